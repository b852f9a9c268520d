"""What both sides of a weight update share: the weight-update process group, the
flattened-bucket layout, dtype names and the weight checksum. The trainer's sender is
megatron_agent/weight_sync; the receivers are the engines (rollout/engine_weights.py,
SGLang).

SGLang's `/init_weights_update_group` builds its group like this, and so must the
trainer, or the two never meet: a TCP rendezvous store at master_address:master_port
(the group's rank 0, the trainer's sender, hosts it), wrapped in a PrefixStore named
after group_name, then a new process group on that store. A plain
`init_process_group` would create the *default* group and not meet the server there.

The group is a world of its own (the trainer's sender and the engines' ranks), never a
part of the caller's default group: see `_never_split_from_default_group`.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _get_default_group,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` members joined.

    The result works with `dist.broadcast(tensor, src=0, group=pg)` without a default
    process group in the calling process.
    """
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # Private torch API; the same call SGLang's server makes, so the keys on the store
    # (prefixes included) are the same on both sides.
    kwargs = {"backend_options": None} if _accepts("backend_options") else {"pg_options": None}
    with _never_split_from_default_group():
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **kwargs
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextmanager
def _never_split_from_default_group():
    """Have torch build the group's own communicator (ncclCommInitRank, as SGLang's side
    does), not split one from the default group's.

    torch (2.11, 2.13) splits every new NCCL group from the default group's communicator
    (ncclCommSplit) when the default group is bound to a device
    (`init_process_group(device_id=...)`, as platform/distributed.py does on GPU):
    `_new_process_group_helper` decides it by `_get_default_group().bound_device_id`.
    A split is collective over the default group, which holds the trainer's ranks and
    none of the engines', while SGLang's members call ncclCommInitRank: the first
    broadcast hangs. The binding is lifted for the call and put back after it (it is a
    plain attribute: setting it touches no live communicator)."""
    default = _get_default_group() if dist.is_initialized() else None
    bound = default.bound_device_id if default is not None else None
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def destroy_weight_update_group(pg: dist.ProcessGroup) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # never initialised as the default group: drop the references ourselves
        _world.pg_group_ranks.pop(pg, None)
        _world.pg_map.pop(pg, None)
        _world.pg_names.pop(pg, None)


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding every tensor's bytes, in order (load_format "flattened_bucket")."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(
    bucket: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]
) -> list[torch.Tensor]:
    """The inverse of `flatten_bucket`: views into `bucket` with the given dtypes and shapes."""
    out, offset = [], 0
    for dtype, shape in zip(dtypes, shapes):
        nbytes = tensor_nbytes(shape, dtype)
        out.append(bucket[offset:offset + nbytes].view(dtype).reshape(shape))
        offset += nbytes
    if offset != bucket.numel():
        raise ValueError(f"flattened bucket holds {bucket.numel()} bytes, the tensors need {offset}")
    return out


def wait_all(works: list) -> None:
    """Wait for every started collective, also after one failed (each may still be reading or
    writing its tensor, which the caller keeps until then); then raise the first failure."""
    first = None
    for work in works:
        try:
            work.wait()
        except Exception as err:
            first = first or err
    if first is not None:
        raise first


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a process group broadcasts it: float8 as its bytes (gloo has no
    float8 type; NCCL moves the same bytes either way)."""
    return tensor.view(torch.uint8) if tensor.dtype in _FLOAT8 else tensor


_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def tensor_nbytes(shape, dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * dtype.itemsize


def weight_checksum(tensor: torch.Tensor) -> float:
    """A position-sensitive checksum (a fixed pseudo-random weighting of every element, in
    float64): swapped rows or heads change it, unlike a plain sum. The trainer and the
    engine compute it the same way to check a weight sync. A tensor on a GPU is copied to
    the CPU first (the weighting is drawn there, so both sides draw the same)."""
    flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.rand(flat.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(flat.numel()))
    return float((flat * (weights + 0.5)).sum())


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _accepts(param: str) -> bool:
    import inspect

    return param in inspect.signature(_new_process_group_helper).parameters
