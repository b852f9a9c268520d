"""pass@k (Chen et al. 2021's unbiased estimator) and the per-model metrics of `megatron-agent
eval`, against hand-computed values and brute-force enumeration of the k-subsets."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from megatron_agent.eval_metrics import mean_pass_at_k, model_metrics, pass_at_k, task_results
from rollout.agent_loop import EpisodeSummary


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of the k-subsets of n samples (the first c of them won) holding a win."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 3, 0.75), (4, 1, 4, 1.0),
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 1, 0.3),  # pass@1 is the share of wins
    (6, 0, 1, 0.0), (6, 0, 6, 0.0),  # no win: never
    (6, 6, 1, 1.0), (6, 6, 3, 1.0),  # all won: always
    (3, 1, 2, 2 / 3),  # of the 3 pairs, 2 hold the win
])
def test_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_equals_brute_force_enumeration_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_stable_for_large_n():
    """The product form against the exact ratio of binomials, where the binomials are huge."""
    for n, c, k in ((1000, 1, 1), (1000, 7, 50), (500, 250, 100), (200, 3, 199)):
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12), (n, c, k)


def test_monotone_in_k():
    for n in range(1, 12):
        for c in range(n + 1):
            curve = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert all(a <= b for a, b in zip(curve, curve[1:])), (n, c, curve)
            if 0 < c < n:  # a win is more likely among more draws until every draw holds one
                rising = [v for v in curve if v < 1.0]
                assert all(a < b for a, b in zip(rising, rising[1:])), (n, c, curve)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_over_tasks_leaves_out_tasks_with_fewer_samples_than_k():
    counts = [(4, 1), (4, 4), (2, 0)]  # the last task: two of its four copies failed
    assert mean_pass_at_k(counts, 1) == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert mean_pass_at_k(counts, 3) == pytest.approx((0.75 + 1.0) / 2)
    assert mean_pass_at_k([(2, 1)], 3) is None


def summary(won: bool, steps: int = 3, task_type: str = "a", failed: bool = False, invalid: int = 1) -> EpisodeSummary:
    return EpisodeSummary(failed=failed, won=won, steps=steps, episode_return=float(won), task_type=task_type,
                          invalid_steps=invalid, truncated_steps=0, clipped_steps=0, response_tokens=2 * steps,
                          prompt_tokens=10 * steps)


def test_model_metrics_of_two_tasks_of_four_samples():
    # task 0 (type a): 1 win of 4; task 1 (type b): 3 wins of 3, its fourth copy failed
    summaries = [summary(True), summary(False), summary(False), summary(False),
                 summary(True, task_type="b"), summary(True, task_type="b"), summary(True, task_type="b"),
                 summary(False, steps=1, task_type="b", failed=True)]
    tasks = task_results(summaries, [7, 8], 4)
    assert [(t.seed, t.task_type, t.samples, t.wins, t.failed) for t in tasks] == [(7, "a", 4, 1, 0), (8, "b", 3, 3, 1)]
    m = model_metrics(summaries, [7, 8], 4)
    assert m["success_rate"] == pytest.approx(4 / 7)  # over the 7 episodes that did not fail
    assert m["success_rate/a"] == 0.25 and m["success_rate/b"] == 1.0
    assert m["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["pass@4"] == pytest.approx(1.0)  # task 1 has 3 samples: only task 0 counts
    assert m["episode_length"] == 3.0 and m["invalid_action_rate"] == pytest.approx(7 / 21)
    assert m["prompt_tokens"] == 7 * 30 and m["response_tokens"] == 7 * 6
    assert m["num_episodes"] == 7 and m["failed_episodes"] == 1 and m["num_tasks"] == 2


def test_task_results_needs_num_samples_per_task():
    with pytest.raises(ValueError, match="3 episodes for 2 tasks x 2 samples"):
        task_results([summary(True)] * 3, [0, 1], 2)
