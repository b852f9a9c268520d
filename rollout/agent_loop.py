"""The step-independent agent loop: every step's prompt is built on its own.

    result = run_rollout(envs, engine, tokenizer, config, seeds)
    result.samples                             # one StepSample per (trajectory, step)

For each env group: reset with the group's seed; then, each step, a copy gets a prompt
(instructions + its memory's history + current observation, see rollout/prompts.py), the
engine generates, the text is decoded and handed to the env's own projection, and the
step becomes one StepSample. A copy stops at done or at `max_steps`.

Two loops (`config.mode`):
- "async" (default, rollout/async_loop.py): each episode takes its next step as soon as
  its own response is back; engines see a continuous stream of requests and env steps
  overlap generation. At scale one long response no longer holds up every episode.
- "lockstep": every active copy generates (one batch `generate`), then every env steps,
  then the next step.
Each request's sampling seed is derived from (sampling seed, rollout_index, env seed,
copy within the group, step), never from call order, so both loops return the same
samples for the same seeds on an engine whose outputs do not depend on what it batches
together. Which engines are (docs/rollout.md): the embedded engine at
`max_batch_size=1` bit for bit; at its default batching in fp32 the tokens (logprobs
differ by ~1e-6, so a sampled token could flip only on a draw that close to a boundary;
tested equal); in bf16 the logprobs differ by ~1e-3 and tokens may differ; SGLang
servers batch continuously and are not batch-invariant unless run in their
deterministic-inference mode. Samples come back sorted by (group, trajectory, step)
whatever the completion order.

`envs` may be one EnvManager or several ("slots", each a set of groups); both loops
play all slots' episodes together.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rollout.async_loop import run_async
from rollout.episodes import RolloutSettings, Slot, Timeline, sampling_seed  # noqa: F401 (sampling_seed: re-exported)
from rollout.memory import Memory, memory_factory
from rollout.progress import ProgressCounter, RolloutProgress
from rollout.prompts import PromptConfig
from rollout.samples import StepSample
from rollout.sampling import SamplingConfig

LOOP_MODES = ("async", "lockstep")


@dataclass
class ValidationConfig:
    num_episodes: int = 16  # groups of size 1, seeds envs.validation_seed(0..n-1)
    first_seed_index: int = 0
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))


@dataclass
class AgentLoopConfig:
    max_steps: int = 15
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # "async": each episode steps as soon as its response is back; "lockstep": all
    # copies generate, then all step. The same samples on a batch-invariant engine.
    mode: str = "async"
    # An answer cut short by a weight update (asynchronous training): "continue" it under the
    # new weights, each token keeping its version and logprob, or "restart" it
    # (rollout/partial_rollout.py).
    in_flight_update: str = "continue"
    # Episodes whose env copy broke (info["failed"]) are not the policy's doing: their
    # samples are dropped and counted in metrics.
    drop_failed_episodes: bool = True


@dataclass
class RolloutResult:
    samples: list[StepSample]  # failed episodes left out when config.drop_failed_episodes
    metrics: dict[str, float]
    episodes: list[list[StepSample]]  # every trajectory's samples in step order, failed included
    summaries: list[EpisodeSummary] = field(default_factory=list)  # one per episode, in `episodes` order


def run_rollout(
    envs,
    engine,
    tokenizer,
    config: AgentLoopConfig,
    seeds: Sequence[int],
    *,
    sampling: SamplingConfig | None = None,
    rollout_index: int = 0,
    first_group: int = 0,
    make_memory: Callable[[], Memory] | None = None,
    image_processor=None,
    on_progress: Callable[[RolloutProgress], None] | None = None,
) -> RolloutResult:
    """Play one episode per env copy and return one StepSample per (trajectory, step).

    envs: an EnvManager, or a list of them (slots); `seeds` has one seed per group over
    all slots, in order. engine: anything with EngineClient's `generate` (and `submit`,
    else the async loop calls `generate` per request). rollout_index: mixed into the
    sampling seeds (pass the iteration, so iterations differ). first_group: the group id
    of the first group (group and trajectory ids count on from it, so the samples of
    several rollouts of one batch stay apart). image_processor: a vision-language
    model's (rollout/vision.py `load_image_processor`): prompts then show the
    observations' images; None (a text model): text prompts. on_progress: called, from
    the loop's threads, with the episodes and steps done and the requests in flight each
    time they change (rollout/progress.py).
    """
    if config.mode not in LOOP_MODES:
        raise ValueError(f"loop mode {config.mode!r}; use one of {LOOP_MODES}")
    slots_envs = list(envs) if isinstance(envs, list | tuple) else [envs]
    if len(seeds) != sum(e.num_groups for e in slots_envs):
        raise ValueError(f"{len(seeds)} seeds for {sum(e.num_groups for e in slots_envs)} groups")
    settings = RolloutSettings(
        tokenizer, config.prompt, sampling or config.sampling, rollout_index, config.max_steps,
        make_memory or memory_factory(config.prompt.memory, config.prompt.history_length,
                                      config.prompt.max_images),
        image_processor=image_processor, in_flight_update=config.in_flight_update)
    slots, offset = [], 0
    for e in slots_envs:
        slots.append(Slot(e, seeds[offset:offset + e.num_groups], first_group + offset, settings))
        offset += e.num_groups

    timeline = Timeline()
    progress = ProgressCounter(sum(s.envs.num_envs for s in slots), on_progress)
    start = time.perf_counter()
    for slot in slots:
        t0 = time.perf_counter()
        slot.reset()
        timeline.record("env", t0, time.perf_counter())
    progress.add(episodes_done=sum(s.envs.num_envs - len(s.active_copies()) for s in slots))  # over at reset
    if config.mode == "async":
        run_async(slots, engine, timeline, progress)
    else:
        run_lockstep(slots, engine, timeline, progress)
    wall = time.perf_counter() - start
    return rollout_result(slots, config, timeline, wall)


def run_lockstep(slots: list[Slot], engine, timeline: Timeline, progress: ProgressCounter | None = None) -> None:
    """Step by step: every active copy of every slot generates (one batch), then each
    slot's envs step the copies that generated."""
    progress = progress or ProgressCounter(0, None)
    while any(s.active.any() for s in slots):
        batch = [(s, i, s.prompt(i)) for s in slots for i in s.active_copies()]
        requests = [s.request(i, p) for s, i, p in batch]
        progress.add(requests_in_flight=len(requests))
        t0 = time.perf_counter()
        images = {"image_data": [r.image_data for r in requests], "prompt_tokens": [r.prompt_tokens for r in requests]}
        outputs = engine.generate([r.ids for r in requests], [r.params for r in requests],
                                  rids=[r.rid for r in requests], sticky_keys=[r.sticky_key for r in requests],
                                  **(images if any(r.image_data for r in requests) else {}))
        timeline.record("generate", t0, time.perf_counter())
        progress.add(requests_in_flight=-len(requests))
        for slot in slots:
            mine = [(i, p, out) for (s, i, p), out in zip(batch, outputs) if s is slot]
            if mine:
                goes_on = [g for _, g in slot.step(mine, timeline)]
                progress.add(steps_done=len(goes_on), episodes_done=goes_on.count(False))


def rollout_result(slots: list[Slot], config: AgentLoopConfig, timeline: Timeline, wall: float) -> RolloutResult:
    """Episodes in (group, trajectory) order with their returns, samples in (group,
    trajectory, step) order, and the metrics."""
    trajectories = sorted(((slot.traj_id(i), traj, bool(slot.failed[i]))
                           for slot in slots for i, traj in enumerate(slot.trajectories)), key=lambda t: t[0])
    episodes = [traj for _, traj, _ in trajectories]
    samples, summaries = finished_episodes(episodes, [f for _, _, f in trajectories], config.drop_failed_episodes)
    metrics = summary_metrics(summaries)
    metrics.update({
        "rollout/time_s": wall,
        "rollout/time_generate_s": timeline.busy(["generate"]),
        "rollout/time_env_s": timeline.busy(["env"]),
        "rollout/overhead_share": 1.0 - timeline.busy(["generate", "env"]) / wall if wall > 0 else 0.0,
    })
    return RolloutResult(samples=samples, metrics=metrics, episodes=episodes, summaries=summaries)


def finished_episodes(episodes: list[list[StepSample]], failed: list[bool],
                      drop_failed: bool) -> tuple[list[StepSample], list[EpisodeSummary]]:
    """Played episodes -> their samples in (group, trajectory, step) order, each with its
    episode's return (a failed episode's left out when `drop_failed`), and one summary
    per episode."""
    for traj in episodes:
        ret = float(sum(s.reward for s in traj))
        for s in traj:
            s.episode_return = ret
    keep = [t for t, f in zip(episodes, failed) if not (f and drop_failed)]
    samples = sorted((s for t in keep for s in t), key=lambda s: (s.group_id, s.traj_id, s.step_index))
    return samples, [summarize_episode(t, f) for t, f in zip(episodes, failed)]


