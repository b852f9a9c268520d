"""Weight sync of a ~500 MB fp32 qwen3 from one trainer rank to one embedded engine, at
several bucket sizes, against a raw gloo broadcast of the same bytes in the same run.

The trainer is this process (WORLD_SIZE=1) holding an Actor; the engine is started with
`launch_engines`. The baseline is `torch.distributed.broadcast` of the same number of
bytes, cut into the same bucket sizes (one flat uint8 tensor per bucket, no HTTP), to a
helper process that joins a weight-update group with `init_weight_update_group`, receives
into one buffer it touched beforehand (the baseline's best case: no page faults), and
acknowledges the last bucket (so the clock stops when the bytes have arrived). Syncs and
raw broadcasts alternate (sync, raw, sync, raw, ...), so both see the same load on a
shared machine; the figures are medians, and raw/sync is the median of each sync's ratio
to the raw broadcast that followed it.

Where the time goes is measured by wrapping, in this process only, the functions a sync
calls. The pipeline overlaps them, so they do not add up to the sync's seconds: `write`
is the caller's thread writing exported tensors into the bucket buffers (overlapping the
wire), `bcast` the sender thread's broadcasts, `http+load` the rest of `send_weights`
(HTTP announce, the engine receiving in place and answering), `control` the six control
requests (pause, flush, begin, end, version, continue), `idle` the sync's seconds in which
no bucket was being sent or controlled (the export and writing of the first bucket, the
collectives between trainer ranks).

The last line is the figure for the default config's bucket size (`WeightSyncConfig`).
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


def _receiver(port: int, plans: list[list[int]], threads: int) -> None:
    """The baseline's receiving side: rank 1 of a weight-update group, one plan at a time."""
    import torch.distributed as dist

    from rollout.weight_group import destroy_weight_update_group, init_weight_update_group

    torch.set_num_threads(threads)
    pg = init_weight_update_group("127.0.0.1", port, 1, 2, "bench-raw-broadcast", backend="gloo", timeout_s=600)
    buffer = torch.zeros(max(max(sizes) for sizes in plans), dtype=torch.uint8)  # touched once, reused
    for sizes in plans:
        for n in sizes:
            dist.broadcast(buffer[:n], src=0, group=pg)
        dist.broadcast(torch.ones(1), src=1, group=pg)  # acknowledge: everything arrived
    destroy_weight_update_group(pg)


def chunks_of(total: int, bucket: int) -> list[int]:
    return [min(bucket, total - start) for start in range(0, total, bucket)]


class RawBroadcast:
    """A helper process receiving `plans` (lists of chunk sizes) in order; `next()`
    broadcasts the next plan to it and returns the seconds until it acknowledged."""

    def __init__(self, total: int, plans: list[list[int]], threads: int):
        from megatron_agent.platform import free_port
        from rollout.weight_group import init_weight_update_group

        port = free_port()
        self.helper = mp.get_context("spawn").Process(target=_receiver, args=(port, plans, threads))
        self.helper.start()
        self.pg = init_weight_update_group("127.0.0.1", port, 0, 2, "bench-raw-broadcast", backend="gloo",
                                           timeout_s=600)
        self.plans = list(plans)
        self.source = torch.randint(0, 255, (total,), dtype=torch.uint8)

    def next(self) -> float:
        import torch.distributed as dist

        t = time.perf_counter()
        offset = 0
        for n in self.plans.pop(0):
            dist.broadcast(self.source[offset:offset + n], src=0, group=self.pg)
            offset += n
        dist.broadcast(torch.zeros(1), src=1, group=self.pg)
        return time.perf_counter() - t

    def close(self) -> None:
        from rollout.weight_group import destroy_weight_update_group

        destroy_weight_update_group(self.pg)
        self.helper.join(timeout=60)
        if self.helper.is_alive():
            self.helper.kill()
            self.helper.join()


