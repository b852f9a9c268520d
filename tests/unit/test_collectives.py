"""Collectives on Megatron's groups take tensors on the group's device (NCCL: CUDA only).

- `group_device` reads the group's backend: the current CUDA device for NCCL (a mixed
  "cpu:gloo,cuda:nccl" group included), the CPU for gloo;
- the helpers hand torch.distributed the moved tensor and write the result back into
  the caller's;
- no module of the trainer (nor a multi-rank test) calls a torch.distributed tensor
  collective on a Megatron group, or on the default group, except through
  `megatron_agent.platform.collectives`: on GPU those groups are NCCL, and a CPU tensor
  there fails the first DP > 1 or PP > 1 step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_agent.platform import collectives

ROOT = Path(__file__).resolve().parents[2]

# name -> index of the `group` argument when it is passed by position
TENSOR_COLLECTIVES = {
    "all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2, "reduce": 3,
    "reduce_scatter": 3, "reduce_scatter_tensor": 3, "gather": 3, "scatter": 3, "send": 2, "recv": 2,
    "isend": 2, "irecv": 2, "all_to_all": 2, "all_to_all_single": 4,
}


@pytest.mark.parametrize("backend, expected", [
    ("nccl", torch.device("cuda", 3)),
    ("cpu:gloo,cuda:nccl", torch.device("cuda", 3)),
    ("gloo", torch.device("cpu")),
])
def test_group_device_follows_the_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.group_device(object()) == expected


@pytest.mark.parametrize("name, call", [
    ("all_reduce", lambda t, g: collectives.all_reduce(t, g)),
    ("broadcast", lambda t, g: collectives.broadcast(t, 0, g)),
])
def test_the_moved_tensor_is_reduced_and_written_back(monkeypatch, name, call):
    group, seen = object(), []
    # Stand in for a move to another device: a distinct tensor object.
    monkeypatch.setattr(collectives, "_on_group_device", lambda t, g: (seen.append(g), t.clone())[1])

    def collective(tensor, *args, group=None, **kwargs):
        seen.append(group)
        tensor.add_(10)

    monkeypatch.setattr(dist, name, collective)
    original = torch.tensor([1.0, 2.0])
    assert call(original, group) is original
    assert original.tolist() == [11.0, 12.0]
    assert seen == [group, group]


def _group_argument(call: ast.Call, position: int) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "group":
            return keyword.value
    return call.args[position] if len(call.args) > position else None


def _is_megatron_group(expr: ast.expr | None) -> bool:
    """None (the default group) or a call of parallel_state's `get_..._group()` getters
    (their `_gloo` twins are gloo groups, which take CPU tensors)."""
    if expr is None:
        return True
    if not isinstance(expr, ast.Call):
        return False
    name = expr.func.attr if isinstance(expr.func, ast.Attribute) else getattr(expr.func, "id", "")
    return name.startswith("get_") and name.endswith("_group")


def direct_collectives_on_megatron_groups(source: str) -> list[str]:
    """`line: call` of each torch.distributed tensor collective on a Megatron group."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = ast.unparse(node.func.value)
        if owner not in ("dist", "torch.distributed") or node.func.attr not in TENSOR_COLLECTIVES:
            continue
        if _is_megatron_group(_group_argument(node, TENSOR_COLLECTIVES[node.func.attr])):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_rule_finds_what_it_looks_for():
    found = direct_collectives_on_megatron_groups(
        "dist.all_reduce(t, group=ps.get_data_parallel_group())\n"
        "dist.broadcast(t, 0, parallel_state.get_pipeline_model_parallel_group())\n"
        "torch.distributed.all_reduce(t)\n"
        "dist.all_reduce(t, group=ps.get_data_parallel_group_gloo())\n"
        "dist.all_reduce(t, group=control_group())\n"
        "dist.broadcast(t, src=0, group=pg)\n"
    )
    assert [line.split(":")[0] for line in found] == ["1", "2", "3"]


def test_no_direct_collective_on_a_megatron_group():
    files = sorted((ROOT / "megatron_agent").rglob("*.py")) + sorted((ROOT / "tests" / "multirank").rglob("*.py"))
    allowed = ROOT / "megatron_agent" / "platform" / "collectives.py"
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in files if path != allowed
             for hit in direct_collectives_on_megatron_groups(path.read_text())]
    assert not found, "use megatron_agent.platform.collectives (tensors on the group's device):\n" + "\n".join(found)
