"""A run's progress from rank 0 to the bar: the reporter's file, the follower of another
process's run directory, and what `megatron-agent train` shows."""

from __future__ import annotations

import json
import threading
import time

from megatron_agent.cli import TrainingBar, describe_progress
from megatron_agent.launcher import follow_metrics
from megatron_agent.progress import DONE, STARTING, Progress, ProgressReporter, read_progress
from rollout.progress import RolloutProgress


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_reporter_hands_on_the_latest_state_to_its_callback_and_the_file(tmp_path):
    seen = []
    reporter = ProgressReporter(tmp_path, iterations=6, first_iteration=4, on_progress=seen.append, interval_s=0.02)
    wait_for(lambda: seen)
    assert seen[0] == Progress(4, 6, STARTING) == read_progress(tmp_path)
    reporter.phase(4, "rollout")
    on_rollout = reporter.rollout("rollout of iteration 4")
    for done in range(1, 6):  # counts faster than it hands on: only the latest need show
        on_rollout(RolloutProgress(episodes=8, episodes_done=done, steps_done=3 * done, requests_in_flight=8 - done))
    expected = Progress(4, 6, "rollout", "rollout of iteration 4", RolloutProgress(8, 5, 15, 3))
    wait_for(lambda: seen[-1] == expected)
    assert read_progress(tmp_path) == expected
    reporter.phase(5, "update")
    reporter.close()
    assert seen[-1] == read_progress(tmp_path) == Progress(5, 6, DONE, "rollout of iteration 4",
                                                          RolloutProgress(8, 5, 15, 3))
    assert len(seen) == len(set(seen))  # a state is handed on once
    assert not list(tmp_path.glob(".*tmp"))


def test_the_follower_reads_another_process_rows_and_progress(tmp_path):
    """What `launch` does for multi-rank and Ray runs: rank 0 writes the files, this
    process follows them. A resumed run's metrics.jsonl starts with the earlier rows."""
    rows, states, finished = [], [], threading.Event()
    follower = threading.Thread(target=follow_metrics, args=(tmp_path, finished, rows.append, states.append),
                                kwargs={"poll_s": 0.02})
    follower.start()
    reporter = ProgressReporter(tmp_path, iterations=3, first_iteration=2, interval_s=0.02)
    wait_for(lambda: states)
    with (tmp_path / "metrics.jsonl").open("w") as metrics:
        metrics.write(json.dumps({"iteration": 0}) + "\n" + json.dumps({"iteration": 1}) + "\n")
        metrics.flush()
        reporter.phase(2, "rollout")
        reporter.rollout("rollout of iteration 2")(RolloutProgress(4, 1, 2, 3))
        wait_for(lambda: states and states[-1].rollout == RolloutProgress(4, 1, 2, 3))
        metrics.write(json.dumps({"iteration": 2}) + "\n")
        metrics.flush()
        wait_for(lambda: len(rows) == 3)
    reporter.close()
    finished.set()
    follower.join()
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert states[0].phase == STARTING and states[-1].phase == DONE and states[-1].iteration == 2


def test_the_bar_counts_from_the_resumed_iteration(capsys):
    bar = TrainingBar(iterations=6, first_iteration=4)
    assert bar.bar.n == 4
    row = {"train/success_rate": 0.5, "train/success_moving_average": 0.95, "train/invalid_action_rate": 0.1}
    for i in range(4):  # the rows before the resume, as the follower replays them
        bar.on_iteration({"iteration": i, **row})
    assert bar.bar.n == 4 and bar.reached is None
    bar.on_progress(Progress(4, 6, "rollout", "rollout of iteration 4", RolloutProgress(8, 2, 9, 6)))
    assert bar.bar.n == 4
    bar.on_iteration({"iteration": 4, **row})
    assert bar.bar.n == 5 and bar.reached[0]["iteration"] == 4
    bar.on_progress(Progress(5, 6, "update"))
    bar.on_iteration({"iteration": 5, **row})
    bar.close()
    assert bar.bar.n == 6
    err = capsys.readouterr().err
    assert "4/6" in err and "6/6" in err and "0/6" not in err and "100%" in err


def test_what_the_bar_says_inside_an_iteration():
    counts = RolloutProgress(episodes=128, episodes_done=57, steps_done=312, requests_in_flight=24)
    assert describe_progress(Progress(3, 9, "rollout", "rollout of iteration 3", counts)) == \
        "rollout: 57/128 episodes, 312 steps, 24 requests in flight"
    # training.mode=overlap: the next iteration's rollout runs during this one's update
    assert describe_progress(Progress(3, 9, "update", "rollout of iteration 4", counts)) == \
        "update; rollout of iteration 4: 57/128 episodes, 312 steps, 24 requests in flight"
    assert describe_progress(Progress(3, 9, "validation", "validation", RolloutProgress(16, 3, 7, 13))) == \
        "validation: 3/16 episodes, 7 steps, 13 requests in flight"
    finished = RolloutProgress(episodes=128, episodes_done=128, steps_done=700, requests_in_flight=0)
    assert describe_progress(Progress(3, 9, "update", "rollout of iteration 3", finished)) == "update"
    assert describe_progress(Progress(0, 9, STARTING)) == "start-up"
    assert describe_progress(Progress(9, 9, DONE, "rollout of iteration 8", finished)) == ""
