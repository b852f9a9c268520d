"""Advantage estimators (GiGPO and siblings), policy losses and the KL loss: pure functions on arrays."""

from megatron_agent.algorithms.algorithm_config import AlgorithmConfig
from megatron_agent.algorithms.dynamic_sampling import enough_groups, filter_zero_variance_groups
from megatron_agent.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    Advantages,
    StepSamples,
    apply_invalid_action_penalty,
    broadcast_to_tokens,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from megatron_agent.algorithms.gigpo import anchor_key, gigpo_advantages, step_discounted_returns
from megatron_agent.algorithms.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    actor_loss,
    aggregate_loss,
    entropy_from_logits,
    entropy_loss,
    gspo_loss,
    kl_loss,
    kl_penalty,
    ppo_clip_loss,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "POLICY_LOSSES",
    "Advantages",
    "AlgorithmConfig",
    "StepSamples",
    "actor_loss",
    "aggregate_loss",
    "anchor_key",
    "apply_invalid_action_penalty",
    "broadcast_to_tokens",
    "compute_advantages",
    "enough_groups",
    "entropy_from_logits",
    "entropy_loss",
    "filter_zero_variance_groups",
    "gae_advantages",
    "gigpo_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_loss",
    "kl_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "step_discounted_returns",
    "value_loss",
]
