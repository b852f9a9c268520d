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

The model's chat template is applied, then the text is tokenized: its ids are exactly
`tokenizer(text, add_special_tokens=False)`'s, assembled from cached ids of its pieces
(below). A prompt over `max_prompt_tokens` is rebuilt with fewer history entries (the
oldest dropped first) and flagged `truncated_history`; it is never cut mid-token. A
prompt still over the budget with no history at all raises `PromptTooLong`.

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

Pieces (text prompts): a window's history entries come back in the next steps' prompts,
and the template, instructions and headers in every prompt, so the text is cut where
its parts begin (the user message's parts: headers, history entries, observation,
footer), each piece is tokenized once per tokenizer and cached by its text (a piece not
cached yet is itself assembled from its lines, so the current observation's lines are
not tokenized again inside the next step's history entry), and the ids are the pieces'
ids one after the other. A cut is made only where the tokenizer tokenizes the two sides
apart: right after a newline and before a character that is not whitespace, where the
usual pre-tokenizers (GPT-2's, Llama 3's and Qwen2's patterns, whitespace splitting)
always end a piece; for a "tight" tokenizer also only after a character that is not
whitespace (GPT-2's pattern makes " \n" one piece at the end of a text, " " and "\n"
two before a word). Which rule holds is probed once per tokenizer (`probe_cuts`): lines
ending and starting in every kind of character (letters, digits, punctuation, tags,
non-Latin text, the tokenizer's added tokens) tokenized whole and in two must agree, and
no added token may hold a newline; else prompts are tokenized whole, and the reason is
logged once. The first `CHECKED_PROMPTS` prompts of each tokenizer are tokenized both
ways and compared as well (a difference: whole prompts from then on, logged). The cache
is per tokenizer object and used under the caller's tokenizer lock (rollout/episodes.py).
Image prompts are tokenized whole.
"""

from __future__ import annotations

import functools
import itertools
import logging
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

log = logging.getLogger("rollout.prompts")

_IMAGE_MARK = "\x00image\x00"  # where an image part goes, while the user text is assembled
# The first prompts of each tokenizer are also tokenized whole and compared with their pieces.
CHECKED_PROMPTS = 8
# The piece cache is emptied when it holds more token ids than this (~40 B a token).
MAX_CACHED_TOKENS = 4_000_000


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


def user_parts(observation: str, history: list[str], step_index: int, config: PromptConfig) -> list[str]:
    """The user message's parts, which it joins with newlines (the layout: module docstring)."""
    parts = []
    if history:
        parts.append(config.history_header)
        parts.extend(history)
    if config.observation_header:
        parts.append(config.observation_header.format(step=step_index))
    parts.append(observation)
    if config.action_footer:
        parts.append(config.action_footer)
    return parts


def build_messages(
    instructions: str, observation: str, history: list[str], step_index: int, config: PromptConfig
) -> list[dict]:
    return _messages(instructions, "\n".join(user_parts(observation, history, step_index, config)), config)


def _messages(instructions: str, user: str, config: PromptConfig) -> list[dict]:
    with_system = instructions and config.include_instructions
    return [{"role": "system", "content": instructions}] * bool(with_system) + [{"role": "user", "content": user}]


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
            parts = user_parts(observation, entries, step_index, config)
            user = "\n".join(parts)
            text = tokenizer.apply_chat_template(_messages(instructions, user, config), tokenize=False,
                                                 add_generation_prompt=True)
            ids = prompt_ids(tokenizer, text, part_starts(text, user, parts))
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


# -- prompt ids from cached pieces (module docstring) ---------------------------------

# Probe lines: how the line before a cut may end, and how the one after it may begin
# (and, with a few of those ends, every printable ASCII character).
_PROBE_ENDS = ["word", "Word", "12", "3.5", "x.", "x:", "x,", "x;", "x!", "x?", "x)", "x]", "x}", "x>", "#", "x_",
               "x-", "x'", 'x"', "x's", "x/", "x\\", "x*", "x=", "x~", "x`", "x|", "x@", "x$", "x%", "x^", "x&",
               "x+", "</action>", "Action: <action>up</action>", "é", "naïve", "日本語", "😀", "ÿ", "Ġ", "Ċ"]
_PROBE_STARTS = ["word", "Word", "12", ".5", ":", ",", "[Step 1]", "#", "_", "-", "'s", "'", '"', "(", ")", "<think>",
                 "<", "/", "*", "+", "=", "é", "日本語", "😀", "\u0301", "Ġx", "Current observation (step 3):"]
_SHORT_ENDS = ["word", "x.", "12", "</action>"]
_ASCII_STARTS = [chr(c) for c in range(33, 127)]
# ... and, for a "loose" tokenizer, lines ending in whitespace (a cut after " \n", "\n\n").
_LOOSE_ENDS = ["x ", "x\t", "x\r", "x\n", "x.\n", "x \n", "", " ", "\n"]


@dataclass
class PieceCache:
    """One tokenizer's piece ids, by piece text. `cuts`: "loose" (a cut after any
    newline that a non-whitespace character follows), "tight" (and that follows a
    non-whitespace character) or "none" (prompts are tokenized whole; `reason` says why)."""

    cuts: str
    reason: str = ""
    ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cached_tokens: int = 0
    checks_left: int = CHECKED_PROMPTS
    tokenized_tokens: int = 0  # over all prompts (the rest of their ids came from the cache)


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids as `tokenizer(text, add_special_tokens=False)` gives them (one call)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def tokenize_whole(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.lru_cache(maxsize=8)
def piece_cache(tokenizer) -> PieceCache:
    cuts, reason = probe_cuts(tokenizer)
    if cuts == "none":
        log.warning("prompts are tokenized whole with this tokenizer (%s)", reason)
    return PieceCache(cuts, reason)


def probe_cuts(tokenizer) -> tuple[str, str]:
    """Where this tokenizer tokenizes the two sides of a newline apart, by probe:
    ("loose" | "tight" | "none", why not looser)."""
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    contents = [str(getattr(t, "content", t)) for t in added]
    with_newline = [t for t in contents if "\n" in t]
    if with_newline:
        return "none", f"its added token {with_newline[0]!r} holds a newline"
    # the first added tokens, and every one that takes the whitespace around it or wants word boundaries
    flagged = [c for t, c in zip(added, contents)
               if getattr(t, "lstrip", False) or getattr(t, "rstrip", False) or getattr(t, "single_word", False)]
    tokens = list(dict.fromkeys(contents[:16] + flagged))
    try:
        problem = (_split_problem(tokenizer, _PROBE_ENDS + tokens, _PROBE_STARTS + tokens)
                   or _split_problem(tokenizer, _SHORT_ENDS, _ASCII_STARTS))
        if problem:
            return "none", f"it tokenizes {problem!r} across the newline"
        problem = _split_problem(tokenizer, _LOOSE_ENDS, _PROBE_STARTS + tokens)
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot take a batch of texts: whole prompts
        return "none", f"probing it raised {type(e).__name__}: {e}"
    return ("tight", f"it tokenizes {problem!r} across the newline") if problem else ("loose", "")


def _split_problem(tokenizer, ends: list[str], starts: list[str]) -> str | None:
    """The first end + "\n" + start whose ids differ from those of its two sides apart."""
    lefts, rights = [e + "\n" for e in ends], starts
    joined = [left + right for left in lefts for right in rights]
    ids = tokenize(tokenizer, lefts + rights + joined)
    apart = [a + b for a in ids[:len(lefts)] for b in ids[len(lefts):len(lefts) + len(rights)]]
    return next((text for text, whole, split in zip(joined, ids[len(lefts) + len(rights):], apart) if whole != split),
                None)


def part_starts(text: str, user: str, parts: list[str]) -> list[int]:
    """Where in `text` the user message `user` ("\n".join(parts)) and each of its parts
    begin ([] when the template did not write the message verbatim)."""
    start = text.find(user)
    if start < 0:
        return []
    starts = [start]
    for part in parts[:-1]:
        starts.append(starts[-1] + len(part) + 1)
    return starts


def prompt_ids(tokenizer, text: str, cuts: list[int]) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)`'s ids, assembled from the cached ids
    of the pieces of `text` between those of the positions `cuts` (increasing) where
    the tokenizer tokenizes the two sides apart. A piece not cached yet is assembled
    from its lines (cut where they may be), so that an observation tokenized as the
    current one is not tokenized again inside the next step's history entry."""
    cache = piece_cache(tokenizer)
    if cache.cuts == "none":
        return tokenize_whole(tokenizer, text)
    loose = cache.cuts == "loose"
    pieces = _cut(text, cuts, loose)
    known = {p: cache.ids.get(p) for p in pieces}
    missing = [p for p, ids in known.items() if ids is None]
    if missing:
        lines_of = {p: _cut(p, _line_starts(p), loose) for p in missing}
        line_ids = {line: cache.ids.get(line) for lines in lines_of.values() for line in lines}
        new = [line for line, ids in line_ids.items() if ids is None]
        if cache.cached_tokens > MAX_CACHED_TOKENS:
            cache.ids.clear()
            cache.cached_tokens = 0
        for line, ids in zip(new, tokenize(tokenizer, new)):
            line_ids[line] = _store(cache, line, tuple(ids))
            cache.tokenized_tokens += len(ids)
        for p in missing:
            known[p] = _store(cache, p, tuple(itertools.chain.from_iterable(map(line_ids.get, lines_of[p]))))
    out: list[int] = []
    for p in pieces:
        out.extend(known[p])
    if cache.checks_left > 0:
        cache.checks_left -= 1
        whole = tokenize_whole(tokenizer, text)
        if whole != out:
            cache.cuts, cache.reason = "none", f"a prompt's pieces gave other ids than the whole text: {pieces!r}"[:2000]
            log.warning("prompts are tokenized whole with this tokenizer (%s)", cache.reason)
            return whole
    return out


def _cut(text: str, cuts: list[int], loose: bool) -> list[str]:
    """`text` cut at those of `cuts` (increasing) that follow a newline and precede a
    character that is not whitespace (and, unless `loose`, follow one that is not)."""
    bounds = [0]
    for q in cuts:
        if bounds[-1] < q < len(text) and text[q - 1] == "\n" and not text[q].isspace() \
                and (loose or (q >= 2 and not text[q - 2].isspace())):
            bounds.append(q)
    bounds.append(len(text))
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _line_starts(text: str) -> list[int]:
    starts, at = [], 0
    for line in text.split("\n")[:-1]:
        at += len(line) + 1
        starts.append(at)
    return starts


def _store(cache: PieceCache, text: str, ids: tuple[int, ...]) -> tuple[int, ...]:
    cache.ids[text] = ids
    cache.cached_tokens += len(ids)
    return ids
