"""The embedded engine as a colocated engine: its memory released while the trainer would
train (generation and weight loads refused, the state reported), resumed, and the new
weights handed over as shared-memory tensor handles (`/update_weights_from_tensor`, one
entry per rank: the engine runs as two ranks, so each rank must load its own)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from megatron_agent.weight_sync.tensor_sync import send_tensor_bucket
from rollout.engine_client import EngineClient, EngineError, http_json
from rollout.engine_launch import launch_engines, stop_engines

from .test_weight_update import PARAMS, assert_same, prompts, reference


@pytest.fixture(scope="module")
def engine(old_dir, tmp_path_factory):
    started = launch_engines(old_dir, 1, ranks=2, log_dir=tmp_path_factory.mktemp("logs"))
    yield started[0]
    stop_engines(started)


def released(url: str) -> list[str]:
    status, info = http_json("GET", url + "/model_info", timeout_s=30)
    assert status == 200
    return info["memory_released"]


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_release_refuses_generation_then_resume_and_tensor_update_serve_the_new_weights(engine, old_dir, new_dir,
                                                                                        flattened):
    client = EngineClient([engine.url], max_attempts=1)
    ps = prompts(old_dir)
    try:
        client.post_all("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert released(engine.url) == ["kv_cache", "weights"]
        with pytest.raises(EngineError, match=r"HTTP 400.*memory is released \(kv_cache, weights\)"):
            client.generate(ps, PARAMS)
        weights = list(AutoModelForCausalLM.from_pretrained(new_dir).state_dict().items())
        client.begin_weight_update()
        with pytest.raises(EngineError, match="resume_memory_occupation"):  # nowhere to load them yet
            send_tensor_bucket(client, weights, {engine.url: 2}, weight_version="w1", flattened=flattened)

        client.post_all("/resume_memory_occupation", {"tags": ["weights"]})
        assert released(engine.url) == ["kv_cache"]
        send_tensor_bucket(client, weights, {engine.url: 2}, weight_version="w1", flattened=flattened)
        client.end_weight_update()
        client.post_all("/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert released(engine.url) == []

        outs = client.generate(ps * 2, PARAMS * 2)  # 4 prompts over 2 ranks: both ranks serve
        assert {o.weight_version for o in outs} == {"w1"}
        assert_same(outs, reference(new_dir, ps) * 2)
        status, sums = http_json("POST", engine.url + "/weights_checksum",
                                 {"names": [n for n, _ in weights], "per_rank": True}, timeout_s=60)
        assert status == 200 and sums["rank_checksums"][0] == sums["rank_checksums"][1]
    finally:
        http_json("POST", engine.url + "/update_weights_from_disk", {"model_path": str(old_dir)}, timeout_s=60)
        client.close()


def test_release_needs_an_idle_engine_and_known_tags(engine):
    status, answer = http_json("POST", engine.url + "/release_memory_occupation", {"tags": ["gpu_cache"]},
                               timeout_s=30)
    assert status == 400 and "unknown memory tags ['gpu_cache']" in answer["message"]
    assert released(engine.url) == []
