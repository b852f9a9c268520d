"""The sender's bucket pipelines.

`BucketPipeline`: the caller's thread iterates the export and writes each tensor straight
into a reused bucket buffer (flattened) or keeps it as it is (per tensor) while one sender
thread announces and broadcasts the previous bucket. Two buffers alternate; a buffer is
written again only once the bucket it held was answered by every engine, and the one
sender thread keeps the announcements in order, one at a time (an engine answers an
announcement after it received and loaded the bucket; two announcements at once would
deadlock it). The buffers live as long as the `BucketBuffers` that owns them, so later
syncs allocate nothing.

`PlannedBuckets` (flattened, once the layout and where each tensor lies are known): the
runs of tensors lying back to back in the parameters' memory go first, straight from
there; every other tensor has its place in a copy bucket before the export yields it, so
the export writes the tensors it rebuilds (q/k/v) there directly.

`StreamedBuckets` (per tensor, once the layout is known): each bucket is announced before
its tensors are exported, from the (name, dtype, shape) list the previous sync recorded,
and each exported tensor is broadcast (asynchronously) the moment the export yields it,
out of its own memory: a parameter that is already laid out (at TP 1 everything but
q/k/v) is sent without a copy, and the export of the next tensor overlaps the wire.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

# send(named, flat): announce and broadcast one bucket. `named` is (name, tensor) with
# tensors on the "meta" device when `flat` holds the bytes, the tensors themselves otherwise.
SendBucket = Callable[[list[tuple[str, torch.Tensor]], "torch.Tensor | None"], object]


class BucketBuffers:
    """Two reusable uint8 buffers on one device, grown on demand, kept across syncs."""

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None, None]

    def get(self, slot: int, nbytes: int, device: torch.device, grow_to: int = 0) -> torch.Tensor:
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            size = nbytes if buf is None else max(nbytes, grow_to)  # a first bucket may be the model
            self.buffers[slot] = None  # the old one goes before the new one comes
            buf = self.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        return buf

    def release(self) -> None:
        self.buffers = [None, None]


def write_bytes(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy `tensor`'s bytes into the uint8 slice `dest` (one copy, also when strided)."""
    tensor = tensor.detach()
    if tensor.is_contiguous():
        dest.copy_(tensor.reshape(-1).view(torch.uint8))
        return
    try:
        dest.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    except RuntimeError:  # dest not aligned for this dtype
        dest.copy_(tensor.contiguous().reshape(-1).view(torch.uint8))


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class SenderThread:
    """One thread that sends buckets in the order they are handed over; once a send failed,
    the later buckets are not announced."""

    def __init__(self, send: SendBucket):
        self.send = send
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="weight-sync-send")
        self.failed = False  # set by the thread

    def submit(self, named, flat) -> Future:
        return self.executor.submit(self._send_unless_failed, named, flat)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

    def _send_unless_failed(self, named, flat) -> None:
        if self.failed:
            return
        try:
            self.send(named, flat)
        except BaseException:
            self.failed = True
            raise


def record(future: Future, errors: list[str]) -> None:
    """Wait for one bucket; its error, if any, joins `errors` (reported by the caller to
    every rank)."""
    try:
        future.result()
    except Exception as err:
        errors.append(f"{type(err).__name__}: {err}")


