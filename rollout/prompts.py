"""One step's prompt, built on its own: system (env instructions) + history + observation.

Layout (the user message; the system message is `EnvManager.instructions`):

    Your previous turns (oldest first):      <- only when there is history
    [Step 3]
    Observation:
    ...
    Action: ...
    Current observation (step 5):
    <the env's observation text>
    What is your next action?

The model's chat template is applied, then the text is tokenized once. A prompt over
`max_prompt_tokens` is rebuilt with fewer history entries (the oldest dropped first)
and flagged `truncated_history`; it is never cut mid-token. A prompt still over the
budget with no history at all raises `PromptTooLong`.

Images (VLM tasks): the prompt carries, in text order, the images of its history entries
that the memory kept (the newest `max_images - 1` steps) and then the current
observation's image: `Prompt.images`, with `Prompt.image_entries` saying where each goes
(the history entry's index, or `history_entries` for the current observation). The text
and ids hold no image placeholders yet: the VLM prompt builder places them from these
positions, and counts the image tokens in the budget.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from rollout.memory import Memory


@dataclass
class PromptConfig:
    """What one step's prompt is made of (the layout: this module's docstring)."""

    # "window": the last `history_length` (observation, action) pairs; "summary": a running
    # digest of the whole episode plus that window; "none": the current observation only.
    memory: str = "window"
    history_length: int = 2
    # The most images one prompt shows, the current observation's included, newest first
    # kept (1: the current one only; 0: none, a text-only prompt even for a visual env).
    max_images: int = 1
    max_prompt_tokens: int = 1024
    # The system message is the env's instructions (False: none, for tiny models trained
    # from scratch, which cannot read them); these wrap the user message ("" leaves a
    # header out).
    include_instructions: bool = True
    history_header: str = "Your previous turns (oldest first):"
    observation_header: str = "Current observation (step {step}):"
    action_footer: str = "What is your next action?"


class PromptTooLong(ValueError):
    pass


@dataclass
class Prompt:
    ids: list[int]
    text: str
    history_entries: int  # how many history entries the prompt holds
    truncated_history: bool  # entries were dropped to fit max_prompt_tokens
    # The prompt's images in text order (HxWx3 uint8 arrays, shared with the env's
    # observations, never copied) and, for each, the history entry it belongs to
    # (index into the prompt's history) or `history_entries` (the current observation).
    images: list[Any] = field(default_factory=list)
    image_entries: list[int] = field(default_factory=list)


def build_messages(
    instructions: str, observation: str, history: list[str], step_index: int, config: PromptConfig
) -> list[dict]:
    parts = []
    if history:
        parts.append(config.history_header)
        parts.extend(history)
    if config.observation_header:
        parts.append(config.observation_header.format(step=step_index))
    parts.append(observation)
    if config.action_footer:
        parts.append(config.action_footer)
    with_system = instructions and config.include_instructions
    messages = [{"role": "system", "content": instructions}] if with_system else []
    messages.append({"role": "user", "content": "\n".join(parts)})
    return messages


def encode_messages(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    text, ids = _encode(tokenizer, tuple((m["role"], m["content"]) for m in messages))
    return text, list(ids)


@functools.lru_cache(maxsize=8192)
def _encode(tokenizer, messages: tuple[tuple[str, str], ...]) -> tuple[str, tuple[int, ...]]:
    """Templating and tokenizing cost ~0.1 ms a prompt, a fifth of a CPU-job iteration
    (~1000 prompts); states and whole prompts recur within and across iterations."""
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                         add_generation_prompt=True)
    return text, tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(
    tokenizer,
    instructions: str,
    observation: str,
    memory: Memory,
    step_index: int,
    config: PromptConfig,
    image: Any = None,
) -> Prompt:
    """The step's prompt ids, with as much of the memory's history as fits the budget;
    `image` is the current observation's (kept when `config.max_images >= 1`)."""
    history = memory.render(None)
    budget = len(history)
    while True:
        entries = memory.render(budget) if budget < len(history) else history
        text, ids = encode_messages(tokenizer, build_messages(instructions, observation, entries, step_index, config))
        if len(ids) <= config.max_prompt_tokens:
            images, positions = prompt_images(memory, len(entries), image, config.max_images)
            return Prompt(ids, text, len(entries), truncated_history=budget < len(history),
                          images=images, image_entries=positions)
        if budget == 0:
            raise PromptTooLong(
                f"the step-{step_index} prompt is {len(ids)} tokens without any history; "
                f"max_prompt_tokens={config.max_prompt_tokens} is too small for this env's "
                "instructions and observation"
            )
        budget -= 1


def prompt_images(memory: Memory, entries: int, image: Any, max_images: int) -> tuple[list, list[int]]:
    """The images of a prompt with `entries` history entries: the newest `max_images` of
    the entries' images (as the memory kept them) and the current one, in text order."""
    slots = list(memory.render_images(entries)) if entries and hasattr(memory, "render_images") else []
    slots = ([None] * entries + slots)[-entries:] if entries else []  # aligned with the newest entries
    slots.append(image)
    kept = [(i, im) for i, im in enumerate(slots) if im is not None][-max_images:] if max_images > 0 else []
    return [im for _, im in kept], [i for i, _ in kept]
