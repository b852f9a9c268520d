"""History / memory modules: what of past steps goes into the next prompt.

A memory is anything with `store(step)` and `render(budget)`:
- `store(step: StepRecord)` after each env step of one trajectory;
- `render(budget: int | None) -> list[str]` the history entries for the next prompt,
  oldest first, at most `budget` of them (None: all it keeps). The prompt builder lowers
  the budget to drop the oldest entries first when a prompt is over its token budget.
One memory object per trajectory; the loop makes them with a `memory_factory()`.

Images (VLM tasks): a `StepRecord` may carry its observation's image. A memory keeps the
images of at most its `max_images - 1` newest steps (the current observation's image is
the prompt's last one; `max_images=1`, the default, keeps none of the past), and
`render_images(budget)` gives one entry per `render(budget)` entry: that step's image or
None. Memories without `render_images` are text-only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class StepRecord:
    step_index: int
    observation: str  # the observation the action answered
    action: str  # the model's raw text
    reward: float
    is_action_valid: bool
    # The observation's image (HxWx3 uint8) for VLM tasks; None for text ones.
    image: Any = None


class Memory(Protocol):
    def store(self, step: StepRecord) -> None: ...

    def render(self, budget: int | None = None) -> list[str]: ...


def format_step(step: StepRecord) -> str:
    return f"[Step {step.step_index}]\nObservation:\n{step.observation}\nAction: {step.action}"


class WindowMemory:
    """The last `k` (observation, action) pairs, with the images of the newest
    `max_images - 1` of them (the current observation holds the prompt's last image)."""

    def __init__(self, k: int, max_images: int = 1):
        self.steps: deque[StepRecord] = deque(maxlen=max(k, 0))
        self.past_images = max(max_images - 1, 0)

    def store(self, step: StepRecord) -> None:
        if self.past_images == 0 and step.image is not None:
            step = dataclasses.replace(step, image=None)
        self.steps.append(step)
        # Drop the image of the step that just left the image window (memory is not kept
        # for pixels no prompt will show).
        if self.past_images and len(self.steps) > self.past_images:
            old = self.steps[-self.past_images - 1]
            if old.image is not None:
                self.steps[-self.past_images - 1] = dataclasses.replace(old, image=None)

    def render(self, budget: int | None = None) -> list[str]:
        entries = [format_step(s) for s in self.steps]
        return _last(entries, budget)

    def render_images(self, budget: int | None = None) -> list:
        return _last([s.image for s in self.steps], budget)


class SummaryMemory:
    """A running digest of the whole episode, then the window of the last `k` pairs.

    The digest is one entry (the oldest, so it is the first to go when the budget is
    tight): steps taken, invalid actions, total reward, and the actions in order
    (run-length encoded, so it grows with the number of distinct runs, not steps).
    """

    def __init__(self, k: int, max_actions: int = 32, max_images: int = 1):
        self.window = WindowMemory(k, max_images)
        self.k = k
        self.max_actions = max_actions
        self.num_steps = 0
        self.num_invalid = 0
        self.total_reward = 0.0
        self.runs: list[list] = []  # [action, count]
        self.counts: Counter[str] = Counter()

    def store(self, step: StepRecord) -> None:
        self.window.store(step)
        self.num_steps += 1
        self.num_invalid += not step.is_action_valid
        self.total_reward += step.reward
        action = _short(step.action) if step.is_action_valid else "(invalid)"
        if self.runs and self.runs[-1][0] == action:
            self.runs[-1][1] += 1
        else:
            self.runs.append([action, 1])

    def digest(self) -> str | None:
        if self.num_steps <= self.k:  # the window already shows everything
            return None
        runs = self.runs[-self.max_actions:]
        actions = ", ".join(a if n == 1 else f"{a} x{n}" for a, n in runs)
        if len(runs) < len(self.runs):
            actions = "..., " + actions
        return (f"[Summary] {self.num_steps} steps so far, {self.num_invalid} invalid, "
                f"total reward {self.total_reward:.2f}. Actions: {actions}")

    def render(self, budget: int | None = None) -> list[str]:
        digest = self.digest()
        entries = ([digest] if digest else []) + self.window.render()
        return _last(entries, budget)

    def render_images(self, budget: int | None = None) -> list:
        images = ([None] if self.digest() else []) + self.window.render_images()
        return _last(images, budget)


class NoMemory:
    def store(self, step: StepRecord) -> None:
        pass

    def render(self, budget: int | None = None) -> list[str]:
        return []

    def render_images(self, budget: int | None = None) -> list:
        return []


def memory_factory(kind: str, history_length: int, max_images: int = 1) -> Callable[[], Memory]:
    """max_images: the most images one prompt shows, the current observation's included
    (1: the current one only; 0: none, a text-only prompt even for a visual env)."""
    if max_images < 0:
        raise ValueError(f"max_images={max_images}; use 0 or more")
    if kind == "window":
        return lambda: WindowMemory(history_length, max_images)
    if kind == "summary":
        return lambda: SummaryMemory(history_length, max_images=max_images)
    if kind == "none":
        return NoMemory
    raise ValueError(f"memory={kind!r}; use 'window', 'summary' or 'none'")


def _last(entries: list[str], budget: int | None) -> list[str]:
    if budget is None:
        return entries
    return entries[len(entries) - budget:] if 0 < budget < len(entries) else ([] if budget <= 0 else entries)


def _short(text: str, limit: int = 40) -> str:
    """The action inside <action>...</action> when there is one, else the text, one line."""
    lower = text.lower()
    start, end = lower.find("<action>"), lower.find("</action>")
    if 0 <= start < end:
        text = text[start + len("<action>"):end]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
