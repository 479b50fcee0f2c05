"""gloo sender abort: one ``timeout_s`` in all, never one per pending wait.

The sender's abort path used to wait for both slots, post an abort and wait for it, each wait with
its own full ``timeout_s`` (every work of a slot too), so a receiver that is alive but slow took the
sender up to (slots + 1) x ``timeout_s`` to fail. Now the sender publishes its cause on the group's
abort channel and closes the group at once (``tests/test_gloo_fleet.py`` covers what the receivers
then see), and the waits of a group share one deadline: a slot's works, a received bucket's
metadata and payload.

* :func:`test_gloo_sender_abort_ends_within_one_timeout`: a real 1-sender/1-receiver gloo pair in
  spawned processes. The receiver's consumer stalls after its first tensor for most of
  ``timeout_s`` (so the sender's last two buckets stay pending) and, once it has taken them, stalls
  again for long. The producer raises in between. The sender must fail with the producer's error
  within ``timeout_s`` + a margin of the raise; the old code took the first stall plus a whole fresh
  ``timeout_s`` for the abort message.
* :func:`test_slot_works_share_one_deadline`: works that each finish just inside ``timeout_s`` of
  the previous one (no processes): one deadline for the slot, not one per work.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _transport_harness import Cluster, TensorSpec

from verl_fastsync.transports.base import TransportOptions, TransportTimeoutError
from verl_fastsync.transports.gloo import GlooTransport
from verl_fastsync.transports.gloo_abort import let_go_later

TIMEOUT_S = 10
MARGIN_S = 6  # process scheduling on a loaded 2-core host
MIB = 1 << 20
BUCKET = 8 * MIB  # four 2 MiB payload parts per bucket: more than loopback's socket buffers take
# one tensor per bucket, exactly the bucket: each add closes its bucket and ships it
MODEL = [TensorSpec(f"layer{i}.w", (BUCKET // 4,), "float32") for i in range(8)]
# The receiver prefetches one bucket: stalled on tensor 1 it holds buckets 0-2, so buckets 3 and 4
# (both slots) are pending when the producer raises before tensor 5.
RAISE_AFTER = 5
# Stall 1 (after 1 tensor) ends inside the gloo op timeout of the pending buckets, which the
# receiver then takes; stall 2 (after 3 tensors, bucket 4 prefetched) outlasts the sender's abort.
FIRST_STALL_S = 0.75 * TIMEOUT_S
SECOND_STALL_S = 3 * TIMEOUT_S


@pytest.mark.timeout(240)
def test_gloo_sender_abort_ends_within_one_timeout() -> None:
    ctor = {"bucket_size": BUCKET, "timeout_s": TIMEOUT_S}
    stalls = {1: FIRST_STALL_S, 3: SECOND_STALL_S}
    with Cluster("gloo", 1, 1, mode="transport", ctor=ctor, timeout=180) as cluster:
        cluster.build_process_group()
        cluster.post(0, "send", MODEL, 0, {"producer": "lazy", "raise_after": RAISE_AFTER})
        cluster.post(1, "receive", {"stall_s": stalls, "hash": False})
        send_status, send_message = cluster.wait_result(0, timeout=FIRST_STALL_S + SECOND_STALL_S + 60)
        failed_at = time.time()
        recv_status, _ = cluster.wait_result(1, timeout=SECOND_STALL_S + 60)
        cluster.call_all("finalize")
    assert send_status == "err", "the sender reported success for a sync whose producer raised"
    assert f"producer failed on purpose after {RAISE_AFTER} tensors" in send_message, send_message
    raised = re.search(r"at t=(\d+\.\d+)", send_message)
    assert raised is not None, send_message
    elapsed = failed_at - float(raised.group(1))
    print(f"gloo sender abort: {elapsed:.2f}s from the producer's raise to the sender's failure")
    assert elapsed <= TIMEOUT_S + MARGIN_S, (
        f"the gloo sender took {elapsed:.1f}s from the producer's raise to its failure "
        f"(timeout_s={TIMEOUT_S}): the abort path must share one deadline"
    )
    assert recv_status == "err", "the receiver reported success for a sync the sender abandoned"


class _SlowWork:
    """A broadcast that completes at ``done_at`` (monotonic); ``wait`` behaves like c10d's."""

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at
        self.timeouts: list[float] = []

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: Any) -> bool:
        seconds = timeout.total_seconds()
        assert seconds > 0, "a zero timeout means no timeout to c10d"
        self.timeouts.append(seconds)
        left = self.done_at - time.monotonic()
        if left > seconds:
            time.sleep(seconds)
            raise RuntimeError("Operation timed out!")
        time.sleep(max(left, 0.0))
        return True


