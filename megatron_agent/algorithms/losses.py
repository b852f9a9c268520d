"""Token-level losses: policy surrogates, KL to a reference, entropy bonus, value loss.

Inputs are [batch, seq] tensors with a response mask (1 on the tokens that count); per-sample
advantages of shape [batch] are broadcast over tokens. Every loss returns
``(loss, metrics)``: a scalar tensor to backpropagate and a dict of detached 0-d tensors (no
device sync; call ``.item()`` when logging). docs/algorithms.md has the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_agent.algorithms.algorithm_config import AlgorithmConfig

Metrics = dict[str, torch.Tensor]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: bounds the ratio of a token the old policy found near-impossible
GSPO_LOG_RATIO_MAX = 10.0
K3_LIMIT = 10.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_length: float | None = None,
    global_denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [batch, seq] per-token loss to a scalar.

    token-mean:              sum(loss * mask) / tokens
    seq-mean-token-sum:      mean over sequences of sum_t loss
    seq-mean-token-mean:     mean over sequences of mean_t loss
    seq-mean-token-sum-norm: mean over sequences of sum_t loss / norm_length (Dr.GRPO;
                             norm_length defaults to seq, the padded length, and should stay
                             constant over training)
    Sequences with no masked token are not counted. ``global_denominator`` replaces the token
    (or sequence) count, for normalising over a whole batch split into micro-batches or ranks.
    """
    mask = mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if mode == "token-mean":
        denominator = mask.sum() if global_denominator is None else global_denominator
        return masked.sum() / torch.as_tensor(denominator, dtype=loss_mat.dtype).clamp(min=1.0)
    tokens_per_seq = mask.sum(-1)
    seq_sums = masked.sum(-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sums / tokens_per_seq.clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = seq_sums / float(norm_length if norm_length is not None else mask.shape[-1])
    else:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    denominator = (tokens_per_seq > 0).sum() if global_denominator is None else global_denominator
    return per_seq.sum() / torch.as_tensor(denominator, dtype=loss_mat.dtype).clamp(min=1.0)


ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_MASKS = ("none", "token", "sequence")


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis_cap: float | None = None,
    tis_level: str = "token",
    mask: str = "none",
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token weights, detached, that correct the loss for the rollout engine's policy.

    The engine and the trainer compute slightly different probabilities for the same tokens
    (kernels, FP8 weights, MoE routing, a rollout one update old); ``r = pi_trainer_old /
    pi_engine`` per token. Truncated importance sampling (``tis_cap``) weights each token by
    ``min(r, cap)`` (token level) or every token of a sequence by ``min(prod_t r_t, cap)``
    (sequence level). Masking drops what the engine sampled too differently: tokens whose r
    (``mask="token"``) or sequences whose geometric mean ``exp(mean_t log r_t)``
    (``"sequence"``) lies outside ``[mask_low, mask_high]`` get weight 0. Both together at the
    token level with ``tis_cap >= mask_high`` are IcePop's ``r * 1[low <= r <= high]``. A
    dropped token keeps its place in the loss's denominator (weight 0, as in IcePop).
    """
    log_r = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    on = response_mask.to(log_r.dtype)
    log_r = log_r * on
    tokens = on.sum(-1, keepdim=True)
    weights = torch.ones_like(log_r)
    metrics: Metrics = {}
    if tis_cap is not None:
        if tis_level == "token":
            log_w = log_r
        elif tis_level == "sequence":
            log_w = log_r.sum(-1, keepdim=True).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).expand_as(log_r)
        else:
            raise ValueError(f"tis_level must be one of {ROLLOUT_IS_LEVELS}, got {tis_level!r}")
        weights = torch.exp(log_w).clamp(max=tis_cap)
        metrics["rollout_correction/clipfrac"] = masked_mean((log_w >= math.log(tis_cap)).to(log_r.dtype), on)
    if mask == "token":
        ratio = torch.exp(log_r)
    elif mask == "sequence":
        ratio = torch.exp(log_r.sum(-1, keepdim=True) / tokens.clamp(min=1.0)).expand_as(log_r)
    elif mask != "none":
        raise ValueError(f"rollout_mask must be one of {ROLLOUT_MASKS}, got {mask!r}")
    if mask != "none":
        kept = ((ratio >= mask_low) & (ratio <= mask_high)).to(log_r.dtype)
        weights = weights * kept
        metrics["rollout_correction/masked_fraction"] = masked_mean(1.0 - kept, on)
    metrics["rollout_correction/weight_mean"] = masked_mean(weights, on)
    return weights, metrics


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    global_denominator: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate, token-level ratio ``exp(logp - logp_old)``.

    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; clip_high > clip_low is DAPO's
    clip-higher. With ``dual_clip_c`` (> 1) the loss of a negative-advantage token is also
    capped at ``-A c``. ``token_weights`` (detached) multiply each token's loss: the rollout
    correction (``rollout_correction_weights``).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(
        ratio, _per_token(advantages, logprobs), response_mask, clip_low, clip_high, dual_clip_c,
        agg_mode, norm_length, global_denominator, token_weights,
    )  # fmt: skip
    metrics["ppo_kl"] = masked_mean(-log_ratio, response_mask).detach()
    metrics["approx_kl"] = masked_mean(ratio - 1.0 - log_ratio, response_mask).detach()
    return loss, metrics


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip_c: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    norm_length: float | None = None,
    global_denominator: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: one ratio per sequence, ``s = exp(mean_t(logp - logp_old))``, clipped like PPO.

    Each token carries ``sg(s) * pi_t / sg(pi_t)``: its value is s and its gradient
    ``s * grad log pi_t``, so with seq-mean-token-mean and one advantage per sequence the
    gradient is exactly that of the sequence-level objective (and GSPO-token when the
    advantage varies over tokens).
    """
    mask = response_mask.to(logprobs.dtype)
    token_log_ratio = logprobs - old_logprobs
    seq_log_ratio = (token_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_ratio = (logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(
        max=GSPO_LOG_RATIO_MAX
    )
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(
        ratio, _per_token(advantages, logprobs), response_mask, clip_low, clip_high, dual_clip_c,
        agg_mode, norm_length, global_denominator, token_weights,
    )  # fmt: skip
    present = mask.sum(-1) > 0
    metrics["ppo_kl"] = masked_mean(-token_log_ratio, response_mask).detach()
    metrics["approx_kl"] = masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, response_mask).detach()
    metrics["seq_log_ratio_mean"] = masked_mean(seq_log_ratio, present).detach()
    return loss, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's logprobs.

    k1 (alias kl): logp - logp_ref            abs: |logp - logp_ref|
    k2 (alias mse): (logp - logp_ref)^2 / 2
    k3 (alias low_var_kl): exp(d) - d - 1 with d = logp_ref - logp, clamped to [-10, 10]
    """
    kind = KL_ALIASES.get(kind, kind)
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        d = (-diff).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.exp(d) - d - 1.0).clamp(-K3_LIMIT, K3_LIMIT)
    raise ValueError(f"kl type must be one of {sorted(KL_ALIASES)}, got {kind!r}")


KL_ALIASES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL to the reference policy as a loss term (multiply by the coefficient outside)."""
    kl = kl_penalty(logprobs, ref_logprobs, kind)
    loss = aggregate_loss(
        kl, response_mask, agg_mode, norm_length=norm_length, global_denominator=global_denominator
    )
    return loss, {"kl_loss": loss.detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last axis: ``logsumexp(z) - sum(softmax(z) * z)``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Aggregated entropy; the actor loss subtracts ``entropy_coef`` times it (a bonus)."""
    value = aggregate_loss(
        entropy, response_mask, agg_mode, norm_length=norm_length, global_denominator=global_denominator
    )
    return value, {"entropy": masked_mean(entropy, response_mask).detach()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO critic loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.

    Takes [batch, seq] or [batch] tensors (one value per step sample, mask [batch]).
    """
    if values.dim() == 1:
        values, old_values, returns, response_mask = (
            t.unsqueeze(-1) for t in (values, old_values, returns, response_mask)
        )
    unclipped = (values - returns).square()
    if clip_range is None:
        per_token, clipfrac = unclipped, torch.zeros((), dtype=values.dtype)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), response_mask)
    loss = 0.5 * aggregate_loss(
        per_token, response_mask, agg_mode, norm_length=norm_length, global_denominator=global_denominator
    )
    return loss, {
        "value_loss": loss.detach(),
        "value_clipfrac": clipfrac.detach(),
        "value_mean": masked_mean(values, response_mask).detach(),
    }


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, Metrics]]] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
}


