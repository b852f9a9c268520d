"""One rollout's episodes, copy by copy: what both agent loops (lock-step in
rollout/agent_loop.py, asynchronous in rollout/async_loop.py) do to one env copy at one
step. A `Slot` is one EnvManager's episodes; each copy has its own step index, memory and
trajectory, so the loops may advance copies together or one by one.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollout.memory import Memory, StepRecord
from rollout.prompts import Prompt, PromptConfig, build_prompt
from rollout.samples import StepSample
from rollout.sampling import SamplingConfig


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
class Request:
    """One copy's generation request at one step."""

    ids: list[int]  # what the engine is sent: one image pad per image (rollout/vision.py)
    params: dict
    rid: str
    sticky_key: str  # the trajectory: its steps go to one engine (prefix cache)
    image_data: list[str] = field(default_factory=list)  # PNG data URLs, one per image pad
    prompt_tokens: int | None = None  # the expanded prompt's length, for an image request (else None)


def sampling_seed(base: int, rollout_index: int, env_seed: int, copy: int, step: int) -> int:
    state = np.random.SeedSequence([base & 0xFFFFFFFF, rollout_index, env_seed, copy, step]).generate_state(2)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 62) - 1)


@dataclass
class RolloutSettings:
    """What every copy of a rollout shares."""

    tokenizer: object
    prompt: PromptConfig
    sampling: SamplingConfig
    rollout_index: int
    max_steps: int
    make_memory: Callable[[], Memory]
    image_processor: object = None  # the vision-language model's (rollout/vision.py); None: a text model
    in_flight_update: str = "continue"  # an answer cut by a weight update: rollout/partial_rollout.py
    # HF fast tokenizers are not safe to share across threads.
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)


