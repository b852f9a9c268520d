"""Routing replay on the tiny MoE with FP8 rollout weights: how often the engine and the trainer
route a token to different experts, and how far apart their logprobs are, without and with
replay (algorithm.routing_replay=rollout).

    .venv/bin/python bench/routing_replay.py [--prompts 32] [--prompt-tokens 48] [--new-tokens 32]
    .venv/bin/python bench/routing_replay.py --quick    # 4 short prompts: the script end to end

The engine (the embedded engine on the model's block-FP8 checkpoint, as `weight_sync.quantize=fp8`
serves it) samples from random prompts and returns each fed token's experts. The trainer (the
Megatron actor at TP 1, fp32, the unquantized weights) recomputes the sampled tokens' logprobs
twice: routing by its own weights, and replaying the engine's routes. Reported: the share of
(fed token, MoE layer) decisions where the trainer routes otherwise than the engine did
(without replay, its `RoutingWatch`; with replay 0, which the watch checks on every router),
and the engine-vs-trainer KL over response tokens (mean of r - 1 - log r, r = exp(trainer -
engine)). Ends with the line
`routing_replay: disagreement D_off -> D_on, KL K_off -> K_on (N tokens, L layers)`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sample_with_routes(model_dir: Path, prompts: int, prompt_tokens: int, new_tokens: int, seed: int):
    """The engine's samples on random prompts: (prompt ids, output ids, logprobs, routes) each."""
    from rollout.embedded_engine import Engine, SamplingParams

    engine = Engine(str(model_dir), max_batch_size=prompts)
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, prompt_tokens).tolist() for _ in range(prompts)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=seed + i)
              for i in range(prompts)]
    done = engine.generate(ids, params, [f"r{i}" for i in range(prompts)], routed_experts=True)
    return [(p, c.output_ids, c.logprobs, c.routed_experts) for p, c in zip(ids, done)]


def trainer_side(model_dir: str, samples: list) -> dict:
    """On one trainer rank: the actor's logprobs of the samples, routing by its own weights and
    replaying the engine's routes; each pass's RoutingWatch counts the (fed token, layer)
    decisions where the trainer's own top-k differs from the engine's (with replay it also
    checks that every router followed the engine)."""
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.training.batch import TrainBatch

    init_distributed(ParallelConfig(), seed=0)
    batch = TrainBatch.from_sequences([p for p, *_ in samples], [o for _, o, *_ in samples],
                                      rollout_logprobs=[lp for *_, lp, _ in samples],
                                      routed_experts=[r for *_, r in samples])
    out = {}
    for mode in ("none", "rollout"):
        actor = Actor(model_dir, ParallelConfig(), ActorConfig(), AlgorithmConfig(routing_replay=mode))
        result = actor.compute_logprobs(batch, with_entropy=False, watch_routing=True)
        log_r = (result["logprobs"] - batch.rollout_logprobs)[batch.response_mask.bool()].double()
        differ, decisions = result["routing"].sum(0).tolist()
        out[mode] = {"differ": differ, "decisions": decisions, "kl_k3": float((torch.expm1(log_r) - log_r).mean()),
                     "max_abs_diff": float(log_r.abs().max()), "tokens": int(log_r.numel())}
        del actor
    return out


def measure(work: Path, prompts: int, prompt_tokens: int, new_tokens: int, seed: int = 0) -> dict:
    from megatron_agent.models.tiny import write_tiny_model
    from megatron_agent.platform.launch import run_on_ranks
    from megatron_agent.weight_sync.fp8 import write_fp8_checkpoint

    model_dir = write_tiny_model("qwen3_moe", work / "model", seed=0, tokenizer="words")
    fp8_dir = write_fp8_checkpoint(model_dir, work / "model_fp8")
    samples = sample_with_routes(fp8_dir, prompts, prompt_tokens, new_tokens, seed)
    result = run_on_ranks(trainer_side, 1, str(model_dir), samples, timeout_s=600)[0]
    result["layers"] = samples[0][3].shape[1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 prompts of 8 tokens, 4 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.prompt_tokens, args.new_tokens = 4, 8, 4
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(Path(tmp), args.prompts, args.prompt_tokens, args.new_tokens, args.seed)
    off, on = r["none"], r["rollout"]
    for name, row in (("own routing", off), ("replayed", on)):
        print(f"{name:12s} KL {row['kl_k3']:.3e}  max |gap| {row['max_abs_diff']:.3e}  "
              f"own top-k unlike the engine's: {row['differ']:.0f} of {row['decisions']:.0f} decisions")
    # replayed, every router routed by the engine's ids (the watch raises otherwise): 0 by construction
    print(f"routing_replay: disagreement {off['differ'] / off['decisions']:.4f} -> 0.0000, "
          f"KL {off['kl_k3']:.3e} -> {on['kl_k3']:.3e} ({off['tokens']} tokens, {r['layers']} layers)")


if __name__ == "__main__":
    main()
