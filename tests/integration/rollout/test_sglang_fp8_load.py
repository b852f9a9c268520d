"""Our block-FP8 checkpoints (`write_fp8_checkpoint`, the tensors every FP8 sync sends) loaded
by SGLang 0.5.23's own model classes and weight loaders, on CPU, for every supported family
(sglang_fp8_load.py: one process for all, no server; about 12 s, most of it importing SGLang).

Against SGLang loading the original checkpoint unquantized (its own names, layouts and
bfloat16 rounding: an independent reference):
- the modules SGLang builds as FP8 are exactly each decoder layer's qkv_proj, o_proj and
  MLP (gate_up_proj + down_proj, or the fused experts): the config's
  `modules_to_not_convert` keeps the vision tower (Qwen2.5-VL's is built with the quant
  config), lm_head, embeddings and the router out, and nothing we send as FP8 is left out;
- every FP8 parameter holds what we sent: its scale is the block's max |w| / 448 and it
  dequantizes to the reference within e4m3's rounding; Qwen3-VL-MoE's fused experts land
  in Fp8MoEMethod's w13_weight / w2_weight and their `_scale_inv`, per expert, with a
  non-square block (16 x 32) so that a transposed scale cannot pass;
- every other parameter equals the reference bit for bit.

Llama: SGLang 0.5.23's LlamaForCausalLM renames `weight_scale_inv` to `weight_scale` on
load (models/llama.py `_legacy_load_weights`), which block-FP8 layers do not have, so no
scale loads; `sglang_fp8_problems` refuses the combination, and the test says when a new
SGLang loads them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from rollout.engine_launch import sglang_cpu_environment
from tests.integration.rollout.test_sglang import sglang_python  # noqa: F401

BLOCK = (16, 32)  # (rows of the output, columns of the input) per scale: not square on purpose
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3", "qwen3_moe", "qwen2", "llama"]
LOADER = Path(__file__).with_name("sglang_fp8_load.py")
KV_CACHE_SCALES = ("attn.k_scale", "attn.v_scale")  # Fp8KVCacheMethod's, not weights


@pytest.fixture(scope="module")
def sglang_loaded(sglang_python, tiny_model_dir, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """{family: (reference state, FP8 state, {module: quant method}, num layers, moe)}."""
    from megatron_agent.models.transformer_config import num_experts, read_hf_config
    from megatron_agent.weight_sync.fp8 import write_fp8_checkpoint

    out = tmp_path_factory.mktemp("sglang-fp8")
    pairs = []
    for family in FAMILIES:
        src = tiny_model_dir(family)
        pairs.append(f"{family}={src},{write_fp8_checkpoint(src, out / f'{family}-fp8', BLOCK)}")
    env = sglang_cpu_environment(1)
    env["HF_HUB_OFFLINE"] = "1"  # a name that is not a local directory must not reach for the hub
    done = subprocess.run([sglang_python, str(LOADER), str(out), *pairs], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    from safetensors.torch import load_file

    loaded = {}
    for family in FAMILIES:
        hf = read_hf_config(tiny_model_dir(family))
        loaded[family] = (load_file(str(out / f"{family}.reference.safetensors")),
                          load_file(str(out / f"{family}.fp8.safetensors")),
                          json.loads((out / f"{family}.methods.json").read_text()),
                          hf["num_hidden_layers"], bool(num_experts(hf)))
    return loaded


def _expected_fp8_modules(layers: int, moe: bool) -> set[str]:
    """SGLang's decoder-layer modules (its names: `model.layers.{i}`, the merged qkv_proj
    and gate_up_proj, FusedMoE `mlp.experts`) that are made of what we send as FP8."""
    mlp = ["mlp.experts"] if moe else ["mlp.gate_up_proj", "mlp.down_proj"]
    return {f"model.layers.{i}.{m}" for i in range(layers) for m in ["self_attn.qkv_proj", "self_attn.o_proj", *mlp]}


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| over each BLOCK of the last two dims ([..., out, in], SGLang's orientation)."""
    bn, bk = BLOCK
    *lead, out, inp = w.shape
    rows, cols = -(-out // bn), -(-inp // bk)
    padded = torch.zeros(*lead, rows * bn, cols * bk)
    padded[..., :out, :inp] = w.float().abs()
    return padded.reshape(*lead, rows, bn, cols, bk).amax(dim=(-3, -1))


def _per_element(scale: torch.Tensor, shape) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK[0], -2).repeat_interleave(BLOCK[1], -1)[..., :shape[-2], :shape[-1]]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_sglang_loads_the_fp8_checkpoint_as_sent(sglang_loaded, family):
    reference, fp8, methods, layers, moe = sglang_loaded[family]
    fp8_modules = {m for m, method in methods.items() if method in ("Fp8LinearMethod", "Fp8MoEMethod")}
    assert fp8_modules == _expected_fp8_modules(layers, moe)
    if moe:
        assert {methods[f"model.layers.{i}.mlp.experts"] for i in range(layers)} == {"Fp8MoEMethod"}
    scales = {n for n in fp8 if n.endswith("_scale_inv")}
    assert {n.removesuffix("_scale_inv") for n in scales} == {n for n, t in fp8.items()
                                                             if t.dtype == torch.float8_e4m3fn}
    assert set(fp8) - scales - {n for n in fp8 if n.endswith(KV_CACHE_SCALES)} == set(reference)
    quantized = 0
    for name, ref in reference.items():
        got = fp8[name]
        if got.dtype != torch.float8_e4m3fn:
            assert torch.equal(got, ref), name
            continue
        quantized += 1
        scale = fp8[name + "_scale_inv"]
        # our scale, from the fp32 original; the reference holds it rounded to bfloat16 (2^-8)
        torch.testing.assert_close(scale, _block_amax(ref) / 448, rtol=2.0**-8, atol=0, msg=name)
        per_element = _per_element(scale, ref.shape)
        error = (got.float() * per_element - ref.float()).abs()
        # e4m3 round to nearest (|w| / 16, half a subnormal step below its normals) plus bfloat16's
        assert (error <= ref.float().abs() * (1 / 16 + 2.0**-7) + per_element * 2.0**-10).all(), name
    assert quantized == sum(2 if m.endswith("experts") else 1 for m in fp8_modules)  # w13 and w2


def test_sglang_llama_loads_no_block_scales_and_the_config_refuses_it(sglang_loaded):
    from megatron_agent.weight_sync.fp8 import sglang_fp8_problems

    _, fp8, methods, layers, _ = sglang_loaded["llama"]
    assert {m for m, method in methods.items() if method == "Fp8LinearMethod"} == _expected_fp8_modules(layers, False)
    unloaded = [n for n in fp8 if n.endswith("_scale_inv") and (fp8[n] == torch.finfo(torch.float32).min).all()]
    # every scale is still Fp8LinearMethod's fill value: when this fails, SGLang loads them
    # and the refusal in sglang_fp8_problems can go
    assert len(unloaded) == 4 * layers, sorted(set(fp8) - set(unloaded))[:8]
    llama_8b = dict(model_type="llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, intermediate_size=14336)  # every block shape fits
    assert [p for p in sglang_fp8_problems(llama_8b, 1) if "LlamaForCausalLM" in p]
