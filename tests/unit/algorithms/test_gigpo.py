"""GiGPO on small batches worked out by hand (numbers in the comments)."""

import math

import numpy as np
import pytest
import torch

from megatron_agent.algorithms import (
    anchor_key,
    apply_invalid_action_penalty,
    gigpo_advantages,
    step_discounted_returns,
)
from megatron_agent.algorithms.gigpo import anchor_state_codes

# One episode group "g", three trajectories, gamma = 0.5:
#   A: anchors s0 s1,    rewards 0 1    -> score 1, G = [0.5, 1]
#   B: anchors s0 s2 s1, rewards 0 0 1  -> score 1, G = [0.25, 0.5, 1]
#   C: anchors s0,       rewards 0      -> score 0, G = [0]
GROUPS = ["g"] * 6
TRAJS = ["A", "A", "B", "B", "B", "C"]
STEPS = [0, 1, 0, 1, 2, 0]
REWARDS = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
ANCHORS = ["s0", "s1", "s0", "s2", "s1", "s0"]
SCORES = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
RETURNS = [0.5, 1.0, 0.25, 0.5, 1.0, 0.0]
EPS = 1e-6


def test_step_discounted_returns_by_hand():
    np.testing.assert_allclose(step_discounted_returns(REWARDS, TRAJS, STEPS, 0.5), RETURNS)
    # gamma = 1: the undiscounted reward-to-go
    np.testing.assert_allclose(step_discounted_returns(REWARDS, TRAJS, STEPS, 1.0), [1, 1, 1, 1, 1, 0])


def test_step_discounted_returns_any_order_gaps_and_padding():
    # trajectory 7: steps 4, 0, 9 (gaps) -> order 0, 4, 9 with rewards 1, 2, 4; gamma 0.5:
    #   G(9) = 4, G(4) = 2 + 2 = 4, G(0) = 1 + 2 = 3. The padding row copies (7, 4) and is ignored.
    out = step_discounted_returns(
        [2.0, 1.0, 4.0, 100.0], [7, 7, 7, 7], [4, 0, 9, 4], 0.5, is_padding=[0, 0, 0, 1]
    )
    np.testing.assert_allclose(out, [4.0, 3.0, 4.0, 0.0])


def test_repeated_step_without_padding_flag_is_an_error():
    with pytest.raises(ValueError, match="appears twice"):
        step_discounted_returns([1.0, 1.0], [0, 0], [3, 3], 1.0)


def test_mean_norm_per_step_by_hand():
    # Episode level, per step: scores [1 1 1 1 1 0], mean 5/6 -> A_E = 1/6 (A, B samples), -5/6 (C).
    # Step groups: s0 = {A0: .5, B0: .25, C0: 0}, mean .25 -> A_S = +.25, 0, -.25;
    #              s1 = {A1: 1, B2: 1} -> 0, 0;  s2 = {B1} singleton -> 0.
    out = gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS)
    e = 1 / 6
    np.testing.assert_allclose(out, [e + 0.25, e, e, e, e, -5 / 6 - 0.25], atol=1e-12)


def test_mean_std_norm_per_step_by_hand():
    # std of [1 1 1 1 1 0] (n-1): squares 5/36 + 25/36 = 5/6, /5 -> var 1/6.
    # s0 returns [.5 .25 0]: std .25 -> A_S = +1, 0, -1; s1 returns equal: 0 / (0 + eps) = 0.
    out = gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, mode="mean_std_norm", eps=EPS)
    std = math.sqrt(1 / 6)
    a, c = (1 / 6) / (std + EPS), (-5 / 6) / (std + EPS)
    s = 0.25 / (0.25 + EPS)
    np.testing.assert_allclose(out, [a + s, a, a, a, a, c - s], atol=1e-12)


