"""The embedded engine's side of a weight update (`rollout/embedded_engine.py` calls these):
receiving an announced bucket from the sender (rank 0 of the weight-update group) straight
into the model, and finding the model tensor a checkpoint-format HF name refers to.

No copy after the wire where the layout allows it:
- per tensor: each broadcast lands in its parameter when dtype, shape and contiguity match;
  every receive of the bucket is posted at once (as SGLang does), so the sender's
  broadcasts never wait for the engine to ask for the next tensor;
- flattened bucket: when the bucket's parameters already lie back to back in one storage,
  in the announced order, the bucket lands there; otherwise, when every name is a whole
  parameter of the bucket's dtype, the bucket is received into a fresh buffer that the
  parameters then *adopt* as their storage (so the next sync of the same layout lands in
  place). Anything else (slices of fused experts, tied names twice, dtype casts) is
  received into a reused scratch buffer and copied once.

Writing into live parameters needs the caller to hold the model's lock; a bucket that
fails half way leaves the model partly updated, as with SGLang (the trainer syncs again).
"""

from __future__ import annotations

import re

import torch

from rollout.weight_group import tensor_nbytes, unflatten_bucket, wait_all, wire_view

_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def receive_tensors(pg: torch.distributed.ProcessGroup, dtypes: list[torch.dtype], shapes: list[list[int]], *,
                    flattened: bool) -> list[torch.Tensor]:
    """Receive one bucket's tensors into fresh memory (no model): one uint8 tensor in the
    flattened-bucket layout, or (not `flattened`) one broadcast per tensor, in order."""
    if flattened:
        bucket = torch.empty(sum(tensor_nbytes(s, d) for s, d in zip(shapes, dtypes)), dtype=torch.uint8)
        torch.distributed.broadcast(bucket, src=0, group=pg)
        return unflatten_bucket(bucket, dtypes, shapes)
    tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    _receive_all(pg, tensors)
    return tensors


def receive_per_tensor(pg, targets: list[torch.Tensor], dtypes: list[torch.dtype], shapes: list[list[int]]) -> None:
    """One broadcast per tensor, each straight into its target where it can land there."""
    targets, landing, taken = [t.detach() for t in targets], [], set()
    for t, d, s in zip(targets, dtypes, shapes):  # a name tied to one already received lands aside
        in_place = lands_in_place(t, d, s) and t.data_ptr() not in taken
        taken.add(t.data_ptr())
        landing.append(t if in_place else torch.empty(s, dtype=d))
    _receive_all(pg, landing)
    for target, received in zip(targets, landing):
        if received is not target:
            target.copy_(received)


def _receive_all(pg, tensors: list[torch.Tensor]) -> None:
    """Post one broadcast receive per tensor, in order, then wait for them all."""
    wait_all([torch.distributed.broadcast(wire_view(t), src=0, group=pg, async_op=True) for t in tensors])


def receive_flat_bucket(pg, targets: list[torch.Tensor], dtypes: list[torch.dtype], shapes: list[list[int]],
                        scratch: torch.Tensor) -> torch.Tensor:
    """Receive one flattened bucket into `targets` (in place, adopted, or via `scratch`);
    returns the scratch buffer to keep for the next bucket (grown if it was too small)."""
    nbytes = sum(tensor_nbytes(s, d) for s, d in zip(shapes, dtypes))
    span = storage_span(targets, dtypes, shapes)
    if span is not None:
        torch.distributed.broadcast(span, src=0, group=pg)
        return scratch
    if adoptable(targets, dtypes, shapes):
        bucket = torch.empty(nbytes, dtype=torch.uint8)
        torch.distributed.broadcast(bucket, src=0, group=pg)
        for param, view in zip(targets, unflatten_bucket(bucket, dtypes, shapes)):
            param.data = view
        return scratch
    if scratch.numel() < nbytes:
        scratch = torch.empty(nbytes, dtype=torch.uint8)
    torch.distributed.broadcast(scratch[:nbytes], src=0, group=pg)
    for target, view in zip(targets, unflatten_bucket(scratch[:nbytes], dtypes, shapes)):
        target.detach().copy_(view)
    return scratch


def checkpoint_tensors(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of an HF model directory's safetensors files, as stored (FP8 ones too)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return [pair for f in files for pair in load_file(str(f)).items()]


def lands_in_place(target: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    return target.dtype == dtype and tuple(target.shape) == tuple(shape) and target.is_contiguous()


def storage_span(targets: list[torch.Tensor], dtypes: list[torch.dtype], shapes: list[list[int]]) -> torch.Tensor | None:
    """A uint8 view of the bytes `targets` occupy when they lie back to back in one
    storage, in order, each as announced (else None): the bucket can land there."""
    if not targets or not all(lands_in_place(t, d, s) for t, d, s in zip(targets, dtypes, shapes)):
        return None
    storage = targets[0].untyped_storage()
    start = targets[0].storage_offset() * targets[0].element_size()
    end = start
    for t in targets:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() * t.element_size() != end:
            return None
        end += t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=targets[0].device).set_(storage, start, (end - start,))


def adoptable(targets: list[torch.Tensor], dtypes: list[torch.dtype], shapes: list[list[int]]) -> bool:
    """Every target a whole parameter of the announced dtype and shape, none twice."""
    return (all(isinstance(t, torch.nn.Parameter) and t.dtype == d and tuple(t.shape) == tuple(s)
                for t, d, s in zip(targets, dtypes, shapes))
            and len({id(t) for t in targets}) == len(targets))


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


_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def vision_weight_view(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """`weight_view` for a vision-language model held by transformers 5, whose in-memory
    names (`model.visual.*`, `model.language_model.*`) are not every checkpoint's:
    - Qwen2.5-VL checkpoints name the tower `visual.*` and the language model `model.*`;
    - Qwen3-VL-MoE checkpoints (and the trainer's export) hold the fused experts in the
      published layout, gate_up_proj [E, H, 2I] and down_proj [E, I, H], while memory
      holds [E, 2I, H] and [E, H, I]: those names map to the transposed view."""
    if name.startswith("visual."):
        name = "model." + name
    elif name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
        name = "model.language_model." + name.removeprefix("model.")
    view = weight_view(state, name)
    if view is not None and name.endswith(_FUSED_EXPERTS) and view.dim() == 3:
        return view.transpose(1, 2)
    return view
