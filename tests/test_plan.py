"""The one planner: layout rules (whole when it fits, split what does not, one chunked tensor at a
time, expert boundaries) and byte ownership (copied at add, no reference to the producer's tensor)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from verl_fastsync.chunks import (
    BUCKET_ALIGN,
    Assembler,
    Bucket,
    BucketPlanner,
    expert_alignment,
    plan_buckets,
)


def _layout(buckets: list[Bucket]) -> list[list[tuple[str, int, int]]]:
    return [[(m.name, m.chunk_offset, m.chunk_size) for m in b.metas] for b in buckets]


def test_whole_tensor_that_fits_is_never_split() -> None:
    named = [("a", torch.zeros(600, dtype=torch.uint8)), ("b", torch.zeros(600, dtype=torch.uint8))]
    buckets = list(plan_buckets(named, 1024))
    assert _layout(buckets) == [[("a", 0, 600)], [("b", 0, 600)]]


def test_oversize_tensor_fills_room_then_buckets() -> None:
    named = [("a", torch.zeros(16, dtype=torch.uint8)), ("big", torch.zeros(3000, dtype=torch.uint8))]
    buckets = list(plan_buckets(named, 1024))
    assert _layout(buckets) == [
        [("a", 0, 16), ("big", 0, 1008)],
        [("big", 1008, 1024)],
        [("big", 2032, 968)],
    ]


def test_split_never_starts_beside_another_splits_tail() -> None:
    """The receiver then assembles at most one chunked tensor at a time."""
    named = [("x", torch.zeros(1500, dtype=torch.uint8)), ("y", torch.zeros(1500, dtype=torch.uint8))]
    buckets = list(plan_buckets(named, 1024))
    assert _layout(buckets) == [[("x", 0, 1024)], [("x", 1024, 476)], [("y", 0, 1024)], [("y", 1024, 476)]]
    # a whole tensor may share the tail's bucket
    named.insert(1, ("small", torch.zeros(32, dtype=torch.uint8)))
    buckets = list(plan_buckets(named, 1024))
    assert ("small", 0, 32) in _layout(buckets)[1]
    asm = Assembler()
    peak = 0
    for bucket in plan_buckets(
        [(f"t{i}", torch.full((1100 + 17 * i,), i, dtype=torch.uint8)) for i in range(6)], 1024
    ):
        for meta, data in bucket:
            asm.feed(meta, data)
            peak = max(peak, len(asm.incomplete))
    assert peak == 1


def test_expert_alignment_by_name() -> None:
    experts = torch.zeros(8, 4, 8, dtype=torch.float32)  # 128 bytes per expert
    assert expert_alignment("model.layers.0.mlp.experts.w13_weight", experts) == 128
    assert expert_alignment("model.layers.0.mlp.experts.3.up_proj.weight", experts) is None
    buckets = list(plan_buckets([("m.experts.w2", experts)], 300, align=expert_alignment))
    assert all(m.chunk_size % 128 == 0 for b in buckets for m in b.metas)


def test_bytes_are_copied_at_add_and_producer_may_reuse_its_buffer() -> None:
    staging = torch.zeros(100, dtype=torch.float32)
    planner = BucketPlanner(1024)
    out: list[Bucket] = []
    for i in range(10):
        staging.fill_(100 + i)  # one staging buffer refilled per tensor
        out += planner.add(f"w{i}", staging)
    staging.fill_(-1)  # and restored in place after the last yield
    out += planner.finish()
    asm = Assembler()
    got = {n: t for b in out for m, d in b for n, t in asm.feed(m, d)}
    assert [got[f"w{i}"][0].item() for i in range(10)] == [100.0 + i for i in range(10)]


def test_no_reference_to_the_producers_tensor_survives_add() -> None:
    planner = BucketPlanner(256)
    for size in (10, 1000):  # whole and split
        t = torch.ones(size, dtype=torch.float32)
        ref = weakref.ref(t)
        planner.add(f"t{size}", t)
        del t
        gc.collect()
        assert ref() is None, f"the planner kept a {size}-element tensor alive"
    planner.finish()


def test_acquire_and_on_full_drive_the_buffers() -> None:
    slots = [torch.zeros(512, dtype=torch.uint8) for _ in range(2)]
    acquired: list[int] = []
    shipped: list[tuple[int, int]] = []

    def acquire(index: int) -> torch.Tensor:
        acquired.append(index)
        return slots[index % 2]

    def on_full(bucket: Bucket) -> None:
        assert bucket.buffer is slots[bucket.index % 2]
        shipped.append((bucket.index, bucket.nbytes))

    planner = BucketPlanner(512, acquire=acquire, on_full=on_full)
    assert planner.add("a", torch.ones(100, dtype=torch.float32)) == []  # 400 bytes
    # bucket 0 is handed over before bucket 1 is acquired
    assert planner.add("b", torch.ones(100, dtype=torch.float32)) == []
    assert shipped == [(0, 400)] and acquired == [0, 1]
    assert planner.finish() == []
    assert shipped == [(0, 400), (1, 400)]
    assert bytes(slots[1][:400].numpy()) == bytes(
        torch.ones(100, dtype=torch.float32).view(torch.uint8).numpy()
    )


def test_acquire_must_return_a_big_enough_flat_byte_buffer() -> None:
    planner = BucketPlanner(512, acquire=lambda i: torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least 512 bytes"):
        planner.add("a", torch.ones(4))


def test_chunks_start_aligned() -> None:
    named = [(f"t{i}", torch.ones(i + 1, dtype=torch.uint8)) for i in range(20)]
    for bucket in plan_buckets(named, 128):
        assert all(m.bucket_offset % BUCKET_ALIGN == 0 for m in bucket.metas)


class _RecordingFence:
    """Stands in for :class:`~verl_fastsync.io.fence.DeviceFence`: records notes and waits in order."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def note(self, *tensors: torch.Tensor) -> None:
        self.log.append("note:" + ">".join(t.device.type for t in tensors))

    def wait(self) -> None:
        self.log.append("wait")


