"""Block-FP8 weights in the layout of SGLang's block-quantized checkpoints (DeepSeek-V3,
Qwen3-FP8): the format both sides of an FP8 weight update share, and the FP8 checkpoint's.

A linear weight W [out, in] travels and is stored as two tensors:

- `<name>.weight`: float8_e4m3fn [out, in], Q = W / s rounded to e4m3, block by block;
- `<name>.weight_scale_inv`: float32 [ceil(out / bn), ceil(in / bk)], s = max |W| over
  the block / 448 (e4m3's largest finite value),

so that W ~= Q * s on every bn x bk block (128 x 128 by default); where out or in is not
a multiple of the block, the last blocks are cut short.

A 3-D tensor is a layer's experts fused as Qwen3-VL-MoE's checkpoints hold them
(`experts.gate_up_proj` [E, hidden, 2 * inter], `experts.down_proj` [E, inter, hidden]):
each expert's weight transposed, [E, in, out]. It is quantized per expert in the
[out, in] orientation and travels transposed back, as `<name>` float8_e4m3fn [E, in, out]
and `<name>_scale_inv` float32 [E, ceil(in / bk), ceil(out / bn)]: what SGLang 0.5.23's
Qwen3-VL-MoE loader wants (models/qwen3_vl_moe.py `load_weights` maps `experts.gate_up_proj*`
to `experts.w13_weight*`, transposes the last two dims of weight and scale alike, splits
gate from up along the output rows and loads each expert into Fp8MoEMethod's
`w13_weight` [E, 2I, H] / `w13_weight_scale_inv` [E, 2I/bn, H/bk]).

A checkpoint says so in its config.json (`quantization_config`), which is what makes
SGLang build block-FP8 layers. The trainer quantizes (megatron_agent/weight_sync/fp8.py
picks which tensors); the embedded engine dequantizes (`Fp8Pairs`). Both live here, so the
format is written once: rollout/ owns the engine side and the trainer may import rollout,
not the reverse.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv", "X.experts.down_proj" -> "..._scale_inv"
# A block of zeros still gets a positive scale (its Q is zero either way).
MIN_SCALE = torch.finfo(torch.float32).tiny

# The vision towers' module names: `visual` in SGLang's module prefixes (Qwen2.5-VL
# `visual.*`, built with the quant config; Qwen3-VL `model.visual.*`, built without one in
# 0.5.23) and in the HF names of all three Qwen VL families; the other two as other VLMs
# name theirs.
VISION_MODULES = ("visual", "vision_tower", "vision_model")
# What SGLang must build unquantized: every module the trainer sends in the training dtype
# that SGLang's Fp8Config would otherwise make FP8. Its `from_config` reads this list as
# `modules_to_not_convert` and `is_layer_skipped` (layers/quantization/utils.py) matches an
# entry on dotted module-path boundaries anywhere in a prefix, so `visual` covers
# `visual.blocks.0.attn.qkv_proj` and `mlp.gate` covers the router, not `mlp.gate_up_proj`.
# lm_head, embed_tokens and the MoE router are unquantized in SGLang 0.5.23 anyway
# (embeddings get no FP8 method; Qwen3-MoE builds its gate without the FP8 config): listed
# so that they stay so wherever a version would quantize them.
NOT_CONVERTED_MODULES = ("lm_head", "embed_tokens", "mlp.gate", *VISION_MODULES)


def quantization_config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """config.json's `quantization_config` for a block-FP8 checkpoint (SGLang's Fp8Config)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])],
            "modules_to_not_convert": list(NOT_CONVERTED_MODULES)}


