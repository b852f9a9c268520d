"""The wire format of `/update_weights_from_tensor`, both sides (the colocated weight path).

The trainer hands the engine *handles* to tensors it holds, not their bytes: a bucket of
weights is packed into one buffer (CPU shared memory, or GPU memory that CUDA IPC can
open), and the request carries, per engine TP rank, a base64 string of a torch
`ForkingPickler` pickle of the tensors. It is SGLang's (0.5.23) format:

    {"serialized_named_tensors": [<one string per TP rank>], "load_format": null |
     "flattened_bucket", "flush_cache": bool, "weight_version": str | null}

- `load_format` null: each string unpickles to a list of (HF name, tensor) pairs (here,
  views into the bucket's one buffer);
- "flattened_bucket": to {"flattened_tensor": uint8 buffer, "metadata": [objects with
  name, shape, dtype, start_idx, end_idx, numel]}, start/end being byte offsets (plain
  `types.SimpleNamespace`s: SGLang's restricted unpickler accepts them, and the sender
  needs no SGLang class).

Each rank gets a string of its own, serialized once per rank (SGLang: a CUDA IPC handle
is counted once per consumer). On CPU, torch shares memory through file descriptors by
default, which a server that is not our child cannot receive: the sender switches to the
"file_system" strategy (`use_file_system_sharing`), so a handle is a shared-memory file
name. The receiver unpickles with an allowlist (`RestrictedUnpickler`): the body of an
HTTP request must not be able to run code.
"""

from __future__ import annotations

import base64
import io
import pickle
import types

import torch

ALIGN_BYTES = 16  # every tensor starts at a multiple of this in the buffer (a dtype view needs it)
FLATTENED = "flattened_bucket"


def use_file_system_sharing() -> None:
    """CPU tensors shared by file name (what an unrelated process can open)."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def pack_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """One uint8 buffer holding every tensor's bytes (on the tensors' device; in shared
    memory on CPU), and each tensor's place in it."""
    metadata, offset = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype,
                                              start_idx=offset, end_idx=offset + nbytes, numel=nbytes))
        offset = _aligned(offset + nbytes)
    device = named_tensors[0][1].device if named_tensors else torch.device("cpu")
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    if buffer.device.type == "cpu":
        use_file_system_sharing()
        buffer.share_memory_()
    for (_, t), meta in zip(named_tensors, metadata):
        buffer[meta.start_idx:meta.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer, metadata


def unpack_bucket(buffer: torch.Tensor, metadata) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `buffer`) for each entry of `metadata`."""
    return [(m.name, buffer[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


_CUDA_DEVICE_ARG = 6  # the device index among rebuild_cuda_tensor's arguments


def serialize(obj) -> str:
    """torch's ForkingPickler pickle of `obj`, base64 (SGLang's MultiprocessingSerializer
    with output_str=True). A CUDA tensor's device goes as its UUID, not its index: the
    engine may see the GPUs numbered otherwise (CUDA_VISIBLE_DEVICES); SGLang's receiver
    maps a UUID back to its own index, and so does `deserialize_named_tensors`."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    class HandlePickler(ForkingPickler):
        def reducer_override(self, obj):
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                return NotImplemented
            rebuild, args = reductions.reduce_tensor(obj)
            uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
            return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])

    buf = io.BytesIO()
    HandlePickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor_payload(named_tensors: list[tuple[str, torch.Tensor]], *, flattened: bool) -> tuple[torch.Tensor, object]:
    """What one rank's entry of `serialized_named_tensors` pickles (`serialize` it once per
    engine rank), and the buffer the handles point to: keep it alive until the engine
    answered."""
    buffer, metadata = pack_bucket(named_tensors)
    payload = ({"flattened_tensor": buffer, "metadata": metadata} if flattened
               else unpack_bucket(buffer, metadata))
    return buffer, payload


# --- the receiver -----------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("builtins", name) for name in ("list", "tuple", "dict", "int", "float", "str", "bytes", "bool", "slice")
} | {
    ("collections", "OrderedDict"), ("types", "SimpleNamespace"), ("copyreg", "_reconstructor"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"), ("torch", "dtype"),
    ("torch.nn.parameter", "Parameter"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
}


def _rebuild_cuda_tensor(*args):
    """torch's rebuild_cuda_tensor, with the device given by UUID (see `serialize`)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        matches = [i for i in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not matches:
            raise ValueError(f"no visible GPU has UUID {device}: the engine must share the trainer's GPUs")
        device = matches[0]
    return rebuild_cuda_tensor(*args[:_CUDA_DEVICE_ARG], device, *args[_CUDA_DEVICE_ARG + 1:])


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles tensor handles and plain data; any other global is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in serialized_named_tensors")


def deserialize_named_tensors(payload: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One rank's entry of `serialized_named_tensors` -> (HF name, tensor) pairs (views of
    the sender's memory: copy them before answering)."""
    import torch.multiprocessing  # noqa: F401  (the rebuild functions)

    if load_format not in (None, FLATTENED):
        raise ValueError(f"load_format={load_format!r}; use null or {FLATTENED!r}")
    obj = RestrictedUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if load_format == FLATTENED:
        return unpack_bucket(obj["flattened_tensor"], obj["metadata"])
    return [(str(name), tensor) for name, tensor in obj]
