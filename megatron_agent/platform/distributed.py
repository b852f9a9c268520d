"""Process start-up: torch.distributed, Megatron's parallel groups, seeds.

One call, `init_distributed`, sets up a rank the same way on CPU (gloo) and GPU (NCCL
for model traffic, plus a gloo group for control messages either way). Rank and world
size come from the usual torchrun / Ray environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without them the process is a world of one.
"""

from __future__ import annotations

import logging
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


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    parallel: ParallelConfig
    data_parallel_size: int


def die_with_parent() -> None:
    """In a child process: be SIGKILLed when the thread that started it dies (Linux), so a
    killed trainer leaves no engine or checkpoint writer behind. A no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError("MASTER_PORT must be set when WORLD_SIZE > 1")
            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if device.type == "cuda" else None,
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
    if dist.is_initialized():
        dist.destroy_process_group()
