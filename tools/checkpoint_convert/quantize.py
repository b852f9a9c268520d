"""Quantized HF exports with NVIDIA ModelOpt: `megatron-agent-convert mcore-to-hf --quantize fp8|nvfp4`.

The Megatron checkpoint is first written as a plain HF checkpoint (`convert.mcore_to_hf`,
into a temporary directory next to the output); transformers loads it, ModelOpt quantizes
it (fake-quant, calibrated on a few texts) and ModelOpt's unified HF export writes the
checkpoint SGLang's ModelOpt loader reads: `hf_quant_config.json` plus a
`quantization_config` with `quant_method: modelopt` in config.json.

- fp8: ModelOpt's FP8 preset. Every decoder linear layer gets a float8_e4m3fn weight with
  one float32 `weight_scale` per tensor and a static per-tensor `input_scale` (quant_algo
  "FP8"), the only FP8 layout SGLang 0.5.x's `modelopt_fp8` method loads; its static
  input scales are why calibration texts are needed.
- nvfp4: ModelOpt's NVFP4 preset (quant_algo "NVFP4"): E2M1 weights packed two per byte,
  one float8_e4m3fn scale per 16 weights, a float32 `weight_scale_2` and `input_scale` per
  tensor. SGLang serves it on Blackwell GPUs only.

ModelOpt's presets leave the embeddings, lm_head, the norms and the MoE router unquantized.
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import tempfile
from pathlib import Path

import torch

from megatron_agent.models.checkpoint import DTYPES, HF_SIDE_FILES, atomic_directory, hf_config_dtype

log = logging.getLogger(__name__)

SCHEMES = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
EXTRA = "quantize"  # the pyproject extra that installs nvidia-modelopt
DEFAULT_CALIBRATION = Path(__file__).with_name("calibration.jsonl")
CALIBRATION_MAX_TOKENS = 512
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale", ".pre_quant_scale")


def import_modelopt():
    """ModelOpt's quantization and HF export modules, or an error naming the extra to install."""
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError as err:
        raise RuntimeError(f"--quantize needs nvidia-modelopt, which is not installed ({err}): "
                           f"pip install 'megatron-agent[{EXTRA}]'") from err
    return mtq, export_hf_checkpoint


def modelopt_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("nvidia-modelopt")


def quant_config(mtq, scheme: str) -> dict:
    if scheme not in SCHEMES:
        raise ValueError(f"--quantize {scheme!r}; choose one of {sorted(SCHEMES)}")
    config = getattr(mtq, SCHEMES[scheme], None)
    if config is None:
        raise RuntimeError(f"nvidia-modelopt {modelopt_version()} has no {SCHEMES[scheme]}: it cannot export {scheme}")
    return config


def quantization_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def describe_platform(device: str) -> str:
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm{major}{minor}), torch {torch.__version__}"
    return f"CPU ({platform.machine()}), torch {torch.__version__}"


def check_scheme_runs_here(scheme: str) -> None:
    """Quantize one small linear layer with `scheme`, so that a platform ModelOpt cannot
    quantize on fails before anything is converted."""
    mtq, _ = import_modelopt()
    config = quant_config(mtq, scheme)
    device = quantization_device()
    probe = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(device)
    try:
        mtq.quantize(probe, config, forward_loop=lambda m: m(torch.randn(4, 64, device=device)))
    except Exception as err:
        raise RuntimeError(f"nvidia-modelopt {modelopt_version()} cannot quantize to {scheme} on "
                           f"{describe_platform(device)}: {type(err).__name__}: {err}") from err


def calibration_texts(path: str | Path | None) -> list[str]:
    """The calibration samples: one per line of a text file, or the "text" field of each
    line of a .jsonl file (for samples with newlines). Default: a small shipped set."""
    source = Path(path) if path else DEFAULT_CALIBRATION
    if not source.is_file():
        raise FileNotFoundError(f"calibration file {source} does not exist")
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    if source.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{source}:{number}: not JSON ({err})") from err
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{source}:{number}: a .jsonl calibration line needs a string field \"text\"")
            texts.append(record["text"])
    else:
        texts = lines
    if not texts:
        raise ValueError(f"calibration file {source} has no text")
    return texts


