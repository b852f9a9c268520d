"""Block-FP8 weights in the layout of SGLang's block-quantized checkpoints (DeepSeek-V3,
Qwen3-FP8): the format both sides of an FP8 weight update share, and the FP8 checkpoint's.

A linear weight W [out, in] travels and is stored as two tensors:

- `<name>.weight`: float8_e4m3fn [out, in], Q = W / s rounded to e4m3, block by block;
- `<name>.weight_scale_inv`: float32 [ceil(out / bn), ceil(in / bk)], s = max |W| over
  the block / 448 (e4m3's largest finite value),

so that W ~= Q * s on every bn x bk block (128 x 128 by default); where out or in is not
a multiple of the block, the last blocks are cut short. A checkpoint says so in its
config.json (`FP8_QUANTIZATION_CONFIG`), which is what makes SGLang build block-FP8
linear layers. The trainer quantizes (megatron_agent/weight_sync/fp8.py picks which
tensors); the embedded engine dequantizes (`Fp8Pairs`). Both live here, so the format is
written once: rollout/ owns the engine side and the trainer may import rollout, not the
reverse.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
# A block of zeros still gets a positive scale (its Q is zero either way).
MIN_SCALE = torch.finfo(torch.float32).tiny


def quantization_config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """config.json's `quantization_config` for a block-FP8 checkpoint (SGLang's Fp8Config)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])]}


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
    """The weight a `<name>.weight_scale_inv` scales (None for any other name)."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(".weight" + SCALE_SUFFIX) else None


def scale_shape(shape, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    out, inp = (int(s) for s in shape)
    return -(-out // block[0]), -(-inp // block[1])


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/bn), ceil(in/bk)]) of a 2-D
    weight, on the weight's device."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    rows, cols = scale_shape(weight.shape, block)
    padded = weight.detach().float()
    if (rows * block[0], cols * block[1]) != (out, inp):  # zeros change no block's max
        padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
        padded[:out, :inp] = weight.detach()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.view(rows * block[0], cols * block[1])[:out, :inp].contiguous(), scale


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q * scale_inv, each scale over its block (the inverse of `quantize_block_fp8` up to e4m3 rounding)."""
    if tuple(scale_inv.shape) != scale_shape(q.shape, block):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(q.shape)} in "
                         f"{block[0]}x{block[1]} blocks (expected {scale_shape(q.shape, block)})")
    out, inp = q.shape
    per_element = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
    return (q.float() * per_element).to(dtype)


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
