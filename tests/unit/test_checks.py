"""The recompute-vs-rollout logprob check, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_agent.training.checks import (
    DEFAULT_MEAN_BOUND,
    LogprobCheckConfig,
    LogprobMismatchError,
    check_rollout_logprobs,
    check_sample_indices,
    mismatch_by_turn,
    rollout_logprob_gap,
)


def test_gap_over_response_tokens_only():
    actor = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.1, -2.0, -7.0], [-0.2, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is not a response token
    gap = rollout_logprob_gap(actor, rollout, mask)
    # |diffs| on the mask: 0.1, 0.0, 0.3, 0.0 -> max 0.3, mean 0.1
    assert gap["check/rollout_logprob_max_abs_diff"] == pytest.approx(0.3)
    assert gap["check/rollout_logprob_mean_abs_diff"] == pytest.approx(0.1)
    check_rollout_logprobs(gap, max_abs_diff=0.5)
    check_rollout_logprobs(gap, max_abs_diff=None)
    with pytest.raises(LogprobMismatchError, match=r"up to 0.3 \(mean 0.1; bound 0.01\)"):
        check_rollout_logprobs(gap, max_abs_diff=0.01)


def test_empty_mask():
    gap = rollout_logprob_gap(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))
    assert gap["check/rollout_logprob_max_abs_diff"] == 0.0


def test_the_mean_bound_and_where_the_gap_was_seen_are_named():
    gap = {"check/rollout_logprob_max_abs_diff": 0.3, "check/rollout_logprob_mean_abs_diff": 0.1}
    check_rollout_logprobs(gap, max_mean_abs_diff=0.2)
    with pytest.raises(LogprobMismatchError, match=r"mean 0.1; mean bound 0.05\) on the same weights \(iteration 4\)"):
        check_rollout_logprobs(gap, max_mean_abs_diff=0.05, when=" (iteration 4)")


def test_check_schedule_bound_and_sample_spread():
    config = LogprobCheckConfig(every=5)
    assert [i for i in range(3, 16) if config.due(i, first_iteration=3)] == [3, 5, 10, 15]
    assert not LogprobCheckConfig(every=0).due(0, 0)
    assert config.bound("fp32") == DEFAULT_MEAN_BOUND["fp32"] and config.bound("bf16") == DEFAULT_MEAN_BOUND["bf16"]
    assert LogprobCheckConfig(max_mean_abs_diff=0.2).bound("fp32") == 0.2
    assert check_sample_indices(3, 64) == [0, 1, 2]
    assert check_sample_indices(10, 4) == [0, 3, 6, 9]
    assert check_sample_indices(10, 1) == [0]
    with pytest.raises(ValueError, match="max_samples=0"):
        LogprobCheckConfig(max_samples=0).validate()


def _k3(log_r: float) -> float:
    return math.exp(log_r) - 1 - log_r


def test_mismatch_by_turn_by_hand():
    # Three samples; log r = old - rollout per response token; the last column of sample 1 is padding.
    #   sample 0, step 0: log r = 0.2, -0.1
    #   sample 1, step 2: log r = 0.5, (9.0 padding)
    #   sample 2, step 0: log r = -0.3, 0.0
    # Step 1: no sample, left out.
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-2.0, -1.0]])
    log_r = torch.tensor([[0.2, -0.1], [0.5, 9.0], [-0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    dropped = torch.tensor([[False, False], [True, True], [True, False]])  # the padded one does not count
    got = mismatch_by_turn(old, old - log_r, mask, torch.tensor([0, 2, 0]), dropped)
    step0 = [0.2, -0.1, -0.3, 0.0]
    assert got["mismatch/turn_0/kl_k3"] == pytest.approx(sum(map(_k3, step0)) / 4, rel=1e-5)
    assert got["mismatch/turn_0/max_abs_diff"] == pytest.approx(0.3, rel=1e-5)
    assert got["mismatch/turn_0/masked_fraction"] == pytest.approx(1 / 4)
    assert got["mismatch/turn_2/kl_k3"] == pytest.approx(_k3(0.5), rel=1e-5)
    assert got["mismatch/turn_2/max_abs_diff"] == pytest.approx(0.5, rel=1e-5)
    assert got["mismatch/turn_2/masked_fraction"] == 1.0
    assert got["mismatch/kl_k3"] == pytest.approx(sum(map(_k3, step0 + [0.5])) / 5, rel=1e-5)
    assert not any(key.startswith("mismatch/turn_1/") for key in got)
    assert "mismatch/turn_0/masked_fraction" not in mismatch_by_turn(old, old - log_r, mask, torch.tensor([0, 2, 0]))
    # MoE routing: per sample (decisions unlike the engine's, decisions) -> per step
    routing = torch.tensor([[1.0, 10.0], [4.0, 8.0], [0.0, 6.0]])
    got = mismatch_by_turn(old, old - log_r, mask, torch.tensor([0, 2, 0]), routing=routing)
    assert got["mismatch/turn_0/routing_disagreement"] == pytest.approx(1 / 16)
    assert got["mismatch/turn_2/routing_disagreement"] == pytest.approx(4 / 8)
    assert got["mismatch/routing_disagreement"] == pytest.approx(5 / 24)
