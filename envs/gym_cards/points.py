"""EZPoints and Points24: build a formula from the dealt cards that equals the target."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from envs.base import Observation, make_info, seeded_rng
from envs.gym_cards.cards import JSON_FORMAT_HINT, Card, card_for_value, draw_card, render_table
from envs.projection import parse_json_action
from envs.registry import register_env

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
            image = render_table([("", list(self.cards))], [f"Formula: {formula}"], self.config.image_size)
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


register_env("ezpoints", PointsEnv, EZPointsConfig)
register_env("points24", PointsEnv, PointsConfig)
