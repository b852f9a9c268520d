"""What the Gym Cards games share: cards, an infinite-deck draw, the PIL renderers and
the JSON answer hint."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SUITS = ("♠", "♥", "♦", "♣")
SUIT_LETTERS = {"♠": "S", "♥": "H", "♦": "D", "♣": "C"}
RANKS = ("A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K")
TABLE_GREEN = (53, 101, 77)

JSON_FORMAT_HINT = (
    'Answer with JSON that ends in "action": "<your choice>", e.g. {"thoughts": "...", "action": "%s"}.'
)


@dataclass(frozen=True)
class Card:
    rank: str
    suit: str

    def __str__(self) -> str:
        return f"{self.rank}{self.suit}"


def draw_card(rng: np.random.Generator) -> Card:
    """From an infinite deck: every rank and suit equally likely."""
    return Card(RANKS[int(rng.integers(13))], SUITS[int(rng.integers(4))])


def card_for_value(rng: np.random.Generator, value: int) -> Card:
    """A card worth `value` with face cards counted as 10 (10 -> 10, J, Q or K)."""
    rank = "A" if value == 1 else str(value)
    if value == 10:
        rank = ("10", "J", "Q", "K")[int(rng.integers(4))]
    return Card(rank, SUITS[int(rng.integers(4))])


# -- drawing ---------------------------------------------------------------------


@lru_cache(maxsize=16)
def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: a fixed bitmap font
        return ImageFont.load_default()


def _draw_card(draw: ImageDraw.ImageDraw, x: int, y: int, w: int, h: int, card: Card | None) -> None:
    if card is None:  # face down
        draw.rounded_rectangle(
            (x, y, x + w, y + h), radius=w // 8, fill=(40, 60, 160), outline="white", width=2
        )
        return
    color = (200, 30, 30) if card.suit in ("♥", "♦") else (20, 20, 20)
    draw.rounded_rectangle((x, y, x + w, y + h), radius=w // 8, fill="white", outline=(30, 30, 30), width=2)
    draw.text(
        (x + w // 2, y + h // 2 - h // 10), card.rank, fill=color, font=_font(max(10, h // 3)), anchor="mm"
    )
    draw.text(
        (x + w // 2, y + h - h // 5),
        SUIT_LETTERS[card.suit],
        fill=color,
        font=_font(max(8, h // 6)),
        anchor="mm",
    )


def render_table(rows: list[tuple[str, list[Card | None]]], footer: list[str], size: int) -> np.ndarray:
    """Rows of labelled cards on a green table, then footer text lines."""
    img = Image.new("RGB", (size, size), TABLE_GREEN)
    draw = ImageDraw.Draw(img)
    label_font = _font(max(10, size // 18))
    max_cards = max([len(cards) for _, cards in rows] + [2])
    card_w = min(size // 5, int((size - 10) / max_cards / 1.1))
    card_h = int(card_w * 1.4)
    y = size // 40
    for label, cards in rows:
        if label:
            draw.text((6, y), label, fill="white", font=label_font)
            y += size // 14
        for i, card in enumerate(cards):
            _draw_card(draw, 6 + int(i * card_w * 1.1), y, card_w, card_h, card)
        y += card_h + size // 30
    for line in footer:
        draw.text((6, y), line, fill="white", font=label_font)
        y += size // 14
    return np.asarray(img)


def render_lines(lines: list[str], size: int) -> np.ndarray:
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    font = _font(max(10, size // 9))
    for i, line in enumerate(lines):
        draw.text((size // 10, size // 5 + i * size * 2 // 5), line, fill="black", font=font)
    return np.asarray(img)
