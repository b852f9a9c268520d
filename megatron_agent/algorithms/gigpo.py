"""GiGPO: Group-in-Group Policy Optimization (arXiv 2505.10978), vectorised.

Advantage of step sample i:  A(i) = A_E(i) + step_weight * A_S(i)
  A_E: the sample's episode score against the other trajectories of its episode group;
  A_S: the sample's discounted step return G_t against the other samples of its group
       that saw the same anchor state (the raw observation before the step).
docs/algorithms.md has the formulas and the choices made where the paper is silent.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

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
    to_numpy,
    trajectory_positions,
)

NormMode = Literal["mean_norm", "mean_std_norm"]
EpisodeStats = Literal["per_step", "per_trajectory"]
NORM_MODES = ("mean_norm", "mean_std_norm")
EPISODE_STATS = ("per_step", "per_trajectory")


def step_discounted_returns(
    rewards: Any, traj_ids: Any, step_index: Any, gamma: float, *, is_padding: Any = None
) -> np.ndarray:
    """G_t = r_t + gamma * G_{t+1} inside each trajectory, one value per step sample (float64).

    Samples may come in any order; ``step_index`` orders the steps of a trajectory (gaps are
    fine). Padding samples get 0 and are not part of any trajectory.
    """
    rewards = to_float64(rewards, num_samples(rewards), "rewards")
    n = rewards.shape[0]
    steps = to_float64(step_index, n, "step_index")
    real = real_mask(is_padding, n)
    traj_codes, n_traj = factorize(take_real(traj_ids, real, n, "traj_ids"))
    if n_traj == 0:
        return np.zeros(n, dtype=np.float64)
    positions, lengths = trajectory_positions(traj_codes, n_traj, steps[real])
    returns = reverse_discounted_scan(rewards[real], traj_codes, positions, n_traj, int(lengths.max()), gamma)
    return scatter_real(returns, real)


def anchor_key(anchor: Any) -> Hashable:
    """A hashable key that is equal for equal anchor states.

    Strings and scalars are their own key. Arrays (grids, images; torch tensors and PIL images
    are converted) are keyed by dtype, shape and their raw bytes: the dict hashes the bytes
    once and compares them exactly on a hit, so an image costs a memory copy and a hash, not a
    tuple of its pixels, and two different states can never share a key. Lists and tuples are
    the same sequence; dict keys are sorted, so insertion order does not matter.
    """
    if isinstance(anchor, str | int | float | bool | bytes) or anchor is None:
        return anchor
    if isinstance(anchor, np.generic):
        return anchor.item()
    if isinstance(anchor, dict):
        items = sorted(((repr(k), anchor_key(v)) for k, v in anchor.items()), key=lambda kv: kv[0])
        return ("dict", tuple(items))
    if isinstance(anchor, list | tuple):
        return ("seq", tuple(anchor_key(x) for x in anchor))
    if not isinstance(anchor, np.ndarray):
        if (
            hasattr(anchor, "detach")
            or hasattr(anchor, "__array_interface__")
            or hasattr(anchor, "__array__")
        ):
            anchor = np.asarray(to_numpy(anchor))
        else:
            hash(anchor)  # unhashable objects fail here, with Python's own message
            return anchor
    if anchor.dtype == object:
        return ("objects", anchor.shape, tuple(anchor_key(x) for x in anchor.ravel()))
    return ("array", anchor.dtype.str, anchor.shape, anchor.tobytes())


def episode_relative_advantages(
    episode_scores: np.ndarray,
    group_codes: np.ndarray,
    n_groups: int,
    traj_codes: np.ndarray,
    n_traj: int,
    *,
    mode: NormMode,
    eps: float,
    episode_stats: EpisodeStats,
) -> np.ndarray:
    """A_E for real samples given dense codes (``traj_codes`` already unique across groups).

    per_step: mean and std over the group's step samples (long trajectories weigh more);
    per_trajectory: over the group's trajectories, each scored by the mean of its samples'
    scores. Either way each sample is compared by its own score, so a per-step penalty shows.
    A group with a single trajectory has mean 0 and std 1: its advantage is its score.
    """
    check_choice("mode", mode, NORM_MODES)
    check_choice("episode_stats", episode_stats, EPISODE_STATS)
    traj_group = np.zeros(n_traj, dtype=np.int64)
    traj_group[traj_codes] = group_codes
    lone = np.bincount(traj_group, minlength=n_groups) == 1
    if episode_stats == "per_step":
        _, mean, std = segment_mean_std(episode_scores, group_codes, n_groups)
    else:
        _, traj_score, _ = segment_mean_std(episode_scores, traj_codes, n_traj)
        _, mean, std = segment_mean_std(traj_score, traj_group, n_groups)
    mean = np.where(lone, 0.0, mean)
    advantages = episode_scores - mean[group_codes]
    if mode == "mean_std_norm":
        std = np.where(lone, 1.0, std)
        advantages = advantages / (std[group_codes] + eps)
    return advantages


def step_relative_advantages(
    step_returns: np.ndarray, step_group_codes: np.ndarray, n_step_groups: int, *, mode: NormMode, eps: float
) -> np.ndarray:
    """A_S for real samples: G_t against its anchor-state group; a singleton group gives 0."""
    check_choice("mode", mode, NORM_MODES)
    count, mean, std = segment_mean_std(step_returns, step_group_codes, n_step_groups)
    advantages = step_returns - mean[step_group_codes]
    if mode == "mean_std_norm":
        advantages = advantages / (np.nan_to_num(std, nan=1.0)[step_group_codes] + eps)
    return np.where(count[step_group_codes] > 1, advantages, 0.0)


def anchor_state_codes(
    anchors: list[Any], group_codes: np.ndarray, similarity_threshold: float | None = None
) -> tuple[np.ndarray, int]:
    """Dense codes of the step groups: (episode group, anchor state) pairs.

    With ``similarity_threshold``, text anchors inside one episode group are clustered: each
    distinct text, visited in sorted order, joins the first cluster (in creation order) whose
    first member has ``SequenceMatcher(None, first_member, text).ratio() >= threshold``, or
    starts a new one. Sorted order (the reference uses batch order) keeps the grouping
    independent of how the batch is shuffled. Non-text anchors are grouped exactly.
    """
    anchor_codes, _ = _factorize_anchors(anchors)
    if similarity_threshold is not None:
        anchor_codes = _similarity_cluster_codes(anchors, anchor_codes, group_codes, similarity_threshold)
    return combine_codes(group_codes, anchor_codes)


def gigpo_advantages(
    episode_scores: Any,
    step_returns: Any,
    group_ids: Any,
    traj_ids: Any,
    anchors: Any,
    *,
    mode: NormMode = "mean_norm",
    step_weight: float = 1.0,
    eps: float = 1e-6,
    episode_stats: EpisodeStats = "per_step",
    similarity_threshold: float | None = None,
    is_padding: Any = None,
) -> np.ndarray:
    """GiGPO advantage per step sample, float64: ``A_E + step_weight * A_S``.

    ``episode_scores[i]``: the score of sample i's trajectory as seen on that sample (after any
    per-step invalid-action penalty); ``step_returns[i]``: its discounted return G_t
    (``step_discounted_returns``, penalty applied after discounting). A trajectory is the pair
    (group id, trajectory id). Padding samples get 0 and enter no statistic; their anchors are
    never looked at (nor any anchor with step_weight 0).
    """
    halves = gigpo_halves(episode_scores, step_returns, group_ids, traj_ids, anchors, mode=mode, eps=eps,
                          episode_stats=episode_stats, similarity_threshold=similarity_threshold,
                          is_padding=is_padding, with_steps=step_weight != 0.0)
    if halves.step is None:
        return scatter_real(halves.episode, halves.real)
    return scatter_real(halves.episode + step_weight * halves.step, halves.real)


@dataclass(frozen=True)
class GigpoHalves:
    """GiGPO's two advantages of the real samples, apart, and the step groups they came from."""

    real: np.ndarray  # bool [n]: the samples that are not padding
    episode: np.ndarray  # A_E of each real sample
    step: np.ndarray | None  # A_S of each real sample (0 in a step group of one); None: not computed
    step_group_size: np.ndarray | None  # how many samples share each real sample's anchor-state group
    n_step_groups: int


