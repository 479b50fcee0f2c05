"""Several senders and a fleet of rollout ranks (``senders=all``): trainer ranks that disagree about
what they send, a consumer failing, a lane that cannot be joined, and ``bucket_bytes=auto`` per lane.

The receiver's checks run in-process on the real plan and tally; the engine end to end with spawned
processes (see ``_transport_harness``), each rollout rank running verl's own
``CheckpointEngineWorker.update_weights`` (``_verl_receive``) into a server adapter stand-in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import pytest
import torch
from _transport_harness import Cluster, TensorSpec  # type: ignore[import-not-found]

from verl_fastsync.transports.base import TransportError
from verl_fastsync.transports.lanes import LanesTransport, lanes_topology
from verl_fastsync.transports.lanes_plan import LanePlan, LaneTally, describe, read_descriptions

TIMEOUT_S = 60
PROMPT_S = 20  # "at once" on a loaded 2-core host: far below TIMEOUT_S
MODEL = [TensorSpec(f"layer{i}.w", (300 + 8 * i,), "float32") for i in range(16)]
MIB = 1 << 20


# ------------------------------------------------------------------------------ in-process


def _walk(plan: LanePlan, lane: int, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
    """What a sender puts on ``lane``: a description record before each of its own tensors."""
    items: list[tuple[str, Any]] = []
    for name, tensor in weights:
        if (
            plan.assign(name, tensor.numel() * tensor.element_size(), str(tensor.dtype)[6:], tensor.shape)
            == lane
        ):
            record = plan.descriptions()
            assert record is not None
            items += [record, (name, tensor)]
    return items


def _weights(dtype_of_2: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.zeros(8, dtype=dtype_of_2 if i == 2 else torch.float32)) for i in range(6)]


def test_a_tensor_the_senders_describe_differently_is_never_handed_out() -> None:
    """Trainer rank 1 yields w2 as int32 where rank 0 yields float32 (same bytes): the lanes' plans
    agree on names and sizes, the descriptions do not. w2 travels on lane 0 and arrives before lane 1
    described it: it is held, and when lane 1's record arrives the sync fails naming position 2, the
    dtype and both trainer ranks; w2 was never handed out."""
    lane0 = _walk(LanePlan(2), 0, _weights())
    lane1 = _walk(LanePlan(2), 1, _weights(torch.int32))
    tally = LaneTally([0, 1], "rollout rank 3")
    handed: list[str] = []
    # lane 0 delivers all it has (w0, w2, w4 with their records) before lane 1 says anything
    for name, tensor in lane0:
        if name.startswith("[fastsync"):
            tally.describe(0, read_descriptions(tensor, "lane 0"))
            handed += [n for n, _ in tally.release()]
        else:
            handed += [n for n, _ in tally.hand_out(tally.take(0, name, tensor), name, tensor)]
    assert handed == [], "a tensor went out before every sender had described it"
    name, record = lane1[0]  # lane 1's first record: w0, w1
    tally.describe(1, read_descriptions(record, "lane 1"))
    assert [n for n, _ in tally.release()] == ["w0"]
    with pytest.raises(TransportError) as info:
        tally.describe(1, read_descriptions(lane1[2][1], "lane 1"))  # w2, w3
    text = str(info.value)
    assert "position 2" in text and "in its dtype" in text, text
    assert "trainer rank 0 (lane 0) has 'w2' float32 [8]" in text, text
    assert "trainer rank 1 (lane 1) has 'w2' int32 [8]" in text, text
    assert "that tensor was not handed to the rollout" in text, text
    assert "w2" not in handed


@pytest.mark.parametrize(
    ("change", "field"),
    [("shape", "shape"), ("size", "shape"), ("order", "name"), ("name", "name")],
)
def test_every_kind_of_disagreement_names_its_first_difference(change: str, field: str) -> None:
    theirs = _weights()
    if change == "shape":
        theirs[3] = ("w3", torch.zeros(2, 4))
    elif change == "size":
        theirs[3] = ("w3", torch.zeros(9))
    elif change == "order":
        theirs[3], theirs[4] = theirs[4], theirs[3]
    else:
        theirs[3] = ("w3-renamed", theirs[3][1])
    plans = [LanePlan(2), LanePlan(2)]
    rows = []
    for plan, weights in zip(plans, (_weights(), theirs), strict=True):
        for name, tensor in weights:
            plan.assign(name, tensor.numel() * 4, "float32", tensor.shape)
        record = plan.descriptions()
        assert record is not None
        rows.append(read_descriptions(record[1], "x"))
    tally = LaneTally([0, 5], "rollout rank 0")
    tally.describe(0, rows[0])
    with pytest.raises(
        TransportError, match=rf"at position 3 of the weights \(the first difference, in its {field}\)"
    ):
        tally.describe(1, rows[1])
    assert plans[0].manifest(0, 0).digest != plans[1].manifest(0, 0).digest


def test_a_lent_view_is_held_as_its_own_copy() -> None:
    tally = LaneTally([0, 1], "rollout rank 0")
    tally.describe(0, [(0, describe("a", torch.zeros(4)))])
    bucket = torch.arange(16, dtype=torch.float32)
    view = bucket[4:8]
    assert tally.hand_out(tally.take(0, "a", view), "a", view) == []
    bucket.zero_()  # the lane refills its bucket
    tally.describe(1, [(0, describe("a", torch.zeros(4)))])
    ((name, held),) = tally.release()
    assert name == "a" and held.tolist() == [4.0, 5.0, 6.0, 7.0]


def test_each_lane_names_its_sender_and_verls_rollout_ranks() -> None:
    from verl_fastsync.plugins import plugin_manager, select_transport

    factory = select_transport(plugin_manager(), "shm", "engine")
    meta = [{"sender": {"host": "h", "endpoint": f"tcp://x:{i}"}} for i in range(3)]
    meta += [{"fresh": {"host": "h"}, "lanes": []} for _ in range(4)]
    actor, rollout = lanes_topology(factory, None, 3, 4, meta)  # type: ignore[arg-type]
    assert actor["lane_kwargs"][2]["rank_labels"] == [
        "trainer rank 2 (lane 2)",
        "rollout rank 0",
        "rollout rank 1",
        "rollout rank 2",
        "rollout rank 3",
    ]
    assert [kw["rank_labels"][0] for kw in rollout["lane_kwargs"][3]] == [
        "trainer rank 0 (lane 0)",
        "trainer rank 1 (lane 1)",
        "trainer rank 2 (lane 2)",
    ]


def test_auto_sizes_each_lane_from_its_share() -> None:
    from verl_fastsync.verl.engine import resolve_auto_bucket_size

    plenty = [("trainer rank 0", 1 << 40), ("rollout rank 0", 1 << 40)]
    model = 16 << 30
    assert resolve_auto_bucket_size(plenty, model) == 512 * MIB  # one sender
    # 8 lanes: 64 MiB each, 8 x 64 MiB = what one sender's bucket takes
    assert resolve_auto_bucket_size(plenty, model, lanes=8) == 64 * MIB
    assert resolve_auto_bucket_size(plenty, 160 * MIB, lanes=4) == 16 * MIB  # never below the floor
    assert resolve_auto_bucket_size(plenty, None, lanes=2) == 32 * MIB  # before the first sync: 64 / 2
    # a rollout rank's free memory is shared by the buckets of its lanes
    budgets = [("trainer rank 0", 1 << 40, 1), ("rollout rank 2", 8 << 30, 8)]
    assert resolve_auto_bucket_size(budgets, model, lanes=8) == 51 * MIB  # 5% of 8 GiB / 8
    # every sender counts, not only trainer rank 0
    tight = [("trainer rank 0", 1 << 40, 1), ("trainer rank 3", 200 * MIB, 1), ("rollout rank 0", 1 << 40, 4)]
    with pytest.raises(ValueError, match="trainer rank 3 has only 200 MiB free"):
        resolve_auto_bucket_size(tight, model, lanes=4)
    with pytest.raises(ValueError, match="rollout rank 1 has only 1000 MiB free for the buckets of 4 lanes"):
        resolve_auto_bucket_size([("rollout rank 1", 1000 * MIB, 4)], model, lanes=4)


def test_topology_checks_every_senders_free_memory() -> None:
    pytest.importorskip("verl")
    from verl_fastsync.verl.engine import FastsyncCheckpointEngine

    def meta(free: int, trainer: bool, master: bool = False) -> dict[str, Any]:
        transport = (
            {"sender": {"host": "h", "endpoint": "tcp://h:1"}}
            if trainer
            else {"fresh": {"host": "h"}, "lanes": []}
        )
        return {
            "engine": "fastsync",
            "transport": "shm",
            "is_master": master,
            "senders": "all",
            "bucket_size": None,
            "free_bytes": free,
            "model_bytes": 16 << 30,
            "delta": None,
            "transport_meta": transport,
        }

    big = 1 << 40
    metadata = [meta(big, True, True), meta(big, True), meta(big, False), meta(big, False)]
    actor, rollout = FastsyncCheckpointEngine.build_topology(2, 2, metadata)
    assert actor["bucket_size"] == [256 * MIB] * 2 and rollout["bucket_size"] == [256 * MIB] * 2
    metadata[1]["free_bytes"] = 100 * MIB
    with pytest.raises(ValueError, match="trainer rank 1 has only 100 MiB free"):
        FastsyncCheckpointEngine.build_topology(2, 2, metadata)


def test_a_device_transports_memory_counts_from_the_first_sync() -> None:
    """A rollout rank holding no lane yet asks a fresh lane transport where its buffers live (nccl:
    the accelerator), not the host."""
    made: list[Any] = []

    class DeviceLane:
        def __init__(self, options: Any) -> None:
            made.append(self)
            self.finalized = False

        def buffer_device(self) -> str:
            return "cuda:3"

        def finalize(self) -> None:
            self.finalized = True

    from verl_fastsync.transports.base import TransportOptions

    lanes = LanesTransport(DeviceLane, TransportOptions(), trainer=False)  # type: ignore[arg-type]
    assert lanes.buffer_device() == "cuda:3"
    assert made and all(lane.finalized for lane in made)


# ------------------------------------------------------------------------------ the engine, end to end

RECEIVE = """
from _verl_receive import verl_update_weights
result = verl_update_weights(worker, **{kw})
result["names"] = [d[0] for d in getattr(worker.adapter, "digests", []) if d]
"""
DISAGREE = """
import torch
import _transport_harness as harness
original = harness.iter_model
def iter_model(specs, seed=0, step=0):
    items = list(original(specs, seed, step))
    change = {change!r}
    at = {at}
    name, tensor = items[at]
    if change == "dtype":
        items[at] = (name, tensor.view(torch.int32))
    elif change == "shape":
        items[at] = (name, tensor.reshape(2, -1))
    elif change == "size":
        items[at] = (name, torch.cat([tensor, tensor[:1]]))
    else:
        items[at], items[at + 1] = items[at + 1], items[at]
    yield from items
