"""The sender's bucket pipelines (megatron_agent/weight_sync/buckets.py) and the engine's
in-place receive planning (rollout/engine_weights.py), without process groups: what a
fake sender receives, unflattened, equals the exported tensors exactly; the streamed
per-tensor buckets announce the recorded layout, send laid-out tensors from their own
memory, and never leave an announced bucket short; flattened buckets of tensors that lie
back to back in the parameters' memory are planned by hand-computed runs and go from there,
before the copied ones."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_agent.weight_sync.buckets import (
    BucketBuffers,
    BucketPipeline,
    InPlaceBuckets,
    PlannedBuckets,
    StreamedBuckets,
    cut_buckets,
    layout_entry,
    plan_spans,
    where_it_lies,
)
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


# --- streamed per-tensor buckets (StreamedBuckets) --------------------------------------


class FakeWire:
    """Stand-ins for the HTTP announcement and the async broadcast: records each announced
    bucket, the bytes each broadcast carried and the memory it was sent from."""

    def __init__(self, fail_announce_at: int | None = None, fail_broadcast_at: int | None = None):
        self.announced: list[list[tuple[str, torch.dtype, tuple]]] = []
        self.sent: list[torch.Tensor] = []
        self.pointers: list[int] = []
        self.open_answers = 0
        self.most_open = 0
        self.fail_announce_at = fail_announce_at
        self.fail_broadcast_at = fail_broadcast_at

    def announce(self, named):
        assert all(t.device.type == "meta" for _, t in named)
        if self.fail_announce_at is not None and len(self.announced) == self.fail_announce_at:
            raise ConnectionError("engine gone")
        self.announced.append([(n, t.dtype, tuple(t.shape)) for n, t in named])
        self.open_answers += 1
        self.most_open = max(self.most_open, self.open_answers)
        wire = self

        class Answer:  # answered when waited for, as an engine answers once it loaded the bucket
            def result(self, timeout=None):
                wire.open_answers -= 1
                return ["ok"]
        return Answer()

    def broadcast(self, tensor):
        assert tensor.is_contiguous()
        self.pointers.append(tensor.data_ptr())
        self.sent.append(tensor.clone())
        failed = len(self.sent) - 1 == self.fail_broadcast_at

        class Done:  # finished at once, as a torch Work that is_completed
            def is_completed(self):
                return True

            def wait(self):
                if failed:
                    raise RuntimeError("connection reset by peer")
                return True
        return Done()


def stream(named, layout, bucket_bytes, wire):
    pipeline = StreamedBuckets(wire.announce, wire.broadcast, bucket_bytes, layout)
    for n, t in named:
        pipeline.add(n, t)
    return pipeline, pipeline.finish()


def test_streamed_buckets_announce_the_recorded_layout_and_send_every_tensor_exactly():
    named = exported(4)
    layout = [layout_entry(n, t) for n, t in named]
    wire = FakeWire()
    pipeline, errors = stream(named, layout, 40, wire)
    assert errors == []
    # cut as the bucket pipeline cuts per-tensor buckets
    recorder = RecordingSender()
    run_pipeline(named, 40, False, BucketBuffers(), recorder)
    assert [[n for n, *_ in b] for b in wire.announced] == [[n for n, _ in b] for b in recorder.buckets]
    assert pipeline.buckets == len(wire.announced) == len(cut_buckets(layout, 40)) >= 5
    assert wire.most_open == 1  # the next bucket is announced once the previous one was answered
    assert pipeline.sent_bytes == sum(t.numel() * t.element_size() for _, t in named)
    assert_exactly(list(zip([n for n, _ in named], wire.sent)), [(n, t.contiguous()) for n, t in named])
    # laid-out tensors go from their own memory; only the strided ones were copied
    for (_, t), pointer in zip(named, wire.pointers):
        assert (pointer == t.data_ptr()) == t.is_contiguous()


def test_streamed_buckets_let_go_of_sent_tensors_and_report_a_failed_broadcast_at_the_bucket_end():
    named = exported(8)
    layout = [layout_entry(n, t) for n, t in named]
    wire = FakeWire(fail_broadcast_at=2)
    pipeline = StreamedBuckets(wire.announce, wire.broadcast, 10**6, layout)  # one bucket
    for n, t in named:
        pipeline.add(n, t)
        assert len(pipeline.works) <= 1  # the finished broadcasts' tensors are not kept
    assert pipeline.errors == []  # the bucket streams on: the engine waits for every tensor
    errors = pipeline.finish()
    assert len(wire.sent) == len(layout)
    assert len(errors) == 1 and "connection reset by peer" in errors[0]


def test_streamed_buckets_fill_the_announced_bucket_when_the_export_changed():
    named = exported(5)
    layout = [layout_entry(n, t) for n, t in named]
    changed = named[:2] + [("other.weight", torch.zeros(3, 3))] + named[3:]
    wire = FakeWire()
    pipeline, errors = stream(changed, layout, 10**6, wire)  # one bucket
    assert pipeline.layout_broken and len(errors) == 1 and "'other.weight'" in errors[0]
    assert len(wire.announced) == 1 and len(wire.sent) == len(layout)  # the engine got every announced tensor
    assert [tuple(t.shape) for t in wire.sent] == [shape for _, _, shape in layout]
    assert all(not t.any() for t in wire.sent[2:])  # zeros after the mismatch

    short = StreamedBuckets(FakeWire().announce, (wire := FakeWire()).broadcast, 10**6, layout)
    for n, t in named[:3]:
        short.add(n, t)
    assert "ended after 3 of the 7" in short.finish()[0] and len(wire.sent) == len(layout)


def test_streamed_buckets_stop_after_a_failed_announcement():
    named = exported(6)
    layout = [layout_entry(n, t) for n, t in named]
    wire = FakeWire(fail_announce_at=1)
    pipeline, errors = stream(named, layout, 40, wire)
    assert len(errors) == 1 and "engine gone" in errors[0]
    assert len(wire.announced) == 1 and len(wire.sent) == cut_buckets(layout, 40)[0][1]  # nothing unannounced


# --- flattened buckets sent from where they lie -------------------------------------------


def f32(name: str, numel: int):
    return layout_entry(name, torch.empty(numel))


def test_spans_are_runs_in_address_order_cut_at_the_bucket_size_and_at_least_the_minimum():
    layout = [f32("a", 4), f32("q", 8), f32("b", 2), f32("c", 6), f32("d", 4), f32("e", 2), f32("f", 4)]
    # storage 1: c@0 (24 B) b@24 (8 B) a@32 (16 B): back to back in the reverse of export order;
    # d@100 after a gap; storage 2: e@0 f@8; q is a copy the export made
    where = [(1, 32), None, (1, 24), (1, 0), (1, 100), (2, 0), (2, 8)]
    assert plan_spans(layout, where, bucket_bytes=1024, min_bytes=1) == [[3, 2, 0], [4], [5, 6]]
    assert plan_spans(layout, where, bucket_bytes=1024, min_bytes=17) == [[3, 2, 0], [5, 6]]  # d: 16 B
    assert plan_spans(layout, where, bucket_bytes=32, min_bytes=1) == [[3, 2], [0], [4], [5, 6]]
    assert plan_spans(layout, [None] * len(layout), bucket_bytes=1024, min_bytes=1) == []


def test_where_a_tensor_lies_only_counts_contiguous_views_of_parameter_storages():
    flat = torch.arange(12.0)
    storages = {flat.untyped_storage().data_ptr()}
    assert where_it_lies(flat[4:8], storages) == (flat.untyped_storage().data_ptr(), 16)
    assert where_it_lies(flat.view(3, 4)[:, 1], storages) is None  # strided: the export copies it
    assert where_it_lies(flat[4:8].clone(), storages) is None


def planned_export(seed: float):
    """Parameters packed in one storage, a tensor the export rebuilds (`qkv`), and the plan
    a first sync records from that export."""
    packed = torch.arange(20.0) + seed
    parameters = [packed[:12].view(3, 4), packed[12:]]
    export = [("w", parameters[0]), ("qkv", torch.arange(5.0) - seed), ("b", parameters[1][:4]),
              ("tail", parameters[1][4:]), ("bias", torch.full((3,), seed))]
    storages = {packed.untyped_storage().data_ptr()}
    plan = InPlaceBuckets.plan([layout_entry(n, t) for n, t in export], [where_it_lies(t, storages) for _, t in export],
                               parameters, bucket_bytes=80, min_bytes=1)
    return packed, parameters, export, storages, plan


def test_planned_buckets_send_the_runs_from_memory_first_and_the_rebuilt_tensors_from_where_they_were_written():
    """The next sync of a planned layout: the run goes as a view of the packed storage (the
    sender sees that very memory), the export writes its rebuilt tensor straight into its
    copy bucket (no second copy), the rest is copied in; every tensor arrives exactly."""
    packed, parameters, export, storages, plan = planned_export(1.0)
    assert plan.spans == [[0, 2, 3]] and plan.holds(parameters)
    sender = RecordingSender()
    pipeline = PlannedBuckets(sender, plan, storages, 80, BucketBuffers())
    fresh = {"qkv": torch.arange(5.0) + 100}
    for name, tensor in export:
        if name in fresh:  # the export rebuilds it into the memory it is given
            tensor = pipeline.destination(name, (5,), torch.float32)
            tensor.copy_(fresh[name])
            written_at = tensor.data_ptr()
        pipeline.add(name, tensor)
    assert pipeline.finish() == []
    assert sender.flats[0] == packed.data_ptr()
    assert sender.flats[1] == written_at  # the copy bucket is where the export wrote
    assert [[n for n, _ in bucket] for bucket in sender.buckets] == [["w", "b", "tail"], ["qkv", "bias"]]
    got = dict(delivered(sender))
    assert torch.equal(got["qkv"], fresh["qkv"]) and torch.equal(got["bias"], export[4][1])
    assert all(torch.equal(got[n], t) for n, t in export if n not in fresh)
    assert pipeline.buckets == 2 and pipeline.sent_bytes == 4 * (20 + 5 + 3)
    assert pipeline.destination("qkv", (6,), torch.float32) is None  # not as planned: the export allocates

    parameters[1].data = parameters[1].data.clone()  # a parameter moved: the plan is void
    assert not plan.holds(parameters)


def test_planned_buckets_stop_before_announcing_what_the_export_no_longer_matches():
    packed, parameters, export, storages, plan = planned_export(2.0)
    sender = RecordingSender()
    pipeline = PlannedBuckets(sender, plan, storages, 80, BucketBuffers())
    pipeline.add("w", export[0][1])
    pipeline.add("qkv", torch.zeros(6))  # another shape than planned
    errors = pipeline.finish()
    assert errors and "changed since the previous sync" in errors[0]
    assert [[n for n, _ in bucket] for bucket in sender.buckets] == [["w", "b", "tail"]]  # from memory; nothing else


def test_a_failed_in_place_bucket_stops_the_copied_ones():
    packed, parameters, export, storages, plan = planned_export(3.0)
    sender = RecordingSender(fail_at=0)
    pipeline = PlannedBuckets(sender, plan, storages, 80, BucketBuffers())
    for name, tensor in export:
        pipeline.add(name, tensor)
    errors = pipeline.finish()
    assert errors and "engine gone" in errors[0] and sender.buckets == []
