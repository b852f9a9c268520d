"""The sender's bucket pipeline: the caller's thread iterates the export and writes each
tensor straight into a reused bucket buffer while one sender thread announces and
broadcasts the previous bucket.

Two buffers alternate; a buffer is written again only once the bucket it held was
answered by every engine, and the one sender thread keeps the announcements in order,
one at a time (an engine answers an announcement after it received and loaded the
bucket; two announcements at once would deadlock it). The buffers live as long as the
`BucketBuffers` that owns them, so later syncs allocate nothing.

Per-tensor buckets (not flattened) keep the exported tensors themselves (no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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


class BucketPipeline:
    """Cuts `(name, tensor)` pairs into buckets of at most `bucket_bytes` (a larger tensor
    is a bucket of its own) and sends them with `send` on one background thread."""

    def __init__(self, send: SendBucket, bucket_bytes: int, *, flattened: bool, buffers: BucketBuffers):
        self.send, self.bucket_bytes, self.flattened, self.buffers = send, bucket_bytes, flattened, buffers
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="weight-sync-send")
        self.slot_futures: list[Future | None] = [None, None]
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.pending_bytes = 0
        self.buckets = 0
        self.sent_bytes = 0
        self.errors: list[str] = []
        self.send_failed = False  # set by the sender thread: later buckets are not announced

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
        self.slot_futures[slot] = self.executor.submit(self._send_unless_failed, named, flat)
        self.buckets += 1
        self.sent_bytes += nbytes

    def finish(self, send_pending: bool = True) -> list[str]:
        """Send what is pending (or drop it), wait for every bucket; the errors, if any."""
        if send_pending:
            self.flush()
        for slot in (0, 1):
            self._wait(slot)
        self.executor.shutdown(wait=True)
        return self.errors

    def _send_unless_failed(self, named, flat) -> None:
        if self.send_failed:
            return
        try:
            self.send(named, flat)
        except BaseException:
            self.send_failed = True
            raise

    def _wait(self, slot: int) -> None:
        future, self.slot_futures[slot] = self.slot_futures[slot], None
        if future is not None:
            self._record(future)

    def _collect_finished(self) -> None:
        for slot, future in enumerate(self.slot_futures):
            if future is not None and future.done():
                self._wait(slot)

    def _record(self, future: Future) -> None:
        try:
            future.result()
        except Exception as err:  # reported by the caller to every rank
            self.errors.append(f"{type(err).__name__}: {err}")