def fp8_block_size(quant) -> tuple[int, int] | None:
    """The block of a config.json `quantization_config` that is block FP8 (else None)."""
    quant = quant.to_dict() if hasattr(quant, "to_dict") else quant
    if not quant or quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
        return None
    block = quant["weight_block_size"]
    return int(block[0]), int(block[1])


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def weight_name_of(name: str) -> str | None:
    """The weight a `<name>_scale_inv` scales (None for any other name)."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def _linear_blocks(shape, block: tuple[int, int]) -> tuple[int, int]:
    out, inp = (int(s) for s in shape)
    return -(-out // block[0]), -(-inp // block[1])


def scale_shape(shape, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, ...]:
    """The scale's shape for a weight of `shape`: [out, in] -> [ceil(out/bn), ceil(in/bk)];
    fused experts [E, in, out] -> [E, ceil(in/bk), ceil(out/bn)] (module docstring)."""
    if len(shape) == 2:
        return _linear_blocks(shape, block)
    if len(shape) == 3:
        experts, inp, out = (int(s) for s in shape)
        rows, cols = _linear_blocks((out, inp), block)
        return experts, cols, rows
    raise ValueError(f"block FP8 needs a 2-D weight or 3-D fused experts, got shape {tuple(shape)}")


def _quantize_linear(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = weight.shape
    rows, cols = _linear_blocks(weight.shape, block)
    padded = weight.detach().float()
    if (rows * block[0], cols * block[1]) != (out, inp):  # zeros change no block's max
        padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
        padded[:out, :inp] = weight.detach()
    blocks = padded.reshape(rows, block[0], cols, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(rows * block[0], cols * block[1])[:out, :inp].contiguous(), scale


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn, scale_inv float32) of a weight, on the weight's device: [out, in]
    -> Q [out, in], scale_inv [ceil(out/bn), ceil(in/bk)]; fused experts [E, in, out] -> Q
    [E, in, out], scale_inv [E, ceil(in/bk), ceil(out/bn)], blocks over each expert's
    [out, in] (module docstring)."""
    shape = scale_shape(weight.shape, block)
    if weight.dim() == 2:
        return _quantize_linear(weight, block)
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(shape, dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):  # one expert in float32 at a time, not the whole layer
        q_e, scale_e = _quantize_linear(weight[e].T, block)
        q[e].copy_(q_e.T)
        scale[e].copy_(scale_e.T)
    return q, scale


def _dequantize_linear(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype) -> torch.Tensor:
    out, inp = q.shape
    per_element = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
    return (q.float() * per_element).to(dtype)


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q * scale_inv, each scale over its block (the inverse of `quantize_block_fp8` up to e4m3 rounding)."""
    if tuple(scale_inv.shape) != scale_shape(q.shape, block):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(q.shape)} in "
                         f"{block[0]}x{block[1]} blocks (expected {scale_shape(q.shape, block)})")
    if q.dim() == 2:
        return _dequantize_linear(q, scale_inv, block, dtype)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for e in range(q.shape[0]):
        out[e].copy_(_dequantize_linear(q[e].T, scale_inv[e].T, block, dtype).T)
    return out


class Fp8Pairs:
    """The engine's receiving side: each FP8 weight and its scale may arrive in different
    calls of one update; `take` passes other tensors through and gives each FP8 weight,
    dequantized, once both halves are in."""

    def __init__(self, block: tuple[int, int] = DEFAULT_BLOCK):
        self.block = block
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> {"q"?, "scale"?}

    @staticmethod
    def carries_fp8(names: list[str], dtypes: list[torch.dtype]) -> bool:
        return any(d == FP8_DTYPE for d in dtypes) or any(weight_name_of(n) for n in names)

    def take(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        ready = []
        for name, tensor in named:
            base = weight_name_of(name)
            if base is None and tensor.dtype != FP8_DTYPE:
                ready.append((name, tensor))
                continue
            halves = self.waiting.setdefault(base or name, {})
            halves["scale" if base else "q"] = tensor.clone()  # the caller's memory may be reused
            if len(halves) == 2:
                del self.waiting[base or name]
                ready.append((base or name, dequantize_block_fp8(halves["q"], halves["scale"], self.block)))
        return ready

    def unpaired(self) -> list[str]:
        """Names still waiting for their other half (an update must end with none)."""
        return [scale_name(n) if "q" in h else n for n, h in self.waiting.items()]

    def clear(self) -> None:
        self.waiting.clear()
