"""Step samples to what the trainer learns from: the estimators' columns and the
actor's training batch (as a rollout worker sends it), worked by hand."""

from __future__ import annotations

import numpy as np
import torch

from megatron_agent.algorithms import AlgorithmConfig, compute_advantages
from megatron_agent.run_config import RunConfig
from megatron_agent.samples import rollout_seeds, step_columns
from megatron_agent.worker_batches import batch_from_shards, compact_shard
from tests.unit.rollout.test_samples import sample


def batch():
    return [sample(0, 0, 0, 0.0, 1.0, anchor="a"), sample(0, 0, 1, 1.0, 1.0, won=True, anchor="b"),
            sample(0, 1, 0, 0.0, 0.0, anchor="a", valid=False), sample(1, 2, 0, 0.5, 0.5, anchor="c")]


def test_step_columns_are_the_estimators_columns():
    s = step_columns(batch())
    np.testing.assert_array_equal(s.group_ids, [0, 0, 0, 1])
    np.testing.assert_array_equal(s.traj_ids, [0, 0, 1, 2])
    np.testing.assert_array_equal(s.step_index, [0, 1, 0, 0])
    np.testing.assert_array_equal(s.episode_scores, [1.0, 1.0, 0.0, 0.5])
    assert list(s.anchors) == ["a", "b", "a", "c"] and s.anchors.dtype == object
    np.testing.assert_array_equal(s.is_action_valid, [True, True, False, True])
    assert not s.is_padding.any()
    for estimator in ("gigpo", "grpo"):
        config = AlgorithmConfig(advantage_estimator=estimator)
        adv = compute_advantages(s, config).advantages
        assert adv.shape == (4,) and np.isfinite(adv).all()


def test_train_batch_puts_rollout_logprobs_on_the_response_tokens_targets():
    # prompts [1] and [1, 2], responses [7, 8]: the target of position t is token t+1
    t = train_batch(batch(), temperature=0.5)
    assert t.tokens.shape == (4, 4) and t.temperature == 0.5
    assert t.tokens[0].tolist() == [1, 7, 8, 0] and t.tokens[1].tolist() == [1, 2, 7, 8]
    assert t.response_mask[0].tolist() == [1, 1, 0] and t.response_mask[1].tolist() == [0, 1, 1]
    assert torch.allclose(t.rollout_logprobs[0], torch.tensor([-0.5, -0.25, 0.0]))
    assert t.lengths.tolist() == [3, 4, 3, 3]


def test_rollout_seeds_are_fresh_per_iteration_and_per_dynamic_sampling_try():
    plain = RunConfig(num_groups=3, seed=2)
    assert rollout_seeds(plain, 0) == [2_000_006, 2_000_007, 2_000_008]
    assert rollout_seeds(plain, 1) == [2_000_009, 2_000_010, 2_000_011]
    dapo = RunConfig(num_groups=3, seed=2)
    dapo.algorithm.dynamic_sampling, dapo.algorithm.dynamic_sampling_max_tries = True, 4
    seen = [s for it in range(2) for attempt in range(4) for s in rollout_seeds(dapo, it, attempt)]
    assert len(set(seen)) == len(seen) == 24


def train_batch(samples, temperature: float = 1.0):
    """One worker's shard of `samples`, as the batch of one DP rank."""
    return batch_from_shards([compact_shard(samples)], np.arange(len(samples)), np.arange(len(samples)), len(samples),
                             pad_id=0, temperature=temperature)
