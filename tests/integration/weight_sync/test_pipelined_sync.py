"""The pipelined weight sync, repeated: tiny buckets (many in flight), the sender's bucket
buffers and the engine's parameters reused from one sync to the next (the second sync
of a layout lands in place). After each of four syncs with different weights
(flattened, flattened again, per tensor, per tensor streamed: announced from the layout
the previous sync recorded, the laid-out parameters broadcast from their own memory),
the engine's logprobs on its own samples equal the actor's recomputed ones and the
engine's checksums equal the actor's."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks
from rollout.engine_launch import launch_engines, stop_engines

pytestmark = pytest.mark.multirank


def engine_vs_actor_gap(client, actor, prompts: list[list[int]]) -> float:
    """The largest gap between the engine's logprobs on its own samples and the actor's."""
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.training.checks import rollout_logprob_gap

    outs = client.generate(prompts, {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True,
                                     "sampling_seed": 3})
    sampled = TrainBatch.from_sequences(prompts, [o.output_ids for o in outs],
                                        rollout_logprobs=[o.logprobs for o in outs])
    recomputed = actor.compute_logprobs(sampled, with_entropy=False)["logprobs"]
    return rollout_logprob_gap(recomputed, sampled.rollout_logprobs, sampled.response_mask)[
        "check/rollout_logprob_max_abs_diff"]


def _three_syncs(model_dir: str, urls: list[str]) -> dict:
    import megatron_agent.weight_sync as weight_sync
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient

    streamed = []
    streamed_buckets = weight_sync.StreamedBuckets

    def counting(*args, **kwargs):
        streamed.append(1)
        return streamed_buckets(*args, **kwargs)

    weight_sync.StreamedBuckets = counting
    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    g = torch.Generator().manual_seed(1)
    client = EngineClient(urls)
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30]]

    def move_the_actor(seed: float):
        batch = TrainBatch.from_sequences([torch.randint(0, 800, (6,), generator=g).tolist() for _ in range(4)],
                                          [torch.randint(0, 800, (5,), generator=g).tolist() for _ in range(4)],
                                          advantages=[seed, -1.0, 0.5, 2.0])
        actor.update(batch)  # large lr: far from what the engine holds

    def engine_vs_actor() -> float:
        return engine_vs_actor_gap(client, actor, prompts)

    flat = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=24 * 1024, check=True, timeout_s=60,
                                                    flattened=True))
    per_tensor = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=24 * 1024, check=True, timeout_s=60,
                                                          flattened=False))
    out = {"gaps": [], "buckets": [], "streamed": []}
    buffers = None
    for step, sync in enumerate([flat, flat, per_tensor, per_tensor]):
        move_the_actor(1.0 + step)
        out["stale_gap_before_sync"] = engine_vs_actor()
        before = len(streamed)
        metrics = sync.sync(version=step)  # check=True: raises if any checksum differs
        out["streamed"].append(len(streamed) - before)
        out["gaps"].append(engine_vs_actor())
        out["buckets"].append(metrics["weight_sync/buckets"])
        if sync is flat:
            pointers = [b.data_ptr() for b in flat.buffers.buffers]
            out["buffers_kept"] = buffers is None or pointers == buffers
            buffers = pointers
    flat.close()
    per_tensor.close()
    return out


def test_repeated_pipelined_syncs_deliver_each_new_set_of_weights(tiny_model_dir, tmp_path):
    engines = launch_engines(tiny_model_dir("qwen3"), 1, log_dir=tmp_path)
    try:
        out = run_on_ranks(_three_syncs, 1, str(tiny_model_dir("qwen3")), [e.url for e in engines],
                           timeout_s=300)[0]
    finally:
        stop_engines(engines)
    assert all(b >= 4 for b in out["buckets"]), out  # several buckets, so several in flight
    assert out["stale_gap_before_sync"] > 1e-3, out  # the actor moved: the comparison can fail
    assert max(out["gaps"]) < 1e-4, out
    assert out["buffers_kept"], out
    assert out["streamed"] == [0, 0, 0, 1], out  # the second per-tensor sync streamed


def _in_place_syncs(model_dir: str, urls: list[str]) -> dict:
    import torch.nn as nn

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    client = EngineClient(urls)
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30]]

    def engine_vs_actor() -> float:
        return engine_vs_actor_gap(client, actor, prompts)

    exported = {n: t.numel() * t.element_size() for n, t in actor.named_hf_weights()}
    copied = sum(b for n, b in exported.items() if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")))
    sync = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=2**30, check=True, timeout_s=60, flattened=True,
                                                    in_place_min_bytes=1))
    out = {"exported": sum(exported.values()), "qkv": copied, "syncs": []}
    for step in range(4):
        batch = TrainBatch.from_sequences([torch.randint(0, 800, (6,), generator=g).tolist() for _ in range(4)],
                                          [torch.randint(0, 800, (5,), generator=g).tolist() for _ in range(4)],
                                          advantages=[1.0 + step, -1.0, 0.5, 2.0])
        actor.update(batch)
        if step == 2:  # a parameter moved to memory of its own (as an offload would move it)
            param = next(p for p in actor.chunks[0].parameters() if p.dim() == 2)
            param.data = param.data.clone()
            assert isinstance(param, nn.Parameter)
        stale = engine_vs_actor()
        metrics = sync.sync(version=step)  # check=True: raises if any checksum differs
        out["syncs"].append({"stale": stale, "gap": engine_vs_actor(), "buckets": metrics["weight_sync/buckets"],
                             "in_place": metrics["weight_sync/bytes_in_place"],
                             "bytes": metrics["weight_sync/bytes"]})
    sync.close()
    client.close()
    return out


def test_flattened_syncs_send_the_packed_parameters_straight_from_memory(tiny_model_dir, tmp_path):
    """A Megatron actor on one rank packs its parameters (bridge.pack_parameters): from the
    second flattened sync on, everything but q/k/v goes straight from the parameters'
    memory, and the engine's logprobs and checksums still equal the actor's. A parameter
    that moves voids the plan for one sync, which copies everything; the next is in place again."""
    engines = launch_engines(tiny_model_dir("qwen3"), 1, log_dir=tmp_path)
    try:
        out = run_on_ranks(_in_place_syncs, 1, str(tiny_model_dir("qwen3")), [e.url for e in engines],
                           timeout_s=300)[0]
    finally:
        stop_engines(engines)
    syncs = out["syncs"]
    assert all(s["stale"] > 1e-3 and s["gap"] < 1e-4 for s in syncs), out
    assert all(s["bytes"] == out["exported"] for s in syncs), out
    assert [s["in_place"] for s in syncs] == [0, out["exported"] - out["qkv"], 0, out["exported"] - out["qkv"]], out
    assert syncs[1]["buckets"] == 2, out  # one run from memory, one bucket of q/k/v copies
    assert syncs[3]["buckets"] == 3, out  # the moved parameter is a run of its own


def _syncs_from_the_distributed_optimizer_buffer(model_dir: str, urls: list[str]) -> dict:
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient

    ctx = init_distributed(ParallelConfig(), seed=7)  # two ranks: DP 2
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2), AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    client = EngineClient(urls)
    g = torch.Generator().manual_seed(1)
    sync = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=2**30, check=True, timeout_s=60,
                                                    in_place_min_bytes=1))
    out = {"distributed_optimizer": actor.distributed_optimizer, "syncs": []}
    for step, flattened in enumerate([None, None, True, True]):
        batch = TrainBatch.from_sequences([torch.randint(0, 800, (6,), generator=g).tolist() for _ in range(4)],
                                          [torch.randint(0, 800, (5,), generator=g).tolist() for _ in range(4)],
                                          advantages=[1.0 + step, -1.0, 0.5, 2.0])
        actor.update(batch)
        sync.config.flattened = flattened
        stale = engine_vs_actor_gap(client, actor, [[1, 2, 3, 4, 5], [10, 20, 30]])
        metrics = sync.sync(version=step)
        out["syncs"].append({"flattened": sync.flattened, "stale": stale, "in_place": metrics["weight_sync/bytes_in_place"],
                             "gap": engine_vs_actor_gap(client, actor, [[1, 2, 3, 4, 5], [10, 20, 30]])})
    sync.close()
    client.close()
    return out


def test_parameters_in_the_distributed_optimizer_buffer_sync_per_tensor_by_default_and_flattened_from_it(
        tiny_model_dir, tmp_path):
    """At DP 2 the distributed optimizer lays the parameters out in its own buffer: the
    default format is then per tensor (its q/k/v cut the buffer into a run per layer); asked
    for flattened, a sync sends those runs straight from the buffer (as the per-tensor syncs
    before recorded them). The engine's logprobs equal the actor's after every sync,
    checksums checked."""
    engines = launch_engines(tiny_model_dir("qwen3"), 1, log_dir=tmp_path)
    try:
        out = run_on_ranks(_syncs_from_the_distributed_optimizer_buffer, 2, str(tiny_model_dir("qwen3")),
                           [e.url for e in engines], timeout_s=300)[0]
    finally:
        stop_engines(engines)
    assert out["distributed_optimizer"], out
    syncs = out["syncs"]
    assert [s["flattened"] for s in syncs] == [False, False, True, True], out
    assert all(s["stale"] > 1e-3 and s["gap"] < 1e-4 for s in syncs), out
    assert [s["in_place"] > 0 for s in syncs] == [False, False, True, True], out  # planned by the earlier syncs
