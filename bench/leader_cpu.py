"""The leader's CPU per step sample: one process today against W rollout workers on Ray.

    python bench/leader_cpu.py [--quick] [--workers 1 2 4] [--groups 32] [--group-size 8]

Rollouts of ALFWorld-sized text episodes against a simulated SGLang engine, through the
real rollout workers (megatron_agent/rollout_workers.py): GiGPO, the asynchronous agent
loop, one env worker process per rollout worker. The env and the engine are in
bench/simulated_engine.py: a room, its objects and the admissible commands (1-2 kB an
observation, ~1.2 kB on average, varying every step; the window of the last 2 steps,
their responses included, makes chat-templated prompts of ~3,000 tokens of the tiny
byte-level BPE tokenizer, at ~1.4 bytes a token); one engine process, an HTTP server per
worker, answering each request after 20 ms of sleep with 200-500 tokens drawn from its
sampling seed, whose action the env accepts part of the time.

W = 1 runs as today: the worker is an object in the coordinator's process. W > 1 runs on
a Ray cluster made here (`ray.cluster_utils.Cluster`: a head node, the trainer's, and one
node per worker offering the `rollout_node` resource, rollout.node_resource), each worker
a Ray actor on its node; the job's runtime_env puts bench/ on the workers' PYTHONPATH and
imports simulated_engine in each (`worker_process_setup_hook`), so that the env is
registered there. Every W rolls out the same iterations (the same seeds: the same
episodes) after one warm-up iteration. Per step sample it prints:
- coordinator: CPU seconds (time.process_time, all threads) of the coordinator's process
  in `RolloutWorkers.collect` and `assign_by_tokens`;
- workers: each worker's CPU seconds (`RolloutWorkers.cpu_seconds()` deltas) over its
  rollout and the compact shards it serves to the DP heads, over its own step samples,
  and the CPU a second a worker spends while idle (Ray's threads);
- DP heads: the CPU of fetching each DP rank's shards and building its TrainBatch
  (`batch_from_shards`), which each DP group's first rank does itself (not rank 0);
- one process today (T, W = 1): collect plus every DP rank's batch built there.

Then the visual job (Sokoban's 96x96 frames, configs/env/sokoban-visual.yaml, a tiny
Qwen3-VL; the engine counts each image's tokens with the model's image processor): the
pickled bytes of everything the coordinator receives from the workers (the results of
every `RolloutWorkers.call` of a collect) and the image bytes among them (HxWx3 uint8
frames, float pixel values; the goal: none), in an iteration and in one that writes
episodes as samples, against W = 1, where rank 0 holds and scatters every shard.

Last line: `leader_cpu: coordinator C ms, worker P ms per step sample at W workers (one
process today: T ms)` for the largest W. Prints figures; never asserts a time. About 3
minutes on 2 cores (--quick: about 1 minute, most of it starting Ray; its single
iteration of ~200 samples gives rough figures only).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STARTED = time.perf_counter()
BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path[:0] = [p for p in (str(REPO), str(BENCH_DIR)) if p not in sys.path]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import simulated_engine  # noqa: E402  (registers bench_household here)

NODE_RESOURCE = "rollout_node"
TEXT_ENV = "bench_household"
IDLE_S = 2.0  # how long the workers' CPU is watched while they wait for calls


def build_config(model_dir: str, args, workers: int, *, visual: bool = False):
    """The run config of one measurement: the text job (the household env, a 2-step window)
    or the visual one (env=sokoban-visual)."""
    from megatron_agent.run_config import load_run_config, validate_run_config
    from rollout.prompts import PromptConfig

    common = [f"model_dir={model_dir}", f"rollout.workers={workers}", f"rollout.node_resource={NODE_RESOURCE}",
              "env_workers=1", "val_every=0", "samples_every=0", "save_every=0", "engine.requests_per_call=1",
              "engine.max_inflight_per_engine=64", f"loop.sampling.max_new_tokens={args.max_tokens}",
              "loop.sampling.temperature=1.0"]
    if visual:
        return load_run_config(["env=sokoban-visual", f"num_groups={args.visual_groups}", "group_size=4",
                                "loop.max_steps=8", *common])
    config = load_run_config(["algorithm=gigpo", f"num_groups={args.groups}", f"group_size={args.group_size}",
                              f"loop.max_steps={args.max_steps}", "env_backend=process", *common])
    config.env, config.env_config = TEXT_ENV, {"max_steps": args.max_steps}
    config.loop.prompt = PromptConfig(memory="window", history_length=args.history,
                                      max_prompt_tokens=args.max_prompt_tokens)
    validate_run_config(config)
    return config


def start_cluster(nodes: int):
    """A head node (the trainer's, no rollout_node) and `nodes` rollout nodes; this
    process connected to it, its workers able to find the bench's env."""
    import ray
    from ray.cluster_utils import Cluster

    store = 100 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, resources={NODE_RESOURCE: 1}, object_store_memory=store)
    cluster.wait_for_nodes()
    path = os.pathsep.join([str(BENCH_DIR), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"},
                          "worker_process_setup_hook": "simulated_engine.register_envs"})
    return cluster