@pytest.mark.timeout(60)
def test_slot_works_share_one_deadline() -> None:
    timeout = 0.5
    transport = GlooTransport(TransportOptions(timeout_s=timeout, is_master=True))
    transport.rank = 0
    start = time.monotonic()
    # six works (header, metadata, four parts), each done 0.4 s after the previous one: every one is
    # inside timeout_s of the last, the slot as a whole is not (the old code waited 2.4 s and passed)
    works = [_SlowWork(start + 0.4 * (i + 1)) for i in range(6)]
    transport._slot_works[0] = list(works)
    with pytest.raises(TransportTimeoutError, match=r"timed out after 0.5s waiting for rollout ranks"):
        transport._wait_slot_free(0)
    elapsed = time.monotonic() - start
    # the old code took 2.4 s (and raised nothing); 1 s of slack for a loaded host
    assert elapsed <= timeout + 1.0, f"one slot took {elapsed:.2f}s with timeout_s={timeout}"
    assert works[1].timeouts and works[1].timeouts[0] <= timeout - 0.3, works[1].timeouts


class _Recorder:
    """Stands for a process group: its destructor records the thread it ran on."""

    def __init__(self, ran_on: list[str]) -> None:
        self.ran_on = ran_on

    def __del__(self) -> None:
        self.ran_on.append(threading.current_thread().name)


@pytest.mark.timeout(120)
def test_a_released_group_is_never_destroyed_on_the_callers_thread() -> None:
    """gloo's group destructor joins its threads, which may wait out a broadcast: it must run on the
    release thread, never on the caller's (the event loop's). Handing the object itself over raced:
    a release thread that finished first left the caller's own reference as the last one (a sync's
    cleanup then stalled for the op's whole timeout). 300 releases, each racing its thread."""
    ran_on: list[str] = []
    for _ in range(300):
        let_go_later([_Recorder(ran_on)])
    deadline = time.monotonic() + 60
    while len(ran_on) < 300 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ran_on) == 300, f"{len(ran_on)} of 300 released"
    assert set(ran_on) == {"fastsync-gloo-release"}, sorted(set(ran_on))
    on_caller = [name for name in ran_on if name == threading.current_thread().name]
    assert not on_caller, f"{len(on_caller)} of 300 destroyed on the caller's thread"


@pytest.mark.timeout(120)
def test_a_released_group_still_referenced_elsewhere_is_destroyed_on_the_release_thread() -> None:
    """A failed receive's traceback keeps the frame that held the group, and that exception is freed
    on the event loop's thread. The release thread keeps its reference until the other is gone, so
    the destructor runs there, not where the exception died (CI: a rollout rank's loop stalled 40 s
    in the destructor of a group whose last reference a suppressed lane error held)."""
    ran_on: list[str] = []
    elsewhere = [_Recorder(ran_on) for _ in range(20)]  # stand for the traceback's frames
    for recorder in elsewhere:
        let_go_later([recorder])
    del recorder
    time.sleep(0.5)  # every release thread has looked: the other reference still stands
    assert not ran_on, f"{len(ran_on)} destroyed while referenced elsewhere"
    elsewhere.clear()  # the exception dies on this (the loop's) thread
    deadline = time.monotonic() + 60
    while len(ran_on) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran_on == ["fastsync-gloo-release"] * 20, ran_on


@pytest.mark.timeout(60)
def test_a_kept_failure_of_a_receive_keeps_no_group_alive() -> None:
    """A failed receive's exception is kept in its future (and, in a reference cycle, until the
    garbage collector runs): its traceback's frames must not hold the group, or the group's threads
    and sockets stay until then (the fleet test saw gloo frames 1 s after a failure). A real gloo
    group of one rank, held as the receive holds it; the kept exception still names its cause."""
    from verl_fastsync.transports.gloo_abort import frames_cleared_on_error

    def receive(group: Any) -> None:
        held = group  # as ``_recv_next`` holds the group it started on
        raise RuntimeError(f"the broadcast failed on {type(held).__name__}")

    kept: dict[str, BaseException] = {}
    for name, call in (("plain", receive), ("cleared", frames_cleared_on_error(receive))):
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
        alive = weakref.ref(group)
        try:
            call(group)
        except RuntimeError as exc:
            kept[name] = exc  # as a future keeps it
        del group
        assert (alive() is not None) == (name == "plain"), name
    assert str(kept["cleared"]) == "the broadcast failed on ProcessGroupGloo"


@pytest.mark.timeout(300)
def test_two_groups_built_at_once_never_take_each_others_connections() -> None:
    """The lanes of several senders build their groups at once between the same processes. Each
    group's connections must be its own: 3 processes x 3 rounds, two groups built at the same moment
    (a thread and a store each), the first group's connections shut down on every rank, then a
    broadcast on the second must deliver every byte. Taking "the connections that appeared while the
    group was built" put both groups' 8 connections in each group's list (measured: every round),
    so cutting one group cut the other's."""
    import multiprocessing as mp

    from _gloo_groups_peer import main

    ctx = mp.get_context("spawn")
    ports = []
    for _ in range(2):  # two free ports for the two stores (the OS picks them)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
    procs = [ctx.Process(target=main, args=(rank, 3, ports, pipes[rank][1])) for rank in range(3)]
    for proc in procs:
        proc.start()
    try:
        reports = []
        for rank, (reader, _) in enumerate(pipes):
            assert reader.poll(240), f"rank {rank} sent no report within 240 s"
            reports.append(reader.recv())
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    for rank, report in enumerate(reports):
        others = sorted(r for r in range(3) if r != rank for _ in range(2))  # two devices: two links a peer
        for round_ in report["rounds"]:
            assert round_["shared"] == 0, (rank, round_)
            assert round_["peers"] == others, (rank, round_)
            assert round_["first_links"] == 4 and round_["second_links"] == 4, (rank, round_)
            assert round_["closed"] <= 4, (rank, round_)  # a peer's shutdown may close some first
            assert round_["error"] == "" and round_["equal"], (rank, round_)


