"""The rollout correction (losses.rollout_correction_weights) on hand-made engine-to-trainer
ratios: which tokens and sequences are weighted or dropped, the loss value and its gradient,
worked out by hand below."""

import math

import pytest
import torch

from megatron_agent.algorithms import AlgorithmConfig, actor_loss, rollout_correction_weights

F64 = torch.float64

# r = pi_trainer_old / pi_engine per token; seq 1's last position is padding (its r must not count).
#   seq 0, A = +1, mask [1 1 1]: r = 3, 0.5, 1.2    (product 1.8,   geometric mean 1.216)
#   seq 1, A = -1, mask [1 1 0]: r = 0.25, 1.5, 100 (product 0.375, geometric mean 0.612)
R = torch.tensor([[3.0, 0.5, 1.2], [0.25, 1.5, 100.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
ADV = torch.tensor([1.0, -1.0], dtype=F64)
OLD = torch.full_like(R, -1.0)
ROLLOUT = OLD - R.log()


def _loss(**settings):
    """actor_loss on-policy (ratio 1: each token's surrogate is -A), token-mean over the 5
    response tokens, no KL, no entropy, no dual clip; its value and d loss / d logp."""
    config = AlgorithmConfig(use_kl_loss=False, dual_clip_c=None, entropy_coef=0.0, **settings)
    logp = OLD.clone().requires_grad_()
    loss, metrics = actor_loss(config, logp, OLD, ADV, MASK, rollout_logprobs=ROLLOUT)
    loss.backward()
    return loss.item(), logp.grad, metrics


def _by_hand(weights):
    """The loss and gradient a weights table gives: sum_t -A w_t / 5 and -A w_t / 5."""
    w = torch.tensor(weights, dtype=F64)
    grad = -ADV[:, None] * w * MASK / 5
    return float(grad.sum()), grad


@pytest.mark.parametrize("settings,weights,metrics", [
    # token TIS, cap 2: min(r, 2)
    ({"tis_cap": 2.0}, [[2, 0.5, 1.2], [0.25, 1.5, 0]],
     {"rollout_correction/clipfrac": 1 / 5, "rollout_correction/weight_mean": 5.45 / 5}),
    # sequence TIS, cap 2: each sequence's product, under the cap
    ({"tis_cap": 2.0, "tis_level": "sequence"}, [[1.8, 1.8, 1.8], [0.375, 0.375, 0]],
     {"rollout_correction/clipfrac": 0.0}),
    # sequence TIS, cap 1.5: seq 0's 1.8 is cut to 1.5 on its 3 tokens
    ({"tis_cap": 1.5, "tis_level": "sequence"}, [[1.5, 1.5, 1.5], [0.375, 0.375, 0]],
     {"rollout_correction/clipfrac": 3 / 5}),
    # token mask [0.4, 2.5]: r = 3 and 0.25 dropped, the rest weighs 1
    ({"rollout_mask": "token", "rollout_mask_low": 0.4, "rollout_mask_high": 2.5}, [[0, 1, 1], [0, 1, 0]],
     {"rollout_correction/masked_fraction": 2 / 5}),
    # sequence mask [0.5, 1.1] by the geometric mean: seq 0 (1.216) dropped whole, seq 1 (0.612) kept
    # (by the product, 0.375, it would go too)
    ({"rollout_mask": "sequence", "rollout_mask_low": 0.5, "rollout_mask_high": 1.1}, [[0, 0, 0], [1, 1, 0]],
     {"rollout_correction/masked_fraction": 3 / 5}),
    # IcePop: r inside [0.4, 2.5], 0 outside
    ({"tis_cap": 2.5, "rollout_mask": "token", "rollout_mask_low": 0.4, "rollout_mask_high": 2.5},
     [[0, 0.5, 1.2], [0, 1.5, 0]], {"rollout_correction/masked_fraction": 2 / 5}),
])  # fmt: skip
def test_each_mode_by_hand(settings, weights, metrics):
    loss, grad, got = _loss(**settings)
    expected_loss, expected_grad = _by_hand(weights)
    assert loss == pytest.approx(expected_loss)
    torch.testing.assert_close(grad, expected_grad)
    for name, value in metrics.items():
        assert got[name].item() == pytest.approx(value), name


def test_no_correction_leaves_the_loss_alone():
    loss, _, metrics = _loss()
    assert loss == pytest.approx((-3 + 2) / 5)
    assert not any(name.startswith("rollout_correction/") for name in metrics)


def test_padding_never_enters_a_ratio():
    # seq 1's padded r = 100 would make its product 37.5 and its token r = 100 count as clipped
    weights, metrics = rollout_correction_weights(OLD, ROLLOUT, MASK, tis_cap=1e3, tis_level="sequence")
    assert weights[1, 0].item() == pytest.approx(0.375)
    assert metrics["rollout_correction/clipfrac"].item() == 0.0


def test_weights_are_constants():
    old = OLD.clone().requires_grad_()
    weights, _ = rollout_correction_weights(old, ROLLOUT, MASK, tis_cap=2.0, mask="token")
    assert not weights.requires_grad


def test_the_correction_needs_the_engines_logprobs():
    config = AlgorithmConfig(tis_cap=2.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        actor_loss(config, OLD, OLD, ADV, MASK, ref_logprobs=OLD)


@pytest.mark.parametrize("settings,problem", [
    ({"tis_level": "trajectory"}, "tis_level"),
    ({"rollout_mask": "tokens"}, "rollout_mask"),
    ({"rollout_mask_low": 2.0, "rollout_mask_high": 2.0}, "below"),
    ({"rollout_mask_low": -0.1}, "rollout_mask_low"),
    ({"rollout_mask_high": math.inf}, "rollout_mask_high"),
])
def test_bad_settings_are_named(settings, problem):
    with pytest.raises(ValueError, match=problem):
        AlgorithmConfig(**settings).validate()
