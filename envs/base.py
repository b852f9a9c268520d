"""The per-copy environment protocol shared by every environment in envs/.

One env copy plays one episode at a time:

    obs = env.reset(seed)
    obs, reward, done, info = env.step(text)   # text is the model's raw output

`info` is a plain dict that always holds `is_action_valid` and `won`; envs add their
own extras (see docs/environments.md). Nothing the model writes may raise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

# Training seeds live in [0, VALIDATION_SEED_OFFSET); validation seed i is
# VALIDATION_SEED_OFFSET + i, so the two ranges never overlap.
VALIDATION_SEED_OFFSET = 1 << 30


def validation_seed(i: int) -> int:
    return VALIDATION_SEED_OFFSET + i


@dataclass
class Observation:
    text: str
    # HxWx3 uint8 RGB for VLM tasks; None for text-only observations. A plain array:
    # it pickles as one raw buffer through the worker pipes, and GiGPO keys an array
    # anchor exactly on (dtype, shape, bytes).
    image: np.ndarray | None = None
    # The raw state with no history or prompt: what GiGPO groups identical states on.
    # The text for every built-in env whose text is the whole state (Sokoban and Gym
    # Cards frames are a one-to-one function of it); the image itself where only the
    # image holds the state (visual_quiz). An array anchor leaves the env worker as its
    # AnchorDigest (`with_anchor_digest`): the digest travels, not the frame.
    anchor: Any = None


@dataclass(frozen=True)
class AnchorDigest:
    """An array anchor as it leaves the env worker: its dtype, shape and a 32-byte BLAKE2b
    digest of its bytes. Equal arrays give equal digests; two different states share one
    only by a BLAKE2b collision (2^128 work). Hashable, so GiGPO keys states on it as is."""

    dtype: str
    shape: tuple[int, ...]
    digest: bytes


def with_anchor_digest(obs: Observation | None) -> Observation | None:
    """`obs` with an array anchor replaced by its AnchorDigest (other anchors unchanged)."""
    if obs is None or not isinstance(obs.anchor, np.ndarray):
        return obs
    anchor = np.ascontiguousarray(obs.anchor)
    digest = hashlib.blake2b(anchor.data, digest_size=32).digest()
    return replace(obs, anchor=AnchorDigest(anchor.dtype.str, tuple(anchor.shape), digest))


class Env(Protocol):
    def reset(self, seed: int) -> Observation: ...

    def step(self, text: str) -> tuple[Observation, float, bool, dict]: ...


def make_info(is_action_valid: bool, won: bool, **extras: Any) -> dict:
    return {"is_action_valid": bool(is_action_valid), "won": bool(won), **extras}


def seeded_rng(seed: int) -> np.random.Generator:
    """Every random choice of an episode comes from this generator."""
    return np.random.default_rng(np.random.SeedSequence(int(seed) & ((1 << 63) - 1)))
