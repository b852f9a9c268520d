"""The first cut of the RL loop runs end to end: env -> engine -> actor -> weight sync."""

from __future__ import annotations

import json
import math

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank  # a spawned trainer rank plus an engine process


def _two_iterations(model_dir: str, run_dir: str) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    config = load_run_config([f"run_dir={run_dir}", f"model_dir={model_dir}", "num_groups=2", "group_size=2",
                              "iterations=2", "loop.max_steps=3", "stop_success=null"])
    return train(config)


def test_loop_runs_and_syncs(tiny_model_dir, tmp_path):
    history = run_on_ranks(_two_iterations, 1, str(tiny_model_dir("qwen3")), str(tmp_path), timeout_s=300)[0]
    assert [row["iteration"] for row in history] == [0, 1]
    for row in history:
        assert row["train/num_episodes"] == 4
        for key in ("actor/pg_loss", "actor/grad_norm", "weight_sync/bytes", "time/rollout", "time/update"):
            assert math.isfinite(row[key]), key
        assert row["weight_sync/bytes"] > 0
        # served vs trained: fp32 on both sides, the weights the engine served are the actor's
        assert row["check/rollout_logprob_mean_abs_diff"] < 1e-5 and row["check/rollout_logprob_max_abs_diff"] < 1e-4
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def _run_with_syncs_that_do_not_land(overrides: list[str]) -> list[dict]:
    """Every weight sync reports success and sends nothing: the engine keeps serving the
    initial weights, as a multi-rank server whose other ranks missed the update would."""
    from megatron_agent.weight_sync import WeightSync

    WeightSync.sync = lambda self, version: {"weight_sync/seconds": 0.0, "weight_sync/bytes": 0.0,
                                             "weight_sync/buckets": 0.0, "weight_sync/gb_per_s": 0.0}
    return _run(overrides)


