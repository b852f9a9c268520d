"""Start the trainer ranks (and, under Ray, the engines) where placement.py says, and
follow rank 0's metrics while they run.

    launch(config, train_rank)   launcher=local with 1 rank: in this process; with N: N local
                                 processes; launcher=ray: Ray actors in the placement groups
                                 placement.py plans (`trainer_bundles`, `engine_bundles`)

Rank 0 writes run_dir/metrics.jsonl and run_dir/progress.json; `follow_metrics` reads them
here to report progress. With Ray and no `placement.ray_address`, `ensure_ray` starts a
local Ray instance for the run, stopped after it; `ray_address=auto` joins the cluster
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_agent.placement import (
    PlacementConfig,
    colocated_engine_bundles,
    colocated_engine_devices,
    colocated_on_gpu,
    engine_actor_resources,
    engine_bundles,
    trainer_actor_resources,
    trainer_bundles,
    trainer_strategy,
)

log = logging.getLogger(__name__)


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


# --- Ray actors -------------------------------------------------------------------------

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
