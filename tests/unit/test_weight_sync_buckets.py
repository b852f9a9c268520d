"""The sender's bucket pipeline (megatron_agent/weight_sync/buckets.py) and the engine's
in-place receive planning (rollout/engine_weights.py), without process groups: what a
fake sender receives, unflattened, equals the exported tensors exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_agent.weight_sync.buckets import BucketBuffers, BucketPipeline
from rollout.engine_weights import adoptable, storage_span
from rollout.weight_group import unflatten_bucket


def exported(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes (an odd bf16 count puts later fp32 tensors off their alignment), a
    strided view (as the export's q/k/v slices are before `.contiguous()`), a 0-d tensor."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(6, 8, generator=g)
    return [("a.weight", torch.randn(4, 8, generator=g)),
            ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
            ("c.weight", fused[:, 2:5]),  # not contiguous
            ("d.weight", torch.randn(5, 4, generator=g)),
            ("e.scale", torch.tensor(float(seed))),
            ("f.weight", torch.randint(0, 100, (9,), generator=g)),
            ("g.weight", torch.randn(2, 3, generator=g).t())]  # transposed


class RecordingSender:
    """A stand-in for send_weights: copies each bucket when called (the buffer is reused
    afterwards) and records how many sends ever ran at once."""

    def __init__(self, fail_at: int | None = None):
        self.buckets: list[list[tuple[str, torch.Tensor]]] = []
        self.flats: list[int] = []  # data_ptr of each flat buffer
        self.running = 0
        self.most_at_once = 0
        self.lock = threading.Lock()
        self.fail_at = fail_at

    def __call__(self, named, flat):
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.fail_at is not None and len(self.buckets) == self.fail_at:
                raise ConnectionError("engine gone")
            if flat is None:
                self.buckets.append([(n, t.clone()) for n, t in named])
            else:
                assert all(t.device.type == "meta" for _, t in named)
                self.flats.append(flat.data_ptr())
                views = unflatten_bucket(flat.clone(), [t.dtype for _, t in named], [list(t.shape) for _, t in named])
                self.buckets.append([(n, v) for (n, _), v in zip(named, views)])
        finally:
            with self.lock:
                self.running -= 1


def run_pipeline(named, bucket_bytes, flattened, buffers, sender):
    pipeline = BucketPipeline(sender, bucket_bytes, flattened=flattened, buffers=buffers)
    for n, t in named:
        pipeline.add(n, t)
    return pipeline, pipeline.finish()


def delivered(sender) -> list[tuple[str, torch.Tensor]]:
    return [pair for bucket in sender.buckets for pair in bucket]


def assert_exactly(got, expected):
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened", "per_tensor"])
def test_tiny_buckets_deliver_every_tensor_exactly_in_order_one_send_at_a_time(flattened):
    named = exported(0)
    sender = RecordingSender()
    pipeline, errors = run_pipeline(named, 40, flattened, BucketBuffers(), sender)
    assert errors == []
    assert pipeline.buckets == len(sender.buckets) >= 5
    assert pipeline.sent_bytes == sum(t.numel() * t.element_size() for _, t in named)
    assert sender.most_at_once == 1  # announcements never overlap
    assert_exactly(delivered(sender), named)


def test_buffers_are_reused_across_syncs_and_deliver_the_second_set_exactly():
    buffers, first, second = BucketBuffers(), RecordingSender(), RecordingSender()
    run_pipeline(exported(1), 64, True, buffers, first)
    kept = [b.data_ptr() for b in buffers.buffers]
    run_pipeline(exported(2), 64, True, buffers, second)
    assert [b.data_ptr() for b in buffers.buffers] == kept  # nothing allocated by the second sync
    assert set(second.flats) <= set(kept) and len(set(second.flats)) == 2  # two buffers, alternating
    assert_exactly(delivered(second), exported(2))
    assert not torch.equal(delivered(first)[0][1], delivered(second)[0][1])


def test_a_failed_bucket_stops_later_ones_and_is_reported():
    sender = RecordingSender(fail_at=1)
    pipeline, errors = run_pipeline(exported(3), 40, True, BucketBuffers(), sender)
    assert len(errors) == 1 and "engine gone" in errors[0]
    assert len(sender.buckets) == 1  # the bucket after the failed one was never announced


def test_bucket_lands_in_place_only_where_the_parameters_lie_back_to_back():
    storage = torch.zeros(20)
    a, b = storage[:12].view(3, 4), storage[12:20].view(8)
    span = storage_span([a, b], [torch.float32] * 2, [[3, 4], [8]])
    assert span is not None and span.numel() == 80 and span.data_ptr() == storage.data_ptr()
    span.view(torch.float32).copy_(torch.arange(20.0))  # what the broadcast does
    assert torch.equal(b, torch.arange(12.0, 20.0))
    assert storage_span([b, a], [torch.float32] * 2, [[8], [3, 4]]) is None  # out of order
    assert storage_span([a, storage[13:20]], [torch.float32] * 2, [[3, 4], [7]]) is None  # a gap
    assert storage_span([a], [torch.bfloat16], [[3, 4]]) is None  # another dtype
    assert storage_span([storage[:12].view(4, 3).t()], [torch.float32], [[3, 4]]) is None  # strided


def test_only_whole_distinct_parameters_of_the_announced_dtype_are_adopted():
    p, q = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    f32 = torch.float32
    assert adoptable([p, q], [f32, f32], [[2, 3], [4]])
    assert not adoptable([p, p], [f32, f32], [[2, 3], [2, 3]])  # tied, twice in one bucket
    assert not adoptable([p.detach()[0], q], [f32, f32], [[3], [4]])  # a slice of a parameter
    assert not adoptable([p, q], [torch.bfloat16, f32], [[2, 3], [4]])  # would need a cast
