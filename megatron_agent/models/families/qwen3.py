"""Qwen3 dense: RMSNorm on q and k (per head), no QKV bias by default."""

from megatron_agent.models.families.common import (
    Family,
    attention,
    dense_mlp,
    embeddings_and_head,
    sliding_window_layers,
)


def qkv_bias(hf: dict) -> bool:
    return bool(hf.get("attention_bias", False))


def rules(hf: dict):
    return embeddings_and_head(hf) + attention(qkv_bias=qkv_bias(hf), qk_norm=True) + dense_mlp()


FAMILY = Family("qwen3", qkv_bias=qkv_bias, qk_layernorm=True, moe=False, rules=rules, attention_bias=True,
                sliding_window=sliding_window_layers)
