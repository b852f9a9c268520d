"""`megatron-agent-convert mcore-to-hf --quantize`: ModelOpt's FP8 and NVFP4 exports of tiny
models, on the CPU (ModelOpt fake-quantizes there and its HF export packs the real formats).

transformers cannot load these checkpoints (it has no `modelopt` quantizer: it skips the
quantization config and reads the FP8 codes as if they were weights), and SGLang 0.5.23 on
CPU stops after loading them (its FP8 post-processing calls a CUDA kernel). So the tests
check the files SGLang's ModelOpt loader reads: dtypes, shapes, scales, the quantization
config (also through SGLang's own parser, in its venv), every dequantized weight within its
format's rounding bound of the original, and the logits of the W8A8 computation SGLang does
on a GPU, emulated here in float32.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_checkpoint_convert import convert, hf_tensors

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
E4M3_MAX = 448.0
# E2M1 codes: bit 3 the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP32_SLACK = 1 + 1e-5  # float32 rounding of the division by the scale and of the product back
# A few of the shipped calibration texts: ModelOpt's fake-quant forward is slow on CPU.
CALIBRATION = ["Think step by step, then give your next action inside <action></action>.",
               "You arrive at countertop 1. On the countertop 1, you see a bread, a mug 2 and a saltshaker.",
               "Solve for x: 4x - 7 = 2x + 9. Subtract 2x from both sides to get 2x - 7 = 9, so x = 8.",
               "<answer>1969, Neil Armstrong</answer>"]


def quantized_modules(tensors: dict) -> list[str]:
    return sorted(name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale"))


def fp8_error_bound(original: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn has 3 mantissa bits: a normal x (|x| >= 2^-6) rounds to within half a unit
    in the last place, 2^-4 * 2^floor(log2|x|) <= 2^-4 |x|; below 2^-6 (subnormals) the step
    is 2^-9, so the error is at most 2^-10. With x = w / scale, in weight units:
    |w - dequantized| <= max(2^-4 |w|, 2^-10 scale)."""
    return torch.maximum(original.float().abs() * 2**-4, scale * 2**-10) * FP32_SLACK


def check_fp8_weights(original: dict, exported: dict) -> int:
    """Every quantized weight: float8_e4m3fn with float32 per-tensor scales, within the bound."""
    modules = quantized_modules(exported)
    for module in modules:
        weight, scale = exported[f"{module}.weight"], exported[f"{module}.weight_scale"]
        input_scale = exported[f"{module}.input_scale"]
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == original[f"{module}.weight"].shape
        assert scale.dtype == input_scale.dtype == torch.float32 and scale.numel() == input_scale.numel() == 1
        assert float(input_scale) > 0 and torch.isfinite(input_scale)
        w = original[f"{module}.weight"].float()
        assert float(scale) >= float(w.abs().max()) / E4M3_MAX * (1 - 1e-6)  # no weight saturates
        error = (w - weight.float() * scale).abs()
        assert (error <= fp8_error_bound(w, scale)).all(), f"{module}: {float(error.max())}"
    return len(modules)


