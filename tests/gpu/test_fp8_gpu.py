"""Block-FP8 rollout weights on a GPU (rollout/fp8_blocks.py, weight_sync/fp8.py):

- quantizing a GPU tensor gives the very bytes and scales the CPU gives (weights whose
  shapes are and are not multiples of the 128x128 block, fp32 and bf16, a zero block),
  and dequantizing on the GPU gives the CPU's values;
- the colocated sync with `quantize: fp8` (CUDA IPC handles, test_colocated_sync_gpu.py's
  job): the embedded engine on the GPU, started from the FP8 checkpoint, holds the
  dequantized weights exactly, and its logprobs are within the fp8 check bound of the bf16
  actor's, while before the sync they were not.

Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # a CPU rehearsal of these checks sets "cpu"
SHAPES = [(256, 384), (200, 130), (64, 128), (128, 64), (1, 300)]


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows, cols in SHAPES:
        w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 1, cols)  # blocks of very different scales
        if rows >= 128 and cols >= 128:
            w[:128, :128] = 0.0  # a zero block
        out.append(w.to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_on_the_gpu_equals_the_cpu(dtype):
    from megatron_agent.weight_sync.fp8 import quantize_named
    from rollout.fp8_blocks import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8

    for w in _weights(dtype):
        q_cpu, s_cpu = quantize_block_fp8(w)
        q_gpu, s_gpu = quantize_block_fp8(w.to(DEVICE))
        assert q_gpu.device.type == s_gpu.device.type == DEVICE and q_gpu.dtype == FP8_DTYPE
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), tuple(w.shape)
        assert torch.equal(s_gpu.cpu(), s_cpu), tuple(w.shape)
        back = dequantize_block_fp8(q_gpu, s_gpu, dtype=dtype)
        assert back.device.type == DEVICE and torch.equal(back.cpu(), dequantize_block_fp8(q_cpu, s_cpu, dtype=dtype))
    named = quantize_named("model.layers.0.mlp.down_proj.weight", _weights(dtype)[0].to(DEVICE))
    assert [(n, t.device.type, t.dtype) for n, t in named] == [
        ("model.layers.0.mlp.down_proj.weight", DEVICE, FP8_DTYPE),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", DEVICE, torch.float32)]


def test_fp8_sync_to_the_embedded_engine_on_the_gpu(tiny_model_dir, tmp_path):
    from megatron_agent.training.checks import QUANTIZED_MEAN_BOUND
    from tests.gpu.test_colocated_sync_gpu import _colocated_job

    out = run_on_ranks(_colocated_job, 1, str(tiny_model_dir("qwen3")), str(tmp_path / "run"), DEVICE, "fp8",
                       timeout_s=300)[0]
    assert out["trainer_device"] == DEVICE and out["engine"]["device"].startswith(DEVICE), out
    bound = QUANTIZED_MEAN_BOUND["fp8"]
    print(f"measured: FP8 engine vs bf16 actor logprobs (mean / max): at the start {out['start']['mean']:.3g} / "
          f"{out['start']['max']:.3g}; after the update {out['stale']['mean']:.3g} / {out['stale']['max']:.3g}; "
          f"after the sync {out['after']['mean']:.3g} / {out['after']['max']:.3g}; bound {bound}")
    assert out["start"]["mean"] < bound, out["start"]  # the FP8 checkpoint of the actor's weights
    assert out["stale"]["mean"] > bound, out["stale"]
    assert out["mismatched"] == [], out["mismatched"]  # the dequantized weights, exactly
    assert out["metrics"]["weight_sync/bytes"] > 0
    assert out["after"]["versions"] == ["1"] and out["after"]["mean"] < bound, out["after"]
