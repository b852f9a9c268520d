"""Weight sync of a ~500 MB fp32 qwen3 from one trainer rank to one embedded engine, at
several bucket sizes, against a raw gloo broadcast of the same bytes in the same run.

The trainer is this process (WORLD_SIZE=1) holding an Actor; the engine is started with
`launch_engines`. The baseline is `torch.distributed.broadcast` of the same number of
bytes, cut into the same bucket sizes (one flat uint8 tensor per bucket), to a helper
process that joins a weight-update group with `init_weight_update_group` and
acknowledges the last bucket (so the clock stops when the bytes have arrived).

Where the time goes is measured by wrapping, in this process only, the functions
`WeightSync.sync` calls: the export alone (iterating `actor.named_hf_weights()`) is
timed separately; inside a sync the time in `send_weights` is split into flattening
(`flatten_bucket`), the broadcast, and the rest (HTTP announce + the engine copying the
bucket into its model before it answers); the six control requests (pause, flush, begin,
end, version, continue) are clocked too, and what is left is the export and bucketing.
On a shared CPU the figures move by tens of percent from run to run.

Run: `.venv/bin/python bench/weight_sync.py [--layers 11] [--buckets-mib 32,128,512]`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MIB = 2**20


def _receiver(port: int, chunk_sizes: list[list[int]], repeats: int, threads: int) -> None:
    """The baseline's receiving side: rank 1 of a weight-update group."""
    import torch.distributed as dist

    from rollout.weight_group import destroy_weight_update_group, init_weight_update_group

    torch.set_num_threads(threads)
    pg = init_weight_update_group("127.0.0.1", port, 1, 2, "bench-raw-broadcast", backend="gloo", timeout_s=300)
    for sizes in chunk_sizes:
        for _ in range(repeats):
            for n in sizes:
                dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=pg)
            dist.broadcast(torch.ones(1), src=1, group=pg)  # acknowledge: everything arrived
    destroy_weight_update_group(pg)


def chunks_of(total: int, bucket: int) -> list[int]:
    return [min(bucket, total - start) for start in range(0, total, bucket)]


def raw_broadcast_seconds(total: int, buckets: list[int], repeats: int, threads: int) -> dict[int, float]:
    """Median seconds to broadcast `total` bytes in chunks of each bucket size."""
    import torch.distributed as dist

    from megatron_agent.platform import free_port
    from rollout.weight_group import destroy_weight_update_group, init_weight_update_group

    plans = [chunks_of(total, b) for b in buckets]
    port = free_port()
    helper = mp.get_context("spawn").Process(target=_receiver, args=(port, plans, repeats, threads))
    helper.start()
    try:
        pg = init_weight_update_group("127.0.0.1", port, 0, 2, "bench-raw-broadcast", backend="gloo", timeout_s=300)
        source = torch.randint(0, 255, (total,), dtype=torch.uint8)
        out = {}
        for bucket, sizes in zip(buckets, plans):
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                offset = 0
                for n in sizes:
                    dist.broadcast(source[offset:offset + n], src=0, group=pg)
                    offset += n
                dist.broadcast(torch.zeros(1), src=1, group=pg)
                times.append(time.perf_counter() - t)
            out[bucket] = statistics.median(times)
        destroy_weight_update_group(pg)
        helper.join(timeout=60)
    finally:
        if helper.is_alive():
            helper.kill()
            helper.join()
    return out


