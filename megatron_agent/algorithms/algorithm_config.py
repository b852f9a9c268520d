"""The algorithm section of the training config (Hydra fills it; ``validate`` checks it).

``validate`` reads the names of the estimators, losses and modes from the modules that
implement them; those modules name ``AlgorithmConfig`` in annotations only (under
``TYPE_CHECKING``), so the imports run one way: this module -> estimators, gigpo, losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_agent.algorithms.estimators import ADVANTAGE_ESTIMATORS
from megatron_agent.algorithms.gigpo import EPISODE_STATS, NORM_MODES
from megatron_agent.algorithms.losses import (
    AGG_MODES,
    KL_ALIASES,
    POLICY_LOSSES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_MASKS,
)

ROUTING_REPLAY_MODES = ("none", "rollout", "recompute")  # training/routing_replay.py


@dataclass
class AlgorithmConfig:
    # advantages
    advantage_estimator: str = (
        "gigpo"  # gigpo | grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae
    )
    gamma: float = 1.0  # step discount; the published GiGPO runs use 0.95
    adv_eps: float = 1e-6
    step_weight: float = 1.0  # GiGPO omega
    gigpo_mode: str = "mean_norm"  # mean_norm | mean_std_norm
    episode_stats: str = "per_step"  # per_step (published runs) | per_trajectory (paper)
    similarity_threshold: float | None = None  # text anchors: 0.95, 0.9 for search
    invalid_action_penalty: float = 0.1  # 0.01 for search
    gae_lambda: float = 1.0
    gae_whiten: bool = True
    # policy loss
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo
    clip_ratio_low: float = 0.2  # gspo: 3e-4
    clip_ratio_high: float = 0.2  # DAPO clip-higher: 0.28; gspo: 4e-4
    dual_clip_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    loss_norm_length: int | None = None  # seq-mean-token-sum-norm constant; None: padded length
    # rollout correction, by r = pi_trainer_old / pi_engine (losses.rollout_correction_weights)
    tis_cap: float | None = None  # truncated importance sampling, e.g. 2.0
    tis_level: str = "token"  # token: min(r_t, cap) | sequence: min(prod_t r_t, cap) on every token
    rollout_mask: str = "none"  # none | token | sequence (geometric mean of r): drop what leaves [low, high]
    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0  # IcePop: rollout_mask=token with tis_cap >= rollout_mask_high
    # MoE: none | rollout (R3: every forward routes by the engines' expert ids) | recompute
    # (R2: the update routes by the experts the old-logprob pass chose)
    routing_replay: str = "none"
    entropy_coef: float = 0.001
    # KL to the reference policy, a loss term (see kl_loss_active)
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.01
    kl_loss_type: str = "k3"  # k1 | abs | k2 | k3 (aliases kl, mse, low_var_kl)
    # critic (gae)
    value_clip: float | None = 0.5
    # DAPO dynamic sampling
    dynamic_sampling: bool = False
    dynamic_sampling_max_tries: int = 10

    @property
    def corrects_rollout(self) -> bool:
        """Whether the loss weights tokens by the engines' logprobs (``tis_cap`` or ``rollout_mask``)."""
        return self.tis_cap is not None or self.rollout_mask != "none"

    @property
    def kl_loss_active(self) -> bool:
        """Whether the actor loss has a KL term (``use_kl_loss`` and ``kl_loss_coef > 0``): only
        then does it need reference logprobs, and only then does the actor build a reference model."""
        return self.use_kl_loss and self.kl_loss_coef > 0

    def validate(self) -> None:
        """Raise ValueError naming the first field that holds an impossible value."""
        _one_of("advantage_estimator", self.advantage_estimator, tuple(ADVANTAGE_ESTIMATORS))
        _one_of("policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        _one_of("gigpo_mode", self.gigpo_mode, NORM_MODES)
        _one_of("episode_stats", self.episode_stats, EPISODE_STATS)
        _one_of("loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        _one_of("kl_loss_type", self.kl_loss_type, tuple(KL_ALIASES))
        _in_range("gamma", self.gamma, 0.0, 1.0)
        _in_range("gae_lambda", self.gae_lambda, 0.0, 1.0)
        _positive("adv_eps", self.adv_eps)
        _in_range("step_weight", self.step_weight, 0.0, math.inf)
        if self.similarity_threshold is not None:
            _in_range("similarity_threshold", self.similarity_threshold, 0.0, 1.0)
        _in_range("invalid_action_penalty", self.invalid_action_penalty, 0.0, math.inf)
        _in_range("clip_ratio_low", self.clip_ratio_low, 0.0, 1.0, open_low=True, open_high=True)
        _positive("clip_ratio_high", self.clip_ratio_high)
        if self.dual_clip_c is not None and not (math.isfinite(self.dual_clip_c) and self.dual_clip_c > 1.0):
            raise ValueError(f"dual_clip_c must be > 1 (or None), got {self.dual_clip_c}")
        if self.loss_norm_length is not None:
            _positive("loss_norm_length", self.loss_norm_length)
        if self.tis_cap is not None:
            _positive("tis_cap", self.tis_cap)
        _one_of("tis_level", self.tis_level, ROLLOUT_IS_LEVELS)
        _one_of("rollout_mask", self.rollout_mask, ROLLOUT_MASKS)
        _one_of("routing_replay", self.routing_replay, ROUTING_REPLAY_MODES)
        _positive("rollout_mask_low", self.rollout_mask_low)
        _positive("rollout_mask_high", self.rollout_mask_high)
        if self.rollout_mask_low >= self.rollout_mask_high:
            raise ValueError(f"rollout_mask_low ({self.rollout_mask_low}) must be below rollout_mask_high "
                             f"({self.rollout_mask_high})")
        _in_range("entropy_coef", self.entropy_coef, 0.0, math.inf)
        _in_range("kl_loss_coef", self.kl_loss_coef, 0.0, math.inf)
        if self.value_clip is not None:
            _positive("value_clip", self.value_clip)
        _positive("dynamic_sampling_max_tries", self.dynamic_sampling_max_tries)


def _one_of(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {sorted(choices)}, got {value!r}")


def _positive(field: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{field} must be a finite number > 0, got {value!r}")


def _in_range(
    field: str, value: float, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> None:
    ok = isinstance(value, int | float) and not math.isnan(value) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        raise ValueError(
            f"{field} must be in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}, got {value!r}"
        )
