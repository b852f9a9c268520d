"""Two iterations of the CPU main job on an environment (a tiny model will not learn the
benchmark environments; the point is that the pipeline runs end to end)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path


def train_two_iterations(run_dir: Path, env: str, overrides: list[str], env_vars: dict | None = None) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_agent.cli", "train", f"env={env}", "iterations=2", "stop_success=null",
         "num_groups=1", "group_size=2", "loop.sampling.max_new_tokens=16", "tiny_model.tokenizer=bpe",
         "val_every=0", "save_every=0", "samples_every=1", f"run_dir={run_dir}", *overrides],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env_vars or {})},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"gigpo on {env}" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for row in rows:
        assert row["train/num_episodes"] == 2.0
        assert math.isfinite(row["actor/grad_norm"]) and math.isfinite(row["train/invalid_action_rate"])
        assert row["weight_sync/bytes"] > 0
    return rows