def test_per_trajectory_statistics_count_each_trajectory_once():
    # Trajectory scores [1 1 0]: mean 2/3 (per step it was 5/6), std sqrt(1/3) (per step sqrt(1/6)).
    per_traj = gigpo_advantages(
        SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, step_weight=0.0, episode_stats="per_trajectory"
    )
    per_step = gigpo_advantages(
        SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, step_weight=0.0, episode_stats="per_step"
    )
    np.testing.assert_allclose(per_traj, [1 / 3] * 5 + [-2 / 3], atol=1e-12)
    np.testing.assert_allclose(per_step, [1 / 6] * 5 + [-5 / 6], atol=1e-12)
    std_traj = gigpo_advantages(
        SCORES,
        RETURNS,
        GROUPS,
        TRAJS,
        ANCHORS,
        step_weight=0.0,
        episode_stats="per_trajectory",
        mode="mean_std_norm",
    )
    np.testing.assert_allclose(
        std_traj, np.array([1 / 3] * 5 + [-2 / 3]) / (math.sqrt(1 / 3) + EPS), atol=1e-12
    )
    # With equal-length trajectories the two definitions agree.
    eq = gigpo_advantages(
        [1, 1, 0, 0], [0, 0, 0, 0], ["g"] * 4, [0, 0, 1, 1], ["a", "b", "c", "d"], mode="mean_std_norm"
    )
    eq_t = gigpo_advantages(
        [1, 1, 0, 0], [0, 0, 0, 0], ["g"] * 4, [0, 0, 1, 1], ["a", "b", "c", "d"], mode="mean_std_norm",
        episode_stats="per_trajectory",
    )  # fmt: skip
    # per step: std of [1 1 0 0] = sqrt(1/3); per trajectory: std of [1 0] = sqrt(1/2)
    np.testing.assert_allclose(
        eq, [0.5 / (math.sqrt(1 / 3) + EPS)] * 2 + [-0.5 / (math.sqrt(1 / 3) + EPS)] * 2
    )
    np.testing.assert_allclose(
        eq_t, [0.5 / (math.sqrt(1 / 2) + EPS)] * 2 + [-0.5 / (math.sqrt(1 / 2) + EPS)] * 2
    )


def test_group_with_one_trajectory_gets_mean_0_std_1():
    # Lone trajectory (2 steps, score 3, distinct anchors): A_E = 3 (mean_norm), 3 / (1 + eps) (std);
    # its step groups are singletons, A_S = 0. The rule counts trajectories, not step samples.
    for stats in ("per_step", "per_trajectory"):
        out = gigpo_advantages([3, 3], [3, 2], ["h", "h"], [0, 0], ["x", "y"], episode_stats=stats)
        np.testing.assert_allclose(out, [3, 3])
        out = gigpo_advantages(
            [3, 3], [3, 2], ["h", "h"], [0, 0], ["x", "y"], episode_stats=stats, mode="mean_std_norm"
        )
        np.testing.assert_allclose(out, [3 / (1 + EPS)] * 2)
    # ...but a lone trajectory revisiting a state still gets a step signal: G 3 vs 1 at anchor x.
    out = gigpo_advantages([3, 3, 3], [3, 2, 1], ["h"] * 3, [0, 0, 0], ["x", "y", "x"])
    np.testing.assert_allclose(out, [3 + 1, 3, 3 - 1])


def test_all_equal_returns_give_zero():
    # Every trajectory scores 1 and every state group has equal returns: all advantages 0, also with std.
    for mode in ("mean_norm", "mean_std_norm"):
        out = gigpo_advantages([1.0] * 4, [1.0] * 4, ["g"] * 4, [0, 0, 1, 1], ["a", "b", "a", "b"], mode=mode)
        np.testing.assert_allclose(out, 0.0, atol=1e-12)


def test_padding_changes_nothing_for_real_samples():
    base = gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, mode="mean_std_norm")
    # Padding rows duplicate real samples (same ids, anchors) with wild values; anchors of padding are never read.
    scores = SCORES + [50.0, -7.0, 1.0]
    returns = RETURNS + [9.0, 9.0, 9.0]
    out = gigpo_advantages(
        scores, returns, GROUPS + ["g", "g", "new"], TRAJS + ["A", "C", "Z"], ANCHORS + ["s0", object(), "s0"],
        mode="mean_std_norm", is_padding=[False] * 6 + [True] * 3,
    )  # fmt: skip
    np.testing.assert_allclose(out[:6], base, atol=1e-12)
    np.testing.assert_array_equal(out[6:], 0.0)