class Clock:
    """Accumulated seconds of a few wrapped functions (this process, any thread)."""

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
    parser.add_argument("--layers", type=int, default=11)  # ~523 MB fp32
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--buckets-mib", default="32,128,512")
    parser.add_argument("--formats", default="flattened,per_tensor", help="flattened and/or per_tensor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads here and in the helper")
    args = parser.parse_args()
    os.environ.setdefault("WORLD_SIZE", "1")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)

    import torch.distributed as dist

    import megatron_agent.weight_sync as weight_sync
    import megatron_agent.weight_sync.buckets as buckets_module
    from megatron_agent.algorithms import AlgorithmConfig
    from megatron_agent.models.tiny import write_tiny_model
    from megatron_agent.platform import ParallelConfig, init_distributed
    from megatron_agent.training.actor import Actor, ActorConfig
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig
    from rollout.engine_client import EngineClient
    from rollout.engine_launch import launch_engines, stop_engines

    default = WeightSyncConfig()
    default_case = (default.flattened, default.bucket_bytes)
    cases = sorted({(fmt == "flattened", int(float(b) * MIB)) for fmt in args.formats.split(",")
                    for b in args.buckets_mib.split(",")} | {default_case}, key=lambda c: (not c[0], c[1]))
    tmp = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    engines, raw = [], None
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

        export_times, total, count = [], 0, 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            total, count = 0, 0
            for _, tensor in actor.named_hf_weights():
                total += tensor.numel() * tensor.element_size()
                count += 1
            export_times.append(time.perf_counter() - t)
        export_s = statistics.median(export_times)

        raw = RawBroadcast(total, [chunks_of(total, b) for _, b in cases for _ in range(args.repeats)], threads)
        clock = Clock()
        clock.wrap(weight_sync, "send_weights", "send")
        clock.wrap(buckets_module, "write_bytes", "write")
        clock.wrap(dist, "broadcast", "broadcast")
        for method in ("pause_generation", "flush_cache", "begin_weight_update", "end_weight_update",
                       "update_weight_version", "continue_generation"):
            clock.wrap(EngineClient, method, "control")
        rows = []
        for flattened, bucket in cases:
            sync = WeightSync(actor, [e.url for e in engines], WeightSyncConfig(bucket_bytes=bucket,
                                                                                flattened=flattened))
            t = time.perf_counter()
            sync.sync(version="warm-up")  # joins the group, allocates the buffers on both sides
            first_s = time.perf_counter() - t
            runs, raw_times = [], []
            for r in range(args.repeats):
                clock.reset()
                metrics = sync.sync(version=f"{bucket}-{r}")
                parts = dict(clock.seconds)
                parts["broadcast"] = parts.get("broadcast", 0.0)
                runs.append((metrics["weight_sync/seconds"], parts, metrics))
                raw_times.append(raw.next())
            runs_in_order = list(runs)
            runs.sort(key=lambda x: x[0])
            seconds, parts, metrics = runs[len(runs) // 2]
            ratio = statistics.median(r / s for r, (s, _, _) in zip(raw_times, runs_in_order))
            rows.append(((flattened, bucket), seconds, statistics.median(raw_times), ratio, first_s, parts, metrics))
            sync.close()  # leaves the group on both sides, frees the buffers
        clock.restore()
    finally:
        stop_engines(engines)
        if raw is not None:
            raw.close()
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"qwen3 {args.layers} layers, hidden {args.hidden}: {total / 1e6:.0f} MB exported in {count} tensors "
          f"({on_disk / 1e6:.0f} MB safetensors), fp32, 1 trainer rank -> 1 embedded engine, gloo, "
          f"{threads} torch threads, {os.cpu_count()} CPUs")
    print(f"setup: write model {write_s:.1f} s, engine start {engine_start_s:.1f} s, actor build {actor_s:.1f} s; "
          f"export alone (iterate named_hf_weights) {export_s:.3f} s")
    print()
    print(f"median of {args.repeats} syncs after a warm-up sync, each followed by a raw gloo broadcast of the same "
          f"bytes in the same bucket sizes to a helper process")
    print(f"{'format':>10}{'bucket':>8}{'buckets':>8}{'sync s':>9}{'GB/s':>7}{'raw s':>8}{'raw GB/s':>9}{'raw/sync':>9}"
          f"{'1st s':>8}  | {'write':>7}{'bcast':>8}{'http+load':>10}{'control':>8}{'idle':>7}")
    for (flattened, bucket), seconds, raw_s, ratio, first_s, parts, metrics in rows:
        send, bcast, control = parts.get("send", 0.0), parts["broadcast"], parts.get("control", 0.0)
        print(f"{'flattened' if flattened else 'per_tensor':>10}{bucket // MIB:>5}MiB{int(metrics['weight_sync/buckets']):>8}{seconds:>9.3f}"
              f"{metrics['weight_sync/bytes'] / 1e9 / seconds:>7.2f}{raw_s:>8.3f}"
              f"{total / 1e9 / raw_s:>9.2f}{ratio:>9.2f}{first_s:>8.2f}  | "
              f"{parts.get('write', 0.0):>7.3f}{bcast:>8.3f}{send - bcast:>10.3f}{control:>8.3f}"
              f"{seconds - send - control:>7.3f}")
    print("columns after '|' (they overlap): write = exported tensors into the bucket buffers (caller's thread), "
          "bcast = broadcasts (sender thread), http+load = the rest of send_weights (announce, engine receive "
          "and answer), control = the six control requests, idle = no bucket on the wire nor a control request")
    print(f"default config: {'flattened' if default.flattened else 'per_tensor'}, "
          f"{default.bucket_bytes // MIB} MiB buckets")
    _, _, _, ratio, _, _, metrics = next(r for r in rows if r[0] == default_case)
    print(f"weight_sync: {ratio:.2f} of raw broadcast ({total / 1e6:.0f} MB, "
          f"{int(metrics['weight_sync/buckets'])} buckets)")


if __name__ == "__main__":
    main()
