"""Safetensors files read and written one tensor at a time, by byte offset.

Reading with plain `pread`s instead of safetensors' memory map keeps a reader's resident
memory at the tensors it holds: a mapped file counts every page it touched for as long
as it stays open. Writing streams too: the shard headers are laid out from the tensors'
names, shapes and dtypes before any data exists, then each tensor is appended as it
comes, so a writer holds one tensor, never a whole shard.

Format: an 8-byte little-endian header length, a JSON header
`{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}`,
then the tensors' bytes back to back (offsets relative to the end of the header).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_OF_CODE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_OF_CODE.items()}
HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    path = Path(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        entries[name] = TensorEntry(path, DTYPE_OF_CODE[info["dtype"]], tuple(info["shape"]), base + start, base + end)
    return entries


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):  # one read returns at most ~2 GiB on Linux
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"unexpected end of file at byte {offset + done}")
        done += n


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    data = torch.empty(entry.end - entry.start, dtype=torch.uint8)
    fd = os.open(entry.file, os.O_RDONLY)
    try:
        _read_exactly(fd, memoryview(data.numpy()), entry.start)
    finally:
        os.close(fd)
    return data.view(entry.dtype).reshape(entry.shape)


# --- writing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into shards of at most `max_shard_bytes` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (shards[-1] and size + spec.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def header_bytes(shard: list[TensorSpec]) -> bytes:
    header, offset = {}, 0
    for spec in shard:
        header[spec.name] = {"dtype": CODE_OF_DTYPE[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_all(f, tensor: torch.Tensor) -> None:
    f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))


def write_streamed_shards(specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path,
                          max_shard_bytes: int) -> dict:
    """Write tensors, arriving in the order of `specs`, as HF safetensors shards plus an
    index (more than one shard); every file is flushed to disk before it is closed."""
    shards = plan_shards(specs, max_shard_bytes)
    names = shard_file_names(len(shards))
    arriving = iter(tensors)
    for file_name, shard in zip(names, shards):
        with open(out_dir / file_name, "wb") as f:
            f.write(header_bytes(shard))
            for spec in shard:
                name, tensor = next(arriving)
                if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                    raise ValueError(f"expected {spec}, got {name!r} {tuple(tensor.shape)} {tensor.dtype}")
                _write_all(f, tensor)
            f.flush()
            os.fsync(f.fileno())
    if next(arriving, None) is not None:
        raise ValueError("more tensors than planned")
    total = sum(spec.nbytes for spec in specs)
    if len(shards) > 1:
        weight_map = {spec.name: file_name for file_name, shard in zip(names, shards) for spec in shard}
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
    return {"total_size": total, "shards": len(shards)}
