"""The seeds of a rollout and the estimators' view of its step samples.

    seeds = rollout_seeds(config, iteration, attempt)   # one env seed per group
    columns = step_columns(samples)                     # the estimators' StepSamples (numpy columns)

The rollout workers (rollout_worker.py) roll out with these seeds and compute their
groups' advantages from these columns; worker_batches.py makes the trainer's batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_agent.algorithms import StepSamples


def rollout_seeds(config, iteration: int, attempt: int = 0) -> list[int]:
    """One env seed per group; dynamic sampling's extra rollouts (attempt > 0) get fresh ones."""
    tries = config.algorithm.dynamic_sampling_max_tries if config.algorithm.dynamic_sampling else 1
    first = config.seed * 1_000_003 + (iteration * tries + attempt) * config.num_groups
    return [first + g for g in range(config.num_groups)]


def step_columns(samples: Sequence) -> StepSamples:
    """The estimators' columns of a list of rollout.samples.StepSample."""
    anchors = np.empty(len(samples), dtype=object)
    anchors[:] = [s.anchor for s in samples]
    return StepSamples(
        group_ids=np.array([s.group_id for s in samples], dtype=np.int64),
        traj_ids=np.array([s.traj_id for s in samples], dtype=np.int64),
        step_index=np.array([s.step_index for s in samples], dtype=np.int64),
        rewards=np.array([s.reward for s in samples], dtype=np.float64),
        episode_scores=np.array([s.episode_return for s in samples], dtype=np.float64),
        anchors=anchors,
        is_action_valid=np.array([s.is_action_valid for s in samples], dtype=bool),
        is_padding=np.zeros(len(samples), dtype=bool),
    )