def gigpo_halves(episode_scores: Any, step_returns: Any, group_ids: Any, traj_ids: Any, anchors: Any, *,
                 mode: NormMode, eps: float, episode_stats: EpisodeStats, similarity_threshold: float | None,
                 is_padding: Any, with_steps: bool = True) -> GigpoHalves:
    """A_E and (with_steps) A_S of the real samples, as `gigpo_advantages` adds them."""
    n = num_samples(episode_scores)
    scores = to_float64(episode_scores, n, "episode_scores")
    returns = to_float64(step_returns, n, "step_returns")
    real = real_mask(is_padding, n)
    group_codes, n_groups = factorize(take_real(group_ids, real, n, "group_ids"))
    if n_groups == 0:
        empty = np.zeros(0, dtype=np.float64)
        return GigpoHalves(real, empty, empty if with_steps else None, np.zeros(0, np.int64) if with_steps else None,
                           0)
    traj_local, _ = factorize(take_real(traj_ids, real, n, "traj_ids"))
    traj_codes, n_traj = combine_codes(group_codes, traj_local)
    episode = episode_relative_advantages(scores[real], group_codes, n_groups, traj_codes, n_traj, mode=mode, eps=eps,
                                          episode_stats=episode_stats)
    if not with_steps:
        return GigpoHalves(real, episode, None, None, 0)
    step_codes, n_step_groups = anchor_state_codes(take_real(anchors, real, n, "anchors"), group_codes,
                                                   similarity_threshold)
    step = step_relative_advantages(returns[real], step_codes, n_step_groups, mode=mode, eps=eps)
    return GigpoHalves(real, episode, step, np.bincount(step_codes, minlength=n_step_groups)[step_codes],
                       n_step_groups)


