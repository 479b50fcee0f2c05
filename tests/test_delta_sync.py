"""``engine_kwargs.fastsync.delta=true`` through the ``fastsync`` engine, in real processes over shm,
gloo and nixl (one sender and, on gloo, every trainer rank sending): every yielded tensor of every
delta sync equals the full sync of the same weights, byte for byte; a sync that fails mid-delta
puts every base back at the last good epoch and the next one diffs against it (or is full when a
rank had committed its part); far fewer bytes move when few values changed.

Only the first test is marked ``verl`` (it builds the engine on verl's base class). None runs per
release: the delta layer uses no verl API beyond the engine's; a delta sync through each release's own
``CheckpointEngineWorker.update_weights`` body is ``test_failure_paths``' load-error test."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from _cgroups import memory_cgroup  # type: ignore[import-not-found]
from _transport_harness import Cluster, TensorSpec, expected_digests, synthetic_model  # type: ignore[import-not-found]

from verl_fastsync.delta.room import RESERVE_MIN
from verl_fastsync.transports.sending import delta_flush_bytes

CPU_TRANSPORTS = ["shm", "gloo", "nixl"]
BUCKET = 4096
TIMEOUT_S = 60
MODEL = synthetic_model(BUCKET, dtypes=("float32", "bfloat16")) + [
    TensorSpec(f"layer{i}.w", (1500 + 37 * i,), "bfloat16") for i in range(12)
]


def _flushes(every: int) -> int:
    """How often a delta stream of MODEL closes a bucket for its model bytes (``flush_every``)."""
    count = since = 0
    for spec in MODEL:
        since += math.prod(spec.shape) * getattr(torch, spec.dtype).itemsize
        if since >= every:
            count, since = count + 1, 0
    return count


def _cluster(transport: str, n_actor: int = 1, n_rollout: int = 2, **ctor: Any) -> Cluster:
    base = {"bucket_size": BUCKET, "timeout_s": TIMEOUT_S, "delta": True}
    return Cluster(transport, n_actor, n_rollout, mode="engine", ctor=base | ctor, timeout=4 * TIMEOUT_S)


def _check(result: dict[str, Any], step: int) -> list[dict[str, float]]:
    want = sorted(expected_digests(MODEL, 0, step))
    for receiver in result["receivers"]:
        assert sorted(tuple(d) for d in receiver["digests"]) == want, f"step {step}"
    return [s["metrics"] for s in result["senders"] if s["metrics"]]


@pytest.mark.verl
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_delta_syncs_deliver_every_byte_and_move_few(transport: str) -> None:
    """5 syncs, ~2-4% of the values changed between them, verify on, tensors split over buckets, a
    consumer that holds every tensor in one of them: byte-exact every time; the first sync is full,
    the others diff and move a fraction of the bytes."""
    with _cluster(transport, verify=True) as cluster:
        for step in range(5):
            recv = {"hold": True} if step == 2 else {}
            [sent] = _check(cluster.sync(MODEL, 0, {"step": step}, recv), step)
            assert sent["fastsync/transfer/delta_sync"] == float(step > 0), sent
            assert sent["fastsync/transfer/delta_full_syncs"] == 1.0
            if step:
                assert sent["fastsync/transfer/delta_tensors"] > 0
                assert sent["fastsync/transfer/delta_codec_s"] > 0.0
                model_bytes = sent["fastsync/transfer/delta_model_bytes"]
                assert sent["fastsync/transfer/bytes"] < 0.3 * model_bytes, sent
                # a bucket goes out after each quarter bucket of model bytes (deltas are a fraction of
                # that): more buckets than a full sync's, not as few as the deltas would fill
                assert (
                    sent["fastsync/transfer/buckets"]
                    >= _flushes(delta_flush_bytes(BUCKET))
                    > _flushes(BUCKET)
                    > 3 * sent["fastsync/transfer/bytes"] / BUCKET
                ), sent
            else:
                assert sent["fastsync/transfer/bytes"] == sent["fastsync/transfer/delta_model_bytes"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_sync_failing_mid_delta_leaves_every_base_at_the_last_epoch(transport: str) -> None:
    """Both rollout ranks' consumers fail mid-delta: the sync fails on every rank, every side puts its
    base back, so the next sync diffs against the last good one on every rank (no full sync), exact.
    Then only one rollout rank fails: a rank that received its whole part commits the new base while
    the others go back, so the next sync is full (counted) - never a diff against different bases -
    and exact; the one after diffs again."""
    with _cluster(transport) as cluster:

        def fail(step: int, raise_after: list[int | None]) -> list[tuple[str, Any]]:
            cluster.build_process_group()
            cluster.post(0, "send", MODEL, 0, {"step": step})
            for rank, after in enumerate(raise_after, start=1):
                cluster.post(rank, "receive", {} if after is None else {"raise_after": after})
            results = [cluster.wait_result(i) for i in range(3)]
            cluster.call_all("finalize")
            assert results[0][0] == "err" and "aborted the sync" in results[0][1], results[0]
            return results

        def check(step: int, delta: bool, full_syncs: int) -> None:
            result = cluster.sync(MODEL, 0, {"step": step})
            [sent] = _check(result, step)
            for metrics in [sent] + [r["metrics"] for r in result["receivers"]]:
                assert metrics["fastsync/transfer/delta_sync"] == float(delta), metrics
                assert metrics["fastsync/transfer/delta_full_syncs"] == float(full_syncs), metrics
            if delta:
                assert sent["fastsync/transfer/bytes"] < 0.3 * sent["fastsync/transfer/delta_model_bytes"]

        _check(cluster.sync(MODEL, 0, {"step": 0}), 0)
        results = fail(1, [9, 5])
        # (a rank fails on its own or, when the other's abort reaches it first, with that reason)
        assert all(r[0] == "err" for r in results[1:]), results
        assert any("failed on purpose" in r[1] for r in results[1:]), results
        check(2, delta=True, full_syncs=1)
        results = fail(3, [None, 5])
        assert results[2][0] == "err" and "consumer failed on purpose" in results[2][1], results[2]
        completed = results[1][0] == "ok"  # rank 1 may have received everything before the abort
        check(4, delta=not completed, full_syncs=1 + completed)
        check(5, delta=True, full_syncs=1 + completed)


@pytest.mark.timeout(900)
def test_delta_with_every_trainer_rank_sending() -> None:
    """``senders=all`` with 2 trainer ranks x 2 rollout ranks on gloo: each sender diffs its own share
    (the plan is made on the tensors' own sizes, so shares stay put), every tensor arrives once,
    byte-exact, over 3 syncs."""
    with _cluster("gloo", n_actor=2, senders="all") as cluster:
        for step in range(3):
            sent = _check(cluster.sync(MODEL, 0, {"step": step}), step)
            assert len(sent) == 2
            for metrics in sent:
                assert metrics["fastsync/transfer/delta_sync"] == float(step > 0)
                if step:
                    raw = metrics["fastsync/transfer/delta_raw_tensors"]
                    assert raw < metrics["fastsync/transfer/tensors"]
            if step:  # each lane posts a bucket per bucket of its share's model bytes, not per delta bucket
                buckets = sum(m["fastsync/transfer/buckets"] for m in sent)
                assert buckets > 3 * sum(m["fastsync/transfer/bytes"] for m in sent) / BUCKET, sent


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tight", ["rollout", "sender"])
def test_a_rank_without_room_for_its_base_turns_delta_off_for_every_rank(tight: str) -> None:
    """One rank runs in a real memory cgroup (a container's limit) that leaves it a few MiB beyond the
    4 GiB it must keep free: rollout rank 1 (one sender, gloo), or trainer rank 1 of two that both
    send (``senders=all``, lanes). In the first sync it finds no room for its whole base, every
    consumer still gets every byte, and from the next sync on every rank runs full syncs and keeps
    no base (told by the topology, with the reason); exact every time."""
    model = [TensorSpec(f"big{i}.w", (1 << 20,), "bfloat16") for i in range(8)]  # 16 MiB, 2 MiB tensors
    n_actor, extra = (1, {}) if tight == "rollout" else (2, {"senders": "all"})
    index = 2 if tight == "rollout" else 1  # the process: trainers first, then rollout ranks
    label = "rollout rank 1, receiver" if tight == "rollout" else "trainer rank 1, sender"
    ranks = n_actor + 2
    with memory_cgroup(RESERVE_MIN + (6 << 20)) as (directory, _version):
        # hosts=off: each rollout rank keeps its own base (over the hosts only a host's leader does)
        with _cluster("gloo", n_actor=n_actor, bucket_size=1 << 20, hosts="off", **extra) as cluster:
            procs = os.path.join(directory, "cgroup.procs")
            join = f"import os\nwith open({procs!r}, 'w') as fh:\n    fh.write(str(os.getpid()))"
            cluster.post(index, "exec", join)
            cluster.wait(index)
            for step in range(3):
                result = cluster.sync(model, 0, {"step": step})
                want = sorted(expected_digests(model, 0, step))
                for receiver in result["receivers"]:
                    assert sorted(tuple(d) for d in receiver["digests"]) == want, f"step {step}"
                sent = [s["metrics"] for s in result["senders"]]
                every = sent + [r["metrics"] for r in result["receivers"]]
                off = [m["fastsync/transfer/delta_off"] for m in every]
                first = [float(i == index) for i in range(ranks)]
                assert off == (first if step == 0 else [1.0] * ranks), (step, off)
                assert all(m["fastsync/transfer/delta_sync"] == 0.0 for m in every), step
                assert sum(m["fastsync/transfer/bytes"] for m in sent) == 16 << 20  # every byte, as itself
            read = "side = worker.engine.delta_encoder or worker.engine.delta_decoder\n"
            read += "result = (side.off, side.base_bytes)"
            reasons = []
            for rank in range(ranks):
                cluster.post(rank, "exec", read)
                reason, base_bytes = cluster.wait(rank)
                assert base_bytes == 0 and reason, (rank, reason, base_bytes)
                reasons.append(reason)
            own = reasons[index]
            rank, role = label.split(", ")
            assert own.startswith(f"{role}: keeping the delta base of"), own
            assert "less than 4.00 GiB free in this process's memory cgroup (a container's limit)" in own, own
            assert all(r == f"{rank}, {own}" for i, r in enumerate(reasons) if i != index), reasons


LAZY = [
    TensorSpec("rotary.spins", (3000,), "complex64", lazy="conj"),
    TensorSpec("gate.gains", (40, 60), "float32", lazy="neg"),
    TensorSpec("gate.gains_t", (60, 40), "bfloat16", noncontig=True, lazy="neg"),
    TensorSpec("gate.bias", (1,), "bfloat16", lazy="strided"),
    TensorSpec("gate.scale", (1, 1), "float32", lazy="strided"),
]
"""Tensors the transports accept whose bytes only their byte view reads right: conjugate and
negative-bit views, one-element tensors with a non-unit stride."""


@pytest.mark.timeout(900)
def test_every_tensor_the_transports_accept_syncs_exactly_as_a_delta() -> None:
    """Before the fix each tensor of :data:`LAZY` failed every delta sync (on the sender, before a byte
    moved); a full sync (no delta) moved them. Now 3 delta syncs over gloo deliver them as the
    transports' byte view reads them, the larger ones as deltas."""
    model = LAZY
    with _cluster("gloo") as cluster:
        for step in range(3):
            result = cluster.sync(model, 0, {"step": step})
            want = sorted(expected_digests(model, 0, step))
            for receiver in result["receivers"]:
                assert sorted(tuple(d) for d in receiver["digests"]) == want, f"step {step}"
            [sent] = [s["metrics"] for s in result["senders"]]
            assert sent["fastsync/transfer/delta_sync"] == float(step > 0), sent
            if step:  # the three large ones as deltas, the one-element ones as themselves
                assert sent["fastsync/transfer/delta_tensors"] == 3, sent
                assert sent["fastsync/transfer/delta_raw_tensors"] == 2, sent


@pytest.mark.timeout(900)
def test_a_holding_consumer_keeps_delta_syncs_after_a_failed_one() -> None:
    """The consumer holds every tensor it was given until the next sync ends (as an adapter that
    batches tensors before loading them keeps them), so each base is held when the next sync
    rebuilds it. Before the fix the receiver's undo journal charged every held base at its size and
    gave up, so a failed delta sync left it without a base and the next sync was full. Now the failed
    sync rolls back on every rank and the next one diffs again, exact."""
    hold = {"hold": True, "keep_held": True}
    with _cluster("gloo", n_rollout=1) as cluster:

        def synced(step: int) -> dict[str, float]:
            result = cluster.sync(MODEL, 0, {"step": step}, hold)
            [sent] = _check(result, step)
            [received] = [r["metrics"] for r in result["receivers"]]
            return {**{f"sender {k}": v for k, v in sent.items()}, **received}

        synced(0)
        assert synced(1)["fastsync/transfer/delta_sync"] == 1.0
        cluster.build_process_group()
        cluster.post(0, "send", MODEL, 0, {"step": 2})
        cluster.post(1, "receive", hold | {"raise_after": 12})
        trainer, rollout = cluster.wait_result(0), cluster.wait_result(1)
        cluster.call_all("finalize")
        assert rollout[0] == "err" and "consumer failed on purpose after 12 tensors" in rollout[1], rollout
        assert trainer[0] == "err" and "aborted the sync" in trainer[1], trainer
        for step in (3, 4):
            metrics = synced(step)
            for side in ("sender ", ""):
                assert metrics[f"{side}fastsync/transfer/delta_sync"] == 1.0, (step, metrics)
                assert metrics[f"{side}fastsync/transfer/delta_full_syncs"] == 1.0, (step, metrics)
            assert (
                metrics["sender fastsync/transfer/bytes"]
                < 0.3 * metrics["fastsync/transfer/delta_model_bytes"]
            )
