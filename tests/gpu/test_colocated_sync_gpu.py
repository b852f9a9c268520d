"""The colocated weight path on one GPU: the actor (bf16, local spec) and an embedded engine
(bf16) on the same GPU, driven by the run's `EngineFleet` with `placement.colocate` (so
`weight_sync.transport` is "tensor"): the engine releases its memory while the actor
trains, then the sync resumes it and hands the weights over as CUDA IPC handles
(weight_sync/tensor_sync.py). Before the sync the engine's logprobs differ from the moved
actor's past the bf16 bound; after it they are within it, and the engine holds exactly the
actor's weights as bf16 (checksums of every tensor). Skipped without CUDA."""

from __future__ import annotations

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # the trainer's and the engine's (a CPU rehearsal of this job sets "cpu")


def _colocated_job(model_dir: str, run_dir: str, device: str, quantize: str | None = None) -> dict:
    """Move the actor away from the engine's weights, release the engine's memory, sync
    through the fleet; the served-vs-actor gap before and after. `quantize="fp8"`: the engine
    starts from the FP8 checkpoint made here and gets block-FP8 weights."""
    import torch

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.engine_fleet import EngineFleet
    from megatron_agent.placement import PlacementConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.run_config import RunConfig
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSyncConfig
    from rollout.engine_launch import EngineConfig
    from tests.gpu.engines import (
        engine_holds_the_actors_weights,
        engine_info,
        served_gap,
        start_embedded_engine,
        trainer_device,
    )

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, params_dtype="bf16", layer_spec="local",
                                                      use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    engine_model = model_dir
    if quantize == "fp8":
        from megatron_agent.weight_sync.fp8 import write_fp8_checkpoint

        engine_model = str(write_fp8_checkpoint(model_dir, f"{run_dir}/engine_model_fp8"))
    config = RunConfig(run_dir=run_dir, placement=PlacementConfig(colocate=True),
                       engine=EngineConfig(dtype="bfloat16", timeout_s=120),
                       # check=True: the engine's checksums of every weight after the sync, as a run does
                       weight_sync=WeightSyncConfig(bucket_bytes=64 * 1024, check=True, timeout_s=120,
                                                    quantize=quantize))

    def launch(engine_config, _model_dir, log_dir, **_):
        return [start_embedded_engine(engine_model, log_dir, device=device, dtype=engine_config.dtype)]

    fleet = EngineFleet(config, model_dir, actor, leader=True, launch_engines=launch)
    try:
        out = {"trainer_device": trainer_device(actor), "engine": engine_info(fleet.urls[0]),
               "start": served_gap(fleet.client, actor)}
        g = torch.Generator().manual_seed(1)
        batch = TrainBatch.from_sequences([torch.randint(0, 800, (6,), generator=g).tolist() for _ in range(4)],
                                          [torch.randint(0, 800, (5,), generator=g).tolist() for _ in range(4)],
                                          advantages=[1.0, -1.0, 0.5, 2.0])
        actor.update(batch)  # large lr: far from the engine's weights
        out["stale"] = served_gap(fleet.client, actor)
        fleet.release_memory()  # as after a rollout: the actor would train now
        out["released"] = engine_info(fleet.urls[0])["memory_released"]
        out["metrics"] = fleet.sync_weights(version=1)
        out["mismatched"] = engine_holds_the_actors_weights(fleet.urls[0], actor, quantize)
        out["after"] = served_gap(fleet.client, actor)
        out["after_released"] = engine_info(fleet.urls[0])["memory_released"]
        return out
    finally:
        fleet.close()


def test_colocated_cuda_ipc_sync_to_the_embedded_engine(tiny_model_dir, tmp_path):
    from megatron_agent.training.checks import DEFAULT_MEAN_BOUND

    out = run_on_ranks(_colocated_job, 1, str(tiny_model_dir("qwen3")), str(tmp_path / "run"), DEVICE,
                       timeout_s=300)[0]
    assert out["trainer_device"] == DEVICE and out["engine"]["device"].startswith(DEVICE), out
    assert out["engine"]["dtype"] == "bfloat16"
    bound = DEFAULT_MEAN_BOUND["bf16"]
    print(f"measured: served vs actor logprobs (mean / max): at the start {out['start']['mean']:.3g} / "
          f"{out['start']['max']:.3g}; after the update {out['stale']['mean']:.3g} / {out['stale']['max']:.3g}; "
          f"after the sync {out['after']['mean']:.3g} / "
          f"{out['after']['max']:.3g}; bound {bound}")
    assert out["start"]["mean"] < bound, out["start"]  # the same checkpoint on both sides
    assert out["stale"]["mean"] > bound, out["stale"]  # the check would catch a sync that did not land
    assert out["released"] == ["kv_cache", "weights"] and out["after_released"] == []
    assert out["metrics"]["engine/memory_released"] == 1.0 and out["metrics"]["weight_sync/bytes"] > 0
    assert out["mismatched"] == [], out["mismatched"]  # every weight, exactly (in the engine's dtype)
    assert out["after"]["versions"] == ["1"] and out["after"]["mean"] < bound, out["after"]
