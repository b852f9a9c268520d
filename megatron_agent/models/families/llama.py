"""Llama 2/3/3.1: GQA, optional attention bias, SwiGLU, llama3 rope scaling, untied head."""

from megatron_agent.models.families.common import Family, attention, dense_mlp, embeddings_and_head


def qkv_bias(hf: dict) -> bool:
    return bool(hf.get("attention_bias", False))


def rules(hf: dict):
    return embeddings_and_head(hf) + attention(qkv_bias=qkv_bias(hf), qk_norm=False) + dense_mlp()


FAMILY = Family("llama", qkv_bias=qkv_bias, qk_layernorm=False, moe=False, rules=rules, attention_bias=True,
                mlp_bias=True)
