"""The real SGLang server (0.5.23, on CPU, from its own venv) against the project.

- greedy generation: logprobs equal transformers' teacher-forced ones (1e-5), through the
  client and through the agent loop;
- `WeightSync` from a Megatron actor (one gloo rank), per tensor and flattened buckets:
  the server's logprobs then equal the actor's (1e-4); again with `--tp-size 2`, where
  both TP ranks must join the update group and load the weights;
- three iterations of the CPU main job with `engine.urls` naming the server, then again
  colocated (memory released and resumed each iteration, weights as tensor handles);
- a LoRA actor's adapter-only sync (`weight_sync.lora=adapters`; from a directory and by
  tensor handles): the server serves each version's adapter, named by the client, with
  the actor's logprobs (1e-5), at TP 1 and TP 2; the one two versions back is unloaded.

The server runs from `.venv-sglang` (`make test` installs it: docs/testing.md) or the
Python named by MEGATRON_AGENT_SGLANG_PYTHON. Without one these tests fail under CI=true
and are skipped elsewhere, with the reason. One server runs at a time: TP1 for the first
tests, then TP2. They share one xdist group, so `-n 2` keeps them on one worker with their
servers. The servers run with `--sleep-on-idle`: without it an idle SGLang scheduler polls
a core (15 s of CPU in 15 s idle, TP1 or TP2; 0.2-0.5 s with it), half of a 2-core
machine, for as long as the server lives, while the tests train, compare and start ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks
from rollout.engine_client import EngineClient, http_json
from rollout.engine_launch import (
    SGLANG_CPU_VENV,
    SGLANG_PYTHON_ENV,
    sglang_cpu_python,
    start_sglang_cpu_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang_cpu")]

START_TIMEOUT_S = 600  # TP2 takes ~55 s to answer /health on an idle 2-core machine; more under load
# LoRA serving on CPU: its torch_native backend, with pinned host memory dropped
# (tools/sglang_cpu/sitecustomize.py); requests without an adapter run on the base as before.
LORA_RANK = 8
SERVER_ARGS = ("--sleep-on-idle", "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--lora-target-modules",
               "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "--lora-backend", "torch_native")


@pytest.fixture(scope="module")
def sglang_python() -> str:
    python = sglang_cpu_python()
    if python is None or not Path(python).exists():
        missing = (f"{SGLANG_PYTHON_ENV}={python} does not exist" if python
                   else f"{SGLANG_CPU_VENV} is absent and {SGLANG_PYTHON_ENV} is unset")
        reason = (f"no SGLang venv: {missing} (`make test` installs it; "
                  f"`make {SGLANG_CPU_VENV.name}/.installed` alone)")
        pytest.fail(reason)
    return python


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The CPU main job's model (configs/model/tiny.yaml: 2-layer Qwen3, word-level tokenizer)."""
    from megatron_agent.models.tiny import write_tiny_model

    return write_tiny_model("qwen3", tmp_path_factory.mktemp("sglang-model") / "model", preset="tiny", seed=0,
                            tokenizer="words", num_hidden_layers=2)


class Servers:
    """One SGLang server at a time: asking for another TP size stops the running one."""

    def __init__(self, python: str, model_dir: Path, log_dir: Path):
        self.python, self.model_dir, self.log_dir = python, model_dir, log_dir
        self.tp, self.server = None, None

    def __call__(self, tp_size: int):
        if self.tp != tp_size:
            self.stop()
            self.server = start_sglang_cpu_server(self.model_dir, tp_size=tp_size, python=self.python,
                                                  extra_args=SERVER_ARGS,
                                                  log_dir=self.log_dir, timeout_s=START_TIMEOUT_S)
            self.tp = tp_size
        return self.server

    def stop(self):
        if self.server is not None:
            self.server.stop()
        self.tp, self.server = None, None


@pytest.fixture(scope="module")
def sglang(sglang_python, model_dir, tmp_path_factory):
    servers = Servers(sglang_python, model_dir, tmp_path_factory.mktemp("sglang-logs"))
    yield servers
    servers.stop()