class Clock:
    """Accumulated seconds of a few wrapped functions (this process only)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.originals: list = []

    def wrap(self, owner, attr: str, key: str) -> None:
        original = getattr(owner, attr)
        self.originals.append((owner, attr, original))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds = {}

    def restore(self) -> None:
        for owner, attr, original in reversed(self.originals):
            setattr(owner, attr, original)
        self.originals = []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=11)  # ~517 MB fp32
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--buckets-mib", default="32,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads here and in the helper")
    args = parser.parse_args()
    os.environ.setdefault("WORLD_SIZE", "1")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    buckets = [int(float(b) * MIB) for b in args.buckets_mib.split(",")]

    import torch.distributed as dist

    import megatron_agent.weight_sync as weight_sync
    import rollout.weight_group as weight_group
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models.tiny import write_tiny_model
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient
    from rollout.engine_launch import launch_engines, stop_engines

    tmp = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    engines = []
    try:
        t = time.perf_counter()
        heads = args.hidden // 64
        model_dir = write_tiny_model("qwen3", tmp / "model", hidden_size=args.hidden,
                                     intermediate_size=args.intermediate, num_attention_heads=heads,
                                     num_key_value_heads=max(1, heads // 2), head_dim=64,
                                     num_hidden_layers=args.layers)
        on_disk = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        write_s = time.perf_counter() - t

        t = time.perf_counter()
        engines = launch_engines(model_dir, 1, log_dir=tmp / "logs", timeout_s=300)
        engine_start_s = time.perf_counter() - t

        t = time.perf_counter()
        ctx = init_distributed(ParallelConfig())
        actor = Actor(model_dir, ctx.parallel, ActorConfig(use_distributed_optimizer=False),
                      AlgorithmConfig(use_kl_loss=False))
        actor_s = time.perf_counter() - t

        # The export alone: iterated and dropped (copies reuse freed memory), and kept alive
        # as a sync's bucket keeps them (the copies, e.g. q/k/v split out of the fused
        # linear_qkv, then touch fresh pages).
        export_times, kept_times, total, count = [], [], 0, 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            total, count = 0, 0
            for _, tensor in actor.named_hf_weights():
                total += tensor.numel() * tensor.element_size()
                count += 1
            export_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            kept = list(actor.named_hf_weights())
            kept_times.append(time.perf_counter() - t)
            del kept
        export_s, kept_s = statistics.median(export_times), statistics.median(kept_times)

        flatten_times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            weight_group.flatten_bucket([w for _, w in actor.named_hf_weights()])
            flatten_times.append(time.perf_counter() - t)
        flatten_all_s = statistics.median(flatten_times)

        # The syncs, with the pieces of send_weights clocked.
        clock = Clock()
        clock.wrap(weight_sync, "send_weights", "send")
        clock.wrap(weight_group, "flatten_bucket", "flatten")
        clock.wrap(dist, "broadcast", "broadcast")
        for method in ("pause_generation", "flush_cache", "begin_weight_update", "end_weight_update",
                       "update_weight_version", "continue_generation"):
            clock.wrap(EngineClient, method, "control")
        rows = []
        for bucket in buckets:
            sync = WeightSync(actor, [e.url for e in engines], WeightSyncConfig(bucket_bytes=bucket))
            t = time.perf_counter()
            sync.sync(version="warm-up")  # joins the group (connect) once per WeightSync
            first_s = time.perf_counter() - t
            runs = []
            for r in range(args.repeats):
                clock.reset()
                metrics = sync.sync(version=f"{bucket}-{r}")
                runs.append((metrics["weight_sync/seconds"], dict(clock.seconds), metrics))
            runs.sort(key=lambda x: x[0])
            seconds, parts, metrics = runs[len(runs) // 2]
            rows.append((bucket, seconds, first_s, parts, metrics))
            sync.set_engines([])  # leaves the group on both sides
        clock.restore()
    finally:
        stop_engines(engines)
    # The engine's CPU is free now, as the helper's receiving side would have it.
    raw = raw_broadcast_seconds(total, buckets, args.repeats, threads)
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"qwen3 {args.layers} layers, hidden {args.hidden}: {total / 1e6:.0f} MB exported in {count} tensors "
          f"({on_disk / 1e6:.0f} MB safetensors), fp32, 1 trainer rank -> 1 embedded engine, gloo, "
          f"{threads} torch threads, {os.cpu_count()} CPUs")
    print(f"setup: write model {write_s:.1f} s, engine start {engine_start_s:.1f} s, actor build {actor_s:.1f} s")
    print(f"export alone (iterate named_hf_weights): {export_s:.3f} s dropping each tensor, {kept_s:.3f} s keeping "
          f"them all; export + flatten_bucket of everything: {flatten_all_s:.3f} s")
    print()
    print(f"median of {args.repeats} syncs after a warm-up sync; raw = gloo broadcast of the same bytes in the "
          f"same bucket sizes to a helper process")
    print(f"{'bucket':>8}{'buckets':>8}{'sync s':>9}{'GB/s':>7}{'raw s':>8}{'raw GB/s':>9}{'sync/raw':>9}"
          f"{'1st s':>8}  | {'flatten':>8}{'bcast':>8}{'http+load':>10}{'control':>8}{'other':>7}")
    for bucket, seconds, first_s, parts, metrics in rows:
        send, flat, bcast = parts.get("send", 0.0), parts.get("flatten", 0.0), parts.get("broadcast", 0.0)
        control = parts.get("control", 0.0)  # pause/flush/begin before, end/version/continue after
        other = seconds - send - control  # export, bucketing, the gathers and all-reduce between ranks
        print(f"{bucket // MIB:>5}MiB{int(metrics['weight_sync/buckets']):>8}{seconds:>9.3f}"
              f"{metrics['weight_sync/bytes'] / 1e9 / seconds:>7.2f}{raw[bucket]:>8.3f}"
              f"{total / 1e9 / raw[bucket]:>9.2f}{seconds / raw[bucket]:>9.2f}{first_s:>8.2f}  | "
              f"{flat:>8.3f}{bcast:>8.3f}{send - flat - bcast:>10.3f}{control:>8.3f}{other:>7.3f}")
    print("columns after '|' split the sync's seconds: flatten_bucket, dist.broadcast, the rest of send_weights "
          "(HTTP announce + engine copy-in, waited on after the broadcast), the six control requests, other "
          "(export, bucketing, collectives between trainer ranks)")


if __name__ == "__main__":
    main()