def test_invalid_action_penalty_is_per_step_and_not_discounted_back():
    # B's step 1 is invalid, c = 0.1: its score 1 -> 0.9, its G 0.5 -> 0.4; B0 keeps G = 0.25.
    valid = [1, 1, 1, 0, 1, 1]
    scores, returns = apply_invalid_action_penalty(SCORES, RETURNS, valid, 0.1)
    np.testing.assert_allclose(scores, [1, 1, 1, 0.9, 1, 0])
    np.testing.assert_allclose(returns, [0.5, 1, 0.25, 0.4, 1, 0])
    # Per step: mean of [1 1 1 .9 1 0] = 4.9/6; s2 is a singleton so B1 only sees the episode level.
    out = gigpo_advantages(scores, returns, GROUPS, TRAJS, ANCHORS)
    m = 4.9 / 6
    np.testing.assert_allclose(out, [1 - m + 0.25, 1 - m, 1 - m, 0.9 - m, 1 - m, -m - 0.25], atol=1e-12)
    # Per trajectory: B scores mean(1, .9, 1) = 2.9/3; trajectory mean (1 + 2.9/3 + 0)/3; B1 compared by its own 0.9.
    out = gigpo_advantages(
        scores, returns, GROUPS, TRAJS, ANCHORS, step_weight=0.0, episode_stats="per_trajectory"
    )
    mt = (1 + 2.9 / 3) / 3
    np.testing.assert_allclose(out, [1 - mt, 1 - mt, 1 - mt, 0.9 - mt, 1 - mt, -mt], atol=1e-12)


def test_groups_are_independent_and_ids_any_hashable():
    # Two groups with the same anchor texts: states are only shared inside a group.
    groups = [("task", 1)] * 2 + [("task", 2)] * 2
    out = gigpo_advantages([1, 0, 5, 1], [1, 0, 5, 1], groups, ["a", "b", "a", "b"], ["s"] * 4)
    # group 1: A_E = +-.5, A_S = +-.5; group 2: A_E = +-2, A_S = +-2
    np.testing.assert_allclose(out, [1, -1, 4, -4])


def test_image_anchors_group_by_value():
    grid = np.array([[0, 1], [1, 0]], dtype=np.uint8)
    same = grid.copy()  # another object, equal values
    other = np.array([[1, 1], [1, 0]], dtype=np.uint8)
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert anchor_key(grid) == anchor_key(same) != anchor_key(other)
    assert anchor_key(grid) != anchor_key(grid.astype(np.int64))  # dtype is part of the state
    assert anchor_key(grid) != anchor_key(grid.reshape(4))  # so is the shape
    assert anchor_key(image[:, :, ::-1].copy()) == anchor_key(
        image[:, :, ::-1]
    )  # non-contiguous views are fine
    assert anchor_key(torch.tensor([1, 2])) == anchor_key(np.array([1, 2]))
    # Samples 0, 1, 2 sit on `grid`, `same` (equal values), `grid`: one state, G [2, 1, 0], mean 1 -> +1, 0, -1.
    # Sample 3 sits on `other`: a singleton -> 0. Episode scores are all 0, so A_E = 0.
    anchors = [grid, same, grid, other]
    out = gigpo_advantages([0, 0, 0, 0], [2, 1, 0, 3], ["g"] * 4, [0, 0, 1, 1], anchors)
    np.testing.assert_allclose(out, [1, 0, -1, 0])
    # A stacked [N, H, W] array of anchors works the same.
    stacked = np.stack(anchors)
    np.testing.assert_allclose(gigpo_advantages([0] * 4, [2, 1, 0, 3], ["g"] * 4, [0, 0, 1, 1], stacked), out)


def test_dict_and_nested_anchors():
    a = {"text": "room", "image": np.zeros((2, 2)), "inventory": ["key", ("lamp", 1)]}
    b = {"inventory": ["key", ("lamp", 1)], "image": np.zeros((2, 2)), "text": "room"}  # other key order
    c = {"text": "room", "image": np.ones((2, 2)), "inventory": ["key", ("lamp", 1)]}
    assert anchor_key(a) == anchor_key(b) != anchor_key(c)
    out = gigpo_advantages([0, 0, 0], [1, 3, 5], ["g"] * 3, [0, 1, 2], [a, b, c])
    np.testing.assert_allclose(out, [-1, 1, 0])


