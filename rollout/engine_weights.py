"""The embedded engine's side of a weight update (`rollout/embedded_engine.py` calls these):
receiving an announced bucket from the sender (`weight_group.send_weights`, rank 0), and
finding the model tensor a checkpoint-format HF name refers to."""

from __future__ import annotations

import re

import torch

from rollout.weight_group import unflatten_bucket

_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def receive_tensors(pg: torch.distributed.ProcessGroup, dtypes: list[torch.dtype], shapes: list[list[int]], *,
                    flattened: bool) -> list[torch.Tensor]:
    """Receive one bucket's tensors by broadcast from rank 0 of `pg`: one uint8 tensor in
    the flattened-bucket layout, or (not `flattened`) one broadcast per tensor, in order."""
    if flattened:
        nbytes = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes))
        bucket = torch.empty(nbytes, dtype=torch.uint8)
        torch.distributed.broadcast(bucket, src=0, group=pg)
        return unflatten_bucket(bucket, dtypes, shapes)
    tensors = []
    for shape, dtype in zip(shapes, dtypes):
        t = torch.empty(shape, dtype=dtype)
        torch.distributed.broadcast(t, src=0, group=pg)
        tensors.append(t)
    return tensors


def weight_view(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor of a model's `state_dict()` that a checkpoint-format HF name refers to
    (None if none does); tied weights appear under both names, one storage.

    transformers >= 5 keeps MoE experts fused in memory (`experts.gate_up_proj`
    [E, 2F, H], `experts.down_proj` [E, H, F]) while checkpoints, SGLang and the
    trainer's export use one tensor per expert: those names map to slices."""
    if name in state:
        return state[name]
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj" and f"{prefix}.down_proj" in state:
        return state[f"{prefix}.down_proj"][expert]
    fused = state.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    gate, up = fused[expert].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up
