"""Dynamic sampling and config validation."""

import math

import numpy as np
import pytest

from megatron_agent.algorithms import AlgorithmConfig, enough_groups, filter_zero_variance_groups


def test_dynamic_sampling_drops_zero_variance_groups():
    # g: scores [1, 1] (+ a padding sample scoring 0: ignored) -> dropped;
    # h: [1, 0] kept; k: one sample -> no variance -> dropped.
    result = filter_zero_variance_groups(
        [1, 1, 0, 1, 0, 5], ["g", "g", "g", "h", "h", "k"], is_padding=[0, 0, 1, 0, 0, 0]
    )
    np.testing.assert_array_equal(result.keep, [False, False, False, True, True, False])
    assert (result.num_groups, result.num_dropped) == (3, 2)
    # Per-step penalties make a group informative; atol ignores float noise.
    assert filter_zero_variance_groups([1, 0.9], ["g", "g"]).num_dropped == 0
    assert filter_zero_variance_groups([1, 1 + 1e-12], ["g", "g"], atol=1e-9).num_dropped == 1


def test_enough_groups():
    assert enough_groups(16, 16, tries=1, max_tries=10)
    assert not enough_groups(15, 16, tries=9, max_tries=10)
    assert enough_groups(3, 16, tries=10, max_tries=10)


def test_config_defaults_validate():
    AlgorithmConfig().validate()
    AlgorithmConfig(
        policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean"
    ).validate()


@pytest.mark.parametrize(
    "field,value",
    [
        ("advantage_estimator", "ppo2"),
        ("policy_loss", "trpo"),
        ("gigpo_mode", "std"),
        ("episode_stats", "per_group"),
        ("loss_agg_mode", "sum"),
        ("kl_loss_type", "k4"),
        ("gamma", 1.5),
        ("gae_lambda", -0.1),
        ("adv_eps", 0.0),
        ("step_weight", -1.0),
        ("similarity_threshold", 1.2),
        ("invalid_action_penalty", -0.1),
        ("clip_ratio_low", 1.0),
        ("clip_ratio_high", 0.0),
        ("dual_clip_c", 1.0),
        ("loss_norm_length", 0),
        ("tis_cap", -2.0),
        ("entropy_coef", math.nan),
        ("kl_loss_coef", -1.0),
        ("value_clip", 0.0),
        ("dynamic_sampling_max_tries", 0),
    ],
)
def test_config_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AlgorithmConfig(**{field: value}).validate()
