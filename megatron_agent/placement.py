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

This module is the plan: the config, its checks and the Ray bundles. launcher.py starts
what it plans (`launch`, the Ray actors, `ensure_ray`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    if p.colocate and getattr(getattr(config, "training", None), "mode", "sync") != "sync":
        raise ValueError("placement.colocate=true gives the engines' memory to the actor while it trains, so "
                         "nothing rolls out then: training.mode=overlap or async needs colocate=false")
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


# --- Ray bundles ----------------------------------------------------------------------

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
