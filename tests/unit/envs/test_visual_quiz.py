"""VisualQuiz: the text carries nothing about the answer, the image decides it, and the
chance level of an image-blind policy is exact."""

from __future__ import annotations

import pickle
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from envs import EnvManager, Observation, make_env
from envs.base import AnchorDigest, with_anchor_digest
from envs.visual_quiz import BACKGROUND, COLOURS, SHAPES, VisualQuizConfig, chance_level, shape_mask
from megatron_agent.algorithms.gigpo import anchor_key, anchor_state_codes

SEEDS = range(400)


def decode_colour(image: np.ndarray) -> str:
    """The colour of the pixels that are not the background."""
    figure = np.unique(image[(image != BACKGROUND).any(-1)], axis=0)
    assert len(figure) == 1  # one flat colour
    rgb = tuple(int(x) for x in figure[0])
    return next(name for name, value in COLOURS.items() if value == rgb)


def _normalised(mask: np.ndarray, n: int = 24) -> np.ndarray:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    crop = mask[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
    ri = (np.arange(n) + 0.5) * crop.shape[0] / n
    ci = (np.arange(n) + 0.5) * crop.shape[1] / n
    return crop[ri.astype(int)][:, ci.astype(int)]


TEMPLATES = {s: _normalised(shape_mask(s, 240, (120.0, 120.0), 100.0)) for s in SHAPES}


def decode_shape(image: np.ndarray) -> str:
    """The template nearest to the figure's mask, cropped to its box (pixels alone)."""
    mask = _normalised((image != BACKGROUND).any(-1))
    return min(SHAPES, key=lambda s: int((TEMPLATES[s] != mask).sum()))


@pytest.mark.parametrize("kind,labels", [("colour", "names"), ("shape", "digits")])
def test_text_is_blind_and_the_image_decides_the_answer(kind, labels):
    config = VisualQuizConfig(kind=kind, num_choices=6, labels=labels)
    env = make_env("visual_quiz", config)
    texts, answers = set(), Counter()
    for seed in SEEDS:
        obs = env.reset(seed)
        texts.add(obs.text)
        answer = env.step("")[3]["answer"]
        answers[answer] += 1
        decoded = (decode_colour if kind == "colour" else decode_shape)(obs.image)
        names = list(COLOURS) if kind == "colour" else list(SHAPES)
        assert env.labels[names.index(decoded)] == answer, seed  # the pixels alone give the answer
        assert obs.image.shape == (64, 64, 3) and obs.image.dtype == np.uint8
    assert len(texts) == 1  # one question for every answer: the text says nothing
    assert set(answers) == set(env.labels)  # and every answer occurs
    # Answers are uniform, so the best blind policy (always one answer) wins 1/K.
    assert chance_level(config) == Fraction(1, 6)
    assert max(answers.values()) / len(SEEDS) < 1 / 6 + 0.06


def test_rewards_actions_and_one_step_episodes():
    env = make_env("visual_quiz", kind="colour", num_choices=4)
    env.reset(3)
    answer = env.labels[env.answer]
    wrong = next(label for label in env.labels if label != answer)
    obs, reward, done, info = env.step(f"it is {answer.upper()}")
    assert (reward, done, info["won"], info["is_action_valid"]) == (1.0, True, True, True)
    assert env.step(answer)[1:3] == (0.0, True)  # done: no second answer
    env.reset(3)
    assert env.step(wrong)[1:3] == (0.0, True)
    env.reset(3)
    _, reward, done, info = env.step("no idea")
    assert (reward, done, info["is_action_valid"], info["won"]) == (0.0, True, False, False)
    json_env = make_env("visual_quiz", action_format="json", labels="digits")
    json_env.reset(3)
    assert json_env.step(f'{{"action": "{json_env.answer}"}}')[3]["won"]
    with pytest.raises(ValueError, match="num_choices"):
        make_env("visual_quiz", num_choices=7)
    assert make_env("visual_quiz", render_image=False).reset(3).image is None


def test_image_anchors_are_exact_on_the_pixels_and_pickle_cheaply():
    env = make_env("visual_quiz", kind="shape")
    first, again, other = env.reset(5), env.reset(5), env.reset(6)
    assert first.anchor is first.image
    assert anchor_key(first.anchor) == anchor_key(again.anchor)  # same state, same step group
    assert anchor_key(first.anchor) != anchor_key(other.anchor)
    flipped = np.array(first.image)
    flipped[0, 0, 0] ^= 1  # one pixel off is another state
    assert anchor_key(flipped) != anchor_key(first.anchor)
    blob = pickle.dumps(first)
    assert len(blob) < first.image.nbytes + 1024  # the pixels once (image and anchor share them)
    back = pickle.loads(blob)
    assert back.anchor is back.image and anchor_key(back.anchor) == anchor_key(first.anchor)


def test_groups_through_the_process_pool_share_the_image():
    """The anchor leaves the env worker as a digest of the pixels (the frame is not sent
    twice), and GiGPO groups states on it as on the pixels themselves."""
    with EnvManager("visual_quiz", {"image_size": 32}, num_groups=2, group_size=2, num_workers=2) as envs:
        obs = envs.reset([1, 2])
        assert all(isinstance(o.anchor, AnchorDigest) and len(o.anchor.digest) == 32 for o in obs)
        direct = [make_env("visual_quiz", image_size=32).reset(seed).image for seed in (1, 1, 2, 2)]
        assert [o.anchor for o in obs] == [with_anchor_digest(Observation("", anchor=im)).anchor for im in direct]
        assert len(pickle.dumps(obs[0])) < obs[0].image.nbytes + 1024  # the pixels once, and 32 bytes
        pixel_codes, _ = anchor_state_codes(direct, np.zeros(4, dtype=np.int64))
        digest_codes, _ = anchor_state_codes([o.anchor for o in obs], np.zeros(4, dtype=np.int64))
        assert list(pixel_codes) == list(digest_codes)
        keys = [anchor_key(o.anchor) for o in obs]
        assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]
        # GiGPO's step groups on the pixels: copies of one state together, others apart
        codes, _ = anchor_state_codes([o.anchor for o in obs], np.zeros(4, dtype=np.int64))
        assert codes[0] == codes[1] and codes[2] == codes[3] and codes[0] != codes[2]
        _, rewards, dones, infos = envs.step(["red"] * 4)
        assert dones.all() and list(rewards) == [float(i["answer"] == "red") for i in infos]
