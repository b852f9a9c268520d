"""Rollout workers: each owns whole env groups and all the per-sample work on them.

    workers = RolloutWorkers(config, model_dir)              # on the leader (rank 0)
    collected = workers.collect(iteration, engine_urls)      # per-sample lengths come back, no tokens
    batch = fetch_batch(workers, collected, dp, ...)        # worker_batches.py: each DP rank's shard

Worker k of W (rollout_worker.py) owns the groups `worker_groups(num_groups, W)[k]`: their
env copies (an EnvManager), the prompts and the tokenizer, an engine client over its share of
the engines (`worker_engine_urls`; a trajectory's steps stick to one engine, for its prefix
cache) and the step samples. It computes its groups' advantages itself (algorithms/group_advantages.py:
GiGPO's episode groups and the step groups inside them are all its own); a batch-wide
estimator gets the moments of the whole batch from the coordinator.

The coordinator (`RolloutWorkers`, on rank 0) sees per-sample lengths and group ids only. It
orders the samples as one process would (by group, then trajectory and step; `whole_order`),
assigns them to the DP ranks by tokens (`assign_by_tokens`), and the first rank of each DP
index fetches its rows from the workers itself (worker_batches.py: from Ray actors, so the bytes
go from the worker's node to the trainer's) and shares them with its TP/PP/CP peers. Rank 0
keeps the seeds, the metrics (from episode summaries), the weight sync and checkpoints.

W = 1 (the default): the worker is an object in rank 0's process, which scatters the shards
as before. W > 1: Ray actors (in a local Ray instance when the run is not on one), spread
over the nodes, at most one per node with `rollout.node_resource`.

A worker that dies (its process killed, its node lost) is replaced and this rollout's calls
are replayed on the new one: the same seeds give the same episodes, so no group is lost or
counted twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_agent.rollout_worker import RolloutWorker

log = logging.getLogger(__name__)


@dataclass
class RolloutWorkersConfig:
    workers: int = 1  # W: each owns num_groups / W whole groups; 1: in rank 0's process
    cpus_per_worker: float = 1.0  # what each worker's Ray actor asks for
    # A custom Ray resource that each rollout node offers once (e.g. `ray start --resources
    # '{"rollout_node": 1}'`): each worker asks for one, so one worker runs per such node.
    # None: Ray spreads the workers over the nodes as it can.
    node_resource: str | None = None
    max_restarts: int = 3  # workers replaced per iteration before the run gives up

    def validate(self, num_groups: int) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1")
        if self.workers > num_groups:
            raise ValueError(f"workers={self.workers}: a worker owns whole groups and the run has "
                             f"num_groups={num_groups}; set rollout.workers <= {num_groups}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker={self.cpus_per_worker} must be > 0")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0")


def whole_order(group_ids: Sequence[np.ndarray]) -> np.ndarray:
    """Each worker's samples' group ids (each worker's in its own (group, trajectory,
    step) order) -> the whole batch as (worker, row) pairs [N, 2], ordered by group as one
    process orders its samples. A group is one worker's, so its rows stay together."""
    sources = np.array([(k, r) for k, ids in enumerate(group_ids) for r in range(len(ids))],
                       dtype=np.int64).reshape(-1, 2)
    keys = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in group_ids]) if group_ids else np.zeros(0)
    return sources[np.argsort(keys, kind="stable")]


