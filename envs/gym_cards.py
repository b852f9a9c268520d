"""The four Gym Cards games: NumberLine, EZPoints, Points24, Blackjack.

Each observation has an RGB image drawn with PIL (render_image=True, the default, as
in the published VLM runs) and a text variant; the anchor is the text variant. The
model answers in the `"action": "<token>"` form (see envs.projection.parse_json_action).

Rewards and step limits follow the published setups (docs/environments.md has the
table and each game's no-op for text that does not parse).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from envs.base import Observation, make_info, seeded_rng
from envs.projection import parse_bare_action, parse_json_action
from envs.registry import register_env

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


# -- NumberLine ------------------------------------------------------------------

NUMBERLINE_INSTRUCTIONS = (
    "You are playing NumberLine. Move 'Current' to 'Target' one step at a time: '+' adds 1, '-' subtracts 1 "
    "(positions stay between 0 and the maximum). " + JSON_FORMAT_HINT % "+"
)

NUMBERLINE_BARE_INSTRUCTIONS = "Move Current to Target: answer + to add 1 or - to subtract 1."


@dataclass
class NumberLineConfig:
    max_position: int = 5
    max_steps: int = 10
    render_image: bool = True
    image_size: int = 300
    # "json": `"action": "+"` (the Gym Cards form); "bare": the first word of the response
    # that is an action (tiny models trained from scratch, see docs/environments.md).
    action_format: str = "json"
    # "dense": the shaped reward below; "sparse": +1 on reaching the target, -0.1 for
    # every other step (only the outcome and the episode length say what was good).
    reward: str = "dense"


class NumberLineEnv:
    """Dense reward: +1 on reaching the target (episode ends, won); -1 for a step that
    does not get closer (a move away, a move blocked at either end, or text that does not
    parse, which leaves the cursor where it is); 0 for a step that gets closer.
    Sparse reward: +1 on reaching the target, -0.1 for any other step."""

    actions = ("+", "-")

    @staticmethod
    def instructions_for(config: NumberLineConfig) -> str:
        if config.action_format == "bare":
            return NUMBERLINE_BARE_INSTRUCTIONS
        return NUMBERLINE_INSTRUCTIONS

    def __init__(self, config: NumberLineConfig):
        if config.max_position < 1:
            raise ValueError("max_position must be >= 1")
        if config.action_format not in ("json", "bare"):
            raise ValueError(f"action_format={config.action_format!r}; choose json or bare")
        if config.reward not in ("dense", "sparse"):
            raise ValueError(f"reward={config.reward!r}; choose dense or sparse")
        self.config = config
        self.target = self.position = 0
        self.steps = 0
        self.done = True

    def _observation(self) -> Observation:
        text = f"Target: {self.target}\nCurrent: {self.position}"
        image = None
        if self.config.render_image:
            image = render_lines(
                [f"Target: {self.target}", f"Current: {self.position}"], self.config.image_size
            )
        return Observation(text=text, image=image, anchor=text)

    def reset(self, seed: int) -> Observation:
        rng = seeded_rng(seed)
        n = self.config.max_position + 1
        self.target = int(rng.integers(n))
        self.position = (self.target + 1 + int(rng.integers(n - 1))) % n  # any position but the target
        self.steps = 0
        self.done = False
        return self._observation()

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.done:
            return self._observation(), 0.0, True, make_info(False, self.position == self.target, action=None)
        parse = parse_bare_action if self.config.action_format == "bare" else parse_json_action
        action = parse(text, self.actions)
        self.steps += 1
        before = abs(self.position - self.target)
        if action == "+":
            self.position = min(self.position + 1, self.config.max_position)
        elif action == "-":
            self.position = max(self.position - 1, 0)
        after = abs(self.position - self.target)
        won = after == 0
        if self.config.reward == "sparse":
            reward = 1.0 if won else -0.1
        else:
            reward = 1.0 if won else (-1.0 if after >= before else 0.0)
        self.done = won or self.steps >= self.config.max_steps
        info = make_info(action is not None, won, action=action, truncated=self.done and not won)
        return self._observation(), reward, self.done, info


# -- EZPoints and Points24 -------------------------------------------------------

SOLVED_POINTS_REWARD = 10.0
WRONG_POINTS_REWARD = -1.0


def evaluate_formula(tokens: list[str]) -> Fraction | None:
    """Exact value of an infix formula over number and + - * / ( ) tokens, or None when
    it does not parse (two numbers in a row, unbalanced brackets...) or divides by zero."""
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expr():
        value = term()
        while peek() in ("+", "-"):
            op, rhs = take(), term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term():
        value = factor()
        while peek() in ("*", "/"):
            op, rhs = take(), factor()
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor():
        tok = peek()
        if tok == "(":
            take()
            value = expr()
            if take_if(")"):
                return value
            raise ValueError("unbalanced")
        if tok is not None and tok.isdigit():
            return Fraction(int(take()))
        raise ValueError(f"unexpected {tok!r}")

    def take_if(tok):
        if peek() == tok:
            take()
            return True
        return False

    try:
        value = expr()
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return value if pos == len(tokens) else None


def solve_points(
    values: list[int], target: int, operators: tuple[str, ...] = ("+", "-", "*", "/"), brackets: bool = True
) -> list[str] | None:
    """A token formula that uses every value once and equals target, or None (brute force)."""

    def search(items):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (a, ta), (b, tb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                for op in operators:
                    if op == "/" and b == 0:
                        continue
                    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
                    tokens = ["(", *ta, op, *tb, ")"] if brackets else [*ta, op, *tb]
                    found = search([*rest, (value, tokens)])
                    if found is not None:
                        return found
        return None

    found = search([(Fraction(v), [str(v)]) for v in values])
    if found is not None and brackets and found[0] == "(" and evaluate_formula(found[1:-1]) == target:
        found = found[1:-1]
    return found


@dataclass
class PointsConfig:
    target: int = 24
    num_cards: int = 4
    operators: tuple[str, ...] = ("+", "-", "*", "/", "(", ")")
    max_steps: int = 20
    face_cards_as_10: bool = True
    # Two-card deals only: the second card is chosen so the pair makes the target with +
    # or * (holds for targets up to 20, e.g. EZPoints' 12).
    guaranteed_solvable_pair: bool = False
    render_image: bool = True
    image_size: int = 300


@dataclass
class EZPointsConfig(PointsConfig):
    target: int = 12
    num_cards: int = 2
    operators: tuple[str, ...] = ("+", "*")
    max_steps: int = 8
    guaranteed_solvable_pair: bool = True


class PointsEnv:
    """Build a formula from the shown cards, one token per step, then '='.

    A number token must be the value of a card not used yet (A = 1, J/Q/K = 10 with
    face_cards_as_10, else 11/12/13). '=' ends the episode: +10 (won) when every card
    is used once and the formula equals the target, else -1. A number that is not an
    unused card, and text that does not parse, leave the formula unchanged and give -1.
    Other tokens give 0. Reaching max_steps ends the episode, not won.
    """

    def __init__(self, config: PointsConfig):
        self.config = config
        top = 10 if config.face_cards_as_10 else 13
        self.numbers = tuple(str(v) for v in range(1, top + 1))
        self.actions = self.numbers + tuple(config.operators) + ("=",)
        self.cards: list[Card] = []
        self.values: list[int] = []
        self.formula: list[str] = []
        self.used: list[int] = []  # indices of cards used, in formula order
        self.steps = 0
        self.done = True

    @staticmethod
    def instructions_for(config: PointsConfig) -> str:
        return (
            f"You are playing a cards-to-{config.target} game. Write a formula that uses every card "
            f"exactly once and equals {config.target}, one token per step: a card value "
            f"(A=1, J/Q/K={'10' if config.face_cards_as_10 else '11/12/13'}), an operator "
            f"({' '.join(config.operators)}), and finally '='. " + JSON_FORMAT_HINT % "2"
        )

    def _value(self, card: Card) -> int:
        if card.rank == "A":
            return 1
        if card.rank in ("J", "Q", "K"):
            return 10 if self.config.face_cards_as_10 else 11 + ("J", "Q", "K").index(card.rank)
        return int(card.rank)

    def _observation(self) -> Observation:
        cards = " ".join(str(c) for c in self.cards)
        formula = " ".join(self.formula)
        text = f"Cards: {cards}\nFormula: {formula}".rstrip()
        image = None
        if self.config.render_image:
            image = render_table([("", list(self.cards))], ["Formula:", formula], self.config.image_size)
        return Observation(text=text, image=image, anchor=text)

    def reset(self, seed: int) -> Observation:
        rng = seeded_rng(seed)
        cfg = self.config
        if cfg.guaranteed_solvable_pair:
            first = int(rng.integers(2, 11))
            divides = cfg.target % first == 0 and cfg.target // first <= 10 and "*" in cfg.operators
            second = cfg.target // first if divides and rng.random() < 0.5 else cfg.target - first
            second = min(max(second, 1), 10)
            pair = [card_for_value(rng, first), card_for_value(rng, second)]
            self.cards = pair[::-1] if rng.random() < 0.5 else pair
        else:
            self.cards = [draw_card(rng) for _ in range(cfg.num_cards)]
        self.values = [self._value(c) for c in self.cards]
        self.formula, self.used = [], []
        self.steps = 0
        self.done = False
        return self._observation()

    def _unused_card_with(self, value: int) -> int | None:
        for i, v in enumerate(self.values):
            if v == value and i not in self.used:
                return i
        return None

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.done:
            return self._observation(), 0.0, True, make_info(False, False, action=None)
        action = parse_json_action(text, self.actions)
        self.steps += 1
        reward, won, legal, ended = 0.0, False, True, False
        if action is None:
            reward, legal = WRONG_POINTS_REWARD, False
        elif action == "=":
            value = evaluate_formula(self.formula)
            won = value == self.config.target and len(self.used) == len(self.cards)
            reward = SOLVED_POINTS_REWARD if won else WRONG_POINTS_REWARD
            ended = True
        elif action in self.numbers:
            card = self._unused_card_with(int(action))
            if card is None:
                reward, legal = WRONG_POINTS_REWARD, False
            else:
                self.used.append(card)
                self.formula.append(action)
        else:
            self.formula.append(action)
        self.done = ended or self.steps >= self.config.max_steps
        info = make_info(
            action is not None,
            won,
            action=action,
            legal_move=legal,
            formula=" ".join(self.formula),
            truncated=self.done and not ended,
        )
        return self._observation(), reward, self.done, info


# -- Blackjack -------------------------------------------------------------------

BLACKJACK_INSTRUCTIONS = (
    "You are playing Blackjack against the dealer. Get closer to 21 than the dealer without going over. "
    "'hit' takes another card, 'stand' ends your turn and the dealer draws to 17 or more. "
    "Aces count 1 or 11, J/Q/K count 10. " + JSON_FORMAT_HINT % "stand"
)


def hand_total(cards: list[Card]) -> int:
    total = sum(1 if c.rank == "A" else 10 if c.rank in ("J", "Q", "K") else int(c.rank) for c in cards)
    if any(c.rank == "A" for c in cards) and total + 10 <= 21:
        total += 10
    return total


def is_natural(cards: list[Card]) -> bool:
    return len(cards) == 2 and hand_total(cards) == 21


@dataclass
class BlackjackConfig:
    max_steps: int = 15
    render_image: bool = True
    image_size: int = 300


class BlackjackEnv:
    """Infinite deck; the dealer shows one card and stands on every 17 (soft too).

    hit: another card; over 21 is a loss (-1) and ends the episode. stand: the dealer
    draws to 17+, then +1 win / -1 loss / 0 draw. A natural (21 with the first two
    cards) beats any other 21; two naturals draw. Text that does not parse is a no-op
    (reward 0). Reaching max_steps without standing or busting forfeits: -1.
    """

    actions = ("hit", "stand")

    @staticmethod
    def instructions_for(config: BlackjackConfig) -> str:
        return BLACKJACK_INSTRUCTIONS

    def __init__(self, config: BlackjackConfig):
        self.config = config
        self.player: list[Card] = []
        self.dealer: list[Card] = []
        self.rng: np.random.Generator | None = None
        self.steps = 0
        self.done = True
        self.outcome: str | None = None

    def _observation(self) -> Observation:
        player = f"Player: {' '.join(map(str, self.player))} (total {hand_total(self.player)})"
        if self.outcome is None:
            dealer = f"Dealer: {self.dealer[0]} [hidden]"
            dealer_cards = [self.dealer[0], None]
        else:
            dealer = f"Dealer: {' '.join(map(str, self.dealer))} (total {hand_total(self.dealer)})"
            dealer_cards = list(self.dealer)
        text = f"{dealer}\n{player}"
        image = None
        if self.config.render_image:
            footer = [] if self.outcome is None else [f"Result: {self.outcome}"]
            image = render_table(
                [("Dealer", dealer_cards), ("Player", list(self.player))], footer, self.config.image_size
            )
        return Observation(text=text, image=image, anchor=text)

    def reset(self, seed: int) -> Observation:
        self.rng = seeded_rng(seed)
        self.player = [draw_card(self.rng), draw_card(self.rng)]
        self.dealer = [draw_card(self.rng), draw_card(self.rng)]
        self.steps = 0
        self.done = False
        self.outcome = None
        return self._observation()

    def _settle(self) -> float:
        while hand_total(self.dealer) < 17:
            self.dealer.append(draw_card(self.rng))
        player, dealer = hand_total(self.player), hand_total(self.dealer)
        player_nat, dealer_nat = is_natural(self.player), is_natural(self.dealer)
        if player_nat or dealer_nat:
            return float(player_nat) - float(dealer_nat)
        if dealer > 21:
            return 1.0
        return float(player > dealer) - float(player < dealer)

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.done:
            return self._observation(), 0.0, True, make_info(False, self.outcome == "win", action=None)
        action = parse_json_action(text, self.actions)
        self.steps += 1
        reward, ended = 0.0, False
        if action == "hit":
            self.player.append(draw_card(self.rng))
            if hand_total(self.player) > 21:
                reward, ended = -1.0, True
        elif action == "stand":
            reward, ended = self._settle(), True
        truncated = not ended and self.steps >= self.config.max_steps
        if truncated:
            reward = -1.0
        self.done = ended or truncated
        if self.done:
            self.outcome = {1.0: "win", 0.0: "draw", -1.0: "loss"}[reward]
        info = make_info(
            action is not None,
            reward > 0,
            action=action,
            outcome=self.outcome,
            player_total=hand_total(self.player),
            truncated=truncated,
        )
        return self._observation(), reward, self.done, info


register_env("numberline", NumberLineEnv, NumberLineConfig)
register_env("ezpoints", PointsEnv, EZPointsConfig)
register_env("points24", PointsEnv, PointsConfig)
register_env("blackjack", BlackjackEnv, BlackjackConfig)
