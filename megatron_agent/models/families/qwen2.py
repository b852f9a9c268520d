"""Qwen2 / Qwen2.5: like Llama with a bias on q, k and v."""

from megatron_agent.models.families.common import (
    Family,
    attention,
    dense_mlp,
    embeddings_and_head,
    sliding_window_layers,
)


def rules(hf: dict):
    return embeddings_and_head(hf) + attention(qkv_bias=True, qk_norm=False) + dense_mlp()


# The attention reads no attention_bias: q, k and v always have one, o_proj never.
FAMILY = Family("qwen2", qkv_bias=lambda hf: True, qk_layernorm=False, moe=False, rules=rules,
                sliding_window=sliding_window_layers)
