"""Where the trainer ranks and the rollout engines run.

    launcher=local, trainer_ranks=1   the rank runs in this process (the CPU main job)
    launcher=local, trainer_ranks=N   N spawned processes on this machine (gloo or NCCL)
    launcher=ray                      Ray actors in placement groups: one bundle per trainer
                                      rank; engines in bundles of their own (disaggregated)
                                      or in the trainer bundles (colocate=true)

colocate=true: the engines share the trainer's machine and devices. They release their
memory while the actor trains and get the weights as tensor handles (shared memory on
CPU, CUDA IPC on GPU: engine_fleet.py, weight_sync/tensor_sync.py). With launcher=local
the engines are the ones rank 0 starts here, or `engine.urls` on this machine; with Ray,
they go into the trainer bundles, all on one node when the weights go as tensor handles
(STRICT_PACK). On GPUs (`engine.gpus_per_engine` >= 1) engine k runs on the GPUs of
trainer bundles k*g .. k*g+g-1 (g = gpus_per_engine: one engine rank per trainer GPU);
its actor sits in the first of them, and it and each trainer actor ask Ray for
COLOCATED_GPU_SHARE of their bundle's GPU, so both fit and Ray gives both that device.
`validate_colocation` checks these at config time.

Every launcher runs the rank function it is given (the driver's `train_rank`) on every
rank; rank 0 writes run_dir/metrics.jsonl and run_dir/progress.json, which this process
follows to report progress. With Ray and no `ray_address`, a local Ray instance is started
for the run and stopped after it; `ray_address=auto` joins the cluster that
slurm/train.sbatch started.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LAUNCHERS = ("local", "ray")
# Colocated on GPUs: the share of a trainer bundle's one GPU that its trainer actor, and
# the colocated engine actor in it, each ask Ray for. Ray only counts it (both then get
# the bundle's device); what each process takes of the memory is set elsewhere (SGLang:
# --mem-fraction-static, rollout/engine_launch.py).
COLOCATED_GPU_SHARE = 0.5


@dataclass
class PlacementConfig:
    launcher: str = "local"  # "local" | "ray"
    trainer_ranks: int = 1  # tp * pp * cp * data-parallel size
    ray_address: str | None = None  # None: a local Ray instance for this run; "auto": the running cluster
    cpus_per_trainer: int = 1
    gpus_per_trainer: int = 0  # 1 on GPU clusters
    # Engines share the trainers' machine and devices (with Ray: their bundles), release
    # their memory while the actor trains, and take the weights as tensor handles.
    colocate: bool = False
    ready_timeout_s: float = 600.0  # to get the placement groups' resources
    runtime_env: dict = field(default_factory=dict)  # Ray runtime_env of the actors (env_vars, ...)

    def validate(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}; choose one of {LAUNCHERS}")
        if self.trainer_ranks < 1:
            raise ValueError(f"trainer_ranks={self.trainer_ranks} must be >= 1")


def validate_colocation(config) -> None:
    """Where the engines run against the trainer (ValueError says what to change): the
    GPUs of engines this run starts under Ray (`engine_gpu_problem`), and the weight
    path: tensor handles (`weight_sync.transport=tensor`, colocate's default) only reach
    engines on the trainer's machine."""
    from megatron_agent.engine_fleet import TRANSPORTS, weight_transport

    p, e, transport = config.placement, config.engine, config.weight_sync.transport
    if transport not in (None, *TRANSPORTS):
        raise ValueError(f"weight_sync.transport={transport!r}; choose one of {TRANSPORTS} (or null: "
                         "tensor when placement.colocate, else broadcast)")
    if p.colocate and getattr(config, "overlap_rollout", False):
        raise ValueError("placement.colocate=true gives the engines' memory to the actor while it trains, so "
                         "nothing rolls out then: overlap_rollout=true needs colocate=false")
    problem = engine_gpu_problem(config)
    if problem:
        raise ValueError(problem)
    if weight_transport(config) != "tensor":
        return
    if p.launcher == "ray" and not p.colocate and not e.urls:
        raise ValueError("weight_sync.transport=tensor hands over tensor handles, which only engines on the "
                         "trainer's machine can open: with launcher=ray set placement.colocate=true (engines "
                         "in the trainer bundles, one node), or use transport=broadcast")
    if e.urls and p.launcher != "local":
        raise ValueError("weight_sync.transport=tensor with engine.urls needs placement.launcher=local (the "
                         "trainer on the engines' machine); under Ray use transport=broadcast")
    remote = [u for u in e.urls if not is_this_machine(u)]
    if remote:
        raise ValueError(f"weight_sync.transport=tensor (placement.colocate={p.colocate}) needs the engines on "
                         f"this machine, and {remote} is not; use weight_sync.transport=broadcast")


def engine_gpu_problem(config) -> str | None:
    """Why the engines this run starts under Ray cannot have the GPUs they need (None: they
    can). SGLang runs on GPUs: an actor that asks Ray for none sees every GPU of its node
    and SGLang takes the first, whoever holds it. Colocated, engine ranks go one per
    trainer GPU (`colocated_engine_bundles`)."""
    p, e = config.placement, config.engine
    if p.launcher != "ray" or e.urls:
        return None
    if e.mem_fraction_static is not None and not 0 < e.mem_fraction_static < 1:
        return f"engine.mem_fraction_static={e.mem_fraction_static} must be in (0, 1) (or null)"
    if e.server == "sglang" and e.gpus_per_engine < 1:
        return ("engine.server=sglang runs on GPUs: set engine.gpus_per_engine (its TP size, >= 1); with "
                "gpus_per_engine=0 its Ray actor gets no GPU and SGLang takes the node's first, another's")
    if not (p.colocate and e.gpus_per_engine > 0):
        return None
    if p.gpus_per_trainer != 1:
        return (f"placement.colocate=true with engine.gpus_per_engine={e.gpus_per_engine}: colocated engines run "
                f"on the trainer ranks' GPUs, one GPU per rank: set placement.gpus_per_trainer=1 "
                f"(it is {p.gpus_per_trainer})")
    needed = e.num_engines * e.gpus_per_engine
    if needed > p.trainer_ranks:
        fits = p.trainer_ranks // e.gpus_per_engine
        return (f"placement.colocate=true: engine.num_engines={e.num_engines} x engine.gpus_per_engine="
                f"{e.gpus_per_engine} engine ranks need {needed} GPUs, and the {p.trainer_ranks} trainer ranks "
                f"have {p.trainer_ranks} (a GPU holds one trainer rank and at most one engine rank): "
                + (f"set engine.num_engines <= {fits}" if fits else
                   f"set engine.gpus_per_engine <= {p.trainer_ranks}"))
    return None


def is_this_machine(url: str) -> bool:
    """Whether `url`'s host is this machine (loopback, its name or its address)."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(url if "//" in url else f"//{url}").hostname or ""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127."):
        return True
    try:
        name = socket.gethostname()
        return host in (name, socket.getfqdn()) or host in socket.gethostbyname_ex(name)[2]
    except OSError:
        return False


def launch(config, train_rank, on_iteration=None, on_progress=None) -> list[dict]:
    """Run `train_rank(config, on_iteration=None, launch_engines=None, on_progress=None)`
    on every trainer rank; return rank 0's metrics rows."""
    from megatron_agent.run_dir import read_metrics

    placement = config.placement
    if placement.launcher == "local" and placement.trainer_ranks == 1:
        return train_rank(config, on_iteration, on_progress=on_progress)
    run = _launch_local if placement.launcher == "local" else _launch_on_ray
    finished = threading.Event()
    follower = threading.Thread(target=follow_metrics,
                                args=(Path(config.run_dir), finished, on_iteration, on_progress),
                                name="metrics-follower", daemon=True)
    follower.start()
    try:
        run(config, train_rank)  # in this thread: Ray installs signal handlers only from the main thread
    finally:
        finished.set()
        follower.join()
    return read_metrics(Path(config.run_dir))


def follow_metrics(run_dir: Path, finished: threading.Event, on_iteration=None, on_progress=None,
                   poll_s: float = 0.5) -> None:
    """Until `finished`: call `on_iteration(row)` for each new row of run_dir/metrics.jsonl
    and `on_progress(progress)` for each new state in run_dir/progress.json."""
    from megatron_agent.progress import read_progress

    path, offset, last = run_dir / "metrics.jsonl", 0, -1
    shown = None
    while True:
        done = finished.wait(poll_s)
        progress = read_progress(run_dir) if on_progress is not None else None
        if progress is not None and progress != shown:
            shown = progress
            on_progress(progress)
        if path.exists():
            with path.open() as f:
                if os.fstat(f.fileno()).st_size < offset:  # rewritten (a resumed run's first rows)
                    offset = 0
                f.seek(offset)
                for line in f:
                    if not line.endswith("\n"):
                        break  # still being written
                    offset += len(line.encode())
                    row = json.loads(line)
                    if row["iteration"] > last:
                        last = row["iteration"]
                        if on_iteration is not None:
                            on_iteration(row)
        if done:
            return


# --- local processes ------------------------------------------------------------------

def _launch_local(config, train_rank) -> None:
    from megatron_agent.platform.launch import run_on_ranks

    run_on_ranks(train_rank, config.placement.trainer_ranks, config, timeout_s=float("inf"),
                 threads_per_rank=config.placement.cpus_per_trainer)


# --- Ray ------------------------------------------------------------------------------

def colocated_on_gpu(config) -> bool:
    """Whether the run starts engines that take GPUs inside the trainer bundles."""
    p, e = config.placement, config.engine
    return p.colocate and not e.urls and e.gpus_per_engine > 0


def colocated_engine_bundles(config) -> list[list[int]]:
    """The trainer bundles each colocated engine runs in, its actor in the first: on GPUs
    engine k spans the `gpus_per_engine` bundles from k * gpus_per_engine; on CPUs
    engine k shares bundle k % trainer_ranks."""
    p, e = config.placement, config.engine
    if colocated_on_gpu(config):
        g = e.gpus_per_engine
        return [list(range(k * g, (k + 1) * g)) for k in range(e.num_engines)]
    return [[k % p.trainer_ranks] for k in range(e.num_engines)]


def trainer_actor_resources(config) -> dict[str, float]:
    """What each trainer rank's actor asks Ray for (in its bundle)."""
    p = config.placement
    share = COLOCATED_GPU_SHARE if colocated_on_gpu(config) else 0
    return {"num_cpus": p.cpus_per_trainer, "num_gpus": p.gpus_per_trainer - share}


def engine_actor_resources(engine_config, shares_trainer_gpu: bool) -> dict[str, float]:
    """What an engine's actor asks Ray for: a thread per rank, and its GPUs, or, colocated
    on GPUs, COLOCATED_GPU_SHARE of the first trainer bundle it spans (the other GPUs it
    runs on are named to it: `colocated_engine_devices`)."""
    e = engine_config
    return {"num_cpus": e.threads_per_engine * e.ranks_per_engine,
            "num_gpus": COLOCATED_GPU_SHARE if shares_trainer_gpu else e.gpus_per_engine}


def trainer_bundles(config) -> list[dict]:
    """One bundle per trainer rank (a whole GPU each on GPUs); with colocate, each engine's
    threads are added to the first bundle it spans. Every actor placed in a bundle asks for
    a part of it: `trainer_actor_resources`, `engine_actor_resources`."""
    p, e = config.placement, config.engine
    bundles = [{"CPU": p.cpus_per_trainer, **({"GPU": p.gpus_per_trainer} if p.gpus_per_trainer else {})}
               for _ in range(p.trainer_ranks)]
    if p.colocate and not e.urls:
        engine_cpus = engine_actor_resources(e, colocated_on_gpu(config))["num_cpus"]
        for spanned in colocated_engine_bundles(config):
            bundles[spanned[0]]["CPU"] += engine_cpus
    return bundles


def trainer_strategy(config) -> str:
    """Ray's placement of the trainer bundles: one node when colocated engines take the
    weights as tensor handles (which name this node's memory), else packed."""
    from megatron_agent.engine_fleet import weight_transport

    return "STRICT_PACK" if config.placement.colocate and weight_transport(config) == "tensor" else "PACK"


def engine_bundles(config) -> list[dict]:
    """Disaggregated: one bundle per engine, what its actor asks for (its threads, its
    GPUs); none when colocated or when the engines are an external fleet (engine.urls)."""
    p, e = config.placement, config.engine
    if p.colocate or e.urls:
        return []
    wants = engine_actor_resources(e, shares_trainer_gpu=False)
    return [{"CPU": wants["num_cpus"], **({"GPU": wants["num_gpus"]} if wants["num_gpus"] else {})}
            for _ in range(e.num_engines)]


def colocated_engine_devices(config, trainer_devices: list[tuple[str, list[str]]]) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each colocated engine: the GPUs of the trainer bundles it
    spans, from each trainer actor's (node IP, Ray GPU ids) (`TrainerRankActor.device`).
    One engine's bundles must be on one node (RuntimeError otherwise)."""
    devices = []
    for k, spanned in enumerate(colocated_engine_bundles(config)):
        nodes = sorted({trainer_devices[b][0] for b in spanned})
        if len(nodes) > 1:
            raise RuntimeError(f"colocated engine {k} would span trainer ranks {spanned}, which Ray placed on "
                               f"{len(nodes)} nodes ({', '.join(nodes)}); an engine runs on one node: make "
                               "engine.gpus_per_engine divide the GPUs of a node, or use weight_sync.transport="
                               "tensor (one node, STRICT_PACK) or placement.colocate=false")
        devices.append(",".join(str(gpu) for b in spanned for gpu in trainer_devices[b][1]))
    return devices


class TrainerRankActor:
    """One trainer rank in a Ray actor (made remote in `_launch_on_ray`)."""

    def address(self) -> tuple[str, int]:
        import ray

        from megatron_agent.platform import free_port

        return ray.util.get_node_ip_address(), free_port()

    def device(self) -> tuple[str, list[str]]:
        """This rank's node IP and the ids of the GPUs Ray gave it (CUDA_VISIBLE_DEVICES)."""
        import ray

        return ray.util.get_node_ip_address(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def run(self, train_rank, config, rank: int, world_size: int, master: tuple[str, int],
            launch_engines=None) -> None:
        import ray
        import torch

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]),
                          # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: device 0 is ours.
                          LOCAL_RANK="0")
        torch.set_num_threads(config.placement.cpus_per_trainer)
        config.weight_sync.master_address = ray.util.get_node_ip_address()  # engines connect here
        train_rank(config, launch_engines=launch_engines)


