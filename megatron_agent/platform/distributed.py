"""Process start-up: torch.distributed, Megatron's parallel groups, seeds.

One call, `init_distributed`, sets up a rank the same way on CPU (gloo) and GPU (NCCL
for model traffic, plus a gloo group for control messages either way). Rank and world
size come from the usual torchrun / Ray environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without them the process is a world of one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_agent.platform.cpu_support import enable_cpu_support
from megatron_agent.platform.device import detect_platform
from megatron_agent.platform.parallel import ParallelConfig, destroy_model_parallel, initialize_model_parallel

log = logging.getLogger(__name__)

_control_group = None
_peer_groups: dict[tuple[int, ...], object] = {}  # gloo groups of the ranks sharing a DP index, by layout


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    parallel: ParallelConfig
    data_parallel_size: int


def die_with_parent(parent_pid: int | None = None) -> None:
    """In a child process: be SIGKILLed when the thread that started it dies (Linux), so a
    killed trainer leaves no engine, checkpoint writer or trainer rank behind. A no-op
    elsewhere. The *thread*: start such children from one that lives as long as the
    process (the main thread). `parent_pid`, the starter's pid: a child that checks in
    late (a spawned process imports for seconds first) and finds it already gone dies
    now, since the kernel only signals a death after the request."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    parallel: ParallelConfig | None = None,
    *,
    seed: int = 1234,
    backend: str | None = None,
    timeout_minutes: int = 30,
) -> DistributedContext:
    """Initialise torch.distributed and Megatron's groups for `parallel`; seed everything.

    The layout is validated before any process group is created.
    """
    parallel = parallel or ParallelConfig()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dp = parallel.validate(world_size)

    platform = detect_platform()
    backend = backend or platform.backend
    if platform.is_cpu:
        enable_cpu_support()
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # One rank with no port given meets no one: an in-memory store, so no port is picked
        # free and then found taken by another process before the store binds it.
        alone = world_size == 1 and "MASTER_PORT" not in os.environ
        if world_size > 1 and "MASTER_PORT" not in os.environ:
            raise RuntimeError("MASTER_PORT must be set when WORLD_SIZE > 1")
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if device.type == "cuda" else None,
            store=dist.HashStore() if alone else None,
        )
    global _control_group
    _control_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD

    initialize_model_parallel(parallel, world_size)
    set_seed(seed)
    log.info(
        "rank %d/%d on %s (%s): tp=%d pp=%d vpp=%s cp=%d ep=%d etp=%d dp=%d",
        rank, world_size, device, backend, parallel.tp, parallel.pp, parallel.vpp,
        parallel.cp, parallel.ep, parallel.expert_tp, dp,
    )
    return DistributedContext(rank, world_size, local_rank, device, backend, parallel, dp)


def control_group():
    """A gloo group over all ranks for small host-side messages (on GPU too)."""
    if _control_group is None:
        raise RuntimeError("init_distributed() has not run")
    return _control_group


def from_leader(obj):
    """Rank 0's `obj` on every rank (pickled over the control group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


@dataclass(frozen=True)
class DataParallelPeers:
    """Where a rank stands among the data-parallel ranks (TP, PP and CP peers share a DP
    index and so the data): its DP index, each index's first rank, and its peers' group."""

    dp_index: int
    heads: tuple[int, ...]  # the lowest world rank of each DP index
    group: object  # a gloo group of this rank's peers (None when it has none)


def data_parallel_peers() -> DataParallelPeers:
    """Collective: every rank calls it (the groups are made once per layout)."""
    from megatron.core import parallel_state

    mine = torch.tensor([parallel_state.get_data_parallel_rank()])
    indices = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(indices, mine, group=control_group())
    layout = tuple(int(i) for i in indices)
    members = [[r for r, d in enumerate(layout) if d == index] for index in range(max(layout) + 1)]
    if layout not in _peer_groups:
        groups = [dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None for ranks in members]
        _peer_groups[layout] = groups
    dp_index = layout[dist.get_rank()]
    return DataParallelPeers(dp_index, tuple(ranks[0] for ranks in members), _peer_groups[layout][dp_index])


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def _sendable(specs: dict[str, tuple]) -> list[str]:
    return [name for name in sorted(specs) if math.prod(specs[name][0]) > 0]


def scatter_to_data_parallel(parts: list[dict[str, torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    """The leader's `parts[d]` (named CPU tensors, one dict per DP index d; None on the
    other ranks) on every rank of DP index d. Only shapes and dtypes are pickled; the
    leader sends each part's tensors to the first rank of its DP index, which broadcasts
    them to its TP/PP/CP peers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return parts[0]
    peers = data_parallel_peers()
    rank, group = dist.get_rank(), control_group()
    specs = from_leader(None if parts is None else [_specs(part) for part in parts])
    if len(specs) != len(peers.heads):
        raise ValueError(f"{len(specs)} parts for {len(peers.heads)} data-parallel ranks")
    mine = specs[peers.dp_index]
    if rank == 0:
        sends = [dist.isend(parts[d][name].contiguous(), dst=head, group=group)
                 for d, head in enumerate(peers.heads) if head != 0 for name in _sendable(specs[d])]
        for request in sends:
            request.wait()
        received = {name: parts[peers.dp_index][name].contiguous() for name in mine}
    else:
        received = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in mine.items()}
        if rank == peers.heads[peers.dp_index]:
            for name in _sendable(mine):
                dist.recv(received[name], src=0, group=group)
    return _broadcast_to_peers(received, mine, peers)


def share_with_peers(tensors: dict[str, torch.Tensor] | None, peers: DataParallelPeers | None):
    """The first rank of each DP index's named CPU tensors (None on its peers) on every rank
    of that index (`peers`: data_parallel_peers(), None in a single process)."""
    if peers is None or peers.group is None:
        return tensors
    head = peers.heads[peers.dp_index]
    box = [None if tensors is None else _specs(tensors)]
    dist.broadcast_object_list(box, src=head, group=peers.group)
    specs = box[0]
    received = tensors if tensors is not None else {
        name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    return _broadcast_to_peers(received, specs, peers)


def _broadcast_to_peers(received: dict[str, torch.Tensor], specs: dict[str, tuple], peers: DataParallelPeers):
    if peers.group is not None:
        head = peers.heads[peers.dp_index]
        for name in _sendable(specs):
            dist.broadcast(received[name], src=head, group=peers.group)
    return received


def gather_from_data_parallel(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """Each DP index's named CPU tensors (as its first rank holds them) on the leader, in DP
    order; None on the other ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [tensors]
    peers = data_parallel_peers()
    rank, group = dist.get_rank(), control_group()
    is_head = rank == peers.heads[peers.dp_index]
    specs = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(_specs(tensors) if is_head else None, specs, dst=0, group=group)
    if rank != 0:
        if is_head:
            for name in _sendable(_specs(tensors)):
                dist.send(tensors[name].contiguous(), dst=0, group=group)
        return None
    parts = []
    for head in peers.heads:
        if head == 0:
            parts.append(dict(tensors))
            continue
        part = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs[head].items()}
        for name in _sendable(specs[head]):
            dist.recv(part[name], src=head, group=group)
        parts.append(part)
    return parts


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch; Megatron's tracker gets per-TP/EP streams.

    Pipeline stages get different default seeds (seed + 100 * pp_rank), as in Megatron's
    own training scripts, so stages do not draw identical random numbers.
    """
    from megatron.core import parallel_state, tensor_parallel

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def shutdown_distributed() -> None:
    global _control_group
    destroy_model_parallel()
    _control_group = None
    _peer_groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