harness.iter_model = iter_model
result = None
"""

RESTORE = """
import _transport_harness as harness
harness.iter_model = harness.iter_model.__globals__["original"]
result = None
"""


def _cluster(transport: str, n_actor: int, n_rollout: int, **ctor: Any) -> Cluster:
    # each lane a group of every rollout rank (hosts=off); lanes over the hosts: test_hosts.py
    base = {"bucket_size": 4096, "timeout_s": TIMEOUT_S, "senders": "all", "hosts": "off"}
    return Cluster(transport, n_actor, n_rollout, mode="engine", ctor=base | ctor, timeout=4 * TIMEOUT_S)


class Shared(Protocol):
    def __call__(self, transport: str, n_actor: int, n_rollout: int) -> AbstractContextManager[Cluster]: ...


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    """``with shared(transport, n_actor, n_rollout) as cluster``: the cluster the previous test of this
    module used when it asked for the same, else a new one (the previous one closed first: one lives at
    a time). Starting 6-7 engine ranks, each importing torch and verl, is most of such a test's time;
    the tests that share are ordered one after another. Each test leaves its cluster as it found it
    (a clean sync at its end, its patches undone); one that fails closes it."""
    live: dict[tuple[str, int, int], Cluster] = {}

    def close() -> None:
        for cluster in live.values():
            cluster.__exit__(None, None, None)
        live.clear()

    @contextmanager
    def get(transport: str, n_actor: int, n_rollout: int) -> Iterator[Cluster]:
        key = (transport, n_actor, n_rollout)
        if key not in live:
            close()
            live[key] = _cluster(transport, n_actor, n_rollout).__enter__()
        try:
            yield live[key]
        except BaseException:
            close()
            raise

    yield get
    close()


@pytest.fixture(scope="module", params=["shm", "gloo", "nixl"])
def fleet_transport(request: pytest.FixtureRequest) -> str:
    """The transport of the 3 x 4 tests: module-scoped, so pytest runs them transport by transport and
    they share each transport's cluster."""
    return str(request.param)