class BucketPipeline:
    """Cuts `(name, tensor)` pairs into buckets of at most `bucket_bytes` (a larger tensor
    is a bucket of its own) and sends them with `send` on one background thread."""

    def __init__(self, send: SendBucket, bucket_bytes: int, *, flattened: bool, buffers: BucketBuffers):
        self.bucket_bytes, self.flattened, self.buffers = bucket_bytes, flattened, buffers
        self.sender = SenderThread(send)
        self.slot_futures: list[Future | None] = [None, None]
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.pending_bytes = 0
        self.buckets = 0
        self.sent_bytes = 0
        self.errors: list[str] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor_bytes(tensor)
        # a tensor starts at a multiple of its element size in a flattened bucket (receivers
        # view it in place; SGLang refuses it otherwise), e.g. a float32 scale after an odd-sized fp8 weight
        misaligned = self.flattened and self.pending_bytes % tensor.element_size()
        if self.pending and (self.pending_bytes + nbytes > self.bucket_bytes or misaligned):
            self.flush()
        self.pending.append((name, tensor))
        self.pending_bytes += nbytes

    @property
    def failed(self) -> bool:
        self._collect_finished()
        return bool(self.errors)

    def flush(self) -> None:
        """Hand the pending tensors to the sender thread as one bucket."""
        named, nbytes = self.pending, self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        if not named or self.failed:
            return
        slot = self.buckets % 2
        self._wait(slot)  # the bucket that last used this slot was answered
        if self.errors:
            return
        flat = None
        if self.flattened:
            flat = self.buffers.get(slot, nbytes, named[0][1].device, grow_to=self.bucket_bytes)[:nbytes]
            offset = 0
            for _, t in named:
                write_bytes(flat[offset:offset + tensor_bytes(t)], t)
                offset += tensor_bytes(t)
            named = [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in named]
        self.slot_futures[slot] = self.sender.submit(named, flat)
        self.buckets += 1
        self.sent_bytes += nbytes

    def finish(self, send_pending: bool = True) -> list[str]:
        """Send what is pending (or drop it), wait for every bucket; the errors, if any."""
        if send_pending:
            self.flush()
        for slot in (0, 1):
            self._wait(slot)
        self.sender.shutdown()
        return self.errors

    def _wait(self, slot: int) -> None:
        future, self.slot_futures[slot] = self.slot_futures[slot], None
        if future is not None:
            record(future, self.errors)

    def _collect_finished(self) -> None:
        for slot, future in enumerate(self.slot_futures):
            if future is not None and future.done():
                self._wait(slot)


# --- the export's layout, recorded by one sync for the next ---------------------------------

Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]  # (name, dtype, shape) in send order


def layout_entry(name: str, tensor: torch.Tensor) -> tuple[str, torch.dtype, tuple[int, ...]]:
    return name, tensor.dtype, tuple(tensor.shape)


def entry_bytes(entry) -> int:
    _, dtype, shape = entry
    return math.prod(shape) * dtype.itemsize


# --- flattened buckets sent from where they lie --------------------------------------------

# Where an exported tensor lies: (storage's data pointer, byte offset) inside a parameter's
# storage, or None for a tensor the export made (q/k/v, gathered shards, FP8).
Where = tuple[int, int] | None


def where_it_lies(tensor: torch.Tensor, parameter_storages: set[int]) -> Where:
    if not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() not in parameter_storages:
        return None
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset() * tensor.element_size()


def plan_spans(layout: Layout, where: list[Where], bucket_bytes: int, min_bytes: int) -> list[list[int]]:
    """Positions in `layout` of each bucket to send from memory: tensors lying back to back
    in one storage, in address order (whatever order the export yields them in), at most
    `bucket_bytes` (a larger tensor alone), at least `min_bytes`."""
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for i, (entry, w) in enumerate(zip(layout, where)):
        if w is not None:
            by_storage.setdefault(w[0], []).append((w[1], entry_bytes(entry), i))
    spans: list[list[int]] = []
    for items in by_storage.values():
        run, end, total = [], 0, 0
        for offset, nbytes, i in sorted(items):
            if run and (offset != end or total + nbytes > bucket_bytes):
                if total >= min_bytes:
                    spans.append(run)
                run, total = [], 0
            run.append(i)
            end, total = offset + nbytes, total + nbytes
        if total >= min_bytes:
            spans.append(run)
    return spans


