"""Agent-loop overhead and the embedded engine's throughput.

1. Overhead: 16 groups x 8 episodes of Sokoban with embedded engine process(es); the
   share of wall time that is neither generation nor env stepping (prompt building,
   tokenisation, decoding, sample bookkeeping, HTTP framing is counted as generation),
   lock-step and asynchronous (rollout/async_loop.py).
2. Throughput: output tokens/s of the embedded engine (in process, and through HTTP)
   against HF transformers' `generate` on the same model, batch and thread count.

Run: `.venv/bin/python bench/agent_loop.py [--family qwen3] [--preset tiny] [--threads 2]`.
Prints figures; never asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

import torch


def overhead(model_dir, args) -> None:
    from transformers import AutoTokenizer

    from envs import EnvManager
    from rollout.agent_loop import AgentLoopConfig, run_rollout
    from rollout.engine_client import EngineClient
    from rollout.engine_launch import launch_engines, stop_engines
    from rollout.prompts import PromptConfig
    from rollout.sampling import SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = AgentLoopConfig(max_steps=15, prompt=PromptConfig(history_length=2),
                          sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens))
    engines = launch_engines(model_dir, args.engines, threads=args.threads)
    client = EngineClient([e.url for e in engines])
    seeds = list(range(16))
    print(f"\n16 groups x 8 Sokoban episodes, {args.engines} embedded engine(s) x {args.threads} thread(s), "
          f"max_new_tokens={args.max_new_tokens}, env backend={args.env_backend}")
    print(f"{'mode':<22} {'wall s':>8} {'generate s':>11} {'env s':>7} {'overhead':>9} {'steps':>6} {'success':>8}")
    try:
        for mode in ("lockstep", "async"):
            envs = [EnvManager("sokoban", None, 16, 8, backend=args.env_backend)]
            try:
                run_rollout(envs, client, tokenizer, replace(cfg, max_steps=1), seeds)  # warm-up
                r = run_rollout(envs, client, tokenizer, replace(cfg, mode=mode), seeds)
            finally:
                for e in envs:
                    e.close()
            m = r.metrics
            print(f"{mode:<22} {m['rollout/time_s']:>8.2f} {m['rollout/time_generate_s']:>11.2f} "
                  f"{m['rollout/time_env_s']:>7.3f} {100 * m['rollout/overhead_share']:>8.1f}% "
                  f"{int(m['rollout/num_samples']):>6} {m['rollout/success_rate']:>8.3f}")
    finally:
        client.close()
        stop_engines(engines)


def throughput(model_dir, args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.embedded_engine import Engine
    from rollout.engine_client import EngineClient
    from rollout.engine_launch import launch_engines, stop_engines
    from rollout.engine_server import generate

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = "you are an agent in environment your task is to reach the goal current observation".split()
    prompts = [tokenizer(" ".join(words[: 8 + i % 8]) * 20, add_special_tokens=False)["input_ids"]
               for i in range(args.batch)]
    n_new = args.max_new_tokens
    params = {"temperature": 1.0, "max_new_tokens": n_new, "ignore_eos": True}

    engine = Engine(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")

    def run_engine():
        generate(engine, {"input_ids": prompts, "sampling_params": params})

    def run_hf():
        with torch.no_grad():
            hf.generate(**batch, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=True, temperature=1.0,
                        top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)

    engines = launch_engines(model_dir, 1, threads=args.threads)
    client = EngineClient([engines[0].url])

    def run_http():
        client.generate(prompts, params)

    results = {}
    try:
        for name, fn in (("embedded engine (in process)", run_engine), ("embedded engine (HTTP)", run_http),
                         ("HF transformers generate", run_hf)):
            fn()
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            results[name] = args.batch * n_new / statistics.median(times)
    finally:
        client.close()
        stop_engines(engines)
    print(f"\nthroughput: batch {args.batch}, prompt ~{statistics.mean(map(len, prompts)):.0f} tokens, "
          f"{n_new} new tokens, {args.threads} thread(s), median of {args.repeats}")
    hf_tps = results["HF transformers generate"]
    for name, tps in results.items():
        print(f"  {name:<30} {tps:>9.0f} tokens/s   x{tps / hf_tps:.2f} vs HF")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--env-backend", default="process")
    args = parser.parse_args()
    from megatron_agent.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(args.family, f"{tmp}/{args.family}-{args.preset}", preset=args.preset, seed=0)
        overhead(model_dir, args)
        throughput(model_dir, args)


if __name__ == "__main__":
    main()
