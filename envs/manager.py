"""The batched, grouped env manager: num_groups x group_size copies, one seed per group.

Copy i belongs to group i // group_size. Copies are sharded over a fixed set of
workers (contiguous slices); one message per worker per call carries the whole shard,
so the per-step overhead is one round trip per worker, not per copy.

Two ways to step: `step(texts)` steps every copy at once (lock-step);
`step_copies({copy: text})` steps some of them, and may be called from several threads
at once for disjoint copies (the asynchronous agent loop steps each episode as soon as
its response is back). Each worker serves one call at a time (a lock per worker);
copies of different workers step in parallel.

Backends:
- "process" (default): worker processes started with spawn (safe next to a trainer
  that holds torch and threads), one duplex pipe each. No Ray needed.
- "ray": one Ray actor per shard, for cluster runs (ray.init() is called if needed).
- "inline": the shards run in this process (debugging, tests, tiny runs).

Failure handling:
- An env copy that raises inside reset/step: the worker catches it, that copy's
  episode ends (done, info["failed"] = True, info["error"] = traceback) and the copy is
  rebuilt for the next reset. The rest of the batch is unaffected.
- A worker that dies (killed, segfault, out of memory) or exceeds step_timeout_s:
  it is restarted with fresh copies. Its copies that were mid-episode end as failed (the
  ones not in that call at their next step); its copies that had already finished keep
  their last result. A reset is retried once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from envs.base import Observation, make_info
from envs.registry import env_instructions, get_spec, make_config
from envs.workers import InlineWorker, ProcessWorker, RayWorker, WorkerDied, failed_info


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class EnvManager:
    """num_groups x group_size copies of one registered env.

    reset(seeds)  -> list[Observation]              one seed per group
    reset_groups({g: seed}) -> {i: Observation}     some groups, while others play on
    step(texts)   -> (list[Observation], rewards float64 [N], dones bool [N], infos list[dict])
    step_copies({i: text}) -> {i: (Observation, reward, done, info)}   some copies; thread-safe

    Copies that are already done are not stepped: their text is ignored (None is fine)
    and they come back with their last observation and info, reward 0.0, done True.
    """

    def __init__(
        self,
        name: str,
        config: Any = None,
        num_groups: int = 1,
        group_size: int = 1,
        backend: str = "process",
        num_workers: int | None = None,
        start_method: str = "spawn",
        step_timeout_s: float | None = None,
    ):
        if num_groups < 1 or group_size < 1:
            raise ValueError("num_groups and group_size must be >= 1")
        spec = get_spec(name)
        self.name = name
        self.config = make_config(name, config)
        self.num_groups, self.group_size = num_groups, group_size
        self.num_envs = num_groups * group_size
        self.group_ids = np.repeat(np.arange(num_groups), group_size)
        self.backend = backend
        self.instructions: str = env_instructions(name, self.config)

        if backend == "inline":
            num_workers = 1
        num_workers = max(1, min(num_workers or _available_cpus(), self.num_envs))
        self.shards = [s.tolist() for s in np.array_split(np.arange(self.num_envs), num_workers)]
        self._worker_of = np.empty(self.num_envs, dtype=np.int64)
        for w, shard in enumerate(self.shards):
            self._worker_of[shard] = w

        self.workers: list = []
        try:
            for shard in self.shards:
                if backend == "process":
                    worker = ProcessWorker(spec.env_cls, self.config, shard, start_method, step_timeout_s)
                elif backend == "ray":
                    worker = RayWorker(spec.env_cls, self.config, shard, step_timeout_s)
                elif backend == "inline":
                    worker = InlineWorker(spec.env_cls, self.config, shard)
                else:
                    raise ValueError(f"unknown backend {backend!r}; use 'process', 'ray' or 'inline'")
                self.workers.append(worker)
            for worker in self.workers:
                if isinstance(worker, ProcessWorker):
                    worker.wait_ready()
        except BaseException:
            self.close()
            raise

        self.observations: list[Observation] = [Observation(text="") for _ in range(self.num_envs)]
        self.infos: list[dict] = [make_info(True, False, failed=False) for _ in range(self.num_envs)]
        self.dones = np.ones(self.num_envs, dtype=bool)
        self.restarts = 0
        self._worker_locks = [threading.Lock() for _ in self.workers]
        self._restart_lock = threading.Lock()
        self._lost: dict[int, str] = {}  # mid-episode copies a worker restart took, and why

    # -- introspection -------------------------------------------------------
    def worker_pids(self) -> list[int | None]:
        return [w.pid for w in self.workers]

    def worker_of(self, env_index: int) -> int:
        return int(self._worker_of[env_index])

    # -- the API ---------------------------------------------------------------
    def reset(self, seeds: Sequence[int]) -> list[Observation]:
        if len(seeds) != self.num_groups:
            raise ValueError(
                f"reset() takes one seed per group: got {len(seeds)}, expected {self.num_groups}"
            )
        seed_of = [int(seeds[g]) for g in self.group_ids]
        payloads = {w: [(i, seed_of[i]) for i in shard] for w, shard in enumerate(self.shards)}
        with _held(self._worker_locks):
            results = self._round(
                "reset", payloads, on_death=lambda w, err: self._retry_reset(w, payloads[w], err)
            )
            self._lost.clear()
        for idx, obs, info in results:
            self.infos[idx] = info
            self.dones[idx] = info["failed"]
            self.observations[idx] = obs if obs is not None else Observation(text="")
        return list(self.observations)

    def reset_groups(self, seeds: Mapping[int, int]) -> dict[int, Observation]:
        """Reset the copies of some groups ({group: seed}) while the others play on;
        {copy: observation}. Safe to call from several threads for disjoint groups."""
        copies = [i for g in seeds for i in range(g * self.group_size, (g + 1) * self.group_size)]
        payloads: dict[int, list] = {}
        for i in copies:
            payloads.setdefault(self.worker_of(i), []).append((i, int(seeds[int(self.group_ids[i])])))
        with _held([self._worker_locks[w] for w in sorted(payloads)]):
            results = self._round(
                "reset", payloads, on_death=lambda w, err: self._retry_reset(w, payloads[w], err)
            )
            for i in copies:
                self._lost.pop(i, None)
        for idx, obs, info in results:
            self.infos[idx] = info
            self.dones[idx] = info["failed"]
            self.observations[idx] = obs if obs is not None else Observation(text="")
        return {i: self.observations[i] for i in copies}

    def step(
        self, texts: Sequence[str | None]
    ) -> tuple[list[Observation], np.ndarray, np.ndarray, list[dict]]:
        if len(texts) != self.num_envs:
            raise ValueError(f"step() takes one text per copy: got {len(texts)}, expected {self.num_envs}")
        results = self.step_copies(dict(enumerate(texts)))
        rewards = np.array([results[i][1] for i in range(self.num_envs)], dtype=np.float64)
        return list(self.observations), rewards, self.dones.copy(), [dict(i) for i in self.infos]

    def step_copies(self, texts: Mapping[int, str | None]) -> dict[int, tuple[Observation, float, bool, dict]]:
        """Step the named copies; {copy: (observation, reward, done, info)}. A copy that is
        done is not stepped (its last observation and info, reward 0.0). Safe to call from
        several threads for disjoint copies."""
        payloads: dict[int, list] = {}
        for i, text in texts.items():
            if not self.dones[i]:
                payloads.setdefault(self.worker_of(i), []).append((i, text))
        rewards = dict.fromkeys(texts, 0.0)

        def died(w, err):
            return [(i, None, 0.0, True, failed_info(err)) for i, _ in payloads[w]]

        with _held([self._worker_locks[w] for w in sorted(payloads)]):
            lost = {i: self._lost.pop(i) for _, items in payloads.items() for i, _ in items if i in self._lost}
            payloads = {w: [(i, t) for i, t in items if i not in lost] for w, items in payloads.items()}
            results = self._round("step", payloads, on_death=died)
        results += [(i, None, 0.0, True, failed_info(err)) for i, err in lost.items()]
        for idx, obs, reward, done, info in results:
            if obs is not None:
                self.observations[idx] = obs
            rewards[idx] = reward
            self.dones[idx] = done
            self.infos[idx] = info
        return {i: (self.observations[i], rewards[i], bool(self.dones[i]), dict(self.infos[i])) for i in texts}

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                w.close()
            except Exception:
                pass
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    # -- internals -------------------------------------------------------------
    def _round(self, cmd: str, payloads: dict[int, list], on_death) -> list:
        """Send each worker its payload, then gather; a dead worker is restarted and
        on_death(worker_index, error) supplies its results. The caller holds the workers' locks."""
        dead: dict[int, str] = {}
        busy = []
        for w, payload in payloads.items():
            if not payload:
                continue
            try:
                self.workers[w].send(cmd, payload)
                busy.append(w)
            except WorkerDied as e:
                dead[w] = str(e)
        results = []
        for w in busy:
            try:
                results.extend(self.workers[w].recv())
            except WorkerDied as e:
                dead[w] = str(e)
        for w, err in dead.items():
            called = {i for i, _ in payloads[w]}
            for i in self.shards[w]:  # the restart takes these copies' episodes too
                if not self.dones[i] and i not in called:
                    self._lost[i] = err
            self._restart(w)
            results.extend(on_death(w, err))
        return results

    def _restart(self, w: int) -> None:
        with self._restart_lock:
            self.restarts += 1
        self.workers[w].restart()

    def _retry_reset(self, w: int, payload: list, err: str) -> list:
        try:
            self.workers[w].send("reset", payload)
            return self.workers[w].recv()
        except WorkerDied as e:
            self._restart(w)
            return [(i, None, failed_info(f"{err}\nretry: {e}")) for i, _ in payload]



@contextmanager
def _held(locks: Sequence[threading.Lock]):
    """Hold several locks, taken in the given order (callers sort them: no deadlock)."""
    with ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield
