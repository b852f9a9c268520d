"""The step-independent agent loop: every step's prompt is built on its own.

    result = run_rollout(envs, engine, tokenizer, config, seeds)
    result.samples                             # one StepSample per (trajectory, step)

For each env group: reset with the group's seed; then, each step, every *active* copy
gets a prompt (instructions + its memory's history + current observation, see
rollout/prompts.py), the engine generates, the text is decoded and handed to the env's
own projection via `EnvManager.step` (done copies get None), and the step becomes one
StepSample. A copy stops at done or at `max_steps`.

`envs` may be one EnvManager or several ("slots", each a set of groups). With
`async_slots` each slot runs in its own thread, so one slot's env step overlaps another
slot's generation. Each request's sampling seed is derived from (sampling seed,
rollout_index, env seed, copy within the group, step), never from call order, so the
async run returns the same samples as the synchronous one (lock-step over all slots).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from rollout.memory import Memory, StepRecord, memory_factory
from rollout.prompts import PromptConfig, build_prompt
from rollout.samples import StepSample
from rollout.sampling import SamplingConfig


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
    # Overlap env stepping of one env manager (a slot of groups) with generation for
    # another. Results equal a synchronous run with the same seeds (tested), so it is on.
    async_slots: bool = True
    # Episodes whose env copy broke (info["failed"]) are not the policy's doing: their
    # samples are dropped and counted in metrics.
    drop_failed_episodes: bool = True


@dataclass
class Timeline:
    """(start, end) intervals of generation and env work, to measure loop overhead."""

    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, start: float, end: float) -> None:
        with self.lock:
            self.intervals[kind].append((start, end))

    def busy(self, kinds: Sequence[str]) -> float:
        """Wall time covered by the union of the intervals of `kinds`."""
        spans = sorted(iv for k in kinds for iv in self.intervals.get(k, []))
        total, cur_start, cur_end = 0.0, None, None
        for s, e in spans:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            total += cur_end - cur_start
        return total

    def total(self, kind: str) -> float:
        return sum(e - s for s, e in self.intervals.get(kind, []))


@dataclass
class RolloutResult:
    samples: list[StepSample]  # failed episodes left out when config.drop_failed_episodes
    metrics: dict[str, float]
    episodes: list[list[StepSample]]  # every trajectory's samples in step order, failed included


def sampling_seed(base: int, rollout_index: int, env_seed: int, copy: int, step: int) -> int:
    state = np.random.SeedSequence([base & 0xFFFFFFFF, rollout_index, env_seed, copy, step]).generate_state(2)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 62) - 1)


class _Slot:
    """One EnvManager's episodes, advanced one step at a time."""

    def __init__(self, envs, seeds: Sequence[int], group_offset: int, make_memory: Callable[[], Memory]):
        self.envs = envs
        self.seeds = [int(s) for s in seeds]
        self.group_offset = group_offset
        self.make_memory = make_memory
        self.G = envs.group_size
        self.trajectories: list[list[StepSample]] = [[] for _ in range(envs.num_envs)]
        self.failed = np.zeros(envs.num_envs, dtype=bool)

    def reset(self, timeline: Timeline) -> None:
        t0 = time.perf_counter()
        self.observations = self.envs.reset(self.seeds)
        timeline.record("env", t0, time.perf_counter())
        self.failed = np.array([bool(i.get("failed")) for i in self.envs.infos])
        self.active = ~self.envs.dones.copy()
        self.memories = [self.make_memory() for _ in range(self.envs.num_envs)]
        self.step_index = 0

    def env_seed(self, i: int) -> int:
        return self.seeds[i // self.G]

    def traj_id(self, i: int) -> int:
        return (self.group_offset + i // self.G) * self.G + i % self.G


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
) -> RolloutResult:
    """Play one episode per env copy and return one StepSample per (trajectory, step).

    envs: an EnvManager, or a list of them (slots); `seeds` has one seed per group over
    all slots, in order. engine: anything with EngineClient's `generate`. rollout_index:
    mixed into the sampling seeds (pass the iteration, so iterations differ). first_group:
    the group id of the first group (group and trajectory ids count on from it, so the
    samples of several rollouts of one batch stay apart).
    """
    slots_envs = list(envs) if isinstance(envs, list | tuple) else [envs]
    sampling = sampling or config.sampling
    make_memory = make_memory or memory_factory(config.prompt.memory, config.prompt.history_length)
    if len(seeds) != sum(e.num_groups for e in slots_envs):
        raise ValueError(f"{len(seeds)} seeds for {sum(e.num_groups for e in slots_envs)} groups")
    slots, offset = [], 0
    for e in slots_envs:
        slots.append(_Slot(e, seeds[offset:offset + e.num_groups], first_group + offset, make_memory))
        offset += e.num_groups

    timeline = Timeline()
    tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
    start = time.perf_counter()

    def prompts_of(slot: _Slot):
        with tokenizer_lock:
            return [(i, build_prompt(tokenizer, slot.envs.instructions, slot.observations[i].text,
                                     slot.memories[i], slot.step_index, config.prompt))
                    for i in np.flatnonzero(slot.active)]

    def requests_of(slot: _Slot, prompts):
        params = [sampling.to_params(None if sampling.seed is None else sampling_seed(
            sampling.seed, rollout_index, slot.env_seed(i), i % slot.G, slot.step_index)) for i, _ in prompts]
        keys = [f"r{rollout_index}-s{slot.env_seed(i)}-t{slot.traj_id(i)}" for i, _ in prompts]
        return [p.ids for _, p in prompts], params, keys, slot.step_index

    def generate(ids, params, keys, steps):
        t0 = time.perf_counter()
        rids = [f"{k}-step{t}" for k, t in zip(keys, steps)]
        outs = engine.generate(ids, params, rids=rids, sticky_keys=keys)
        timeline.record("generate", t0, time.perf_counter())
        return outs

    def advance(slot: _Slot, prompts, outs) -> None:
        with tokenizer_lock:
            texts_of = {i: tokenizer.decode(o.output_ids, skip_special_tokens=True)
                        for (i, _), o in zip(prompts, outs)}
        texts = [texts_of.get(i) for i in range(slot.envs.num_envs)]
        t0 = time.perf_counter()
        new_obs, rewards, dones, infos = slot.envs.step(texts)
        timeline.record("env", t0, time.perf_counter())
        for (i, prompt), out in zip(prompts, outs):
            info = infos[i]
            obs = slot.observations[i]
            sample = StepSample(
                prompt_ids=prompt.ids, response_ids=list(out.output_ids), rollout_logprobs=list(out.logprobs),
                reward=float(rewards[i]), episode_return=0.0, group_id=slot.group_offset + i // slot.G,
                traj_id=slot.traj_id(i), step_index=slot.step_index, anchor=obs.anchor,
                is_action_valid=bool(info.get("is_action_valid", True)), done=bool(dones[i]),
                won=bool(info.get("won", False)), env_seed=slot.env_seed(i), env_name=slot.envs.name,
                task_type=str(info.get("task_type") or slot.envs.name),
                truncated_history=prompt.truncated_history, history_entries=prompt.history_entries,
                finish_reason=out.finish_reason, response_text=texts[i], weight_version=out.weight_version,
                info={k: v for k, v in info.items() if k in ("failed", "error", "truncated", "action")},
            )
            slot.trajectories[i].append(sample)
            slot.memories[i].store(StepRecord(slot.step_index, obs.text, texts[i], float(rewards[i]),
                                              sample.is_action_valid))
            if info.get("failed"):
                slot.failed[i] = True
            if dones[i]:
                slot.active[i] = False
        slot.observations = new_obs
        slot.step_index += 1
        if slot.step_index >= config.max_steps:
            slot.active[:] = False

    if config.async_slots and len(slots) > 1:
        def run_slot(slot: _Slot) -> None:
            slot.reset(timeline)
            while slot.active.any():
                prompts = prompts_of(slot)
                ids, params, keys, step = requests_of(slot, prompts)
                outs = generate(ids, params, keys, [step] * len(ids))
                advance(slot, prompts, outs)

        with ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="rollout-slot") as pool:
            for f in [pool.submit(run_slot, s) for s in slots]:
                f.result()
    else:
        for slot in slots:
            slot.reset(timeline)
        while any(s.active.any() for s in slots):
            live = [s for s in slots if s.active.any()]
            per_slot = [prompts_of(s) for s in live]
            reqs = [requests_of(s, p) for s, p in zip(live, per_slot)]
            outs = generate([x for r in reqs for x in r[0]], [x for r in reqs for x in r[1]],
                            [x for r in reqs for x in r[2]], [r[3] for r in reqs for _ in r[0]])
            at = 0
            for s, p in zip(live, per_slot):
                advance(s, p, outs[at:at + len(p)])
                at += len(p)
    wall = time.perf_counter() - start

    episodes, failed = [], []
    for slot in slots:
        for i, traj in enumerate(slot.trajectories):
            ret = float(sum(s.reward for s in traj))
            for s in traj:
                s.episode_return = ret
            episodes.append(traj)
            failed.append(bool(slot.failed[i]))
    keep = [t for t, f in zip(episodes, failed) if not (f and config.drop_failed_episodes)]
    samples = [s for t in keep for s in t]
    metrics = rollout_metrics(episodes, failed)
    metrics.update({
        "rollout/time_s": wall,
        "rollout/time_generate_s": timeline.busy(["generate"]),
        "rollout/time_env_s": timeline.busy(["env"]),
        "rollout/overhead_share": 1.0 - timeline.busy(["generate", "env"]) / wall if wall > 0 else 0.0,
    })
    return RolloutResult(samples=samples, metrics=metrics, episodes=episodes)


