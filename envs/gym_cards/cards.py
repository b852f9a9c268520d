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


def _draw_pip(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, suit: str, color) -> None:
    """The suit as a drawn symbol (no font needed), centred on (cx, cy), about 2r wide."""

    def disc(x: float, y: float, radius: float) -> None:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=color)

    if suit == "♦":
        draw.polygon([(cx, cy - r), (cx + 0.75 * r, cy), (cx, cy + r), (cx - 0.75 * r, cy)], fill=color)
    elif suit == "♥":
        disc(cx - 0.48 * r, cy - 0.35 * r, 0.52 * r)
        disc(cx + 0.48 * r, cy - 0.35 * r, 0.52 * r)
        draw.polygon([(cx - r, cy - 0.2 * r), (cx + r, cy - 0.2 * r), (cx, cy + r)], fill=color)
    elif suit == "♠":
        disc(cx - 0.48 * r, cy + 0.2 * r, 0.52 * r)
        disc(cx + 0.48 * r, cy + 0.2 * r, 0.52 * r)
        draw.polygon([(cx - r, cy + 0.1 * r), (cx + r, cy + 0.1 * r), (cx, cy - r)], fill=color)
        draw.polygon([(cx, cy + 0.2 * r), (cx - 0.4 * r, cy + r), (cx + 0.4 * r, cy + r)], fill=color)
    else:  # clubs
        disc(cx, cy - 0.45 * r, 0.42 * r)
        disc(cx - 0.5 * r, cy + 0.15 * r, 0.42 * r)
        disc(cx + 0.5 * r, cy + 0.15 * r, 0.42 * r)
        draw.polygon([(cx, cy), (cx - 0.35 * r, cy + r), (cx + 0.35 * r, cy + r)], fill=color)


def _draw_card(draw: ImageDraw.ImageDraw, x: int, y: int, w: int, h: int, card: Card | None) -> None:
    """A card: the rank large in the upper half, the suit drawn below it (red for hearts
    and diamonds, black for spades and clubs); face down: a blue back."""
    border = max(1, w // 20)
    if card is None:  # face down
        draw.rounded_rectangle(
            (x, y, x + w, y + h), radius=max(1, w // 8), fill=(40, 60, 160), outline="white", width=border
        )
        return
    color = (200, 30, 30) if card.suit in ("♥", "♦") else (20, 20, 20)
    draw.rounded_rectangle(
        (x, y, x + w, y + h), radius=max(1, w // 8), fill="white", outline=(30, 30, 30), width=border
    )
    font_size = max(8, int(min(h * 0.4, w * (0.85 if len(card.rank) == 1 else 0.5))))
    draw.text((x + w / 2, y + h * 0.3), card.rank, fill=color, font=_font(font_size), anchor="mm")
    _draw_pip(draw, x + w / 2, y + h * 0.72, min(w * 0.28, h * 0.18), card.suit, color)


def _wrap(draw: ImageDraw.ImageDraw, line: str, font, width: float) -> list[str]:
    """The line cut at spaces into pieces no wider than width (a long word stays whole)."""
    out: list[str] = []
    for word in line.split(" "):
        if out and draw.textlength(out[-1] + " " + word, font=font) <= width:
            out[-1] += " " + word
        else:
            out.append(word)
    return out or [""]


def render_table(rows: list[tuple[str, list[Card | None]]], footer: list[str], size: int) -> np.ndarray:
    """Rows of labelled cards on a green table, then footer text lines (wrapped), as an
    HxWx3 uint8 array. Cards take the room the text leaves, so they stay legible from
    ~112 px up."""
    img = Image.new("RGB", (size, size), TABLE_GREEN)
    draw = ImageDraw.Draw(img)
    margin = max(2, size // 40)
    font_px = max(10, size // 12)
    label_font = _font(font_px)
    line_h = int(font_px * 1.25)
    lines = [piece for line in footer for piece in _wrap(draw, line, label_font, size - 2 * margin)]
    labels = sum(1 for label, _ in rows if label)
    gap = max(2, size // 40)
    room_h = size - 2 * margin - labels * line_h - len(lines) * line_h - gap * len(rows)
    max_cards = max([len(cards) for _, cards in rows] + [2])
    card_h = min(room_h / max(len(rows), 1), 1.4 * (size - 2 * margin) / (max_cards * 1.08))
    card_h = max(int(card_h), 8)
    card_w = max(int(card_h / 1.4), 6)
    y = margin
    for label, cards in rows:
        if label:
            draw.text((margin, y), label, fill="white", font=label_font)
            y += line_h
        for i, card in enumerate(cards):
            _draw_card(draw, margin + int(i * card_w * 1.08), y, card_w, card_h, card)
        y += card_h + gap
    for line in lines:
        draw.text((margin, y), line, fill="white", font=label_font)
        y += line_h
    return np.asarray(img)


def render_lines(lines: list[str], size: int) -> np.ndarray:
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    font = _font(max(10, size // 9))
    for i, line in enumerate(lines):
        draw.text((size // 10, size // 5 + i * size * 2 // 5), line, fill="black", font=font)
    return np.asarray(img)
