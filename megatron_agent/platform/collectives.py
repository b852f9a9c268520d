"""Collectives on Megatron's process groups, with tensors on the group's device.

Megatron's groups (data, tensor, pipeline, expert parallel; the default group) use the
model backend: NCCL on GPU, which takes CUDA tensors only, and gloo on CPU. The
trainer's bookkeeping (counts, gathered logprob rows, metric sums) is made on the CPU.
Every collective over one of those groups goes through here: the tensor is moved to
the group's device for the call and the result written back into it, so the caller
never has to know which backend it runs on. `control_group()` (gloo on every platform)
takes CPU tensors as they are. tests/unit/test_collectives.py holds the rule that no
other module calls a torch.distributed collective on a Megatron group directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_device(group=None) -> torch.device:
    """Where a collective over `group` (None: the default group) takes its tensors: the
    current CUDA device when the group's backend is NCCL (also in a mixed
    "cpu:gloo,cuda:nccl" group, whose CUDA tensors NCCL carries), else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_group_device(tensor: torch.Tensor, group) -> torch.Tensor:
    device = group_device(group)
    return tensor if tensor.device == device else tensor.to(device)


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`dist.all_reduce` of `tensor` in place, on `group`'s device; returns `tensor`."""
    moved = _on_group_device(tensor, group)
    dist.all_reduce(moved, op=op, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`dist.broadcast` of `tensor` from global rank `src` in place, on `group`'s device;
    returns `tensor`."""
    moved = _on_group_device(tensor, group)
    dist.broadcast(moved, src=src, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor
