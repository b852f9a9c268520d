"""run_on_ranks: results come back by rank; a failing or dying rank is reported, not hung on."""

from __future__ import annotations

import os

import pytest

from megatron_agent.platform.launch import RankFailed, run_on_ranks

pytestmark = pytest.mark.multirank


def _all_reduce_rank():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t)}


def _fail_on_rank_one():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one says no")
    return "ok"


def _die_on_rank_one():
    if os.environ["RANK"] == "1":
        os._exit(3)
    import time

    time.sleep(30)


def _sleep_with_pid_file(pid_dir):
    import time
    from pathlib import Path

    Path(pid_dir, os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(600)


LAUNCHER = """
import sys
from megatron_agent.platform.launch import run_on_ranks
from tests.unit.test_launch import _sleep_with_pid_file
run_on_ranks(_sleep_with_pid_file, 2, sys.argv[1], timeout_s=600)
"""


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL the process that called run_on_ranks (a CLI killed by the user or the OOM
    killer): its ranks go too, instead of training on as orphans."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=root)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.iterdir()]
        assert len(pids) == 2, "the ranks did not start"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
        assert not alive, f"ranks outlived their launcher: {alive}"
    finally:
        launcher.kill()


def test_results_by_rank():
    results = run_on_ranks(_all_reduce_rank, 2, timeout_s=60)
    assert results == [{"rank": 0, "world": 2, "sum": 3.0}, {"rank": 1, "world": 2, "sum": 3.0}]


def test_exception_is_reported_with_traceback():
    with pytest.raises(RankFailed, match="rank one says no"):
        run_on_ranks(_fail_on_rank_one, 2, timeout_s=60)


def test_dead_rank_is_reported():
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] exited without a result \(exit codes \{1: 3\}\)"):
        run_on_ranks(_die_on_rank_one, 2, timeout_s=60)


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_retried_on_a_fresh_one(monkeypatch):
    import socket

    from megatron_agent.platform import launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    fresh = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or fresh())
    try:
        assert [r["sum"] for r in run_on_ranks(_all_reduce_rank, 2, timeout_s=120)] == [3.0, 3.0]
    finally:
        taken.close()
    with pytest.raises(RankFailed, match="rank one says no"):  # other failures are not retried
        run_on_ranks(_fail_on_rank_one, 2, timeout_s=60)
