"""The comparison's statistics (bench/gigpo_vs_grpo.py) on hand-computed cases."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("gigpo_vs_grpo", ROOT / "bench" / "gigpo_vs_grpo.py")
bench = sys.modules[SPEC.name] = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


@pytest.mark.parametrize("differences, p", [
    ([0.1] * 6, 2 / 64),                      # 6 of 6 one way: 2 * (1/2)^6
    ([0.1] * 8 + [-0.1] * 2, 2 * 56 / 1024),  # 8 of 10: 2 * (C(10,8) + C(10,9) + C(10,10)) / 2^10
    ([0.1, -0.1, 0.0], 1.0),                   # a tie is dropped; 1 of 2 is no evidence
    ([0.0, 0.0], 1.0),
])
def test_sign_test_against_the_binomial_tail_by_hand(differences, p):
    assert bench.sign_test_p(differences) == pytest.approx(p)


def test_bootstrap_interval_is_the_percentiles_of_resampled_means():
    assert bench.bootstrap_interval([0.2] * 5) == pytest.approx((0.2, 0.2))
    differences = [-0.3, 0.1, 0.2, 0.4, 0.05, -0.1, 0.3, 0.0, 0.15, 0.2]
    low, high = bench.bootstrap_interval(differences)
    # the normal approximation of the mean's spread, which a bootstrap of 10 values stays near
    mean, se = np.mean(differences), np.std(differences, ddof=1) / np.sqrt(len(differences))
    assert low < mean < high
    assert low == pytest.approx(mean - 1.96 * se, abs=0.03) and high == pytest.approx(mean + 1.96 * se, abs=0.03)
    assert bench.bootstrap_interval(differences) == (low, high)  # a fixed generator: the docs' digits repeat
