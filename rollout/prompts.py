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
(the history entry's index, or `history_entries` for the current observation). With an
image processor (a vision-language model, rollout/vision.py) the user message becomes
content parts: each image an {"type": "image"} part right before its observation's text
(after a history entry's "Observation:" line; before the current observation's text),
the text otherwise exactly the layout above. `Prompt.engine_ids` hold one image pad per
image (what an engine takes with `Prompt.image_data`), `Prompt.ids` each pad repeated
its image's token count (what the model runs on and the trainer trains on), and
`max_prompt_tokens` counts the expanded ids. Without an image processor (a text model)
the images are only carried along and the prompt is text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.memory import Memory
from rollout.vision import (
    IMAGE_PAD,
    encode_image_data,
    expand_image_pads,
    image_token_counts,
    merge_size,
    process_images,
)

_IMAGE_MARK = "\x00image\x00"  # where an image part goes, while the user text is assembled


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
    # Vision-language prompts (an image processor given; else these stay empty / None):
    # `ids` are expanded (each image pad repeated its token count); `engine_ids` hold one
    # pad per image and go to the engine with `image_data` (PNG data URLs, one per image).
    engine_ids: list[int] | None = None
    image_data: list[str] = field(default_factory=list)
    pixel_values: Any = None  # float32 [patches, dim] torch tensor
    image_grid_thw: Any = None  # long [images, 3] torch tensor

    def __post_init__(self):
        if self.engine_ids is None:
            self.engine_ids = self.ids


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
    image_processor=None,
) -> Prompt:
    """The step's prompt ids, with as much of the memory's history as fits the budget;
    `image` is the current observation's (kept when `config.max_images >= 1`).
    `image_processor`: the vision-language model's (rollout/vision.py); None: a text model."""
    history = memory.render(None)
    budget = len(history)
    processed: dict[int, tuple] = {}  # id(image) -> (image, pixel_values, grid, data URL): each done once
    while True:
        entries = memory.render(budget) if budget < len(history) else history
        images, positions = prompt_images(memory, len(entries), image, config.max_images)
        if image_processor is None or not images:
            text, ids = encode_messages(tokenizer, build_messages(instructions, observation, entries, step_index,
                                                                  config))
            prompt = Prompt(ids, text, len(entries), truncated_history=budget < len(history),
                            images=images, image_entries=positions)
        else:
            prompt = _image_prompt(tokenizer, image_processor, processed, instructions, observation, entries,
                                   step_index, config, images, positions)
            prompt.truncated_history = budget < len(history)
        if len(prompt.ids) <= config.max_prompt_tokens:
            return prompt
        if budget == 0:
            raise PromptTooLong(
                f"the step-{step_index} prompt is {len(prompt.ids)} tokens"
                f"{f' ({len(prompt.images)} image(s) included)' if prompt.pixel_values is not None else ''} "
                f"without any history; max_prompt_tokens={config.max_prompt_tokens} is too small for this env's "
                "instructions and observation"
            )
        budget -= 1


def build_image_messages(instructions: str, observation: str, history: list[str], step_index: int,
                         config: PromptConfig, image_entries: list[int]) -> list[dict]:
    """`build_messages` with the user message as content parts: an {"type": "image"} part
    before the observation text of each entry in `image_entries` (an index into
    `history`, or len(history): the current observation), the text otherwise the same."""
    marked = list(history)
    current = observation
    for e in image_entries:
        if e == len(history):
            current = _IMAGE_MARK + current
        else:
            head, sep, tail = marked[e].partition("Observation:\n")
            marked[e] = head + sep + _IMAGE_MARK + tail if sep else _IMAGE_MARK + marked[e]
    messages = build_messages(instructions, current, marked, step_index, config)
    parts: list[dict] = []
    for i, chunk in enumerate(messages[-1]["content"].split(_IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    messages[-1] = {"role": "user", "content": parts}
    return messages


def _image_prompt(tokenizer, image_processor, processed: dict, instructions: str, observation: str,
                  entries: list[str], step_index: int, config: PromptConfig, images: list,
                  positions: list[int]) -> Prompt:
    """A vision-language prompt: templated with image parts, its engine ids (one pad per
    image), expanded ids and processed images."""
    messages = build_image_messages(instructions, observation, entries, step_index, config, positions)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for im in images:
        if id(im) not in processed:
            # the image itself is kept in the tuple, so its id is not reused meanwhile
            processed[id(im)] = (im, *process_images(image_processor, [im]), encode_image_data(im))
    pixel_values = torch.cat([processed[id(im)][1] for im in images])
    grid = torch.cat([processed[id(im)][2] for im in images])
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = expand_image_pads(engine_ids, pad_id, image_token_counts(grid, merge_size(image_processor)))
    return Prompt(ids, text, len(entries), truncated_history=False, images=images, image_entries=positions,
                  engine_ids=engine_ids, image_data=[processed[id(im)][3] for im in images],
                  pixel_values=pixel_values, image_grid_thw=grid)


def prompt_images(memory: Memory, entries: int, image: Any, max_images: int) -> tuple[list, list[int]]:
    """The images of a prompt with `entries` history entries: the newest `max_images` of
    the entries' images (as the memory kept them) and the current one, in text order."""
    slots = list(memory.render_images(entries)) if entries and hasattr(memory, "render_images") else []
    slots = ([None] * entries + slots)[-entries:] if entries else []  # aligned with the newest entries
    slots.append(image)
    kept = [(i, im) for i, im in enumerate(slots) if im is not None][-max_images:] if max_images > 0 else []
    return [im for _, im in kept], [i for i, _ in kept]
