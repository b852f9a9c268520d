"""The GPU path's Transformer Engine layer spec, FP8 and NCCL model parallelism. Every model
here holds the weights of a tiny model made on the spot (loaded through the bridge, the
TE spec's fused norm names included), so two specs or recipes are compared on the same
function:

- the TE spec's logits and the local spec's, both bf16, each as close to transformers' fp32
  forward on the same bf16 weights as transformers' own bf16 model is (and so to each other);
- FP8 (two recipes) forward/backward: finite, the first loss within 5% of bf16's, falling;
- TP=2 and TP=2 + sequence parallelism over NCCL against TP=1 (2 GPUs).

Skipped without CUDA; TE checks without Transformer Engine, NCCL ones with fewer than 2 GPUs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

JOB_TIMEOUT_S = 300


def _needs_transformer_engine() -> None:
    from megatron_agent.platform.device import transformer_engine_importable

    if not transformer_engine_importable():
        pytest.skip("Transformer Engine is not importable (the `gpu` extra)")


def _loaded_model(model_dir: str, layer_spec: str, fp8_recipe: str | None = None) -> list:
    from megatron_agent.models import build_model
    from megatron_agent.models.bridge import load_hf_weights
    from megatron_agent.platform import ParallelConfig

    chunks = build_model(model_dir, ParallelConfig(), params_dtype=torch.bfloat16, layer_spec=layer_spec,
                         fp8_recipe=fp8_recipe, init_weights=False)
    load_hf_weights(chunks, model_dir)
    return chunks


def _spec_logits_job(model_dir: str, input_ids: torch.Tensor) -> dict:
    from megatron_agent.models import read_hf_config
    from megatron_agent.platform import init_distributed
    from megatron_agent.training.schedule import forward_logits

    init_distributed(seed=5)
    vocab = read_hf_config(model_dir)["vocab_size"]
    return {spec: forward_logits(_loaded_model(model_dir, spec), input_ids, vocab).float().cpu()
            for spec in ("transformer_engine", "local")}


def _lm_losses_job(model_dir: str, recipes: list[str | None], steps: int = 3) -> dict:
    """LM losses of `steps` Adam steps from the loaded weights, per FP8 recipe (None: bf16)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_agent.platform import init_distributed
    from megatron_agent.training.schedule import (
        attach_grad_finalization,
        language_model_micro_batch,
        run_schedule,
        wrap_with_ddp,
    )

    init_distributed(seed=5)
    out = {}
    for recipe in recipes:
        chunks = wrap_with_ddp(_loaded_model(model_dir, "transformer_engine", recipe))
        attach_grad_finalization(chunks)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16), chunks)
        g = torch.Generator().manual_seed(0)
        batches = [language_model_micro_batch(torch.randint(0, 800, (2, 33), generator=g)) for _ in range(2)]
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            metrics = run_schedule(chunks, batches)
            optimizer.step()
            losses.append(sum(float(m["loss"]) for m in metrics) / len(metrics))
        out[recipe] = losses
    return out


def test_transformer_engine_matches_local_spec(tiny_model_dir):
    _needs_transformer_engine()
    from megatron_agent.platform.launch import run_on_ranks
    from tests.gpu.test_actor_gpu import _hf_logits, bf16_allowance

    model_dir = str(tiny_model_dir("qwen3"))
    input_ids = torch.randint(0, 800, (3, 24), generator=torch.Generator().manual_seed(3))
    logits = run_on_ranks(_spec_logits_job, 1, model_dir, input_ids, timeout_s=JOB_TIMEOUT_S)[0]
    exact = _hf_logits(model_dir, input_ids, torch.float32, "cuda")
    allowed = bf16_allowance(float((_hf_logits(model_dir, input_ids, torch.bfloat16, "cuda") - exact).abs().max()),
                             exact)
    errors = {spec: float((value - exact).abs().max()) for spec, value in logits.items()}
    between = float((logits["transformer_engine"] - logits["local"]).abs().max())
    print(f"measured: max |logit - fp32 reference| {errors}; TE vs local {between:.3g}; allowed {allowed:.3g} each")
    assert all(error <= allowed for error in errors.values()), (errors, allowed)
    assert between <= 2 * allowed, between


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_forward_backward(tiny_model_dir, recipe):
    from megatron_agent.platform import detect_platform
    from megatron_agent.platform.launch import run_on_ranks

    _needs_transformer_engine()
    if not detect_platform().fp8_capable:
        pytest.skip("FP8 needs compute capability 8.9+")
    losses = run_on_ranks(_lm_losses_job, 1, str(tiny_model_dir("qwen3")), [recipe, None],
                          timeout_s=JOB_TIMEOUT_S)[0]
    fp8, bf16 = losses[recipe], losses[None]
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
                           LAYOUTS["qwen3"][:2], timeout_s=JOB_TIMEOUT_S)
    reference = results[0]["reference"]
    for name in ("tp=2", "pp=2"):
        assert results[0][name]["loss"] == pytest.approx(reference["loss"], rel=1e-4)


@pytest.mark.multirank
def test_nccl_sequence_parallel(tiny_model_dir):
    """TP=2 + sequence parallelism over NCCL against TP=1 on the same GPUs: the CPU test's
    job, with GPU tolerances. On a GPU sequence parallelism needs the TE spec (builder.py)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _needs_transformer_engine()
    from megatron_agent.platform.launch import run_on_ranks
    from tests.multirank.test_sequence_parallel import METRICS, _real_positions, _worker

    model_dir = tiny_model_dir("qwen3")
    per_rank = run_on_ranks(_worker, 2, str(model_dir), dict(tp=2, sequence_parallel=True), (),
                            timeout_s=JOB_TIMEOUT_S)
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