def calibration_batches(tokenizer, texts: list[str], max_tokens: int = CALIBRATION_MAX_TOKENS) -> list[torch.Tensor]:
    """One [1, n] tensor of token ids per text (unpadded, so no attention mask is needed)."""
    encoded = (tokenizer(text, truncation=True, max_length=max_tokens, return_tensors="pt").input_ids
               for text in texts)
    return [ids for ids in encoded if ids.numel() > 0]


def checkpoint_dtype(hf_dir: Path) -> torch.dtype:
    config = json.loads((hf_dir / "config.json").read_text())
    declared = hf_config_dtype(config)
    if declared is None and (config.get("dtype") or config.get("torch_dtype")):
        raise ValueError(f"{hf_dir / 'config.json'}: dtype {config.get('dtype') or config.get('torch_dtype')!r}; "
                         f"expected one of {sorted(str(d).removeprefix('torch.') for d in DTYPES.values())}")
    return DTYPES[declared or "fp32"]


def tensor_names(hf_dir: Path) -> set[str]:
    from megatron_agent.models.bridge import SafetensorsCheckpoint

    return set(SafetensorsCheckpoint(hf_dir).file_of)


def check_tensor_names(plain_dir: Path, quantized_dir: Path) -> None:
    """The quantized checkpoint holds the plain one's tensors under the same names, plus scales.
    (ModelOpt renames fused transformers modules back to checkpoint names on a best-effort
    basis; SGLang would silently skip a tensor whose name drifted.)"""
    plain = tensor_names(plain_dir)
    quantized = {n for n in tensor_names(quantized_dir) if not n.endswith(SCALE_SUFFIXES)}
    if plain != quantized:
        missing, extra = sorted(plain - quantized), sorted(quantized - plain)
        raise RuntimeError(f"the quantized export's tensor names differ from the checkpoint's: "
                           f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                           f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The side files (tokenizer, chat template) the export did not write itself."""
    for name in HF_SIDE_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


def quantize_hf_checkpoint(hf_dir: str | Path, out_dir: str | Path, scheme: str, *, texts: list[str],
                           max_shard_bytes: int = 5 * 2**30) -> Path:
    """Quantize an HF checkpoint with ModelOpt and write its unified HF export to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mtq, export_hf_checkpoint = import_modelopt()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = quant_config(mtq, scheme)
    device, dtype = quantization_device(), checkpoint_dtype(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    batches = calibration_batches(AutoTokenizer.from_pretrained(hf_dir), texts)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(ids.to(device))

    log.info("quantizing to %s with nvidia-modelopt %s on %s, calibrated on %d text(s)",
             scheme, modelopt_version(), describe_platform(device), len(batches))
    mtq.quantize(model, config, forward_loop=forward_loop)
    with atomic_directory(out_dir) as tmp:
        export_hf_checkpoint(model, dtype=dtype, export_dir=tmp, max_shard_size=max_shard_bytes)
        copy_tokenizer_files(hf_dir, tmp)
        for written in tmp.iterdir():  # the shards come out owner-only; a server may run as another user
            written.chmod((tmp / "config.json").stat().st_mode & 0o777)
        check_tensor_names(hf_dir, tmp)
        quantization = json.loads((tmp / "hf_quant_config.json").read_text())["quantization"]
    log.info("wrote %s: quant_algo %s, unquantized modules %s", out_dir, quantization["quant_algo"],
             quantization.get("exclude_modules"))
    return out_dir


def mcore_to_quantized_hf(mcore_dir: str | Path, out_dir: str | Path, scheme: str, *, calib: str | Path | None = None,
                          hf_config_dir: str | Path | None = None, dtype: str | None = None,
                          max_shard_bytes: int = 5 * 2**30) -> Path:
    """A Megatron dist checkpoint -> a ModelOpt-quantized HF checkpoint (see the module doc)."""
    from tools.checkpoint_convert import convert

    texts = calibration_texts(calib)
    check_scheme_runs_here(scheme)  # bad input and an unable platform fail before the conversion
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.unquantized-", dir=out_dir.parent) as tmp:
        plain = convert.mcore_to_hf(mcore_dir, Path(tmp) / "hf", hf_config_dir=hf_config_dir, dtype=dtype,
                                    max_shard_bytes=max_shard_bytes)
        return quantize_hf_checkpoint(plain, out_dir, scheme, texts=texts, max_shard_bytes=max_shard_bytes)