def actor_loss(
    config: AlgorithmConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The policy loss the config names, plus ``kl_loss_coef * KL`` and ``- entropy_coef * H``."""
    try:
        policy_loss = POLICY_LOSSES[config.policy_loss]
    except KeyError:
        raise ValueError(
            f"policy_loss must be one of {sorted(POLICY_LOSSES)}, got {config.policy_loss!r}"
        ) from None
    agg = {
        "agg_mode": config.loss_agg_mode,
        "norm_length": config.loss_norm_length,
        "global_denominator": global_denominator,
    }
    weights, correction = None, {}
    if config.corrects_rollout:
        if rollout_logprobs is None:
            raise ValueError("the rollout correction (tis_cap or rollout_mask) needs rollout_logprobs")
        weights, correction = rollout_correction_weights(
            old_logprobs, rollout_logprobs, response_mask, tis_cap=config.tis_cap, tis_level=config.tis_level,
            mask=config.rollout_mask, mask_low=config.rollout_mask_low, mask_high=config.rollout_mask_high,
        )  # fmt: skip
    loss, metrics = policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        clip_low=config.clip_ratio_low,
        clip_high=config.clip_ratio_high,
        dual_clip_c=config.dual_clip_c,
        token_weights=weights,
        **agg,
    )
    metrics.update(correction)
    if config.kl_loss_active:
        if ref_logprobs is None:
            raise ValueError("the KL loss (use_kl_loss with kl_loss_coef > 0) needs ref_logprobs")
        kl, kl_metrics = kl_loss(logprobs, ref_logprobs, response_mask, kind=config.kl_loss_type, **agg)
        loss = loss + config.kl_loss_coef * kl
        metrics.update(kl_metrics)
    if entropy is not None:
        bonus, entropy_metrics = entropy_loss(entropy, response_mask, **agg)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * bonus
        metrics.update(entropy_metrics)
    metrics["actor_loss"] = loss.detach()
    return loss, metrics


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    advantages = torch.as_tensor(advantages, dtype=like.dtype, device=like.device)
    return advantages.unsqueeze(-1) if advantages.dim() == like.dim() - 1 else advantages


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
    agg_mode: str,
    norm_length: float | None,
    global_denominator: float | torch.Tensor | None,
    token_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    advantages = advantages.expand_as(ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    if dual_clip_c is not None:
        per_token = torch.where(negative, torch.minimum(per_token, -advantages * dual_clip_c), per_token)
    metrics: Metrics = {}
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = aggregate_loss(
        per_token, mask, agg_mode, norm_length=norm_length, global_denominator=global_denominator
    )
    with torch.no_grad():
        flags = ratio.dtype
        bool_mask = mask.to(torch.bool)
        metrics["pg_loss"] = loss.detach()
        metrics["clipfrac_high"] = masked_mean(((advantages > 0) & (ratio > 1.0 + clip_high)).to(flags), mask)
        metrics["clipfrac_low"] = masked_mean((negative & (ratio < 1.0 - clip_low)).to(flags), mask)
        if dual_clip_c is not None:
            metrics["clipfrac_dual"] = masked_mean((negative & (ratio > dual_clip_c)).to(flags), mask)
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        metrics["ratio_max"] = torch.where(bool_mask, ratio, -torch.inf).max()  # -inf: no masked token
        metrics["ratio_min"] = torch.where(bool_mask, ratio, torch.inf).min()
    return loss, metrics
