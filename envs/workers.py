"""The workers behind EnvManager: EnvShard (the env copies one worker owns) and the three
ways to run one (InlineWorker in this process, ProcessWorker in a spawned process,
RayWorker as a Ray actor). A worker that dies or times out raises WorkerDied; the
manager restarts it (see envs.manager for the failure handling).

Nothing outlives the trainer: a worker process leads a process group of its own (its
env copies' servers and simulators are in it) and ends that group when the process that
started it is gone, however it died (SIGKILL, the kernel's OOM killer). It polls
os.getppid() rather than asking for PR_SET_PDEATHSIG, which fires when the *thread* that
started the worker ends: the manager restarts workers from the rollout's pool threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from envs.base import Observation, make_info, with_anchor_digest


class WorkerDied(Exception):
    pass


PARENT_POLL_S = 0.2  # how often a worker process looks for its parent
CLOSE_TIMEOUT_S = 10.0  # for a worker to close its copies (their servers) before it is killed


def lead_own_process_group() -> bool:
    """Make this process the leader of a new process group (what it starts joins it);
    False where it cannot (a session leader)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        return False
    return True


def end_worker() -> None:
    """SIGKILL this worker and, when it leads its own process group, everything in it:
    the servers and simulators its env copies started. Never the trainer's group."""
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def parent_gone(parent_pid: int) -> bool:
    """Whether `parent_pid` is no longer this process's parent: it died and this process
    was handed to init or a subreaper."""
    return os.getppid() != parent_pid


def end_with_parent(parent_pid: int) -> None:
    """A daemon thread that calls `end_worker` once `parent_pid` is gone (checked at once,
    so a parent that died before this call counts too)."""

    def watch() -> None:
        while not parent_gone(parent_pid):
            time.sleep(PARENT_POLL_S)
        end_worker()

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def kill_worker(proc) -> None:
    """SIGKILL worker process `proc` and its process group: what its copies started dies
    with it. A pid is not reused while a process group of that id has members, so the group
    holds only the worker's own; a worker not yet leading one is killed alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.exitcode is None:  # not reaped: the pid is still the worker's
        proc.kill()


def failed_info(error: str) -> dict:
    # The copy broke, not the model's text: is_action_valid stays True so the trainer
    # adds no invalid-action penalty; the agent loop drops episodes with failed=True.
    return make_info(True, False, failed=True, error=error)


class EnvShard:
    """The env copies one worker owns. Runs inside the worker (or inline)."""

    def __init__(self, env_cls: type, config: Any, indices: Sequence[int], parent_pid: int | None = None):
        self.env_cls, self.config = env_cls, config
        self.parent_pid = parent_pid  # a worker process's trainer: its copies stop when it is gone
        self.envs = {int(i): env_cls(config) for i in indices}

    def pid(self) -> int:
        return os.getpid()

    def _stop_if_orphaned(self) -> None:
        """Before each copy's reset, step or rebuild: a worker whose trainer is gone starts
        nothing more (an env copy may start a server on reset or rebuild)."""
        if self.parent_pid is not None and parent_gone(self.parent_pid):
            end_worker()

    def close(self) -> None:
        """Close the copies that hold something (a server process): `close()` where an env has it."""
        for env in self.envs.values():
            close = getattr(env, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass

    def _rebuild(self, idx: int) -> None:
        self._stop_if_orphaned()
        try:
            fresh = self.env_cls(self.config)
        except Exception:  # keep the old copy; its next reset reports any lasting fault
            return
        old, self.envs[idx] = self.envs[idx], fresh
        try:
            getattr(old, "close", lambda: None)()
        except Exception:
            pass

    def reset(self, items: list[tuple[int, int]]) -> list[tuple[int, Observation | None, dict]]:
        out = []
        for idx, seed in items:
            self._stop_if_orphaned()
            try:
                obs = with_anchor_digest(self.envs[idx].reset(seed))
                out.append((idx, obs, make_info(True, False, failed=False)))
            except Exception:
                out.append((idx, None, failed_info(traceback.format_exc())))
                self._rebuild(idx)
        return out

    def step(self, items: list[tuple[int, str]]) -> list[tuple[int, Observation | None, float, bool, dict]]:
        out = []
        for idx, text in items:
            self._stop_if_orphaned()
            try:
                obs, reward, done, info = self.envs[idx].step(text)
                info.setdefault("failed", False)
                out.append((idx, with_anchor_digest(obs), float(reward), bool(done), info))
            except Exception:
                out.append((idx, None, 0.0, True, failed_info(traceback.format_exc())))
                self._rebuild(idx)
        return out


def worker_main(conn, env_cls, config, indices, parent_pid: int | None) -> None:
    """`parent_pid`: the trainer's pid (None under forkserver, where the parent is the fork
    server, which exits with the trainer: this process's parent at start is taken)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes us
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    lead_own_process_group()
    end_with_parent(parent_pid)
    try:
        shard = EnvShard(env_cls, config, indices, parent_pid=parent_pid)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                cmd, payload = conn.recv()
            except (EOFError, OSError):
                return
            if cmd == "close":
                return
            conn.send(getattr(shard, cmd)(payload))
    finally:
        shard.close()