def test_a_weight_sync_that_did_not_land_fails_the_run_at_the_next_check(tmp_path):
    from megatron_agent.platform.launch import RankFailed

    # On the tiny MoE with routing replay from the rollout: in fp32 the engine's routes are the
    # trainer's own, so a route placed on the wrong token, layer or sample would move iteration
    # 0's logprobs off the engine's (by ~1e-2) and fail its check, and the routing watch of the
    # old-logprob pass (two epochs) finds the trainer's own routing the engine's. And with the
    # sequence-level rollout corrections on.
    common = ["num_groups=4", "group_size=4", "stop_success=null", "seed=3", "iterations=3", "val_every=0",
              "model=tiny-moe", "algorithm.routing_replay=rollout", "actor.ppo_epochs=2",
              "algorithm.tis_cap=2.0", "algorithm.tis_level=sequence", "algorithm.rollout_mask=sequence"]
    with pytest.raises(RankFailed, match=r"(?s)differ from the rollout engine's.*iteration 1, served weights"):
        run_on_ranks(_run_with_syncs_that_do_not_land, 1, [f"run_dir={tmp_path}", *common], timeout_s=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0]  # the first iteration served the trained weights
    assert rows[0]["check/rollout_logprob_mean_abs_diff"] < 1e-5
    assert json.loads((tmp_path / "config.json").read_text())["engine"]["return_routed_experts"] is True
    assert rows[0]["mismatch/routing_disagreement"] == 0.0 and rows[0]["mismatch/turn_0/routing_disagreement"] == 0.0
    # the same weights on both sides: every sequence's ratio is 1 to fp32, nothing cut or dropped
    assert rows[0]["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert rows[0]["rollout_correction/masked_fraction"] == 0.0


def _run_counting_env_workers(overrides: list[str]) -> list[dict]:
    """The run's rows, each with the number of env worker processes alive at its end."""
    import os

    import psutil

    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    def count(row):
        row["env_worker_processes"] = sum("multiprocessing" in " ".join(c.cmdline())
                                          for c in psutil.Process(os.getpid()).children(recursive=True))

    return train(load_run_config(overrides), on_iteration=count)


def test_env_backend_setting_moves_the_envs_and_keeps_the_run(tmp_path):
    common = ["num_groups=4", "group_size=2", "stop_success=null", "seed=2", "iterations=2", "val_every=2",
              "loop.validation.num_episodes=2"]
    inline = run_on_ranks(_run_counting_env_workers, 1, [f"run_dir={tmp_path / 'inline'}", *common],
                          timeout_s=300)[0]
    pooled = run_on_ranks(_run_counting_env_workers, 1, [f"run_dir={tmp_path / 'pool'}", "env_backend=process",
                                                         "env_workers=2", *common], timeout_s=300)[0]
    assert [row.pop("env_worker_processes") for row in inline] == [0, 0]
    assert [row.pop("env_worker_processes") for row in pooled] == [4, 4]  # 2 for training, 2 for validation
    _same_metrics(inline, pooled)


def _run(overrides: list[str]) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    return train(load_run_config(overrides))


# ppo: the critic is checkpointed and resumed too; an actor-only run's resume (GiGPO, killed
# mid-run and inside a save) is tests/integration/test_cli.py's
@pytest.mark.parametrize("algorithm", ["ppo"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, algorithm):
    common = ["num_groups=4", "group_size=4", "stop_success=null", "save_every=2", "seed=3", f"algorithm={algorithm}"]
    full = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'full'}", "iterations=4", *common], timeout_s=300)[0]
    part = tmp_path / "part"
    run_on_ranks(_run, 1, [f"run_dir={part}", "iterations=2", *common], timeout_s=300)
    assert (part / "checkpoints" / "iter_000002" / "megatron_agent.json").exists()
    resumed = run_on_ranks(_run, 1, [f"run_dir={part}", f"resume={part}", f"model_dir={part / 'model'}",
                                     "iterations=4", *common], timeout_s=300)[0]
    assert [row["iteration"] for row in resumed] == [0, 1, 2, 3]
    _same_metrics(full[2:], resumed[2:], rel=1e-6)
    if algorithm == "ppo":
        assert all(math.isfinite(row["critic/value_loss"]) for row in resumed)
        assert resumed[3]["critic/value_mean"] != 0.0  # the value head has left its zero start


def _run_killing_the_engine_after(overrides: list[str], kill_after: int) -> list[dict]:
    import os
    import signal

    import psutil

    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    def kill_engine(row):
        if row["iteration"] == kill_after:
            for child in psutil.Process(os.getpid()).children(recursive=True):
                if "rollout.engine_server" in " ".join(child.cmdline()):
                    os.kill(child.pid, signal.SIGKILL)

    return train(load_run_config(overrides), on_iteration=kill_engine)


# two mini-batches: the data-parallel test compares its run with the same clean run
DEAD_ENGINE_SETTINGS = ["num_groups=4", "group_size=4", "stop_success=null", "seed=5", "val_every=0",
                        "actor.num_mini_batches=2"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The uninterrupted single-rank run the dead-engine and data-parallel tests compare with,
    run once for them all: 4 iterations (a run's first iterations do not depend on how many
    follow them)."""
    run_dir = tmp_path_factory.mktemp("clean")
    return run_on_ranks(_run, 1, [f"run_dir={run_dir}", "iterations=4", *DEAD_ENGINE_SETTINGS], timeout_s=300)[0]


def test_a_dead_engine_is_restarted_and_the_iteration_retried(tmp_path, clean_run):
    killed = run_on_ranks(_run_killing_the_engine_after, 1, [f"run_dir={tmp_path / 'killed'}", "iterations=3",
                                                            *DEAD_ENGINE_SETTINGS], 0, timeout_s=300)[0]
    assert [row["engine/restarts"] for row in killed] == [0, 1, 1]
    clean = clean_run[:3]
    assert [row["iteration"] for row in clean] == [0, 1, 2]
    for a, b in zip(clean, killed):  # the retried iteration is the one that would have run
        for key in ("train/success_rate", "train/episode_return", "actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["iteration"], key)


def _same_metrics(reference: list[dict], other: list[dict], rel: float = 1e-5) -> None:
    assert [row["iteration"] for row in other] == [row["iteration"] for row in reference]
    for a, b in zip(reference, other):
        for key, value in a.items():
            if key.startswith(("time/", "perf/")) or key.endswith("_s") or any(
                    w in key for w in ("seconds", "gb_per_s", "overhead")):
                continue  # wall-clock figures
            if key in ("weight_sync/buckets", "engine/restarts", "rollout/worker_restarts"):
                continue  # one or more per pipeline stage; compared by the tests that kill engines
            # gaps between two fp32 logprobs: one ulp of a logprob near -3 is 2.4e-7
            tolerance = 1e-6 if key.startswith("mismatch/") else 1e-7
            assert b[key] == pytest.approx(value, rel=rel, abs=tolerance), (a["iteration"], key)


def test_multi_rank_trainers_reproduce_the_single_rank_run(tmp_path):
    """The same loop on TP=2 (local processes) and PP=2 (Ray actors, engine colocated in a
    trainer bundle): the same episodes, losses, validation and weights synced."""
    common = ["num_groups=4", "group_size=4", "stop_success=null", "seed=7", "iterations=3", "val_every=2",
              "loop.validation.num_episodes=4"]
    single = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'single'}", *common], timeout_s=300)[0]
    tp2 = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'tp2'}", "placement.trainer_ranks=2", "parallel.tp=2",
                                 *common], timeout_s=300)[0]
    _same_metrics(single, tp2)
    pp2 = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'pp2'}", "placement.launcher=ray", "placement.colocate=true",
                                 "placement.trainer_ranks=2", "parallel.pp=2", *common], timeout_s=300)[0]
    _same_metrics(single, pp2)
    assert "val/success_rate" in pp2[1] and pp2[-1]["weight_sync/bytes"] == single[-1]["weight_sync/bytes"]


def test_a_dead_engine_is_restarted_under_a_multi_rank_trainer_and_under_ray(tmp_path, clean_run):
    """Rank 0 restarts the engine; both ranks re-sync their shards to it and the step is retried."""
    common = ["iterations=4", *DEAD_ENGINE_SETTINGS]
    clean = clean_run
    killed = run_on_ranks(_run_killing_the_engine_after, 1, [f"run_dir={tmp_path / 'killed'}", "parallel.tp=2",
                                                            "placement.trainer_ranks=2", *common], 0,
                          timeout_s=300)[0]
    assert killed[-1]["engine/restarts"] == 1
    _same_metrics(clean, killed)
    # Under Ray the engine is an actor's process: rank 0's actor starts a new engine actor.
    on_ray = run_on_ranks(_run_killing_the_engine_after, 1, [f"run_dir={tmp_path / 'ray'}", "placement.launcher=ray",
                                                            *common], 0, timeout_s=300)[0]
    assert on_ray[-1]["engine/restarts"] == 1
    _same_metrics(clean, on_ray)


def test_data_parallel_trainers_reproduce_the_single_rank_run(tmp_path, clean_run):
    """DP=2: each trainer rank receives only its shard of the batch (and of the advantages);
    the two mini-batches are drawn from the whole batch, so the run is the single-rank one."""
    dp2 = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'dp2'}", "placement.trainer_ranks=2", "iterations=4",
                                 *DEAD_ENGINE_SETTINGS], timeout_s=300)[0]
    _same_metrics_across_data_parallel(clean_run, dp2)


def _same_metrics_across_data_parallel(single: list[dict], other: list[dict]) -> None:
    single, other = [dict(row) for row in single], [dict(row) for row in other]
    for a, b in zip(single, other):
        # per-micro-batch extremes, averaged: they depend on how the samples are cut into
        # micro-batches, which DP changes; the KL estimate is fp32 noise on ratios near 1
        for key in ("actor/ratio_max", "actor/ratio_min"):
            a.pop(key), b.pop(key)
        assert b.pop("actor/ppo_kl") == pytest.approx(a.pop("actor/ppo_kl"), abs=1e-6)
    _same_metrics(single, other)


def _run_killing_a_rollout_worker(overrides: list[str]) -> tuple[list[dict], list[int]]:
    """The run's rows, and the pid of the rollout worker killed in it: the first one seen
    rolling out (Ray titles its process `ray::RolloutWorker.roll_out` then) after the
    first iteration's row."""
    import threading
    import time

    import psutil

    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    armed, killed = threading.Event(), []

    def kill_one():
        armed.wait()
        while not killed:
            for process in psutil.process_iter(["cmdline"]):
                if any("ray::RolloutWorker.roll_out" in part for part in process.info["cmdline"] or []):
                    process.kill()
                    killed.append(process.pid)
                    return
            time.sleep(0.02)

    threading.Thread(target=kill_one, daemon=True).start()
    return train(load_run_config(overrides), on_iteration=lambda row: armed.set()), killed


def test_rollout_workers_on_a_ray_cluster_lose_no_group_when_one_is_killed(tmp_path, clean_run):
    """Two rollout workers, one on each of two rollout nodes of a 3-node Ray cluster made
    here (the trainer's node, and two with a `rollout_node` resource), two DP trainer ranks
    that fetch their shards from the workers; a worker killed mid-rollout is replaced and
    its groups rolled out again: the run is the single-process run."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
        cluster.wait_for_nodes()
        rows, killed = run_on_ranks(_run_killing_a_rollout_worker, 1, [
            f"run_dir={tmp_path}", "iterations=4", *DEAD_ENGINE_SETTINGS, f"placement.ray_address={cluster.address}",
            "placement.trainer_ranks=2", "rollout.workers=2", "rollout.node_resource=rollout_node"],
            timeout_s=600)[0]
    finally:
        cluster.shutdown()
    assert len(killed) == 1
    assert rows[-1]["rollout/worker_restarts"] == 1
    assert all(row["train/num_episodes"] == 16 for row in rows)  # 4 groups x 4, none lost, none twice
    _same_metrics_across_data_parallel(clean_run, rows)


def test_overlapped_rollout_is_one_update_stale_and_resumes_exactly(tmp_path):
    """training.mode=overlap: iteration k+1 is rolled out on the weights of iteration k while k
    trains; a checkpoint keeps the rollout done ahead, so a resumed run is the same run."""
    common = ["num_groups=4", "group_size=4", "stop_success=null", "save_every=2", "seed=3", "val_every=0",
              "training.mode=overlap", "algorithm.tis_cap=2.0"]
    full = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'full'}", "iterations=4", *common], timeout_s=300)[0]
    assert [row["train/policy_staleness"] for row in full] == [0.0, 1.0, 1.0, 1.0]
    assert "check/rollout_logprob_mean_abs_diff" in full[0]  # served vs trained: same weights only
    assert all("check/rollout_logprob_mean_abs_diff" not in row for row in full[1:])
    assert all(math.isfinite(row["rollout_correction/weight_mean"]) for row in full)
    part = tmp_path / "part"
    run_on_ranks(_run, 1, [f"run_dir={part}", "iterations=2", *common], timeout_s=300)
    assert (part / "rollout_ahead" / "iter_000002.pkl").exists()
    resumed = run_on_ranks(_run, 1, [f"run_dir={part}", f"resume={part}", f"model_dir={part / 'model'}",
                                     "iterations=4", *common], timeout_s=300)[0]
    _same_metrics(full[2:], resumed[2:], rel=1e-6)
    # two rollout workers (Ray actors) roll out ahead the same episodes; the engine batches
    # their requests otherwise, so logprobs differ by fp32 noise
    workers = run_on_ranks(_run, 1, [f"run_dir={tmp_path / 'workers'}", "iterations=4", "rollout.workers=2",
                                     *common], timeout_s=300)[0]
    _same_metrics(full, workers, rel=1e-5)


def _run_killed_with_groups_in_flight(overrides: list[str], kill_in: int) -> list[dict]:
    """The run, its engine killed after iteration 0 (the stream's requests fail, the engine is
    restarted), then the run itself killed (SIGKILL) in iteration `kill_in` once its progress
    shows requests in flight."""
    import os
    import signal

    import psutil

    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    def kill_engine(row):
        if row["iteration"] == 0:
            for child in psutil.Process(os.getpid()).children(recursive=True):
                if "rollout.engine_server" in " ".join(child.cmdline()):
                    os.kill(child.pid, signal.SIGKILL)

    def kill(progress):
        if progress.iteration >= kill_in and progress.rollout and progress.rollout.requests_in_flight > 0:
            os.kill(os.getpid(), signal.SIGKILL)

    return train(load_run_config(overrides), on_iteration=kill_engine, on_progress=kill)


def test_async_training_killed_with_groups_in_flight_resumes_and_finishes(tmp_path):
    """training.mode=async: the workers' stream plays on beside the update; an engine that dies
    under the stream is restarted and a new stream plays on; a run killed while its groups
    are in flight resumes from its last checkpoint and plays them again."""
    from megatron_agent.platform.launch import RankFailed

    common = ["num_groups=4", "group_size=4", "stop_success=null", "save_every=2", "seed=3", "val_every=0",
              "training.mode=async", "algorithm.tis_cap=2.0", "training.max_staleness=2",
              "training.max_inflight_groups=8"]
    run_dir = tmp_path / "run"
    with pytest.raises(RankFailed, match=r"exited without a result \(exit codes \{0: -9\}\)"):
        run_on_ranks(_run_killed_with_groups_in_flight, 1, [f"run_dir={run_dir}", "iterations=4", *common], 2,
                     timeout_s=300)
    assert (run_dir / "checkpoints" / "iter_000002" / "megatron_agent.json").exists()
    killed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in killed][:2] == [0, 1] and killed[1]["engine/restarts"] == 1
    assert killed[1]["train/num_episodes"] == 16  # the stream on the new engine gave the whole batch
    resumed = run_on_ranks(_run, 1, [f"run_dir={run_dir}", f"resume={run_dir}", f"model_dir={run_dir / 'model'}",
                                     "iterations=4", *common], timeout_s=300)[0]
    assert [row["iteration"] for row in resumed] == [0, 1, 2, 3]
    for row in resumed[2:]:
        assert row["train/num_episodes"] == 16  # 4 groups of 4, from the stream
        assert 0 <= row["train/policy_staleness"] <= 2
        lags = {k: v for k, v in row.items() if k.startswith("async/token_lag_")}
        assert lags and sum(lags.values()) == pytest.approx(1.0)
        assert all(int(k.rsplit("_", 1)[1]) <= 2 for k in lags)  # no token older than max_staleness
        assert math.isfinite(row["rollout_correction/weight_mean"]) and math.isfinite(row["actor/pg_loss"])
