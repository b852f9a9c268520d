"""megatron-agent-convert on a vision-language model: Qwen3-VL (nested names, tied
embeddings, the vision tower's 1:1 prefix rule) through hf-to-mcore, mcore-to-hf
(bit-identical) and verify at PP=2; Qwen3-VL-MoE's fused experts are refused up front."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_checkpoint_convert import convert, hf_tensors


@pytest.mark.multirank
def test_qwen3_vl_round_trip_and_verify(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3_vl")
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    out = convert("hf-to-mcore", "--hf", str(src), "--out", str(mcore), "--pp", "2")
    assert out.returncode == 0, out.stderr
    out = convert("mcore-to-hf", "--mcore", str(mcore), "--out", str(back))
    assert out.returncode == 0, out.stderr
    original, converted = hf_tensors(src), hf_tensors(back)
    assert original.keys() == converted.keys() and any(k.startswith("model.visual.") for k in original)
    assert all(torch.equal(original[k], converted[k]) for k in original)
    out = convert("verify", "--hf", str(src), "--mcore", str(mcore), "--pp", "2")
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_fused_experts_are_refused_before_writing(tiny_model_dir, tmp_path):
    out = convert("hf-to-mcore", "--hf", str(tiny_model_dir("qwen3_vl_moe")), "--out", str(tmp_path / "o"))
    assert out.returncode != 0 and "fused experts" in out.stderr and not (tmp_path / "o").exists()
