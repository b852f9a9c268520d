"""Image observations of Sokoban and the Gym Cards games: deterministic HxWx3 uint8
frames that are a one-to-one function of the text state (the anchor), so GiGPO's step
groups are the same whether keyed on the text or exactly on the pixels."""

from __future__ import annotations

import numpy as np
import pytest

from envs import make_env
from envs.base import seeded_rng

ACTIONS = {
    "sokoban": [f"<think>.</think><action>{m}</action>" for m in ("up", "down", "left", "right")],
    "numberline": ['"action": "+"', '"action": "-"'],
    "ezpoints": [f'"action": "{t}"' for t in ("2", "3", "4", "6", "+", "*", "=")],
    "points24": [f'"action": "{t}"' for t in ("1", "3", "8", "10", "+", "*", "(", ")", "=")],
    "blackjack": ['"action": "hit"', '"action": "hit"', '"action": "stand"'],
}
SIZE = {"sokoban": {"tile_px": 16}, "numberline": {"image_size": 112}, "ezpoints": {"image_size": 112},
        "points24": {"image_size": 112}, "blackjack": {"image_size": 112}}


@pytest.mark.parametrize("name", sorted(ACTIONS))
def test_frames_are_a_one_to_one_function_of_the_text_state(name):
    env = make_env(name, render_image=True, **SIZE[name])
    text_to_pixels: dict[str, bytes] = {}
    pixels_to_text: dict[bytes, str] = {}
    shape = (96, 96, 3) if name == "sokoban" else (112, 112, 3)
    for seed in range(12):
        rng = seeded_rng(1000 + seed)
        obs, done = env.reset(seed), False
        for _ in range(12):
            assert obs.image.shape == shape and obs.image.dtype == np.uint8 and obs.anchor == obs.text
            assert not obs.image.flags.writeable  # shared downstream, never edited
            key = obs.image.tobytes()
            assert text_to_pixels.setdefault(obs.text, key) == key, "one state, one frame"
            assert pixels_to_text.setdefault(key, obs.text) == obs.text, "one frame, one state"
            if done:
                break
            obs, _, done, _ = env.step(ACTIONS[name][int(rng.integers(len(ACTIONS[name])))])
    assert len(text_to_pixels) > 12  # the walk met many states
    again = make_env(name, render_image=True, **SIZE[name]).reset(3)
    assert np.array_equal(again.image, env.reset(3).image)  # deterministic
