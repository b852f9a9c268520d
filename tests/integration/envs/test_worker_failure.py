"""Env worker processes that die, hang or exit mid-episode; the Ray backend."""

import os
import signal
import time

import pytest

import tests.unit.envs.toy_envs  # noqa: F401  (registers toy_counter)
from envs import EnvManager


def act(move):
    return f"<think>t</think><action>{move}</action>"


def kill(pid):
    """SIGKILL and wait until the process is gone or a zombie (its parent reaps it)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def test_killing_a_worker_mid_episode_fails_only_its_running_episodes():
    with EnvManager("toy_counter", {"max_steps": 4}, num_groups=2, group_size=2, num_workers=2) as m:
        m.reset([1, 2])
        assert [m.worker_of(i) for i in range(4)] == [0, 0, 1, 1]
        m.step(["crash", "a", "b", "c"])  # copy 0 (worker 0) ends early, failed by its own error
        done_before = dict(m.infos[0])
        old_pid = m.worker_pids()[0]
        kill(old_pid)

        obs, rewards, dones, infos = m.step([None, "a", "b", "c"])
        assert list(dones) == [True, True, False, False]
        assert infos[0] == done_before and "boom" in infos[0]["error"]  # finished before: untouched
        assert infos[1]["failed"] and f"worker process {old_pid}" in infos[1]["error"]
        assert not infos[2]["failed"] and not infos[3]["failed"] and list(rewards[2:]) == [1.0, 1.0]
        assert m.worker_pids()[0] != old_pid and m.restarts == 1

        while not m.dones.all():  # the batch completes
            m.step(["x"] * 4)
        obs = m.reset([1, 2])  # the new worker serves its copies
        assert not m.dones.any() and f"pid={m.worker_pids()[0]}" in obs[0].text
        obs, rewards, dones, infos = m.step(["a"] * 4)
        assert not any(i["failed"] for i in infos) and list(rewards) == [1.0] * 4


def test_sokoban_batch_survives_a_killed_worker():
    with EnvManager("sokoban", num_groups=4, group_size=2, num_workers=2) as m:
        m.reset([0, 1, 2, 3])
        m.step([act("up")] * 8)
        kill(m.worker_pids()[1])
        steps = 0
        while not m.dones.all():
            obs, rewards, dones, infos = m.step([act(["left", "down", "right", "up"][steps % 4])] * 8)
            steps += 1
        failed = [i for i in range(8) if m.infos[i]["failed"]]
        assert failed and all(m.worker_of(i) == 1 for i in failed)
        assert all(not m.infos[i]["failed"] for i in range(8) if m.worker_of(i) == 0)


def test_a_worker_that_exits_by_itself_is_replaced():
    with EnvManager("toy_counter", num_groups=1, group_size=2, num_workers=2) as m:
        m.reset([3])
        obs, rewards, dones, infos = m.step(["exit", "ok"])
        assert list(dones) == [True, False] and "exit code 3" in infos[0]["error"]
        assert rewards[1] == 2.0


def test_a_hung_worker_is_killed_after_the_step_timeout():
    with EnvManager("toy_counter", num_groups=2, group_size=1, num_workers=2, step_timeout_s=1.0) as m:
        m.reset([1, 2])
        start = time.monotonic()
        obs, rewards, dones, infos = m.step(["sleep", "fine"])
        assert time.monotonic() - start < 10
        assert list(dones) == [True, False] and "step_timeout_s" in infos[0]["error"]
        assert rewards[1] == 4.0


def test_a_reset_that_kills_the_worker_is_retried():
    with EnvManager("toy_counter", num_groups=1, group_size=2, num_workers=1) as m:
        m.reset([1])
        kill(m.worker_pids()[0])
        obs = m.reset([1])  # first attempt finds the worker dead, the retry succeeds
        assert not m.dones.any() and obs[0].text.startswith("seed=1 step=0")


@pytest.mark.slow
def test_ray_backend_matches_the_process_pool_and_survives_a_killed_actor():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        texts = [act(m) for m in ["up", "left", "down", "right"]] * 2
        results = {}
        for backend in ("ray", "process"):
            with EnvManager("sokoban", num_groups=4, group_size=2, backend=backend, num_workers=2) as m:
                first = [o.text for o in m.reset([5, 6, 7, 8])]
                obs, rewards, dones, _ = m.step(texts)
                results[backend] = (first, [o.text for o in obs], rewards.tolist(), dones.tolist())
                if backend == "ray":
                    kill(m.worker_pids()[0])
                    obs, rewards, dones, infos = m.step(texts)
                    assert infos[0]["failed"] and not infos[7]["failed"]
                    assert m.worker_pids()[0] is not None
        assert results["ray"] == results["process"]
    finally:
        ray.shutdown()


def test_copies_stepped_one_by_one_from_threads_and_a_worker_that_exits():
    """step_copies from several threads at once gives what the batch step gives; a worker
    that dies under one copy's step takes its other mid-episode copies with it: they end
    failed at their own next step, and nothing else does."""
    from concurrent.futures import ThreadPoolExecutor

    with EnvManager("toy_counter", {"max_steps": 3}, num_groups=2, group_size=3, num_workers=2) as m:
        m.reset([1, 2])
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: m.step_copies({i: "ab"})[i], range(6)))
        assert [r[1] for r in got] == [2.0] * 6 and [r[0].anchor for r in got] == [(1, 1)] * 3 + [(2, 1)] * 3
        assert not any(r[2] or r[3]["failed"] for r in got)

        old_pid = m.worker_pids()[0]  # copies 0-2
        first = m.step_copies({0: "exit"})[0]
        assert first[2] and first[3]["failed"] and f"worker process {old_pid}" in first[3]["error"]
        assert m.worker_pids()[0] != old_pid and m.restarts == 1
        later = m.step_copies({1: "a", 2: "a", 3: "a"})
        assert later[1][2] and later[1][3]["failed"] and later[2][3]["failed"] and later[1][1] == 0.0
        assert not later[3][3]["failed"] and later[3][1] == 1.0 and later[3][0].anchor == (2, 2)
        m.reset([1, 2])
        assert not any(r[3]["failed"] for r in m.step_copies({i: "a" for i in range(6)}).values())