@pytest.mark.parametrize("dst_device", ["meta", "cpu"])
def test_host_source_into_device_bucket_is_fenced_before_add_returns(dst_device: str) -> None:
    """A host source copied into a device bucket (non_blocking, e.g. from a pinned staging buffer) is
    complete when ``add`` returns, since the producer may refill that host buffer right away; a
    host -> host copy (a synchronous memcpy) waits for nothing until its bucket closes. ("meta"
    stands in for an accelerator: any non-CPU destination takes the device copy path.)"""
    log: list[str] = []
    planner = BucketPlanner(
        1024, acquire=lambda index: torch.empty(1024, dtype=torch.uint8, device=dst_device)
    )
    planner._fence = _RecordingFence(log)  # type: ignore[assignment]
    staging = torch.ones(64, dtype=torch.float32)  # 256 bytes: the bucket stays open
    assert planner.add("w0", staging) == []
    after_copy = [f"note:cpu>{dst_device}"] + ([] if dst_device == "cpu" else ["wait"])
    if dst_device == "cpu":
        assert log == after_copy == ["note:cpu>cpu"], "a host -> host copy must not wait per tensor"
    else:
        assert log == after_copy, "add returned before the host -> device copy was complete"
    log.clear()
    planner.add("w1", torch.ones(900, dtype=torch.uint8))  # does not fit: bucket 0 closes first
    assert log == ["wait", *after_copy]
    log.clear()
    buckets_before, chunks_before = planner.num_buckets, planner.num_chunks
    planner.add("big", torch.ones(2500, dtype=torch.uint8))  # split over several buckets
    closed, chunks = planner.num_buckets - buckets_before, planner.num_chunks - chunks_before
    assert chunks >= 3 and closed >= 2
    notes = [i for i, entry in enumerate(log) if entry.startswith("note:")]
    assert len(notes) == chunks
    if dst_device == "cpu":
        assert log.count("wait") == closed  # the bucket fences only
    else:
        assert all(log[i + 1] == "wait" for i in notes), log  # every chunk fenced at once
        assert log.count("wait") == closed + chunks
    log.clear()
    planner.finish()
    assert log == ["wait"]  # the per-bucket fence still runs at close


def test_flush_closes_the_open_bucket_and_the_layout_stays_whole() -> None:
    """``flush`` sends what the open bucket holds (a split tensor's tail included) and the next
    tensor starts a new bucket; a flush of an empty bucket makes none; the bytes round-trip."""
    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
             for n, size in (("a", 100), ("b", 200), ("big", 2500), ("c", 40))]  # fmt: skip
    planner = BucketPlanner(1024)
    out: list[Bucket] = []
    out += planner.flush()  # nothing open yet: no bucket
    out += planner.add(*named[0])
    out += planner.flush()
    out += planner.flush()  # again: nothing open
    out += planner.add(*named[1])
    out += planner.add(*named[2])
    out += planner.flush()  # the split tensor's tail goes now
    out += planner.add(*named[3])
    out += planner.finish()
    assert _layout(out) == [
        [("a", 0, 100)],
        [("b", 0, 200), ("big", 0, 816)],
        [("big", 816, 1024)],
        [("big", 1840, 660)],
        [("c", 0, 40)],
    ]
    assert [b.index for b in out] == [0, 1, 2, 3, 4]
    asm = Assembler()
    got = {
        name: tensor.clone()
        for bucket in out
        for meta, data in bucket
        for name, tensor in asm.feed(meta, data)
    }
    assert all(torch.equal(got[n], t) for n, t in named)
