"""The CPU main job runs end to end on WebShop (the tiny model will not learn it; the
point is the pipeline): the byte-level BPE tiny tokenizer, since the word-level one
knows none of WebShop's words."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_train_two_iterations_on_webshop(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megatron_agent.cli", "train", "env=webshop", "iterations=2", "stop_success=null",
         "num_groups=1", "group_size=2", "+env_config.max_steps=3", "loop.max_steps=3",
         "loop.sampling.max_new_tokens=16", "loop.prompt.max_prompt_tokens=1900", "tiny_model.tokenizer=bpe",
         "samples_every=1", f"run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gigpo on webshop" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for row in rows:
        assert row["train/num_episodes"] == 2.0 and row["train/episode_length"] <= 3
        assert math.isfinite(row["actor/grad_norm"]) and math.isfinite(row["train/invalid_action_rate"])
        assert any(k.startswith("train/success_rate/") for k in row)  # per product category
    text = (tmp_path / "samples" / "iter_000001.txt").read_text()
    assert "=== episode" in text and "observation: search" in text  # the page state (anchor) is logged
