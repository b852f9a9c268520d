"""Run-time checks that catch silent errors early: served vs trained.

Each iteration's episodes are generated on the weights the last sync sent, which are
the weights the actor holds before this iteration's update; so the logprobs the engine
reported and the ones the actor recomputes for the same tokens must agree up to
numerics. A large gap on the first iteration means a weight-mapping or precision bug (a
wrong bridge rule, a different temperature, bf16 against fp32); a gap that appears
later means a weight sync that reported success but did not land (e.g. on some of an
engine's ranks). Either would otherwise only show up as a policy that does not learn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The mean |served - trained| logprob a healthy run stays under, by the actor's
# parameter dtype: fp32 on both sides agrees to ~1e-6; bf16 kernels differ by ~1e-2.
DEFAULT_MEAN_BOUND = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
# ...and by the weights the engines serve (weight_sync.quantize), whatever the actor's
# dtype: block-FP8 rollout weights measured a mean gap of 1.6e-3 to 4.7e-3 on the CPU job
# (fp32 actor; max per token 2.2e-2), so 10x that (docs/training.md).
QUANTIZED_MEAN_BOUND = {"fp8": 5e-2}


@dataclass
class LogprobCheckConfig:
    """The served-vs-trained check (RunConfig.check)."""

    every: int = 1  # iterations between checks (0: never); the run's first iteration is always one
    max_samples: int = 64  # step samples recomputed per check (evenly spaced over the batch)
    # Fail the run when the mean |served - trained| logprob is above this (None: by the
    # actor's params_dtype, DEFAULT_MEAN_BOUND); with fail=False it is only reported.
    max_mean_abs_diff: float | None = None
    fail: bool = True

    def validate(self) -> None:
        if self.every < 0 or self.max_samples < 1:
            raise ValueError(f"every={self.every} must be >= 0 and max_samples={self.max_samples} >= 1")
        if self.max_mean_abs_diff is not None and not self.max_mean_abs_diff > 0:
            raise ValueError(f"max_mean_abs_diff={self.max_mean_abs_diff} must be > 0 (or null)")

    def due(self, iteration: int, first_iteration: int) -> bool:
        return self.every > 0 and (iteration == first_iteration or iteration % self.every == 0)

    def bound(self, params_dtype: str, quantize: str | None = None) -> float:
        if self.max_mean_abs_diff is not None:
            return self.max_mean_abs_diff
        return QUANTIZED_MEAN_BOUND[quantize] if quantize else DEFAULT_MEAN_BOUND[params_dtype]


def check_sample_indices(batch_size: int, max_samples: int) -> list[int]:
    """At most `max_samples` indices spread evenly over the batch, first and last included."""
    if batch_size <= max_samples:
        return list(range(batch_size))
    if max_samples == 1:
        return [0]
    return sorted({round(k * (batch_size - 1) / (max_samples - 1)) for k in range(max_samples)})


class LogprobMismatchError(RuntimeError):
    """The trainer and the rollout engine disagree on the same weights."""


def rollout_logprob_gap(actor_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                        response_mask: torch.Tensor, *, over_data_parallel: bool = False) -> dict[str, float]:
    """Max and mean |actor - rollout| logprob over response tokens (with
    `over_data_parallel`: over every DP rank's tokens; collective)."""
    diff = (actor_logprobs.double() - rollout_logprobs.double())[response_mask.bool()].abs()
    sums = torch.tensor([float(diff.sum()), float(diff.numel())], dtype=torch.float64)
    worst = torch.tensor([float(diff.max()) if diff.numel() else 0.0], dtype=torch.float64)
    if over_data_parallel:
        sums, worst = _over_data_parallel(sums, "sum"), _over_data_parallel(worst, "max")
    return {"check/rollout_logprob_max_abs_diff": float(worst),
            "check/rollout_logprob_mean_abs_diff": float(sums[0] / sums[1]) if sums[1] else 0.0}


def mismatch_by_turn(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                     step_index: torch.Tensor, dropped: torch.Tensor | None = None,
                     routing: torch.Tensor | None = None, *, over_data_parallel: bool = False) -> dict[str, float]:
    """Engine against trainer per step of the episode (collective with `over_data_parallel`).

    For the response tokens of the samples at step k, with r = exp(old - rollout):
    `mismatch/turn_k/kl_k3`, the mean of r - 1 - log r (KL(engine || trainer) estimated on the
    engine's samples); `mismatch/turn_k/max_abs_diff`, the largest |old - rollout|; and, given
    `dropped` (the tokens a rollout mask drops), `mismatch/turn_k/masked_fraction`; given
    `routing` (per sample: MoE decisions where the trainer's own top-k differs from the
    engine's, decisions; RoutingWatch), `mismatch/turn_k/routing_disagreement`. Then
    `mismatch/kl_k3` (and `mismatch/routing_disagreement`) over all steps. Steps no sample
    reached are left out.
    """
    on = response_mask.bool()
    log_r = (old_logprobs.double() - rollout_logprobs.double()).masked_fill(~on, 0.0)
    k3 = torch.expm1(log_r) - log_r
    turns = int(step_index.max()) + 1 if step_index.numel() else 0
    if over_data_parallel:
        turns = int(_over_data_parallel(torch.tensor([turns], dtype=torch.float64), "max")[0])
    steps = step_index.long()
    sums = torch.zeros(turns, 5, dtype=torch.float64)  # k3, tokens, dropped tokens, routing differ, decisions
    sums[:, 0].index_add_(0, steps, k3.sum(-1))
    sums[:, 1].index_add_(0, steps, on.sum(-1).double())
    if dropped is not None:
        sums[:, 2].index_add_(0, steps, (dropped.bool() & on).sum(-1).double())
    if routing is not None:
        sums[:, 3:].index_add_(0, steps, routing.double())
    worst = torch.zeros(turns, dtype=torch.float64)
    per_sample = log_r.abs().amax(-1) if log_r.numel() else torch.zeros(len(steps), dtype=torch.float64)
    for k in steps.unique().tolist():
        worst[k] = per_sample[steps == k].max()
    if over_data_parallel:
        sums, worst = _over_data_parallel(sums, "sum"), _over_data_parallel(worst, "max")
    out = {}
    for k in range(turns):
        if sums[k, 1] == 0:
            continue
        out[f"mismatch/turn_{k}/kl_k3"] = float(sums[k, 0] / sums[k, 1])
        out[f"mismatch/turn_{k}/max_abs_diff"] = float(worst[k])
        if dropped is not None:
            out[f"mismatch/turn_{k}/masked_fraction"] = float(sums[k, 2] / sums[k, 1])
        if routing is not None and sums[k, 4] > 0:
            out[f"mismatch/turn_{k}/routing_disagreement"] = float(sums[k, 3] / sums[k, 4])
    if sums[:, 1].sum() > 0:
        out["mismatch/kl_k3"] = float(sums[:, 0].sum() / sums[:, 1].sum())
    if routing is not None and sums[:, 4].sum() > 0:
        out["mismatch/routing_disagreement"] = float(sums[:, 3].sum() / sums[:, 4].sum())
    return out


def _over_data_parallel(values: torch.Tensor, op: str) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_agent.platform.collectives import all_reduce

    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        all_reduce(values, ps.get_data_parallel_group(),
                   op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return values


def check_rollout_logprobs(gap: dict[str, float], max_abs_diff: float | None = None, *,
                           max_mean_abs_diff: float | None = None, when: str = "") -> None:
    """Raise when the gap's max or mean is over its bound (None: that one is not checked)."""
    worst, mean = gap["check/rollout_logprob_max_abs_diff"], gap["check/rollout_logprob_mean_abs_diff"]
    over = []
    if max_abs_diff is not None and worst > max_abs_diff:
        over.append(f"bound {max_abs_diff:g}")
    if max_mean_abs_diff is not None and mean > max_mean_abs_diff:
        over.append(f"mean bound {max_mean_abs_diff:g}")
    if over:
        raise LogprobMismatchError(
            f"the actor's recomputed logprobs differ from the rollout engine's by up to {worst:.3g} "
            f"(mean {mean:.3g}; {', '.join(over)}) on the same weights{when}: check the weight mapping, "
            "the sampling temperature, the dtypes of both sides, and that every engine rank received the "
            "last weight sync"
        )


def served_vs_trained(actor, batch, config: LogprobCheckConfig, params_dtype: str, iteration: int, *,
                      quantize: str | None = None) -> dict:
    """Recompute the logprobs of some of the batch's samples with the actor (collective:
    every rank calls it; none when `batch.old_logprobs`, the actor's on the served
    weights, are there already) and compare them with what the engines reported; raise
    LogprobMismatchError past the bound (config.fail), return the gap as metrics.
    `quantize`: the engines' weights (weight_sync.quantize), which sets the default bound."""
    picked = set(check_sample_indices(batch.whole_batch_size(), config.max_samples))
    sample = batch.select([k for k, i in enumerate(batch.positions().tolist()) if i in picked])
    recomputed = (sample.old_logprobs if sample.old_logprobs is not None
                  else actor.compute_logprobs(sample, with_entropy=False)["logprobs"])
    gap = rollout_logprob_gap(recomputed, sample.rollout_logprobs, sample.response_mask,
                              over_data_parallel=sample.is_shard)
    if config.fail:
        check_rollout_logprobs(gap, max_mean_abs_diff=config.bound(params_dtype, quantize),
                               when=f" (iteration {iteration}, served weights version {iteration})")
    return gap


def batch_rollout_gap(batch, prefix: str) -> dict[str, float]:
    """`rollout_logprob_gap` of `batch.old_logprobs` (the actor's, before this update) over
    every sample of the batch (every DP rank's: collective), as `<prefix>rollout_logprob_*`."""
    gap = rollout_logprob_gap(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask,
                              over_data_parallel=batch.is_shard)
    return {prefix + key.removeprefix("check/"): value for key, value in gap.items()}


def batch_mismatch_by_turn(batch, algorithm, routing: torch.Tensor | None = None) -> dict[str, float]:
    """`mismatch_by_turn` of `batch.old_logprobs` against the engines' over the whole batch
    (collective), with the tokens `algorithm.rollout_mask` drops and the `routing` counts."""
    from megatron_agent.algorithms.losses import rollout_correction_weights

    dropped = None
    if algorithm.rollout_mask != "none":
        kept, _ = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask,
                                             mask=algorithm.rollout_mask, mask_low=algorithm.rollout_mask_low,
                                             mask_high=algorithm.rollout_mask_high)
        dropped = kept == 0
    return mismatch_by_turn(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, batch.step_index,
                            dropped, routing, over_data_parallel=batch.is_shard)
