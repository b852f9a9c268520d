"""The four Gym Cards games: NumberLine, EZPoints, Points24, Blackjack.

Each observation has an RGB image drawn with PIL (render_image=True, the default, as
in the published VLM runs) and a text variant; the anchor is the text variant. The
model answers in the `"action": "<token>"` form (see envs.projection.parse_json_action).

Rewards and step limits follow the published setups (docs/environments.md has the
table and each game's no-op for text that does not parse). Importing this package
registers all four games.
"""

from envs.gym_cards.blackjack import BlackjackConfig, BlackjackEnv, hand_total, is_natural
from envs.gym_cards.cards import RANKS, SUITS, Card, card_for_value, draw_card, render_lines, render_table
from envs.gym_cards.numberline import NumberLineConfig, NumberLineEnv
from envs.gym_cards.points import EZPointsConfig, PointsConfig, PointsEnv, evaluate_formula, solve_points

__all__ = [
    "RANKS",
    "SUITS",
    "BlackjackConfig",
    "BlackjackEnv",
    "Card",
    "EZPointsConfig",
    "NumberLineConfig",
    "NumberLineEnv",
    "PointsConfig",
    "PointsEnv",
    "card_for_value",
    "draw_card",
    "evaluate_formula",
    "hand_total",
    "is_natural",
    "render_lines",
    "render_table",
    "solve_points",
]
