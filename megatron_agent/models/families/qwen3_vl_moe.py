"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-VL with the Qwen3-MoE block; experts
stored fused per layer, and the router always renormalises its top-k weights."""

from megatron_agent.models.families.common import (
    Family,
    UnsupportedModelError,
    attention,
    embeddings_and_head,
    fused_moe_mlp,
    vision_tower,
)
from megatron_agent.models.families.qwen3_vl import LM, qkv_bias


def rules(hf: dict):
    if hf.get("mlp_only_layers") or (hf.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError("Qwen3-VL-MoE weights with dense MLP layers (mlp_only_layers) are not supported")
    return (embeddings_and_head(hf, LM) + attention(qkv_bias=qkv_bias(hf), qk_norm=True, prefix=LM)
            + fused_moe_mlp(LM) + vision_tower("model.visual"))


FAMILY = Family(
    "qwen3_vl_moe", qkv_bias=qkv_bias, qk_layernorm=True, moe=True, rules=rules, attention_bias=True,
    vision_tower="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel",
    mrope_interleaved=True, norm_topk_prob=True,
)