def _verl_sync(
    cluster: Cluster, seed: int, adapter: dict[int, Any] | None = None
) -> tuple[list[tuple[str, Any]], list[Any], float]:
    """One sync, every rollout rank through verl's worker method: (trainer results, rollout results,
    seconds until every rank ended)."""
    cluster.build_process_group()
    for i in range(cluster.n_actor + cluster.n_rollout):  # a rank still busy after PROMPT_S: its stacks
        cluster.post(i, "exec", ARM.format(seconds=PROMPT_S))
        cluster.wait(i)
    start = time.time()
    for i in range(cluster.n_actor):
        cluster.post(i, "send", MODEL, seed, {})
    for i in range(cluster.n_actor, cluster.n_actor + cluster.n_rollout):
        cluster.post(i, "exec", RECEIVE.format(kw=repr((adapter or {}).get(i - cluster.n_actor, {}))))
    rollouts = [cluster.wait(i) for i in range(cluster.n_actor, cluster.n_actor + cluster.n_rollout)]
    trainers = [cluster.wait_result(i, timeout=3 * TIMEOUT_S) for i in range(cluster.n_actor)]
    seconds = time.time() - start
    for i in range(cluster.n_actor + cluster.n_rollout):
        cluster.post(i, "exec", DISARM)
        cluster.wait(i)
    cluster.call_all("finalize")
    return trainers, rollouts, seconds