def load_from_disk(server, model_dir) -> None:
    """Back to the weights on disk (an earlier test synced others)."""
    status, answer = http_json("POST", server.url + "/update_weights_from_disk", {"model_path": str(model_dir)},
                               timeout_s=120)
    assert status == 200 and answer["success"], answer


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_greedy_logprobs_equal_transformers(sglang, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import EnvManager
    from rollout.agent_loop import AgentLoopConfig, run_rollout
    from rollout.prompts import PromptConfig
    from rollout.sampling import SamplingConfig

    server = sglang(1)
    load_from_disk(server, model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = EngineClient([server.url])
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, len(tokenizer), (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
        outs = client.generate(prompts, {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
        for prompt, out in zip(prompts, outs):
            assert len(out.output_ids) == 12 and out.finish_reason == "length"
            expected = teacher_forced(hf, prompt, out.output_ids)
            torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
            with torch.no_grad():  # greedy: each token is transformers' argmax
                logits = hf(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1:-1]
            assert out.output_ids == logits.argmax(-1).tolist()

        # the agent loop on the CPU job's env, token ids in and out
        cfg = AgentLoopConfig(max_steps=3, prompt=PromptConfig(history_length=2),
                              sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, seed=None))
        with EnvManager("numberline", {"render_image": False, "max_position": 5}, num_groups=2, group_size=2,
                        backend="inline") as envs:
            result = run_rollout(envs, client, tokenizer, cfg, seeds=[1, 2])
        assert len(result.episodes) == 4 and result.samples
        for s in result.samples:
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs),
                                       teacher_forced(hf, s.prompt_ids, s.response_ids), atol=1e-5, rtol=0)
    finally:
        client.close()


def _sync_and_compare(model_dir: str, urls: list[str], versions: int = 4) -> dict:
    """On one gloo rank: move the actor's weights, sync them per tensor (version 1), then
    move them again and sync flattened buckets (version 2: the packed parameters' runs
    straight from memory, planned by version 1, q/k/v copied), then per tensor again, streamed
    from the layout the earlier syncs recorded (version 3), then flattened again (version 4);
    after each the server's greedy logprobs against the actor's recomputation. The first
    `versions` of those."""
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    client = EngineClient(urls)
    g = torch.Generator().manual_seed(1)
    vocab = 40  # inside the word-level tokenizer's vocabulary
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30], [7]]

    def engine_vs_actor() -> tuple[float, set[str]]:
        return _served_vs_trained(client, actor, prompts)

    sync = WeightSync(actor, urls, WeightSyncConfig(bucket_bytes=64 * 1024, timeout_s=120, in_place_min_bytes=1))
    out = {"server_ranks": client.server_ranks()}
    for version, flattened in [(1, False), (2, True), (3, False), (4, True)][:versions]:
        batch = TrainBatch.from_sequences([torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(4)],
                                          [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(4)],
                                          advantages=[1.0, -1.0, 0.5, 2.0])
        actor.update(batch)  # large lr: the weights move far from the server's
        stale, _ = engine_vs_actor()
        sync.config.flattened = flattened
        streamed = not flattened and sync.layout is not None
        metrics = sync.sync(version=version)
        diff, versions = engine_vs_actor()
        out[version] = {"stale": stale, "diff": diff, "versions": versions, "metrics": metrics,
                        "group": sync.group_name, "streamed": streamed}
    sync.close()  # the server outlives this trainer: leave no group behind
    client.close()
    return out


