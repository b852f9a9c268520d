"""Nothing an env worker process started outlives the trainer, however the trainer dies
(issue 32): a trainer stand-in is SIGKILLed alone (not its process group) while its worker
processes start their copies' subprocesses. (The AppWorld server's own parent watch, and
a whole CPU run, are tested with AppWorld: tests/integration/envs/test_appworld.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from envs.base import Observation, make_info
from envs.registry import register_env
from tests.process_tree import alive_under

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class SleeperEnvConfig:
    reset_s: float = 0.5


class SleeperEnv:
    """Each reset starts a subprocess that never ends by itself (no parent watch of its own),
    then takes `reset_s`: a worker with several copies keeps starting them."""

    def __init__(self, config: SleeperEnvConfig):
        self.config, self.child = config, None

    def reset(self, seed: int) -> Observation:
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(self.config.reset_s)
        return Observation(text=f"child {self.child.pid}")

    def step(self, text: str):
        return Observation(text="x"), 0.0, True, make_info(True, False)


register_env("test_sleeper", SleeperEnv, SleeperEnvConfig)


def trainer_main() -> None:
    """The trainer stand-in: two worker processes with four copies each, reset forever."""
    from envs import EnvManager

    with EnvManager("test_sleeper", num_groups=4, group_size=2, num_workers=2) as envs:
        print("workers", *envs.worker_pids(), flush=True)
        while True:
            envs.reset([0, 1, 2, 3])


def wait_gone(procs: dict[int, psutil.Process], seconds: float, seen: dict) -> dict[int, psutil.Process]:
    """What is still alive of `procs` and what they start meanwhile after `seconds` (all of it added to `seen`)."""
    deadline = time.monotonic() + seconds
    while procs and time.monotonic() < deadline:
        time.sleep(0.05)
        procs = alive_under(list(procs.values()))
        seen.update(procs)
    return procs


def kill_all(procs) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def test_worker_processes_and_what_their_copies_started_end_with_the_trainer():
    trainer = subprocess.Popen([sys.executable, "-c", f"import {__name__} as t; t.trainer_main()"], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    try:
        workers = [psutil.Process(int(pid)) for pid in trainer.stdout.readline().split()[1:]]
        assert len(workers) == 2
        deadline = time.monotonic() + 60
        while not all(w.children() for w in workers):  # each worker has started a copy's subprocess
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen = alive_under([psutil.Process(trainer.pid)])
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        left = wait_gone({pid: p for pid, p in seen.items() if pid != trainer.pid}, 5, seen)
        assert not left, [" ".join(p.cmdline())[:100] for p in left.values() if p.is_running()]
    finally:
        trainer.kill()
        kill_all(seen.values())