def rollout_metrics(episodes: list[list[StepSample]], failed: list[bool], prefix: str = "rollout/") -> dict:
    """Success rate (won at the last step), episode length and return, invalid-action rate,
    per-env-type success; failed episodes (env copy broke) only counted."""
    good = [t for t, f in zip(episodes, failed) if t and not f]
    steps = [s for t in good for s in t]
    m = {
        f"{prefix}num_episodes": float(len(good)),
        f"{prefix}failed_episodes": float(sum(failed)),
        f"{prefix}num_samples": float(len(steps)),
    }
    if not good:
        return m
    m[f"{prefix}success_rate"] = float(np.mean([t[-1].won for t in good]))
    m[f"{prefix}episode_length"] = float(np.mean([len(t) for t in good]))
    m[f"{prefix}episode_return"] = float(np.mean([t[-1].episode_return for t in good]))
    m[f"{prefix}invalid_action_rate"] = float(np.mean([not s.is_action_valid for s in steps]))
    m[f"{prefix}truncated_history_rate"] = float(np.mean([s.truncated_history for s in steps]))
    m[f"{prefix}response_length"] = float(np.mean([len(s.response_ids) for s in steps]))
    m[f"{prefix}prompt_length"] = float(np.mean([len(s.prompt_ids) for s in steps]))
    m[f"{prefix}response_clipped_rate"] = float(np.mean([s.finish_reason == "length" for s in steps]))
    by_type: dict[str, list[bool]] = defaultdict(list)
    for t in good:
        by_type[t[-1].task_type].append(t[-1].won)
    for task, wins in sorted(by_type.items()):
        m[f"{prefix}success_rate/{task}"] = float(np.mean(wins))
    return m


def validation_seeds(config: AgentLoopConfig) -> list[int]:
    from envs import validation_seed

    v = config.validation
    return [validation_seed(v.first_seed_index + i) for i in range(v.num_episodes)]


def run_validation(envs, engine, tokenizer, config: AgentLoopConfig) -> RolloutResult:
    """Validation: group size 1, the validation seed range, the validation sampling
    (greedy by default). `envs` must have group_size 1 and num_episodes groups."""
    for e in envs if isinstance(envs, list | tuple) else [envs]:
        if e.group_size != 1:
            raise ValueError(f"validation runs use group_size=1, got {e.group_size}")
    result = run_rollout(envs, engine, tokenizer, replace(config, drop_failed_episodes=True),
                         validation_seeds(config), sampling=config.validation.sampling)
    result.metrics = {k.replace("rollout/", "val/", 1): v for k, v in result.metrics.items()}
    return result
