"""Megatron dist checkpoints (torch_dist) written and read one parameter at a time.

`dist_checkpointing.save` and `load` take a whole state dict, so a model converted
through them is in memory at once. These functions speak the same format through
torch.distributed.checkpoint directly and hold one parameter at a time:

- `checkpoint_layout(model)`: the checkpoint's tensors, taken from the
  `sharded_state_dict()` of a model built at TP=PP=EP=1 (on the meta device: no
  weights). Each parameter maps to one or more chunks of the layout-independent
  global tensors Megatron checkpoints (layers stacked on a leading axis, experts on
  the next; a SwiGLU `linear_fc1` is two chunks: gate and up).
- `write_checkpoint(out, layout, param_rows)`: a dist checkpoint whose chunks are
  produced on demand from `param_rows(param)`; Megatron loads it at any TP/PP/EP, as it
  would the checkpoint `dist_checkpointing.save` writes for the same model at TP=1.
- `read_params(mcore_dir, params)`: each parameter's full tensor in turn, from a dist
  checkpoint written at any layout (Megatron's or ours).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

SHARDED_BACKEND = ("torch_dist", 1)
COMMON_BACKEND = ("torch", 1)


class CheckpointLayoutError(ValueError):
    """A model or checkpoint whose tensors do not fit the layout expected here."""


@dataclass(frozen=True)
class Chunk:
    """One piece of a parameter in the checkpoint's global tensor `key`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # in the global tensor, the prepended (layer, expert) axes included
    sizes: tuple[int, ...]
    region: tuple[slice, ...]  # the part of the parameter it holds

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk of a full parameter, shaped as stored (size-1 prepended axes)."""
        piece = full[self.region]
        return piece[(None,) * (len(self.sizes) - piece.dim())]


@dataclass(frozen=True)
class ParamChunks:
    name: str  # the parameter's name in the model
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class CheckpointLayout:
    params: tuple[ParamChunks, ...]
    objects: tuple[tuple[str, object], ...]  # (unique key, value): per-layer extra states


def _sharded_tensors(value) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(value, ShardedTensorFactory):
        value = value.build()
    return list(nested_values(value)) if isinstance(value, dict | list) else [value]


def _chunk(sh, param_shape: tuple[int, ...]) -> Chunk:
    if sh.flattened_range is not None:
        raise CheckpointLayoutError(f"{sh.key}: flattened sharded tensors are not supported here")
    prepend = sh.prepend_axis_num
    within = sh.global_offset[prepend:]
    if len(within) != len(param_shape) or any(o + s > p for o, s, p in zip(within, sh.local_shape, param_shape)):
        raise CheckpointLayoutError(f"{sh.key} at {sh.global_offset} does not lie inside its parameter {param_shape}")
    return Chunk(
        key=sh.key,
        global_shape=tuple(sh.global_shape),
        offsets=tuple(sh.global_offset),
        sizes=(1,) * prepend + tuple(sh.local_shape),
        region=tuple(slice(o, o + s) for o, s in zip(within, sh.local_shape)),
    )


def checkpoint_layout(model) -> CheckpointLayout:
    """The checkpoint tensors of one model chunk built on a single rank at TP=PP=EP=1."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica

    named = dict(model.named_parameters())
    params, objects = [], []
    for name, value in model.sharded_state_dict().items():
        if isinstance(value, ShardedObject):
            if is_main_replica(value.replica_id):
                objects.append((value.unique_key, value.data))
            continue
        if name not in named:
            raise CheckpointLayoutError(f"sharded tensor {name!r} is not a parameter of the model")
        param = named[name]
        chunks = tuple(_chunk(sh, tuple(param.shape)) for sh in _sharded_tensors(value)
                       if is_main_replica(sh.replica_id))
        if sum(math.prod(c.sizes) for c in chunks) != param.numel():
            raise CheckpointLayoutError(f"the checkpoint chunks of {name!r} do not cover it exactly: {chunks}")
        params.append(ParamChunks(name, tuple(param.shape), param.dtype, chunks))
    return CheckpointLayout(tuple(params), tuple(objects))


# --- writing --------------------------------------------------------------------------


def _write_items(layout: CheckpointLayout) -> list[WriteItem]:
    items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key, _ in layout.objects]
    for param in layout.params:
        for c in param.chunks:
            items.append(WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=param.dtype),
                    size=torch.Size(c.global_shape),
                ),
            ))
    return items


