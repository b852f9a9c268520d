"""Qwen3-VL dense: the Qwen3 language model under interleaved multimodal RoPE, deepstack
(features of some vision layers added at the image tokens after the first LM layers), and
the HF vision tower (checkpoint names `model.visual.*`, `model.language_model.*`)."""

from megatron_agent.models.families.common import (
    Family,
    attention,
    dense_mlp,
    embeddings_and_head,
    vision_tower,
)

LM = "model.language_model"


def qkv_bias(hf: dict) -> bool:
    return bool(hf.get("attention_bias", False))


def rules(hf: dict):
    return (embeddings_and_head(hf, LM) + attention(qkv_bias=qkv_bias(hf), qk_norm=True, prefix=LM)
            + dense_mlp(LM) + vision_tower("model.visual"))


FAMILY = Family(
    "qwen3_vl", qkv_bias=qkv_bias, qk_layernorm=True, moe=False, rules=rules, attention_bias=True,
    vision_tower="transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel", mrope_interleaved=True,
)