def summed(parts: list[dict | None]) -> dict[str, float]:
    """The key-wise sum of the dicts in `parts` (None and {} count as nothing)."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in (part or {}).items():
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass
class Collected:
    """A rollout, as the coordinator holds it: no token, no image."""

    iteration: int
    sources: np.ndarray  # int64 [N, 2]: the (worker, row) of each sample of the whole batch
    lengths: np.ndarray  # int64 [N]: tokens of each sample, in whole-batch order
    moments: object  # the whole batch's Moments (batch-wide estimators), else None
    metrics: dict[str, float]
    episodes: list  # the first whole group's episodes, as step samples (for run_dir/samples)
    mean_weight_version: float
    positions: list[np.ndarray] = field(default_factory=list)  # per DP rank, once assigned (fetch_batch)

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


class WorkerLost(RuntimeError):
    """More rollout workers died in one iteration than rollout.max_restarts allows."""


class RolloutWorkers:
    """The coordinator (rank 0): starts the workers, runs their rollouts and replaces the
    ones that die. `make_worker(index)`: worker objects in this process instead (tests)."""

    def __init__(self, config, model_dir: str | None, *, make_worker=None, on_progress=None):
        """`on_progress(label)`: the progress callback of the agent loop for a rollout so
        labelled (the counts of all workers, summed)."""
        self.config, self.model_dir, self.on_progress = config, model_dir, on_progress
        self.count = config.rollout.workers
        self.remote = self.count > 1 and make_worker is None
        self.namespace = f"megatron-agent-{uuid.uuid4().hex[:12]}"
        self.started_ray = False
        self.restarts = self.iteration_restarts = 0
        self.generation = [0] * self.count
        self.calls: list[list[tuple]] = [[] for _ in range(self.count)]  # this rollout's, replayed on a replacement
        self.handles: list = []
        try:
            if self.remote:
                from megatron_agent.launcher import ensure_ray

                r, p = config.rollout, config.placement
                self.started_ray = ensure_ray(p, cpus=r.workers * r.cpus_per_worker + p.cpus_per_trainer)
            self.handles = [make_worker(k) if make_worker else self._start(k) for k in range(self.count)]
        except BaseException:
            self.close()
            raise

    # -- workers ----------------------------------------------------------------------

    def name(self, k: int) -> str:
        return f"rollout-worker-{k}-{self.generation[k]}"

    def _start(self, k: int):
        if not self.remote:
            return RolloutWorker(self.config, k, self.model_dir)
        import ray

        r = self.config.rollout
        options = {"name": self.name(k), "namespace": self.namespace, "num_cpus": r.cpus_per_worker,
                   "max_restarts": 0, "max_concurrency": 2}  # 2: `progress` while `roll_out` runs
        if r.node_resource:
            options["resources"] = {r.node_resource: 1}
        else:
            options["scheduling_strategy"] = "SPREAD"
        return ray.remote(RolloutWorker).options(**options).remote(self.config, k, self.model_dir)

    def _replace(self, k: int, reason: str) -> None:
        """A new worker k in place of the dead one, brought to where the dead one was by
        replaying this rollout's calls."""
        import ray

        self.restarts += 1
        self.iteration_restarts += 1
        if self.iteration_restarts > self.config.rollout.max_restarts:
            raise WorkerLost(f"rollout worker {k} died ({reason}) and {self.iteration_restarts - 1} workers were "
                             f"already replaced this iteration (rollout.max_restarts="
                             f"{self.config.rollout.max_restarts})")
        log.warning("rollout worker %d died (%s); a new one rolls out its groups again", k, reason.splitlines()[0])
        ray.kill(self.handles[k])
        self.generation[k] += 1
        self.handles[k] = self._start(k)
        for method, args in self.calls[k]:
            ray.get(getattr(self.handles[k], method).remote(*args))

    def call(self, method: str, args: Sequence[tuple], *, record: bool = True) -> list:
        """`method(*args[k])` on every worker k (at once when they are Ray actors); a
        worker that dies is replaced (`_replace`) and asked again."""
        if not self.remote:
            results = [getattr(h, method)(*a) for h, a in zip(self.handles, args)]
        else:
            import ray
            from ray.exceptions import RayActorError

            refs = [getattr(h, method).remote(*a) for h, a in zip(self.handles, args)]
            results = [None] * self.count
            for k, ref in enumerate(refs):
                while True:
                    try:
                        results[k] = ray.get(ref)
                        break
                    except RayActorError as err:
                        self._replace(k, str(err))
                        ref = getattr(self.handles[k], method).remote(*args[k])
        if record:
            for k, a in enumerate(args):
                self.calls[k].append((method, a))
        return results

    def cpu_seconds(self) -> list[float]:
        return self.call("cpu_seconds", [()] * self.count, record=False)

    def pids(self) -> list[int]:
        return self.call("pid", [()] * self.count, record=False)

    # -- a rollout --------------------------------------------------------------------

    def collect(self, iteration: int, urls: list[str], *, keep_episodes: int = 0) -> Collected:
        """Every worker rolls out its groups (with dynamic sampling: tries until enough
        groups have a learning signal, as `enough_groups` says, and keeps the lowest-numbered
        of them); returns the rollout as the coordinator holds it."""
        from megatron_agent.algorithms import enough_groups
        from rollout.agent_loop import summary_metrics

        config, every = self.config, range(self.count)
        self.calls = [[] for _ in every]
        self.iteration_restarts = 0
        self.call("set_engines", [(list(urls),)] * self.count)
        self.call("begin", [(iteration,)] * self.count)
        show = self.on_progress(f"rollout of iteration {iteration}") if self.on_progress is not None else None
        if not self.remote:
            self.handles[0].on_progress = show
        kept, dropped, attempt, first = [], 0, 0, None
        while True:
            with self._showing_progress(show):
                tries = self.call("roll_out", [(iteration, attempt, keep_episodes if k == 0 else 0) for k in every])
            first = first or tries
            kept += [g for t in tries for g in t.kept_groups]
            dropped += sum(t.dropped_groups for t in tries)
            attempt += 1
            if not config.algorithm.dynamic_sampling or enough_groups(
                    len(kept), config.num_groups, attempt, config.algorithm.dynamic_sampling_max_tries):
                break
        chosen = sorted(kept)[:config.num_groups] if config.algorithm.dynamic_sampling else None
        metrics = summary_metrics([e for t in first for e in t.summaries])
        slowest = max(first, key=lambda t: t.metrics.get("rollout/time_s", 0.0)).metrics
        metrics.update({k: v for k, v in slowest.items() if k.startswith("rollout/time") or k.endswith("_share")})
        if config.algorithm.dynamic_sampling:
            metrics.update({"rollout/dynamic_sampling_tries": float(attempt),
                            "rollout/dynamic_sampling_dropped_groups": float(dropped),
                            "rollout/dynamic_sampling_kept_groups": float(len(chosen))})
            if not chosen:
                raise RuntimeError(f"dynamic sampling: every group of {attempt} rollouts had equal episode scores; "
                                   "nothing to train on (raise algorithm.dynamic_sampling_max_tries)")
        return self._kept(iteration, chosen, metrics, first[0].episodes)

    def take_stream(self, iteration: int, urls: list[str]) -> Collected:
        """training.mode=async: iteration `iteration`'s groups from the workers' streams
        (rollout_stream.py), the engines holding weights `iteration`."""
        from megatron_agent.rollout_stream import stream_metrics
        from rollout.agent_loop import summary_metrics

        self.calls = [[] for _ in range(self.count)]
        self.iteration_restarts = 0
        self.call("set_engines", [(list(urls),)] * self.count)
        show = self.on_progress("the rollout stream") if self.on_progress is not None else None
        if not self.remote:
            self.handles[0].on_progress = show
        with self._showing_progress(show):
            tries = self.call("take_groups", [(iteration, iteration)] * self.count)
        metrics = summary_metrics([e for t in tries for e in t.summaries])
        metrics.update(stream_metrics([t.metrics for t in tries]))
        return self._kept(iteration, None, metrics, tries[0].episodes)

    def _kept(self, iteration: int, chosen: list[int] | None, metrics: dict, episodes: list) -> Collected:
        """The workers keep `chosen` of their groups (None: all) and compute their part of
        the advantages; the rollout as the coordinator holds it."""
        from megatron_agent.algorithms.gigpo import gigpo_diagnostics
        from megatron_agent.algorithms.group_advantages import combine_moments

        batches = self.call("keep", [(iteration, chosen)] * self.count)
        metrics.update(gigpo_diagnostics(summed([b.diagnostics for b in batches])))
        sources = whole_order([b.group_ids for b in batches])
        lengths = np.array([batches[k].lengths[r] for k, r in sources], dtype=np.int64)
        versions = np.concatenate([b.weight_versions for b in batches])
        return Collected(iteration, sources, lengths, combine_moments([b.moments for b in batches]), metrics,
                         episodes, float(versions.mean()) if versions.size else 0.0)

    @contextlib.contextmanager
    def _showing_progress(self, show, interval_s: float = 0.5):
        """While the body runs, the Ray workers' rollout counts, summed, go to `show` every
        `interval_s` (W = 1 reports from inside its rollout)."""
        if show is None or not self.remote:
            yield
            return
        import ray

        from rollout.progress import RolloutProgress

        done = threading.Event()

        def poll():
            while not done.wait(interval_s):
                try:
                    counts = [c for c in ray.get([h.progress.remote() for h in self.handles], timeout=interval_s * 4)
                              if c is not None]
                except Exception:  # noqa: BLE001 - a worker being replaced: the next poll shows it
                    continue
                if counts:
                    show(RolloutProgress(*(sum(getattr(c, f) for c in counts) for f in (
                        "episodes", "episodes_done", "steps_done", "requests_in_flight"))))

        poller = threading.Thread(target=poll, name="rollout-progress", daemon=True)
        poller.start()
        try:
            yield
        finally:
            done.set()
            poller.join()

    def rows_of(self, sources: np.ndarray) -> list[np.ndarray]:
        """Per worker, its rows among `sources` ((worker, row) pairs), in their order there."""
        return [sources[sources[:, 0] == k, 1] for k in range(self.count)]

    def fetch(self, iteration: int, sources: np.ndarray, moments) -> list[dict]:
        """(Local fetch) each worker's shard of `sources`, in worker order."""
        return self.call("shard", [(iteration, r, moments) for r in self.rows_of(sources)], record=False)

    def step_advantages(self, collected: Collected) -> list[list[float | None]]:
        """The advantages of `collected.episodes`' steps as the trainer gets them, from the
        worker that keeps each (None: a step no worker keeps, e.g. a failed episode's)."""
        steps = [(s.traj_id, s.step_index) for e in collected.episodes for s in e]
        found = self.call("step_advantages", [(collected.iteration, steps, collected.moments)] * self.count,
                          record=False)
        flat = iter([next((a[i] for a in found if a[i] is not None), None) for i in range(len(steps))])
        return [[next(flat) for _ in e] for e in collected.episodes]

    def snapshot(self, collected: Collected) -> dict:
        """A rollout done ahead, whole, for a checkpoint (`restore` reads it back)."""
        return {"collected": collected,
                "samples": self.call("samples", [(collected.iteration,)] * self.count, record=False)}

    def restore(self, snapshot: dict) -> Collected:
        collected = snapshot["collected"]
        self.call("restore", [(collected.iteration, s) for s in snapshot["samples"]], record=False)
        return collected

    def gae_advantages(self, collected: Collected, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """GAE: the critic's values in whole-batch order -> (advantages, returns) in that order."""
        from megatron_agent.algorithms.group_advantages import combine_moments

        values = np.asarray(values, dtype=np.float64)
        per_worker = [np.zeros(int((collected.sources[:, 0] == k).sum())) for k in range(self.count)]
        for position, (k, row) in enumerate(collected.sources):
            per_worker[k][row] = values[position]
        it = collected.iteration
        moments = combine_moments(self.call("gae_partial", [(it, v) for v in per_worker]))
        done = self.call("advantages", [(it, moments)] * self.count)
        advantages, returns = np.zeros(collected.size), np.zeros(collected.size)
        for position, (k, row) in enumerate(collected.sources):
            advantages[position], returns[position] = done[k][0][row], done[k][1][row]
        return advantages, returns

    def close(self) -> None:
        if self.remote:
            import ray

            for h in self.handles:
                try:
                    ray.get(h.close.remote(), timeout=30)
                except Exception as err:  # noqa: BLE001 - a dead worker has nothing to close
                    log.debug("rollout worker did not close cleanly: %s", err)
                ray.kill(h)
            if self.started_ray:
                ray.shutdown()
        else:
            for h in self.handles:
                h.close()
