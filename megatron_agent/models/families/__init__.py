"""Model families: one module each, holding what sets the family apart in the HF config
and its HF <-> Megatron weight table. A new family (Qwen2.5-VL, Qwen3-VL...) is a new
module here plus a line in FAMILIES."""

from __future__ import annotations

from megatron_agent.models.families import llama, qwen2, qwen2_5_vl, qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe
from megatron_agent.models.families.common import Family, Rule, UnsupportedModelError

FAMILIES: dict[str, Family] = {
    m.FAMILY.name: m.FAMILY for m in (llama, qwen2, qwen3, qwen3_moe, qwen2_5_vl, qwen3_vl, qwen3_vl_moe)
}


def family_of(hf: dict) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported families: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "Rule", "UnsupportedModelError", "family_of"]
