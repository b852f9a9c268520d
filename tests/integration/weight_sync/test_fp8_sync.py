"""FP8 rollout weights end to end on the CPU: an embedded engine started from the block-FP8
checkpoint receives the actor's weights as float8_e4m3fn + weight_scale_inv (flattened
buckets small enough to split a weight from its scale, then per tensor, then per tensor
streamed from the layout the previous sync recorded), dequantizes them,
and its logprobs equal those of HF transformers loaded with the dequantized weights, while
they differ from the fp32 actor's by the small gap FP8 costs."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.platform.launch import run_on_ranks
from rollout.engine_launch import launch_engines, stop_engines

pytestmark = pytest.mark.multirank

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30]]


def _fp8_syncs(model_dir: str, urls: list[str]) -> list[dict]:
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient

    ctx = init_distributed(ParallelConfig(), seed=7)
    actor = Actor(model_dir, ctx.parallel, ActorConfig(lr=1e-2, use_distributed_optimizer=False),
                  AlgorithmConfig(use_kl_loss=False, entropy_coef=0.0))
    g = torch.Generator().manual_seed(1)
    client = EngineClient(urls)
    results, syncs = [], {}
    for step, flattened in enumerate([True, False, False]):
        batch = TrainBatch.from_sequences([torch.randint(0, 800, (6,), generator=g).tolist() for _ in range(4)],
                                          [torch.randint(0, 800, (5,), generator=g).tolist() for _ in range(4)],
                                          advantages=[1.0 + step, -1.0, 0.5, 2.0])
        actor.update(batch)  # away from the checkpoint the engine started from
        sync = syncs.get(flattened) or WeightSync(actor, urls, WeightSyncConfig(
            bucket_bytes=20 * 1024, check=True, timeout_s=60, flattened=flattened, quantize="fp8"))
        syncs[flattened] = sync
        streamed = sync.layout is not None and not flattened  # the second per-tensor sync
        metrics = sync.sync(version=step + 1)  # check=True: the engine holds the dequantized weights
        outs = client.generate(PROMPTS, {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True,
                                         "sampling_seed": 3})
        sampled = TrainBatch.from_sequences(PROMPTS, [o.output_ids for o in outs],
                                            rollout_logprobs=[o.logprobs for o in outs])
        actor_logprobs = actor.compute_logprobs(sampled, with_entropy=False)["logprobs"]
        mask = sampled.response_mask.bool()
        results.append({"outputs": [o.output_ids for o in outs], "engine": [o.logprobs for o in outs],
                        "actor": [row[m].tolist() for row, m in zip(actor_logprobs, mask)],
                        "weights": {n: t.detach().clone() for n, t in actor.named_hf_weights()},
                        "buckets": metrics["weight_sync/buckets"], "streamed": streamed})
    for sync in syncs.values():
        sync.close()
    return results


def _reference_dequantized(w: torch.Tensor) -> torch.Tensor:
    """The trainer's quantization, dequantized block by block here (not with fp8_blocks')."""
    from rollout.fp8_blocks import quantize_block_fp8

    q, scale_inv = quantize_block_fp8(w)
    out = torch.empty_like(w)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = q[rows, cols].to(torch.float32) * scale_inv[i, j]
    return out


def _hf_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_fp8_sync_serves_the_dequantized_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_agent.weight_sync.fp8 import is_quantized_linear, write_fp8_checkpoint

    model_dir = tiny_model_dir("qwen3")
    engines = launch_engines(write_fp8_checkpoint(model_dir, tmp_path / "fp8"), 1, log_dir=tmp_path)
    try:
        results = run_on_ranks(_fp8_syncs, 1, str(model_dir), [e.url for e in engines], timeout_s=300)[0]
    finally:
        stop_engines(engines)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [r["streamed"] for r in results] == [False, False, True]
    for result in results:
        assert result["buckets"] >= 4  # small buckets: weights and their scales split across some
        state = {n: _reference_dequantized(w) if is_quantized_linear(n) else w for n, w in result["weights"].items()}
        missing, unexpected = hf.load_state_dict(state, strict=False)
        assert not unexpected and all("lm_head" in n for n in missing)  # tied
        engine_vs_hf, engine_vs_actor = [], []
        for prompt, output, engine, actor in zip(PROMPTS, result["outputs"], result["engine"], result["actor"]):
            reference = _hf_logprobs(hf, prompt, output)
            engine_vs_hf += [abs(a - b) for a, b in zip(engine, reference)]
            engine_vs_actor += [abs(a - b) for a, b in zip(engine, actor)]
        assert max(engine_vs_hf) < 1e-5, max(engine_vs_hf)
        mean_gap = sum(engine_vs_actor) / len(engine_vs_actor)
        print(f"engine vs HF on the dequantized weights: max {max(engine_vs_hf):.1e}; "
              f"vs the fp32 actor: mean {mean_gap:.2e}, max {max(engine_vs_actor):.2e}")
        assert 1e-5 < mean_gap < 5e-2, mean_gap  # FP8 shows, within the check's fp8 bound
