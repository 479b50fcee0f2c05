"""One copy per host (``engine_kwargs.fastsync.hosts=auto``, :mod:`verl_fastsync.transports.hosts`).

The hosts are simulated on this machine: each rollout process is told its shared-memory identity
(what :func:`~verl_fastsync.io.hostid.host_identity` would read from its host's ``/dev/shm``), so the
chain between hosts runs over real gloo / NIXL groups and the fan-out within a host over real shared
memory. The bench (``verl-fastsync bench --sections fanout``) measures the same code across network
namespaces with a private ``/dev/shm`` per host and counts the bytes on every link.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
from _transport_harness import Cluster, TensorSpec, expected_digests  # type: ignore[import-not-found]
from test_fleet_failures import DIE, RECEIVE, SEND  # type: ignore[import-not-found]

from verl_fastsync.io.hostid import host_identity
from verl_fastsync.transports.hosts import CHAIN_BUCKET_FLOOR, chain_bucket
from verl_fastsync.transports.hosts_topology import chain_of_hosts

TIMEOUT_S = 60
PROMPT_S = 15  # "at once" on a loaded 2-core host: far below TIMEOUT_S
MODEL = [TensorSpec(f"layer{i}.w", (900,), "float32") for i in range(12)]  # one tensor per 4 KiB bucket
MODEL_BYTES = 12 * 900 * 4
# failures: more buckets than the chain holds in flight, so the trainer is still sending when they happen
LONG = [TensorSpec(f"layer{i}.w", (900,), "float32") for i in range(48)]

IDENTITY = """
import verl_fastsync.transports.hosts as hosts
hosts.host_identity = lambda directory=None: ({key!r}, "" if {key!r} else "no /dev/shm here")
result = None
"""

ROLE = """
t = worker.engine.transport
plans = [t.plan] if hasattr(t, "plan") else [lane.plan for lane in t.lanes]
up = [getattr(lane.up, "last_stats", None) for lane in ([t] if hasattr(t, "plan") else t.lanes)]
result = ([sorted(k for k in ("direct", "up", "down", "fanout", "local") if k in p) for p in plans],
          [None if s is None else s.bytes for s in up])
