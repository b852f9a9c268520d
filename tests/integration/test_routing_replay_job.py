"""Routing replay from the rollout (algorithm.routing_replay=rollout) end to end on the tiny MoE.

- The CPU job: the engine returns each fed token's experts, they ride the samples into the
  batch, and every forward of the trainer routes by them. In fp32 the engine's routes are the
  trainer's own, so a route placed on the wrong token, layer or sample would move the
  trainer's logprobs off the engine's: the served-vs-trained check (bound 1e-4) would stop
  the run.
- With FP8 rollout weights (bench/routing_replay.py's measurement, smaller): the engine
  routes some decisions otherwise than the trainer would; replayed, every router follows the
  engine, and the trainer's logprobs come closer to the engine's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_agent.platform.launch import run_on_ranks

pytestmark = pytest.mark.multirank  # spawned trainer ranks plus an engine process
ROOT = Path(__file__).resolve().parents[2]


def _run(run_dir: str) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    return train(load_run_config([f"run_dir={run_dir}", "model=tiny-moe", "num_groups=2", "group_size=2",
                                  "iterations=2", "loop.max_steps=3", "stop_success=null",
                                  "algorithm.routing_replay=rollout", "check.max_mean_abs_diff=1e-4"]))


def test_the_cpu_job_replays_the_engines_routes(tmp_path):
    rows = run_on_ranks(_run, 1, str(tmp_path), timeout_s=300)[0]
    assert [row["iteration"] for row in rows] == [0, 1]
    assert all(row["check/rollout_logprob_max_abs_diff"] < 1e-4 for row in rows)
    assert json.loads((tmp_path / "config.json").read_text())["engine"]["return_routed_experts"] is True


def test_replay_brings_the_trainer_closer_to_an_fp8_engine():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "routing_replay.py"), "--prompts", "8",
                           "--prompt-tokens", "24", "--new-tokens", "8"],
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
