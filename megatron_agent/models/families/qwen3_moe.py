"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention, routed experts, no shared expert."""

from megatron_agent.models.families.common import (
    Family,
    UnsupportedModelError,
    attention,
    embeddings_and_head,
    moe_mlp,
    sliding_window_everywhere,
)


def qkv_bias(hf: dict) -> bool:
    return bool(hf.get("attention_bias", False))


def rules(hf: dict):
    if hf.get("mlp_only_layers") or (hf.get("decoder_sparse_step") or 1) != 1:
        # The table would need dense-MLP rules for those layers; no released Qwen3-MoE uses them.
        raise UnsupportedModelError("Qwen3-MoE weights with dense MLP layers (mlp_only_layers) are not supported")
    return embeddings_and_head(hf) + attention(qkv_bias=qkv_bias(hf), qk_norm=True) + moe_mlp()


FAMILY = Family("qwen3_moe", qkv_bias=qkv_bias, qk_layernorm=True, moe=True, rules=rules, attention_bias=True,
                sliding_window=sliding_window_everywhere)
