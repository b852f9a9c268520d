"""NumberLine: move a cursor to a target, one '+' or '-' per step."""

from __future__ import annotations

from dataclasses import dataclass

from envs.base import Observation, make_info, seeded_rng
from envs.gym_cards.cards import JSON_FORMAT_HINT, render_lines
from envs.projection import parse_bare_action, parse_json_action
from envs.registry import register_env

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


register_env("numberline", NumberLineEnv, NumberLineConfig)
