"""The engine receive stream's own rules (no verl): the reason a closed stream sends, and the fence on
the destination device before a bucket is refilled or reused."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from _transport_harness import Cluster, TensorSpec, expected_digests  # type: ignore[import-not-found]

from verl_fastsync.chunks import Assembler, ChunkMeta
from verl_fastsync.chunks.meta import dtype_to_str
from verl_fastsync.io.control import ControlChannel
from verl_fastsync.transports.base import ConsumerError, PeerAbortedError, consumer_error, failure_reason
from verl_fastsync.transports.shm import ShmTransport
from verl_fastsync.wire import Abort, Attached, SyncEnd, encode


def test_a_closed_stream_names_the_consumer_not_pythons_close_mechanism() -> None:
    assert failure_reason(GeneratorExit(), 7) == (
        "the consumer stopped before the end of the sync (its receive stream was closed after 7 tensors)"
    )
    assert failure_reason(ValueError("bad shape")) == "ValueError: bad shape"
    assert "cancelled" in failure_reason(asyncio.CancelledError())
    error = consumer_error(KeyError("lm_head.weight"), 3)
    assert isinstance(error, ConsumerError)
    assert str(error) == "the consumer failed: KeyError: 'lm_head.weight'"
    assert failure_reason(error) == str(error)  # thrown into the stream, it is sent as it is
    assert str(consumer_error(None, 2)).startswith("the consumer stopped before the end of the sync")


def test_copies_into_a_device_destination_are_noted_on_the_fence() -> None:
    """A destination on another device is written with a non-blocking copy: the assembler's fence
    must name that device (the bucket's own device, the host, tells nothing about it)."""
    data = torch.arange(16, dtype=torch.uint8)
    meta = ChunkMeta(
        name="w",
        tensor_index=0,
        shape=(4,),
        dtype=dtype_to_str(torch.float32),
        total_bytes=16,
        chunk_offset=0,
        chunk_size=16,
        bucket_offset=0,
    )
    on_host = Assembler("cpu")
    on_host.feed(meta, data)
    assert not on_host.fence.pending
    on_device = Assembler("meta")  # stands in for an accelerator: copies into it are device copies
    ((_name, tensor),) = on_device.feed(meta, data)
    assert tensor.device.type == "meta" and on_device.fence.pending


FENCE_PROBE = """
import verl_fastsync.io.fence as fence
events = worker.events = []
original_wait = fence.DeviceFence.wait
def wait(self):
    events.append("fence")
    original_wait(self)
fence.DeviceFence.wait = wait
t = worker.engine
original_release = t._release_slot
def release(slot, bucket_index):
    events.append(("release", bucket_index))
    original_release(slot, bucket_index)
t._release_slot = release
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_the_destination_fence_comes_before_every_bucket_release(transport: str) -> None:
    """Before a receiver lets its sender refill a slot (or reuses the buffer), every copy out of that
    bucket has completed, those into device destinations included."""
    specs = [TensorSpec(f"t{i}", (900,), "float32") for i in range(5)] + [
        TensorSpec("big", (3000,), "float32")
    ]
    ctor = {"bucket_size": 4096, "timeout_s": 60}
    with Cluster(transport, 1, 1, mode="transport", ctor=ctor, timeout=240) as cluster:
        cluster.post(1, "exec", FENCE_PROBE)
        cluster.wait(1)
        result = cluster.sync(specs, seed=3)
        cluster.post(1, "exec", "result = list(worker.events)")
        events = cluster.wait(1)
    assert [tuple(d) for d in result["receivers"][0]["digests"]] == expected_digests(specs, 3)
    releases = [i for i, event in enumerate(events) if event != "fence"]
    assert len(releases) == result["senders"][0]["metrics"]["fastsync/transfer/buckets"]
    for index in releases:
        assert index > 0 and events[index - 1] == "fence", events


def test_a_sender_that_finds_its_receiver_gone_raises_the_abort_it_left() -> None:
    """A receiver that fails posts its Abort, then closes its channel. zmq may report the closed
    connection to a sender that is about to post a bucket before the sender read that Abort: the
    sync must still fail with the receiver's reason, not "Host unreachable" (seen under load)."""
    router, dealer = ControlChannel(), ControlChannel(linger_ms=5000)
    try:
        dealer.connect(router.bind(), routing_id=b"rollout-1")
        dealer.send(encode(Attached(rank=1)))
        assert router.recv(time.monotonic() + 30) is not None  # connected both ways
        sender = ShmTransport()
        sender.role, sender.rank = "trainer", 0
        sender._channel, sender._peers = router, {b"rollout-1": 1}
        dealer.send(encode(Abort(reason="the consumer failed: LoadError: boom", rank=1)))
        dealer.close()
        deadline = time.monotonic() + 30
        with pytest.raises(
            PeerAbortedError, match="rollout rank 0 aborted the sync: the consumer failed: LoadError: boom"
        ):
            while time.monotonic() < deadline:  # posts succeed until the router sees the peer gone
                sender._send_to(
                    b"rollout-1", SyncEnd(sync_id="s", num_buckets=0, num_tensors=0, total_bytes=0)
                )
                time.sleep(0.01)
    finally:
        dealer.close()
        router.close()