# every thread's stack on stderr (shown with a failing test's output) if the sync still runs then
ARM = "import faulthandler\nfaulthandler.dump_traceback_later({seconds})\nresult = None\n"
DISARM = "import faulthandler\nfaulthandler.cancel_dump_traceback_later()\nresult = None\n"


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("transport", "change", "field"),
    [  # one after another on each transport: they share its cluster
        ("shm", "dtype", "dtype"),
        ("shm", "shape", "shape"),
        ("shm", "size", "shape"),
        ("shm", "order", "name"),
        ("gloo", "dtype", "dtype"),
        ("nixl", "dtype", "dtype"),
    ],
)
def test_trainer_ranks_that_disagree_fail_before_the_disputed_tensor(
    transport: str, change: str, field: str, shared: Shared
) -> None:
    """2 senders x 4 rollout ranks through verl's ``update_weights``: trainer rank 1 yields tensor 5
    differently (a dtype or a shape for the same bytes, another size, two tensors swapped). Every
    rollout rank fails naming position 5, the field and both trainer ranks, and never loads tensor 5;
    every trainer rank still sending fails with that cause, promptly; the next, agreeing sync is
    whole."""
    with shared(transport, 2, 4) as cluster:
        cluster.post(1, "exec", DISAGREE.format(change=change, at=5))
        cluster.wait(1)
        trainers, rollouts, seconds = _verl_sync(cluster, 1)
        for result in rollouts:
            assert result["status"] == "err", result
            error = result["error"]
            assert f"at position 5 of the weights (the first difference, in its {field})" in error, error
            assert "trainer rank 0 (lane 0)" in error and "trainer rank 1 (lane 1)" in error, error
            assert MODEL[5].name not in result["names"], result["names"]
        # a sender whose share was all delivered before the rollout ranks compared may return (the
        # documented decision, lanes.py: the rollout ranks fail, so verl's manager fails the step)
        failed = [error for status, error in trainers if status == "err"]
        assert failed, trainers
        for error in failed:
            assert "disagree about what they send" in error, error
        assert seconds < PROMPT_S, f"the disagreement took {seconds:.1f}s to end every rank"
        cluster.post(1, "exec", RESTORE)
        cluster.wait(1)
        result = cluster.sync(MODEL, 3)
        assert all(len(r["digests"]) == len(MODEL) for r in result["receivers"])


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_a_consumer_failure_reaches_every_sender_with_its_cause(fleet_transport: str, shared: Shared) -> None:
    """3 senders x 4 rollout ranks: rollout rank 2's adapter raises at its 5th tensor. Every sender
    whose lane was still running fails with that cause (not "the consumer's task was cancelled"),
    promptly; a sender whose lane had already delivered all its bytes may return (documented: the
    sync fails on every rollout rank, so verl's manager fails the step), but never all of them."""
    with shared(fleet_transport, 3, 4) as cluster:
        trainers, rollouts, seconds = _verl_sync(cluster, 2, {2: {"fail_at": 4}})
        assert rollouts[2]["status"] == "err" and "load_weights failed on purpose" in rollouts[2]["error"]
        failed = [error for status, error in trainers if status == "err"]
        assert failed, f"every sender reported success for a sync a rollout rank failed: {trainers}"
        for error in failed:
            assert "load_weights failed on purpose" in error, error
            assert "task was cancelled" not in error, error
        assert seconds < PROMPT_S, f"the failure took {seconds:.1f}s to end every rank"


