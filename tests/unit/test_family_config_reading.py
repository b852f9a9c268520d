"""Every family reads a config the way transformers' model of it does (issue 32): a tiny
config per family with stray, conflicting or missing keys; our Megatron config, model
arguments and bridge dimensions against the transformers model built from the same
config (its parameter shapes, norms, rotary frequencies, tying, router)."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.models import UnsupportedModelError, transformer_config_from_hf
from megatron_agent.models.bridge import Dims
from megatron_agent.models.tiny import VISION_FAMILIES
from megatron_agent.models.transformer_config import gpt_model_kwargs, read_hf_config
from megatron_agent.platform import ParallelConfig

# hidden 96 over 6 heads: 16 per head unless a head_dim says otherwise
TEXT = dict(vocab_size=128, hidden_size=96, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


def vision(family: str) -> dict:
    return dict(VISION_FAMILIES[family]["vision"], out_hidden_size=TEXT["hidden_size"], spatial_merge_size=2,
                temporal_patch_size=2)


CONFIGS = {
    # head_dim honoured (32); use_sliding_window and norm_topk_prob are keys Llama does not read
    "llama": dict(TEXT, model_type="llama", head_dim=32, use_sliding_window=True, norm_topk_prob=True),
    # Qwen2 takes head_dim when given; attention_bias it does not read (q, k, v always biased, o_proj never)
    "qwen2": dict(TEXT, model_type="qwen2", head_dim=32, attention_bias=True, tie_word_embeddings=True),
    # The issue's config: flat, as Qwen2.5-VL is published, head_dim 32 that its attention ignores
    # (hidden / heads = 16); rms_norm_eps and rope_theta missing (the class's 1e-5 and 1e6)
    "qwen2_5_vl": dict(TEXT, model_type="qwen2_5_vl", head_dim=32, attention_bias=True,
                       rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                       vision_config=vision("qwen2_5_vl"), **TOKENS),
    # no head_dim: Qwen3's class default is 128, not hidden / heads; a sliding window that
    # max_window_layers keeps off every layer; mlp_bias it does not read
    "qwen3": dict(TEXT, model_type="qwen3", use_sliding_window=True, max_window_layers=2, mlp_bias=True),
    # head_dim that Qwen3-MoE's class lacks but its attention reads; norm_topk_prob missing (False)
    "qwen3_moe": dict(TEXT, **MOE, model_type="qwen3_moe", head_dim=24),
    # nested, as Qwen3-VL is published; no head_dim: the text class's default 128
    "qwen3_vl": dict(model_type="qwen3_vl", tie_word_embeddings=True, vision_config=vision("qwen3_vl"), **TOKENS,
                     text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                             "mrope_section": [16, 24, 24],
                                                             "mrope_interleaved": True})),
    # no head_dim: derived (16); norm_topk_prob false, which its router does not read (it always renormalises)
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe", vision_config=vision("qwen3_vl_moe"), **TOKENS,
                         text_config=dict(TEXT, **MOE, norm_topk_prob=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                           "mrope_section": [2, 3, 3], "mrope_interleaved": True})),
}


def transformers_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    torch.manual_seed(0)
    return auto.from_config(hf_config)


def language_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_we_read_the_config_as_transformers_does(family):
    config = CONFIGS[family]
    model = transformers_model(config)
    lm = language_model(model)
    hf = read_hf_config(config)
    ours = transformer_config_from_hf(hf, ParallelConfig())
    kwargs = gpt_model_kwargs(hf, ParallelConfig())
    dims = Dims.from_hf(hf, 1)

    attention = lm.layers[0].self_attn
    hidden, head = ours.hidden_size, ours.kv_channels
    assert attention.q_proj.weight.shape == (ours.num_attention_heads * head, hidden)
    assert attention.k_proj.weight.shape == (ours.num_query_groups * head, hidden)
    assert attention.v_proj.weight.shape == (ours.num_query_groups * head, hidden)
    assert attention.o_proj.weight.shape == (hidden, ours.num_attention_heads * head)
    assert (dims.head_dim, dims.num_heads, dims.num_kv_heads) == (head, ours.num_attention_heads,
                                                                   ours.num_query_groups)
    assert (attention.q_proj.bias is not None) == ours.add_qkv_bias and attention.o_proj.bias is None
    assert hasattr(attention, "q_norm") == ours.qk_layernorm
    if ours.qk_layernorm:
        assert attention.q_norm.weight.shape == (head,)
    assert len(lm.layers) == ours.num_layers
    assert lm.norm.variance_epsilon == ours.layernorm_epsilon
    assert lm.embed_tokens.weight.shape == (kwargs["vocab_size"], hidden)
    tied = model.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr()
    assert tied == kwargs["share_embeddings_and_output_weights"]
    # RoPE: Megatron's frequencies from our base over our head width, against the model's own
    ours_inv_freq = 1.0 / kwargs["rotary_base"] ** (torch.arange(0, head, 2, dtype=torch.float) / head)
    torch.testing.assert_close(lm.rotary_emb.inv_freq, ours_inv_freq)

    mlp = lm.layers[0].mlp
    if ours.num_moe_experts:
        experts, router = mlp.experts.gate_up_proj, mlp.gate
        assert experts.shape == (ours.num_moe_experts, 2 * ours.moe_ffn_hidden_size, hidden)
        assert router.top_k == ours.moe_router_topk
        renormalises = getattr(router, "norm_topk_prob", True)  # Qwen3-VL-MoE's router has no switch
        assert renormalises == (not ours.moe_router_pre_softmax)
    else:
        assert mlp.gate_proj.weight.shape == (ours.ffn_hidden_size, hidden) and mlp.gate_proj.bias is None


def test_the_issue_config_reads_head_dim_as_hidden_over_heads():
    hf = read_hf_config(CONFIGS["qwen2_5_vl"])
    assert hf["head_dim"] == 16 and hf["rms_norm_eps"] == 1e-5 and hf["rope_parameters"]["rope_theta"] == 1e6


def test_reading_is_idempotent():
    """Readers further down (bridge, memory model) take read_hf_config's dict, and the
    config builders read it again: the second reading changes nothing."""
    for config in CONFIGS.values():
        once = read_hf_config(config)
        assert read_hf_config(once) == once


@pytest.mark.parametrize("family, key", [("llama", "attention_bias"), ("qwen3", "attention_bias"),
                                         ("qwen3_moe", "attention_bias"), ("llama", "mlp_bias")])
def test_a_bias_transformers_puts_where_megatron_has_none_is_refused(family, key):
    """transformers' Llama and Qwen3 put attention_bias on o_proj too; Megatron-Core has no
    output-projection bias alone. Refused, not built without it."""
    config = dict(CONFIGS[family], **{key: True})
    model = transformers_model(config)
    biased = model.model.layers[0].self_attn.o_proj if key == "attention_bias" else model.model.layers[0].mlp.down_proj
    assert biased.bias is not None
    with pytest.raises(UnsupportedModelError, match=key):
        transformer_config_from_hf(config, ParallelConfig())


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_a_sliding_window_the_model_uses_is_refused(family):
    config = dict(CONFIGS[family], use_sliding_window=True, sliding_window=8, max_window_layers=0)
    lm = language_model(transformers_model(config))
    assert getattr(lm.layers[-1].self_attn, "sliding_window", None) == 8  # transformers slides there
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        transformer_config_from_hf(config, ParallelConfig())
