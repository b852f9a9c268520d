"""The embedded engine as several weight-update ranks (`--ranks 2`, rollout/engine_ranks.py):
both ranks join the group and receive every broadcast, generation uses both, a rank that
missed an update is caught, and a group counted one rank per server is refused."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_agent.platform.distributed import free_port
from megatron_agent.weight_sync import send_weights
from rollout.embedded_engine import BadRequest, Engine, SamplingParams
from rollout.engine_client import EngineClient, http_json
from rollout.engine_launch import launch_engines, stop_engines
from rollout.engine_ranks import RankedEngine, RanksDisagree
from rollout.engine_server import ROUTES, generate
from rollout.weight_group import destroy_weight_update_group, init_weight_update_group, weight_checksum

PARAMS = [{"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
          {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 5},
          {"temperature": 0.7, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 6},
          {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 7}]


@pytest.fixture(scope="module")
def server(old_dir, tmp_path_factory):
    started = launch_engines(old_dir, 1, ranks=2, log_dir=tmp_path_factory.mktemp("logs"))
    yield started[0]
    stop_engines(started)


@pytest.fixture(scope="module")
def local(old_dir):
    """A 2-rank engine in this process (rank 1 in a process of its own)."""
    torch.set_num_threads(1)
    engine = RankedEngine(str(old_dir), ranks=2, threads=1)
    yield engine
    engine.close()


def prompts(model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t, add_special_tokens=False)["input_ids"] for t in
            ("you are an agent", "move left right up", "position 5 target 3", "the box is on the goal")]


def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def teacher_forced(hf, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def max_gap(hf, ps, params, outs) -> list[float]:
    """Per output: the largest |engine logprob - teacher-forced logprob under `hf`|."""
    gaps = []
    for p, sp, o in zip(ps, params, outs):
        lps = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        gaps.append(float((lps - teacher_forced(hf, p, o["output_ids"], sp["temperature"])).abs().max()))
    return gaps


def http_generate(url: str, ps, params) -> list[dict]:
    status, outs = http_json("POST", url + "/generate", {"input_ids": ps, "sampling_params": params,
                                                         "return_logprob": True}, timeout_s=120)
    assert status == 200, outs
    return outs


def test_server_info_reports_the_ranks_as_tp_size(server):
    status, info = http_json("GET", server.url + "/get_server_info")
    assert status == 200 and info["tp_size"] == 2 and info["pp_size"] == 1
    assert info["weight_version"] == "default" and Path(info["model_path"]).exists()


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_both_ranks_join_a_group_of_three_receive_the_update_and_generate_with_it(server, old_dir, new_dir, flattened):
    ps = prompts(old_dir)
    new = model(new_dir)
    names = [n for n, _ in new.state_dict().items()]
    port = free_port()
    joined: dict = {}
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": "wu", "backend": "gloo", "timeout_s": 60}
    joiner = threading.Thread(target=lambda: joined.update(
        answer=http_json("POST", server.url + "/init_weights_update_group", body, timeout_s=90)))
    joiner.start()
    pg = init_weight_update_group("127.0.0.1", port, 0, 3, "wu", "gloo", timeout_s=60)  # the trainer: rank 0
    joiner.join(90)
    assert joined["answer"][0] == 200, joined
    client = EngineClient([server.url])
    try:
        client.pause_generation("abort")
        client.begin_weight_update()
        named = list(new.state_dict().items())
        half = len(named) // 2  # two buckets; every broadcast reaches both engine ranks
        send_weights(client, pg, named[:half], "wu", flattened=flattened, timeout_s=60)
        send_weights(client, pg, named[half:], "wu", weight_version="v1", flattened=flattened, timeout_s=60)
        client.end_weight_update()
        client.continue_generation()

        status, answer = http_json("POST", server.url + "/weights_checksum", {"names": names, "per_rank": True})
        assert status == 200 and len(answer["rank_checksums"]) == 2
        expected = {n: weight_checksum(t) for n, t in new.state_dict().items()}
        for sums in answer["rank_checksums"]:
            assert all(abs(sums[n] - v) <= 1e-9 * max(1.0, abs(v)) for n, v in expected.items())
        assert http_json("POST", server.url + "/weights_checksum", {"names": names})[0] == 200

        outs = http_generate(server.url, ps, PARAMS)
        assert sorted({o["meta_info"]["engine_rank"] for o in outs}) == [0, 1]
        assert {o["meta_info"]["weight_version"] for o in outs} == {"v1"}
        assert max(max_gap(new, ps, PARAMS, outs)) < 1e-4

        client.begin_weight_update()  # and back, so the module's engine is as it started
        old = model(old_dir)
        send_weights(client, pg, list(old.state_dict().items()), "wu", weight_version="v0", flattened=flattened,
                     timeout_s=60)
        client.end_weight_update()
        outs = http_generate(server.url, ps, PARAMS)
        assert sorted({o["meta_info"]["engine_rank"] for o in outs}) == [0, 1]
        assert max(max_gap(old, ps, PARAMS, outs)) < 1e-4
    finally:
        client.destroy_weights_update_group("wu")
        destroy_weight_update_group(pg)
        client.close()


def test_a_group_counting_one_rank_per_server_is_refused_at_once(server):
    """The trainer's old count (world 1 + servers) leaves no room for rank 1: a 400 that
    says so, not a half-joined group."""
    start = time.monotonic()
    status, answer = http_json("POST", server.url + "/init_weights_update_group",
                               {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                                "world_size": 2, "group_name": "too-small", "backend": "gloo"})
    assert status == 400 and "2 ranks" in answer["message"] and "tp_size" in answer["message"], answer
    assert time.monotonic() - start < 10


def test_a_request_gives_the_same_result_on_either_rank(local, old_dir):
    p, q = prompts(old_dir)[:2]
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, sampling_seed=11, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)]
    for sp in params:
        first = local.generate([p, q], [sp, sp], ["a", "b"])
        second = local.generate([q, p], [sp, sp], ["c", "d"])[::-1]  # swapped: each prompt meets the other rank
        assert {first[0].rank, first[1].rank} == {0, 1}
        for a, b in zip(first, second):
            assert a.rank != b.rank and a.output_ids == b.output_ids and a.logprobs == b.logprobs


def test_both_ranks_serve_an_adapter_by_name(local, old_dir, tmp_path):
    """A PEFT adapter loaded from a directory and by tensor handles (one entry per rank):
    the prompts dealt to both ranks get `peft`'s logprobs (1e-5); unloaded everywhere."""
    from safetensors.torch import load_file

    from tests.unit.rollout.test_engine_lora import Handles, _peft_model

    reference = _peft_model(str(old_dir), tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    config = {"r": 4, "lora_alpha": 8}
    local.load_lora_adapter("dir", str(tmp_path / "adapter"))
    shared = Handles()  # the memory the handles point to, alive until the ranks copied it
    local.load_lora_adapter_from_tensors("handles", config, [shared(tensors)] * 2)
    ps = prompts(old_dir)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    for name in ("dir", "handles"):
        outs = local.generate(ps, [greedy] * 4, [f"{name}{i}" for i in range(4)], adapters=[name] * 4)
        assert {o.rank for o in outs} == {0, 1}
        for p, o in zip(ps, outs):
            expected = teacher_forced(reference, p, o.output_ids, 0.0)
            assert float((torch.tensor(o.logprobs) - expected).abs().max()) < 1e-5, (name, o.rank)
    for name in ("dir", "handles"):
        local.unload_lora_adapter(name)
    with pytest.raises(BadRequest, match="names no loaded LoRA adapter"):
        local.generate(ps[:2], [greedy] * 2, ["x", "y"], adapters=["dir"] * 2)


def test_a_rank_that_missed_an_update_is_caught(local, old_dir, new_dir):
    ps = prompts(old_dir)
    new, old = model(new_dir), model(old_dir)
    names = list(new.state_dict())
    Engine.load_weights(local, list(new.state_dict().items()))  # rank 0 only: a half-landed update
    try:
        per_rank = ROUTES[("POST", "/weights_checksum")](local, {"names": names, "per_rank": True})["rank_checksums"]
        assert per_rank[0] != per_rank[1]
        with pytest.raises(RanksDisagree, match="rank 1"):  # the server answers 500 with this
            ROUTES[("POST", "/weights_checksum")](local, {"names": names})
        outs = generate(local, {"input_ids": ps, "sampling_params": PARAMS, "return_logprob": True})
        gaps = max_gap(new, ps, PARAMS, outs)
        by_rank = {r: [g for g, o in zip(gaps, outs) if o["meta_info"]["engine_rank"] == r] for r in (0, 1)}
        assert by_rank[0] and max(by_rank[0]) < 1e-4  # rank 0 has the new weights
        assert by_rank[1] and min(by_rank[1]) > 1e-2  # rank 1's outputs give it away
    finally:
        local.load_weights(list(old.state_dict().items()))  # every rank
    assert local.weight_checksums(names[:3]) == local.rank_weight_checksums(names[:3])[1]


def _rank_processes(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_dead_rank_takes_its_server_down(old_dir, tmp_path):
    engine = launch_engines(old_dir, 1, ranks=2, log_dir=tmp_path)[0]
    try:
        ranks = _rank_processes(engine.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        engine.proc.wait(30)  # as an SGLang server exits when a TP worker dies
        assert engine.proc.returncode != 0
        assert "engine rank 1 exited" in engine.log_path.read_text()
    finally:
        stop_engines([engine])
