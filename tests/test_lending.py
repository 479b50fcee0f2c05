"""Lending receive buffers (``verl_fastsync.io.lending``) and the engine receivers that lend them.

The lease must see every way a consumer can keep lent memory alive (the tensor, a view, its storage,
a NumPy array over it) and none that does not (a clone); the pool must bound its spares. In real
processes, over shm, gloo and nixl, with the safe default (``zero_copy=False``): a consumer that
drops each tensor gets the right bytes with nothing copied, sync after sync, and one that keeps
views of some tensors while later buckets arrive still reads exactly what was sent.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pytest
import torch
from _transport_harness import Cluster, TensorSpec, expected_digests  # type: ignore[import-not-found]

from verl_fastsync.io.lending import DestinationPool, LendingPool, lend

CPU_TRANSPORTS = ["shm", "gloo", "nixl"]
BUCKET = 4096
WHOLE = [TensorSpec(f"w{i}", (200 + i,), "float32") for i in range(12)] + [
    TensorSpec(f"h{i}", (300,), "bfloat16") for i in range(6)
]  # every tensor fits a bucket: all of them can be lent
HANG_TIMEOUT = 300  # a hang guard only: a slow but correct run on a loaded 2-core host passes


def test_lease_follows_every_reference_into_the_buffer() -> None:
    buffer = torch.arange(64, dtype=torch.uint8)
    for keep in (
        lambda t: t,
        lambda t: t[8:16].view(torch.int16),
        lambda t: t.untyped_storage(),
        lambda t: t[4:].numpy(),
    ):
        lent, lease = lend(buffer)
        kept = keep(lent)
        del lent
        assert lease.active
        del kept
        assert not lease.active
    lent, lease = lend(buffer)
    copy = lent.clone()
    del lent
    assert not lease.active and copy[5] == 5
    assert lend(buffer)[0].data_ptr() == buffer.data_ptr()  # the same memory, no copy


def test_lend_refuses_device_buffers() -> None:
    with pytest.raises(ValueError, match="only host buffers can be lent"):
        lend(torch.empty(4, dtype=torch.uint8, device="meta"))


def test_pool_rotates_and_keeps_at_most_its_spares() -> None:
    made: list[torch.Tensor] = []

    def make(size: int) -> torch.Tensor:
        made.append(torch.zeros(size, dtype=torch.uint8))
        return made[-1]

    pool = LendingPool(16, make, keep_spares=1)
    views = []
    for _ in range(3):  # the consumer holds three buffers: three made, all on loan
        lent, lease = lend(pool.take())
        views.append(lent)
        pool.loan(lease)
        del lent
    assert len(made) == 3 and pool.on_loan == 3 and pool.loaned_bytes == 48
    views.clear()
    pool.reclaim()
    assert pool.on_loan == 0
    first = pool.take()
    assert any(first is b for b in made)  # a returned buffer, not a new one
    assert pool.take() is not first and len(made) == 4  # only one spare was kept
    pool.clear()
    assert pool.on_loan == 0


def test_destination_pool_reuses_memory_only_once_the_consumer_let_go() -> None:
    pool = DestinationPool(keep=2)
    cpu = torch.device("cpu")
    first = pool.allocate((3, 500), torch.bfloat16, cpu)  # 3000 bytes
    assert first.shape == (3, 500) and first.dtype == torch.bfloat16 and first.is_contiguous()
    first.fill_(1.5)
    address = first.data_ptr()
    kept = first[1, 100:110]  # the consumer keeps only a view: the memory is still the consumer's
    del first
    second = pool.allocate((3, 500), torch.bfloat16, cpu)
    assert second.data_ptr() != address and pool.made == 2
    second.fill_(-2.0)
    assert torch.equal(kept, torch.full((10,), 1.5, dtype=torch.bfloat16))  # never written again
    del kept
    third = pool.allocate((1000,), torch.float32, cpu)  # 4000 bytes: the free 3000-byte one is too small
    assert third.data_ptr() != address and pool.made == 3
    del third
    fourth = pool.allocate((3, 500), torch.bfloat16, cpu)  # the smallest free buffer that fits
    assert fourth.data_ptr() == address and pool.made == 3
    del second, fourth
    pool.reclaim()
    assert pool.free_bytes == 4000 + 3000  # three free buffers: the two largest are kept
    pool.clear()
    assert pool.free_bytes == 0


@pytest.mark.timeout(60)  # a callback that blocked on the pool's lock would hang here
def test_buffers_come_back_the_moment_the_consumer_lets_go() -> None:
    """No take(), allocate() or reclaim() in between: when the consumer drops its last view the
    lease settles by itself (also from another thread, also while the pool's lock is held, when it
    queues and the next pool call settles it), spares stay at their bound and the rest is freed."""
    pool = LendingPool(16, lambda size: torch.zeros(size, dtype=torch.uint8), keep_spares=1)
    views: list[torch.Tensor] = []
    alive: list[weakref.ref[torch.Tensor]] = []
    for _ in range(5):
        buffer = pool.take()
        alive.append(weakref.ref(buffer))
        lent, lease = pool.lend(buffer)
        pool.loan(lease)
        views.append(lent)
        del buffer, lent, lease
    assert pool.on_loan == 5 and pool.loaned_bytes == 80 and pool.spares == 0
    views.pop()  # one lets go: it becomes the spare at once
    assert pool.on_loan == 4 and pool.spares == 1
    worker = threading.Thread(target=views.pop)  # dropped in another thread
    worker.start()
    worker.join()
    assert pool.on_loan == 3 and pool.spares == 1
    with pool._lock:  # the callback cannot take the lock: it queues and returns
        views.clear()
    assert pool.on_loan == 0 and pool.spares == 1
    assert sum(ref() is not None for ref in alive) == 1  # four buffers were freed, one spare kept

    dest = DestinationPool(keep=2)
    cpu = torch.device("cpu")
    tensors = [dest.allocate((n,), torch.uint8, cpu) for n in (1000, 4000, 2000, 3000)]
    assert dest.loaned_bytes == 10000 and dest.free_bytes == 0
    tensors.clear()
    assert dest.loaned_bytes == 0 and dest.free_bytes == 4000 + 3000  # the two largest kept


def _cluster(transport: str) -> Cluster:
    ctor = {"bucket_size": BUCKET, "timeout_s": 60}
    return Cluster(transport, 1, 1, mode="transport", ctor=ctor, timeout=240)


def _digests(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(d) for d in result["receivers"][0]["digests"]]


@pytest.mark.timeout(HANG_TIMEOUT)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("loop_var", [False, True])
def test_default_receiver_lends_instead_of_copying(transport: str, loop_var: bool) -> None:
    """A consumer that uses each tensor at once: right bytes in every sync and no byte copied out of
    the buckets (the 0.2.0 default copied every one). With ``loop_var`` the consumer keeps each
    tensor in its loop variable until the next arrives (vLLM's ``load_weights`` loop), so every
    bucket is still referenced when its slot is released: every slot moves to a spare (on nixl a new
    address for the sender) each bucket, and the moves must neither copy nor misdeliver. (That the
    held bucket is not refilled is the keeping tests' job: this consumer never reads it again.)"""
    with _cluster(transport) as cluster:
        for seed in range(4):
            result = cluster.sync(WHOLE, seed=seed, recv_extra={"keep_loop_var": loop_var})
            assert _digests(result) == expected_digests(WHOLE, seed)
            metrics = result["receivers"][0]["metrics"]
            assert metrics["fastsync/transfer/copied_bytes_receiver"] == 0
            assert metrics["fastsync/transfer/buckets"] >= 4


@pytest.mark.timeout(HANG_TIMEOUT)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("hold", ["views", "tensors"])
def test_consumer_keeping_some_tensors_reads_what_was_sent(transport: str, hold: str) -> None:
    """Every third tensor kept (the tensor, or only a view of it) until the sync ends while later
    buckets flow through the same slots; the next syncs (other contents) are right too."""
    with _cluster(transport) as cluster:
        for seed in (5, 6, 7):
            result = cluster.sync(WHOLE, seed=seed, recv_extra={"hold": hold, "hold_every": 3})
            assert _digests(result) == expected_digests(WHOLE, seed)
        result = cluster.sync(WHOLE, seed=8)
        assert _digests(result) == expected_digests(WHOLE, 8)


@pytest.mark.timeout(HANG_TIMEOUT)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_two_receivers_one_keeping_views_both_read_what_was_sent(transport: str) -> None:
    """Rollout rank 1 keeps views of every other tensor, rank 2 drops each at once: the sender must
    not refill a bucket either still references (for shm: one segment shared by both)."""
    ctor = {"bucket_size": BUCKET, "timeout_s": 60}
    with Cluster(transport, 1, 2, mode="transport", ctor=ctor, timeout=240) as cluster:
        for seed in (11, 12, 13):
            cluster.build_process_group()
            cluster.post(0, "send", WHOLE, seed, {})
            cluster.post(1, "receive", {"hold": "views", "hold_every": 2})
            cluster.post(2, "receive", {})
            results = [cluster.wait(i) for i in range(3)]
            cluster.call_all("finalize")
            for receiver in results[1:]:
                assert [tuple(d) for d in receiver["digests"]] == expected_digests(WHOLE, seed)


@pytest.mark.timeout(HANG_TIMEOUT)
def test_segments_made_for_a_keeping_consumer_are_dropped_once_it_lets_go() -> None:
    """shm: a consumer that keeps every tensor makes the sender create a segment per bucket (both
    sides map them all); once it lets go, the pool falls back to the three slots and one spare: two
    syncs later each side reports at most four buckets again. (gloo's receiver-side pool keeps at
    most one spare: ``test_pool_rotates_and_keeps_at_most_its_spares``.)"""
    one_per_bucket = [TensorSpec(f"b{i}", (900,), "float32") for i in range(12)]  # 3600 of 4096 bytes
    with _cluster("shm") as cluster:
        held = cluster.sync(one_per_bucket, seed=1, recv_extra={"hold": "tensors"})
        assert _digests(held) == expected_digests(one_per_bucket, 1)
        grown = max(
            held["senders"][0]["metrics"]["fastsync/transfer/peak_extra_bytes_sender"],
            held["receivers"][0]["metrics"]["fastsync/transfer/peak_extra_bytes_receiver"],
        )
        assert grown >= 12 * BUCKET  # the loaned buckets were replaced, not refilled
        for seed in (2, 3):
            result = cluster.sync(one_per_bucket, seed=seed)
            assert _digests(result) == expected_digests(one_per_bucket, seed)
        for side, key in (("senders", "sender"), ("receivers", "receiver")):
            assert result[side][0]["metrics"][f"fastsync/transfer/peak_extra_bytes_{key}"] <= 4 * BUCKET


@pytest.mark.timeout(HANG_TIMEOUT)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_tensors_kept_from_a_failed_sync_survive_the_next_sync(transport: str) -> None:
    """The consumer keeps views of every tensor, then raises mid-bucket; the sync fails on both
    sides, and the consumer still holds what it got. The next sync (other contents) must not land
    in those buffers: nixl keeps its registered buckets after a failed sync (a WRITE may still
    land), so the bucket lent at the failure must stay on loan like any other."""
    with _cluster(transport) as cluster:
        cluster.build_process_group()
        cluster.post(0, "send", WHOLE, 21, {})
        cluster.post(1, "receive", {"hold": "views", "raise_after": 6, "keep_held": True})
        recv_status, recv_message = cluster.wait_result(1)
        send_status, _ = cluster.wait_result(0)
        assert recv_status == "err" and "consumer failed on purpose after 6 tensors" in recv_message
        assert send_status == "err"
        cluster.call_all("finalize")
        result = cluster.sync(WHOLE, seed=22, recv_extra={"report_kept": True})
        assert _digests(result) == expected_digests(WHOLE, 21)[:6]
        result = cluster.sync(WHOLE, seed=23)
        assert _digests(result) == expected_digests(WHOLE, 23)
