"""The agent loop's progress counts (rollout/progress.py) against what the rollout returns
and what a scripted engine holds at a known moment."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from envs import EnvManager
from rollout.agent_loop import AgentLoopConfig, run_rollout
from rollout.engine_client import GenerateOutput
from rollout.prompts import PromptConfig
from rollout.sampling import SamplingConfig

COPIES = 4  # 2 groups x 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))


class HoldingEngine:
    """Answers "+" (one request per call, from the loop's threads, or one batch call), but
    holds the first COPIES requests until all of them are in: at that moment every copy's
    first request is in flight and none answered, and the engine notes what the progress
    said then."""

    def __init__(self, tokenizer, latest):
        self.ids = tokenizer.encode(" +", add_special_tokens=False)
        self.latest, self.seen_when_all_held = latest, None
        self.barrier = threading.Barrier(COPIES, action=self._all_held)
        self.calls, self.lock = 0, threading.Lock()

    def _all_held(self):
        self.seen_when_all_held = self.latest[-1]

    def generate(self, input_ids, sampling_params, *, rids=None, sticky_keys=None):
        with self.lock:
            self.calls += 1
            call = self.calls
        if len(input_ids) == COPIES:  # the lock-step loop: its first call holds them all
            if call == 1:
                self._all_held()
        elif call <= COPIES:
            self.barrier.wait(timeout=30)
        return [GenerateOutput(list(self.ids), [-0.5] * len(self.ids), "stop", "+", "0", "scripted")
                for _ in input_ids]


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_progress_counts_episodes_steps_and_requests_in_flight(tokenizer, mode):
    states = []
    engine = HoldingEngine(tokenizer, states)
    config = AgentLoopConfig(max_steps=6, mode=mode, sampling=SamplingConfig(max_new_tokens=2),
                             prompt=PromptConfig(memory="none", include_instructions=False))
    env_config = {"render_image": False, "action_format": "bare", "max_position": 5}
    with EnvManager("numberline", env_config, num_groups=2, group_size=2, backend="inline") as envs:
        result = run_rollout(envs, engine, tokenizer, config, seeds=[3, 8], on_progress=states.append)

    assert engine.seen_when_all_held.requests_in_flight == COPIES  # the engine held all four, unanswered
    assert engine.seen_when_all_held.steps_done == 0 and engine.seen_when_all_held.episodes_done == 0
    last = states[-1]
    assert last.episodes == last.episodes_done == COPIES
    assert last.steps_done == len(result.samples) == sum(len(t) for t in result.episodes) > COPIES
    assert last.requests_in_flight == 0
    for before, after in zip(states, states[1:]):
        assert after.steps_done >= before.steps_done and after.episodes_done >= before.episodes_done
    # one request at most per episode still going
    assert all(0 <= s.requests_in_flight <= s.episodes - s.episodes_done for s in states)
