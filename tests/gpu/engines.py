"""What the GPU checks' weight-sync jobs share: an embedded engine on a GPU, and the gap
between the logprobs an engine serves and the actor's for the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [7, 7, 7, 7, 7, 7, 7]]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}


def start_embedded_engine(model_dir: str | Path, log_dir: str | Path, *, device: str = "cuda",
                          dtype: str = "bfloat16", timeout_s: float = 180.0):
    """`python -m rollout.engine_server --device DEVICE` on a free port, once it answers
    /health (rollout/engine_launch.py starts engines on the CPU only). Stop it with `.stop()`."""
    from rollout.engine_launch import EngineProcess, wait_healthy
    from rollout.processes import die_with_parent, free_port

    port = free_port()
    log_path = Path(log_dir) / f"engine-{device.replace(':', '')}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rollout.engine_server", "--model", str(Path(model_dir).resolve()),
           "--port", str(port), "--device", device, "--dtype", dtype]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(CHECKOUT),
                                preexec_fn=die_with_parent)
    engine = EngineProcess(f"http://127.0.0.1:{port}", proc, log_path)
    if not wait_healthy(engine, timeout_s):
        raise RuntimeError(f"the embedded engine on {device} did not start; its log ({log_path}):\n"
                           + log_path.read_text()[-3000:])
    return engine


def served_gap(client, actor) -> dict:
    """Sample PROMPTS on the engines (seeded), recompute the samples' logprobs with the actor;
    the gap (`training.checks.rollout_logprob_gap`) and the weight versions served."""
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.training.checks import rollout_logprob_gap

    outs = client.generate(PROMPTS, SAMPLING)
    sampled = TrainBatch.from_sequences(PROMPTS, [o.output_ids for o in outs],
                                        rollout_logprobs=[o.logprobs for o in outs])
    recomputed = actor.compute_logprobs(sampled, with_entropy=False)["logprobs"]
    gap = rollout_logprob_gap(recomputed, sampled.rollout_logprobs, sampled.response_mask)
    return {"max": gap["check/rollout_logprob_max_abs_diff"], "mean": gap["check/rollout_logprob_mean_abs_diff"],
            "versions": sorted({o.weight_version for o in outs})}


def engine_holds_the_actors_weights(url: str, actor, quantize: str | None = None) -> list[str]:
    """The names whose checksum on the engine differs from the actor's tensor as the engine
    should hold it: cast to the engine's dtype, and with `quantize="fp8"` the quantized
    weights dequantized first (the engine's `Fp8Pairs` dequantizes to fp32, then casts)."""
    from megatron_agent.weight_sync.fp8 import quantize_named
    from rollout.engine_client import http_json
    from rollout.fp8_blocks import dequantize_block_fp8
    from rollout.weight_group import dtype_from_name, weight_checksum

    dtype = dtype_from_name(engine_info(url)["dtype"])
    expected = {}
    for name, tensor in actor.named_hf_weights():
        sent = quantize_named(name, tensor) if quantize == "fp8" else [(name, tensor)]
        value = dequantize_block_fp8(sent[0][1], sent[1][1]) if len(sent) == 2 else tensor
        expected[name] = weight_checksum(value.to(dtype))
    status, answer = http_json("POST", url + "/weights_checksum", {"names": sorted(expected)}, timeout_s=60)
    assert status == 200, answer
    return [n for n, v in expected.items() if abs(answer["checksums"][n] - v) > 1e-6 * max(1.0, abs(v))]


def engine_info(url: str) -> dict:
    from rollout.engine_client import http_json

    status, info = http_json("GET", url + "/get_server_info", timeout_s=30)
    assert status == 200, info
    return info


def trainer_device(actor) -> str:
    return next(actor.chunks[0].parameters()).device.type