@dataclass
class InPlaceBuckets:
    """What a flattened sync learned for the next one: the export's layout, where each tensor
    lies, and the buckets (`plan_spans`) that can go straight from the parameters' memory
    as long as no parameter moved to another storage."""

    layout: Layout
    where: list[Where]
    spans: list[list[int]]
    storages: dict[int, torch.UntypedStorage]  # kept alive: the spans are views of them
    parameter_pointers: list[int]  # each parameter's storage when planned
    device: torch.device  # of the parameters (the copy buckets' buffers too)

    @classmethod
    def plan(cls, layout: Layout, where: list[Where], parameters: list[torch.Tensor], bucket_bytes: int,
             min_bytes: int):
        spans = plan_spans(layout, where, bucket_bytes, min_bytes)
        in_spans = {where[span[0]][0] for span in spans}
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in parameters}
        return cls(list(layout), list(where), spans, {ptr: storages[ptr] for ptr in in_spans},
                   [p.untyped_storage().data_ptr() for p in parameters],
                   parameters[0].device if parameters else torch.device("cpu"))

    def holds(self, parameters: list[torch.Tensor]) -> bool:
        return [p.untyped_storage().data_ptr() for p in parameters] == self.parameter_pointers

    @property
    def positions(self) -> set[int]:
        return {i for span in self.spans for i in span}

    def bucket(self, span: list[int]) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
        """(names as meta tensors, the bytes they occupy) of one span."""
        ptr, start = self.where[span[0]]
        named = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, dtype, shape in
                 (self.layout[i] for i in span)]
        nbytes = sum(entry_bytes(self.layout[i]) for i in span)
        storage = self.storages[ptr]
        return named, torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,))


def cut_flat_buckets(layout: Layout, positions: list[int], bucket_bytes: int) -> list[list[int]]:
    """`positions` of `layout`, in order, cut as `BucketPipeline` cuts flattened buckets (at
    most `bucket_bytes`, a larger tensor alone; a new bucket where a tensor would not start
    at a multiple of its element size)."""
    buckets: list[list[int]] = []
    nbytes = 0
    for i in positions:
        size, itemsize = entry_bytes(layout[i]), layout[i][1].itemsize
        if buckets and buckets[-1] and (nbytes + size > bucket_bytes or nbytes % itemsize):
            buckets.append([])
            nbytes = 0
        if not buckets:
            buckets.append([])
        buckets[-1].append(i)
        nbytes += size
    return buckets


