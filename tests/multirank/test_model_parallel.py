"""TP=2, PP=2 (+VPP), EP=2 give the single-rank loss and gradient norm.

One 2-rank job per family: it first computes the reference on a plain, unwrapped TP=1
model (autograd gradients, no DDP, no optimizer), saves those weights with
dist_checkpointing, then for each layout rebuilds the model, loads the weights
(Megatron reshards them), runs the pipeline schedule with DDP and the Megatron
optimizer, and reports the loss and the optimizer's gradient norm.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank

NUM_MICRO_BATCHES = 4
# An odd vocabulary makes TP=2 pad the output layer: the padded logit must take no mass.
MODEL_OVERRIDES = {"qwen3": {"vocab_size": 805}, "qwen3_moe": {}}
LAYOUTS = {
    "qwen3": [dict(tp=2), dict(pp=2), dict(pp=2, vpp=2)],
    # MoE with tp>1 trains only with sequence parallelism: tests/multirank/test_sequence_parallel.py.
    "qwen3_moe": [dict(pp=2), dict(ep=2)],
}


def _micro_batches(vocab_size: int, seed: int = 7):
    from megatron_agent.training.schedule import language_model_micro_batch

    g = torch.Generator().manual_seed(seed)
    return [language_model_micro_batch(torch.randint(0, vocab_size, (2, 17), generator=g))
            for _ in range(NUM_MICRO_BATCHES)]


def _layout_name(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in layout.items())


def _worker(model_dir: str, ckpt_dir: str, layouts: list[dict]) -> dict:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_agent.models import build_model, read_hf_config
    from megatron_agent.platform import (
        ParallelConfig,
        destroy_model_parallel,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )
    from megatron_agent.platform.collectives import all_reduce
    from megatron_agent.training.schedule import (
        attach_grad_finalization,
        run_schedule,
        wrap_with_ddp,
    )

    hf = read_hf_config(model_dir)
    batches = _micro_batches(hf["vocab_size"])
    ctx = init_distributed(ParallelConfig(), seed=11)
    world = ctx.world_size
    results = {}

    # Reference: one rank's worth of work, no communication.
    (model,) = build_model(model_dir, ctx.parallel)
    losses = run_schedule([model], batches)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    results["reference"] = {
        "loss": sum(float(m["loss"]) for m in losses) / len(losses),
        "grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))),
    }
    dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt_dir)
    del model
    destroy_model_parallel()

    for layout in layouts:
        parallel = ParallelConfig(**layout)
        initialize_model_parallel(parallel, world)
        set_seed(11)
        chunks = build_model(model_dir, parallel)
        state = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
        loaded = dist_checkpointing.load(state, ckpt_dir)
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"model{i}"])
        chunks = wrap_with_ddp(chunks)
        attach_grad_finalization(chunks)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, params_dtype=torch.float32), chunks
        )
        optimizer.zero_grad()
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        my_batches = batches[dp_rank::dp_size]
        losses = run_schedule(chunks, my_batches)
        _, grad_norm, _ = optimizer.step()
        # The loss lives on the last stage: average over its micro-batches and DP ranks.
        loss = torch.tensor(
            [sum(float(m["loss"]) for m in losses), float(len(losses))], dtype=torch.float64
        )
        all_reduce(loss)
        results[_layout_name(layout)] = {"loss": float(loss[0] / loss[1]), "grad_norm": float(grad_norm)}
        del chunks, optimizer
        destroy_model_parallel()
    return results


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def family_results(request, tiny_model_dir, tmp_path_factory):
    family = request.param
    ckpt = tmp_path_factory.mktemp(f"ckpt_{family}")
    results = run_on_ranks(
        _worker, 2, str(tiny_model_dir(family, **MODEL_OVERRIDES[family])), str(ckpt), LAYOUTS[family], timeout_s=600)
    return family, results


def test_layouts_match_single_rank(family_results):
    family, per_rank = family_results
    reference = per_rank[0]["reference"]
    assert math.isfinite(reference["loss"]) and reference["grad_norm"] > 0
    for layout in LAYOUTS[family]:
        name = _layout_name(layout)
        for rank, results in enumerate(per_rank):
            got = results[name]
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), (family, name, rank)
            assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), (family, name, rank)
