"""Blackjack against a dealer who stands on every 17, from an infinite deck."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.base import Observation, make_info, seeded_rng
from envs.gym_cards.cards import JSON_FORMAT_HINT, Card, draw_card, render_table
from envs.projection import parse_json_action
from envs.registry import register_env

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


register_env("blackjack", BlackjackEnv, BlackjackConfig)
