"""The weight-update group is never split from the trainer's default group.

On GPU the trainer binds its default group to its device (platform/distributed.py), and
torch's `_new_process_group_helper` then builds new NCCL groups by splitting the default
group's communicator: collective over the trainer's ranks only, while SGLang's members
of the weight-update group call ncclCommInitRank, so the first sync hangs. The split is
decided by torch's own code from the default group's `bound_device_id` (it asks
`_get_split_source` for the communicator to split); here a gloo default group carries
the binding a CUDA one would, and torch must never look for a split source while the
weight-update group is made.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from rollout.processes import free_port
from rollout.weight_group import destroy_weight_update_group, init_weight_update_group


@pytest.fixture
def default_group_bound_to_a_device():
    if dist.is_initialized():
        pytest.fail("a default process group leaked into this process from another test")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    default = distributed_c10d._get_default_group()
    default.bound_device_id = torch.device("cuda", 0)  # what init_process_group(device_id=cuda:0) sets
    try:
        yield default
    finally:
        dist.destroy_process_group()


def test_the_update_group_is_created_without_a_split(monkeypatch, default_group_bound_to_a_device):
    asked = []
    original = distributed_c10d._get_split_source
    monkeypatch.setattr(distributed_c10d, "_get_split_source", lambda pg: asked.append(pg) or original(pg))
    pg = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "weight-update-test", timeout_s=30)
    try:
        assert asked == [], "torch looked for a communicator to split the weight-update group from"
        assert default_group_bound_to_a_device.bound_device_id == torch.device("cuda", 0)  # put back
        t = torch.arange(4.0)
        dist.broadcast(t, src=0, group=pg)  # the group works
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        destroy_weight_update_group(pg)


def test_a_bound_default_group_is_what_makes_torch_split(monkeypatch, default_group_bound_to_a_device):
    """The premise, on torch's own helper: a new group on a bound default group asks for a
    split source (so the test above can fail)."""
    asked = []
    original = distributed_c10d._get_split_source
    monkeypatch.setattr(distributed_c10d, "_get_split_source", lambda pg: asked.append(pg) or original(pg))
    group = dist.new_group([0], backend="gloo")
    assert asked == [default_group_bound_to_a_device]
    dist.destroy_process_group(group)
