"""Engine transports in real processes, without verl (the transport layer must work without it):
round trips over bucket sizes and dtypes, memory bounds, verify, wire versions, dead peers, and a
third-party transport loaded through a real entry point.

Every ``Cluster`` checks on exit that no shared-memory segment its processes created or mapped is
left in /dev/shm (including after a peer was killed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _plugin_dist import write_plugin_dist
from _transport_harness import (  # type: ignore[import-not-found]
    EXACT_RSS_ENV,
    ROOT,
    Cluster,
    TensorSpec,
    WorkerError,
    expected_digests,
    synthetic_model,
)

from verl_fastsync.plugins import (
    UnknownPluginNameError,
    available_transports,
    plugin_manager,
    select_transport,
)
from verl_fastsync.transports.base import LazyTransportClass, TransportOptions, base_topology
from verl_fastsync.wire import WIRE_SCHEMA_VERSION

BASE = 4096
MODEL = synthetic_model(BASE)
CPU_TRANSPORTS = ["shm", "gloo", "nixl"]


def _check(result: dict[str, Any], specs: list[TensorSpec], seed: int = 0) -> None:
    expected = expected_digests(specs, seed)
    for receiver in result["receivers"]:
        assert [tuple(d) for d in receiver["digests"]] == expected


def test_builtin_engine_transports_registered() -> None:
    names = available_transports(plugin_manager(), "engine")
    assert {"shm", "gloo", "nixl"} <= set(names)
    factory = select_transport(plugin_manager(), "shm", "engine")
    assert isinstance(factory, LazyTransportClass)


def test_unknown_transport_lists_available() -> None:
    with pytest.raises(UnknownPluginNameError, match=r"unknown engine transport; available: .*gloo.*shm"):
        select_transport(plugin_manager(), "carrier-pigeon", "engine")


def test_options_and_topology_validation() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
        TransportOptions(timeout_s=0)
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        TransportOptions(timeout_s="soon")  # type: ignore[arg-type]
    actor, rollout = base_topology(2, 3, [{"bucket_size": 8}] * 5)
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2, 3]
    assert actor["world_size"] == [4, 4] and rollout["role"] == ["rollout"] * 3
    with pytest.raises(ValueError, match="5 metadata entries"):
        base_topology(1, 1, [{}] * 5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_round_trip_two_receivers(transport: str) -> None:
    """1 sender -> 2 receivers; buckets from 1 KiB (tensors up to 40x the bucket) to larger than the
    model; odd bucket sizes; a sync and an async weight generator; identical bytes/names/order."""
    with Cluster(transport, 1, 2, mode="transport", ctor={"bucket_size": BASE, "timeout_s": 60}) as cluster:
        for bucket, seed, extra in ((1024, 0, {}), (BASE + 7, 1, {"async_gen": True}), (1 << 20, 2, {})):
            cluster.set_bucket(bucket)
            result = cluster.sync(MODEL, seed=seed, send_extra=extra)
            _check(result, MODEL, seed)
            sent = result["senders"][0]["metrics"]
            assert sent["fastsync/transfer/tensors"] == len(MODEL)
            if bucket == 1 << 20:
                assert sent["fastsync/transfer/buckets"] == 1
            for receiver in result["receivers"]:
                assert receiver["metrics"]["fastsync/transfer/bytes"] == sent["fastsync/transfer/bytes"]


MIB = 1 << 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_peak_memory_bounds(transport: str) -> None:
    """The transports' own accounting and the kernel's RSS high-water mark (VmHWM reset right before
    the transfer; glibc's mmap threshold fixed in the children so freed tensors leave RSS).

    * Accounting: each side reports exactly its bucket buffers (``peak_extra_bytes`` documents the
      buffers a side allocated; a sender holds nothing else): its slots, plus the spares lending
      needs; no tensor here is split, so the receiver has nothing in progress and copies nothing.
    * Sender RSS: the model is produced lazily, after the baseline (the bucket buffers were allocated
      at ``init_process_group``, before it), so the sender's growth is the producer's one live tensor
      plus noise. A sender that kept the source tensors of a bucket (32 MiB here, 8 tensors of 4 MiB)
      would exceed that bound: 38-39 MiB measured against the 24 MiB allowed (the largest tensor + 12 MiB
      for the first sync's one-time state - event loop, lazy imports, zmq: 2-7 MiB measured, more on a
      loaded host - and allocator noise).
    * Receiver RSS: <= two buckets + the largest tensor + the noise allowance (its slots are mapped
      before the baseline; what grows is a spare bucket, or copies a receiver should not make).
    """
    bucket = 32 * MIB
    largest = 12 * MIB
    specs = [
        TensorSpec("embed", (largest // 4,), "float32"),
        *[TensorSpec(f"l{i}.w", (1024, 2048 + i), "bfloat16") for i in range(16)],  # ~4 MiB each
        TensorSpec("moe", (6, MIB), "int8"),
        TensorSpec("norm", (4096,), "float32"),
    ]
    slack = 12 * MIB  # see the docstring: a kept bucket of sources (32 MiB) still fails the bound
    ctor = {"bucket_size": bucket, "timeout_s": 60}
    with Cluster(transport, 1, 1, mode="transport", ctor=ctor, env=EXACT_RSS_ENV) as cluster:
        result = cluster.sync(specs, seed=5, send_extra={"producer": "lazy"})
        _check(result, specs, 5)
    sender, receiver = result["senders"][0], result["receivers"][0]
    # buckets each side reports: its slots (shm: three by default, the others two); the consumer here
    # drops each tensor before asking for the next, so nothing stays on loan and no spare is made,
    # except nixl's two registered spares
    sent_buckets, received_buckets = {"shm": (3, 3), "gloo": (2, 2), "nixl": (2, 4)}[transport]
    assert sender["metrics"]["fastsync/transfer/peak_extra_bytes_sender"] == sent_buckets * bucket
    received = receiver["metrics"]["fastsync/transfer/peak_extra_bytes_receiver"]
    assert received == received_buckets * bucket, received  # every tensor whole: none in progress
    assert receiver["metrics"]["fastsync/transfer/copied_bytes_receiver"] == 0
    assert sender["rss_delta"] <= largest + slack, (
        f"sender RSS grew by {sender['rss_delta'] / MIB:.1f} MiB during the sync; the producer's "
        f"largest live tensor is {largest / MIB:.0f} MiB: the sender holds produced tensors"
    )
    assert receiver["rss_delta"] <= 2 * bucket + largest + slack, receiver["rss_delta"] / MIB


CORRUPT = """
import torch
t = worker.engine
orig = t._receiver_buffer
def corrupt(slot):
    buf = orig(slot)
    if t.inflight.bucket == 2:
        buf[3] ^= 0xFF
    return buf
t._receiver_buffer = corrupt
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo", "nixl"])
def test_verify_detects_corruption_and_aborts_sender(transport: str) -> None:
    """The receiver rejects the corrupted bucket naming the tensor; the sender fails too (shm, nixl:
    with the receiver's reason; gloo has no back channel: the sender sees the receiver leave)."""
    ctor = {"bucket_size": 1024, "timeout_s": 30, "verify": True}
    with Cluster(transport, 1, 1, mode="transport", ctor=ctor) as cluster:
        cluster.build_process_group()
        cluster.post(1, "exec", CORRUPT)
        cluster.wait(1)
        cluster.post(0, "send", MODEL, 0, {})
        cluster.post(1, "receive", {})
        recv_status, recv_msg = cluster.wait_result(1)
        send_status, send_msg = cluster.wait_result(0)
        cluster.call_all("finalize")
    assert recv_status == "err" and "ChunkCorruptedError" in recv_msg and "is corrupted" in recv_msg
    assert "tensor '" in recv_msg
    assert send_status == "err", send_msg
    # every transport, gloo included (its receiver leaves the reason on the store), names the cause
    assert "PeerAbortedError" in send_msg and "corrupted" in send_msg and "phase" in send_msg, send_msg


WRONG_VERSION = """
import msgspec
import verl_fastsync.transports.controlled as controlled
orig = controlled.encode
def encode(message):
    raw = msgspec.to_builtins(message)
    raw["schema_version"] = 99
    return msgspec.msgpack.encode(raw)
controlled.encode = encode
"""


@pytest.mark.timeout(120)
def test_incompatible_wire_version_rejected() -> None:
    with Cluster("shm", 1, 1, mode="transport", ctor={"bucket_size": 1024, "timeout_s": 4}) as cluster:
        cluster.post(0, "exec", WRONG_VERSION)
        cluster.wait(0)
        metadata = [
            cluster.wait(i) for i in (cluster.post(0, "prepare") or 0, cluster.post(1, "prepare") or 1)
        ]
        from verl_fastsync.transports.shm import ShmTransport

        actor, rollout = ShmTransport.build_topology(1, 1, metadata)
        cluster.post(0, "init", {k: v[0] for k, v in actor.items()})
        cluster.post(1, "init", {k: v[0] for k, v in rollout.items()})
        recv_status, recv_msg = cluster.wait_result(1)
        send_status, send_msg = cluster.wait_result(0, timeout=60)
        cluster.call_all("finalize")
    assert recv_status == "err" and "WireVersionError" in recv_msg
    assert f"sent version 99, this side speaks version {WIRE_SCHEMA_VERSION}" in recv_msg
    # the receiver tells the sender's handshake why it cannot join before it closes its connection:
    # the sender knows at once, not by its timeout, and with the cause (not "connection closed")
    assert send_status == "err" and "phase 'handshake'" in send_msg, send_msg
    assert "rollout rank 0 aborted the sync" in send_msg and "sent version 99" in send_msg, send_msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_receiver_killed_sender_raises(transport: str) -> None:
    ctor = {"bucket_size": 1024, "timeout_s": 4}
    with Cluster(transport, 1, 1, mode="transport", ctor=ctor) as cluster:
        cluster.build_process_group()
        cluster.post(0, "send", MODEL, 0, {})
        cluster.post(1, "receive", {"die_after": 3})
        status, message = cluster.wait_result(0, timeout=4 + 40)
        cluster.procs[1].join(timeout=10)
        assert cluster.procs[1].exitcode == 17
        cluster.post(0, "finalize")
        cluster.wait(0)
    assert status == "err"
    assert "trainer rank 0" in message, message
    assert "bucket" in message and "tensor in flight" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_sender_killed_receiver_raises(transport: str) -> None:
    ctor = {"bucket_size": 1024, "timeout_s": 4}
    with Cluster(transport, 1, 1, mode="transport", ctor=ctor) as cluster:
        cluster.build_process_group()
        cluster.post(0, "send", MODEL, 0, {"die_after": 4})
        cluster.post(1, "receive", {})
        status, message = cluster.wait_result(1, timeout=4 + 40)
        cluster.procs[0].join(timeout=10)
        assert cluster.procs[0].exitcode == 17
        cluster.post(1, "finalize")
        cluster.wait(1)
    assert status == "err", message
    assert "trainer rank 0" in message
    assert "bucket" in message and "tensor in flight" in message


@pytest.mark.timeout(120)
def test_sender_error_reaches_receiver() -> None:
    """A bad weight on the trainer (duplicate name) aborts every receiver with the reason."""
    specs = [TensorSpec("a", (10,)), TensorSpec("a", (3,))]
    with Cluster("shm", 1, 1, mode="transport", ctor={"bucket_size": 1024, "timeout_s": 30}) as cluster:
        with pytest.raises(WorkerError, match="appears twice"):
            cluster.sync(specs, finalize=False)
        status, message = cluster.wait_result(1)
        cluster.call_all("finalize")
    assert status == "err" and "PeerAbortedError" in message and "'a' appears twice" in message


# -- third-party transport through a real entry point ------------------------------------------

PLUGIN = """
from verl_fastsync import hookimpl
from verl_fastsync.transports.shm import ShmTransport


class PigeonTransport(ShmTransport):
    name = "pigeon"


@hookimpl
def weight_transport(kind):
    return {"pigeon": PigeonTransport} if kind == "engine" else None
"""

CHECK = """
import sys
from verl_fastsync.plugins import available_transports, plugin_manager, select_transport
pm = plugin_manager()
cls = select_transport(pm, "pigeon", "engine")
print("selected", cls.__module__, cls.__name__, sorted(available_transports(pm, "engine")))
"""


@pytest.mark.timeout(120)
def test_third_party_transport_via_entry_point(tmp_path: Path) -> None:
    write_plugin_dist(tmp_path, "pigeon_transport", PLUGIN, entry_name="pigeon")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=90, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "selected pigeon_transport PigeonTransport" in out.stdout
    assert "'pigeon'" in out.stdout and "'shm'" in out.stdout
    # without the dist-info on the path the name is unknown and the error lists what exists
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=90, check=False
    )
    assert out.returncode != 0 and "unknown engine transport; available:" in out.stderr


