"""How a failure of one gloo rank reaches every other rank at once, and how a failed group lets go.

gloo gives neither: ``ProcessGroupGloo.abort()`` and ``shutdown()`` close nothing (measured on torch
2.13: a peer blocked in a broadcast waits out the op's whole ``timeout_s``, and so does the aborting
process's own blocked receive), and a receive blocked in ``Work.wait`` cannot be interrupted. Two
pieces here make up for it:

* :class:`AbortChannel`: one key per group epoch on the group's ``TCPStore`` holding the first
  :class:`~verl_fastsync.wire.Abort` any rank published (``compare_set``: the first cause wins, later
  ones are dropped). A failing rank publishes its cause before it closes its sockets, so a peer whose
  broadcast fails because of it finds the cause there; a rank blocked in a broadcast reads the key
  between short wait slices, so it learns of a failure it is not connected to directly.
* :class:`GroupSockets`: the TCP connections of one group. Each gloo device listens on one socket
  of its own, and every connection of the group ends at a listener of one of its ranks: a
  connection this rank accepted has one of its own listeners as its local end, one it opened has a
  peer's listener as its far end. The listeners are known exactly (:func:`create_devices`: the
  listening sockets a device creation added, under a process-wide lock) and exchanged on the store,
  so a connection of another group, even one built at the same moment between the same processes
  (the lanes of several senders), is never taken for one of this group's. (Taking "the connections
  that appeared while the group was built" instead took the other group's too, every time when two
  groups were built at once: shutting one group down then cut the other's connections.) Shutting
  them down fails every operation posted on the group at once, on this side (its threads, buffers
  and sockets are free within moments, the group's destructor no longer waits for a receive's
  timeout) and on every peer connected to it (its broadcast fails with "Connection closed by peer":
  the kernel does the same for a process that dies).

A rank that cannot join a group at all never reaches gloo's rendezvous, where the others would wait
out ``timeout_s``: every rank first passes :func:`join_barrier` (reading the channel between short
slices), and the failing rank publishes its cause there with :func:`publish_join_abort`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist

from verl_fastsync.wire import Abort, decode, encode

__all__ = [
    "AbortChannel",
    "GroupSockets",
    "connected_sockets",
    "create_devices",
    "frames_cleared_on_error",
    "join_barrier",
    "let_go_later",
    "publish_join_abort",
]

P = ParamSpec("P")
R = TypeVar("R")
Endpoint = tuple[str, int]
Link = tuple[Endpoint, Endpoint]  # (this side's address, the peer's address)

_JOIN_POLL_S = 0.05  # a rank waiting for the others to join reads the abort channel this often
_DEVICE_LOCK = threading.Lock()  # one device creation at a time per process: its listener is told apart
_DEVICE_TRIES = 5  # a listener opened meanwhile by other code (not gloo's) makes a creation ambiguous
_ANY = ("0.0.0.0", "::", "")
_RELEASE_POLL_S = 0.01  # a released object still referenced elsewhere is looked at again after this
_RELEASE_POLL_MAX_S = 0.1  # ... doubling up to this (a kept group's threads and sockets go soon after)
_ONLY_OURS = 2  # sys.getrefcount of an object only the release list holds (the list, the argument)
_PEER = re.compile(r"\[([^\]]+)\]:(\d+)")


class AbortChannel:
    """The first cause of a group's failure, on its store (see the module docstring)."""

    def __init__(self, store: Any, key: str) -> None:
        self.store = store
        self.key = key

    def publish(self, message: Abort) -> Abort:
        """Publish ``message`` unless a cause is there already; returns the cause that stands."""
        stored = self.store.compare_set(self.key, "", encode(message))
        return _as_abort(stored) or message

    def read(self) -> Abort | None:
        """The published cause, or ``None``. One store round trip when there is none."""
        if not self.store.check([self.key]):
            return None
        return _as_abort(self.store.get(self.key))


def join_barrier(
    channel: AbortChannel, key: str, world_size: int, deadline: float
) -> tuple[Abort | None, int]:
    """Count this rank in on ``key`` (on the channel's store) and wait until all ``world_size`` ranks
    are in, or a rank published on ``channel`` that it cannot join, or ``deadline``
    (:func:`time.monotonic`) passed. Returns (the published cause or ``None``, how many were in)."""
    joined = int(channel.store.add(key, 1))
    while joined < world_size:
        message = channel.read()
        if message is not None or time.monotonic() >= deadline:
            return message, joined
        time.sleep(_JOIN_POLL_S)
        joined = int(channel.store.add(key, 0))
    return None, joined


