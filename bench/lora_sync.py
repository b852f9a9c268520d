"""Bytes and seconds of a LoRA actor's weight sync, merged against adapters alone, to one
embedded engine, measured in the same run; then the bytes of both for Qwen3-30B-A3B.

The trainer is this process (WORLD_SIZE=1) holding an Actor with adapters (rank
`--rank` on every linear) on a ~500 MB fp32 qwen3 (as bench/weight_sync.py's); the engine
is an embedded engine process. The syncs alternate (merged, adapters from a directory,
adapters by tensor handles, merged, ...), so all see the same load on a shared machine;
the figures are medians, and each ratio is the median of a round's merged seconds over
that round's adapter seconds. A merged sync sends the whole model, W + (alpha/r)·B·A for
each adapted linear, over the weight-update group (gloo here, NCCL on GPUs); an adapter
sync gathers the adapters whole and loads them as a PEFT adapter (weight_sync/adapters.py).

The Qwen3-30B-A3B line is arithmetic: the model's bf16 bytes against PEFT's tensors for
the same adapters (a fused linear's A once per HF module it is cut into), the formula
checked first against the bytes the tiny model's adapter sync sent in this run.

Run: `.venv/bin/python bench/lora_sync.py [--layers 11] [--rank 8] [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

# Qwen3-30B-A3B's config.json, the fields the byte counts read
QWEN3_30B_A3B = dict(model_type="qwen3_moe", num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, head_dim=128, vocab_size=151936)
# HF modules a fused Megatron linear is cut into (each with its own copy of A)
HF_MODULES = {"linear_qkv": 3, "linear_proj": 1, "linear_fc1": 2, "linear_fc2": 1}


def peft_bytes(hf: dict, lora, bytes_per_value: int) -> int:
    """Bytes of the PEFT adapter `lora` puts on `hf` (models/lora.py peft_tensors' layout:
    `lora_parameters`' A and B, with a fused linear's A once per HF module)."""
    from megatron_agent.models.memory import linear_widths
    from megatron_agent.models.transformer_config import num_experts

    experts = num_experts(hf) or 0
    per_layer = 0
    for target in lora.targets:
        n_in, n_out = linear_widths(hf)[target]
        copies = (experts if lora.experts else 0) if experts and target in ("linear_fc1", "linear_fc2") else 1
        per_layer += copies * lora.rank * (HF_MODULES[target] * n_in + n_out)
    return per_layer * hf["num_hidden_layers"] * bytes_per_value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=11)  # ~523 MB fp32
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"lora_sync: a {args.layers}-layer qwen3 (hidden {args.hidden}) with rank-{args.rank} adapters, "
          f"{args.repeats} rounds of merged / adapters (directory) / adapters (handles); about a minute on 2 cores",
          flush=True)
    os.environ.setdefault("WORLD_SIZE", "1")

    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models.lora import LoraConfig, adapters
    from megatron_agent.models.memory import parameter_counts
    from megatron_agent.models.tiny import write_tiny_model
    from megatron_agent.models.transformer_config import read_hf_config
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_launch import launch_engines, stop_engines

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-sync-"))
    engines = []
    try:
        heads = args.hidden // 64
        model_dir = write_tiny_model("qwen3", tmp / "model", hidden_size=args.hidden,
                                     intermediate_size=args.intermediate, num_attention_heads=heads,
                                     num_key_value_heads=max(1, heads // 2), head_dim=64,
                                     num_hidden_layers=args.layers)
        engines = launch_engines(model_dir, 1, log_dir=tmp / "logs", timeout_s=300, allowed_weight_dirs=[tmp])
        urls = [e.url for e in engines]
        init_distributed(ParallelConfig())
        lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
        actor = Actor(model_dir, ParallelConfig(), ActorConfig(lora=lora), AlgorithmConfig(use_kl_loss=False))
        for adapter in adapters(actor.chunks):  # B starts at zero: as after some updates
            adapter.b.data.normal_(0, 0.01)
        syncs = {
            "merged": WeightSync(actor, urls, WeightSyncConfig(lora="merged")),
            "adapters (directory)": WeightSync(actor, urls, WeightSyncConfig(lora="adapters",
                                                                            adapter_dir=str(tmp / "adapters"))),
            "adapters (handles)": WeightSync(actor, urls, WeightSyncConfig(lora="adapters", transport="tensor")),
        }
        version = 0
        for sync in syncs.values():  # warm-up: groups joined, buffers allocated
            version += 1
            sync.sync(version)
        seconds = {name: [] for name in syncs}
        sent = {}
        for _ in range(args.repeats):
            for name, sync in syncs.items():
                version += 1
                metrics = sync.sync(version)
                seconds[name].append(metrics["weight_sync/seconds"])
                sent[name] = metrics["weight_sync/bytes"]
        for sync in syncs.values():
            sync.close()

        hf = read_hf_config(model_dir)
        merged = seconds["merged"]
        print(f"\n{'sync':<22}{'bytes':>14}{'seconds (median)':>19}{'merged / this':>16}")
        for name, times in seconds.items():
            ratio = statistics.median(m / t for m, t in zip(merged, times))
            print(f"{name:<22}{sent[name]:>14,.0f}{statistics.median(times):>19.4f}{ratio:>15.1f}x")
        formula = peft_bytes(hf, lora, 4)
        assert formula == sent["adapters (directory)"], (formula, sent)
        print(f"\nthe PEFT-bytes formula gives {formula:,} B for this model: what the adapter sync sent")

        big = read_hf_config(QWEN3_30B_A3B)
        model_bytes = 2 * parameter_counts(big).total
        print("\nQwen3-30B-A3B in bf16 (arithmetic):")
        for rank in (8, 32):
            for experts in (True, False):
                adapter = peft_bytes(big, LoraConfig(rank=rank, experts=experts), 2)
                print(f"  rank {rank:>2}, experts {'in ' if experts else 'out'}: adapters {adapter / 1e9:6.3f} GB "
                      f"against the merged model's {model_bytes / 1e9:.1f} GB ({model_bytes / adapter:,.0f}x fewer bytes)")
    finally:
        stop_engines(engines)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - start:.0f} s)")
    torch.distributed.destroy_process_group()