"""


def _cluster(transport: str, hosts: list[str | None], n_actor: int = 1, **ctor: Any) -> Cluster:
    base = {"bucket_size": 4096, "timeout_s": TIMEOUT_S} | ctor
    cluster = Cluster(transport, n_actor, len(hosts), mode="engine", ctor=base, timeout=4 * TIMEOUT_S)
    for rank, key in enumerate(hosts):
        cluster.post(n_actor + rank, "exec", IDENTITY.format(key=key))
        cluster.wait(n_actor + rank)
    return cluster


def _roles(cluster: Cluster) -> list[Any]:
    out = []
    for rank in range(cluster.n_rollout):
        cluster.post(cluster.n_actor + rank, "exec", ROLE)
        out.append(cluster.wait(cluster.n_actor + rank))
    return out


def _check(result: dict[str, Any], seed: int, step: int = 0) -> None:
    want = sorted(expected_digests(MODEL, seed, step))
    for rank, receiver in enumerate(result["receivers"]):
        assert sorted(tuple(d) for d in receiver["digests"]) == want, (rank, seed, step)


def test_ranks_sharing_memory_form_a_host_and_lanes_rotate_leaders() -> None:
    keys: list[str | None] = ["a", "a", "b", "b", None, "c"]
    assert chain_of_hosts(keys, 0) == [[0, 1], [2, 3], [4], [5]]
    # lane 1 enters the fleet at the second host, led by each host's second rank (another rail)
    assert chain_of_hosts(keys, 1) == [[3, 2], [4], [5], [1, 0]]
    assert chain_of_hosts(["x"] * 4, 2) == [[2, 3, 0, 1]]
    assert chain_of_hosts([None, None], 0) == [[0], [1]]  # no identity: a host alone


def test_the_hops_bucket_is_a_share_of_the_bucket_by_the_chains_length() -> None:
    assert chain_bucket(64 << 20, 1) == 64 << 20  # one host: no hop relays
    assert chain_bucket(64 << 20, 4) == 16 << 20
    assert chain_bucket((64 << 20) + 1, 4) == (16 << 20) + 1  # rounded up: never more hops' buckets
    assert chain_bucket(8 << 20, 8) == CHAIN_BUCKET_FLOOR == 2 << 20
    assert chain_bucket(1 << 20, 8) == 1 << 20  # never above the bucket


def test_host_identity_is_shared_exactly_by_processes_that_share_the_directory(tmp_path: Any) -> None:
    one, two = tmp_path / "host1", tmp_path / "host2"
    one.mkdir()
    two.mkdir()
    first, why = host_identity(str(one))
    assert first is not None and why == ""
    code = (
        "import sys; from verl_fastsync.io.hostid import host_identity; print(host_identity(sys.argv[1])[0])"
    )
    other = subprocess.run([sys.executable, "-c", code, str(one)], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == first  # another process, the same directory: the same host
    assert host_identity(str(two))[0] not in (None, first)  # another /dev/shm: another host
    assert os.listdir(one) == [f"verl_fastsync_host_id.{os.getuid()}"]  # no private file left behind
    missing, why = host_identity(str(tmp_path / "absent"))
    assert missing is None and "cannot create" in why and "absent" in why


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_each_host_receives_once_and_its_ranks_read_shared_memory(transport: str) -> None:
    """2 hosts x 2 rollout ranks + a rank with no shared memory (a host alone): every rank gets every
    byte on every sync; only one rank per host receives across the network (the model's bytes, once),
    the first host's leader relays onward, the others read their host's shared memory."""
    with _cluster(transport, ["h1", "h1", "h2", "h2", None]) as cluster:
        for seed in range(3):
            _check(cluster.sync(MODEL, seed), seed)
        roles = _roles(cluster)
    assert [r[0] for r in roles] == [
        [["down", "fanout", "up"]],
        [["local"]],
        [["down", "fanout", "up"]],
        [["local"]],
        [["up"]],  # the chain's last host, alone
    ]
    assert [r[1] for r in roles] == [[MODEL_BYTES], [None], [MODEL_BYTES], [None], [MODEL_BYTES]]


LOG_ARRIVALS = """
import time
t = worker.engine.transport
t._make_sides()  # (made at the first prepare)
side = t.{side}
receive, arrivals = side.receive, []
t.arrivals = arrivals

async def logged():
    async for name, tensor in receive():
        arrivals.append((name, time.monotonic()))
        yield name, tensor

side.receive = logged
result = None
"""

SMALL_FLOOR = """
import verl_fastsync.transports.hosts as hosts
hosts.CHAIN_BUCKET_FLOOR = 1024
result = None
"""

# larger than the 4 KiB bucket: 32 of them, and 8 whose last is short (bf16, a non-contiguous view)
BIG = [
    *MODEL[:2],
    TensorSpec("experts.gate_up_proj", (32 * 1024,), "float32"),
    *MODEL[2:4],
    TensorSpec("lm_head", (150, 101), "bfloat16", noncontig=True),
]


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_a_tensor_larger_than_the_bucket_goes_on_before_its_last_piece_arrived(transport: str) -> None:
    """2 hosts (2 ranks, then 1), hop buckets of half the bucket: a tensor of 64 hop buckets reaches
    the second host's leader, and the first host's other rank through shared memory, before the
    first host's leader has received all of it (a hop costs one hop bucket, not one tensor: the
    pieces in flight are bounded by the buckets and the relay's feeds, far fewer than 64), and every
    rank, the one reading shared memory included, gets every tensor exact."""
    with _cluster(transport, ["h1", "h1", "h2"]) as cluster:
        for rank in range(4):  # hop buckets of half the 4 KiB bucket (2 hosts), below the real floor
            cluster.post(rank, "exec", SMALL_FLOOR)
            cluster.wait(rank)
        for rank, side in ((0, "up"), (1, "local"), (2, "up")):
            cluster.post(1 + rank, "exec", LOG_ARRIVALS.format(side=side))
            cluster.wait(1 + rank)
        result = cluster.sync(BIG, 7)
        want = sorted(expected_digests(BIG, 7, 0))
        for rank, receiver in enumerate(result["receivers"]):
            assert sorted(tuple(d) for d in receiver["digests"]) == want, rank
        arrivals = []
        for rank in (0, 1, 2):
            cluster.post(1 + rank, "exec", "result = worker.engine.transport.arrivals")
            arrivals.append(cluster.wait(1 + rank))
    big = [[(n, at) for n, at in log if n.endswith("] experts.gate_up_proj")] for log in arrivals]
    assert [len(pieces) for pieces in big] == [64, 64, 64], arrivals
    assert big[0][0][0] == "[fastsync: bytes 0-2048 of 131072, float32[32768]] experts.gate_up_proj"
    last_on_first_leader = big[0][-1][1]
    for other in (1, 2):  # the first host's shm reader, the second host's leader
        first = big[other][0][1]
        assert first < last_on_first_leader, (other, [at for _, at in big[0]], [at for _, at in big[other]])


KEPT_GROUPS = """
lanes = worker.engine.transport.lanes
result = [sorted(side for side in ("up", "relay") if getattr(getattr(lane, side), "group_epoch", None))
          for lane in lanes]
"""


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_each_lane_enters_at_another_host_and_rail(transport: str) -> None:
    """2 senders, 2 hosts x 2 ranks: the first sync of a new lane runs directly (the ranks hold
    no endpoints of it yet), from the second on lane 0 is led by each host's first rank and lane 1 by
    its second, entering at the other host; every byte arrives on every sync. A side of a rank that
    a sync does not use keeps no group: a gloo group kept for reuse holds a connection to each of its
    ranks, and a host's reader that received directly at the first sync kept that whole-fleet group
    until the process ended."""
    with _cluster(transport, ["h1", "h1", "h2", "h2"], n_actor=2, senders=2) as cluster:
        _check(cluster.sync(MODEL, 0), 0)
        assert all(r[0] == [["direct"], ["direct"]] for r in _roles(cluster))
        for seed in (1, 2):
            _check(cluster.sync(MODEL, seed), seed)
        roles = [r[0] for r in _roles(cluster)]
        kept = []
        for rank in range(4):
            cluster.post(2 + rank, "exec", KEPT_GROUPS)
            kept.append(cluster.wait(2 + rank))
    if transport == "gloo":
        assert kept == [
            [["relay", "up"], []],  # lane 0's leader on the first host, lane 1's reader there
            [[], ["up"]],
            [["up"], []],
            [[], ["relay", "up"]],
        ], kept
    assert roles == [
        [["down", "fanout", "up"], ["local"]],
        [["local"], ["fanout", "up"]],  # lane 1's chain ends at the first host
        [["fanout", "up"], ["local"]],
        [["local"], ["down", "fanout", "up"]],  # lane 1 enters here
    ]


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_delta_keeps_one_base_per_host_on_its_leader() -> None:
    """delta=true over 2 hosts x 2 ranks (nixl): exact on every sync, the syncs after the first diff;
    the leaders hold the base (the model's bytes), the other ranks none."""
    with _cluster("nixl", ["h1", "h1", "h2", "h2"], delta=True) as cluster:
        for step in range(3):
            result = cluster.sync(MODEL, 0, {"step": step})
            _check(result, 0, step)
            [sent] = [s["metrics"] for s in result["senders"] if s["metrics"]]
            assert sent["fastsync/transfer/delta_sync"] == float(step > 0), sent
        read = "side = worker.engine.delta_decoder\nresult = side.base_bytes"
        bases = []
        for rank in range(4):
            cluster.post(1 + rank, "exec", read)
            bases.append(cluster.wait(1 + rank))
    assert bases[0] == bases[2] >= MODEL_BYTES
    assert bases[1] == bases[3] == 0


def _run(
    cluster: Cluster,
    seed: int,
    adapters: dict[int, Any] | None = None,
    die: int | None = None,
    send_extra: dict[int, dict[str, Any]] | None = None,
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """One sync, every rollout rank through verl's ``update_weights``: (each trainer rank's result,
    each rollout rank's); ``send_extra`` and ``adapters`` by trainer and rollout rank."""
    cluster.build_process_group()
    for trainer in range(cluster.n_actor):
        extra = (send_extra or {}).get(trainer, {})
        cluster.post(trainer, "exec", SEND.format(model=LONG, seed=seed, extra=extra))
    for rank in range(cluster.n_rollout):
        code = DIE if rank == die else RECEIVE.format(kw=repr((adapters or {}).get(rank, {})))
        cluster.post(cluster.n_actor + rank, "exec", code)
    rollouts = {
        rank: cluster.wait(cluster.n_actor + rank) for rank in range(cluster.n_rollout) if rank != die
    }
    return {trainer: cluster.wait(trainer) for trainer in range(cluster.n_actor)}, rollouts


def _all_failed(results: dict[Any, dict[str, Any]], start: float, named: str, cause: str) -> None:
    for who, result in results.items():
        assert result["status"] == "err", (who, result)
        assert named in result["error"] and cause in result["error"], (who, result["error"])
        assert "timed out" not in result["error"], (who, result["error"])
        assert result["ended"] - start < PROMPT_S, (who, result["ended"] - start)


def _a_producer_fails(cluster: Cluster, seed: int, trainer: int) -> None:
    """Trainer rank ``trainer``'s producer raises after 3 tensors: it fails with that, and every
    rollout rank ends within moments naming it and the cause."""
    start = time.time()
    trainers, rollouts = _run(cluster, seed, send_extra={trainer: {"raise_after": 3}})
    cluster.call_all("finalize")
    assert "producer failed on purpose after 3 tensors" in trainers[trainer]["error"], trainers
    cause = "RuntimeError: producer failed on purpose after 3 tensors"
    _all_failed(dict(rollouts), start, f"trainer rank {trainer}", cause)


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_a_failure_anywhere_ends_every_rank_with_its_cause(transport: str) -> None:
    """2 hosts x 2 ranks, each rollout rank through verl's ``update_weights``. verl's server adapter of
    rollout rank 3 (reading the second host's shared memory) raises at its 2nd tensor: every rank's
    sync ends within moments naming rollout rank 3 and its error (the trainer through two hops, the
    first host's ranks through the relay). Then the trainer's producer raises: every rollout rank
    ends with it. The next sync is exact."""
    with _cluster(transport, ["h1", "h1", "h2", "h2"]) as cluster:
        _check(cluster.sync(MODEL, 0), 0)
        start = time.time()
        trainers, rollouts = _run(cluster, 1, adapters={3: {"fail_at": 2}})
        cluster.call_all("finalize")
        assert rollouts[3]["error"].startswith("LoadError: load_weights failed"), rollouts[3]
        del rollouts[3]
        _all_failed(
            {"trainer": trainers[0], **rollouts}, start, "rollout rank 3", "the consumer failed: LoadError"
        )
        _a_producer_fails(cluster, 2, trainer=0)
        _check(cluster.sync(MODEL, 3), 3)


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_a_relay_that_dies_mid_chain_is_named_on_every_rank(transport: str) -> None:
    """The first host's leader (rollout rank 0, the relay to the second host) is killed while loading
    its 5th tensor: the trainer, its own host's other rank and the second host's ranks all fail within
    moments, naming rollout rank 0."""
    with _cluster(transport, ["h1", "h1", "h2", "h2"]) as cluster:
        _check(cluster.sync(MODEL, 0), 0)
        cluster.call_all("finalize")
        start = time.time()
        trainers, rollouts = _run(cluster, 1, die=0)
        _all_failed({"trainer": trainers[0], **rollouts}, start, "rollout rank 0", "")


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_a_failure_in_one_lane_over_the_hosts_ends_every_lane_on_every_rank(transport: str) -> None:
    """2 senders over 2 hosts x 2 ranks, both lanes through the hosts (from the second sync on).
    Rollout rank 3's adapter raises at its 2nd tensor: every rollout rank ends within moments naming
    it, and so does every trainer rank that fails (at least one does; a sender whose lane had
    delivered its whole share may return, lanes.py: the sync failed on the rollout ranks, so verl's
    manager fails the step). Then trainer rank 1's producer raises: every rollout rank ends with
    that. The next sync is exact."""
    with _cluster(transport, ["h1", "h1", "h2", "h2"], n_actor=2, senders=2) as cluster:
        for seed in (0, 1):
            _check(cluster.sync(MODEL, seed), seed)
        assert all(["direct"] not in r[0] for r in _roles(cluster)), _roles(cluster)
        start = time.time()
        trainers, rollouts = _run(cluster, 2, adapters={3: {"fail_at": 2}})
        cluster.call_all("finalize")
        assert rollouts[3]["error"].startswith("LoadError: load_weights failed"), rollouts[3]
        del rollouts[3]
        cause = "the consumer failed: LoadError"
        _all_failed(dict(rollouts), start, "rollout rank 3", cause)
        failed = {f"trainer rank {i}": r for i, r in trainers.items() if r["status"] == "err"}
        assert failed, f"every sender reported success for a sync a rollout rank failed: {trainers}"
        _all_failed(failed, start, "rollout rank 3", cause)
        _a_producer_fails(cluster, 3, trainer=1)
        _check(cluster.sync(MODEL, 4), 4)


COUNT = """
import os
result = (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")))
"""


@pytest.mark.verl
@pytest.mark.fleet
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_a_rollout_rank_holds_as_many_threads_and_sockets_in_a_bigger_fleet(transport: str) -> None:
    """2 senders to 2 and then 3 hosts of 2 ranks: between syncs, rollout rank 0 (a leader
    relaying lane 0, a reader of lane 1) and rank 1 hold the same number of threads and (up to two)
    file descriptors in both fleets: what a rank holds grows with the lanes, not with lanes x ranks
    (a full-mesh group per lane, kept between syncs, grew with every rank)."""
    counts = []
    for hosts in (["h1", "h1", "h2", "h2"], ["h1", "h1", "h2", "h2", "h3", "h3"]):
        with _cluster(transport, hosts, n_actor=2, senders=2) as cluster:
            for seed in range(3):
                _check(cluster.sync(MODEL, seed), seed)
            seen = []
            for rank in (0, 1):
                cluster.post(2 + rank, "exec", COUNT)
                seen.append(cluster.wait(2 + rank))
            counts.append(seen)
    print("threads, fds of rollout ranks 0 and 1 at 4 and 6 rollout ranks:", counts)
    for (threads, fds), (more_threads, more_fds) in zip(counts[0], counts[1], strict=True):
        # a full mesh per lane adds a connection (and gloo's threads) per lane and rank: 2 x 2 here;
        # a socket still closing may be counted once
        assert more_threads == threads and more_fds <= fds + 2, counts


def test_ranks_of_one_host_under_different_hostnames_share_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with a NIC per GPU may name each rail's rank differently: the shared-memory identity,
    not the hostname, makes them one host, and their shm group is built (the shm transport alone
    would refuse ranks on different hostnames)."""
    from verl_fastsync.transports import hosts as hosts_module
    from verl_fastsync.transports.base import TransportOptions
    from verl_fastsync.transports.gloo import GlooTransport

    monkeypatch.setattr(hosts_module, "host_identity", lambda directory=None: ("one-host", ""))
    factory = hosts_module.HostsFactory(GlooTransport)
    ranks = [factory(TransportOptions(is_master=True))] + [factory(TransportOptions()) for _ in range(2)]
    try:
        metadata = [rank.prepare() for rank in ranks]
        for index, meta in enumerate(metadata[1:]):
            for side in ("fanout", "local"):
                meta["hosts"][side]["host"] = f"rail{index}"
        _actor, rollout = factory.build_topology(1, 2, metadata)
        assert "fanout" in rollout["hosts_plan"][0] and "local" in rollout["hosts_plan"][1]
    finally:
        for rank in ranks:
            rank.finalize()
