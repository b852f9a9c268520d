"""Every env's step() takes arbitrary text: it never raises, always returns the info
keys, and calls an action valid exactly when the env's projection rule says so."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import make_env
from envs.projection import parse_bare_action, parse_json_action, parse_search_or_answer, parse_tagged_action
from tests.unit.envs.test_projection import texts

SOKOBAN = ("up", "down", "left", "right")

RULES = {
    "sokoban": lambda t: parse_tagged_action(t, SOKOBAN) is not None,
    "numberline": lambda t: parse_json_action(t, ("+", "-")) is not None,
    "ezpoints": lambda t: parse_json_action(t, tuple(map(str, range(1, 11))) + ("+", "*", "=")) is not None,
    "points24": lambda t: parse_json_action(t, tuple(map(str, range(1, 11))) + tuple("+-*/()=")) is not None,
    "blackjack": lambda t: parse_json_action(t, ("hit", "stand")) is not None,
    "search": lambda t: parse_search_or_answer(t) is not None,
    "visual_quiz": lambda t: parse_bare_action(t, ("red", "green", "blue", "yellow")) is not None,
}

# Valid actions mixed in, so episodes also move forward and end.
VALID = {
    "sokoban": ["<think>.</think><action>left</action>", "<think>.</think><action>up</action>"],
    "numberline": ['"action": "+"', '"action": "-"'],
    "ezpoints": ['"action": "5"', '"action": "+"', '"action": "="'],
    "points24": ['"action": "("', '"action": "3"', '"action": "="'],
    "blackjack": ['"action": "hit"', '"action": "stand"'],
    "search": ["<search>capital</search>", "<answer>Paris</answer>"],
    "visual_quiz": ["red", "it is Blue"],
}


ENVS = {name: make_env(name, {} if name == "search" else {"render_image": False}) for name in RULES}


@pytest.mark.parametrize("name", sorted(RULES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), turns=st.data())
def test_fuzz_env_episode(name, seed, turns):
    env = ENVS[name]
    env.reset(seed)
    moves = turns.draw(st.lists(st.one_of(texts, st.sampled_from(VALID[name])), min_size=1, max_size=25))
    for text in moves:
        obs, reward, done, info = env.step(text)
        assert isinstance(obs.text, str) and isinstance(reward, float) and isinstance(done, bool)
        assert info["is_action_valid"] == RULES[name](text)
        assert isinstance(info["won"], bool)
        if done:
            break