def check_unquantized_tensors(original: dict, exported: dict, modules: list[str]) -> None:
    """Everything else (embeddings, norms, router, lm_head) exactly as it was."""
    quantized_weights = {f"{m}.weight" for m in modules}
    for name, tensor in original.items():
        if name not in quantized_weights:
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def emulated_w8a8_logits(model_dir, exported: dict, ids: torch.Tensor) -> torch.Tensor:
    """The logits of what SGLang's modelopt_fp8 linear computes on a GPU: weights dequantized
    from FP8, inputs rounded to FP8 with their static per-tensor input_scale (saturating)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = dict(model.named_modules())
    for module in quantized_modules(exported):
        layer = layers[module]
        layer.weight.data.copy_(exported[f"{module}.weight"].float() * exported[f"{module}.weight_scale"])
        input_scale = exported[f"{module}.input_scale"]

        def fp8_inputs(_, args, s=input_scale):
            x = args[0]
            return ((x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s,)

        layer.register_forward_pre_hook(fp8_inputs)
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def fp8_export(tiny_model_dir, tmp_path_factory):
    """hf-to-mcore (fp32), then mcore-to-hf --quantize fp8 in several shards, through the CLI."""
    src = tiny_model_dir("qwen3")
    work = tmp_path_factory.mktemp("quantized-export")
    (work / "calib.txt").write_text("\n".join(CALIBRATION) + "\n")
    out = convert("hf-to-mcore", "--hf", str(src), "--out", str(work / "mcore"), "--dtype", "fp32")
    assert out.returncode == 0, out.stderr
    out = convert("mcore-to-hf", "--mcore", str(work / "mcore"), "--out", str(work / "fp8"), "--quantize", "fp8",
                  "--calib", str(work / "calib.txt"), "--max-shard-size", "200KB")
    assert out.returncode == 0, out.stderr
    assert "calibrated on 4 text(s)" in out.stderr
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # the unquantized temporary is gone
    return src, work / "fp8"


@pytest.mark.slow
@pytest.mark.xdist_group("quantized_export")
def test_fp8_export_is_modelopt_format(fp8_export):
    from transformers import AutoTokenizer

    src, out = fp8_export
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert hf_quant["quantization"]["quant_algo"] == "FP8" and not hf_quant["quantization"]["kv_cache_quant_algo"]
    assert set(hf_quant["quantization"]["exclude_modules"]) == {"lm_head", "model.embed_tokens"}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    assert config["tie_word_embeddings"] and config["dtype"] == "float32"
    assert (out / "model.safetensors.index.json").exists()  # several shards at 200KB
    assert AutoTokenizer.from_pretrained(out).chat_template
    assert all(p.stat().st_mode & stat.S_IROTH for p in out.iterdir())

    original, exported = hf_tensors(src), hf_tensors(out)
    modules = quantized_modules(exported)
    assert modules == sorted(f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in PROJECTIONS)
    assert check_fp8_weights(original, exported) == len(modules)
    check_unquantized_tensors(original, exported, modules)
    assert set(exported) == set(original) | {f"{m}.{s}" for m in modules for s in ("weight_scale", "input_scale")}


@pytest.mark.slow
@pytest.mark.xdist_group("quantized_export")
def test_fp8_export_computes_what_the_model_computes(fp8_export):
    from transformers import AutoModelForCausalLM

    src, out = fp8_export
    ids = torch.randint(0, 800, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    logits = emulated_w8a8_logits(src, hf_tensors(out), ids)
    gap = (logits.log_softmax(-1) - reference.log_softmax(-1)).abs().max()
    assert float(gap) < 0.2  # ~0.05 seen: FP8 weights and activations, 4 layers
    assert torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0) > 0.99


SGLANG_READS_CONFIG = """
import json, sys
from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config
out = sys.argv[1]
layers = ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
          "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
forms = {"hf_quant_config.json": json.load(open(out + "/hf_quant_config.json")),
         "config.json": json.load(open(out + "/config.json"))["quantization_config"]}
seen = {}
for form, raw in forms.items():
    config = ModelOptFp8Config.from_config(raw)
    seen[form] = [config.get_name(), config.is_checkpoint_fp8_serialized,
                  [layer for layer in layers if config.is_layer_excluded(layer)]]
from sglang.srt.configs.model_config import ModelConfig
seen["method"] = ModelConfig(out).quantization  # what the server picks with no --quantization
print(json.dumps(seen))
"""


@pytest.mark.slow
@pytest.mark.xdist_group("quantized_export")
def test_sglang_reads_the_fp8_config(fp8_export):
    """SGLang 0.5.23's own parser, from its venv (serving FP8 needs a GPU): both forms of the
    config select its modelopt_fp8 method, which leaves lm_head and the embeddings alone and
    quantizes the fused attention and MLP layers it builds."""
    from rollout.engine_launch import sglang_cpu_environment, sglang_cpu_python

    python = sglang_cpu_python()
    if python is None or not Path(python).exists():
        pytest.fail(f"no SGLang venv ({python}): `make test` installs it")
    result = subprocess.run([python, "-c", SGLANG_READS_CONFIG, str(fp8_export[1])], env=sglang_cpu_environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    fp8_with_exclusions = ["modelopt_fp8", True, ["lm_head", "model.embed_tokens"]]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "hf_quant_config.json": fp8_with_exclusions, "config.json": fp8_with_exclusions, "method": "modelopt_fp8"}


def test_moe_fp8_export_keeps_the_router(tmp_path):
    """Qwen3-MoE in bf16, quantized from its HF checkpoint (the step after mcore_to_hf): one
    FP8 weight and scale per expert projection, gate and up sharing theirs (SGLang fuses
    them); the router and the norms stay bf16."""
    from megatron_agent.models.tiny import write_tiny_model
    from megatron_agent.models.transformer_config import num_experts
    from tools.checkpoint_convert import quantize

    src = write_tiny_model("qwen3_moe", tmp_path / "moe", seed=0, dtype=torch.bfloat16, num_hidden_layers=2)
    out = quantize.quantize_hf_checkpoint(src, tmp_path / "fp8", "fp8", texts=CALIBRATION[:2])
    original, exported = hf_tensors(src), hf_tensors(out)
    config = json.loads((src / "config.json").read_text())
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(config["num_hidden_layers"])
               for e in range(num_experts(config)) for p in ("gate_proj", "up_proj", "down_proj")]
    attention = [f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in PROJECTIONS[:4]]
    assert quantized_modules(exported) == sorted(experts + attention)
    check_fp8_weights(original, exported)
    check_unquantized_tensors(original, exported, quantized_modules(exported))
    for expert in experts[::3]:
        gate, up = expert, expert.replace("gate_proj", "up_proj")
        assert torch.equal(exported[f"{gate}.weight_scale"], exported[f"{up}.weight_scale"])
    assert exported["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    excluded = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert {f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])} <= set(excluded)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes a byte, the low nibble first."""
    pairs = torch.stack([E2M1_VALUES[(packed & 0xF).long()], E2M1_VALUES[(packed >> 4).long()]], dim=-1)
    return pairs.flatten(-2)


