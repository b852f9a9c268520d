"""Block-FP8 rollout weights: the format (rollout/fp8_blocks.py) against a hand-computed
example and e4m3's error bound, which tensors the trainer quantizes, the FP8 checkpoint,
the engine's pairing of weights and scales, and the config rules (fp8.py, run_config)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_agent.weight_sync.fp8 import is_quantized_linear, sglang_fp8_problems, write_fp8_checkpoint
from rollout.fp8_blocks import FP8_DTYPE, Fp8Pairs, dequantize_block_fp8, quantize_block_fp8

BLOCK = (2, 2)


def test_a_hand_computed_example_with_edge_blocks_cut_short():
    # 3x3 in 2x2 blocks: scales [ceil(3/2), ceil(3/2)] = [2, 2]; the last row and column
    # are blocks of their own, cut short.
    w = torch.tensor([[448.0, -3.3, 2.0],
                      [0.1, 17.5, -0.5],
                      [-896.0, 1.0, 0.0]])
    q, scale_inv = quantize_block_fp8(w, BLOCK)
    assert q.dtype == FP8_DTYPE and q.shape == (3, 3)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 2)
    # scale = max |w| of the block / 448
    assert scale_inv[0, 0] == 1.0  # max 448
    assert scale_inv[0, 1] == pytest.approx(2.0 / 448)  # max |2|, |-0.5|
    assert scale_inv[1, 0] == 2.0  # max 896
    assert 0 < scale_inv[1, 1] < 1e-30  # a block of zeros still gets a positive scale
    # e4m3 (3 mantissa bits): in [2, 4) the step is 0.25, in [16, 32) 2, in [2^-4, 2^-3) 2^-7
    expected_q = torch.tensor([[448.0, -3.25, 448.0],     # -3.3 -> -3.25; 2 / (2/448) = 448
                               [0.1015625, 18.0, -112.0],  # 0.1 -> 13 * 2^-7; 17.5 -> 18; -0.5 / (2/448)
                               [-448.0, 0.5, 0.0]])        # / 2
    assert torch.equal(q.float(), expected_q)
    expected = torch.tensor([[448.0, -3.25, 2.0],
                             [0.1015625, 18.0, -0.5],
                             [-896.0, 1.0, 0.0]])
    torch.testing.assert_close(dequantize_block_fp8(q, scale_inv, BLOCK), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", [(128, 256), (130, 200), (64, 64), (1, 300)])
def test_error_within_e4m3_rounding_on_128_blocks(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[1])
    q, scale_inv = quantize_block_fp8(w)
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_block_fp8(q, scale_inv)
    # round to nearest with 3 mantissa bits: |error| <= |w| / 16 for normal numbers, and half
    # the subnormal step (2^-9 * scale / 2) below e4m3's smallest normal
    per_element = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    bound = w.abs() / 16 + per_element * 2.0**-10
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    largest = w.abs().argmax()  # maps to +-448 exactly
    assert back.flatten()[largest] == pytest.approx(float(w.flatten()[largest]), rel=1e-6)


def test_the_trainer_quantizes_attention_and_mlp_weights_only():
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                 "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.2.mlp.experts.7.up_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"):
        assert is_quantized_linear(name), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.2.mlp.gate.weight",
                 "model.visual.blocks.0.mlp.layers.0.up_proj.weight"):
        assert not is_quantized_linear(name), name


def test_engine_pairs_weights_and_scales_across_calls():
    w = torch.randn(5, 3)
    q, s = quantize_block_fp8(w, BLOCK)
    pairs = Fp8Pairs(BLOCK)
    norm = torch.ones(3)
    assert [n for n, _ in pairs.take([("x.norm.weight", norm), ("x.weight", q)])] == ["x.norm.weight"]
    assert pairs.unpaired() == ["x.weight_scale_inv"]
    ready = pairs.take([("x.weight_scale_inv", s)])
    assert [n for n, _ in ready] == ["x.weight"] and pairs.unpaired() == []
    torch.testing.assert_close(ready[0][1], dequantize_block_fp8(q, s, BLOCK))


def test_fp8_checkpoint_quantizes_the_linear_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    src = tiny_model_dir("qwen3")
    dst = write_fp8_checkpoint(src, tmp_path / "fp8")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    original, tensors = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    for name, w in original.items():
        if is_quantized_linear(name):
            assert tensors[name].dtype == FP8_DTYPE
            assert tensors[name + "_scale_inv"].shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        else:
            assert torch.equal(tensors[name], w), name
    assert (dst / "tokenizer.json").is_file()
    assert write_fp8_checkpoint(src, dst) == dst  # made from src already: kept


def test_sglang_block_shape_rules():
    qwen3_8b = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    intermediate_size=12288)
    assert sglang_fp8_problems(qwen3_8b, 1) == [] and sglang_fp8_problems(qwen3_8b, 4) == []
    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    assert any("q_proj output per engine TP rank = 64" in p for p in sglang_fp8_problems(tiny, 1))
    a3b = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
               moe_intermediate_size=768)
    assert any("experts' gate_proj/up_proj output per engine TP rank = 192" in p for p in sglang_fp8_problems(a3b, 4))
    assert sglang_fp8_problems(a3b, 4, engine_ep=4) == []


def test_config_resolves_tis_and_checks_sglang_shapes():
    from megatron_agent.run_config import ConfigError, load_run_config

    assert load_run_config(["weight_sync.quantize=fp8"]).algorithm.tis_cap == 2.0
    assert load_run_config(["weight_sync.quantize=fp8", "algorithm.tis_cap=3.0"]).algorithm.tis_cap == 3.0
    assert load_run_config([]).algorithm.tis_cap is None
    with pytest.raises(ConfigError, match="weight_sync.quantize='int4'"):
        load_run_config(["weight_sync.quantize=int4"])
    with pytest.raises(ConfigError, match="q_proj output per engine TP rank = 64, not a multiple of 128"):
        load_run_config(["weight_sync.quantize=fp8", "engine.server=sglang", "engine.dtype=bfloat16",
                         'engine.urls=["http://127.0.0.1:1"]'])
