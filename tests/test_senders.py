"""``engine_kwargs.fastsync.senders``: several trainer ranks send disjoint, byte-balanced shares on
their own lanes; every rollout rank gets every tensor exactly once, byte for byte.

The plan and the receiver's bookkeeping are checked in-process; the engine end to end with spawned
processes driven through verl's engine protocol (see ``_transport_harness``): 2 trainer ranks x 2
rollout ranks on shm, gloo and nixl, tensors chunked over several buckets, a sender failing
mid-sync, a sender that breaks the plan (a missing or a duplicated tensor), a sender that never
arrives. None runs per release (``release``): the lanes use no verl API beyond the engine's; verl's
own manager driving two senders, on each release, is ``test_senders_verl``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from _transport_harness import Cluster, TensorSpec, expected_digests, synthetic_model  # type: ignore[import-not-found]

from verl_fastsync.config import EngineKwargsError, parse_senders
from verl_fastsync.transports.base import TransportError
from verl_fastsync.transports.lanes_plan import (
    LanePlan,
    LaneTally,
    choose_senders,
    manifest_tensor,
    read_manifest,
)

CPU_TRANSPORTS = ["shm", "gloo", "nixl"]
TIMEOUT_S = 60
BUCKET = 4096


# ------------------------------------------------------------------------------ the plan, in-process


def test_senders_setting_is_validated_naming_what_is_allowed() -> None:
    assert parse_senders(1) == 1 and parse_senders(4) == 4 and parse_senders("2") == 2
    assert parse_senders("all") is None and parse_senders(" ALL ") is None
    for bad in (0, -1, True, 1.5, "some", "", None, "2.0"):
        with pytest.raises(
            EngineKwargsError, match=r"senders=.* is invalid; allowed: a positive int .* or 'all'"
        ):
            parse_senders(bad)


def test_the_plan_is_the_same_on_every_sender_and_balanced_by_bytes() -> None:
    sizes = [(f"t{i}", (i * 7919) % 5000 + 1) for i in range(300)]
    plans = [LanePlan(3) for _ in range(3)]
    lanes = [[plan.assign(name, size) for name, size in sizes] for plan in plans]
    assert lanes[0] == lanes[1] == lanes[2]  # every sender computes it alone, identically
    assert {plans[0].manifest(0, 0).digest} == {p.manifest(0, 0).digest for p in plans}
    largest = max(size for _, size in sizes)
    assert max(plans[0].nbytes) - min(plans[0].nbytes) <= largest
    assert sum(plans[0].counts) == 300 and plans[0].total_bytes == sum(size for _, size in sizes)
    # another order is another plan (the digest says so)
    other = LanePlan(3)
    for name, size in reversed(sizes):
        other.assign(name, size)
    assert other.manifest(0, 0).digest != plans[0].manifest(0, 0).digest
    with pytest.raises(TransportError, match="reserved"):
        LanePlan(2).assign("[fastsync: the end of a sender's share]", 1)


def test_senders_are_spread_over_hosts_and_rank_0_always_sends() -> None:
    hosts = ["a", "a", "b", "b"]
    assert choose_senders(hosts, 1) == [0]
    assert choose_senders(hosts, 2) == [0, 2]  # one per host before a second on a host
    assert choose_senders(hosts, 3) == [0, 1, 2]
    assert choose_senders(hosts, None) == [0, 1, 2, 3]
    assert choose_senders(hosts, 9) == [0, 1, 2, 3]
    assert choose_senders(["a", "b", "c"], 2) == [0, 1]


def test_the_receivers_bookkeeping_names_the_sender() -> None:
    plan = LanePlan(2)
    items = [("a", 8), ("b", 4), ("c", 4), ("d", 0)]
    lanes = [plan.assign(name, size) for name, size in items]
    assert lanes == [0, 1, 1, 0]
    manifests = [
        read_manifest(manifest_tensor(plan.manifest(lane, sender)), "x") for lane, sender in ((0, 0), (1, 3))
    ]

    def tally() -> LaneTally:
        return LaneTally([0, 3], "rollout rank 1")

    whole = tally()
    for (name, size), lane in zip(items, lanes, strict=True):
        whole.take(lane, name, torch.zeros(size, dtype=torch.uint8))
    for lane in (0, 1):
        whole.manifest(lane, manifests[lane])
        whole.end(lane)
    whole.finish()

    twice = tally()
    twice.take(0, "a", torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(
        TransportError,
        match=r"'a' arrived twice, from trainer rank 0 \(lane 0\) and from trainer rank 3 \(lane 1\)",
    ):
        twice.take(1, "a", torch.zeros(8, dtype=torch.uint8))

    short = tally()
    short.take(1, "b", torch.zeros(4, dtype=torch.uint8))
    short.manifest(1, manifests[1])
    with pytest.raises(
        TransportError, match=r"trainer rank 3 \(lane 1\) delivered 1 of the 2 tensors.*1 missing"
    ):
        short.end(1)

    unended = tally()
    with pytest.raises(
        TransportError, match=r"trainer rank 0 \(lane 0\) ended its lane without its manifest"
    ):
        unended.end(0)
    wrong = tally()
    with pytest.raises(TransportError, match="sent the manifest of lane 1"):
        wrong.manifest(0, manifests[1])
    other = LanePlan(2)
    for name, size in items[:3]:
        other.assign(name, size)
    differ = tally()
    differ.manifest(0, manifests[0])
    differ.manifest(1, other.manifest(1, 3))
    differ.ended = [True, True]
    with pytest.raises(TransportError, match="the senders planned different syncs"):
        differ.finish()


# ------------------------------------------------------------------------------ the engine, end to end


def _model() -> list[TensorSpec]:
    """Small and 1x-10x-bucket tensors (chunked over several buckets), 0-dim, empty, non-contiguous."""
    return synthetic_model(BUCKET, dtypes=("float32", "bfloat16")) + [
        TensorSpec(f"layer{i}.w", (300 + 37 * i,), "float32") for i in range(16)
    ]


def _cluster(transport: str, n_actor: int = 2, n_rollout: int = 2, **ctor: Any) -> Cluster:
    base = {"bucket_size": BUCKET, "timeout_s": TIMEOUT_S, "senders": "all"}
    return Cluster(transport, n_actor, n_rollout, mode="engine", ctor=base | ctor, timeout=4 * TIMEOUT_S)


def _assert_exactly_once(receivers: list[dict[str, Any]], model: list[TensorSpec], seed: int) -> None:
    expected = sorted(expected_digests(model, seed))
    for receiver in receivers:
        got = [tuple(d) for d in receiver["digests"]]
        assert len(got) == len(model)
        assert len({d[0] for d in got}) == len(model)  # no name twice
        assert sorted(got) == expected  # every byte, shape and dtype


@pytest.mark.verl
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_two_senders_two_receivers_every_tensor_exactly_once(transport: str) -> None:
    """2 trainer ranks x 2 rollout ranks, ``senders=all``: both trainer ranks send a share (bytes within
    one tensor of each other's), the shares add up to the model, each rollout rank gets every tensor
    once, byte-exact, twice in a row (the second sync reuses each lane's resources); verify on."""
    model = _model()
    total = sum(t.numel() * t.element_size() for t in (_tensor(s) for s in model))
    with _cluster(transport, verify=True) as cluster:
        for seed in (1, 2):
            result = cluster.sync(model, seed)
            _assert_exactly_once(result["receivers"], model, seed)
            sent = [s["metrics"] for s in result["senders"]]
            assert all(m["fastsync/transfer/tensors"] > 0 for m in sent), sent
            assert sum(m["fastsync/transfer/tensors"] for m in sent) == len(model)
            assert sum(m["fastsync/transfer/bytes"] for m in sent) == total
            for receiver in result["receivers"]:
                assert receiver["metrics"]["fastsync/transfer/tensors"] == len(model)
                assert receiver["metrics"]["fastsync/transfer/bytes"] == total


def _tensor(spec: TensorSpec) -> torch.Tensor:
    from _transport_harness import build_tensor  # type: ignore[import-not-found]

    return build_tensor(spec, 0)


@pytest.mark.verl
@pytest.mark.timeout(900)
def test_two_of_three_trainer_ranks_send_the_third_walks_its_generator() -> None:
    """``senders=2`` with 3 trainer ranks: ranks 0 and 1 send, rank 2 produces its weights (verl's
    generator may be collective) and sends nothing; one rollout rank; oversize tensors, shm; then
    with ``bucket_bytes=auto`` and with ``zero_copy``."""
    model = _model()
    with _cluster("shm", n_actor=3, n_rollout=1, senders=2) as cluster:
        result = cluster.sync(model, 3)
        _assert_exactly_once(result["receivers"], model, 3)
        first, second, third = (s["metrics"] for s in result["senders"])
        assert third == {}
        assert first["fastsync/transfer/tensors"] + second["fastsync/transfer/tensors"] == len(model)
        for extra in ({"bucket_bytes": "auto"}, {"zero_copy": True}):  # sized per lane / views
            cluster.renew("shm", **extra)
            _assert_exactly_once(cluster.sync(model, 4)["receivers"], model, 4)


def _start_sync(
    cluster: Cluster, model: list[TensorSpec], seed: int, sends: list[dict[str, Any]], recv: dict[str, Any]
) -> None:
    cluster.build_process_group()
    for rank, extra in enumerate(sends):
        cluster.post(rank, "send", model, seed, extra)
    for i in range(cluster.n_actor, cluster.n_actor + cluster.n_rollout):
        cluster.post(i, "receive", recv)


@pytest.mark.verl
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_one_senders_failure_aborts_every_lane_with_its_reason(transport: str) -> None:
    """Trainer rank 1's producer raises after 3 tensors while rank 0 is mid-lane (the consumers are
    slow): every rollout rank fails naming sender trainer rank 1 and the producer's error, trainer
    rank 0 fails with the same reason (its lane was closed with it) well within ``timeout_s``; the
    next sync delivers every byte."""
    model = [TensorSpec(f"layer{i}.w", (900,), "float32") for i in range(40)]  # ~one tensor per bucket
    with _cluster(transport) as cluster:
        start = time.time()
        _start_sync(cluster, model, 4, [{}, {"raise_after": 3}], {"stall_s": {1: 1.0}})
        results = [cluster.wait_result(i) for i in range(4)]
        seconds = time.time() - start
        cluster.call_all("finalize")
        (s0, e0), (s1, e1), *rollouts = results
        assert s1 == "err" and "producer failed on purpose after 3 tensors" in e1, e1
        for status, error in rollouts:
            assert status == "err", error
            assert "trainer rank 1 (lane 1)" in error, error
            assert "producer failed on purpose" in error, error
        assert s0 == "err", f"trainer rank 0 finished a sync that failed: {e0}"
        assert "producer failed on purpose" in e0 and "trainer rank 1 (lane 1)" in e0, e0
        assert seconds < TIMEOUT_S, f"the failure took {seconds:.1f}s to reach every rank"
        result = cluster.sync(model, 5)
        _assert_exactly_once(result["receivers"], model, 5)


SKIP_ONE = """
from verl_fastsync.transports import lanes_plan
original = lanes_plan.LanePlan.assign
lanes_plan.original_assign = original  # for RESTORE
state = {{"done": False}}
def assign(self, name, nbytes, *args):
    lane = original(self, name, nbytes, *args)
    if lane == {lane} and not state["done"]:
        state["done"] = True
        return {answer}
    return lane
lanes_plan.LanePlan.assign = assign
result = None
"""
RESTORE = """
from verl_fastsync.transports import lanes_plan
lanes_plan.LanePlan.assign = lanes_plan.original_assign
result = None
"""


@pytest.mark.verl
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("lane", "answer", "expected"),
    [
        # trainer rank 1 plans a tensor for itself but never sends it
        (1, -1, r"trainer rank 1 \(lane 1\) delivered \d+ of the \d+ tensors .* 1 missing"),
        # trainer rank 1 also sends a tensor planned for rank 0
        (
            0,
            1,
            r"arrived twice, from trainer rank [01] \(lane [01]\) and from trainer rank",
        ),
    ],
    ids=["missing", "duplicate"],
)
def test_a_sender_that_breaks_the_plan_fails_the_sync_naming_it(
    lane: int, answer: int, expected: str
) -> None:
    """A sender whose share differs from the plan (a bug, or trainer ranks producing different
    weights) never makes a rollout rank hand out a tensor twice or end short: the sync fails on every
    rollout rank naming the sender, and the next (correct) sync is whole."""
    model = [TensorSpec(f"layer{i}.w", (200 + i,), "float32") for i in range(12)]
    with _cluster("shm") as cluster:
        cluster.post(1, "exec", SKIP_ONE.format(lane=lane, answer=answer))
        cluster.wait(1)
        _start_sync(cluster, model, 6, [{}, {}], {})
        results = [cluster.wait_result(i) for i in range(4)]
        cluster.call_all("finalize")
        for status, error in results[2:]:
            assert status == "err", error
            assert re.search(expected, error), error
        cluster.post(1, "exec", RESTORE)
        cluster.wait(1)
        result = cluster.sync(model, 7)
        _assert_exactly_once(result["receivers"], model, 7)


@pytest.mark.verl
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_sender_that_never_arrives_is_named_within_timeout(transport: str) -> None:
    """Trainer rank 1 prepares but never joins its lane: each rollout rank fails within ``timeout_s``
    (+ slack) naming sender trainer rank 1, and tells trainer rank 0's lane why."""
    timeout = 15
    with _cluster(transport, timeout_s=timeout) as cluster:
        metadata = cluster.call_all("prepare")
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        from verl_fastsync.verl.engine import register_engine

        register_engine()
        actor, rollout = CheckpointEngineRegistry.get("fastsync").build_topology(2, 2, metadata)
        assert actor["lane_senders"][0] == [0, 1]
        start = time.time()
        cluster.post(0, "init", {k: v[0] for k, v in actor.items()})
        for i in range(2):
            cluster.post(2 + i, "init", {k: v[i] for k, v in rollout.items()})
        for i in (2, 3):
            status, error = cluster.wait_result(i, timeout=6 * timeout)
            assert status == "err", error
            assert "trainer rank 1 (lane 1)" in error, error
        assert time.time() - start < 4 * timeout
        cluster.wait_result(0, timeout=6 * timeout)
        cluster.call_all("finalize")
