"""Block-FP8 rollout weights: the format (rollout/fp8_blocks.py) against hand-computed
examples and e4m3's error bound, fused experts included, which tensors the trainer
quantizes, the FP8 checkpoint (Qwen3-VL-MoE's fused experts, Qwen2.5-VL's vision tower), the
engine's pairing of weights and scales and its loading of an FP8 Qwen3-VL-MoE, and the
config rules (fp8.py, run_config). What SGLang itself makes of the checkpoint:
tests/integration/rollout/test_sglang_fp8_load.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_agent.weight_sync.fp8 import (
    SOURCE_FILE,
    is_quantized_linear,
    quantize_named,
    sglang_fp8_problems,
    write_fp8_checkpoint,
)
from rollout.fp8_blocks import FP8_DTYPE, Fp8Pairs, dequantize_block_fp8, quantize_block_fp8, scale_shape

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


def test_fused_experts_are_blocked_per_expert_in_the_linear_orientation():
    # One expert stored [in=2, out=3] (as Qwen3-VL-MoE's gate_up_proj [E, H, 2I]): its
    # linear weight is the transpose, rows (448, 224), (-896, 0), (1, -2). Blocks of 1 output
    # row x 2 input columns: one scale per output row, max |row| / 448 = 1, 2, 2/448, stored
    # in the tensor's own orientation, [E, ceil(in/2), ceil(out/1)] = [1, 1, 3].
    w = torch.tensor([[[448.0, -896.0, 1.0],
                       [224.0, 0.0, -2.0]]])
    q, scale_inv = quantize_block_fp8(w, (1, 2))
    assert q.dtype == FP8_DTYPE and q.shape == (1, 2, 3) and scale_shape(w.shape, (1, 2)) == (1, 1, 3)
    torch.testing.assert_close(scale_inv, torch.tensor([[[1.0, 2.0, 2.0 / 448]]]), rtol=0, atol=0)
    assert torch.equal(q.float(), torch.tensor([[[448.0, -448.0, 224.0], [224.0, 0.0, -448.0]]]))
    assert torch.equal(dequantize_block_fp8(q, scale_inv, (1, 2)), w)


def test_fused_experts_equal_their_experts_quantized_alone():
    w = torch.randn(3, 40, 70, generator=torch.Generator().manual_seed(1))  # [E, in, out]
    q, scale_inv = quantize_block_fp8(w, (16, 32))
    assert scale_inv.shape == (3, 2, 5)  # [E, ceil(40/32), ceil(70/16)]
    for e in range(3):
        q_e, s_e = quantize_block_fp8(w[e].T, (16, 32))  # the expert's [out, in] weight
        assert torch.equal(q[e].T.float(), q_e.float()) and torch.equal(scale_inv[e].T, s_e)
        torch.testing.assert_close(dequantize_block_fp8(q, scale_inv, (16, 32))[e].T,
                                   dequantize_block_fp8(q_e, s_e, (16, 32)), rtol=0, atol=0)


def test_the_trainer_quantizes_attention_and_mlp_weights_only():
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                 "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.2.mlp.experts.7.up_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight",
                 "model.language_model.layers.5.mlp.experts.gate_up_proj",
                 "model.language_model.layers.5.mlp.experts.down_proj"):
        assert is_quantized_linear(name), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.2.mlp.gate.weight",
                 "model.visual.blocks.0.mlp.layers.0.up_proj.weight", "visual.blocks.0.mlp.gate_proj.weight",
                 "model.visual.blocks.0.mlp.linear_fc1.weight", "model.language_model.layers.5.mlp.gate.weight"):
        assert not is_quantized_linear(name), name


def test_quantize_named_refuses_a_tensor_of_the_wrong_rank():
    with pytest.raises(ValueError, match="3-D tensor here, got shape"):
        quantize_named("model.language_model.layers.0.mlp.experts.down_proj", torch.ones(4, 8))
    with pytest.raises(ValueError, match="2-D tensor here, got shape"):
        quantize_named("model.layers.0.mlp.experts.0.down_proj.weight", torch.ones(2, 4, 8))
    norm = torch.ones(8)
    assert quantize_named("model.norm.weight", norm) == [("model.norm.weight", norm)]


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


NOT_CONVERTED = ["lm_head", "embed_tokens", "mlp.gate", "visual", "vision_tower", "vision_model"]


def test_fp8_checkpoint_quantizes_the_linear_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    src = tiny_model_dir("qwen3")
    dst = write_fp8_checkpoint(src, tmp_path / "fp8")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": NOT_CONVERTED}
    original, tensors = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    for name, w in original.items():
        if is_quantized_linear(name):
            assert tensors[name].dtype == FP8_DTYPE
            assert tensors[name + "_scale_inv"].shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        else:
            assert torch.equal(tensors[name], w), name
    assert (dst / "tokenizer.json").is_file()
    assert write_fp8_checkpoint(src, dst) == dst  # made from src already: kept
    source = json.loads((dst / SOURCE_FILE).read_text())
    (dst / SOURCE_FILE).write_text(json.dumps({k: v for k, v in source.items() if k != "format"}))
    (dst / "model.safetensors").write_bytes(b"")  # written by an older format: made again
    assert load_file(str(write_fp8_checkpoint(src, dst) / "model.safetensors")).keys() == tensors.keys()


def _within_e4m3(back: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block) -> bool:
    """|back - w| within round-to-nearest e4m3 of each block's scale, `w` fused [E, in, out]."""
    per_element = scale_inv.repeat_interleave(block[1], 1).repeat_interleave(block[0], 2)[:, :w.shape[1], :w.shape[2]]
    return bool(((back - w).abs() <= (w.abs() / 16 + per_element * 2.0**-10) * (1 + 1e-6)).all())


