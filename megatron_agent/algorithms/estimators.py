"""Advantage estimators on the flat step-sample layout, selectable by name, for a whole batch.

Every estimator returns one float64 advantage per step sample (numpy, whatever the input
type); padding samples get 0 and enter no statistic. ``compute_advantages`` is the entry point
the trainer uses: it derives returns and episode scores, applies the invalid-action penalty and
dispatches on ``AlgorithmConfig.advantage_estimator`` through ``ADVANTAGE_ESTIMATORS``. The rules
themselves live in ``group_advantages``, split where a batch-wide statistic enters; everything
here is that split run with the whole batch as the one part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron_agent.algorithms.gigpo import EpisodeStats
from megatron_agent.algorithms.group_advantages import (
    PARTIAL_ESTIMATORS,
    Advantages,
    PartialAdvantages,
    StepSamples,
    combine_moments,
    finish_advantages,
    gae_before_whitening,
    grpo_advantages,
    moments_of,
    partial_advantages,
    rloo_advantages,
    trajectory_reward_sums,
    whiten_with_moments,
)
from megatron_agent.algorithms.segments import num_samples, real_mask, to_float64

if TYPE_CHECKING:
    from megatron_agent.algorithms.algorithm_config import AlgorithmConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "Advantages",
    "StepSamples",
    "apply_invalid_action_penalty",
    "broadcast_to_tokens",
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "trajectory_reward_sums",
]


def apply_invalid_action_penalty(
    episode_scores: Any, step_returns: Any, is_action_valid: Any, penalty: float
) -> tuple[np.ndarray, np.ndarray]:
    """Subtract ``penalty * (1 - valid)`` from the step's episode score and from its G_t.

    Applied to G_t after discounting, so the penalty stays on the step that made the bad action
    and is not discounted back onto earlier steps.
    """
    n = num_samples(episode_scores)
    cost = penalty * (1.0 - to_float64(is_action_valid, n, "is_action_valid"))
    return to_float64(episode_scores, n, "episode_scores") - cost, to_float64(
        step_returns, n, "step_returns"
    ) - cost


def reinforce_pp_advantages(step_returns: Any, *, eps: float = 1e-6, is_padding: Any = None) -> np.ndarray:
    """REINFORCE++: the step returns G_t whitened over the batch's real samples."""
    n = num_samples(step_returns)
    return _whitened_over_batch(to_float64(step_returns, n, "step_returns"), real_mask(is_padding, n), eps)


def reinforce_pp_baseline_advantages(
    episode_scores: Any,
    group_ids: Any,
    traj_ids: Any,
    *,
    eps: float = 1e-6,
    episode_stats: EpisodeStats = "per_step",
    is_padding: Any = None,
) -> np.ndarray:
    """REINFORCE++-baseline: subtract the group mean (lone trajectory: 0), then whiten over the batch."""
    centred = grpo_advantages(
        episode_scores,
        group_ids,
        traj_ids,
        mode="mean_norm",
        eps=eps,
        episode_stats=episode_stats,
        is_padding=is_padding,
    )
    return _whitened_over_batch(centred, real_mask(is_padding, centred.shape[0]), eps)


def gae_advantages(
    rewards: Any,
    values: Any,
    traj_ids: Any,
    step_index: Any,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    final_values: Any = None,
    whiten: bool = True,
    eps: float = 1e-6,
    is_padding: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """PPO's GAE over the steps of each trajectory; returns (advantages, value targets).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    target ``A_t + V_t``. After a trajectory's last step V is ``final_values`` of that step
    (0 when not given: the episode terminated). With ``whiten`` the advantages (not the
    targets) are whitened over the real samples, as PPO implementations do.
    """
    advantages, targets = gae_before_whitening(
        rewards,
        values,
        traj_ids,
        step_index,
        gamma=gamma,
        lam=lam,
        final_values=final_values,
        is_padding=is_padding,
    )
    if whiten:
        advantages = _whitened_over_batch(advantages, real_mask(is_padding, advantages.shape[0]), eps)
    return advantages, targets


def broadcast_to_tokens(advantages: Any, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [B] as a [B, T] tensor on the mask's device, 0 outside the mask."""
    mask = response_mask
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    per_sample = torch.as_tensor(np.asarray(advantages, dtype=np.float64), dtype=dtype, device=mask.device)
    return per_sample.unsqueeze(-1) * mask.to(dtype)


def compute_advantages(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    """Advantages for a batch of step samples with the estimator the config names: its
    partial over the whole batch, finished with the batch's own moments (a rollout
    worker's part is finished with the moments of all workers' parts instead)."""
    part = partial_advantages(samples, config)
    return finish_advantages(part, combine_moments([part.moments]), config)


def _whole_batch(
    partial: Callable[[StepSamples, AlgorithmConfig], PartialAdvantages],
) -> Callable[[StepSamples, AlgorithmConfig], Advantages]:
    """An estimator's partial -> combine -> finish, with the batch as the one part."""

    def estimator(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
        part = partial(samples, config)
        return finish_advantages(part, combine_moments([part.moments]), config)

    return estimator


ADVANTAGE_ESTIMATORS: dict[str, Callable[[StepSamples, AlgorithmConfig], Advantages]] = {
    name: _whole_batch(partial) for name, partial in PARTIAL_ESTIMATORS.items()
}


def _whitened_over_batch(values: np.ndarray, real: np.ndarray, eps: float) -> np.ndarray:
    return whiten_with_moments(values, real, moments_of(values[real]), eps)