# -- nccl: no GPU here, so import safety and the protocol up to the CUDA check -----------------


def test_nccl_importable_without_gpu_and_fails_clearly() -> None:
    import torch

    from verl_fastsync.transports.base import EngineTransport
    from verl_fastsync.transports.nccl import NcclTransport

    factory = select_transport(plugin_manager(), "nccl", "engine")
    assert factory.load() is NcclTransport
    assert issubclass(NcclTransport, EngineTransport) and NcclTransport.prefetch
    master = factory(TransportOptions(is_master=True, host="127.0.0.1", timeout_s=5))
    receiver = factory(TransportOptions(timeout_s=5))
    try:
        meta = [dict(master.prepare(), bucket_size=1024), dict(receiver.prepare(), bucket_size=1024)]
        assert meta[0]["endpoint"].startswith("tcp://127.0.0.1:")
        actor, rollout = factory.build_topology(1, 1, meta)
        assert actor["endpoint"] == rollout["endpoint"] == [meta[0]["endpoint"]]
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="nccl transport needs a CUDA device"):
                master.init_process_group(**{k: v[0] for k, v in actor.items()})
    finally:
        master.finalize()
        receiver.finalize()
    with pytest.raises(RuntimeError, match="no control endpoint"):
        factory.build_topology(1, 1, [{"bucket_size": 1}, {"bucket_size": 1}])