class EngineActor:
    """One rollout engine (embedded or SGLang) started by a Ray actor on its node."""

    def __init__(self):
        self.engine = None

    def start(self, engine_config, model_dir: str, log_dir: str, index: int,
              colocated_devices: str | None = None) -> str:
        """Start the engine; return its URL, which names this node by the IP Ray knows it
        by. `colocated_devices`: the CUDA_VISIBLE_DEVICES of an engine colocated on the
        trainer ranks' GPUs (its memory saver on: `sglang_server_command`)."""
        import ray

        from rollout.engine_launch import launch_embedded_engines, start_sglang_server

        node_ip = ray.util.get_node_ip_address()
        if engine_config.server == "sglang":
            self.engine = start_sglang_server(engine_config, model_dir, log_dir, index, advertise_host=node_ip,
                                              colocated=colocated_devices is not None,
                                              cuda_visible_devices=colocated_devices)
        else:
            one = dataclasses.replace(engine_config, num_engines=1)
            self.engine = launch_embedded_engines(one, model_dir, log_dir, advertise_host=node_ip)[0]
        return self.engine.url

    def pid(self) -> int:
        return self.engine.pid

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()


@dataclass
class RayEngine:
    url: str
    actor: Any

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        except Exception as err:  # a dead actor: nothing left to stop
            log.warning("engine %s did not stop cleanly: %s", self.url, err)
        ray.kill(self.actor)


