"""Every estimator's rule, split where a batch-wide statistic enters, for workers that own whole groups.

A worker that owns whole episode groups (all their trajectories and step samples) computes:

    part = partial_advantages(samples, config)         # its own samples only
    moments = combine_moments([p.moments for p in all workers' parts])   # a few scalars each
    advantages = finish_advantages(part, moments, config)

gigpo, grpo, dr_grpo and rloo take every mean and std over one episode group (GiGPO's
anchor-state groups are (episode group, anchor) pairs), so a part's advantages are final and
its ``moments`` None. reinforce_pp, reinforce_pp_baseline and gae (with ``gae_whiten``) whiten
over the batch's real samples: a part carries its advantages before whitening and their
``Moments``; the combined moments give the mean and unbiased std of the whole batch.
``estimators.compute_advantages`` is this path with the whole batch as the one part.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_agent.algorithms.gigpo import (
    EpisodeStats,
    NormMode,
    episode_relative_advantages,
    gigpo_diagnostic_sums,
    gigpo_halves,
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


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations from the mean (m2) of a set of values."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def combine(self, other: Moments) -> Moments:
        """The moments of both sets together: Chan, Golub and LeVeque's pairwise update, exact
        in exact arithmetic and free of the cancellation a sum of squares suffers."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        count = self.count + other.count
        delta = other.mean - self.mean
        return Moments(
            count,
            self.mean + delta * (other.count / count),
            self.m2 + other.m2 + delta * delta * (self.count * other.count / count),
        )

    @property
    def std(self) -> float:
        """Unbiased (n - 1) standard deviation; 1 for fewer than two values."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0


def moments_of(values: Any) -> Moments:
    """Moments of the values (two passes: the mean, then the squared deviations from it)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return Moments()
    mean = x.mean()
    deviations = x - mean
    return Moments(int(x.size), float(mean), float(np.sum(deviations * deviations)))


def combine_moments(parts: Sequence[Moments | None]) -> Moments | None:
    """The batch's moments from every part's; None when the estimator needs none (all parts None)."""
    if all(part is None for part in parts):
        return None
    if any(part is None for part in parts):
        raise ValueError("some parts carry moments and some do not: were they computed with one estimator?")
    return functools.reduce(Moments.combine, parts, Moments())


def whiten_with_moments(values: np.ndarray, real: np.ndarray, moments: Moments, eps: float) -> np.ndarray:
    """``(x - mean) / (std + eps)`` at the real samples with the given moments; 0 at padding."""
    return scatter_real((values[real] - moments.mean) / (moments.std + eps), real)


@dataclass
class PartialAdvantages:
    """What one worker computes from its own whole groups."""

    advantages: np.ndarray  # float64 [n], 0 at padding: final, or before whitening when moments is set
    returns: np.ndarray  # float64 [n]: as Advantages.returns
    moments: Moments | None  # this part's share of the batch-wide statistic; None: the estimator needs none
    real: np.ndarray  # bool [n]: the samples that are not padding (whitening leaves padding at 0)
    # GiGPO: gigpo.gigpo_diagnostic_sums of these samples (parts' sums add up); None for others
    diagnostics: dict[str, float] | None = None