def test_nccl_communicator_takes_the_unique_id_in_the_form_this_cupy_wants() -> None:
    """cupy 14 takes the unique id as bytes, earlier cupy as a tuple of signed chars; each refuses the
    other with a TypeError before NCCL is called. Stand-ins for cupy's ``nccl`` module (no GPU here)
    with the two signatures; the GPU check (benchmarks/gpu_nccl_check.py) ran the real one."""
    from verl_fastsync.transports.nccl import new_communicator

    uid = bytes(range(120, 248))  # bytes past 127 become negative chars in the tuple form
    made: list[tuple[int, object, int]] = []

    class Cupy:
        """A ``nccl`` module whose ``NcclCommunicator`` takes the unique id as ``takes`` only."""

        def __init__(self, takes: type, made_as: str) -> None:
            self.takes, self.made_as = takes, made_as

        def NcclCommunicator(self, ndev: int, comm_id: object, rank: int) -> str:
            if not isinstance(comm_id, self.takes):
                raise TypeError(
                    f"Argument 'commId' has incorrect type (expected {self.takes.__name__}, "
                    f"got {type(comm_id).__name__})"
                )
            made.append((ndev, comm_id, rank))
            return self.made_as

    assert new_communicator(Cupy(bytes, "comm14"), 3, uid, 1) == "comm14"
    assert made.pop() == (3, uid, 1)
    assert new_communicator(Cupy(tuple, "comm13"), 3, uid, 2) == "comm13"
    ndev, comm_id, rank = made.pop()
    assert (ndev, rank) == (3, 2) and isinstance(comm_id, tuple) and len(comm_id) == 128
    assert (
        comm_id[:8] == (120, 121, 122, 123, 124, 125, 126, 127) and comm_id[8] == -128 and comm_id[-1] == -9
    )
    assert bytes(b & 0xFF for b in comm_id) == uid


