"""The batched, grouped env manager: num_groups x group_size copies, one seed per group.

Copy i belongs to group i // group_size. Copies are sharded over a fixed set of
workers (contiguous slices); one message per worker per call carries the whole shard,
so the per-step overhead is one round trip per worker, not per copy.

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
  it is restarted with fresh copies. Its copies that were mid-episode end as failed;
  its copies that had already finished keep their last result. A reset is retried once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from envs.base import Observation, make_info
from envs.registry import get_spec, make_config
from envs.workers import InlineWorker, ProcessWorker, RayWorker, WorkerDied, failed_info


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class EnvManager:
    """num_groups x group_size copies of one registered env.

    reset(seeds)  -> list[Observation]              one seed per group
    step(texts)   -> (list[Observation], rewards float64 [N], dones bool [N], infos list[dict])

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
        describe = getattr(spec.env_cls, "instructions_for", None)
        # The task description and action format, for the agent loop's system prompt.
        self.instructions: str = describe(self.config) if describe is not None else ""

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
        payloads = [[(i, seed_of[i]) for i in shard] for shard in self.shards]
        results = self._round(
            "reset", payloads, on_death=lambda w, err: self._retry_reset(w, payloads[w], err)
        )
        for idx, obs, info in results:
            self.infos[idx] = info
            self.dones[idx] = info["failed"]
            self.observations[idx] = obs if obs is not None else Observation(text="")
        return list(self.observations)

    def step(
        self, texts: Sequence[str | None]
    ) -> tuple[list[Observation], np.ndarray, np.ndarray, list[dict]]:
        if len(texts) != self.num_envs:
            raise ValueError(f"step() takes one text per copy: got {len(texts)}, expected {self.num_envs}")
        payloads = [[(i, texts[i]) for i in shard if not self.dones[i]] for shard in self.shards]
        rewards = np.zeros(self.num_envs, dtype=np.float64)

        def died(w, err):
            return [(i, None, 0.0, True, failed_info(err)) for i, _ in payloads[w]]

        for idx, obs, reward, done, info in self._round("step", payloads, on_death=died):
            if obs is not None:
                self.observations[idx] = obs
            rewards[idx] = reward
            self.dones[idx] = done
            self.infos[idx] = info
        return list(self.observations), rewards, self.dones.copy(), [dict(i) for i in self.infos]

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
    def _round(self, cmd: str, payloads: list[list], on_death) -> list:
        """Send each worker its payload, then gather; a dead worker is restarted and
        on_death(worker_index, error) supplies its results."""
        dead: dict[int, str] = {}
        busy = []
        for w, payload in enumerate(payloads):
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
            self._restart(w)
            results.extend(on_death(w, err))
        return results

    def _restart(self, w: int) -> None:
        self.restarts += 1
        self.workers[w].restart()

    def _retry_reset(self, w: int, payload: list, err: str) -> list:
        try:
            self.workers[w].send("reset", payload)
            return self.workers[w].recv()
        except WorkerDied as e:
            self._restart(w)
            return [(i, None, failed_info(f"{err}\nretry: {e}")) for i, _ in payload]
