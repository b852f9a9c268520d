"""Advantage estimators on the flat step-sample layout, selectable by name.

Every estimator returns one float64 advantage per step sample (numpy, whatever the input
type); padding samples get 0 and enter no statistic. ``compute_advantages`` is the entry point
the trainer uses: it derives returns and episode scores, applies the invalid-action penalty and
dispatches on ``AlgorithmConfig.advantage_estimator`` through ``ADVANTAGE_ESTIMATORS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron_agent.algorithms.gigpo import (
    EpisodeStats,
    NormMode,
    episode_relative_advantages,
    gigpo_advantages,
    step_discounted_returns,
)
from megatron_agent.algorithms.segments import (
    check_choice,
    combine_codes,
    factorize,
    num_samples,
    real_mask,
    reverse_discounted_scan,
    scatter_real,
    segment_mean_std,
    take_real,
    to_float64,
    trajectory_positions,
)

if TYPE_CHECKING:
    from megatron_agent.algorithms.algorithm_config import AlgorithmConfig


@dataclass
class StepSamples:
    """The columns of a batch of step samples that the estimators read (one entry per sample)."""

    group_ids: Any
    traj_ids: Any
    step_index: Any
    rewards: Any
    episode_scores: Any = None  # before any penalty; None: the sum of the trajectory's step rewards
    anchors: Any = None  # GiGPO only
    is_action_valid: Any = None  # None: every action parsed
    is_padding: Any = None
    reward_penalty: Any = None  # any per-sample cost; enters like the invalid-action penalty
    values: Any = None  # critic values, GAE only
    final_values: Any = None  # value after a trajectory's last step (0 = terminal), GAE only


@dataclass
class Advantages:
    advantages: np.ndarray  # float64 [n_samples], 0 at padding
    returns: np.ndarray  # float64 [n_samples]: value targets for GAE, step returns G_t otherwise


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


def grpo_advantages(
    episode_scores: Any,
    group_ids: Any,
    traj_ids: Any,
    *,
    mode: NormMode = "mean_std_norm",
    eps: float = 1e-6,
    episode_stats: EpisodeStats = "per_step",
    is_padding: Any = None,
) -> np.ndarray:
    """GRPO: the episode-level half of GiGPO. ``mode="mean_norm"`` is Dr.GRPO (no std)."""
    n = num_samples(episode_scores)
    scores, real, group_codes, n_groups, traj_codes, n_traj = _episode_columns(
        episode_scores, group_ids, traj_ids, is_padding, n
    )
    if n_groups == 0:
        return np.zeros(n, dtype=np.float64)
    advantages = episode_relative_advantages(
        scores, group_codes, n_groups, traj_codes, n_traj, mode=mode, eps=eps, episode_stats=episode_stats
    )
    return scatter_real(advantages, real)


def rloo_advantages(
    episode_scores: Any,
    group_ids: Any,
    traj_ids: Any,
    *,
    episode_stats: EpisodeStats = "per_step",
    is_padding: Any = None,
) -> np.ndarray:
    """RLOO: ``A = score - mean(score of the others in the group)``.

    per_step: the others are the group's other step samples; per_trajectory: the group's other
    trajectories (each scored by the mean of its samples). A lone trajectory has baseline 0.
    """
    check_choice("episode_stats", episode_stats, ("per_step", "per_trajectory"))
    n = num_samples(episode_scores)
    scores, real, group_codes, n_groups, traj_codes, n_traj = _episode_columns(
        episode_scores, group_ids, traj_ids, is_padding, n
    )
    if n_groups == 0:
        return np.zeros(n, dtype=np.float64)
    traj_group = np.zeros(n_traj, dtype=np.int64)
    traj_group[traj_codes] = group_codes
    lone = (np.bincount(traj_group, minlength=n_groups) == 1)[group_codes]
    if episode_stats == "per_step":
        count = np.bincount(group_codes, minlength=n_groups)[group_codes]
        total = np.bincount(group_codes, weights=scores, minlength=n_groups)[group_codes]
        own = scores
    else:
        _, traj_score, _ = segment_mean_std(scores, traj_codes, n_traj)
        count = np.bincount(traj_group, minlength=n_groups)[group_codes]
        total = np.bincount(traj_group, weights=traj_score, minlength=n_groups)[group_codes]
        own = traj_score[traj_codes]
    baseline = np.where(lone, 0.0, (total - own) / np.maximum(count - 1, 1))
    return scatter_real(scores - baseline, real)


def reinforce_pp_advantages(step_returns: Any, *, eps: float = 1e-6, is_padding: Any = None) -> np.ndarray:
    """REINFORCE++: the step returns G_t whitened over the batch's real samples."""
    n = num_samples(step_returns)
    real = real_mask(is_padding, n)
    return scatter_real(_whiten(to_float64(step_returns, n, "step_returns")[real], eps), real)


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
    real = real_mask(is_padding, centred.shape[0])
    return scatter_real(_whiten(centred[real], eps), real)


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
    n = num_samples(rewards)
    rewards = to_float64(rewards, n, "rewards")
    values = to_float64(values, n, "values")
    finals = np.zeros(n) if final_values is None else to_float64(final_values, n, "final_values")
    real = real_mask(is_padding, n)
    traj_codes, n_traj = factorize(take_real(traj_ids, real, n, "traj_ids"))
    if n_traj == 0:
        return np.zeros(n), np.zeros(n)
    positions, lengths = trajectory_positions(
        traj_codes, n_traj, to_float64(step_index, n, "step_index")[real]
    )
    max_len = int(lengths.max())
    value_table = np.zeros((n_traj, max_len + 1))
    value_table[traj_codes, positions] = values[real]
    is_last = positions == lengths[traj_codes] - 1
    value_table[traj_codes[is_last], positions[is_last] + 1] = finals[real][is_last]
    deltas = rewards[real] + gamma * value_table[traj_codes, positions + 1] - values[real]
    advantages = reverse_discounted_scan(deltas, traj_codes, positions, n_traj, max_len, gamma * lam)
    targets = advantages + values[real]
    if whiten:
        advantages = _whiten(advantages, eps)
    return scatter_real(advantages, real), scatter_real(targets, real)