POSTED_FLAG = """
import pathlib
t = worker.engine
orig = t._post_bucket
def post(slot, message):
    orig(slot, message)
    if message.bucket_index == 2:
        pathlib.Path({flag!r}).touch()
t._post_bucket = post
"""

DELAY_FIRST_ACK = """
import pathlib, time
t = worker.engine
orig = t._release_slot
def release(slot, bucket_index):
    if bucket_index == 0:
        deadline = time.monotonic() + {wait_s}
        while not pathlib.Path({flag!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.seen_bucket_2_before_ack_0 = pathlib.Path({flag!r}).exists()
    orig(slot, bucket_index)
t._release_slot = release
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slots", [2, 3])
def test_shm_sender_packs_ahead_by_its_slots_and_never_into_an_unacked_one(
    slots: int, tmp_path: Path
) -> None:
    """The receiver holds back its ack of bucket 0 until the sender posted bucket 2. With three slots
    the sender does so without waiting (the third slot is what lets it pack ahead over uneven
    buckets); with two it must not (bucket 2 goes into bucket 0's slot): it posts only after the ack,
    which the receiver sends after waiting 3 s in vain. Both syncs deliver the right bytes."""
    flag = str(tmp_path / "bucket-2-posted")
    specs = [TensorSpec(f"b{i}", (900,), "float32") for i in range(6)]  # one tensor per 4 KiB bucket
    ctor = {"bucket_size": 4096, "timeout_s": 120, "extra": {"slots": slots}}
    with Cluster("shm", 1, 1, mode="transport", ctor=ctor, timeout=240) as cluster:
        cluster.build_process_group()
        cluster.post(0, "exec", POSTED_FLAG.format(flag=flag))
        cluster.wait(0)
        wait_s = 120 if slots == 3 else 3
        cluster.post(1, "exec", DELAY_FIRST_ACK.format(flag=flag, wait_s=wait_s))
        cluster.wait(1)
        cluster.post(0, "send", specs, 4, {})
        cluster.post(1, "receive", {})
        received = cluster.wait(1)
        cluster.wait(0)
        cluster.post(1, "exec", "result = worker.seen_bucket_2_before_ack_0")
        seen = cluster.wait(1)
        cluster.call_all("finalize")
    assert [tuple(d) for d in received["digests"]] == expected_digests(specs, 4)
    assert seen is (slots == 3)


HOLD_WRITE_UNTIL_NEXT_PACKED = """
t = worker.engine
events = worker.events = []
state = {"write": None, "packed_after": False}
orig_start, orig_between = t._start_write, t._between_tensors
def start(slot, message):
    orig_start(slot, message)
    events.append(("write", message.bucket_index))
    state["write"], state["packed_after"] = message.bucket_index, False
    agent = t._agent
    if not hasattr(agent, "_real_check"):
        agent._real_check = agent.check_xfer_state
        def check(handle):
            real = agent._real_check(handle)
            # the WRITE of bucket 0 "moves" until the sender has packed a tensor of the next bucket
            return "PROC" if state["write"] == 0 and not state["packed_after"] else real
        agent.check_xfer_state = check
def between():
    if state["write"] is not None:
        state["packed_after"] = True
        events.append(("packed", state["write"]))
    orig_between()
t._start_write, t._between_tensors = start, between
orig_finish = t._writes.finish
def finish(agent):
    write = orig_finish(agent)  # the bucket's WRITEs completed: it is announced right after
    events.append(("announce", write.message.bucket_index))
    return write
t._writes.finish = finish
"""


@pytest.mark.timeout(300)
def test_nixl_sender_packs_the_next_bucket_while_a_write_moves() -> None:
    """The WRITE of bucket 0 reports "in progress" until the sender has packed a tensor of bucket 1:
    the sender must go on packing (a sender that waits for each WRITE before packing on would time
    out here), announce bucket 0 only once its WRITE completed, and the bytes of both slots must
    arrive intact."""
    specs = [TensorSpec(f"b{i}", (900,), "float32") for i in range(6)]  # one tensor per 4 KiB bucket
    ctor = {"bucket_size": 4096, "timeout_s": 60}  # a blocking sender fails by this timeout
    with Cluster("nixl", 1, 1, mode="transport", ctor=ctor, timeout=240) as cluster:
        cluster.build_process_group()
        cluster.post(0, "exec", HOLD_WRITE_UNTIL_NEXT_PACKED)
        cluster.wait(0)
        cluster.post(0, "send", specs, 9, {})
        cluster.post(1, "receive", {})
        received = cluster.wait(1)
        cluster.wait(0)
        cluster.post(0, "exec", "result = list(worker.events)")
        events = cluster.wait(0)
        cluster.call_all("finalize")
    assert [tuple(d) for d in received["digests"]] == expected_digests(specs, 9)
    events = [tuple(e) for e in events]
    assert events.index(("write", 0)) < events.index(("packed", 0)) < events.index(("announce", 0))
    assert [e for e in events if e[0] == "announce"] == [("announce", i) for i in range(6)]