def _block_of(chunk: Chunk, rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The block of `rows` that is exactly this chunk, if there is one."""
    first, *rest = chunk.region
    start = 0
    for block in rows:
        whole_rows = all(r.start == 0 and r.stop == n for r, n in zip(rest, block.shape[1:]))
        if whole_rows and (first.start, first.stop) == (start, start + block.shape[0]):
            return block
        start += block.shape[0]
    return None


def _rows_checked(param: ParamChunks, param_rows: Callable[[ParamChunks], list[torch.Tensor]]) -> list[torch.Tensor]:
    rows = param_rows(param)
    shape = (sum(b.shape[0] for b in rows), *rows[0].shape[1:])
    if shape != param.shape or any(b.dtype != param.dtype for b in rows):
        raise CheckpointLayoutError(f"{param.name}: made {shape} {rows[0].dtype}, expected {param.shape} {param.dtype}")
    if len(rows) > 1 and any(_block_of(c, rows) is None for c in param.chunks):
        rows = [torch.cat(rows)]  # on the reading thread
    return rows


class _StreamingSavePlanner(SavePlanner):
    """Write items are the layout's chunks, made when the writer asks for them (in plan
    order, a parameter's chunks next to each other) from their parameter's rows; the next
    parameter is read meanwhile on the `prefetch` thread."""

    def __init__(self, layout: CheckpointLayout, param_rows: Callable[[ParamChunks], list[torch.Tensor]],
                 prefetch: ThreadPoolExecutor):
        self.layout, self.param_rows, self.prefetch = layout, param_rows, prefetch
        self.objects = dict(layout.objects)
        self.chunk_of = {(c.key, c.offsets): (i, c) for i, p in enumerate(layout.params) for c in p.chunks}
        self.pending: dict[int, Future] = {}
        self.current: tuple[int, list[torch.Tensor]] | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(_write_items(self.layout))

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def _submit(self, index: int) -> Future:
        return self.prefetch.submit(_rows_checked, self.layout.params[index], self.param_rows)

    def _rows(self, index: int) -> list[torch.Tensor]:
        if self.current is None or self.current[0] != index:
            self.current = None
            future = self.pending.pop(index, None) or self._submit(index)
            if index + 1 < len(self.layout.params):
                self.pending[index + 1] = self._submit(index + 1)
            self.current = (index, future.result())
        return self.current[1]

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self.objects[write_item.index.fqn]], buffer)  # as Megatron stores a ShardedObject
            return buffer
        index, chunk = self.chunk_of[(write_item.index.fqn, tuple(write_item.index.offset))]
        rows = self._rows(index)
        block = _block_of(chunk, rows)
        if block is None:  # part of the one block (the writer copies it out)
            return chunk.of(rows[0])
        return block[(None,) * (len(chunk.sizes) - block.dim())]


@contextmanager
def _no_crc32():
    """torch.save without zip CRCs: torch.load does not check them, and computing them
    is a pass over every byte."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def write_checkpoint(out_dir: str | Path, layout: CheckpointLayout,
                     param_rows: Callable[[ParamChunks], list[torch.Tensor]]) -> None:
    """Write a torch_dist checkpoint of `layout` into `out_dir` (flushed to disk).

    `param_rows(param)` gives a parameter as consecutive blocks of rows (concatenated
    along dim 0 they are the parameter): a chunk that is one block is written as it is,
    with no copy. It is called once per parameter, in the layout's order.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    out_dir = Path(out_dir)
    # One writer thread and no copy-ahead: items are resolved lazily and in plan order.
    writer = FileSystemWriter(out_dir, single_file_per_rank=True, sync_files=True, thread_count=1,
                              per_thread_copy_ahead=0)
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-read") as prefetch, _no_crc32():
        planner = _StreamingSavePlanner(layout, param_rows, prefetch)
        planner.set_up_planner({}, writer.storage_meta(), True)
        writer.set_up_storage_writer(True)
        plans, metadata = planner.create_global_plan([writer.prepare_local_plan(planner.create_local_plan())])
        plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
        results = writer.write_data(plan, planner).wait()
        writer.finish(metadata, [results])
    torch.save({}, out_dir / "common.pt")  # the model has no state outside its sharded tensors
    save_config(CheckpointingConfig(*SHARDED_BACKEND, *COMMON_BACKEND), str(out_dir))


# --- reading --------------------------------------------------------------------------


class _IntoTensors(LoadPlanner):
    """Reads land in the given tensors, one per requested (key, chunk offsets)."""

    def __init__(self, targets: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        self.targets = targets

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("the plan is made by the caller")

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value):
        raise CheckpointLayoutError(f"unexpected object {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        target = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item, tensor):
        pass


def read_params(mcore_dir: str | Path, params: Iterable[ParamChunks]) -> Iterator[tuple[ParamChunks, torch.Tensor]]:
    """Yield `(param, full tensor)` in turn, in the dtype the checkpoint stores it in; the
    next parameter is read on a second thread while the caller handles this one."""
    end = object()
    reading = _read_params(mcore_dir, params)
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-read") as pool:
        ahead = pool.submit(next, reading, end)
        while (item := ahead.result()) is not end:
            ahead = pool.submit(next, reading, end)
            yield item


def _read_params(mcore_dir: str | Path, params: Iterable[ParamChunks]) -> Iterator[tuple[ParamChunks, torch.Tensor]]:
    reader = FileSystemReader(str(mcore_dir))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    stored = metadata.state_dict_metadata
    for param in params:
        first = stored.get(param.chunks[0].key)
        if not isinstance(first, TensorStorageMetadata):
            raise CheckpointLayoutError(f"{mcore_dir} has no tensor {param.chunks[0].key!r} (for {param.name!r})")
        full = torch.empty(param.shape, dtype=first.properties.dtype)
        targets, items = {}, []
        for c in param.chunks:
            md = stored.get(c.key)
            if not isinstance(md, TensorStorageMetadata) or len(md.size) != len(c.global_shape) or any(
                    o + s > n for o, s, n in zip(c.offsets, c.sizes, md.size)):
                raise CheckpointLayoutError(
                    f"{mcore_dir}: {c.key!r} is {getattr(md, 'size', None)}, the model needs {c.global_shape}")
            targets[(c.key, c.offsets)] = c.of(full)
            reads = create_read_items_for_chunk_list(
                c.key, md, [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))])
            if sum(math.prod(r.lengths) for r in reads) != math.prod(c.sizes):
                raise CheckpointLayoutError(f"{mcore_dir}: the stored chunks of {c.key!r} do not cover {c.offsets}")
            items += reads
        reader.read_data(LoadPlan(items), _IntoTensors(targets)).wait()
        yield param, full
