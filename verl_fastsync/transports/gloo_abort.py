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
* :class:`GroupSockets`: the TCP connections of one group, found when it is built (the sockets the
  build opened whose other end is in a peer's own list of such sockets, exchanged on the store, so an
  unrelated connection opened by another thread meanwhile is never taken for one). Shutting them down
  fails every operation posted on the group at once, on this side (its threads, buffers and sockets
  are free within moments, the group's destructor no longer waits for a receive's timeout) and on
  every peer connected to it (its broadcast fails with "Connection closed by peer": the kernel does
  the same for a process that dies).

A rank that cannot join a group at all never reaches gloo's rendezvous, where the others would wait
out ``timeout_s``: every rank first passes :func:`join_barrier` (reading the channel between short
slices), and the failing rank publishes its cause there with :func:`publish_join_abort`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from verl_fastsync.wire import Abort, decode, encode

__all__ = [
    "AbortChannel",
    "GroupSockets",
    "connected_sockets",
    "join_barrier",
    "let_go_later",
    "publish_join_abort",
]

Endpoint = tuple[str, int]
Link = tuple[Endpoint, Endpoint]  # (this side's address, the peer's address)

_JOIN_POLL_S = 0.05  # a rank waiting for the others to join reads the abort channel this often
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
    return str(address[0]), int(address[1])


def connected_sockets() -> dict[int, Link]:
    """This process's connected TCP sockets: fd -> (local address, peer address)."""
    found: dict[int, Link] = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                found[fd] = (_endpoint(sock.getsockname()), _endpoint(sock.getpeername()))
        except OSError:
            pass  # not connected
        finally:
            sock.close()  # the duplicate only
    return found


class GroupSockets:
    """The connections of one gloo group (see the module docstring), with the peer rank of each."""

    def __init__(self, links: dict[Link, int]) -> None:
        self.links = links

    @classmethod
    def exchange(
        cls,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        opened: dict[int, Link],
        timeout_s: float,
    ) -> GroupSockets:
        """``opened``: the connections that appeared while the group was built (maybe with others).
        Publishes them under ``prefix/<rank>`` and keeps those a peer lists the other way round."""
        store.set(f"{prefix}/{rank}", json.dumps([[*local, *peer] for local, peer in opened.values()]))
        peers = [r for r in range(world_size) if r != rank]
        keys = [f"{prefix}/{r}" for r in peers]
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        mine = set(opened.values())
        links: dict[Link, int] = {}
        for peer, raw in zip(peers, store.multi_get(keys), strict=True):
            for lhost, lport, phost, pport in json.loads(bytes(raw)):
                link = ((str(phost), int(pport)), (str(lhost), int(lport)))  # seen from this side
                if link in mine:
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
        """Shut down every connection of the group still open (matched again by its addresses: a
        number gloo closed may belong to another socket by now). Returns how many."""
        done = 0
        for fd, link in connected_sockets().items():
            if link not in self.links:
                continue
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)  # acts on the socket, shared with gloo's descriptor
                done += 1
            except OSError:
                pass
            finally:
                sock.close()
        self.links = {}
        return done


def _let_go(held: list[Any], after_s: float) -> None:
    time.sleep(after_s)
    held.clear()  # the only reference: the destructor (a group's joins gloo's threads) runs here


def let_go_later(held: list[Any], after_s: float = 0.0) -> None:
    """Destroy what ``held`` holds (a process group or a store: the caller's only reference, handed
    over in a list so that no reference stays in the caller's frame) ``after_s`` from now, on a
    short-lived daemon thread, never on the caller's (the event loop's) thread: a group's destructor
    joins gloo's threads, which may wait out a broadcast. Passing the object itself would race: if
    the thread finished first, the caller's own reference would be the last one, and the destructor
    would run on the caller's thread after all."""
    if held:
        thread = threading.Thread(
            target=_let_go, args=(held, after_s), name="fastsync-gloo-release", daemon=True
        )
        thread.start()
