"""Where the trainer ranks and the rollout engines run.

    launcher=local, trainer_ranks=1   the rank runs in this process (the CPU main job)
    launcher=local, trainer_ranks=N   N spawned processes on this machine (gloo or NCCL)
    launcher=ray                      Ray actors in placement groups: one bundle per trainer
                                      rank; engines in bundles of their own (disaggregated)
                                      or in the trainer bundles (colocate=true, one node)

colocate=true: the engines share the trainer's machine and devices. They release their
memory while the actor trains and get the weights as tensor handles (shared memory on
CPU, CUDA IPC on GPU: engine_fleet.py, weight_sync/tensor_sync.py). With launcher=local
the engines are the ones rank 0 starts here, or `engine.urls` on this machine; with Ray,
they go into the trainer bundles, all on one node (STRICT_PACK). `validate_colocation`
checks these at config time.

Every launcher runs the rank function it is given (the driver's `train_rank`) on every
rank; rank 0 writes run_dir/metrics.jsonl, which this process follows to report
progress. With Ray and no `ray_address`, a local Ray instance is started for the run and
stopped after it; `ray_address=auto` joins the cluster that slurm/train.sbatch started.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LAUNCHERS = ("local", "ray")


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
    """The weight path against where the engines run (ValueError says what to change):
    tensor handles (`weight_sync.transport=tensor`, colocate's default) only reach engines
    on the trainer's machine."""
    from megatron_agent.engine_fleet import TRANSPORTS, weight_transport

    p, e, transport = config.placement, config.engine, config.weight_sync.transport
    if transport not in (None, *TRANSPORTS):
        raise ValueError(f"weight_sync.transport={transport!r}; choose one of {TRANSPORTS} (or null: "
                         "tensor when placement.colocate, else broadcast)")
    if p.colocate and getattr(config, "overlap_rollout", False):
        raise ValueError("placement.colocate=true gives the engines' memory to the actor while it trains, so "
                         "nothing rolls out then: overlap_rollout=true needs colocate=false")
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


def launch(config, train_rank, on_iteration=None) -> list[dict]:
    """Run `train_rank(config, on_iteration=None, launch_engines=None)` on every trainer
    rank; return rank 0's metrics rows."""
    from megatron_agent.run_dir import read_metrics

    placement = config.placement
    if placement.launcher == "local" and placement.trainer_ranks == 1:
        return train_rank(config, on_iteration)
    run = _launch_local if placement.launcher == "local" else _launch_on_ray
    finished = threading.Event()
    follower = threading.Thread(target=follow_metrics, args=(Path(config.run_dir), finished, on_iteration),
                                name="metrics-follower", daemon=True)
    follower.start()
    try:
        run(config, train_rank)  # in this thread: Ray installs signal handlers only from the main thread
    finally:
        finished.set()
        follower.join()
    return read_metrics(Path(config.run_dir))


def follow_metrics(run_dir: Path, finished: threading.Event, on_iteration=None, poll_s: float = 0.5) -> None:
    """Call `on_iteration(row)` for each new row of run_dir/metrics.jsonl until `finished`."""
    path, offset, last = run_dir / "metrics.jsonl", 0, -1
    while True:
        done = finished.wait(poll_s)
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

def trainer_bundles(config) -> list[dict]:
    """One bundle per trainer rank; with colocate, engine i's share is added to bundle i."""
    p, e = config.placement, config.engine
    bundles = [{"CPU": p.cpus_per_trainer, **({"GPU": p.gpus_per_trainer} if p.gpus_per_trainer else {})}
               for _ in range(p.trainer_ranks)]
    if p.colocate and not e.urls:
        for i in range(e.num_engines):
            bundles[i % len(bundles)]["CPU"] += e.threads_per_engine * e.ranks_per_engine
    return bundles


def trainer_strategy(config) -> str:
    """Ray's placement of the trainer bundles: one node when colocated engines take the
    weights as tensor handles (which name this node's memory), else packed."""
    from megatron_agent.engine_fleet import weight_transport

    return "STRICT_PACK" if config.placement.colocate and weight_transport(config) == "tensor" else "PACK"


def engine_bundles(config) -> list[dict]:
    """Disaggregated: one bundle per engine (its threads, its GPUs); none when colocated or
    when the engines are an external fleet (engine.urls)."""
    p, e = config.placement, config.engine
    if p.colocate or e.urls:
        return []
    return [{"CPU": e.threads_per_engine * e.ranks_per_engine,
             **({"GPU": e.gpus_per_engine} if e.gpus_per_engine else {})}
            for _ in range(e.num_engines)]


class TrainerRankActor:
    """One trainer rank in a Ray actor (made remote in `_launch_on_ray`)."""

    def address(self) -> tuple[str, int]:
        import ray

        from megatron_agent.platform import free_port

        return ray.util.get_node_ip_address(), free_port()

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

    def start(self, engine_config, model_dir: str, log_dir: str, index: int) -> str:
        from rollout.engine_launch import launch_embedded_engines, start_sglang_server

        if engine_config.server == "sglang":
            self.engine = start_sglang_server(engine_config, model_dir, log_dir, index)
        else:
            one = dataclasses.replace(engine_config, num_engines=1)
            self.engine = launch_embedded_engines(one, model_dir, log_dir)[0]
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
    bundle of `placement_group` (picklable, so rank 0's actor can restart engines)."""

    placement_group: Any
    bundle_indices: list[int]

    def __call__(self, engine_config, model_dir, log_dir) -> list[RayEngine]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(EngineActor)
        actors = [remote.options(num_cpus=engine_config.threads_per_engine * engine_config.ranks_per_engine,
                                 num_gpus=engine_config.gpus_per_engine,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, bundle))
                  .remote() for bundle in self.bundle_indices]
        try:
            urls = ray.get([a.start.remote(engine_config, str(model_dir), str(log_dir), i)
                            for i, a in enumerate(actors)])
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        return [RayEngine(url, actor) for url, actor in zip(urls, actors)]


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
    started_here = not ray.is_initialized() and p.ray_address is None
    if started_here:
        needed = sum(b["CPU"] for b in trainers + engines)
        ray.init(num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False,
                 runtime_env=p.runtime_env or None)
    elif not ray.is_initialized():
        ray.init(address=p.ray_address, runtime_env=p.runtime_env or None)
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
        actors = [remote.options(num_cpus=p.cpus_per_trainer, num_gpus=p.gpus_per_trainer,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(trainer_group, i)).remote()
                  for i in range(p.trainer_ranks)]
        master = ray.get(actors[0].address.remote())
        launcher = (RayEngineLauncher(engine_group, list(range(len(engines)))) if engine_group is not None
                    else RayEngineLauncher(trainer_group, [i % p.trainer_ranks
                                                           for i in range(config.engine.num_engines)]))
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
