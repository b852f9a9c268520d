"""HF config -> Megatron config, family by family, checked field by field."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.models import UnsupportedModelError, padded_vocab_size, transformer_config_from_hf
from megatron_agent.models.tiny import hf_config_for
from megatron_agent.models.transformer_config import gpt_model_kwargs, moe_layer_pattern, rope_settings
from megatron_agent.platform import ParallelConfig


def hf(family, **overrides):
    return dict(hf_config_for(family, "tiny", **overrides), model_type=family)


@pytest.mark.parametrize(
    "family, qkv_bias, qk_norm, moe",
    [("llama", False, False, False), ("qwen2", True, False, False),
     ("qwen3", False, True, False), ("qwen3_moe", False, True, True)],
)
def test_family_features(family, qkv_bias, qk_norm, moe):
    config = transformer_config_from_hf(hf(family), ParallelConfig())
    assert config.add_qkv_bias is qkv_bias
    assert config.qk_layernorm is qk_norm
    assert (config.num_moe_experts == 4) is moe
    assert config.normalization == "RMSNorm" and config.gated_linear_unit
    assert config.num_query_groups == 2 and config.kv_channels == 16
    assert config.hidden_dropout == 0.0 and config.attention_dropout == 0.0


def test_llama_attention_bias_is_refused():
    """transformers' Llama puts `attention_bias` on o_proj too, which Megatron-Core cannot add
    alone (add_bias_linear covers every linear): refused, not silently dropped."""
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        transformer_config_from_hf(hf("llama", attention_bias=True), ParallelConfig())


def test_moe_router_matches_qwen_semantics():
    # norm_topk_prob renormalises the top-k of a softmax == softmax over the top-k logits.
    normed = transformer_config_from_hf(hf("qwen3_moe", norm_topk_prob=True), ParallelConfig())
    assert normed.moe_router_pre_softmax is False and normed.moe_router_topk == 2
    raw = transformer_config_from_hf(hf("qwen3_moe", norm_topk_prob=False), ParallelConfig())
    assert raw.moe_router_pre_softmax is True
    assert normed.moe_router_load_balancing_type == "none" and normed.moe_aux_loss_coeff == 0.0
    assert normed.moe_ffn_hidden_size == 64


def test_moe_layer_pattern():
    assert moe_layer_pattern({"num_hidden_layers": 4}) == 1
    assert moe_layer_pattern({"num_hidden_layers": 4, "mlp_only_layers": [0]}) == [0, 1, 1, 1]
    assert moe_layer_pattern({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == [0, 1, 0, 1]


def test_rope_from_both_config_generations():
    assert rope_settings({"rope_theta": 5e5}).base == 5e5  # transformers 4.x
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).base == 1e6
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert rope_settings({"rope_theta": 5e5, "rope_scaling": llama31}).llama3_scaling_factor == 8.0
    assert rope_settings({"rope_parameters": dict(llama31, rope_theta=5e5)}).llama3_scaling_factor == 8.0
    assert rope_settings({"rope_scaling": {"type": "linear", "factor": 2.0}}).linear_factor == 2.0
    with pytest.raises(UnsupportedModelError, match="low_freq_factor=2.0"):
        rope_settings({"rope_scaling": dict(llama31, low_freq_factor=2.0)})
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        rope_settings({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_model_kwargs():
    kwargs = gpt_model_kwargs(hf("qwen3", vocab_size=805, tie_word_embeddings=True), ParallelConfig(tp=2))
    assert kwargs["vocab_size"] == 806 and kwargs["share_embeddings_and_output_weights"]
    assert kwargs["position_embedding_type"] == "rope" and kwargs["rotary_base"] == 10000.0


@pytest.mark.parametrize("vocab, tp, padded", [(805, 1, 805), (805, 2, 806), (151936, 8, 151936), (7, 4, 8)])
def test_vocab_padding_is_minimal(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded


def test_unsupported_inputs_are_named():
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2' is not supported"):
        transformer_config_from_hf({"model_type": "gpt2"}, ParallelConfig())
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        transformer_config_from_hf(hf("llama", hidden_act="gelu"), ParallelConfig())
    with pytest.raises(ValueError, match="fp8_recipe='e5m2'"):
        transformer_config_from_hf(hf("qwen3"), ParallelConfig(), fp8_recipe="e5m2")


def test_dtype_flags():
    config = transformer_config_from_hf(hf("qwen3"), ParallelConfig(), params_dtype=torch.bfloat16)
    assert config.bf16 and not config.fp16 and config.params_dtype == torch.bfloat16