@dataclass(frozen=True)
class EpisodeSummary:
    """What the rollout metrics need of one episode: a few numbers, so episodes rolled out
    in other processes (rollout workers) are summed up without their samples."""

    failed: bool
    won: bool
    steps: int
    episode_return: float
    task_type: str
    invalid_steps: int
    truncated_steps: int
    clipped_steps: int
    response_tokens: int
    prompt_tokens: int


def summarize_episode(trajectory: list[StepSample], failed: bool) -> EpisodeSummary:
    last = trajectory[-1] if trajectory else None
    return EpisodeSummary(
        failed=failed, won=bool(last and last.won), steps=len(trajectory),
        episode_return=float(last.episode_return) if last else 0.0,
        task_type=last.task_type if last else "",
        invalid_steps=sum(not s.is_action_valid for s in trajectory),
        truncated_steps=sum(bool(s.truncated_history) for s in trajectory),
        clipped_steps=sum(s.finish_reason == "length" for s in trajectory),
        response_tokens=sum(len(s.response_ids) for s in trajectory),
        prompt_tokens=sum(len(s.prompt_ids) for s in trajectory))


def rollout_metrics(episodes: list[list[StepSample]], failed: list[bool], prefix: str = "rollout/") -> dict:
    """Success rate (won at the last step), episode length and return, invalid-action rate,
    per-env-type success; failed episodes (env copy broke) only counted."""
    return summary_metrics([summarize_episode(t, f) for t, f in zip(episodes, failed)], prefix)


def summary_metrics(summaries: list[EpisodeSummary], prefix: str = "rollout/") -> dict:
    """`rollout_metrics` from the episodes' summaries (those of several rollouts together)."""
    good = [e for e in summaries if e.steps and not e.failed]
    steps = sum(e.steps for e in good)
    m = {
        f"{prefix}num_episodes": float(len(good)),
        f"{prefix}failed_episodes": float(sum(e.failed for e in summaries)),
        f"{prefix}num_samples": float(steps),
    }
    if not good:
        return m
    m[f"{prefix}success_rate"] = float(np.mean([e.won for e in good]))
    m[f"{prefix}episode_length"] = float(np.mean([e.steps for e in good]))
    m[f"{prefix}episode_return"] = float(np.mean([e.episode_return for e in good]))
    for name, field_name in (("invalid_action_rate", "invalid_steps"), ("truncated_history_rate", "truncated_steps"),
                             ("response_length", "response_tokens"), ("prompt_length", "prompt_tokens"),
                             ("response_clipped_rate", "clipped_steps")):
        m[f"{prefix}{name}"] = float(sum(getattr(e, field_name) for e in good) / steps)
    by_type: dict[str, list[bool]] = defaultdict(list)
    for e in good:
        by_type[e.task_type].append(e.won)
    for task, wins in sorted(by_type.items()):
        m[f"{prefix}success_rate/{task}"] = float(np.mean(wins))
    return m


def validation_seeds(config: AgentLoopConfig) -> list[int]:
    from envs import validation_seed

    v = config.validation
    return [validation_seed(v.first_seed_index + i) for i in range(v.num_episodes)]


def run_validation(envs, engine, tokenizer, config: AgentLoopConfig, *, image_processor=None,
                   on_progress: Callable[[RolloutProgress], None] | None = None) -> RolloutResult:
    """Validation: group size 1, the validation seed range, the validation sampling
    (greedy by default). `envs` must have group_size 1 and num_episodes groups."""
    for e in envs if isinstance(envs, list | tuple) else [envs]:
        if e.group_size != 1:
            raise ValueError(f"validation runs use group_size=1, got {e.group_size}")
    result = run_rollout(envs, engine, tokenizer, replace(config, drop_failed_episodes=True),
                         validation_seeds(config), sampling=config.validation.sampling,
                         image_processor=image_processor, on_progress=on_progress)
    result.metrics = {k.replace("rollout/", "val/", 1): v for k, v in result.metrics.items()}
    return result