class InlineWorker:
    def __init__(self, env_cls, config, indices):
        self.shard = EnvShard(env_cls, config, indices)
        self._result = None

    pid = None

    def send(self, cmd, payload):
        self._result = getattr(self.shard, cmd)(payload)

    def recv(self):
        return self._result

    def restart(self):
        pass

    def close(self):
        self.shard.close()


class ProcessWorker:
    def __init__(self, env_cls, config, indices, start_method: str, timeout_s: float | None):
        self.args = (env_cls, config, list(indices))
        self.ctx = mp.get_context(start_method)
        self.timeout_s = timeout_s
        self.proc = None
        self.conn = None
        self._start()

    def _start(self):
        parent, child = self.ctx.Pipe(duplex=True)
        self.proc = self.ctx.Process(target=worker_main, args=(child, *self.args, self._parent_pid()),
                                     daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.pid = None

    def _parent_pid(self) -> int | None:
        return None if self.ctx.get_start_method() == "forkserver" else os.getpid()

    def wait_ready(self):
        try:
            kind, value = self._recv(timeout_s=None)
        except WorkerDied as e:
            raise RuntimeError(f"env worker failed to start: {e}") from None
        if kind == "error":
            self.proc.join(5)
            raise RuntimeError(f"env worker could not build its env copies:\n{value}")
        self.pid = value

    def _recv(self, timeout_s):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise WorkerDied(f"worker process {self.proc.pid} died (exit code {self.proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                kill_worker(self.proc)
                raise WorkerDied(f"worker process {self.proc.pid} exceeded step_timeout_s={timeout_s}")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1)
            raise WorkerDied(
                f"worker process {self.proc.pid} died (exit code {self.proc.exitcode})"
            ) from None

    def send(self, cmd, payload):
        try:
            self.conn.send((cmd, payload))
        except (BrokenPipeError, EOFError, OSError):
            raise WorkerDied(f"worker process {self.proc.pid} is gone") from None

    def recv(self):
        return self._recv(self.timeout_s)

    def restart(self):
        self._stop(graceful=False)
        self._start()
        self.wait_ready()

    def _stop(self, graceful: bool):
        if self.proc is None:
            return
        if graceful and self.proc.is_alive():
            try:
                self.conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(CLOSE_TIMEOUT_S)
        if not graceful or self.proc.is_alive():
            kill_worker(self.proc)
        self.proc.join(5)
        self.conn.close()
        self.proc = None

    def close(self):
        self._stop(graceful=True)


class RayWorker:
    def __init__(self, env_cls, config, indices, timeout_s: float | None):
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        self.ray = ray
        self.remote_cls = ray.remote(num_cpus=1)(EnvShard)
        self.args = (env_cls, config, list(indices))
        self.timeout_s = timeout_s
        self._start()

    def _start(self):
        self.actor = self.remote_cls.remote(*self.args)
        self.pid = self.ray.get(self.actor.pid.remote())
        self._future = None

    def send(self, cmd, payload):
        self._future = getattr(self.actor, cmd).remote(payload)

    def recv(self):
        try:
            return self.ray.get(self._future, timeout=self.timeout_s)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
            raise WorkerDied(f"ray env actor died: {type(e).__name__}: {e}") from None

    def restart(self):
        self.ray.kill(self.actor, no_restart=True)
        self._start()

    def close(self):
        self.ray.kill(self.actor, no_restart=True)
