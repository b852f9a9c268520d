"""The agent loop on real envs with embedded engine processes and a tiny random model."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import EnvManager, validation_seed
from megatron_agent.samples import step_columns
from rollout.agent_loop import AgentLoopConfig, ValidationConfig, run_rollout, run_validation
from rollout.engine_launch import EngineConfig, start_engines, stop_engines
from rollout.prompts import PromptConfig
from rollout.sampling import SamplingConfig


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    """Two embedded engines started the way the driver starts them."""
    c, started = start_engines(EngineConfig(num_engines=2), model_dir, log_dir=tmp_path_factory.mktemp("logs"))
    assert len(started) == 2 and c.urls == [e.url for e in started]
    yield c
    c.close()
    stop_engines(started)


def config(**over) -> AgentLoopConfig:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=over.pop("max_new_tokens", 12), seed=7)
    return AgentLoopConfig(max_steps=over.pop("max_steps", 15), sampling=sampling,
                           prompt=PromptConfig(history_length=2, max_prompt_tokens=over.pop("max_prompt_tokens", 2048)),
                           **over)


def assert_logprobs_match_teacher_forcing(samples, hf_model, temperature):
    """Every sample's rollout logprobs equal a teacher-forced forward pass (fp32)."""
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = hf_model(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        if temperature > 0:
            logits = logits / temperature
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("env_name", ["sokoban", "numberline"])
def test_episodes_complete_and_logprobs_match_hf(env_name, client, tokenizer, hf_model):
    env_config = {"render_image": False} if env_name == "numberline" else None
    cfg = config(max_steps=15)
    with EnvManager(env_name, env_config, num_groups=2, group_size=3, backend="inline") as envs:
        result = run_rollout(envs, client, tokenizer, cfg, seeds=[11, 12])
    assert len(result.episodes) == 6
    for traj in result.episodes:
        assert traj, "every copy played at least one step"
        assert [s.step_index for s in traj] == list(range(len(traj)))
        assert traj[-1].done or len(traj) == cfg.max_steps
        assert not any(s.done for s in traj[:-1])
        assert len({s.traj_id for s in traj}) == 1 and len({s.group_id for s in traj}) == 1
        assert all(s.episode_return == pytest.approx(sum(x.reward for x in traj)) for s in traj)
    first_anchor = {t[0].group_id: t[0].anchor for t in result.episodes}
    assert all(t[0].anchor == first_anchor[t[0].group_id] for t in result.episodes)  # same seed, same start
    for s in result.samples:
        assert len(s.response_ids) == len(s.rollout_logprobs) > 0
        assert len(s.prompt_ids) <= cfg.prompt.max_prompt_tokens
    m = result.metrics
    for key in ("success_rate", "episode_length", "invalid_action_rate", f"success_rate/{env_name}",
                "episode_return", "overhead_share"):
        assert f"rollout/{key}" in m
    assert m["rollout/num_samples"] == len(result.samples)
    assert_logprobs_match_teacher_forcing(result.samples, hf_model, cfg.sampling.temperature)
    assert len(step_columns(result.samples).group_ids) == len(result.samples)


def test_prompts_hold_exactly_the_configured_history(client, tokenizer):
    cfg = config(max_steps=6)
    with EnvManager("sokoban", None, num_groups=1, group_size=2, backend="inline") as envs:
        result = run_rollout(envs, client, tokenizer, cfg, seeds=[3])
    for traj in result.episodes:
        for s in traj:
            text = tokenizer.decode(s.prompt_ids)
            user = text.split("<|im_start|>user\n", 1)[1]
            shown = [int(n) for n in re.findall(r"^\[Step (\d+)\]$", user, flags=re.M)]
            assert shown == list(range(max(0, s.step_index - 2), s.step_index))
            assert s.history_entries == len(shown) and not s.truncated_history
            for prev in traj[max(0, s.step_index - 2):s.step_index]:  # each shown step's obs and action
                assert f"[Step {prev.step_index}]\nObservation:\n{prev.anchor}\nAction: {prev.response_text}" in user
            assert user.split(f"Current observation (step {s.step_index}):\n", 1)[1].startswith(s.anchor)


def test_over_budget_prompts_drop_history_and_are_flagged(client, tokenizer):
    cfg = config(max_steps=4, max_prompt_tokens=450)
    with EnvManager("sokoban", None, num_groups=1, group_size=2, backend="inline") as envs:
        result = run_rollout(envs, client, tokenizer, cfg, seeds=[3])
    later = [s for s in result.samples if s.step_index >= 2]
    assert any(s.truncated_history for s in later)
    for s in result.samples:
        assert len(s.prompt_ids) <= 450
        assert s.truncated_history == (s.history_entries < min(s.step_index, 2))


class CountingEngine:
    def __init__(self, inner):
        self.inner, self.batch_sizes = inner, []

    def generate(self, input_ids, sampling_params, **kw):
        self.batch_sizes.append(len(input_ids))
        return self.inner.generate(input_ids, sampling_params, **kw)


def test_only_active_copies_generate(client, tokenizer):
    engine = CountingEngine(client)
    with EnvManager("numberline", {"render_image": False}, num_groups=2, group_size=4, backend="inline") as envs:
        result = run_rollout(envs, engine, tokenizer, config(max_steps=10, mode="lockstep"), seeds=[1, 2])
    lengths = np.array([len(t) for t in result.episodes])
    assert engine.batch_sizes == [int((lengths > t).sum()) for t in range(lengths.max())]


def test_async_and_lockstep_loops_give_the_same_samples(client, tokenizer):
    """The embedded engine in fp32 batches requests but its tokens do not depend on the
    batch (logprobs within ~1e-6): the asynchronous loop, on one manager or on two slots,
    returns the lock-step loop's samples, in (group, trajectory, step) order."""
    seeds = [21, 22, 23, 24]
    cfg = config(max_steps=5)
    with EnvManager("sokoban", None, num_groups=4, group_size=2, backend="inline") as envs:
        lockstep = run_rollout(envs, client, tokenizer, replace(cfg, mode="lockstep"), seeds)
        one = run_rollout(envs, client, tokenizer, replace(cfg, mode="async"), seeds)
    slots = [EnvManager("sokoban", None, num_groups=2, group_size=2, backend="process", num_workers=2)
             for _ in range(2)]
    try:
        overlapped = run_rollout(slots, client, tokenizer, replace(cfg, mode="async"), seeds)
    finally:
        for e in slots:
            e.close()
    key = lambda s: (s.group_id, s.traj_id, s.step_index)  # noqa: E731
    assert len(lockstep.samples) > 0
    for other in (one, overlapped):
        a, b = lockstep.samples, other.samples
        assert [key(s) for s in b] == sorted(key(s) for s in b) == [key(s) for s in a]
        for x, y in zip(a, b):
            assert (x.anchor, x.reward, x.done, x.episode_return) == (y.anchor, y.reward, y.done, y.episode_return)
            assert x.prompt_ids == y.prompt_ids and x.response_ids == y.response_ids
            np.testing.assert_allclose(x.rollout_logprobs, y.rollout_logprobs, atol=1e-5)
        assert [[s.traj_id for s in t] for t in other.episodes] == [[s.traj_id for s in t] for t in lockstep.episodes]
    other = run_rollout(EnvManager("sokoban", None, num_groups=4, group_size=2, backend="inline"), client,
                        tokenizer, cfg, seeds, rollout_index=1)
    assert [s.response_ids for s in other.samples] != [s.response_ids for s in lockstep.samples]


def test_validation_is_greedy_group_size_one_on_its_own_seeds(client, tokenizer, hf_model):
    cfg = config(max_steps=3, validation=ValidationConfig(num_episodes=3))
    runs = []
    for _ in range(2):
        with EnvManager("numberline", {"render_image": False}, num_groups=3, group_size=1, backend="inline") as envs:
            runs.append(run_validation(envs, client, tokenizer, cfg))
    first, second = runs
    assert [s.env_seed for s in first.samples if s.step_index == 0] == [validation_seed(i) for i in range(3)]
    assert [s.response_ids for s in first.samples] == [s.response_ids for s in second.samples]
    assert "val/success_rate" in first.metrics and "val/success_rate/numberline" in first.metrics
    assert_logprobs_match_teacher_forcing(first.samples, hf_model, temperature=0.0)
    with EnvManager("numberline", {"render_image": False}, num_groups=3, group_size=2, backend="inline") as envs:
        with pytest.raises(ValueError, match="group_size=1"):
            run_validation(envs, client, tokenizer, cfg)


def test_a_group_stream_plays_each_group_as_a_rollout_of_that_group_alone(client, tokenizer):
    """rollout/group_stream.py: 5 groups through 2 env groups, each played as soon as one
    ends; every group's samples equal `run_rollout`'s of that group (same seed, rollout
    index and group id), the batch-invariant engine answering in whatever order."""
    from rollout.group_stream import GroupStream, GroupTicket

    tickets = [GroupTicket(group_id=g, seed=31 + g, rollout_index=g // 2) for g in (0, 1, 2, 3, 7)]
    queue = list(tickets)
    cfg = config(max_steps=4)
    with EnvManager("sokoban", None, num_groups=2, group_size=2, backend="inline") as envs:
        stream = GroupStream(envs, client, tokenizer, cfg, lambda: queue.pop(0) if queue else None)
        stream.start()
        finished = stream.take(len(tickets), timeout_s=120)
        assert stream.stop() == []  # nothing was cut off
    assert sorted(f.ticket.group_id for f in finished) == [t.group_id for t in tickets]
    assert stream.clocks_since_last()["rollout/time_generate_s"] > 0
    key = lambda s: (s.group_id, s.traj_id, s.step_index)  # noqa: E731
    for f in finished:
        t = f.ticket
        with EnvManager("sokoban", None, num_groups=1, group_size=2, backend="inline") as alone:
            expected = run_rollout(alone, client, tokenizer, cfg, [t.seed], rollout_index=t.rollout_index,
                                   first_group=t.group_id)
        assert [key(s) for s in f.samples] == [key(s) for s in expected.samples]
        for x, y in zip(f.samples, expected.samples):
            assert (x.anchor, x.reward, x.done, x.episode_return) == (y.anchor, y.reward, y.done, y.episode_return)
            assert x.response_ids == y.response_ids and x.prompt_ids == y.prompt_ids
        assert sum(f.version_tokens.values()) == sum(len(s.response_ids) for s in f.samples)