def publish_join_abort(topology: dict[str, Any], key: str, reason: str) -> None:
    """Publish ``Abort(reason, topology["rank"])`` on the abort channel ``key`` of the group's store
    (``topology``: a rank's ``init_process_group`` arguments) from a rank that holds no connection to
    it (one that could not join the group); the first cause still wins."""
    addr, port = str(topology["master_addr"]), int(topology["master_port"])
    store = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=2))
    AbortChannel(store, key).publish(Abort(reason=reason, rank=int(topology["rank"])))


def _as_abort(raw: bytes) -> Abort | None:
    try:
        message = decode(bytes(raw), peer="the gloo store")
    except Exception:
        return None
    return message if isinstance(message, Abort) else None


def _endpoint(address: Any) -> Endpoint:
    host = str(address[0])
    return host.removeprefix("::ffff:") if "." in host else host, int(address[1])


def _ends(sock: socket.socket) -> tuple[Endpoint, Endpoint | None] | None:
    """(Local address, peer address; ``None``: listening) of a TCP socket; ``None`` for any other
    socket (a Unix one, say) or one not or no longer connected."""
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        local = _endpoint(sock.getsockname())
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return local, None
        return local, _endpoint(sock.getpeername())
    except OSError:
        return None


def _tcp_sockets() -> dict[int, tuple[Endpoint, Endpoint | None]]:
    """This process's TCP sockets: fd -> (local address, peer address; ``None``: listening)."""
    found: dict[int, tuple[Endpoint, Endpoint | None]] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        with sock:  # the duplicate only
            ends = _ends(sock)
        if ends is not None:
            found[int(name)] = ends
    return found


def connected_sockets() -> dict[int, Link]:
    """This process's connected TCP sockets: fd -> (local address, peer address)."""
    return {fd: (local, peer) for fd, (local, peer) in _tcp_sockets().items() if peer is not None}


def _listeners() -> set[Endpoint]:
    return {local for local, peer in _tcp_sockets().values() if peer is None}


def create_devices(create: Callable[[], Any], count: int) -> tuple[list[Any], set[Endpoint]]:
    """``count`` gloo devices made by ``create`` and the addresses they listen on (one each). Device
    creations of this process take turns; when other code opened a listener meanwhile (more new
    listeners than devices), the devices are made again, so the set holds gloo's listeners only."""
    with _DEVICE_LOCK:
        for _ in range(_DEVICE_TRIES):
            before = _listeners()
            devices = [create() for _ in range(count)]
            added = _listeners() - before
            if len(added) == count:
                return devices, added
            del devices  # their listeners close with them
    raise RuntimeError(
        f"gloo: could not tell this group's {count} listening sockets from others opened meanwhile "
        f"({_DEVICE_TRIES} tries)"
    )


def _listener_of(end: Endpoint, owner: dict[Endpoint, int]) -> int | None:
    """The rank whose listener ``end`` is (one bound to every address matches its port alone)."""
    if end in owner:
        return owner[end]
    return next((r for (host, port), r in owner.items() if port == end[1] and host in _ANY), None)