def partial_advantages(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
    """The part of the configured estimator that needs only these samples' own groups."""
    try:
        rule = PARTIAL_ESTIMATORS[config.advantage_estimator]
    except KeyError:
        raise ValueError(
            f"advantage_estimator must be one of {sorted(PARTIAL_ESTIMATORS)}, got {config.advantage_estimator!r}"
        ) from None
    return rule(samples, config)


def finish_advantages(
    part: PartialAdvantages, moments: Moments | None, config: AlgorithmConfig
) -> Advantages:
    """The part's final advantages: whitened with the batch's combined ``moments``, or as they are."""
    if part.moments is None:
        if moments is not None:
            raise ValueError(f"{config.advantage_estimator} needs no batch moments, got {moments}")
        return Advantages(part.advantages, part.returns)
    if moments is None or moments.count < part.moments.count:
        raise ValueError(
            f"{config.advantage_estimator} whitens over the batch: pass the moments combined over every part "
            f"(got {moments}, this part alone has {part.moments.count} samples)"
        )
    return Advantages(whiten_with_moments(part.advantages, part.real, moments, config.adv_eps), part.returns)


# --- the array-level rules the parts are made of ------------------------------------------


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


def gae_before_whitening(
    rewards: Any,
    values: Any,
    traj_ids: Any,
    step_index: Any,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    final_values: Any = None,
    is_padding: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """PPO's GAE over the steps of each trajectory, not whitened; returns (advantages, value targets).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    target ``A_t + V_t``. After a trajectory's last step V is ``final_values`` of that step
    (0 when not given: the episode terminated).
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


# --- the parts, from (StepSamples, AlgorithmConfig) ---------------------------------------


def _gigpo_part(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
    if samples.anchors is None and config.step_weight != 0.0:
        raise ValueError("gigpo needs anchors (or step_weight=0)")
    scores, returns = _penalised_scores_and_returns(samples, config)
    halves = gigpo_halves(
        scores,
        returns,
        samples.group_ids,
        samples.traj_ids,
        samples.anchors if samples.anchors is not None else [None] * len(scores),
        mode=config.gigpo_mode,
        eps=config.adv_eps,
        episode_stats=config.episode_stats,
        similarity_threshold=config.similarity_threshold,
        is_padding=samples.is_padding,
        with_steps=config.step_weight != 0.0,
    )
    advantages = halves.episode if halves.step is None else halves.episode + config.step_weight * halves.step
    part = _final(scatter_real(advantages, halves.real), returns, samples)
    part.diagnostics = gigpo_diagnostic_sums(halves)
    return part


def _grpo_part(mode: NormMode) -> Callable[[StepSamples, AlgorithmConfig], PartialAdvantages]:
    def part(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
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
        return _final(advantages, returns, samples)

    return part


def _rloo_part(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
    scores, returns = _penalised_scores_and_returns(samples, config)
    advantages = rloo_advantages(
        scores,
        samples.group_ids,
        samples.traj_ids,
        episode_stats=config.episode_stats,
        is_padding=samples.is_padding,
    )
    return _final(advantages, returns, samples)


def _reinforce_pp_part(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
    _, returns = _penalised_scores_and_returns(samples, config)
    return _to_whiten(returns.copy(), returns, samples)


def _reinforce_pp_baseline_part(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
    scores, returns = _penalised_scores_and_returns(samples, config)
    centred = grpo_advantages(
        scores,
        samples.group_ids,
        samples.traj_ids,
        mode="mean_norm",
        eps=config.adv_eps,
        episode_stats=config.episode_stats,
        is_padding=samples.is_padding,
    )
    return _to_whiten(centred, returns, samples)


def _gae_part(samples: StepSamples, config: AlgorithmConfig) -> PartialAdvantages:
    if samples.values is None:
        raise ValueError("gae needs critic values (StepSamples.values)")
    n = num_samples(samples.rewards)
    rewards = to_float64(samples.rewards, n, "rewards") - _step_penalty(samples, config, n)
    advantages, targets = gae_before_whitening(
        rewards,
        samples.values,
        _trajectory_key(samples, n),
        samples.step_index,
        gamma=config.gamma,
        lam=config.gae_lambda,
        final_values=samples.final_values,
        is_padding=samples.is_padding,
    )
    if config.gae_whiten:
        return _to_whiten(advantages, targets, samples)
    return _final(advantages, targets, samples)


PARTIAL_ESTIMATORS: dict[str, Callable[[StepSamples, AlgorithmConfig], PartialAdvantages]] = {
    "gigpo": _gigpo_part,
    "grpo": _grpo_part("mean_std_norm"),
    "dr_grpo": _grpo_part("mean_norm"),
    "rloo": _rloo_part,
    "reinforce_pp": _reinforce_pp_part,
    "reinforce_pp_baseline": _reinforce_pp_baseline_part,
    "gae": _gae_part,
}


def _final(advantages: np.ndarray, returns: np.ndarray, samples: StepSamples) -> PartialAdvantages:
    return PartialAdvantages(advantages, returns, None, real_mask(samples.is_padding, advantages.shape[0]))


def _to_whiten(advantages: np.ndarray, returns: np.ndarray, samples: StepSamples) -> PartialAdvantages:
    real = real_mask(samples.is_padding, advantages.shape[0])
    return PartialAdvantages(advantages, returns, moments_of(advantages[real]), real)


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


def _episode_columns(episode_scores: Any, group_ids: Any, traj_ids: Any, is_padding: Any, n: int):
    """Real samples' scores, group codes and trajectory codes (trajectory = (group, traj id))."""
    scores = to_float64(episode_scores, n, "episode_scores")
    real = real_mask(is_padding, n)
    group_codes, n_groups = factorize(take_real(group_ids, real, n, "group_ids"))
    traj_local, _ = factorize(take_real(traj_ids, real, n, "traj_ids"))
    traj_codes, n_traj = combine_codes(group_codes, traj_local)
    return scores[real], real, group_codes, n_groups, traj_codes, n_traj
