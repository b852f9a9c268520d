"""Weight updates through SGLang's protocol against an embedded engine process, the
token check off localhost, and pause / continue."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_agent.platform.distributed import free_port
from megatron_agent.weight_sync import send_weights
from rollout.embedded_engine import Engine
from rollout.engine_client import EngineClient, EngineError
from rollout.engine_launch import launch_engines, stop_engines
from rollout.weight_group import destroy_weight_update_group, init_weight_update_group


@pytest.fixture(scope="module")
def engine(old_dir, tmp_path_factory):
    started = launch_engines(old_dir, 1, log_dir=tmp_path_factory.mktemp("logs"))
    yield started[0]
    stop_engines(started)


def prompts(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ("you are an agent", "move left right up")]


PARAMS = [{"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True},
          {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 5}]


def reference(model_dir, ps):
    """What an engine started on `model_dir` generates (in process, same code)."""
    ref = Engine(str(model_dir))
    from rollout.engine_server import generate

    return generate(ref, {"input_ids": ps, "sampling_params": PARAMS, "return_logprob": True})


def assert_same(outs, expected):
    for o, e in zip(outs, expected):
        assert o.output_ids == e["output_ids"]
        torch.testing.assert_close(torch.tensor(o.logprobs),
                                   torch.tensor([lp for lp, _, _ in e["meta_info"]["output_token_logprobs"]]),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_update_over_gloo_group_switches_to_the_new_weights_exactly(engine, old_dir, new_dir, flattened):
    client = EngineClient([engine.url])
    ps = prompts(old_dir)
    old_ref, new_ref = reference(old_dir, ps), reference(new_dir, ps)
    assert old_ref[0]["output_ids"] != new_ref[0]["output_ids"]
    assert_same(client.generate(ps, PARAMS), old_ref)

    port = free_port()
    pending, world_size = client.init_weights_update_group("127.0.0.1", port, "wu", backend="gloo")
    pg = init_weight_update_group("127.0.0.1", port, 0, world_size, "wu", "gloo", timeout_s=60)
    pending.result(timeout=60)
    try:
        with pytest.raises(EngineError, match="400"):  # outside begin/end
            client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[1]], "wu").result()
        client.pause_generation("abort")
        client.begin_weight_update()
        new = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
        named = list(new.state_dict().items())
        half = len(named) // 2  # two buckets, as a trainer sends them
        send_weights(client, pg, named[:half], "wu", flattened=flattened)
        send_weights(client, pg, named[half:], "wu", weight_version="v1", flattened=flattened)
        client.end_weight_update()
        client.flush_cache()
        client.continue_generation()
        outs = client.generate(ps, PARAMS)
        assert_same(outs, new_ref)
        assert {o.weight_version for o in outs} == {"v1"}
        assert client.model_info()[0]["weight_version"] == "v1"

        client.begin_weight_update()  # and back, so the module's engine is as it started
        old = AutoModelForCausalLM.from_pretrained(old_dir, dtype=torch.float32)
        send_weights(client, pg, list(old.state_dict().items()), "wu", weight_version="v0", flattened=flattened)
        client.end_weight_update()
        assert_same(client.generate(ps, PARAMS), old_ref)
    finally:
        client.destroy_weights_update_group("wu")
        destroy_weight_update_group(pg)
        client.close()


def test_pause_abort_ends_inflight_work_and_holds_new_work_until_continue(engine, old_dir):
    client = EngineClient([engine.url])
    p = prompts(old_dir)[0]
    long = {"temperature": 0.0, "max_new_tokens": 1500, "ignore_eos": True}
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("long", client.generate([p], long)[0]))
    t.start()
    time.sleep(0.5)
    client.pause_generation("abort")
    t.join(30)
    assert box["long"].finish_reason == "abort" and len(box["long"].output_ids) < 1500
    held = threading.Thread(target=lambda: box.setdefault("held", client.generate([p], PARAMS[0])[0]))
    held.start()
    held.join(0.5)
    assert held.is_alive(), "a request sent while paused waits for continue"
    client.continue_generation()
    held.join(30)
    assert box["held"].finish_reason == "length" and len(box["held"].output_ids) == 10
    client.close()


def test_off_localhost_weight_calls_need_the_token(old_dir, tmp_path):
    started = launch_engines(old_dir, 1, host="0.0.0.0", token="run-token", log_dir=tmp_path)
    try:
        url = started[0].url
        anonymous = EngineClient([url], auth_token="")
        with pytest.raises(EngineError, match="401"):
            anonymous.begin_weight_update()
        with pytest.raises(EngineError, match="401"):
            anonymous.update_weights_from_distributed(["x"], ["float32"], [[1]], "wu").result()
        assert anonymous.generate([[5, 6]], PARAMS[0])[0].output_ids  # generation is open
        wrong = EngineClient([url], auth_token="guess")
        with pytest.raises(EngineError, match="401"):
            wrong.pause_generation()
        owner = EngineClient([url], auth_token="run-token")
        owner.begin_weight_update()
        owner.end_weight_update()
    finally:
        stop_engines(started)
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_AGENT_ENGINE_TOKEN"}
    refused = subprocess.run([sys.executable, "-m", "rollout.engine_server", "--model", str(old_dir),
                              "--host", "0.0.0.0", "--port", str(free_port())],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "needs a token" in refused.stderr
