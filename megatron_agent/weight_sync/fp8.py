"""FP8 rollout weights, the trainer's side (`weight_sync.quantize: fp8`): which of the
actor's HF tensors the engines get as block FP8, the FP8 checkpoint they start from, and
what SGLang's block-FP8 layers require of a model's shapes.

The format (float8_e4m3fn weight + float32 `*_scale_inv` per 128x128 block; fused experts
[E, in, out] with their scale in the same orientation) is rollout/fp8_blocks.py's, shared
with the embedded engine that dequantizes it. Only the linear weights of attention and of
the MLP / experts are quantized (per expert, or Qwen3-VL-MoE's fused `experts.gate_up_proj`
and `experts.down_proj`); embeddings, lm_head, norms, biases, the MoE router and any vision
tower stay in the training dtype, and the checkpoint's config names them
(`modules_to_not_convert`) so that SGLang builds them unquantized too.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from rollout.fp8_blocks import (
    DEFAULT_BLOCK,
    VISION_MODULES,
    quantization_config,
    quantize_block_fp8,
    scale_name,
)

QUANTIZE_MODES = ("fp8",)  # weight_sync.quantize; None: the training dtype
# With FP8 rollouts the engine's policy differs from the trainer's: truncated importance
# sampling corrects for it when no other rollout correction is set (run_config resolves it).
FP8_DEFAULT_TIS_CAP = 2.0

_QUANTIZED_LINEAR = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn|mlp)\.((experts\.\d+|shared_experts?)\.)?(q|k|v|o|gate|up|down)_proj\.weight$")
# A layer's experts in one [E, in, out] tensor each (Qwen3-VL-MoE's checkpoints).
_FUSED_EXPERTS = re.compile(r"(^|\.)layers\.\d+\.mlp\.experts\.(gate_up|down)_proj$")
_VISION = re.compile(rf"(^|\.)({'|'.join(VISION_MODULES)})\.")
SOURCE_FILE = "fp8_source.json"  # in an FP8 checkpoint written here: what it was made from
# Raised when what `write_fp8_checkpoint` writes changes, so that one written before is
# made again (2: fused experts quantized, `modules_to_not_convert`).
FORMAT_VERSION = 2
# Families whose SGLang (0.5.23) model class loads no block-FP8 scale: its loader renames
# `weight_scale_inv` to the per-tensor `weight_scale`, which block-FP8 layers do not have
# (models/llama.py `_legacy_load_weights`, and the v2 loader's remap in
# model_loader/auto_loader.py), so every scale keeps its fill value.
SGLANG_DROPS_BLOCK_SCALES = {"llama": "LlamaForCausalLM"}


def is_fused_experts(name: str) -> bool:
    """A decoder layer's experts fused in one tensor (HF name)."""
    return bool(_FUSED_EXPERTS.search(name)) and not _VISION.search(name)


def is_quantized_linear(name: str) -> bool:
    """A decoder layer's attention or MLP / expert projection weight (HF name), fused
    experts included."""
    return (bool(_QUANTIZED_LINEAR.search(name)) and not _VISION.search(name)) or is_fused_experts(name)


def quantize_named(name: str, tensor: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                   ) -> list[tuple[str, torch.Tensor]]:
    """What goes to the engines for one exported tensor: the FP8 weight and its scale, or
    the tensor itself. Fused experts must come in the published layout, [E, in, out]."""
    if not is_quantized_linear(name):
        return [(name, tensor)]
    rank = 3 if is_fused_experts(name) else 2
    if tensor.dim() != rank:
        raise ValueError(f"{name}: block FP8 takes a {rank}-D tensor here, got shape {tuple(tensor.shape)}")
    q, scale_inv = quantize_block_fp8(tensor, block)
    return [(name, q), (scale_name(name), scale_inv)]


