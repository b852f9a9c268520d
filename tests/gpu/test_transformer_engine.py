"""The GPU path: NCCL, the Transformer Engine layer spec, FP8. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _lm_losses(model_dir, layer_spec, fp8_recipe=None, dtype=torch.bfloat16, steps=3):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_agent.models import build_model
    from megatron_agent.platform import ParallelConfig, init_distributed, shutdown_distributed
    from megatron_agent.training.schedule import (
        attach_grad_finalization,
        language_model_micro_batch,
        run_schedule,
        wrap_with_ddp,
    )

    ctx = init_distributed(ParallelConfig(), seed=5)
    try:
        chunks = wrap_with_ddp(build_model(model_dir, ctx.parallel, params_dtype=dtype,
                                           layer_spec=layer_spec, fp8_recipe=fp8_recipe))
        attach_grad_finalization(chunks)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=dtype == torch.bfloat16, params_dtype=dtype), chunks
        )
        g = torch.Generator().manual_seed(0)
        batches = [language_model_micro_batch(torch.randint(0, 800, (2, 33), generator=g)) for _ in range(2)]
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            out = run_schedule(chunks, batches)
            optimizer.step()
            losses.append(sum(float(m["loss"]) for m in out) / len(out))
        return losses
    finally:
        shutdown_distributed()


def test_transformer_engine_matches_local_spec(tiny_model_dir):
    path = str(tiny_model_dir("qwen3"))
    te = _lm_losses(path, "transformer_engine")
    local = _lm_losses(path, "local")
    assert te[0] == pytest.approx(local[0], rel=2e-2)
    assert te[-1] < te[0]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_forward_backward(tiny_model_dir, recipe):
    from megatron_agent.platform import detect_platform

    if not detect_platform().fp8_capable:
        pytest.skip("FP8 needs compute capability 8.9+ and Transformer Engine")
    path = str(tiny_model_dir("qwen3"))
    fp8 = _lm_losses(path, "transformer_engine", fp8_recipe=recipe)
    bf16 = _lm_losses(path, "transformer_engine")
    assert all(torch.isfinite(torch.tensor(fp8)))
    assert fp8[0] == pytest.approx(bf16[0], rel=5e-2)
    assert fp8[-1] < fp8[0]


@pytest.mark.multirank
def test_nccl_tensor_parallel(tiny_model_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from megatron_agent.platform.launch import run_on_ranks
    from tests.multirank.test_model_parallel import LAYOUTS, _worker

    results = run_on_ranks(_worker, 2, str(tiny_model_dir("qwen3")), str(tiny_model_dir("qwen3").parent / "ck"),
                           LAYOUTS["qwen3"][:2])
    reference = results[0]["reference"]
    for name in ("tp=2", "pp=2"):
        assert results[0][name]["loss"] == pytest.approx(reference["loss"], rel=1e-4)


@pytest.mark.multirank
def test_nccl_sequence_parallel(tiny_model_dir):
    """TP=2 + sequence parallelism over NCCL (Transformer Engine where installed) against
    TP=1 on the same GPUs: the CPU test's job, with GPU tolerances."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from megatron_agent.platform.launch import run_on_ranks
    from tests.multirank.test_sequence_parallel import METRICS, _real_positions, _worker

    model_dir = tiny_model_dir("qwen3")
    per_rank = run_on_ranks(_worker, 2, str(model_dir), dict(tp=2, sequence_parallel=True), False, timeout_s=900)
    real = _real_positions(read_vocab(model_dir))
    reference = per_rank[0]["tp=1"]
    for rank in per_rank:
        for key in ("logprobs", "after"):
            assert (rank["sp"][key] - reference[key])[real].abs().max() < 1e-3, key
        for metric in METRICS:
            assert rank["sp"]["metrics"][metric] == pytest.approx(reference["metrics"][metric], rel=1e-3, abs=1e-5)


def read_vocab(model_dir) -> int:
    from megatron_agent.models import read_hf_config

    return read_hf_config(model_dir)["vocab_size"]