class Meter:
    """The pickled bytes of what the coordinator receives from the workers, and the image
    bytes among them, while `on`."""

    def __init__(self, workers):
        self.on, self.total, self.images, self.by_method = False, 0, 0, {}
        call = workers.call

        def counted(method, args, *, record=True):
            results = call(method, args, record=record)
            if self.on:
                self.add(method, results)
            return results

        workers.call = counted

    def add(self, method: str, obj) -> None:
        size, images = pickled_size(obj)
        self.total += size
        self.images += images
        self.by_method[method] = self.by_method.get(method, 0) + size


class _ImageCountingPickler(pickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.image_bytes = 0

    def reducer_override(self, obj):
        import torch

        if isinstance(obj, np.ndarray) and obj.dtype == np.uint8 and obj.ndim == 3 and obj.shape[-1] in (3, 4):
            self.image_bytes += obj.nbytes  # a frame
        elif isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.ndim == 2:
            self.image_bytes += obj.numel() * obj.element_size()  # an image processor's pixel values
        return NotImplemented


def pickled_size(obj) -> tuple[int, int]:
    """(pickled bytes, image bytes among them) of `obj`."""
    buffer = io.BytesIO()
    pickler = _ImageCountingPickler(buffer)
    pickler.dump(obj)
    return buffer.tell(), pickler.image_bytes


def dp_batches(workers, collected, positions: list[np.ndarray], *, pad_id: int, temperature: float,
               meter_shards: list | None = None) -> None:
    """Every DP rank's TrainBatch, as its DP head builds it: its shards from the workers
    (Ray actors: straight from them; W = 1: through RolloutWorkers.fetch), then
    batch_from_shards."""
    from megatron_agent.worker_batches import batch_from_shards, shard_order

    for p in positions:
        sources = collected.sources[p]
        if workers.remote:
            import ray

            rows = workers.rows_of(sources)
            shards = ray.get([h.shard.remote(collected.iteration, r, collected.moments)
                              for h, r in zip(workers.handles, rows)])
        else:
            shards = workers.fetch(collected.iteration, sources, collected.moments)
        if meter_shards is not None:
            meter_shards.append(pickled_size(shards))
        batch_from_shards(shards, shard_order(sources), p, collected.size, pad_id=pad_id,
                          temperature=temperature).tensors()


@dataclasses.dataclass
class Figures:
    workers: int
    iterations: int
    samples: int = 0
    coordinator_s: float = 0.0
    batches_s: float = 0.0  # DP heads' fetch + batch_from_shards (W = 1: in the coordinator)
    worker_s: np.ndarray | None = None  # per worker: its rollout and the shards it serves
    worker_shards_s: np.ndarray | None = None  # per worker: the shards it serves
    idle_ms_per_s: np.ndarray | None = None  # per worker: CPU ms per second while it waits for calls (Ray's threads)
    worker_samples: np.ndarray | None = None
    wall_s: float = 0.0
    prompt_tokens: list = dataclasses.field(default_factory=list)
    response_tokens: list = dataclasses.field(default_factory=list)

    def ms(self, seconds: float, samples: int | None = None) -> float:
        return 1e3 * seconds / max(samples if samples is not None else self.samples, 1)


def measure(config, model_dir: str, urls: list[str], args) -> Figures:
    """Warm-up iteration, then `args.iterations` measured ones."""
    from transformers import AutoTokenizer

    from megatron_agent.rollout_workers import RolloutWorkers
    from megatron_agent.worker_batches import assign_by_tokens

    count = config.rollout.workers
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    temperature = config.loop.sampling.temperature
    figures = Figures(count, args.iterations, worker_s=np.zeros(count), worker_shards_s=np.zeros(count),
                      worker_samples=np.zeros(count, dtype=np.int64))
    workers = RolloutWorkers(config, model_dir)
    try:
        for iteration in range(1 + args.iterations):
            measured = iteration > 0
            before = np.array(workers.cpu_seconds())
            wall, c0 = time.perf_counter(), time.process_time()
            collected = workers.collect(iteration, urls)
            positions = assign_by_tokens(collected.lengths, args.dp)
            c1 = time.process_time()
            middle = np.array(workers.cpu_seconds()) if workers.remote else None
            c2 = time.process_time()  # (the call above is the benchmark's, not the coordinator's)
            dp_batches(workers, collected, positions, pad_id=pad_id, temperature=temperature)
            c3, wall = time.process_time(), time.perf_counter() - wall
            after = np.array(workers.cpu_seconds())
            if not measured:
                continue
            figures.samples += collected.size
            figures.coordinator_s += c1 - c0
            figures.batches_s += c3 - c2
            figures.worker_s += after - before
            if middle is not None:
                figures.worker_shards_s += after - middle
            figures.worker_samples += np.bincount(collected.sources[:, 0], minlength=count)
            figures.wall_s += wall
            if not workers.remote:
                held = workers.handles[0].samples(iteration)
                figures.prompt_tokens += [len(s.prompt_ids) for s in held]
                figures.response_tokens += [len(s.response_ids) for s in held]
        if workers.remote:
            before = np.array(workers.cpu_seconds())
            time.sleep(IDLE_S)
            figures.idle_ms_per_s = 1e3 * (np.array(workers.cpu_seconds()) - before) / IDLE_S
    finally:
        workers.close()
    return figures


def visual_bytes(model_dir: str, urls: list[str], args, workers: int) -> dict:
    """One visual iteration (after a warm-up): the bytes the coordinator receives from the
    workers and the image bytes among them; the shards' bytes (to the DP heads)."""
    from transformers import AutoTokenizer

    from megatron_agent.rollout_workers import RolloutWorkers
    from megatron_agent.worker_batches import assign_by_tokens

    config = build_config(model_dir, args, workers, visual=True)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    pool = RolloutWorkers(config, model_dir)
    meter = Meter(pool)
    out = {}
    try:
        for iteration, keep in ((0, 0), (1, 0), (2, 4)):  # warm-up; an iteration; one writing samples
            meter.on, meter.total, meter.images, meter.by_method = iteration > 0, 0, 0, {}
            collected = pool.collect(iteration, urls, keep_episodes=keep)
            meter.on = False
            shards: list = []
            dp_batches(pool, collected, assign_by_tokens(collected.lengths, args.dp), pad_id=pad_id,
                       temperature=config.loop.sampling.temperature, meter_shards=shards)
            if iteration:
                out[keep] = dict(samples=collected.size, total=meter.total, images=meter.images,
                                 by_method=dict(meter.by_method), shards=sum(s for s, _ in shards),
                                 shard_images=sum(i for _, i in shards))
    finally:
        pool.close()
    return out


def print_table(rows: list[Figures]) -> None:
    print(f"\n{'W':>2} {'samples':>8} {'coordinator':>12} {'workers: all (each)':>30} {'shards':>7} {'DP heads':>9} "
          f"{'Ray idle':>9} {'wall':>6}")
    print(f"{'':>2} {'per it.':>8} {'ms/sample':>12} {'ms/sample':>30} {'of it':>7} {'ms/sample':>9} "
          f"{'ms/s':>9} {'s/it.':>6}")
    for f in rows:
        if f.workers == 1:
            worker, shards, idle = "(in the coordinator)", "", ""
        else:
            each = " ".join(f"{f.ms(s, int(n)):.2f}" for s, n in zip(f.worker_s, f.worker_samples))
            worker, shards = f"{f.ms(f.worker_s.sum()):.2f} ({each})", f"{f.ms(f.worker_shards_s.sum()):.2f}"
            idle = f"{f.idle_ms_per_s.mean():.1f}"
        print(f"{f.workers:>2} {f.samples / f.iterations:>8.0f} {f.ms(f.coordinator_s):>12.3f} {worker:>30} "
              f"{shards:>7} {f.ms(f.batches_s):>9.2f} {idle:>9} {f.wall_s / f.iterations:>6.1f}")
    print("coordinator: its process in collect + assign_by_tokens; workers: each one's process over its own samples\n"
          "(its rollout and the shards it serves, `shards` of it); DP heads: fetching the shards and batch_from_shards\n"
          "(W = 1: rank 0 fetches and builds every rank's); Ray idle: a worker's CPU a second while it waits for calls")


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer groups, one measured iteration (~1 minute)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=3, help="measured, after one warm-up")
    ap.add_argument("--max-steps", type=int, default=15)
    ap.add_argument("--history", type=int, default=2, help="loop.prompt.history_length")
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=500, help="the longest response (the shortest: 200)")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--dp", type=int, default=4, help="DP ranks the batch is split over")
    ap.add_argument("--visual-groups", type=int, default=8)
    ap.add_argument("--visual-workers", type=int, default=2)
    ap.add_argument("--no-visual", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.group_size, args.iterations, args.visual_groups = 8, 4, 1, 4
    if 1 not in args.workers:
        args.workers = [1, *args.workers]
    args.workers = sorted(set(args.workers))
    if args.groups < max(args.workers):
        ap.error(f"--groups {args.groups}: each of {max(args.workers)} workers needs a whole group")

    from megatron_agent.models.tiny import progress_bars_off, write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="leader-cpu-"))
    procs, cluster = [], None
    try:
        with progress_bars_off():
            text_model = str(write_tiny_model("qwen3", tmp / "text", tokenizer="bpe",
                                              max_position_embeddings=args.max_prompt_tokens + args.max_tokens))
            visual_model = None if args.no_visual else str(write_tiny_model("qwen3_vl", tmp / "vlm", tokenizer="bpe"))
        most = max(args.workers)
        urls, proc = simulated_engine.start_engine(text_model, ports=most, latency_ms=args.latency_ms,
                                                   max_tokens=args.max_tokens)
        procs.append(proc)
        print(f"{args.groups} groups x {args.group_size} episodes (up to {args.max_steps} steps), window of "
              f"{args.history} steps, responses 200-{args.max_tokens} tokens after {args.latency_ms:g} ms; "
              f"W = {args.workers}; {args.iterations} measured iteration(s) after a warm-up; DP {args.dp}", flush=True)
        rows = []
        for w in args.workers:
            if w > 1 and cluster is None:
                cluster = start_cluster(most)
                print(f"Ray cluster: a head node and {most} nodes with {NODE_RESOURCE}", flush=True)
            rows.append(measure(build_config(text_model, args, w), text_model, urls, args))
            f = rows[-1]
            print(f"W={w}: {f.samples} step samples in {f.iterations} iteration(s), {f.wall_s:.1f} s", flush=True)
        today = rows[0]
        prompts, responses = np.array(today.prompt_tokens), np.array(today.response_tokens)
        print(f"\nprompt tokens: mean {prompts.mean():.0f}, p50 {np.median(prompts):.0f}, p90 "
              f"{np.percentile(prompts, 90):.0f}, max {prompts.max()}; response tokens: mean {responses.mean():.0f}")
        print_table(rows)
        t_ms = today.ms(today.coordinator_s + today.batches_s)
        print(f"one process today (W=1): collect {today.ms(today.coordinator_s):.2f} ms + every DP batch "
              f"{today.ms(today.batches_s):.2f} ms = {t_ms:.2f} ms per step sample")

        if visual_model is not None:
            vurls, vproc = simulated_engine.start_engine(visual_model, ports=most, latency_ms=args.latency_ms,
                                                         actions="sokoban", max_tokens=args.max_tokens)
            procs.append(vproc)
            vw = min(args.visual_workers, most) if cluster is not None else 1
            print(f"\nvisual job (env=sokoban-visual, 96x96 frames, tiny qwen3_vl), {args.visual_groups} groups x 4:")
            for w in sorted({1, vw}):
                for keep, b in visual_bytes(visual_model, vurls, args, w).items():
                    kind = "an iteration" if keep == 0 else f"writing {keep} episodes as samples"
                    through = b["total"] + (b["shards"] if w == 1 else 0)
                    images = b["images"] + (b["shard_images"] if w == 1 else 0)
                    print(f"  W={w}, {kind}: {b['samples']} step samples; through rank 0 {through / 1e3:.1f} kB, "
                          f"image bytes {images / 1e3:.1f} kB"
                          + (f" (calls {b['total'] / 1e3:.1f} kB: "
                             + ", ".join(f"{m} {v / 1e3:.1f}" for m, v in b["by_method"].items())
                             + f"; shards to the DP heads {b['shards'] / 1e3:.1f} kB, image bytes "
                             f"{b['shard_images'] / 1e3:.1f} kB)" if w > 1 else " (rank 0 fetches every shard)"))
                    if w == 1 and keep == 0:
                        print(f"    image bytes a step sample in the shards: {b['shard_images'] / b['samples'] / 1e3:.1f} kB "
                              f"(the image processor's float32 pixel values; the frame itself is "
                              f"{96 * 96 * 3 / 1e3:.1f} kB of uint8)")
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    top = rows[-1]
    c_ms = top.ms(top.coordinator_s)
    p_ms = top.ms(top.worker_s.sum()) if top.workers > 1 else c_ms
    print(f"(wall {time.perf_counter() - STARTED:.0f} s)")
    print(f"leader_cpu: coordinator {c_ms:.3f} ms, worker {p_ms:.2f} ms per step sample at {top.workers} workers "
          f"(one process today: {t_ms:.2f} ms)")
    return {"coordinator_ms": c_ms, "worker_ms": p_ms, "today_ms": t_ms}


if __name__ == "__main__":
    main()