def test_similarity_grouping_first_member_rule():
    # Sorted order X < Y < Z ("X" sorts before "h"). ratio(X, Y) = .9, ratio(Y, Z) = .8, ratio(X, Z) = .7.
    # threshold .8: X founds a cluster, Y joins it, Z does not (its match Y is not the first member).
    x, y, z = "abcdefgXYZ", "abcdefghXY", "abcdefghij"
    codes, n = anchor_state_codes([z, y, x, y], np.zeros(4, dtype=np.int64), similarity_threshold=0.8)
    assert n == 2
    assert codes[1] == codes[2] == codes[3] != codes[0]
    # threshold .7: everything joins X.
    codes, n = anchor_state_codes([z, y, x], np.zeros(3, dtype=np.int64), similarity_threshold=0.7)
    assert n == 1
    # threshold .95: exact matching only.
    codes, n = anchor_state_codes([z, y, x, y], np.zeros(4, dtype=np.int64), similarity_threshold=0.95)
    assert n == 3
    # End to end: G of X and Y samples [2, 0] -> +-1; Z alone -> 0. Clusters never cross episode groups.
    out = gigpo_advantages(
        [0] * 4, [2, 0, 7, 7], ["g", "g", "g", "h"], [0, 1, 2, 3], [x, y, z, x], similarity_threshold=0.8
    )
    np.testing.assert_allclose(out, [1, -1, 0, 0])


def test_similarity_mode_groups_non_text_anchors_exactly():
    arr = np.zeros(3)
    out = gigpo_advantages(
        [0] * 3, [2, 0, 5], ["g"] * 3, [0, 1, 2], [arr, arr.copy(), "abc"], similarity_threshold=0.5
    )
    np.testing.assert_allclose(out, [1, -1, 0])


def test_inputs_as_torch_numpy_lists_agree():
    ref = gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, mode="mean_std_norm")
    out = gigpo_advantages(
        torch.tensor(SCORES, dtype=torch.float32), np.array(RETURNS), np.array(GROUPS), np.array(TRAJS),
        np.array(ANCHORS), mode="mean_std_norm", is_padding=torch.zeros(6, dtype=torch.bool),
    )  # fmt: skip
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, mode="std")
    with pytest.raises(ValueError, match="episode_stats"):
        gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, episode_stats="per_group")
    with pytest.raises(ValueError, match="step_returns"):
        gigpo_advantages(SCORES, RETURNS[:3], GROUPS, TRAJS, ANCHORS)
    with pytest.raises(ValueError, match="similarity_threshold"):
        gigpo_advantages(SCORES, RETURNS, GROUPS, TRAJS, ANCHORS, similarity_threshold=1.5)


def test_empty_and_all_padding():
    assert gigpo_advantages([], [], [], [], []).shape == (0,)
    np.testing.assert_array_equal(
        gigpo_advantages([1.0], [1.0], ["g"], [0], [None], is_padding=[True]), [0.0]
    )


def test_diagnostics_say_how_much_the_step_half_has_to_work_with():
    """One group, two trajectories (scores 1 and 0) that share state "a" at their first
    step; G_t given: the losing trajectory did better from "a" than the winner."""
    from megatron_agent.algorithms.gigpo import gigpo_diagnostic_sums, gigpo_diagnostics, gigpo_halves

    halves = gigpo_halves([1.0, 1.0, 0.0, 0.0], [0.2, 1.0, 0.9, 0.0], [0, 0, 0, 0], [0, 0, 1, 1],
                          ["a", "b", "a", "c"], mode="mean_norm", eps=1e-6, episode_stats="per_step",
                          similarity_threshold=None, is_padding=None)
    np.testing.assert_allclose(halves.episode, [0.5, 0.5, -0.5, -0.5])
    np.testing.assert_allclose(halves.step, [-0.35, 0.0, 0.35, 0.0])  # "a": mean 0.55; b, c alone: 0
    metrics = gigpo_diagnostics(gigpo_diagnostic_sums(halves))
    assert metrics["gigpo/shared_state_fraction"] == 0.5
    assert metrics["gigpo/step_group_size"] == pytest.approx(4 / 3)
    assert metrics["gigpo/step_advantage_abs"] == pytest.approx(0.7 / 4)
    assert metrics["gigpo/episode_advantage_abs"] == pytest.approx(0.5)
    assert metrics["gigpo/step_to_episode_abs"] == pytest.approx(0.35)
    assert metrics["gigpo/sign_disagreement"] == 1.0  # both shared samples: A_S against A_E