class GroupSockets:
    """The connections of one gloo group (see the module docstring), with the peer rank of each."""

    def __init__(self, links: dict[Link, int]) -> None:
        self.links = links

    @staticmethod
    def publish_listeners(store: Any, prefix: str, rank: int, listeners: set[Endpoint]) -> None:
        """Publish this rank's listeners (:func:`create_devices`) before its group is built."""
        store.set(f"{prefix}/listen/{rank}", json.dumps(sorted(listeners)))

    @classmethod
    def exchange(
        cls, store: Any, prefix: str, rank: int, world_size: int, listeners: set[Endpoint], timeout_s: float
    ) -> GroupSockets:
        """Once the group is built: this rank's connections of the group, each with its peer rank.
        One it opened ends at a peer's listener (which names the peer); one it accepted starts at one
        of ``listeners`` and is named by the peer that lists it among the connections it opened."""
        peers = [r for r in range(world_size) if r != rank]
        wait = datetime.timedelta(seconds=timeout_s)
        listen_keys = [f"{prefix}/listen/{r}" for r in peers]
        store.wait(listen_keys, wait)
        owner: dict[Endpoint, int] = {}
        for peer, raw in zip(peers, store.multi_get(listen_keys), strict=True):
            owner.update({(str(host), int(port)): peer for host, port in json.loads(bytes(raw))})
        now = connected_sockets().values()
        opened = {
            link: owner_rank for link in now if (owner_rank := _listener_of(link[1], owner)) is not None
        }
        mine = dict.fromkeys(listeners, rank)
        accepted = {link for link in now if _listener_of(link[0], mine) is not None}
        store.set(f"{prefix}/opened/{rank}", json.dumps([[*local, *far] for local, far in opened]))
        opened_keys = [f"{prefix}/opened/{r}" for r in peers]
        store.wait(opened_keys, wait)
        links = dict(opened)
        for peer, raw in zip(peers, store.multi_get(opened_keys), strict=True):
            for lhost, lport, phost, pport in json.loads(bytes(raw)):
                link = ((str(phost), int(pport)), (str(lhost), int(lport)))  # seen from this side
                if link in accepted:
                    links[link] = peer
        return cls(links)

    def rank_of(self, text: str) -> int | None:
        """The peer rank of the connection named by the first "[host]:port" in a gloo error text
        (the peer's end; torch 2.13's gloo prints its port in network byte order), if it is one of
        this group's."""
        match = _PEER.search(text)
        if match is None:
            return None
        host, port = match.group(1), int(match.group(2))
        ends = {(host, port), (host, ((port & 0xFF) << 8) | (port >> 8))}
        return next((rank for (_, far), rank in self.links.items() if far in ends), None)

    def shutdown(self) -> int:
        """Shut down every connection of the group still open, matched by its addresses when listed
        and again once its socket is held: a number gloo closed meanwhile is soon another socket's
        (the kernel hands out the lowest free one). Returns how many."""
        done = 0
        for fd, link in connected_sockets().items():
            if link not in self.links:
                continue
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                # listed a moment ago: the number may be another socket by now, of any kind (a Unix
                # socket's address once stopped this loop, leaving the rest of the group connected)
                if _ends(sock) != link:
                    continue
                sock.shutdown(socket.SHUT_RDWR)  # acts on the socket, shared with gloo's descriptor
                done += 1
            except OSError:
                pass
            finally:
                sock.close()
        self.links = {}
        return done


def frames_cleared_on_error(func: Callable[P, R]) -> Callable[P, R]:
    """``func``, whose exceptions leave with the locals of its frame and its callees' cleared: a
    failure kept somewhere (a receive's, in its future; a traceback in a reference cycle until the
    garbage collector runs) must not keep a group or a store alive, which :func:`let_go_later`
    would wait for (its threads and sockets held, and the destructor run where the last one dies)."""

    @functools.wraps(func)
    def cleared(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # all but this one, still running
            del args, kwargs  # this frame stays in the traceback too
            raise

    return cleared


def _let_go(held: list[Any], after_s: float) -> None:
    time.sleep(after_s)
    # Another reference may outlive the caller's: a failed receive's traceback keeps the frame that
    # held the group (it is freed where the exception is, on the event loop's thread). Wait until
    # this thread's is the last one, so the destructor runs here whoever lets go of theirs last.
    poll = _RELEASE_POLL_S
    while held and held[0] is not None and sys.getrefcount(held[0]) > _ONLY_OURS:
        time.sleep(poll)
        poll = min(2 * poll, _RELEASE_POLL_MAX_S)
    held.clear()  # the last reference: the destructor (a group's joins gloo's threads) runs here


def let_go_later(held: list[Any], after_s: float = 0.0) -> None:
    """Destroy what ``held`` holds (a process group or a store: the caller's only reference, handed
    over in a list so that no reference stays in the caller's frame) ``after_s`` from now, on a
    short-lived daemon thread, never on the caller's (the event loop's) thread: a group's destructor
    joins gloo's threads, which may wait out a broadcast. Passing the object itself would race: if
    the thread finished first, the caller's own reference would be the last one, and the destructor
    would run on the caller's thread after all. For the same reason the thread keeps its reference
    until every other one (an exception's traceback, say) is gone."""
    if held:
        thread = threading.Thread(
            target=_let_go, args=(held, after_s), name="fastsync-gloo-release", daemon=True
        )
        thread.start()
