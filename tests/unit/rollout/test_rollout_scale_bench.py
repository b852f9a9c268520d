"""bench/rollout_scale.py in miniature: both loops run through the real EngineClient on
fake engines, return the same samples, and the bench prints its summary line. No time is
asserted (tests/ holds no benchmarks that assert a time)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "rollout_scale.py"


def test_the_bench_runs_both_loops_to_the_same_samples(capsys):
    spec = importlib.util.spec_from_file_location("rollout_scale_bench", BENCH)
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(bench)
    figures = bench.main(["--engines", "2", "--concurrency", "4", "--groups", "4", "--group-size", "4",
                          "--max-steps", "5", "--token-ms", "0.05", "--median-tokens", "8",
                          "--max-new-tokens", "64", "--env-ms", "0", "--env-backend", "inline"])
    out = capsys.readouterr().out
    assert figures["same"] == 1.0 and "samples equal across loops: True" in out
    assert re.search(r"^rollout_scale: async \d+\.\d\d x bound, lock-step \d+\.\d\d x bound$", out.strip().splitlines()[-1])