def _published_layout(hf: dict) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A checkpoint tensor as SGLang reads it: fused experts in the published layout
    (gate_up_proj [E, H, 2I], down_proj [E, I, H]), whichever of the two layouts the
    checkpoint holds (models/bridge.py); every other tensor as it is."""
    from megatron_agent.models.bridge import Dims, fused_experts_in_megatron_layout
    from megatron_agent.models.families.common import COLS, GATE_UP_ROWS

    def published(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not is_fused_experts(name):
            return tensor
        split = GATE_UP_ROWS if name.endswith("gate_up_proj") else COLS
        return fused_experts_in_megatron_layout(tensor, split, Dims.from_hf(hf, 1), name).transpose(1, 2)

    return published


def write_fp8_checkpoint(src_dir: str | Path, dst_dir: str | Path, block: tuple[int, int] = DEFAULT_BLOCK) -> Path:
    """An HF model directory with the weights `quantize_named` would send, and config.json
    declaring block FP8 (what the engines load at start in fp8 mode). Shard by shard; the
    other files are copied. Skipped when `dst_dir` was already made from `src_dir` with
    this format (`FORMAT_VERSION`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_agent.models.checkpoint import atomic_directory
    from megatron_agent.models.transformer_config import read_hf_config

    src, dst = Path(src_dir).resolve(), Path(dst_dir)
    source = {"source": str(src), "weight_block_size": list(block), "format": FORMAT_VERSION}
    if (dst / SOURCE_FILE).is_file() and json.loads((dst / SOURCE_FILE).read_text()) == source:
        return dst
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{src} has no *.safetensors weights to quantize")
    published = _published_layout(read_hf_config(src))
    with atomic_directory(dst) as tmp:
        weight_map = {}
        for shard in shards:
            out = {}
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    out.update(quantize_named(name, published(name, f.get_tensor(name)), block))
            save_file(out, str(tmp / shard.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, shard.name))
        for path in src.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", SOURCE_FILE):
                shutil.copy2(path, tmp / path.name)
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config(block)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        index = tmp / "model.safetensors.index.json"
        if index.is_file():
            meta = json.loads(index.read_text())
            meta["weight_map"] = weight_map
            index.write_text(json.dumps(meta, indent=2))
        (tmp / SOURCE_FILE).write_text(json.dumps(source))
    return dst


def sglang_fp8_problems(hf: dict, engine_tp: int, *, engine_ep: int = 1, block: tuple[int, int] = DEFAULT_BLOCK
                        ) -> list[str]:
    """Why SGLang (0.5.23) would refuse to build this model's block-FP8 layers at tensor
    parallel size `engine_tp`, or load their scales (empty: it would). Its checks
    (Fp8LinearMethod, Fp8MoEMethod): every output part of a merged layer (q/k/v, gate/up),
    and at TP > 1 every column-parallel output and row-parallel input shard, is a multiple
    of the block; and `SGLANG_DROPS_BLOCK_SCALES`."""
    from megatron_agent.models.transformer_config import num_experts

    bn, bk = block
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    outputs = {"q_proj output": heads * head_dim // engine_tp,
               "k_proj/v_proj output": max(1, kv_heads // engine_tp) * head_dim}
    inputs = {"o_proj input": heads * head_dim // engine_tp} if engine_tp > 1 else {}
    if num_experts(hf):  # num_experts, or num_local_experts as transformers 5 writes Qwen3-VL-MoE's
        moe_tp = max(1, engine_tp // engine_ep)  # SGLang's expert TP: its TP over its EP
        outputs["experts' gate_proj/up_proj output"] = hf["moe_intermediate_size"] // moe_tp
        if moe_tp > 1:
            inputs["experts' down_proj input"] = hf["moe_intermediate_size"] // moe_tp
    else:
        outputs["gate_proj/up_proj output"] = hf["intermediate_size"] // engine_tp
        if engine_tp > 1:
            inputs["down_proj input"] = hf["intermediate_size"] // engine_tp
    dropped = SGLANG_DROPS_BLOCK_SCALES.get(hf.get("model_type"))
    return ([f"{what} per engine TP rank = {size}, not a multiple of {bn}" for what, size in outputs.items()
             if size % bn]
            + [f"{what} per engine TP rank = {size}, not a multiple of {bk}" for what, size in inputs.items()
               if size % bk]
            + ([f"SGLang's {dropped} loads no block-FP8 scale (it renames weight_scale_inv to weight_scale)"]
               if dropped else []))