def trajectory_reward_sums(
    rewards: Any, group_ids: Any, traj_ids: Any, *, is_padding: Any = None
) -> np.ndarray:
    """Each sample's trajectory return (sum of its real step rewards), the default episode score."""
    n = num_samples(rewards)
    scores, real, _, n_groups, traj_codes, n_traj = _episode_columns(
        rewards, group_ids, traj_ids, is_padding, n
    )
    if n_groups == 0:
        return np.zeros(n)
    return scatter_real(np.bincount(traj_codes, weights=scores, minlength=n_traj)[traj_codes], real)


def broadcast_to_tokens(advantages: Any, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [B] as a [B, T] tensor on the mask's device, 0 outside the mask."""
    mask = response_mask
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    per_sample = torch.as_tensor(np.asarray(advantages, dtype=np.float64), dtype=dtype, device=mask.device)
    return per_sample.unsqueeze(-1) * mask.to(dtype)


def compute_advantages(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    """Advantages for a batch of step samples with the estimator the config names."""
    try:
        estimator = ADVANTAGE_ESTIMATORS[config.advantage_estimator]
    except KeyError:
        raise ValueError(
            f"advantage_estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {config.advantage_estimator!r}"
        ) from None
    return estimator(samples, config)


# --- adapters from (StepSamples, AlgorithmConfig) to the estimators above -------------------


def _penalised_scores_and_returns(
    samples: StepSamples, config: AlgorithmConfig
) -> tuple[np.ndarray, np.ndarray]:
    n = num_samples(samples.rewards)
    traj_key = _trajectory_key(samples, n)
    returns = step_discounted_returns(
        samples.rewards, traj_key, samples.step_index, config.gamma, is_padding=samples.is_padding
    )
    if samples.episode_scores is None:
        scores = trajectory_reward_sums(
            samples.rewards, samples.group_ids, samples.traj_ids, is_padding=samples.is_padding
        )
    else:
        scores = to_float64(samples.episode_scores, n, "episode_scores")
    cost = _step_penalty(samples, config, n)
    return scores - cost, returns - cost


def _step_penalty(samples: StepSamples, config: AlgorithmConfig, n: int) -> np.ndarray:
    cost = np.zeros(n)
    if samples.is_action_valid is not None and config.invalid_action_penalty:
        cost += config.invalid_action_penalty * (
            1.0 - to_float64(samples.is_action_valid, n, "is_action_valid")
        )
    if samples.reward_penalty is not None:
        cost += to_float64(samples.reward_penalty, n, "reward_penalty")
    return cost * real_mask(samples.is_padding, n)


def _trajectory_key(samples: StepSamples, n: int) -> np.ndarray:
    group_codes, _ = factorize(take_real(samples.group_ids, np.ones(n, dtype=bool), n, "group_ids"))
    traj_codes, _ = factorize(take_real(samples.traj_ids, np.ones(n, dtype=bool), n, "traj_ids"))
    return combine_codes(group_codes, traj_codes)[0]


def _run_gigpo(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    if samples.anchors is None and config.step_weight != 0.0:
        raise ValueError("gigpo needs anchors (or step_weight=0)")
    scores, returns = _penalised_scores_and_returns(samples, config)
    advantages = gigpo_advantages(
        scores,
        returns,
        samples.group_ids,
        samples.traj_ids,
        samples.anchors if samples.anchors is not None else [None] * len(scores),
        mode=config.gigpo_mode,
        step_weight=config.step_weight,
        eps=config.adv_eps,
        episode_stats=config.episode_stats,
        similarity_threshold=config.similarity_threshold,
        is_padding=samples.is_padding,
    )
    return Advantages(advantages, returns)


def _run_grpo(mode: NormMode) -> Callable[[StepSamples, AlgorithmConfig], Advantages]:
    def run(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
        scores, returns = _penalised_scores_and_returns(samples, config)
        advantages = grpo_advantages(
            scores,
            samples.group_ids,
            samples.traj_ids,
            mode=mode,
            eps=config.adv_eps,
            episode_stats=config.episode_stats,
            is_padding=samples.is_padding,
        )
        return Advantages(advantages, returns)

    return run


def _run_rloo(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    scores, returns = _penalised_scores_and_returns(samples, config)
    advantages = rloo_advantages(
        scores,
        samples.group_ids,
        samples.traj_ids,
        episode_stats=config.episode_stats,
        is_padding=samples.is_padding,
    )
    return Advantages(advantages, returns)


def _run_reinforce_pp(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    _, returns = _penalised_scores_and_returns(samples, config)
    return Advantages(
        reinforce_pp_advantages(returns, eps=config.adv_eps, is_padding=samples.is_padding), returns
    )


def _run_reinforce_pp_baseline(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    scores, returns = _penalised_scores_and_returns(samples, config)
    advantages = reinforce_pp_baseline_advantages(
        scores,
        samples.group_ids,
        samples.traj_ids,
        eps=config.adv_eps,
        episode_stats=config.episode_stats,
        is_padding=samples.is_padding,
    )
    return Advantages(advantages, returns)


def _run_gae(samples: StepSamples, config: AlgorithmConfig) -> Advantages:
    if samples.values is None:
        raise ValueError("gae needs critic values (StepSamples.values)")
    n = num_samples(samples.rewards)
    rewards = to_float64(samples.rewards, n, "rewards") - _step_penalty(samples, config, n)
    advantages, targets = gae_advantages(
        rewards,
        samples.values,
        _trajectory_key(samples, n),
        samples.step_index,
        gamma=config.gamma,
        lam=config.gae_lambda,
        final_values=samples.final_values,
        whiten=config.gae_whiten,
        eps=config.adv_eps,
        is_padding=samples.is_padding,
    )
    return Advantages(advantages, targets)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[StepSamples, AlgorithmConfig], Advantages]] = {
    "gigpo": _run_gigpo,
    "grpo": _run_grpo("mean_std_norm"),
    "dr_grpo": _run_grpo("mean_norm"),
    "rloo": _run_rloo,
    "reinforce_pp": _run_reinforce_pp,
    "reinforce_pp_baseline": _run_reinforce_pp_baseline,
    "gae": _run_gae,
}


def _episode_columns(episode_scores: Any, group_ids: Any, traj_ids: Any, is_padding: Any, n: int):
    """Real samples' scores, group codes and trajectory codes (trajectory = (group, traj id))."""
    scores = to_float64(episode_scores, n, "episode_scores")
    real = real_mask(is_padding, n)
    group_codes, n_groups = factorize(take_real(group_ids, real, n, "group_ids"))
    traj_local, _ = factorize(take_real(traj_ids, real, n, "traj_ids"))
    traj_codes, n_traj = combine_codes(group_codes, traj_local)
    return scores[real], real, group_codes, n_groups, traj_codes, n_traj


def _whiten(values: np.ndarray, eps: float) -> np.ndarray:
    """``(x - mean) / (std + eps)`` over all entries, std unbiased (1 for a single entry)."""
    if values.size == 0:
        return values
    std = float(values.std(ddof=1)) if values.size > 1 else 1.0
    return (values - values.mean()) / (std + eps)