GIGPO_DIAGNOSTIC_SUMS = ("samples", "shared_state_samples", "step_groups", "step_advantage_abs",
                         "episode_advantage_abs", "both_nonzero", "sign_disagreements")


def gigpo_diagnostic_sums(halves: GigpoHalves) -> dict[str, float]:
    """Sums over the real samples that say whether GiGPO's step half has anything to work
    with (`gigpo_diagnostics` turns them into metrics; sums of parts add up)."""
    if halves.step is None:
        return {}
    both = (halves.episode != 0) & (halves.step != 0)
    return {
        "samples": float(len(halves.episode)),
        "shared_state_samples": float((halves.step_group_size >= 2).sum()),
        "step_groups": float(halves.n_step_groups),
        "step_advantage_abs": float(np.abs(halves.step).sum()),
        "episode_advantage_abs": float(np.abs(halves.episode).sum()),
        "both_nonzero": float(both.sum()),
        "sign_disagreements": float((both & (np.sign(halves.episode) != np.sign(halves.step))).sum()),
    }


def gigpo_diagnostics(sums: dict[str, float], prefix: str = "gigpo/") -> dict[str, float]:
    """Metrics of (summed) `gigpo_diagnostic_sums`: the share of step samples whose
    anchor-state group has 2 or more members (only those get a step advantage), the mean
    step-group size, the mean |A_S| and |A_E| and their ratio, and how often A_S's sign
    disagrees with A_E's where both are non-zero."""
    if not sums or not sums["samples"]:
        return {}
    n = sums["samples"]
    out = {f"{prefix}shared_state_fraction": sums["shared_state_samples"] / n,
           f"{prefix}step_group_size": n / sums["step_groups"],
           f"{prefix}step_advantage_abs": sums["step_advantage_abs"] / n,
           f"{prefix}episode_advantage_abs": sums["episode_advantage_abs"] / n}
    if sums["episode_advantage_abs"]:
        out[f"{prefix}step_to_episode_abs"] = sums["step_advantage_abs"] / sums["episode_advantage_abs"]
    if sums["both_nonzero"]:
        out[f"{prefix}sign_disagreement"] = sums["sign_disagreements"] / sums["both_nonzero"]
    return out


def _factorize_anchors(anchors: list[Any]) -> tuple[np.ndarray, int]:
    table: dict[Hashable, int] = {}
    keys = (a if type(a) is str else anchor_key(a) for a in anchors)  # text, the common case, skips the call
    codes = np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int64, count=len(anchors))
    return codes, len(table)


def _similarity_cluster_codes(
    anchors: list[Any], anchor_codes: np.ndarray, group_codes: np.ndarray, threshold: float
) -> np.ndarray:
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"similarity_threshold must be in [0, 1], got {threshold}")
    if anchor_codes.size == 0:
        return anchor_codes
    pair_codes, _ = combine_codes(group_codes, anchor_codes)
    _, first_of_pair = np.unique(pair_codes, return_index=True)
    pair_cluster = anchor_codes[first_of_pair]  # non-text anchors keep their exact code
    texts_by_group: dict[int, list[tuple[str, int]]] = {}
    for pair, sample in enumerate(first_of_pair):
        if isinstance(anchors[sample], str):
            texts_by_group.setdefault(int(group_codes[sample]), []).append((anchors[sample], pair))
    next_cluster = int(anchor_codes.max()) + 1
    for texts in texts_by_group.values():
        clusters: list[tuple[str, int]] = []  # (first member's text, cluster code), in creation order
        for text, pair in sorted(texts):
            matcher = difflib.SequenceMatcher(None, "", text)
            cluster = None
            for first, code in clusters:
                matcher.set_seq1(first)
                # the quick ratios are upper bounds of ratio(): cheap rejections, same answer
                if (
                    matcher.real_quick_ratio() >= threshold
                    and matcher.quick_ratio() >= threshold
                    and matcher.ratio() >= threshold
                ):
                    cluster = code
                    break
            if cluster is None:
                cluster = next_cluster
                next_cluster += 1
                clusters.append((text, cluster))
            pair_cluster[pair] = cluster
    return pair_cluster[pair_codes]
