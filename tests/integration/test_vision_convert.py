"""megatron-agent-convert on a vision-language model: Qwen3-VL (nested names, tied
embeddings, the vision tower's 1:1 prefix rule) through hf-to-mcore, mcore-to-hf
(bit-identical) and verify at PP=2; Qwen3-VL-MoE's fused experts (a layer's experts in
one HF tensor) both ways from either layout transformers writes, and verify."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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


FUSED_EXPERT_CONVERSIONS = """
import json
from tools.checkpoint_convert.convert import hf_to_mcore, mcore_to_hf, verify
from megatron_agent.platform.parallel import ParallelConfig
if __name__ == "__main__":
    for hf, mcore, back in [({hub!r}, {hub_mcore!r}, {hub_back!r}), ({memory!r}, {memory_mcore!r}, {memory_back!r})]:
        hf_to_mcore(hf, mcore)
        mcore_to_hf(mcore, back)
    print(json.dumps(verify({hub!r}, {hub_mcore!r}, ParallelConfig())))
"""


def _is_fused_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def test_qwen3_vl_moe_fused_experts_round_trip_and_verify(tiny_model_dir, tmp_path):
    """Both layouts of the fused experts (published [E, H, 2I] / [E, I, H]; transformers
    5's in-memory [E, 2I, H] / [E, H, I]) convert to Megatron and back to the published
    layout bit for bit; the Megatron checkpoint's logits match transformers'. One process
    (imports once); `verify` at TP=PP=EP=1 (other layouts load the same files, see
    test_checkpoint_convert's EP=2)."""
    from safetensors.torch import save_file

    hub = tiny_model_dir("qwen3_vl_moe")
    original = hf_tensors(hub)
    gate_up = original["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 64, 2 * 48)  # [E, H, 2I]: the published layout
    memory = shutil.copytree(hub, tmp_path / "memory")
    save_file({k: t.transpose(1, 2).contiguous() if _is_fused_expert(k) else t for k, t in original.items()},
              memory / "model.safetensors", metadata={"format": "pt"})
    paths = {k: str(tmp_path / k) for k in ("hub_mcore", "hub_back", "memory_mcore", "memory_back")}
    code = FUSED_EXPERT_CONVERSIONS.format(hub=str(hub), memory=str(memory), **paths)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for back in ("hub_back", "memory_back"):
        converted = hf_tensors(tmp_path / back)
        assert converted.keys() == original.keys() and sum(map(_is_fused_expert, original)) == 8
        assert all(torch.equal(original[k], converted[k]) for k in original), back
    logits = json.loads(out.stdout.strip().splitlines()[-1])
    assert logits["max_abs_diff"] < 1e-4 and logits["cosine"] > 0.9999, logits