def _served_vs_trained(client, actor, prompts: list[list[int]]) -> tuple[float, set[str]]:
    """The server's greedy answers against the actor's recomputed logprobs: the largest
    difference, and the weight versions the answers name."""
    from megatron_agent.training.batch import TrainBatch

    outs = client.generate(prompts, {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    batch = TrainBatch.from_sequences(prompts, [o.output_ids for o in outs], rollout_logprobs=[o.logprobs for o in outs])
    recomputed = actor.compute_logprobs(batch, with_entropy=False)["logprobs"]
    return float((recomputed - batch.rollout_logprobs)[batch.response_mask.bool()].abs().max()), {
        o.weight_version for o in outs}


def _check_synced(out: dict, url: str, tp_size: int, versions: int = 4) -> None:
    assert out["server_ranks"] == {url: tp_size}
    assert [out[v]["streamed"] for v in range(1, versions + 1)] == [False, False, True, False][:versions]
    assert ([out[v]["metrics"]["weight_sync/bytes_in_place"] > 0 for v in range(1, versions + 1)]
            == [False, True, False, True][:versions])
    for version in range(1, versions + 1):
        result = out[version]
        assert result["stale"] > 1e-2, result  # the update moved the weights: the check can fail
        assert result["diff"] < 1e-4, result
        assert result["versions"] == {str(version)}
        assert result["metrics"]["weight_sync/bytes"] > 0 and result["metrics"]["weight_sync/buckets"] > 1
    assert len({out[v]["group"] for v in range(1, versions + 1)}) == 1  # later syncs reused the group


def test_weight_sync_per_tensor_and_flattened(sglang, model_dir):
    server = sglang(1)
    out = run_on_ranks(_sync_and_compare, 1, str(model_dir), [server.url], timeout_s=600)[0]
    _check_synced(out, server.url, 1)


def _train(overrides: list[str]) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    return train(load_run_config(overrides))


def test_cpu_main_job_against_sglang(sglang, model_dir, tmp_path):
    server = sglang(1)
    load_from_disk(server, model_dir)  # the driver's first check holds the served weights to the disk's
    history = run_on_ranks(_train, 1, [f"run_dir={tmp_path / 'run'}", f"model_dir={model_dir}",
                                       f"engine.urls=['{server.url}']", "num_groups=2", "group_size=2",
                                       "iterations=3", "loop.max_steps=3", "stop_success=null", "val_every=0",
                                       "save_every=0", "samples_every=0"], timeout_s=600)[0]
    assert [row["iteration"] for row in history] == [0, 1, 2]
    for row in history:
        assert row["weight_sync/bytes"] > 0
        for key in ("actor/pg_loss", "actor/grad_norm", "train/num_episodes"):
            assert math.isfinite(row[key]), key


def test_colocated_cpu_main_job_against_sglang(sglang, model_dir, tmp_path):
    """placement.colocate=true with the server as the colocated engine: every iteration
    asks it to release its memory after the rollout, resumes it and hands the weights over
    as shared-memory tensor handles (/update_weights_from_tensor); the next rollout then
    serves them. SGLang on CPU accepts the release and frees nothing (its memory saver is
    CUDA-only, and /server_info says it is off), so `engine/memory_released` is 0."""
    server = sglang(1)
    load_from_disk(server, model_dir)
    history = run_on_ranks(_train, 1, [f"run_dir={tmp_path / 'run'}", f"model_dir={model_dir}",
                                       f"engine.urls=['{server.url}']", "placement.colocate=true", "num_groups=2",
                                       "group_size=2", "iterations=3", "loop.max_steps=3", "stop_success=null",
                                       "val_every=0", "save_every=0", "samples_every=0", "check.every=1"],
                           timeout_s=600)[0]
    assert [row["iteration"] for row in history] == [0, 1, 2]
    for row in history:
        assert row["engine/memory_released"] == 0.0  # the release frees nothing on CPU (the calls are made)
        assert row["weight_sync/bytes"] > 0
        assert row["check/rollout_logprob_max_abs_diff"] < 1e-4, row


def _sync_adapters_and_compare(model_dir: str, urls: list[str], adapter_dir: str, versions: int = 3) -> dict:
    """On one gloo rank, a LoRA actor (every linear, rank LORA_RANK): sync its adapters as
    the driver does at the start (version 0, B zero: the base), then update it and sync its
    adapters alone (version 1 from a directory, 2 by tensor handles, 3 from a directory
    again), and after each compare the server's greedy logprobs, asked through a client
    that names the served version's adapter, with the actor's recomputation."""
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models.lora import LoraConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, use_distributed_optimizer=False,
                                                       lora=LoraConfig(rank=LORA_RANK, alpha=16)),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    client = EngineClient(urls, lora_adapters=True)
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30], [7]]

    def engine_vs_actor() -> tuple[float, set[str]]:
        return _served_vs_trained(client, actor, prompts)

    sync = WeightSync(actor, urls, WeightSyncConfig(lora="adapters", adapter_dir=adapter_dir, timeout_s=120))
    sync.sync(version=0)  # the server's version (an earlier test's) names no adapter of this run until then
    out = {"base": engine_vs_actor()}
    for version in range(1, versions + 1):
        for _ in range(2):  # B starts at zero: the second update is the first to move A
            batch = TrainBatch.from_sequences([torch.randint(0, 40, (6,), generator=g).tolist() for _ in range(4)],
                                              [torch.randint(0, 40, (5,), generator=g).tolist() for _ in range(4)],
                                              advantages=[1.0, -1.0, 0.5, 2.0])
            actor.update(batch)
        stale, _ = engine_vs_actor()
        sync.by_handles = version == 2  # the colocated path: /load_lora_adapter_from_tensors
        metrics = sync.sync(version=version)
        diff, served = engine_vs_actor()
        out[version] = {"stale": stale, "diff": diff, "versions": served, "bytes": metrics["weight_sync/bytes"],
                        "kept": sorted(p.name for p in Path(adapter_dir).iterdir())}
    for name in sync.adapters.loaded:  # leave the server as it was found: no adapter, the disk's version
        http_json("POST", urls[0] + "/unload_lora_adapter", {"lora_name": name}, timeout_s=120)
    out["trainable"] = actor.trainable_parameters
    sync.close()
    client.close()
    return out