@dataclass
class RayEngineLauncher:
    """The driver's `launch_engines` under Ray: one EngineActor per engine, each in its
    bundle of `placement_group` (picklable, so rank 0's actor can restart engines).
    `colocated_devices`: colocated on GPUs, each engine's CUDA_VISIBLE_DEVICES
    (`colocated_engine_devices`); its actor then asks for COLOCATED_GPU_SHARE."""

    placement_group: Any
    bundle_indices: list[int]
    colocated_devices: list[str] | None = None

    def __call__(self, engine_config, model_dir, log_dir) -> list[RayEngine]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(EngineActor)
        wants = engine_actor_resources(engine_config, shares_trainer_gpu=self.colocated_devices is not None)
        actors = [remote.options(**wants,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, bundle))
                  .remote() for bundle in self.bundle_indices]
        devices = self.colocated_devices or [None] * len(actors)
        try:
            urls = ray.get([a.start.remote(engine_config, str(model_dir), str(log_dir), i, devices[i])
                            for i, a in enumerate(actors)])
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        return [RayEngine(url, actor) for url, actor in zip(urls, actors)]


def ensure_ray(placement: PlacementConfig, *, cpus: float) -> bool:
    """Connect this process to Ray: `placement.ray_address`, or a new local instance of at
    least `cpus` CPUs (never another cluster that runs on this machine). True when the
    instance was started here (its starter shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if placement.ray_address:
        ray.init(address=placement.ray_address, runtime_env=placement.runtime_env or None)
        return False
    ray.init(address="local", num_cpus=max(math.ceil(cpus), os.cpu_count() or 1), include_dashboard=False,
             runtime_env=placement.runtime_env or None)
    return True


def _launch_on_ray(config, train_rank) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from megatron_agent.platform.launch import RankFailed
    from megatron_agent.run_dir import model_dir_of

    # Actors may run in other directories (and on other nodes, over a shared file system).
    config = dataclasses.replace(config, run_dir=str(Path(config.run_dir).resolve()),
                                 model_dir=str(Path(model_dir_of(config)).resolve()),
                                 resume=config.resume and str(Path(config.resume).resolve()))
    p = config.placement
    trainers, engines = trainer_bundles(config), engine_bundles(config)
    started_here = ensure_ray(p, cpus=sum(b["CPU"] for b in trainers + engines))
    groups, actors = [], []
    try:
        trainer_group = placement_group(trainers, strategy=trainer_strategy(config))
        groups.append(trainer_group)
        engine_group = placement_group(engines, strategy="PACK") if engines else None
        if engine_group is not None:
            groups.append(engine_group)
        for group, bundles in zip(groups, (trainers, engines)):
            ready, _ = ray.wait([group.ready()], timeout=p.ready_timeout_s)
            if not ready:
                raise RuntimeError(f"Ray could not place {bundles} within {p.ready_timeout_s:.0f} s; "
                                   f"the cluster has {ray.cluster_resources()}"
                                   + ("; tensor handles need the trainers and their colocated engines on one "
                                      "node (STRICT_PACK): across nodes use weight_sync.transport=broadcast"
                                      if trainer_strategy(config) == "STRICT_PACK" else ""))
        remote = ray.remote(TrainerRankActor)
        actors = [remote.options(**trainer_actor_resources(config),
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(trainer_group, i)).remote()
                  for i in range(p.trainer_ranks)]
        master = ray.get(actors[0].address.remote())
        if engine_group is not None:
            launcher = RayEngineLauncher(engine_group, list(range(len(engines))))
        else:
            devices = (colocated_engine_devices(config, ray.get([a.device.remote() for a in actors]))
                       if colocated_on_gpu(config) else None)
            launcher = RayEngineLauncher(trainer_group, [spanned[0] for spanned in colocated_engine_bundles(config)],
                                         devices)
        pending = {a.run.remote(train_rank, config, rank, p.trainer_ranks, master,
                                launcher if rank == 0 else None): rank
                   for rank, a in enumerate(actors)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                ray.get(done[0])
            except Exception as err:
                raise RankFailed(f"trainer rank {rank} of {p.trainer_ranks} failed:\n{err}") from None
    finally:
        for a in actors:
            ray.kill(a)
        for group in groups:
            remove_placement_group(group)
        if started_here:
            time.sleep(0.1)
            ray.shutdown()
