"""The agent-loop and weight-update scenario against a real SGLang server.

Runs where `sglang` is importable (GPU machines with the `gpu` extra, or the CPU recipe
in docs/rollout.md); skipped otherwise, with the reason shown under `-ra`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

sglang = pytest.importorskip(
    "sglang", reason="sglang is not installed (GPU extra, or the CPU recipe in docs/rollout.md); "
                     "the embedded-engine tests cover the same scenario")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from envs import EnvManager  # noqa: E402
from megatron_agent.models.tiny import write_tiny_model  # noqa: E402
from megatron_agent.platform.distributed import free_port  # noqa: E402
from megatron_agent.weight_sync import send_weights  # noqa: E402
from rollout.agent_loop import AgentLoopConfig, run_rollout  # noqa: E402
from rollout.engine_client import EngineClient  # noqa: E402
from rollout.engine_launch import EngineProcess, wait_healthy  # noqa: E402
from rollout.prompts import PromptConfig  # noqa: E402
from rollout.sampling import SamplingConfig  # noqa: E402
from rollout.weight_group import destroy_weight_update_group, init_weight_update_group  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--skip-server-warmup"]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
    log_path = tmp_path_factory.mktemp("sglang") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    engine = EngineProcess(f"http://127.0.0.1:{port}", proc, log_path)
    if not wait_healthy(engine, timeout_s=600):
        engine.stop()
        pytest.fail("sglang server did not start:\n" + log_path.read_text()[-4000:])
    yield engine
    engine.stop()


def greedy_logprobs_match_hf(samples, model, atol):
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), expected, atol=atol, rtol=0)


def test_agent_loop_and_weight_update_against_sglang(server, model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    client = EngineClient([server.url])
    # greedy: SGLang's greedy logprobs are untempered, as ours; no per-request seed needed
    cfg = AgentLoopConfig(max_steps=4, prompt=PromptConfig(history_length=2),
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=12, seed=None))
    for env_name, env_cfg in [("sokoban", None), ("numberline", {"render_image": False})]:
        with EnvManager(env_name, env_cfg, num_groups=2, group_size=2, backend="inline") as envs:
            result = run_rollout(envs, client, tokenizer, cfg, seeds=[1, 2])
        assert len(result.episodes) == 4 and all(result.episodes)
        greedy_logprobs_match_hf(result.samples[:4], hf, atol=1e-3)

    new_dir = write_tiny_model("qwen2", tmp_path / "new", seed=1)
    new = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    port = free_port()
    pending, world_size = client.init_weights_update_group("127.0.0.1", port, "wu", backend="gloo")
    pg = init_weight_update_group("127.0.0.1", port, 0, world_size, "wu", "gloo", timeout_s=120)
    pending.result(timeout=120)
    try:
        client.pause_generation("abort")
        client.begin_weight_update()
        send_weights(client, pg, list(new.state_dict().items()), "wu", weight_version="v1", flattened=True)
        client.end_weight_update()
        client.flush_cache()
        client.continue_generation()
    finally:
        client.destroy_weights_update_group("wu")
        destroy_weight_update_group(pg)
    prompt = tokenizer("you are an agent", add_special_tokens=False)["input_ids"]
    out = client.generate([prompt], {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})[0]
    expected = new.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
    assert out.output_ids == expected.tolist()
    assert out.weight_version == "v1"
    client.close()
