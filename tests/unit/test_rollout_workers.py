"""Rollout workers (megatron_agent/rollout_workers.py), in this process: the coordinator's
rules (groups per worker, the whole batch's order, DP assignment by tokens), dynamic sampling
against a scripted engine whose groups are informative or not by construction, and the
batch and advantages of W workers against one worker's on the same episodes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from envs import EnvManager
from megatron_agent.algorithms import compute_advantages
from megatron_agent.models.tiny import build_tokenizer
from megatron_agent.rollout_worker import RolloutWorker, worker_groups
from megatron_agent.rollout_workers import RolloutWorkers, whole_order
from megatron_agent.run_config import load_run_config
from megatron_agent.samples import rollout_seeds, step_columns
from megatron_agent.training.batch import TrainBatch
from megatron_agent.worker_batches import assign_by_tokens, batch_from_shards, shard_order
from rollout.engine_client import GenerateOutput


class ScriptedEngine:
    """Groups with an even env seed: every copy answers "+" (identical episodes, no signal).
    Odd seeds: even trajectories answer "+", odd ones "-" (different returns)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, input_ids, sampling_params, *, rids=None, sticky_keys=None):
        outputs = []
        for key in sticky_keys:
            seed, traj = map(int, re.fullmatch(r"r\d+-s(\d+)-t(\d+)", key).groups())
            text = "+" if seed % 2 == 0 or traj % 2 == 0 else "-"
            ids = self.tokenizer.encode(" " + text, add_special_tokens=False)
            outputs.append(GenerateOutput(ids, [-0.5] * len(ids), "stop", text, "0", "scripted"))
        return outputs


def _config(*overrides):
    return load_run_config(["algorithm=dapo", "num_groups=4", "group_size=2", "loop.max_steps=3",
                            "env_config.max_steps=3", *overrides])


def _workers(config, workers: int = 1) -> RolloutWorkers:
    config.rollout.workers = workers
    tokenizer = build_tokenizer("words")

    def make(k):
        envs = EnvManager(config.env, config.env_config, num_groups=len(worker_groups(config.num_groups, workers)[k]),
                          group_size=config.group_size, backend="inline")
        return RolloutWorker(config, k, None, envs=envs, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer))

    return RolloutWorkers(config, None, make_worker=make)


def _collect(config, iteration=0, workers: int = 1):
    """(the kept samples in whole-batch order, the metrics, the first episodes) as the driver sees them."""
    pool = _workers(config, workers)
    try:
        collected = pool.collect(iteration, ["unused"], keep_episodes=10_000)
        held = [h.samples(iteration) for h in pool.handles]
        return [held[k][r] for k, r in collected.sources], collected.metrics, collected.episodes
    finally:
        pool.close()


def test_groups_without_signal_are_replaced_until_the_batch_is_full():
    config = _config()
    samples, metrics, _ = _collect(config)
    seeds = [s for attempt in range(config.algorithm.dynamic_sampling_max_tries)
             for s in rollout_seeds(config, 0, attempt)]
    informative = [s for s in seeds if s % 2]
    # Groups are kept in the order they were rolled: the first 4 odd seeds, tries in order.
    tries_needed = seeds.index(informative[config.num_groups - 1]) // config.num_groups + 1
    assert metrics["rollout/dynamic_sampling_tries"] == tries_needed
    assert metrics["rollout/dynamic_sampling_kept_groups"] == config.num_groups
    assert metrics["rollout/dynamic_sampling_dropped_groups"] == sum(
        1 for s in seeds[:tries_needed * config.num_groups] if s % 2 == 0)
    assert len({s.group_id for s in samples}) == config.num_groups
    # Each try's groups are numbered after the earlier tries' (the seeds list is in that order too).
    assert all(s.env_seed == seeds[s.group_id] for s in samples)
    assert all(s.traj_id // config.group_size == s.group_id for s in samples)
    # A dropped group's samples would all get a zero GRPO advantage; every kept one has a signal.
    advantages = compute_advantages(step_columns(samples), config.algorithm).advantages
    assert bool((advantages != 0).all())


def test_no_informative_group_at_all_is_a_clear_error(monkeypatch):
    config = _config("algorithm.dynamic_sampling_max_tries=2")
    monkeypatch.setattr(ScriptedEngine, "generate", lambda self, input_ids, p, rids=None, sticky_keys=None: [
        GenerateOutput(self.tokenizer.encode(" +", add_special_tokens=False), [-0.5], "stop", "+", "0", "s")
        for _ in input_ids])
    with pytest.raises(RuntimeError, match="every group of 2 rollouts had equal episode scores"):
        _collect(config)


def test_without_dynamic_sampling_the_first_rollout_is_the_batch():
    config = _config("algorithm.dynamic_sampling=false")
    samples, metrics, episodes = _collect(config)
    assert "rollout/dynamic_sampling_tries" not in metrics
    assert len(episodes) == config.num_groups * config.group_size
    assert len(samples) == sum(len(e) for e in episodes)


def test_workers_own_contiguous_whole_groups():
    for groups, workers in ((16, 1), (16, 3), (5, 5), (7, 2)):
        ranges = worker_groups(groups, workers)
        assert [g for r in ranges for g in r] == list(range(groups))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_the_whole_batch_is_ordered_by_group_as_one_process_orders_it():
    # dynamic sampling: worker 0 kept groups 0 and 16 (a second try), worker 1 kept 2, 3 and 18
    order = whole_order([np.array([0, 0, 16]), np.array([2, 3, 3, 18])])
    assert order.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2], [0, 2], [1, 3]]


