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
calls. `open` + `wire` + `close` are the sync's seconds: `open` from the start to the
first broadcast (pause, begin; then the first bucket exported, or written, and
announced), `wire` from there until the engine answered the last bucket (compare it with
the raw broadcast), `close` the rest (end, continue, the collectives between
trainer ranks). Overlapping those: `write`, the caller's thread writing exported tensors
into the bucket buffers (flattened only), and `control`, the control requests (pause,
begin, end, continue; over a group, no flush or version call of their own). The
sender's CPU seconds per sync (`cpu`, every thread of this process) are next to the raw
broadcast's (`raw cpu`): what the sync adds to the bytes' own cost.

Each format gets a warm-up sync first (it joins the group and allocates, and records the
export's layout: per tensor, the measured syncs are streamed; flattened, the runs of
tensors lying back to back in the parameters' memory go from there, `in place` MB). The
actor packs its parameters (`bridge.pack_parameters`) as at one data-parallel rank;
`--distributed-optimizer` leaves them in Megatron's DDP buffer instead, as at DP > 1.

The last line is the figure for the default config (`WeightSyncConfig`: its format over a
weight-update group, its bucket size). On a shared CPU the figures move by tens of
percent from run to run; the ratio is taken within each pair of runs.

Run: `.venv/bin/python bench/weight_sync.py [--layers 11] [--buckets-mib 32,128,512]
[--distributed-optimizer]`.
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
    """Accumulated seconds of a few wrapped functions (this process, any thread), and when
    each was first entered and last left."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.originals: list = []

    def wrap(self, owner, attr: str, key: str) -> None:
        original = getattr(owner, attr)
        self.originals.append((owner, attr, original))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            self.first.setdefault(key, t)
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.seconds[key] = self.seconds.get(key, 0.0) + end - t
                self.last[key] = max(self.last.get(key, end), end)

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds, self.first, self.last = {}, {}, {}

    def restore(self) -> None:
        for owner, attr, original in reversed(self.originals):
            setattr(owner, attr, original)
        self.originals = []


def cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread."""
    return time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=11)  # ~523 MB fp32
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--buckets-mib", default="32,128,512")
    parser.add_argument("--formats", default="flattened,per_tensor", help="flattened and/or per_tensor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads here and in the helper")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="parameters in Megatron's DDP buffer (as at DP > 1), not packed for the export")
    args = parser.parse_args()
    print(f"weight_sync: a {args.layers}-layer qwen3 (hidden {args.hidden}), {args.repeats} syncs per format and "
          f"bucket size; at the defaults about 50 s on 2 cores (model, engine and actor start-up ~30 s)", flush=True)
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
    from megatron_agent.weight_sync import WeightSync, WeightSyncConfig, is_flattened
    from rollout.engine_client import EngineClient
    from rollout.engine_launch import launch_engines, stop_engines

    default = WeightSyncConfig()
    default_case = (is_flattened(default.flattened, by_handles=False, distributed_optimizer=args.distributed_optimizer),
                    default.bucket_bytes)  # over a weight-update group
    cases = sorted({(fmt == "flattened", int(float(b) * MIB)) for fmt in args.formats.split(",")
                    for b in args.buckets_mib.split(",")} | {default_case}, key=lambda c: (not c[0], c[1]))
    load_before = os.getloadavg()
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
        actor = Actor(model_dir, ctx.parallel, ActorConfig(use_distributed_optimizer=args.distributed_optimizer),
                      AlgorithmConfig(use_kl_loss=False))
        actor_s = time.perf_counter() - t

        export_times, total, count = [], 0, 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            total, count = 0, 0
            with weight_sync._one_thread_on_cpu():  # as in a sync
                for _, tensor in actor.named_hf_weights():
                    total += tensor.numel() * tensor.element_size()
                    count += 1
            export_times.append(time.perf_counter() - t)
        export_s = statistics.median(export_times)

        raw = RawBroadcast(total, [chunks_of(total, b) for _, b in cases for _ in range(args.repeats)], threads)
        clock = Clock()
        clock.wrap(weight_sync, "send_weights", "answered")  # flattened: one bucket each
        clock.wrap(buckets_module.StreamedBuckets, "_complete", "answered")  # streamed: a bucket's end
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
                cpu, t = cpu_seconds(), time.perf_counter()
                metrics = sync.sync(version=f"{bucket}-{r}")
                cpu = cpu_seconds() - cpu
                seconds = metrics["weight_sync/seconds"]
                parts = {"write": clock.seconds.get("write", 0.0), "control": clock.seconds.get("control", 0.0),
                         "open": clock.first["broadcast"] - t, "cpu": cpu}
                parts["wire"] = clock.last["answered"] - clock.first["broadcast"]
                parts["close"] = seconds - parts["open"] - parts["wire"]
                runs.append((seconds, parts, metrics))
                raw_cpu = cpu_seconds()
                raw_times.append(raw.next())
                parts["raw_cpu"] = cpu_seconds() - raw_cpu
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
          f"{threads} torch threads, {os.cpu_count()} CPUs, parameters "
          f"{'in the DDP buffer' if args.distributed_optimizer else 'packed'}; load average (1 min) "
          f"{load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(f"setup: write model {write_s:.1f} s, engine start {engine_start_s:.1f} s, actor build {actor_s:.1f} s; "
          f"export alone (iterate named_hf_weights, one thread as in a sync) {export_s:.3f} s")
    print()
    print(f"median of {args.repeats} syncs after a warm-up sync, each followed by a raw gloo broadcast of the same "
          f"bytes in the same bucket sizes to a helper process")
    print(f"{'format':>10}{'bucket':>8}{'buckets':>8}{'sync s':>9}{'GB/s':>7}{'raw s':>8}{'raw GB/s':>9}{'raw/sync':>9}"
          f"{'1st s':>8}  | {'open':>6}{'wire':>7}{'close':>7} | {'write':>6}{'control':>8} | {'cpu':>6}{'raw cpu':>8}"
          f" | {'in place':>8}")
    for (flattened, bucket), seconds, raw_s, ratio, first_s, parts, metrics in rows:
        print(f"{'flattened' if flattened else 'per_tensor':>10}{bucket // MIB:>5}MiB{int(metrics['weight_sync/buckets']):>8}{seconds:>9.3f}"
              f"{metrics['weight_sync/bytes'] / 1e9 / seconds:>7.2f}{raw_s:>8.3f}"
              f"{total / 1e9 / raw_s:>9.2f}{ratio:>9.2f}{first_s:>8.2f}  | "
              f"{parts['open']:>6.3f}{parts['wire']:>7.3f}{parts['close']:>7.3f} | {parts['write']:>6.3f}"
              f"{parts['control']:>8.3f} | {parts['cpu']:>6.3f}{parts['raw_cpu']:>8.3f} | "
              f"{metrics['weight_sync/bytes_in_place'] / 1e6:>5.0f} MB")
    print("open + wire + close = sync s: open = start to the first broadcast (pause, begin, first bucket "
          "ready and announced), wire = first broadcast to the last bucket answered, close = end, "
          "continue, collectives; write = exported tensors into bucket buffers (flattened), control = the "
          "control requests (both overlap the above); cpu = this process's CPU seconds in the sync, raw cpu = in "
          "the raw broadcast; in place = bytes sent straight from the parameters' memory (medians are of the "
          "median-time run)")
    print(f"default config: {'flattened (laid-out runs from memory)' if default_case[0] else 'per tensor (streamed)'} "
          f"over a weight-update group, "
          f"{default.bucket_bytes // MIB} MiB buckets")
    _, _, _, ratio, _, _, metrics = next(r for r in rows if r[0] == default_case)
    print(f"weight_sync: {ratio:.2f} of raw broadcast ({total / 1e6:.0f} MB, "
          f"{int(metrics['weight_sync/buckets'])} buckets)")


if __name__ == "__main__":
    main()
