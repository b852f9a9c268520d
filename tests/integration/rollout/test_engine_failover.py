"""Killing one of two engine processes mid-batch: the rollout completes on the other,
nothing is lost (the re-sent requests give what they would have), the event is logged;
with no engine left the error says so."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from transformers import AutoTokenizer

from envs import EnvManager
from rollout.agent_loop import AgentLoopConfig, run_rollout
from rollout.engine_client import EngineClient, NoEngineLeft
from rollout.engine_launch import launch_engines, stop_engines
from rollout.prompts import PromptConfig
from rollout.sampling import SamplingConfig

SEEDS = [31, 32, 33, 34]


def rollout(client, tokenizer, mode="lockstep"):
    cfg = AgentLoopConfig(max_steps=6, mode=mode, prompt=PromptConfig(history_length=1),
                          sampling=SamplingConfig(temperature=1.0, max_new_tokens=64, seed=3))
    with EnvManager("sokoban", None, num_groups=4, group_size=2, backend="inline") as envs:
        return run_rollout(envs, client, tokenizer, cfg, SEEDS)


@pytest.mark.parametrize("mode", ["lockstep", "async"])
def test_killed_engine_mid_batch_loses_nothing(mode, tiny_model_dir, tmp_path, caplog):
    model_dir = tiny_model_dir("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engines = launch_engines(model_dir, 2, log_dir=tmp_path)
    try:
        victim, survivor = engines
        expected = rollout(EngineClient([survivor.url]), tokenizer, mode)  # what the batch must come to

        client = EngineClient([victim.url, survivor.url])
        done = {}
        worker = threading.Thread(target=lambda: done.setdefault("result", rollout(client, tokenizer, mode)))
        with caplog.at_level(logging.WARNING, logger="rollout.engine_client"):
            worker.start()
            while not client.load[victim.url] and worker.is_alive():  # until the victim holds requests
                time.sleep(0.002)
            time.sleep(0.05)
            victim.kill()
            worker.join(120)
        assert not worker.is_alive()
        got = done["result"]
        assert client.alive == [survivor.url] and [u for u, _ in client.dead_events] == [victim.url]
        assert any(victim.url in r.getMessage() and "marked dead" in r.getMessage() for r in caplog.records)
        key = lambda s: (s.traj_id, s.step_index)  # noqa: E731
        a, b = sorted(got.samples, key=key), sorted(expected.samples, key=key)
        assert [key(s) for s in a] == [key(s) for s in b]
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert got.metrics["rollout/num_episodes"] == 8

        survivor.kill()
        with pytest.raises(NoEngineLeft, match="no rollout engine left"):
            client.generate([[1, 2, 3]], {"max_new_tokens": 2})
    finally:
        stop_engines(engines)
