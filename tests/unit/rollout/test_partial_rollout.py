"""Partial rollouts (rollout/partial_rollout.py) against scripted engines that cut answers
the way a weight sync's abort does: what is sent again, what the joined answer holds, and
the asynchronous loop's samples when every request's first answer is cut."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from rollout.engine_responses import GenerateOutput
from rollout.episodes import Request
from rollout.partial_rollout import MAX_CONTINUATIONS, finished_answer, token_versions


class CuttingEngine:
    """Answers each request with `max_new_tokens` tokens counting on from its last prompt
    id, at the current `version`; the first `cuts` answers are cut after `cut_after` tokens
    ("abort"), and the version then moves on by one, as a weight sync would."""

    def __init__(self, cuts: int, cut_after: int = 2):
        self.cuts, self.cut_after, self.version = cuts, cut_after, 0
        self.sent: list[Request] = []

    def submit(self, request: Request) -> Future:
        self.sent.append(request)
        n = request.params["max_new_tokens"]
        cut = self.cuts > 0
        if cut:
            self.cuts -= 1
            n = min(n, self.cut_after)
        ids = [request.ids[-1] + 1 + k for k in range(n)]
        out = GenerateOutput(ids, [-0.1 * (self.version + 1)] * n, "abort" if cut else "stop", "", str(self.version),
                             "scripted")
        if cut:
            self.version += 1
        done = Future()
        done.set_result(out)
        return done


def _request(max_new_tokens: int = 7, seed: int | None = 11) -> Request:
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0}
    if seed is not None:
        params["sampling_seed"] = seed
    return Request([100, 101], params, "r0-s1-t0-step0", "r0-s1-t0")


def test_a_cut_answer_is_continued_and_each_token_keeps_its_version_and_logprob():
    engine = CuttingEngine(cuts=2, cut_after=2)
    out = finished_answer(engine.submit, _request(7), "continue")
    assert out.finish_reason == "stop"
    assert out.output_ids == list(range(102, 109))  # one answer of 7 tokens, as uncut
    assert token_versions(out) == ["0", "0", "1", "1", "2", "2", "2"]
    assert out.logprobs == pytest.approx([-0.1] * 2 + [-0.2] * 2 + [-0.3] * 3)
    assert out.weight_version == "2"
    # each continuation: the prompt and the tokens so far, the rest of the budget, new draws
    assert [r.ids for r in engine.sent] == [[100, 101], [100, 101, 102, 103], [100, 101, 102, 103, 104, 105]]
    assert [r.params["max_new_tokens"] for r in engine.sent] == [7, 5, 3]
    assert len({r.params["sampling_seed"] for r in engine.sent}) == 3
    assert [r.rid for r in engine.sent] == ["r0-s1-t0-step0", "r0-s1-t0-step0-c1", "r0-s1-t0-step0-c2"]
    assert {r.sticky_key for r in engine.sent} == {"r0-s1-t0"}  # the same engine (its prefix cache)


def test_restart_throws_the_cut_tokens_away():
    engine = CuttingEngine(cuts=1, cut_after=3)
    out = finished_answer(engine.submit, _request(5), "restart")
    assert out.output_ids == list(range(102, 107)) and token_versions(out) == ["1"] * 5
    assert [r.ids for r in engine.sent] == [[100, 101]] * 2


def test_a_cut_that_used_the_whole_budget_is_a_length_finish_and_an_endless_cut_stays_aborted():
    engine = CuttingEngine(cuts=1, cut_after=4)
    out = finished_answer(engine.submit, _request(4), "continue")
    assert out.finish_reason == "length" and len(engine.sent) == 1
    engine = CuttingEngine(cuts=10 ** 6, cut_after=1)
    out = finished_answer(engine.submit, _request(10 ** 3, seed=None), "continue")
    assert out.finish_reason == "abort" and len(engine.sent) == MAX_CONTINUATIONS + 1
    assert "sampling_seed" not in engine.sent[-1].params


def test_an_engine_error_reaches_the_caller_and_a_bad_setting_is_refused():
    def failing(request):
        f = Future()
        f.set_exception(RuntimeError("engine gone"))
        return f

    with pytest.raises(RuntimeError, match="engine gone"):
        finished_answer(failing, _request(), "continue")
    with pytest.raises(ValueError, match="in_flight_update='keep'"):
        finished_answer(failing, _request(), "keep")


class CutOnceEngine:
    """The asynchronous loop's engine API: every request's answer is tokens 5, 6, 7, ... by
    position; its first sending is cut after one token at version "0", the rest come at "1"."""

    def __init__(self):
        self.prompt_length: dict[str, int] = {}

    def submit(self, ids, params, *, rid=None, sticky_key=None):
        base = rid.split("-c")[0]
        first = base not in self.prompt_length
        if first:
            self.prompt_length[base] = len(ids)
        start = len(ids) - self.prompt_length[base]  # the answer's tokens already given
        n = 1 if first else params["max_new_tokens"]
        tokens = [5 + (start + k) % 7 for k in range(n)]
        done = Future()
        done.set_result(GenerateOutput(tokens, [-0.5] * n, "abort" if first else "length", "", "0" if first else "1",
                                       "scripted"))
        return done


def test_the_asynchronous_loop_continues_every_cut_answer():
    from envs import EnvManager
    from megatron_agent.models.tiny import build_tokenizer
    from rollout.agent_loop import AgentLoopConfig, run_rollout
    from rollout.prompts import PromptConfig
    from rollout.sampling import SamplingConfig

    config = AgentLoopConfig(max_steps=3, prompt=PromptConfig(history_length=1),
                             sampling=SamplingConfig(max_new_tokens=3, seed=1))
    engine = CutOnceEngine()
    with EnvManager("numberline", {"render_image": False}, num_groups=2, group_size=2, backend="inline") as envs:
        result = run_rollout(envs, engine, build_tokenizer("words"), config, [3, 4])
    assert result.samples and len(engine.prompt_length) == len(result.samples)  # one request each, cut once
    for s in result.samples:
        assert s.response_ids == [5, 6, 7] and s.token_versions == ["0", "1", "1"]
        assert s.finish_reason == "length" and s.weight_version == "1"
