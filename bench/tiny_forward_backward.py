"""Forward+backward of the tiny model at TP=1: Megatron-Core (this project's CPU path)
against HF transformers on the same weights-shape model and batch, in the same run.

Prints time per step (median of repeats), the ratio to transformers, and peak resident
memory. Run: `.venv/bin/python bench/tiny_forward_backward.py [--family qwen3] [--preset tiny]`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import torch


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"tiny_forward_backward: {args.repeats} timed forward+backward steps each of Megatron-Core and "
          f"transformers; at the defaults about 20 s on 2 cores", flush=True)
    os.environ.setdefault("WORLD_SIZE", "1")

    from transformers import AutoModelForCausalLM

    from megatron_agent.models import build_model
    from megatron_agent.models.tiny import write_tiny_model
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.schedule import language_model_micro_batch, run_schedule

    model_dir = write_tiny_model(args.family, os.path.join(tempfile.mkdtemp(), "m"), preset=args.preset)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = language_model_micro_batch(tokens)

    rss_before = peak_rss_mib()
    ctx = init_distributed(ParallelConfig())
    (mcore,) = build_model(model_dir, ctx.parallel)
    mcore_s = timed(lambda: run_schedule([mcore], [batch]), args.repeats)
    rss_mcore = peak_rss_mib()

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def hf_step():
        out = hf(input_ids=batch["input_ids"], labels=tokens[:, :-1])  # same shapes, HF shifts itself
        out.loss.backward()

    hf_s = timed(hf_step, args.repeats)
    n_params = sum(p.numel() for p in mcore.parameters())
    tokens_per_step = args.batch * args.seq
    print(f"{args.family} {args.preset}: {n_params / 1e6:.2f} M parameters, batch {args.batch} x seq {args.seq}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':24}{'s/step':>10}{'tokens/s':>12}")
    print(f"{'megatron-core (local)':24}{mcore_s:>10.4f}{tokens_per_step / mcore_s:>12.0f}")
    print(f"{'transformers':24}{hf_s:>10.4f}{tokens_per_step / hf_s:>12.0f}")
    print(f"ratio megatron / transformers: {mcore_s / hf_s:.2f}")
    print(f"peak RSS: {rss_before:.0f} MiB before the model, {rss_mcore:.0f} MiB after megatron fwd+bwd, "
          f"{peak_rss_mib():.0f} MiB at the end")


if __name__ == "__main__":
    main()