CANNOT_JOIN = """
cls = worker.engine.factory.load()
original = cls.init_process_group
def init_process_group(self, **kwargs):
    if str((kwargs.get("rank_labels") or [""])[0]).endswith("(lane 0)"):
        raise OSError("cannot map the lane's buckets on purpose")
    return original(self, **kwargs)
cls.init_process_group = init_process_group
result = None
"""
CAN_JOIN = """
cls = worker.engine.factory.load()
cls.init_process_group = cls.init_process_group.__globals__["original"]
result = None
"""


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_a_rollout_rank_that_cannot_join_a_lane_does_not_keep_the_other_lanes_waiting(
    fleet_transport: str, shared: Shared
) -> None:
    """3 senders x 4 rollout ranks; rollout rank 2 cannot join lane 0 (fails before its lane
    transport ran any code). It fails at once naming itself, the lane and the cause; the senders of
    lanes 1 and 2 are not left waiting for its hello (it joins every lane at once; before, a rank that
    failed lane 0 never said hello on the later lanes and their senders waited out ``timeout_s``);
    and lane 0's side (its sender, the rollout ranks waiting in its handshake) hears the cause from
    the lane's handshake (``abort_join``) at once, instead of waiting out ``timeout_s``."""
    timeout = TIMEOUT_S
    with shared(fleet_transport, 3, 4) as cluster:
        cluster.post(5, "exec", CANNOT_JOIN)
        cluster.wait(5)
        metadata = cluster.call_all("prepare")
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        from verl_fastsync.verl.engine import register_engine

        register_engine()
        actor, rollout = CheckpointEngineRegistry.get("fastsync").build_topology(3, 4, metadata)
        start = time.time()
        for i in range(3):
            cluster.post(i, "init", {k: v[i] for k, v in actor.items()})
        for j in range(4):
            cluster.post(3 + j, "init", {k: v[j] for k, v in rollout.items()})
        status, error = cluster.wait_result(5, timeout=4 * timeout)
        assert status == "err", error
        assert "rollout rank 2 could not join trainer rank 0 (lane 0)" in error, error
        assert "cannot map the lane's buckets on purpose" in error, error
        for sender in (1, 2):  # joined; they end at once too when another rank relays the failure
            status, error = cluster.wait_result(sender, timeout=4 * timeout)
            if status == "err":
                assert "rollout rank 2 could not join trainer rank 0 (lane 0)" in error, error
                assert "cannot map the lane's buckets on purpose" in error, error
        assert time.time() - start < PROMPT_S, "a later lane's sender waited for the failed rank's hello"
        for i in (0, 3, 4, 6):  # lane 0's side: its sender and the rollout ranks in its handshake
            status, error = cluster.wait_result(i, timeout=4 * timeout)
            assert status == "err", error
            assert "rollout rank 2" in error and "cannot map the lane's buckets on purpose" in error, error
        seconds = time.time() - start
        assert seconds < PROMPT_S, f"lane 0 took {seconds:.1f}s (timeout_s={timeout}) to hear the cause"
        cluster.call_all("finalize")
        cluster.post(5, "exec", CAN_JOIN)
        cluster.wait(5)