class PlannedBuckets:
    """Flattened buckets of a sync whose layout the previous one recorded (`InPlaceBuckets`):
    the runs lying back to back in the parameters' memory go first, straight from there,
    while the export runs; every other tensor has its place in a copy bucket before the
    export yields it, so a tensor the export rebuilds (q/k/v) is written there directly
    (`destination`, one copy) and each copy bucket goes once its last tensor arrived. Copy
    buckets alternate between two reused buffers (a buffer is written again once its
    bucket was answered). Same interface as `BucketPipeline` (add, failed, finish, buckets,
    sent_bytes).

    An export that differs from the plan (a can't-happen: another model, a parameter that
    is not where it was) fails the sync before its next copy bucket is announced; the runs
    already sent came from the parameters themselves."""

    def __init__(self, send: SendBucket, plan: InPlaceBuckets, parameter_storages: set[int], bucket_bytes: int,
                 buffers: BucketBuffers):
        self.plan, self.storages, self.buffers, self.bucket_bytes = plan, parameter_storages, buffers, bucket_bytes
        self.sender = SenderThread(send)
        self.futures: list[Future] = []  # the buckets handed to the sender thread, not yet waited for
        self.copy_futures: dict[int, Future] = {}  # copy bucket -> its send (its buffer is free once done)
        self.errors: list[str] = []
        self.buckets = 0
        self.sent_bytes = 0
        self.index = 0  # next position in the layout
        self.in_span = plan.positions
        self.copies = cut_flat_buckets(plan.layout, [i for i in range(len(plan.layout)) if i not in self.in_span],
                                       bucket_bytes)
        self.place: dict[int, tuple[int, int]] = {}  # position -> (copy bucket, byte offset)
        for k, bucket in enumerate(self.copies):
            offset = 0
            for i in bucket:
                self.place[i] = (k, offset)
                offset += entry_bytes(plan.layout[i])
        self.copy_bytes = [sum(entry_bytes(plan.layout[i]) for i in bucket) for bucket in self.copies]
        self.by_name = {plan.layout[i][0]: i for i in self.place}
        self.flats: dict[int, torch.Tensor] = {}  # copy bucket -> its bytes, once a buffer holds it
        for span in plan.spans:
            self._submit(*plan.bucket(span))

    @property
    def failed(self) -> bool:
        for future in [f for f in self.futures if f.done()]:
            self.futures.remove(future)
            record(future, self.errors)
        return bool(self.errors)

    def destination(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where the export should write the tensor `name` (its place in a copy bucket), or
        None (not planned as such: the export allocates)."""
        i = self.by_name.get(name)
        if i is None or self.errors or self.plan.layout[i] != (name, dtype, tuple(shape)):
            return None
        return self._slot(i).view(dtype).view(shape)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.errors:
            return
        i = self.index
        self.index += 1
        if i >= len(self.plan.layout) or self.plan.layout[i] != layout_entry(name, tensor):
            expected = self.plan.layout[i][0] if i < len(self.plan.layout) else "nothing more"
            self.errors.append(f"the export changed since the previous sync: {name!r} {tuple(tensor.shape)} "
                               f"{tensor.dtype} where {expected!r} was planned")
            return
        if i in self.in_span:
            if where_it_lies(tensor, self.storages) != self.plan.where[i]:
                self.errors.append(f"the export changed since the previous sync: {name!r} is not where it was "
                                   "sent from")
            return
        slot = self._slot(i)
        if slot.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():  # else the export wrote it there
            write_bytes(slot, tensor)
        k, _ = self.place[i]
        if i == self.copies[k][-1]:
            named = [(n, torch.empty(shape, dtype=dtype, device="meta"))
                     for n, dtype, shape in (self.plan.layout[j] for j in self.copies[k])]
            self.copy_futures[k] = self._submit(named, self.flats.pop(k))

    def finish(self, send_pending: bool = True) -> list[str]:
        """Wait for every bucket handed over; the errors, if any. (A copy bucket whose tensors
        did not all arrive was never announced: nobody waits for it.)"""
        if self.index < len(self.plan.layout) and not self.errors and send_pending:
            self.errors.append(f"the export ended after {self.index} of the {len(self.plan.layout)} tensors planned")
        for future in self.futures:
            record(future, self.errors)
        self.futures = []
        self.sender.shutdown()
        return self.errors

    def _slot(self, i: int) -> torch.Tensor:
        """The uint8 bytes of position `i` in its copy bucket's buffer (taking the buffer, once
        the bucket that last used it was answered)."""
        k, offset = self.place[i]
        if k not in self.flats:
            previous = self.copy_futures.pop(k - 2, None)
            if previous is not None:  # its error, if any, is recorded with the others
                wait([previous])
            self.flats[k] = self.buffers.get(k % 2, self.copy_bytes[k], self.plan.device,
                                             grow_to=self.bucket_bytes)[:self.copy_bytes[k]]
        return self.flats[k][offset:offset + entry_bytes(self.plan.layout[i])]

    def _submit(self, named, flat: torch.Tensor) -> Future:
        future = self.sender.submit(named, flat)
        self.futures.append(future)
        self.buckets += 1
        self.sent_bytes += flat.numel()
        return future


# --- streamed per-tensor buckets -------------------------------------------------------

def cut_buckets(layout: Layout, bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of each per-tensor bucket, cut as `BucketPipeline` cuts them."""
    bounds, start, nbytes = [], 0, 0
    for i, entry in enumerate(layout):
        size = entry_bytes(entry)
        if i > start and nbytes + size > bucket_bytes:
            bounds.append((start, i))
            start, nbytes = i, 0
        nbytes += size
    if start < len(layout):
        bounds.append((start, len(layout)))
    return bounds


# announce(named): post one bucket's names/dtypes/shapes (meta tensors) to every engine;
# a Future of their answers (they answer once the bucket is received and loaded).
Announce = Callable[[list[tuple[str, torch.Tensor]]], Future]
# broadcast(tensor): start sending one tensor to the engines; an object with .wait() and
# .is_completed() (a torch Work)
Broadcast = Callable[[torch.Tensor], object]


