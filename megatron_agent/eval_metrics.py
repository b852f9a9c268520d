"""What `megatron-agent eval` reports of the episodes it played: pass@k and the per-model
metrics (pure functions; the command is megatron_agent/evaluate.py).

    pass_at_k(n=4, c=1, k=2)                  # 0.5: one of four samples won
    model_metrics(summaries, num_samples=4)   # the rollout metrics, pass@1..4, tokens

pass@k is the chance that at least one of k samples drawn without replacement from a
task's n samples won, c of the n having won: 1 - C(n-c, k) / C(n, k), the unbiased
estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
section 2.1), computed as their product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never
forms the binomial coefficients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with `c` wins among `n` samples (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"{c} wins among {n} samples")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} of {n} samples: k must be in [1, {n}]")
    if n - c < k:  # every draw of k holds a win
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float | None:
    """pass@k averaged over tasks, given each task's (samples n, wins c); tasks with fewer
    than k samples (some failed: the env copy broke) are left out; None when none is left."""
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return float(np.mean(values)) if values else None


@dataclass(frozen=True)
class TaskResult:
    """One task (env seed) of an evaluation: its samples and how many won."""

    seed: int
    task_type: str
    samples: int  # episodes that did not fail
    wins: int
    failed: int  # episodes whose env copy broke (not the policy's doing: not counted)


def task_results(summaries: Sequence, seeds: Sequence[int], num_samples: int) -> list[TaskResult]:
    """Per task, from the episodes' summaries (rollout.agent_loop.EpisodeSummary) in (task,
    sample) order, `num_samples` per task."""
    if len(summaries) != len(seeds) * num_samples:
        raise ValueError(f"{len(summaries)} episodes for {len(seeds)} tasks x {num_samples} samples")
    results = []
    for t, seed in enumerate(seeds):
        group = summaries[t * num_samples:(t + 1) * num_samples]
        good = [e for e in group if e.steps and not e.failed]
        types = [e.task_type for e in group if e.task_type]
        results.append(TaskResult(seed=int(seed), task_type=types[0] if types else "", samples=len(good),
                                  wins=sum(bool(e.won) for e in good), failed=len(group) - len(good)))
    return results


def model_metrics(summaries: Sequence, seeds: Sequence[int], num_samples: int) -> dict[str, float]:
    """The training loop's rollout metrics of these episodes (rollout.agent_loop.summary_metrics:
    success_rate, success_rate/<task type>, episode_length, invalid_action_rate, prompt_length and
    response_length per step), pass@k for k = 1..num_samples, and the tokens in all."""
    from rollout.agent_loop import summary_metrics

    metrics = summary_metrics(list(summaries), prefix="")
    counts = [(t.samples, t.wins) for t in task_results(summaries, seeds, num_samples)]
    for k in range(1, num_samples + 1):
        value = mean_pass_at_k(counts, k)
        if value is not None:
            metrics[f"pass@{k}"] = value
    good = [e for e in summaries if e.steps and not e.failed]
    metrics["prompt_tokens"] = float(sum(e.prompt_tokens for e in good))
    metrics["response_tokens"] = float(sum(e.response_tokens for e in good))
    metrics["num_tasks"] = float(len(seeds))
    return metrics
