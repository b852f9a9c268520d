"""From the agent loop's step samples to what the trainer learns from.

    samples, metrics, episodes = collect_samples(config, envs, client, tokenizer, iteration)
    columns = step_columns(samples)        # the estimators' StepSamples (numpy columns)
    batch = train_batch(samples, pad_id, temperature)   # the actor's TrainBatch (tokens)
    policy_staleness(samples, actor.step)  # updates between the generating weights and the trainer's

`collect_samples` runs the agent loop once, or (DAPO dynamic sampling) until enough
groups with a learning signal are found.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_agent.algorithms import StepSamples, enough_groups, filter_zero_variance_groups


def rollout_seeds(config, iteration: int, attempt: int = 0) -> list[int]:
    """One env seed per group; dynamic sampling's extra rollouts (attempt > 0) get fresh ones."""
    tries = config.algorithm.dynamic_sampling_max_tries if config.algorithm.dynamic_sampling else 1
    first = config.seed * 1_000_003 + (iteration * tries + attempt) * config.num_groups
    return [first + g for g in range(config.num_groups)]


def collect_samples(config, envs, client, tokenizer, iteration: int, *, image_processor=None, on_progress=None):
    """Roll out `num_groups` groups (more with dynamic sampling: groups whose episodes all
    scored the same are dropped and new ones rolled, numbered after the earlier ones,
    until the batch is full or the tries run out); return the kept step samples, the
    first rollout's episode metrics and its episodes. `image_processor`: a vision-language
    model's (rollout/vision.py), None for a text model. `on_progress`: the agent loop's
    (run_rollout), for each rollout."""
    from rollout.agent_loop import run_rollout

    kept, metrics, episodes, tries, dropped = [], None, None, 0, 0
    while True:
        rollout = run_rollout(envs, client, tokenizer, config.loop, rollout_seeds(config, iteration, tries),
                              rollout_index=iteration, first_group=tries * config.num_groups,
                              image_processor=image_processor, on_progress=on_progress)
        if metrics is None:
            metrics, episodes = rollout.metrics, rollout.episodes
        tries += 1
        if not config.algorithm.dynamic_sampling:
            kept = rollout.samples
            break
        scores = np.array([s.episode_return for s in rollout.samples])
        keep = filter_zero_variance_groups(scores, [s.group_id for s in rollout.samples])
        dropped += keep.num_dropped
        kept += [s for s, k in zip(rollout.samples, keep.keep) if k]
        groups = sorted({s.group_id for s in kept})
        if enough_groups(len(groups), config.num_groups, tries, config.algorithm.dynamic_sampling_max_tries):
            chosen = set(groups[:config.num_groups])
            kept = [s for s in kept if s.group_id in chosen]
            break
    if config.algorithm.dynamic_sampling:
        metrics = {**metrics, "rollout/dynamic_sampling_tries": float(tries),
                   "rollout/dynamic_sampling_dropped_groups": float(dropped),
                   "rollout/dynamic_sampling_kept_groups": float(len({s.group_id for s in kept}))}
        if not kept:
            raise RuntimeError(f"dynamic sampling: every group of {tries} rollouts had equal episode scores; "
                               "nothing to train on (raise algorithm.dynamic_sampling_max_tries)")
    return kept, metrics, episodes


def policy_staleness(samples: Sequence, trainer_version: int) -> float:
    """How many updates the weights that generated the samples are behind the trainer's
    (the mean over samples; the engines' initial "default" weights are version 0)."""
    versions = [int(s.weight_version) if str(s.weight_version).isdigit() else 0 for s in samples]
    return float(trainer_version - np.mean(versions)) if versions else 0.0


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


def train_batch(samples: Sequence, pad_id: int, temperature: float):
    """Token ids, response masks and rollout logprobs of the step samples, and their
    prompts' images (`pixel_values`, `image_grid_thw`) when they have any (advantages are
    set once the critic, if any, has valued them)."""
    from megatron_agent.training.batch import TrainBatch

    images = [None if s.pixel_values is None else (s.pixel_values, s.image_grid_thw) for s in samples]
    return TrainBatch.from_sequences([list(s.prompt_ids) for s in samples], [list(s.response_ids) for s in samples],
                                     pad_id=pad_id, rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
                                     temperature=temperature, images=images)


def estimate_advantages(samples: Sequence, algorithm, values=None):
    """The configured estimator over the step samples (`values`: the critic's, for GAE)."""
    import dataclasses

    from megatron_agent.algorithms import compute_advantages

    columns = step_columns(samples)
    if values is not None:
        columns = dataclasses.replace(columns, values=values.numpy())
    return compute_advantages(columns, algorithm)
