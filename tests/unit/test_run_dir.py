"""The run directory's files and the metrics row, by hand."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from megatron_agent.iteration_metrics import PhaseTimer, iteration_row, moving_average
from megatron_agent.run_dir import MetricsLog, latest_checkpoint, read_metrics, write_sample_episodes
from tests.unit.rollout.test_samples import sample


def test_latest_checkpoint_skips_partial_ones_and_names_the_folder_when_none(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in .*checkpoints"):
        latest_checkpoint(tmp_path)
    for name, complete in (("iter_000002", True), ("iter_000004", True), ("iter_000006", False)):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / name / "megatron_agent.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "iter_000004"


def test_metrics_log_keeps_a_resumed_runs_rows_and_reading_stops_at_a_cut_row(tmp_path):
    log = MetricsLog(tmp_path, [{"iteration": 0, "x": 1.0}])
    log.write({"iteration": 1, "x": 2.0, "note": "text is not a scalar"})
    log.close()
    assert [row["x"] for row in read_metrics(tmp_path)] == [1.0, 2.0]
    assert list((tmp_path / "tensorboard").iterdir())
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iteration": 2})[:5])  # a kill mid-write
    assert len(read_metrics(tmp_path)) == 2
    assert read_metrics(tmp_path / "nothing-here") == []


def test_sample_episodes_read_as_text(tmp_path):
    episode = [sample(0, 3, 0, 0.0, 1.0, anchor="Target: 2 Current: 1"), sample(0, 3, 1, 1.0, 1.0, won=True)]
    write_sample_episodes(tmp_path, 25, [episode, []])
    text = (tmp_path / "samples" / "iter_000025.txt").read_text()
    assert text.startswith("=== episode traj 3 (group 0, seed 0): return 1, won True, 2 steps")
    assert "observation: Target: 2 Current: 1" in text and text.count("--- step") == 2
    pictured = sample(0, 4, 0, 1.0, 1.0, won=True, anchor=np.zeros((8, 8, 3), np.uint8))
    pictured.observation, pictured.images = "Which colour?", [pictured.anchor]
    write_sample_episodes(tmp_path, 26, [[pictured]])
    text = (tmp_path / "samples" / "iter_000026.txt").read_text()
    assert "observation: Which colour?\nimages: 8x8x3\n" in text


def test_phase_timer_adds_up_repeated_phases():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("update"):
            time.sleep(0.01)
    assert list(timer.seconds) == ["time/update"] and timer.seconds["time/update"] >= 0.02
    with pytest.raises(RuntimeError), timer.phase("weight_sync"):  # a failed phase is still timed
        raise RuntimeError
    assert "time/weight_sync" in timer.seconds


def test_iteration_row_moves_the_rollout_clocks_into_time_and_names_train_metrics():
    timer = PhaseTimer()
    timer.seconds = {"time/rollout": 0.5, "time/update": 0.25}
    rollout = {"rollout/success_rate": 0.5, "rollout/time_s": 0.5, "rollout/time_generate_s": 0.3,
               "rollout/time_env_s": 0.1, "rollout/overhead_share": 0.2}
    row = iteration_row(7, timer, rollout, {"actor/pg_loss": 0.1}, tokens=100.0, elapsed=9.0,
                        successes=[0.0, 0.25, 0.5, 1.0], restarts=1)
    assert row["iteration"] == 7 and row["time/elapsed"] == 9.0 and row["engine/restarts"] == 1
    assert row["train/success_rate"] == 0.5 and "rollout/time_s" not in row and "train/time_s" not in row
    assert row["time/generate"] == 0.3 and row["time/env"] == 0.1 and row["perf/rollout_overhead_share"] == 0.2
    assert row["train/success_moving_average"] == pytest.approx(0.5833333)
    assert row["perf/update_tokens_per_s"] == 400.0
    assert row["time/other"] == pytest.approx(row["time/iteration"] - 0.75)
    assert rollout["rollout/time_s"] == 0.5  # the caller's dict is left as it was
    assert moving_average([1.0]) == 1.0
