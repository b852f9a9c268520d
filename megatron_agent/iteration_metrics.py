"""One iteration's metrics row: seconds per phase, throughput, and the training figures.

    timer = PhaseTimer()
    with timer.phase("rollout"):
        ...
    row = iteration_row(iteration, timer, rollout_metrics, metrics, ...)
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    """Seconds per named phase of one iteration, as `time/<phase>` keys."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{name}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def moving_average(values: list[float], window: int = 3) -> float:
    tail = values[-window:]
    return sum(tail) / len(tail)


def iteration_row(iteration: int, timer: PhaseTimer, rollout_metrics: dict, metrics: dict, *, tokens: float,
                  elapsed: float, successes: list[float], restarts: int) -> dict:
    """The row of metrics.jsonl. `rollout_metrics` are the agent loop's (rollout/...: they
    become train/...; its clocks become time/generate, time/env and the overhead share);
    `metrics` the update's, critic's, weight sync's and validation's."""
    rollout_metrics = dict(rollout_metrics)
    iteration_seconds = timer.elapsed()
    timing = dict(timer.seconds)
    timing["time/other"] = iteration_seconds - sum(timing.values())
    # parts of time/rollout (its rest: prompts, tokenizing, the loop itself)
    timing["time/generate"] = rollout_metrics.pop("rollout/time_generate_s")
    timing["time/env"] = rollout_metrics.pop("rollout/time_env_s")
    rollout_metrics.pop("rollout/time_s")  # time/rollout
    overhead = rollout_metrics.pop("rollout/overhead_share")
    timing["time/iteration"] = iteration_seconds
    return {"iteration": iteration, "time/elapsed": elapsed,
            **{k.replace("rollout/", "train/", 1): v for k, v in rollout_metrics.items()},
            **metrics, **timing, "train/success_moving_average": moving_average(successes),
            "perf/tokens_per_s": tokens / iteration_seconds,
            "perf/update_tokens_per_s": tokens / timing["time/update"],
            "perf/rollout_overhead_share": overhead,
            "engine/restarts": restarts}
