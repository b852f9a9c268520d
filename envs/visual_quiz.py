"""VisualQuiz: one question whose answer is only in the image.

Each episode is one step. The image shows one filled shape on a light grey background;
the model names its colour (`kind="colour"`) or its shape (`kind="shape"`). The text
observation is the same question for every episode of a config, so it carries no
information about the answer: a policy blind to the image wins with probability
exactly `chance_level(config)` = 1 / num_choices (the answer is uniform over the
choices and independent of the text), whatever it does. What the image does not
decide is drawn as nuisance: the other attribute (the shape when asking the colour,
the colour when asking the shape), the size and the position.

Drawing is pure numpy (pixel-centre tests against each shape's region): the same seed
gives the same pixels on any machine and any Pillow version. The anchor is the image
itself (exact on the pixels; `render_image=False`, the image-blind baseline, anchors on
the text).

Reward: 1 for the right answer (won), 0 for a wrong one; text that names no choice is
an invalid action, reward 0. The episode ends after the one step either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from envs.base import Observation, make_info, seeded_rng
from envs.projection import parse_bare_action, parse_json_action
from envs.registry import register_env

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "cross", "diamond", "ring")
BACKGROUND = (225, 225, 225)
KINDS = ("colour", "shape")


@dataclass
class VisualQuizConfig:
    # "colour": name the shape's colour; "shape": name its shape.
    kind: str = "colour"
    # The first num_choices colours (red green blue yellow purple orange) or shapes
    # (circle square triangle cross diamond ring): 2 to 6.
    num_choices: int = 4
    image_size: int = 64
    # False: no image (the image-blind baseline; the task is then chance by design).
    render_image: bool = True
    # "bare": the first word of the response that is a choice (tiny models trained from
    # scratch); "json": `"action": "<choice>"`.
    action_format: str = "bare"
    # "names": the choices are the names (`red`); "digits": `0`..`num_choices - 1`, the
    # question lists which name each stands for (tokenizers of a few words know digits).
    labels: str = "names"


def choice_names(config: VisualQuizConfig) -> tuple[str, ...]:
    names = tuple(COLOURS) if config.kind == "colour" else SHAPES
    return names[: config.num_choices]


def choice_labels(config: VisualQuizConfig) -> tuple[str, ...]:
    if config.labels == "digits":
        return tuple(str(i) for i in range(config.num_choices))
    return choice_names(config)


def question_text(config: VisualQuizConfig) -> str:
    """The text observation: the same for every episode of a config."""
    noun = "colour" if config.kind == "colour" else "shape"
    names = choice_names(config)
    if config.labels == "digits":
        choices = ", ".join(f"{i} {n}" for i, n in enumerate(names))
    else:
        choices = ", ".join(names)
    return f"Which {noun} is shown in the image?\nChoices: {choices}"


def answer_distribution(config: VisualQuizConfig) -> dict[str, Fraction]:
    """P(answer = label): the answer is drawn uniformly (`rng.integers(num_choices)`)."""
    return {label: Fraction(1, config.num_choices) for label in choice_labels(config)}


def chance_level(config: VisualQuizConfig) -> Fraction:
    """The best success rate of a policy blind to the image.

    The text is one fixed string, so such a policy's answer distribution q does not
    depend on the answer; it wins with probability sum_c q(c) P(answer = c) <=
    max_c P(answer = c), reached by always naming a most likely answer. Its expected
    reward is the same number (reward 1 for a win, 0 otherwise).
    """
    return max(answer_distribution(config).values())


def shape_mask(shape: str, size: int, centre: tuple[float, float], radius: float) -> np.ndarray:
    """(size, size) bool: the pixels whose centres fall in the shape."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    u, v = (xx - centre[1]) / radius, (yy - centre[0]) / radius
    if shape == "circle":
        return u * u + v * v <= 1.0
    if shape == "square":
        return (np.abs(u) <= 0.85) & (np.abs(v) <= 0.85)
    if shape == "triangle":  # apex up, base at the bottom
        return (v <= 0.8) & (v >= -0.95) & (np.abs(u) <= (v + 0.95) / 1.75 * 0.95)
    if shape == "cross":
        return ((np.abs(u) <= 0.3) & (np.abs(v) <= 0.95)) | ((np.abs(v) <= 0.3) & (np.abs(u) <= 0.95))
    if shape == "diamond":
        return np.abs(u) + np.abs(v) <= 1.0
    if shape == "ring":
        r2 = u * u + v * v
        return (r2 <= 1.0) & (r2 >= 0.36)
    raise ValueError(f"unknown shape {shape!r}")


def draw_quiz(shape: str, colour: str, size: int, centre: tuple[float, float], radius: float) -> np.ndarray:
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    image[shape_mask(shape, size, centre, radius)] = COLOURS[colour]
    image.flags.writeable = False  # shared by the observation, the prompt and the samples
    return image


class VisualQuizEnv:
    @staticmethod
    def instructions_for(config: VisualQuizConfig) -> str:
        noun = "colour" if config.kind == "colour" else "shape"
        labels = choice_labels(config)
        fmt = (f'Answer with JSON that ends in "action": "<your choice>", e.g. {{"action": "{labels[0]}"}}.'
               if config.action_format == "json" else "Answer with the choice alone.")
        return f"Look at the image and name the {noun} of the figure in it, one of: {', '.join(labels)}. {fmt}"

    def __init__(self, config: VisualQuizConfig):
        if config.kind not in KINDS:
            raise ValueError(f"kind={config.kind!r}; choose one of {KINDS}")
        if not 2 <= config.num_choices <= 6:
            raise ValueError(f"num_choices={config.num_choices}; use 2 to 6")
        if config.action_format not in ("bare", "json"):
            raise ValueError(f"action_format={config.action_format!r}; choose bare or json")
        if config.labels not in ("names", "digits"):
            raise ValueError(f"labels={config.labels!r}; choose names or digits")
        if config.image_size < 16:
            raise ValueError(f"image_size={config.image_size}; use 16 or more")
        self.config = config
        self.labels = choice_labels(config)
        self.text = question_text(config)
        self.answer: int | None = None
        self.observation: Observation | None = None
        self.done = True
        self.won = False

    def reset(self, seed: int) -> Observation:
        cfg, rng = self.config, seeded_rng(seed)
        self.answer = int(rng.integers(cfg.num_choices))
        other = int(rng.integers(len(SHAPES) if cfg.kind == "colour" else len(COLOURS)))
        if cfg.kind == "colour":
            colour, shape = tuple(COLOURS)[self.answer], SHAPES[other]
        else:
            colour, shape = tuple(COLOURS)[other], SHAPES[self.answer]
        size = cfg.image_size
        radius = float(rng.uniform(0.2, 0.4)) * size
        centre = (float(rng.uniform(radius, size - radius)), float(rng.uniform(radius, size - radius)))
        image = draw_quiz(shape, colour, size, centre, radius) if cfg.render_image else None
        self.observation = Observation(text=self.text, image=image, anchor=self.text if image is None else image)
        self.done, self.won = False, False
        return self.observation

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.observation is None:
            raise RuntimeError("step() before reset()")
        answer = self.labels[self.answer]
        if self.done:
            return self.observation, 0.0, True, make_info(False, self.won, action=None, answer=answer)
        parse = parse_json_action if self.config.action_format == "json" else parse_bare_action
        action = parse(text, self.labels)
        self.won = action == answer
        self.done = True
        info = make_info(action is not None, self.won, action=action, answer=answer, truncated=False)
        return self.observation, 1.0 if self.won else 0.0, True, info


register_env("visual_quiz", VisualQuizEnv, VisualQuizConfig)