def test_samples_go_to_the_rank_with_the_fewest_tokens_longest_first():
    # position 1 (9 tokens) -> rank 0; 3 (7) -> rank 1; 0 (5) -> rank 1 (7 < 9); 2 (3) -> rank 0 (9 < 12)
    assert [p.tolist() for p in assign_by_tokens([5, 9, 3, 7], 2)] == [[1, 2], [0, 3]]
    assert [p.tolist() for p in assign_by_tokens([4, 4, 4], 1)] == [[0, 1, 2]]


ESTIMATORS = ("gigpo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_w_workers_give_one_workers_batch_and_advantages(estimator):
    """The same episodes rolled out by 1, 2 and 3 workers: each DP rank's batch (tokens,
    masks, logprobs, places) and advantages are the same, and one worker's advantages are
    the single-process estimator's over the whole batch (batch-wide whitening included)."""
    config = _config(f"algorithm.advantage_estimator={estimator}", "algorithm.dynamic_sampling=false",
                     "num_groups=5", "group_size=3", "algorithm.invalid_action_penalty=0.1")
    shards, diagnostics = {}, {}
    for workers in (1, 2, 3):
        pool = _workers(config, workers)
        try:
            collected = pool.collect(0, ["unused"])
            diagnostics[workers] = {k: v for k, v in collected.metrics.items() if k.startswith("gigpo/")}
            positions = assign_by_tokens(collected.lengths, 2)
            shards[workers] = [batch_from_shards(pool.fetch(0, collected.sources[p], collected.moments),
                                                 shard_order(collected.sources[p]), p, collected.size, pad_id=0,
                                                 temperature=1.0) for p in positions]
            if workers == 1:
                held = pool.handles[0].samples(0)
                whole = [held[r] for _, r in collected.sources]
                reference = compute_advantages(step_columns(whole), config.algorithm).advantages
        finally:
            pool.close()
    for rank in range(2):
        one = shards[1][rank]
        np.testing.assert_allclose(one.advantages.numpy(), reference[one.sample_index.numpy()], rtol=1e-6,
                                   atol=1e-6)
        for workers in (2, 3):
            other = shards[workers][rank]
            for name in ("tokens", "response_mask", "rollout_logprobs", "lengths", "sample_index"):
                assert torch.equal(getattr(one, name), getattr(other, name)), name
            np.testing.assert_allclose(other.advantages.numpy(), one.advantages.numpy(), rtol=1e-6, atol=1e-6)
    assert np.abs(reference).sum() > 0  # the episodes differ: the advantages are not all 0
    # GiGPO's diagnostics: the workers' sums give the one-worker figures
    assert bool(diagnostics[1]) == (estimator == "gigpo")
    for workers in (2, 3):
        assert diagnostics[workers] == pytest.approx(diagnostics[1], rel=1e-12)


def test_gae_advantages_follow_the_critic_values_to_the_workers():
    config = _config("algorithm=ppo", "algorithm.dynamic_sampling=false", "num_groups=3", "group_size=2")
    results = {}
    for workers in (1, 3):
        pool = _workers(config, workers)
        try:
            collected = pool.collect(0, ["unused"])
            values = np.linspace(-1, 1, collected.size)  # in whole-batch order, as the trainer gathers them
            results[workers] = pool.gae_advantages(collected, values)
            if workers == 1:
                held = pool.handles[0].samples(0)
                columns = step_columns([held[r] for _, r in collected.sources])
                columns.values = values
                reference = compute_advantages(columns, config.algorithm)
        finally:
            pool.close()
    for workers in (1, 3):
        np.testing.assert_allclose(results[workers][0], reference.advantages, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(results[workers][1], reference.returns, rtol=1e-12, atol=1e-12)


def test_a_ranks_batch_from_shards_is_the_batch_of_its_samples():
    """Two workers' compact shards -> the TrainBatch that TrainBatch.from_sequences makes of
    the same samples in whole-batch order."""
    shards = [
        {"prompt_lengths": np.array([2, 1], np.int32), "response_lengths": np.array([1, 2], np.int32),
         "tokens": np.array([1, 2, 3, 4, 5, 6], np.int32), "logprobs": np.array([-.1, -.2, -.3], np.float32),
         "images": [None, None], "step_index": np.array([0, 3], np.int32), "advantages": np.array([1.0, 2.0], np.float32)},
        {"prompt_lengths": np.array([3], np.int32), "response_lengths": np.array([1], np.int32),
         "tokens": np.array([7, 8, 9, 10], np.int32), "logprobs": np.array([-.4], np.float32),
         "images": [None], "step_index": np.array([1], np.int32), "advantages": np.array([3.0], np.float32)},
    ]
    sources = np.array([[1, 0], [0, 0], [0, 1]])  # whole positions 4, 5, 9 of a batch of 12
    batch = batch_from_shards(shards, shard_order(sources), np.array([4, 5, 9]), 12, pad_id=0, temperature=0.5)
    reference = TrainBatch.from_sequences([[7, 8, 9], [1, 2], [4]], [[10], [3], [5, 6]], pad_id=0,
                                          rollout_logprobs=[[-.4], [-.1], [-.2, -.3]], temperature=0.5)
    for name in ("tokens", "response_mask", "rollout_logprobs", "lengths"):
        assert torch.allclose(getattr(batch, name).float(), getattr(reference, name).float()), name
    assert batch.advantages.tolist() == [3.0, 1.0, 2.0]
    assert batch.step_index.tolist() == [1, 0, 3]
    assert batch.sample_index.tolist() == [4, 5, 9] and batch.whole_size == 12