def test_device_listeners_leave_out_a_listener_other_code_opened_meanwhile() -> None:
    """A group's connections are told apart by its devices' listeners: another listener opened while
    the devices were made (another transport's, on another thread) must not be taken for one of
    them; the creation is redone and yields exactly the devices' own."""
    from verl_fastsync.transports.gloo_abort import create_devices

    foreign: list[socket.socket] = []

    def create() -> object:
        if not foreign:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            foreign.append(sock)
        return dist.ProcessGroupGloo.create_default_device()

    try:
        devices, listeners = create_devices(create, 2)
        assert len(devices) == 2 and len(listeners) == 2, listeners
        host, port = foreign[0].getsockname()[:2]
        assert (host, port) not in listeners, (listeners, (host, port))
    finally:
        for sock in foreign:
            sock.close()


@pytest.mark.timeout(60)
def test_a_closed_connections_number_taken_by_a_unix_socket_leaves_no_other_connection_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, but the number now names a Unix socket (asyncio's self-pipe, a multiprocessing
    pipe): its address is no (host, port). Its check raised out of the shutdown, which the group's
    close swallows as best effort, and the group's later connections stayed open: a broadcast posted
    on them waited out ``timeout_s`` in gloo's thread, and the group's destructor with it (the likely
    cause of a CI run where a rollout rank's failed sync took 60 s to end, with the destructor on the
    loop's thread, see the test above). Every other connection of the group must close."""
    from verl_fastsync.transports import gloo_abort
    from verl_fastsync.transports.gloo_abort import GroupSockets, connected_sockets

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    reused = socket.create_connection(server.getsockname()[:2])
    reused_far, _ = server.accept()
    kept = socket.create_connection(server.getsockname()[:2])
    kept_far, _ = server.accept()
    fd = reused.fileno()
    listed = connected_sockets()
    ordered = {fd: listed[fd], kept.fileno(): listed[kept.fileno()]}  # the reused number first
    group = GroupSockets({link: 1 for link in ordered.values()})
    pipe_a, pipe_b = socket.socketpair()
    os.dup2(pipe_a.fileno(), fd)  # gloo closed the connection; the number is a Unix socket's now
    try:
        monkeypatch.setattr(gloo_abort, "connected_sockets", lambda: ordered)
        assert group.shutdown() == 1
        kept_far.settimeout(10)
        assert kept_far.recv(64) == b"", "the group's other connection is still open"
        pipe_b.sendall(b"still connected")
        with socket.socket(fileno=os.dup(fd)) as unix:
            unix.settimeout(10)
            assert unix.recv(64) == b"still connected"
    finally:
        for sock in (server, reused, reused_far, kept, kept_far, pipe_a, pipe_b):
            sock.close()


def test_a_closed_connections_number_taken_by_another_groups_socket_is_never_shut_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's shutdown lists this process's connections, then shuts each of its own down. Between
    the two, gloo may close one of them (its peer shut the other end first) and the kernel hands the
    same number, the lowest free one, to a connection of the group the process builds next. Shutting
    that number down cut the new group's connection: gloo lanes over the hosts, 4 hosts x 2 ranks,
    failed 3 of 3 builds with "Failed to recv, got 0 bytes". The listing is taken here just before
    the old connection closes and its number is reused; the new connection must carry on."""
    from verl_fastsync.transports import gloo_abort
    from verl_fastsync.transports.gloo_abort import GroupSockets, connected_sockets

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    old = socket.create_connection(server.getsockname()[:2])
    old_far, _ = server.accept()
    fd = old.fileno()
    listed = connected_sockets()
    link = listed[fd]
    group = GroupSockets({link: 1})
    old.close()  # gloo closed it: its number is free
    new = socket.create_connection(server.getsockname()[:2])
    new_far, _ = server.accept()
    moved = new.fileno() != fd  # the kernel hands out the lowest free number: usually fd itself
    if moved:
        os.dup2(new.fileno(), fd)  # the number names the new connection either way
    try:
        monkeypatch.setattr(gloo_abort, "connected_sockets", lambda: listed)
        assert group.shutdown() == 0
        new.sendall(b"still connected")
        new_far.settimeout(10)
        assert new_far.recv(64) == b"still connected"
    finally:
        if moved:
            os.close(fd)
        for sock in (server, old_far, new, new_far):
            sock.close()
