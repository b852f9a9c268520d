"""Parse the model's raw text into an env action. None means invalid; nothing raises.

The rules are deliberately strict so that validity is a crisp property (the fuzz tests
state them independently):

- Tags are matched ASCII-case-insensitively (`<Action>` == `<action>`), nothing else
  is folded, so look-alike unicode letters never form a tag.
- A tagged block is valid only when its opening tag and its closing tag each occur
  exactly once, in that order. Nested or repeated tags are invalid.
- A chosen word is compared after stripping surrounding whitespace and lowercasing,
  and must be ASCII.
"""

from __future__ import annotations

import re
from functools import cache

_FLAGS = re.IGNORECASE | re.ASCII


@cache
def _tag_patterns(tag: str) -> tuple[re.Pattern, re.Pattern]:
    return re.compile(f"<{re.escape(tag)}>", _FLAGS), re.compile(f"</{re.escape(tag)}>", _FLAGS)


def tag_positions(text: str, tag: str) -> tuple[list[int], list[int]]:
    """Start offsets of every `<tag>` and every `</tag>`."""
    open_re, close_re = _tag_patterns(tag)
    return [m.start() for m in open_re.finditer(text)], [m.start() for m in close_re.finditer(text)]


def tag_count(text: str, tag: str) -> int:
    """Occurrences of `<tag>` plus occurrences of `</tag>`."""
    opens, closes = tag_positions(text, tag)
    return len(opens) + len(closes)


def single_block(text: str, tag: str) -> tuple[int, int, str] | None:
    """(start, end, content) of the one `<tag>...</tag>` block, or None when the tag is
    missing, repeated, nested or out of order."""
    opens, closes = tag_positions(text, tag)
    if len(opens) != 1 or len(closes) != 1 or opens[0] > closes[0]:
        return None
    start = opens[0] + len(tag) + 2
    return opens[0], closes[0] + len(tag) + 3, text[start : closes[0]]


def normalise_choice(value: str, choices: tuple[str, ...]) -> str | None:
    word = value.strip()
    if not word.isascii():
        return None
    word = word.lower()
    return word if word in choices else None


def action_block(text: object, require_think: bool = True) -> str | None:
    """The content of the one `<action>` block, with (require_think) exactly one
    `<think>` block closing before it opens; None otherwise. Text outside is ignored."""
    if not isinstance(text, str):
        return None
    action = single_block(text, "action")
    if action is None:
        return None
    if require_think:
        think = single_block(text, "think")
        if think is None or think[1] > action[0]:
            return None
    return action[2]


def parse_tagged_action(text: object, choices: tuple[str, ...], require_think: bool = True) -> str | None:
    """`<think>...</think><action>word</action>` -> word, when the action block's
    content is one of `choices` (`action_block`'s rules for the blocks)."""
    action = action_block(text, require_think)
    return None if action is None else normalise_choice(action, choices)


_JSON_KEY = re.compile(r'"(?ai:action)"\s*:\s*')  # whitespace in the unicode sense, like str.strip()
_JSON_VALUE = re.compile(r'"([^"]*)"|([^\s,"{}\[\]]+)')


def parse_bare_action(text: object, choices: tuple[str, ...]) -> str | None:
    """The first whitespace-separated word of the text that is one of `choices`.

    The format of tiny models trained from scratch (the CPU default job): one action
    token among a few generated ones, nothing to learn about tags first.
    """
    if not isinstance(text, str):
        return None
    for word in text.split():
        choice = normalise_choice(word, choices)
        if choice is not None:
            return choice
    return None


def parse_json_action(text: object, choices: tuple[str, ...]) -> str | None:
    """The Gym Cards form `"action": "+"` (quotes around the value optional).

    Valid when the key `"action":` occurs exactly once and its value is one of `choices`.
    """
    if not isinstance(text, str):
        return None
    keys = list(_JSON_KEY.finditer(text))
    if len(keys) != 1:
        return None
    value = _JSON_VALUE.match(text, keys[0].end())
    if value is None:
        return None
    raw = value.group(1) if value.group(1) is not None else value.group(2)
    return normalise_choice(raw, choices)


def parse_search_or_answer(text: object) -> tuple[str, str] | None:
    """`<search>q</search>` -> ("search", q); `<answer>a</answer>` -> ("answer", a).

    Valid when exactly one of the two tags is used, as one well-formed block with
    non-blank content. Both tags present, or either repeated, is invalid.
    """
    if not isinstance(text, str):
        return None
    found = []
    for kind in ("search", "answer"):
        if tag_count(text, kind) == 0:
            continue
        block = single_block(text, kind)
        if block is None:
            return None
        found.append((kind, block[2].strip()))
    if len(found) != 1 or not found[0][1]:
        return None
    return found[0]
