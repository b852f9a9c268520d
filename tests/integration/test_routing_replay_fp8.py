"""Routing replay from the rollout (algorithm.routing_replay=rollout) with FP8 rollout weights
on the tiny MoE (bench/routing_replay.py's measurement, smaller): the engine routes some
decisions otherwise than the trainer would; replayed, every router follows the engine, and
the trainer's logprobs come closer to the engine's. (The CPU job with replay runs in
tests/integration/test_driver.py, the weight sync that did not land.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank  # spawned trainer ranks plus an engine process
ROOT = Path(__file__).resolve().parents[2]


def test_replay_brings_the_trainer_closer_to_an_fp8_engine():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "routing_replay.py"), "--prompts", "4",
                           "--prompt-tokens", "16", "--new-tokens", "8"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"routing_replay: disagreement (\S+) -> (\S+), KL (\S+) -> (\S+) \((\d+) tokens, (\d+) "
                         r"layers\)", last)
    assert found, last
    disagreement_off, disagreement_on, kl_off, kl_on = map(float, found.groups()[:4])
    assert disagreement_off > 0  # FP8 moved some decisions, so the comparison means something
    assert disagreement_on == 0  # every replayed router followed the engine (the bench checks each)
    assert kl_on < kl_off