def test_nvfp4_export(tiny_model_dir, tmp_path):
    from tools.checkpoint_convert import quantize

    src = tiny_model_dir("qwen3")
    out = quantize.quantize_hf_checkpoint(src, tmp_path / "nvfp4", "nvfp4", texts=CALIBRATION)
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    original, exported = hf_tensors(src), hf_tensors(out)
    modules = quantized_modules(exported)
    assert len(modules) == 7 * json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for module in modules:
        w = original[f"{module}.weight"]
        packed, block_scale = exported[f"{module}.weight"], exported[f"{module}.weight_scale"]
        global_scale = exported[f"{module}.weight_scale_2"]
        assert packed.dtype == torch.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
        assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (w.shape[0], w.shape[1] // 16)
        assert global_scale.dtype == exported[f"{module}.input_scale"].dtype == torch.float32
        scale = block_scale.float().repeat_interleave(16, dim=-1) * global_scale
        # E2M1 (1 mantissa bit) rounds x = w / scale to within 2^-2 |x| for |x| >= 0.5 (its
        # largest half-step, 1 between 4 and 6, is |x|/4 there) and to within 0.25 below 0.5;
        # a value over 6 (the block scale rounded down to FP8) saturates within |x|/4 too.
        bound = torch.maximum(w.abs(), scale) / 4 * FP32_SLACK
        assert ((w - unpack_e2m1(packed) * scale).abs() <= bound).all(), module
    check_unquantized_tensors(original, exported, modules)


def test_the_shipped_calibration_texts():
    from tools.checkpoint_convert import quantize

    texts = quantize.calibration_texts(None)
    assert len(texts) >= 32 and all(t.strip() for t in texts) and any("\n" in t for t in texts)  # .jsonl: multi-line samples


def test_errors_name_the_cause(tmp_path, monkeypatch, capsys):
    """Each fails before any conversion starts: nothing is written."""
    import modelopt.torch.quantization as mtq

    from tools.checkpoint_convert.cli import main

    def run(*extra):
        code = main(["mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "out"), *extra])
        return code, capsys.readouterr().err

    code, err = run("--quantize", "fp8", "--calib", str(tmp_path / "absent.txt"))
    assert code == 2 and "calibration file" in err and "absent.txt" in err

    (tmp_path / "calib.jsonl").write_text('{"prompt": "no text field"}\n')
    code, err = run("--quantize", "fp8", "--calib", str(tmp_path / "calib.jsonl"))
    assert code == 2 and 'needs a string field "text"' in err

    def unable(*args, **kwargs):
        raise NotImplementedError("no E2M1 kernel for this device")

    monkeypatch.setattr(mtq, "quantize", unable)
    code, err = run("--quantize", "nvfp4")
    assert code == 2 and "cannot quantize to nvfp4 on CPU" in err and "no E2M1 kernel" in err
    monkeypatch.undo()

    for name in [m for m in sys.modules if m == "modelopt" or m.startswith("modelopt.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    code, err = run("--quantize", "fp8")
    assert code == 2 and "pip install 'megatron-agent[quantize]'" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