class Slot:
    """One EnvManager's episodes; copy i of the slot's group i // G, whose group id is
    counted from `group_offset` (a group stream, rollout/group_stream.py, gives a group of
    the slot a new id, seed and rollout index each time it plays again: `restart_group`)."""

    def __init__(self, envs, seeds: Sequence[int], group_offset: int, settings: RolloutSettings):
        self.envs = envs
        self.seeds = [int(s) for s in seeds]
        self.group_numbers = [group_offset + g for g in range(len(self.seeds))]
        self.rollout_indices = [settings.rollout_index] * len(self.seeds)
        self.settings = settings
        self.G = envs.group_size
        self.trajectories: list[list[StepSample]] = [[] for _ in range(envs.num_envs)]
        self.failed = np.zeros(envs.num_envs, dtype=bool)
        self.active = np.zeros(envs.num_envs, dtype=bool)
        self.steps = np.zeros(envs.num_envs, dtype=np.int64)

    def reset(self) -> None:
        self.observations = list(self.envs.reset(self.seeds))
        self.failed = np.array([bool(i.get("failed")) for i in self.envs.infos])
        self.active = ~self.envs.dones.copy()
        self.memories = [self.settings.make_memory() for _ in range(self.envs.num_envs)]

    def restart_group(self, g: int, group_number: int, seed: int, rollout_index: int) -> list[int]:
        """Play group g of the slot again as group `group_number` (its episodes so far
        must have been taken: `take_group`); its copies that play (not failed at reset)."""
        self.seeds[g], self.group_numbers[g], self.rollout_indices[g] = int(seed), group_number, rollout_index
        copies = range(g * self.G, (g + 1) * self.G)
        for i, obs in self.envs.reset_groups({g: int(seed)}).items():
            self.observations[i] = obs
            self.failed[i] = bool(self.envs.infos[i].get("failed"))
            self.active[i] = not self.envs.dones[i]
            self.steps[i] = 0
            self.memories[i] = self.settings.make_memory()
            self.trajectories[i] = []
        return [i for i in copies if self.active[i]]

    def take_group(self, g: int) -> tuple[list[list[StepSample]], list[bool]]:
        """Group g's trajectories and whether each copy failed, in copy order."""
        copies = range(g * self.G, (g + 1) * self.G)
        return [self.trajectories[i] for i in copies], [bool(self.failed[i]) for i in copies]

    def active_copies(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.active)]

    def env_seed(self, i: int) -> int:
        return self.seeds[i // self.G]

    def traj_id(self, i: int) -> int:
        return self.group_numbers[i // self.G] * self.G + i % self.G

    def prompt(self, i: int) -> Prompt:
        s = self.settings
        with s.tokenizer_lock:
            obs = self.observations[i]
            return build_prompt(s.tokenizer, self.envs.instructions, obs.text, self.memories[i],
                                int(self.steps[i]), s.prompt, image=obs.image, image_processor=s.image_processor)

    def request(self, i: int, prompt: Prompt) -> Request:
        s, step, rollout_index = self.settings, int(self.steps[i]), self.rollout_indices[i // self.G]
        seed = None if s.sampling.seed is None else sampling_seed(
            s.sampling.seed, rollout_index, self.env_seed(i), i % self.G, step)
        key = f"r{rollout_index}-s{self.env_seed(i)}-t{self.traj_id(i)}"
        return Request(prompt.engine_ids, s.sampling.to_params(seed), f"{key}-step{step}", key,
                       image_data=list(prompt.image_data),
                       prompt_tokens=len(prompt.ids) if prompt.image_data else None)

    def decode(self, output) -> str:
        with self.settings.tokenizer_lock:
            return self.settings.tokenizer.decode(output.output_ids, skip_special_tokens=True)

    def step(self, items: list[tuple[int, Prompt, object]], timeline: Timeline) -> list[tuple[int, bool]]:
        """Step the copies of `items` ((copy, its prompt, the engine's output)) in one
        env call and record each; [(copy, whether its episode goes on)]."""
        texts = {i: self.decode(output) for i, _, output in items}
        t0 = time.perf_counter()
        stepped = self.envs.step_copies(texts)
        timeline.record("env", t0, time.perf_counter())
        return [(i, self.record(i, prompt, output, texts[i], stepped[i])) for i, prompt, output in items]

    def record(self, i: int, prompt: Prompt, output, text: str, stepped: tuple) -> bool:
        """Store copy i's step (its prompt, the engine's output, its decoded text and the
        env's (observation, reward, done, info)) as a sample and in its memory; advance
        the copy. True while the episode goes on."""
        new_obs, reward, done, info = stepped
        obs, step = self.observations[i], int(self.steps[i])
        sample = StepSample(
            prompt_ids=prompt.ids, response_ids=list(output.output_ids), rollout_logprobs=list(output.logprobs),
            reward=float(reward), episode_return=0.0, group_id=self.group_numbers[i // self.G],
            traj_id=self.traj_id(i), step_index=step, anchor=obs.anchor,
            is_action_valid=bool(info.get("is_action_valid", True)), done=bool(done),
            won=bool(info.get("won", False)), env_seed=self.env_seed(i), env_name=self.envs.name,
            task_type=str(info.get("task_type") or self.envs.name),
            truncated_history=prompt.truncated_history, history_entries=prompt.history_entries,
            finish_reason=output.finish_reason, response_text=text, weight_version=output.weight_version,
            token_versions=list(getattr(output, "token_versions", None) or []),
            info={k: v for k, v in info.items() if k in ("failed", "error", "truncated", "action")},
            images=list(prompt.images), image_entries=list(prompt.image_entries), observation=obs.text,
            pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
            routed_experts=output.routed_experts,
        )
        self.trajectories[i].append(sample)
        self.memories[i].store(StepRecord(step, obs.text, text, float(reward), sample.is_action_valid,
                                                 obs.image))
        if info.get("failed"):
            self.failed[i] = True
        self.observations[i] = new_obs
        self.steps[i] = step + 1
        self.active[i] = not done and step + 1 < self.settings.max_steps
        return bool(self.active[i])