class StreamedBuckets:
    """Per-tensor buckets of a known `layout` (the previous sync's), each announced when its
    first tensor arrives and streamed tensor by tensor as `add` is called; the next bucket
    is announced once every engine answered the previous one. Same interface as
    `BucketPipeline` (add, failed, finish, buckets, sent_bytes).

    The export must yield exactly `layout`. If it does not (a can't-happen: a different
    model), the announced bucket is completed with zeros so that no engine waits for a
    broadcast that never comes, and the sync fails (`layout_broken`; the caller re-plans)."""

    def __init__(self, announce: Announce, broadcast: Broadcast, bucket_bytes: int, layout: Layout,
                 timeout_s: float = 600.0):
        self.announce, self.broadcast, self.layout, self.timeout_s = announce, broadcast, list(layout), timeout_s
        self.bounds = cut_buckets(self.layout, bucket_bytes)
        self.bucket_of_start = {start: k for k, (start, _) in enumerate(self.bounds)}
        self.index = 0  # next position in the layout
        self.open_end: int | None = None  # end of the announced bucket still being streamed
        # broadcasts of the announced bucket not yet seen finished, with their tensors
        self.works: deque[tuple[object, torch.Tensor]] = deque()
        self.wire_errors: list[str] = []  # of finished broadcasts, reported at the bucket's end
        self.answer: Future | None = None
        self.buckets = 0
        self.sent_bytes = 0
        self.errors: list[str] = []
        self.layout_broken = False
        self.device = torch.device("cpu")  # of the exported tensors (zeros go from there)

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.errors:
            return
        i = self.index
        if i >= len(self.layout) or self.layout[i] != layout_entry(name, tensor):
            expected = self.layout[i][0] if i < len(self.layout) else "nothing more"
            self._break(f"the export changed since the previous sync: {name!r} "
                        f"{tuple(tensor.shape)} {tensor.dtype} where {expected!r} was announced")
            return
        if i in self.bucket_of_start:
            self._complete()  # one announcement at a time
            if self.errors:
                return
            start, end = self.bounds[self.bucket_of_start[i]]
            named = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, dtype, shape in self.layout[start:end]]
            try:
                self.answer = self.announce(named)
            except Exception as err:  # nothing was sent: nobody waits
                self.errors.append(f"{type(err).__name__}: {err}")
                return
            self.open_end = end
            self.buckets += 1
        self.device = tensor.device
        self._send(tensor)
        self.index += 1
        self.sent_bytes += tensor_bytes(tensor)
        if self.index == self.open_end:
            self.open_end = None

    def finish(self, send_pending: bool = True) -> list[str]:
        """Wait for the last bucket; the errors, if any. (`send_pending` is accepted for
        `BucketPipeline`'s interface: an announced bucket is always completed.)"""
        if self.open_end is not None or (self.index < len(self.layout) and not self.errors and send_pending):
            self._break(f"the export ended after {self.index} of the {len(self.layout)} tensors announced")
        self._complete()
        return self.errors

    def _send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self.works.append((self.broadcast(tensor), tensor))  # the tensor lives until sent
        self._drop_sent()

    def _drop_sent(self) -> None:
        """Let go of the tensors already sent (a work holds its tensor too): the export's
        fresh copies (q/k/v) are freed while the bucket streams, so the allocator hands
        their memory to the next copies instead of faulting in new pages, and a bucket
        never keeps all of its copies at once."""
        while self.works and self.works[0][0].is_completed():
            work, _ = self.works.popleft()
            try:
                work.wait()
            except Exception as err:
                self.wire_errors.append(f"{type(err).__name__}: {err}")

    def _break(self, why: str) -> None:
        """Fill the announced bucket with zeros (the engines wait for it) and fail the sync."""
        self.layout_broken = True
        self.errors.append(why + "; the next sync announces each bucket after exporting it")
        if self.open_end is not None:
            for _, dtype, shape in self.layout[self.index:self.open_end]:
                self._send(torch.zeros(shape, dtype=dtype, device=self.device))
            self.index, self.open_end = self.open_end, None

    def _complete(self) -> None:
        """Wait for the announced bucket's broadcasts (every one, also after a failure: they
        read the tensors kept here) and for every engine's answer."""
        from rollout.weight_group import wait_all

        works, self.works = self.works, deque()
        answer, self.answer = self.answer, None
        self.errors += self.wire_errors
        self.wire_errors = []
        try:
            wait_all([work for work, _ in works])
        except Exception as err:
            self.errors.append(f"{type(err).__name__}: {err}")
        if answer is not None:
            try:
                answer.result(timeout=self.timeout_s)
            except Exception as err:
                self.errors.append(f"{type(err).__name__}: {err}")
