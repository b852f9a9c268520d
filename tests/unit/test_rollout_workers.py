"""The driver's rollout collection with dynamic sampling, against a scripted engine whose
groups are informative or not by construction."""

from __future__ import annotations

import re

import pytest

from envs import EnvManager
from megatron_agent.algorithms import compute_advantages
from megatron_agent.models.tiny import build_tokenizer
from megatron_agent.run_config import load_run_config
from megatron_agent.samples import collect_samples, rollout_seeds, step_columns
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


def _collect(config, iteration=0):
    envs = EnvManager(config.env, config.env_config, num_groups=config.num_groups, group_size=config.group_size,
                      backend="inline")
    try:
        return collect_samples(config, envs, ScriptedEngine(build_tokenizer("words")), build_tokenizer("words"), iteration)
    finally:
        envs.close()


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