def _check_adapters_synced(out: dict, versions: int = 3) -> None:
    print("adapter-only sync to SGLang: max |served - actor| logprob after each sync",
          [f"{out[v]['diff']:.1e}" for v in range(1, versions + 1)], "before it",
          [f"{out[v]['stale']:.2f}" for v in range(1, versions + 1)])  # docs/training.md's figures (pytest -s)
    for version in range(1, versions + 1):
        result = out[version]
        assert result["stale"] > 1e-2, result  # the updates moved the adapters: the check can fail
        assert result["diff"] < 1e-5, result  # measured 2.4e-7 at TP 1 and TP 2
        assert result["versions"] == {str(version)}  # the client named this version's adapter
        # the PEFT form: more than the actor's adapters (a fused linear's A once per HF module), fp32
        assert 4 * out["trainable"] < result["bytes"] < 4 * 3 * out["trainable"], result
    assert out["base"][0] < 1e-5 and out["base"][1] == {"0"}
    # two versions kept; v2 came by handles (no directory), and v0's and v1's went with their unloads
    assert out[1]["kept"] == ["policy-v0", "policy-v1"] and out[versions]["kept"] == ["policy-v3"]


def test_adapter_only_sync_to_sglang(sglang, model_dir, tmp_path):
    server = sglang(1)
    load_from_disk(server, model_dir)
    _check_adapters_synced(run_on_ranks(_sync_adapters_and_compare, 1, str(model_dir), [server.url],
                                        str(tmp_path / "adapters"), timeout_s=600)[0])


def test_weight_sync_reaches_both_tp_ranks(sglang, model_dir):
    """Both TP ranks load a per-tensor update, then a flattened one from the trainer's memory
    (the streamed and second flattened syncs are the single-rank test's)."""
    server = sglang(2)
    out = run_on_ranks(_sync_and_compare, 1, str(model_dir), [server.url], 2, timeout_s=600)[0]
    _check_synced(out, server.url, 2, versions=2)


def test_adapter_only_sync_reaches_both_tp_ranks(sglang, model_dir, tmp_path):
    server = sglang(2)
    load_from_disk(server, model_dir)
    _check_adapters_synced(run_on_ranks(_sync_adapters_and_compare, 1, str(model_dir), [server.url],
                                        str(tmp_path / "adapters"), timeout_s=600)[0])