def test_fp8_checkpoint_of_qwen3_vl_moe_quantizes_the_fused_experts(tiny_model_dir, tmp_path):
    """SGLang 0.5.23's Qwen3-VL-MoE loader (models/qwen3_vl_moe.py `load_weights`) maps
    `experts.gate_up_proj*` / `experts.down_proj*` to Fp8MoEMethod's w13_weight* / w2_weight*,
    transposing weight and scale alike ([E, H, 2I] -> [E, 2I, H], blocks [E, 2I/bn, H/bk]):
    so the checkpoint holds each fused tensor in the published layout as float8_e4m3fn and
    its `_scale_inv` [E, ceil(in/bk), ceil(out/bn)]. Either source layout of the experts
    (published, or transformers 5's [E, 2I, H]) gives the same checkpoint."""
    from safetensors.torch import load_file, save_file

    block = (16, 32)
    src = tiny_model_dir("qwen3_vl_moe")
    dst = write_fp8_checkpoint(src, tmp_path / "fp8", block)
    original, tensors = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    fused = {n: w for n, w in original.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(fused) == 8
    for name, w in fused.items():
        experts, inp, out = w.shape  # gate_up_proj [4, H=64, 2I=96], down_proj [4, I=48, H=64]
        assert (inp, out) == ((64, 96) if "gate_up" in name else (48, 64))
        q, scale_inv = tensors[name], tensors[name + "_scale_inv"]
        assert q.dtype == FP8_DTYPE and q.shape == w.shape
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == (experts, -(-inp // 32), -(-out // 16))
        assert _within_e4m3(dequantize_block_fp8(q, scale_inv, block), w, scale_inv, block), name
    for name, w in original.items():
        if not is_quantized_linear(name):  # vision tower, router, norms, embeddings, lm_head
            assert torch.equal(tensors[name], w), name
    assert any(n.startswith("model.visual.blocks.") for n in original)
    assert sum(t.dtype == FP8_DTYPE for t in tensors.values()) == 6 * 4  # q, k, v, o and the two fused a layer
    memory = shutil.copytree(src, tmp_path / "memory-layout")
    save_file({n: w.transpose(1, 2).contiguous() if n in fused else w for n, w in original.items()},
              str(memory / "model.safetensors"), metadata={"format": "pt"})
    again = load_file(str(write_fp8_checkpoint(memory, tmp_path / "fp8-from-memory", block) / "model.safetensors"))
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[n].view(torch.uint8) if again[n].dtype == FP8_DTYPE else again[n],
                           t.view(torch.uint8) if t.dtype == FP8_DTYPE else t) for n, t in tensors.items())


def test_fp8_checkpoint_of_qwen2_5_vl_keeps_the_vision_tower(tiny_model_dir, tmp_path):
    """SGLang 0.5.23 builds Qwen2.5-VL's tower with the quant config (models/qwen2_5_vl.py,
    prefix `visual`): the config's modules_to_not_convert, read by Fp8Config.from_config,
    keeps it unquantized, as the checkpoint holds it."""
    from safetensors.torch import load_file

    src = tiny_model_dir("qwen2_5_vl")
    dst = write_fp8_checkpoint(src, tmp_path / "fp8", (16, 32))
    assert "visual" in json.loads((dst / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    original, tensors = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    vision = [n for n in original if n.startswith("visual.")]
    assert any(n.endswith("mlp.gate_proj.weight") for n in vision)
    assert all(torch.equal(tensors[n], original[n]) for n in vision)
    assert sum(t.dtype == FP8_DTYPE for t in tensors.values()) == 7 * 4  # q, k, v, o, gate, up, down a layer


def test_engine_loads_and_updates_fp8_fused_experts(tiny_model_dir, tmp_path):
    """The embedded engine started from Qwen3-VL-MoE's FP8 checkpoint holds the dequantized
    experts (transformers 5 keeps them [E, 2I, H] in memory), and an update that sends a
    fused FP8 weight and its scale in separate calls replaces them."""
    from safetensors.torch import load_file

    from rollout.embedded_engine import Engine

    src = tiny_model_dir("qwen3_vl_moe")
    engine = Engine(str(write_fp8_checkpoint(src, tmp_path / "fp8")))
    original = load_file(str(src / "model.safetensors"))
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    held = engine.weight_view(name)
    q, scale_inv = quantize_block_fp8(original[name])
    assert torch.equal(held, dequantize_block_fp8(q, scale_inv))
    assert _within_e4m3(held, original[name], scale_inv, (128, 128))
    new = torch.randn(original[name].shape, generator=torch.Generator().manual_seed(2))
    (q_name, q), (s_name, s) = quantize_named(name, new)
    engine.begin_weight_update()
    engine.load_weights([(q_name, q)])
    assert engine.fp8.unpaired() == [s_name]
    engine.load_weights([(s_name, s)])
    engine.end_weight_update()
    assert torch.equal(engine.weight_view(name), dequantize_block_fp8(q, s))


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
    # transformers 5 writes Qwen3-VL-MoE's expert count as num_local_experts
    vl_a3b = dict(a3b, model_type="qwen3_vl_moe", num_local_experts=128, intermediate_size=6144)
    del vl_a3b["num_experts"]
    assert any("experts' gate_proj/up_proj output per engine TP rank = 192" in p
               for p in sglang_fp8_problems(vl_a3b, 4))
    # SGLang's Llama loads no block scale, whatever the shapes
    llama = dict(qwen3_8b, model_type="llama")
    assert sglang_fp8_problems(llama, 1) == [
        "SGLang's LlamaForCausalLM loads no block-FP8 scale (it renames weight_scale_inv to weight_scale)"]


def test_config_resolves_tis_and_checks_sglang_shapes():
    from megatron_agent.run_config import ConfigError, load_run_config

    assert load_run_config(["weight_sync.quantize=fp8"]).algorithm.tis_cap == 2.0
    assert load_run_config(["weight_sync.quantize=fp8", "algorithm.tis_cap=3.0"]).algorithm.tis_cap == 3.0
    assert load_run_config([]).algorithm.tis_cap is None
    masked = load_run_config(["weight_sync.quantize=fp8", "algorithm.rollout_mask=token"]).algorithm
    assert masked.tis_cap is None and masked.rollout_mask == "token"  # a correction chosen: none added
    with pytest.raises(ConfigError, match="weight_sync.quantize='int4'"):
        load_run_config(["weight_sync.quantize=int4"])
    with pytest.raises(ConfigError, match="q_proj output per engine TP rank = 64, not a multiple of 128"):
        load_run_config(["weight_sync.quantize=fp8", "engine.server=sglang", "engine.dtype=bfloat16",
                         'engine.urls=["http://127.0.0.1:1"]'])
