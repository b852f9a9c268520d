"""Qwen2.5-VL: the Qwen2 language model under multimodal RoPE (chunked sections), and the
HF vision tower (checkpoint names `visual.*`, language model `model.layers.*`, `lm_head`)."""

from megatron_agent.models.families.common import (
    Family,
    attention,
    dense_mlp,
    embeddings_and_head,
    head_dim_from_hidden,
    sliding_window_layers,
    vision_tower,
)


def rules(hf: dict):
    return embeddings_and_head(hf) + attention(qkv_bias=True, qk_norm=False) + dense_mlp() + vision_tower("visual")


FAMILY = Family(
    "qwen2_5_vl", qkv_bias=lambda hf: True, qk_layernorm=False, moe=False, rules=rules,
    head_dim=head_dim_from_hidden, sliding_window=sliding_window_layers,
    vision_tower="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel",
)
