"""One rollout worker: what runs in its Ray actor (or, W = 1, in rank 0's process).

Worker k of W owns the groups `worker_groups(num_groups, W)[k]`: their env copies (an
EnvManager), the prompts and the tokenizer, an engine client over its share of the engines
(`worker_engine_urls`; a trajectory's steps stick to one engine, for its prefix cache) and
the step samples of the rollouts it holds (this iteration's, and the next one's with
training.mode=overlap), with their groups' advantages as far as its own groups decide them. The
coordinator that drives the workers is rollout_workers.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def worker_groups(num_groups: int, workers: int) -> list[range]:
    """The groups each worker owns: contiguous ranges whose sizes differ by at most one."""
    bounds = np.linspace(0, num_groups, workers + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def worker_engine_urls(urls: Sequence[str], workers: int, index: int) -> list[str]:
    """The engines worker `index` sends to: every W-th one from its index when there are
    at least W engines (so workers do not share an engine's prefix cache), else all."""
    urls = list(urls)
    return urls[index::workers] if len(urls) >= workers else urls


@dataclass
class WorkerTry:
    """One try of a worker's rollout (dynamic sampling may take several)."""

    kept_groups: list[int]  # the groups kept (all of them without dynamic sampling)
    dropped_groups: int
    summaries: list  # rollout.agent_loop.EpisodeSummary, one per episode
    metrics: dict[str, float]  # the worker's rollout metrics (timings among them)
    episodes: list  # the first whole groups' episodes asked for, as step samples (for run_dir/samples)


@dataclass
class WorkerBatch:
    """What the coordinator learns of a worker's kept samples: a few numbers each."""

    lengths: np.ndarray  # int64 [n]: prompt + response tokens
    group_ids: np.ndarray  # int64 [n]
    weight_versions: np.ndarray  # int64 [n]: the engine weights that generated each
    moments: object  # algorithms.group_advantages.Moments of a batch-wide estimator, or None
    diagnostics: dict | None = None  # GiGPO: algorithms.gigpo.gigpo_diagnostic_sums of its samples


class RolloutWorker:
    """One worker: its groups' env copies, prompts, engine client and samples. A plain
    object (W = 1) or the body of a Ray actor (W > 1). `envs`, `tokenizer` and `engine`
    replace what it would make (tests, benchmarks)."""

    def __init__(self, config, index: int, model_dir: str | None, *, envs=None, tokenizer=None, engine=None):
        from rollout.vision import load_image_processor

        self.config, self.index, self.model_dir = config, index, model_dir
        self.groups = worker_groups(config.num_groups, config.rollout.workers)[index]
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        self.image_processor = load_image_processor(model_dir) if model_dir else None
        if envs is None:
            from envs import EnvManager

            played = len(self.groups)  # async: the worker's share of the groups in flight
            if config.training.mode == "async":
                played = len(worker_groups(config.training.inflight_groups(config.num_groups),
                                           config.rollout.workers)[index])
            envs = EnvManager(config.env, config.env_config, num_groups=played,
                              group_size=config.group_size, backend=config.env_backend,
                              num_workers=config.env_workers)
        self.envs, self.engine, self.urls = envs, engine, None
        self.own_engine_client = engine is None
        self.held: dict[int, HeldRollout] = {}  # by iteration: the rollout being trained on, and the next
        self.on_progress = None  # W = 1: the run's progress display (rollout/progress.py), set by the coordinator
        self.latest_progress = None  # the running rollout's counts (rollout.progress.RolloutProgress), for `progress`
        # training.mode=async: the group stream, the groups it finished, tickets to play again
        self.stream = None
        self.ready: list = []  # rollout.group_stream.FinishedGroup, not taken yet
        self.replay: list = []  # rollout.group_stream.GroupTicket of groups cut off in flight
        self.next_ticket = 0  # tickets issued, counted from the first iteration streamed
        self.dropped = 0  # groups dropped as stale: as many more are admitted
        self.first_streamed = self.version = 0

    def pid(self) -> int:
        import os

        return os.getpid()

    def cpu_seconds(self) -> float:
        """CPU time of this process so far (all its threads)."""
        return time.process_time()

    def set_engines(self, urls: list[str]) -> None:
        from rollout.engine_launch import engine_client

        mine = worker_engine_urls(urls, self.config.rollout.workers, self.index)
        if not self.own_engine_client or mine == self.urls:
            return
        self._stop_stream()  # new engines: the groups in flight play again on them
        if self.engine is not None:
            self.engine.close()
        self.engine, self.urls = engine_client(self.config.engine, mine, self.model_dir), mine

    def begin(self, iteration: int) -> None:
        self.held = {i: h for i, h in self.held.items() if i == iteration - 1}  # training.mode=overlap: the one training
        self.held[iteration] = HeldRollout()

    def roll_out(self, iteration: int, attempt: int, keep_episodes: int = 0) -> WorkerTry:
        """Roll out this worker's groups with the seeds of (iteration, attempt); with
        dynamic sampling keep only its groups whose episodes did not all score the same."""
        from megatron_agent.algorithms import filter_zero_variance_groups
        from megatron_agent.samples import rollout_seeds
        from rollout.agent_loop import run_rollout

        config, groups = self.config, self.groups
        seeds = rollout_seeds(config, iteration, attempt)[groups.start:groups.stop]
        rollout = run_rollout(self.envs, self.engine, self.tokenizer, config.loop, seeds, rollout_index=iteration,
                              first_group=attempt * config.num_groups + groups.start,
                              image_processor=self.image_processor, on_progress=self._report)
        kept, dropped = rollout.samples, 0
        if config.algorithm.dynamic_sampling:
            scores = np.array([s.episode_return for s in kept])
            keep = filter_zero_variance_groups(scores, [s.group_id for s in kept])
            kept, dropped = [s for s, k in zip(kept, keep.keep) if k], keep.num_dropped
        self.held[iteration].samples += kept
        return WorkerTry(sorted({s.group_id for s in kept}), dropped, rollout.summaries, rollout.metrics,
                         [[shown_copy(s) for s in e] for e in whole_groups(rollout.episodes, keep_episodes, kept)])

    def _report(self, counts) -> None:
        self.latest_progress = counts
        if self.on_progress is not None:
            self.on_progress(counts)

    def progress(self):
        """The running rollout's counts (None before the first); answered while `roll_out`
        runs (the actor serves two calls at once)."""
        return self.latest_progress

    # -- training.mode=async ------------------------------------------------------------

    def take_groups(self, iteration: int, version: int) -> WorkerTry:
        """Iteration `iteration`'s groups from the stream (started on the first call): this
        worker's share of num_groups, the lowest-numbered of those finished whose tokens are
        at most training.max_staleness versions behind `version` (the engines' weights, from
        which the stream's admission now counts); older ones are dropped."""
        from collections import Counter

        from rollout.group_stream import GroupStream, version_lag_tokens

        config = self.config
        self.version = version
        if self.stream is not None and self.stream.play.errors:  # it failed the last take: a new one
            self._stop_stream()
        if self.stream is None:
            if not self.next_ticket:
                self.first_streamed = iteration
            self.stream = GroupStream(self.envs, self.engine, self.tokenizer, config.loop, self._admit,
                                      image_processor=self.image_processor, on_progress=self._report)
            self.stream.start()
        else:
            self.stream.wake()
        self.begin(iteration)
        wanted, dropped, taken = len(self.groups), 0, []
        while len(taken) < wanted:
            self.ready += self.stream.take(max(0, wanted - len(taken) - len(self.ready)))
            self.ready.sort(key=lambda f: f.ticket.group_id)
            while self.ready and len(taken) < wanted:
                group = self.ready.pop(0)
                oldest = min((weight_version_number(v) for v in group.version_tokens), default=version)
                if version - oldest > config.training.max_staleness:
                    dropped += 1
                    self.dropped += 1
                else:
                    taken.append(group)
        samples = [s for g in taken for s in g.samples]
        self.held[iteration].samples += samples
        lags = version_lag_tokens(sum((Counter(g.version_tokens) for g in taken), Counter()), version,
                                  weight_version_number)
        counts = {f"lag_tokens/{k}": float(n) for k, n in lags.items()}  # rollout_stream.stream_metrics
        counts.update({"dropped_groups": float(dropped), "samples": float(len(samples)),
                       "partial_samples": float(sum(len(set(s.token_versions)) > 1 for s in samples)),
                       **self.stream.clocks_since_last()})
        episodes = [[shown_copy(s) for s in e] for g in taken[:1] for e in trajectories(g.samples)]  # a whole group
        return WorkerTry(sorted(g.ticket.group_id for g in taken), dropped, [e for g in taken for e in g.summaries],
                         counts, episodes)

    def _admit(self):
        """The stream's next group (called under its lock), or None while it would start more
        than training.max_staleness versions ahead of the engines' weights (counting the
        groups kept: one dropped as stale is made up for)."""
        from megatron_agent.samples import rollout_seeds
        from rollout.group_stream import GroupTicket

        if self.replay:
            return self.replay.pop(0)
        per_iteration = len(self.groups)
        if (self.first_streamed + (self.next_ticket - self.dropped) // per_iteration
                > self.version + self.config.training.max_staleness):
            return None
        iteration = self.first_streamed + self.next_ticket // per_iteration
        g = self.groups[self.next_ticket % per_iteration]
        self.next_ticket += 1
        seed = rollout_seeds(self.config, iteration, 0)[g]
        return GroupTicket(iteration * self.config.num_groups + g, int(seed), iteration)

    def _stop_stream(self) -> None:
        if self.stream is not None:
            self.replay = sorted(self.replay + self.stream.stop(), key=lambda t: t.group_id)
            self.stream = None

    def keep(self, iteration: int, groups: list[int] | None) -> WorkerBatch:
        """Keep the samples of `groups` (None: all); their partial advantages are computed
        now (GAE's once the critic's values come: `gae_partial`)."""
        from megatron_agent.algorithms.group_advantages import partial_advantages
        from megatron_agent.samples import step_columns

        held = self.held[iteration]
        if groups is not None:
            chosen = set(groups)
            held.samples = [s for s in held.samples if s.group_id in chosen]
        algorithm = self.config.algorithm
        held.partial = (partial_advantages(step_columns(held.samples), algorithm)
                        if algorithm.advantage_estimator != "gae" else None)
        return WorkerBatch(
            lengths=np.array([len(s.prompt_ids) + len(s.response_ids) for s in held.samples], dtype=np.int64),
            group_ids=np.array([s.group_id for s in held.samples], dtype=np.int64),
            weight_versions=np.array([weight_version_number(s.weight_version) for s in held.samples],
                                     dtype=np.int64),
            moments=None if held.partial is None else held.partial.moments,
            diagnostics=None if held.partial is None else held.partial.diagnostics)

    def gae_partial(self, iteration: int, values: np.ndarray):
        """GAE: the critic's values of this worker's samples -> the moments it contributes."""
        import dataclasses

        from megatron_agent.algorithms.group_advantages import partial_advantages
        from megatron_agent.samples import step_columns

        held = self.held[iteration]
        columns = dataclasses.replace(step_columns(held.samples), values=np.asarray(values, dtype=np.float64))
        held.partial, held.finished = partial_advantages(columns, self.config.algorithm), None
        return held.partial.moments

    def advantages(self, iteration: int, moments) -> tuple[np.ndarray, np.ndarray]:
        """(advantages, returns) of the kept samples, finished with the whole batch's moments."""
        from megatron_agent.algorithms.group_advantages import finish_advantages

        held = self.held[iteration]
        if held.finished is None or held.finished[0] != moments:
            done = finish_advantages(held.partial, moments, self.config.algorithm)
            held.finished = (moments, done.advantages, done.returns)
        return held.finished[1], held.finished[2]

    def step_advantages(self, iteration: int, steps: Sequence[tuple[int, int]], moments) -> list[float | None]:
        """The advantages, as the trainer gets them (`shard`), of the kept samples `steps`
        ((trajectory id, step index) pairs: the episodes of run_dir/samples); None for a step
        this worker does not keep (another worker's, or a failed episode's)."""
        held = self.held[iteration]
        if held.finished is None and held.partial is not None:
            self.advantages(iteration, moments)
        if held.finished is None:  # GAE before the critic's values
            return [None] * len(steps)
        rows = {(s.traj_id, s.step_index): r for r, s in enumerate(held.samples)}
        return [float(held.finished[1][rows[k]]) if k in rows else None for k in map(tuple, steps)]

    def samples(self, iteration: int) -> list:
        """The kept samples (a checkpoint of a rollout done ahead holds them)."""
        return self.held[iteration].samples

    def restore(self, iteration: int, samples: list) -> None:
        """A rollout done ahead, from a checkpoint: its kept samples, as `samples` gave them."""
        self.begin(iteration)
        self.held[iteration].samples = list(samples)
        self.keep(iteration, None)

    def shard(self, iteration: int, rows: Sequence[int], moments=None) -> dict:
        """Rows `rows` of the kept samples, compact: int32 token ids and float32 response
        logprobs, unpadded and flat, with each row's prompt and response lengths; the
        advantages (not for GAE: its are computed later) and the images of an image prompt."""
        from megatron_agent.worker_batches import compact_shard

        held = self.held[iteration]
        rows = np.asarray(rows, dtype=np.int64)
        advantages = self.advantages(iteration, moments)[0][rows] if held.partial is not None else None
        return compact_shard([held.samples[int(r)] for r in rows], advantages)

    def close(self) -> None:
        self._stop_stream()
        if self.own_engine_client and self.engine is not None:
            self.engine.close()
        self.envs.close()


@dataclass
class HeldRollout:
    """A worker's samples of one iteration, and their advantages as far as they go."""

    samples: list = field(default_factory=list)
    partial: object = None  # algorithms.group_advantages.PartialAdvantages
    finished: tuple | None = None  # (moments, advantages, returns)


def whole_groups(episodes: list[list], count: int, kept: list) -> list[list]:
    """The episodes run_dir/samples shows: those of the first groups until there are at
    least `count`, whole groups (so that their anchor-state groups are complete), of the
    groups kept when dynamic sampling kept any (a dropped group has no advantages)."""
    if count <= 0:
        return []
    kept_groups = {s.group_id for s in kept}
    played = [e for e in episodes if e]
    shown, groups = [], set()
    for e in [e for e in played if e[0].group_id in kept_groups] or played:
        if len(shown) >= count and e[0].group_id not in groups:
            break
        shown.append(e)
        groups.add(e[0].group_id)
    return shown


def trajectories(samples: list) -> list[list]:
    """Samples in (trajectory, step) order -> one list per trajectory."""
    by_traj: dict[int, list] = {}
    for s in samples:
        by_traj.setdefault(s.traj_id, []).append(s)
    return list(by_traj.values())


def shown_copy(sample):
    """A step sample for run_dir/samples: the current observation's image as it is (the
    episode page shows it), the history's images as their shapes only and no processed
    pixels (those frames stay on the worker)."""
    import dataclasses
    from types import SimpleNamespace

    if not sample.images and sample.pixel_values is None:
        return sample
    current = [entry == sample.history_entries for entry in sample.image_entries]
    images = [im if i < len(current) and current[i] else SimpleNamespace(shape=tuple(im.shape))
              for i, im in enumerate(sample.images)]
    return dataclasses.replace(sample, images=images, pixel_values=None, image_grid_thw=None)


def weight_version_number(version) -> int:
    """An engine's weight version as a number (its first weights, "default", are 0)."""
    return int(version) if str(version).isdigit() else 0
