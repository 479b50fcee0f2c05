"""``engine_kwargs.fastsync.delta=true`` through the ``fastsync`` engine, in real processes over shm,
gloo and nixl (one sender and, on gloo, every trainer rank sending): every yielded tensor of every
delta sync equals the full sync of the same weights, byte for byte; a sync that fails mid-delta
leaves no base in use and the next one is full; far fewer bytes move when few values changed.

Only the first test is marked ``verl`` (run against every verl release): the delta layer uses no verl
API beyond the engine's; the others run with the default release."""

from __future__ import annotations

from typing import Any

import pytest
from _transport_harness import Cluster, TensorSpec, expected_digests, synthetic_model  # type: ignore[import-not-found]

CPU_TRANSPORTS = ["shm", "gloo", "nixl"]
BUCKET = 4096
TIMEOUT_S = 60
MODEL = synthetic_model(BUCKET, dtypes=("float32", "bfloat16")) + [
    TensorSpec(f"layer{i}.w", (1500 + 37 * i,), "bfloat16") for i in range(12)
]


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
            else:
                assert sent["fastsync/transfer/bytes"] == sent["fastsync/transfer/delta_model_bytes"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_sync_failing_mid_delta_is_followed_by_a_full_one(transport: str) -> None:
    """The consumer fails mid-delta on one rollout rank: the sync fails on every rank; the next sync
    is full on every rank (counted), exact, and the one after diffs again."""
    with _cluster(transport) as cluster:
        _check(cluster.sync(MODEL, 0, {"step": 0}), 0)
        cluster.build_process_group()
        cluster.post(0, "send", MODEL, 0, {"step": 1})
        cluster.post(1, "receive", {})
        cluster.post(2, "receive", {"raise_after": 5})
        results = [cluster.wait_result(i) for i in range(3)]
        cluster.call_all("finalize")
        assert results[2][0] == "err" and "consumer failed on purpose" in results[2][1], results[2]
        assert results[0][0] == "err" and "rank 2 aborted the sync" in results[0][1], results[0]
        result = cluster.sync(MODEL, 0, {"step": 2})
        [sent] = _check(result, 2)
        assert sent["fastsync/transfer/delta_sync"] == 0.0
        assert sent["fastsync/transfer/delta_full_syncs"] == 2.0
        for receiver in result["receivers"]:
            assert receiver["metrics"]["fastsync/transfer/delta_sync"] == 0.0
        [sent] = _check(cluster.sync(MODEL, 0, {"step": 3}), 3)
        assert sent["fastsync/transfer/delta_sync"] == 1.0


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
