"""Actor -> embedded engine weight sync through SGLang's protocol, at several layouts.

After an update and a sync, the engine generates with the new weights: its logprobs on
its own samples equal the actor's recomputed logprobs within 1e-4, and the check mode's
checksums agree, for the default format (flattened: copied at the first sync, laid-out
runs straight from the parameters' memory from the second) and per tensor (streamed from
the recorded layout). An engine killed after the first bucket of a sync makes the sync
fail with its URL named, whether the buckets are announced after their export, sent from
memory or streamed; a restarted engine then syncs.
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks
from rollout.engine_launch import launch_engines, stop_engines

pytestmark = pytest.mark.multirank

CASES = [("qwen3", 1, {}), ("qwen3", 2, {"tp": 2}), ("qwen3", 2, {"pp": 2}), ("qwen3_moe", 2, {"ep": 2})]


def _sync_and_compare(model_dir: str, urls: list[str], layout: dict, check: bool = True, bound: float = 1e-4) -> dict:
    """Update the actor far from the engines' weights, sync, and compare the engines'
    logprobs with the actor's (`check`: the engines' checksums too, an embedded-engine route).
    Then again twice: the second sync (flattened, the default) sends the laid-out runs from
    memory, the third streams per tensor from the layout the earlier ones recorded."""
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.training.checks import (
        LogprobMismatchError,
        check_rollout_logprobs,
        rollout_logprob_gap,
    )
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient

    ctx = init_distributed(ParallelConfig(**layout), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch.from_sequences([torch.randint(0, 800, (6,), generator=g).tolist() for _ in range(4)],
                                      [torch.randint(0, 800, (5,), generator=g).tolist() for _ in range(4)],
                                      advantages=[1.0, -1.0, 0.5, 2.0])
    actor.update(batch)  # large lr: the weights move far from the engine's
    client = EngineClient(urls)
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30]]

    def engine_vs_actor():
        outs = client.generate(prompts, {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True,
                                         "sampling_seed": 3})
        sampled = TrainBatch.from_sequences(prompts, [o.output_ids for o in outs],
                                            rollout_logprobs=[o.logprobs for o in outs])
        recomputed = actor.compute_logprobs(sampled, with_entropy=False)["logprobs"]
        return outs, rollout_logprob_gap(recomputed, sampled.rollout_logprobs, sampled.response_mask)

    _, stale = engine_vs_actor()  # the engine still has the old weights: the check must fire
    try:
        check_rollout_logprobs(stale, max_abs_diff=bound)
        stale_error = None
    except LogprobMismatchError as err:
        stale_error = str(err)
    sync = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=64 * 1024, check=check, timeout_s=60,
                                                    in_place_min_bytes=1))
    metrics = sync.sync(version=1)
    outs, gap = engine_vs_actor()
    check_rollout_logprobs(gap, max_abs_diff=bound)
    out = {"max_diff": gap["check/rollout_logprob_max_abs_diff"], "stale_error": stale_error,
           "versions": {o.weight_version for o in outs}, "metrics": metrics}
    for version in (2, 3):
        batch.advantages = -batch.advantages
        actor.update(batch)
        sync.config.flattened = None if version == 2 else False
        streamed = version == 3 and sync.layout is not None  # the source rank's view (others never stream)
        metrics = sync.sync(version=version)
        outs, gap = engine_vs_actor()
        check_rollout_logprobs(gap, max_abs_diff=bound)
        out[version] = {"max_diff": gap["check/rollout_logprob_max_abs_diff"], "streamed": streamed,
                        "versions": {o.weight_version for o in outs}, "metrics": metrics}
    sync.close()
    return out


@pytest.mark.parametrize("family, world, layout", CASES, ids=[f"{f}-{lay or 'tp1'}" for f, _, lay in CASES])
def test_engine_matches_actor_after_sync(tiny_model_dir, tmp_path, family, world, layout):
    engines = launch_engines(tiny_model_dir(family), 1, log_dir=tmp_path)
    try:
        results = run_on_ranks(_sync_and_compare, world, str(tiny_model_dir(family)), [e.url for e in engines],
                               layout, timeout_s=300)
    finally:
        stop_engines(engines)
    out = results[0]
    assert out["versions"] == {"1"}
    assert out["metrics"]["weight_sync/buckets"] > 1 and out["metrics"]["weight_sync/bytes"] > 0
    assert out["max_diff"] < 1e-4, out
    assert out["metrics"]["weight_sync/bytes_in_place"] == 0  # nothing planned yet
    assert out[2]["metrics"]["weight_sync/bytes_in_place"] > 0, out  # TP 2: the replicated norms
    assert out[3]["streamed"], out  # rank 0: stage 0's source
    for version in (2, 3):
        assert out[version]["versions"] == {str(version)} and out[version]["max_diff"] < 1e-4, out
    assert out["stale_error"] and "differ from the rollout engine's" in out["stale_error"]


def _sync_with_an_engine_dying(model_dir: str, urls: list[str], victim_pid: int, restart_dir: str,
                               how: str) -> dict:
    import os
    import signal

    import megatron_agent.weight_sync as weight_sync
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError
    from megatron_agent.weight_sync.buckets import StreamedBuckets
    from rollout.engine_launch import launch_engines, stop_engines

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(), AlgorithmConfig(use_kl_loss=False))
    sync = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=16 * 1024, timeout_s=20, in_place_min_bytes=1,
                                                    flattened=how != "streamed"))
    sent = []
    if how == "in_place":
        sync.sync(version=0)  # plans the runs the next sync sends from memory (through send_weights)
    if how == "streamed":
        sync.sync(version=0)  # records the layout: the next sync streams
        owner, attr = StreamedBuckets, "_complete"

        def then_kill(original):
            def complete(self):  # the engine dies after the first bucket was answered
                answered = self.answer is not None
                original(self)
                if answered:
                    sent.append(1)
                    if len(sent) == 1:
                        os.kill(victim_pid, signal.SIGKILL)
            return complete
    else:
        owner, attr = weight_sync, "send_weights"

        def then_kill(original):
            def send(*args, **kwargs):  # the engine dies after the first bucket landed
                out = original(*args, **kwargs)
                sent.append(1)
                if len(sent) == 1:
                    os.kill(victim_pid, signal.SIGKILL)
                return out
            return send

    original = getattr(owner, attr)
    setattr(owner, attr, then_kill(original))
    try:
        sync.sync(version=1)
        return {"error": None}
    except WeightSyncError as err:
        message = str(err)
    finally:
        setattr(owner, attr, original)
    restarted = launch_engines(restart_dir, 1)
    try:
        sync.set_engines([urls[0], restarted[0].url])
        metrics = sync.sync(version=2)
    finally:
        stop_engines(restarted)
    return {"error": message, "buckets_before_failure": len(sent), "second": metrics}


@pytest.mark.parametrize("how", ["announced_after_export", "in_place", "streamed"])
def test_engine_dying_mid_sync_is_named_and_a_restarted_one_syncs(tiny_model_dir, tmp_path, how):
    engines = launch_engines(tiny_model_dir("qwen3"), 2, log_dir=tmp_path)
    try:
        out = run_on_ranks(_sync_with_an_engine_dying, 1, str(tiny_model_dir("qwen3")),
                           [e.url for e in engines], engines[1].pid, str(tiny_model_dir("qwen3")), how,
                           timeout_s=300)[0]
    finally:
        stop_engines(engines)
    assert out["error"] is not None and engines[1].url in out["error"], out["error"]
    assert out["buckets_before_failure"] >= 1
    assert out["second"]["weight_sync/bytes"] > 0 and out["second"]["weight_sync/buckets"] > 1


def _sync_when_the_update_does_not_open(model_dir: str, urls: list[str]) -> dict:
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError
    from rollout.engine_client import EngineClient

    ctx = init_distributed(ParallelConfig(tp=2), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(), AlgorithmConfig(use_kl_loss=False))
    sync = WeightSync(actor, urls, WeightSyncConfig(timeout_s=20, check=True))
    original = EngineClient.begin_weight_update

    def refused(self):
        raise ConnectionError("begin refused")
    EngineClient.begin_weight_update = refused  # on rank 0, the only rank that opens
    try:
        sync.sync(version=1)
        error = None
    except WeightSyncError as err:
        error = str(err)
    finally:
        EngineClient.begin_weight_update = original
    untouched = EngineClient(urls).model_info()[0]["weight_version"]
    metrics = sync.sync(version=2)
    sync.close()
    return {"error": error, "metrics": metrics, "version_after_failure": untouched}


def test_an_update_that_does_not_open_sends_nothing_and_the_next_sync_works(tiny_model_dir):
    """Rank 0 opens the update before it exports; when that fails, its TP peer still gets
    through the export's gathers, both ranks raise, no bucket was announced (the engine's
    version is unchanged), and the next sync goes through (checksums equal)."""
    from rollout.engine_client import EngineClient

    engines = launch_engines(tiny_model_dir("qwen3"), 1)
    try:
        outs = run_on_ranks(_sync_when_the_update_does_not_open, 2, str(tiny_model_dir("qwen3")),
                            [engines[0].url], timeout_s=300)
        versions = [info["weight_version"] for info in EngineClient([engines[0].url]).model_info()]
    finally:
        stop_engines(engines)
    for out in outs:
        assert out["error"] is not None and "opening the update" in out["error"] and "begin refused" in out["error"]
        assert out["version_after_failure"] not in ("1", "2")  # nothing was announced
        assert out["metrics"]["weight_sync/buckets"] >= 1
    assert versions == ["2"]
