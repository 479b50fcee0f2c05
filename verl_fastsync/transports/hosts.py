"""One copy per host (``engine_kwargs.fastsync.hosts=auto``, the default for ``gloo`` and ``nixl``).

verl puts a receiver on every rollout GPU. Sent to each receiver on its own, every byte would cross
an 8-GPU host's link 8 times. Here every byte crosses each host's link about once:

* the rollout ranks that can share memory form a *host* (an identity read from ``/dev/shm``, not the
  hostname: :mod:`verl_fastsync.io.hostid`); a rank that cannot is a host alone (logged once, with
  the reason);
* one rank per host, its *leader*, receives across the network; the hosts form a *chain* (the
  sending trainer rank -> leader of host 0 -> leader of host 1 ...), each leader passing every bucket
  on as soon as it arrived (:mod:`verl_fastsync.transports.hosts_relay`; a tensor larger than the
  bucket as bucket-sized pieces, :mod:`verl_fastsync.transports.hosts_pieces`), as verl's own NIXL
  engine chains its ranks: the trainer's link carries one copy, so does each host's link in and out.
  Each hop passes a bucket on once it has all of it, so a chain of ``H`` hosts costs ``H - 1`` hop
  buckets of latency on top of one model's time; the hops' bucket is ``1/H`` of the bucket
  (:func:`chain_bucket`), so the chain adds less than one bucket's time at any length (a tree would
  halve the depth but send two copies out of a host's link: on links that are the limit, the
  chain is faster from 2 hosts on);
* the leader hands the host's other ranks what arrived through an ``shm`` group (segments in shared
  memory, lent as the ``shm`` transport lends: a tensor stays valid as long as its consumer holds
  it), and its own consumer gets the tensors it received (lent likewise);
* with several senders (``senders``), each lane is one such chain, entering the fleet at a
  different host and, on hosts with a link per GPU, at a different rank of each host: lane ``k``'s
  chain starts at host ``k mod H`` and is led by each host's ``k mod R``-th rank, so ``K`` lanes use
  ``min(K, R)`` rails of every host;
* delta sync: leaders decode (one base per host and lane share), the next host gets the encoded
  stream, the host's ranks the rebuilt tensors.

Groups (:mod:`verl_fastsync.transports.hosts_topology`) are ordinary groups of the wrapped transport
(each with one sender and one receiver) plus one ``shm`` group per host, so everything a transport
does (chunking, ``verify``, lending, timeouts, failure relay) holds on every hop. A failure anywhere
ends every rank's sync with the first cause, naming the rank where it happened (each leader relays
it upstream, onward and to its host's ranks at once). A leader whose onward sends are still running
when its upstream stream ended keeps its own stream open until they end: it fails when they fail.

Cost per rollout rank (per lane): two endpoints of the wrapped transport (one to receive, one to
relay onward) and two ``shm`` endpoints (to fan out, to receive locally), whatever the fleet's size;
a rank joins at most four groups, each of at most its host's ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from verl_fastsync.chunks import AlignSpec, FlushBucket
from verl_fastsync.io.hostid import host_identity
from verl_fastsync.io.lending import DestinationPool
from verl_fastsync.transports.base import (
    EngineTransport,
    EngineTransportFactory,
    PeerAbortedError,
    TransferStats,
    TransportError,
    TransportOptions,
    failure_reason,
    rank_labels,
)
from verl_fastsync.transports.hosts_pieces import Pieces, count_of, split_pieces
from verl_fastsync.transports.hosts_relay import Group, Relay, abort_sender
from verl_fastsync.transports.hosts_topology import HOSTS_KEY, hosts_topology
from verl_fastsync.transports.lanes_plan import is_reserved
from verl_fastsync.transports.shm import ShmTransport

__all__ = ["CHAIN_BUCKET_FLOOR", "HostsFactory", "HostsTransport", "chain_bucket", "supports_hosts"]

logger = logging.getLogger(__name__)
_logged: set[str] = set()

ItemMap = Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]


CHAIN_BUCKET_FLOOR = 2 << 20
"""The hops' bucket is never below 2 MiB (nor above the bucket): each bucket costs a message (and a
gloo broadcast or a NIXL write) whatever its size."""


def chain_bucket(bucket_size: int, hosts: int) -> int:
    """The bucket of the chain's hops (the trainer's to the first host, each leader's to the next)
    for a chain of ``hosts`` hosts: ``1/hosts`` of ``bucket_size``, at least
    :data:`CHAIN_BUCKET_FLOOR`. A host's ``shm`` fan-out keeps ``bucket_size``. Smaller hop buckets
    cost nothing where the link is the limit: 64 MiB at 0.5 Gbit/s over 1 host took the same time
    with 8 and 2 MiB buckets, and 4 hosts x 2 ranks 1.54x, 1.25x and 1.14x the 1 host's time with
    8, 4 and 2 MiB (gloo; nixl 1.81x, 1.23x, 1.14x)."""
    if hosts < 2:
        return bucket_size
    return max(-(-bucket_size // hosts), min(bucket_size, CHAIN_BUCKET_FLOOR))


def supports_hosts(factory: Any) -> bool:
    """Whether the transport can run the host structure (it declares ``one_copy_per_host``: a
    rollout rank may also send, and its groups connect across hosts)."""
    load = getattr(factory, "load", None)
    cls = load() if callable(load) else factory
    return bool(getattr(cls, "one_copy_per_host", False))


class HostsFactory:
    """``factory``'s transport with one copy per host (an engine-transport factory itself, so the
    lanes of several senders compose with it unchanged)."""

    def __init__(self, inner: EngineTransportFactory) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name", "?"))

    @property
    def engine_options(self) -> Mapping[str, Any]:
        options: Mapping[str, Any] = getattr(self.inner, "engine_options", None) or {}
        return options

    def __call__(self, options: TransportOptions) -> HostsTransport:
        return HostsTransport(self.inner, options, trainer=options.is_master)

    def build_topology(
        self, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return hosts_topology(self.inner, ShmTransport, actor_world_size, rollout_world_size, metadata)

    def build_lane_topology(
        self, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]], lane: int
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return hosts_topology(self.inner, ShmTransport, actor_world_size, rollout_world_size, metadata, lane)


class HostsTransport(EngineTransport):
    """One rank's side of a one-copy-per-host sync (see the module docstring)."""

    name = "hosts"

    def __init__(self, factory: EngineTransportFactory, options: TransportOptions, trainer: bool) -> None:
        super().__init__(options)
        self.factory = factory
        self.trainer = trainer
        self.rank: int | None = None
        self.decode_item: ItemMap | None = None
        """Applied by a leader to each received tensor before its host's ranks get it (delta sync)."""
        self.sender: EngineTransport | None = None
        self.up: EngineTransport | None = None
        self.relay: EngineTransport | None = None
        self.fanout: ShmTransport | None = None
        self.local: ShmTransport | None = None
        self.plan: dict[str, Any] = {}
        self.fingerprint: str | None = None
        """Who leads which host in this sync (delta keeps a base per host while it is the same)."""
        self._labels: list[str] = []
        self._stats: TransferStats | None = None
        self._destinations = DestinationPool()
        """Host memory of tensors put back together from pieces (reused once the consumer let go)."""

    @property
    def inner_name(self) -> str:
        return str(getattr(self.factory, "name", "?"))

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        if self.trainer:
            if self.sender is None:
                self.sender = self.factory(self.options)
            return self.sender.prepare()
        key, why = host_identity()
        if key is None and why not in _logged:
            _logged.add(why)
            logger.warning(
                "fastsync hosts: this rank shares memory with no other (%s): it is a host alone", why
            )
        self._make_sides()
        assert self.up is not None and self.relay is not None
        assert self.fanout is not None and self.local is not None
        return {
            HOSTS_KEY: {
                "key": key,
                "why": why,
                "up": self.up.prepare(),
                "relay": self.relay.prepare(),
                "fanout": self.fanout.prepare(),
                "local": self.local.prepare(),
            }
        }

    def _make_sides(self) -> None:
        """A rollout rank's four transports (kept from sync to sync: their endpoints persist)."""
        if self.up is not None:
            return
        host_side = dataclasses.replace(self.options, device="cpu", zero_copy=False)
        local = dataclasses.replace(self.options, extra={})
        self.up = self.factory(dataclasses.replace(host_side, is_master=False))
        self.relay = self.factory(dataclasses.replace(host_side, is_master=True))
        self.fanout = ShmTransport(dataclasses.replace(local, is_master=True, device="cpu"))
        self.local = ShmTransport(dataclasses.replace(local, is_master=False))

    @classmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        raise TransportError("HostsTransport: use HostsFactory(factory).build_topology")

    def buffer_device(self) -> str:
        return "cpu" if not self.trainer else str(getattr(self.sender, "buffer_device", lambda: "cpu")())

    def _groups(self, size: int) -> list[tuple[str, EngineTransport, dict[str, Any], list[int]]]:
        plan = self.plan
        wanted = [
            ("direct", self.up, "up_fleet"),
            ("up", self.up, "up_fleet"),
            ("down", self.relay, "down_fleet"),
            ("fanout", self.fanout, "local_fleet"),
            ("local", self.local, "local_fleet"),
        ]
        groups = []
        hop = chain_bucket(size, int(plan.get("chain", 1)))
        for what, transport, fleet_key in wanted:
            if what in plan and transport is not None:
                fleet = [int(f) for f in plan[fleet_key]]
                bucket = hop if what in ("up", "down") else size
                kwargs = dict(plan[what], bucket_size=bucket, rank_labels=self._group_labels(fleet))
                groups.append((what, transport, kwargs, fleet))
        return groups

    def _group_labels(self, fleet: list[int]) -> list[str]:
        # the group's own ranks, then the whole fleet (relayed causes name any rank of it)
        return [self._labels[f] for f in fleet] + self._labels

    def init_process_group(self, **kwargs: Any) -> None:
        self.rank = int(kwargs["rank"])
        size = kwargs.get("bucket_size")
        labels = kwargs.get("rank_labels")
        world = int(kwargs.get("world_size", 1))
        fleet_labels = [str(x) for x in labels] if isinstance(labels, list | tuple) else None
        self._labels = fleet_labels or rank_labels(world - 1)
        plan = kwargs.get("hosts_plan")
        if self.trainer:
            assert self.sender is not None
            if isinstance(plan, dict) and "down" in plan:
                fleet = [int(f) for f in plan["down_fleet"]]
                bucket = chain_bucket(int(size), int(plan.get("chain", 1))) if size is not None else None
                self.sender.init_process_group(
                    **dict(plan["down"], bucket_size=bucket, rank_labels=self._group_labels(fleet))
                )
            return
        if not isinstance(plan, dict):
            raise TransportError(
                "fastsync hosts: a rollout rank needs its hosts_plan (HostsFactory's topology)"
            )
        self._make_sides()  # a lane's transport made at its first sync receives directly
        self.plan = plan
        self.fingerprint = str(plan.get("fingerprint"))
        groups = self._groups(int(size) if size is not None else 0)
        used = [transport for _what, transport, _kwargs, _fleet in groups]
        for side in (self.up, self.relay):  # e.g. a host's reader that received directly before
            if side is not None and not any(side is transport for transport in used):
                side.let_go_of_peers()
        self._join(groups)

    def _join(self, groups: list[tuple[str, EngineTransport, dict[str, Any], list[int]]]) -> None:
        """Join every group at once (a sender's handshake waits for its receivers' hellos, which
        may be waiting in theirs); when one fails, the others hear the cause."""
        me = self._me()

        def join(index: int) -> BaseException | None:
            _what, transport, kwargs, _fleet = groups[index]
            try:
                transport.init_process_group(**kwargs)
            except BaseException as exc:
                return exc
            return None

        with ThreadPoolExecutor(max_workers=max(1, len(groups)), thread_name_prefix="fastsync-hosts") as pool:
            errors = list(pool.map(join, range(len(groups))))
        failed = [i for i, exc in enumerate(errors) if exc is not None]
        if not failed:
            return
        exc = errors[failed[0]]
        assert exc is not None
        for index in failed:
            logger.warning(
                "fastsync hosts: %s could not join its %s group: %r", me, groups[index][0], errors[index]
            )
        if isinstance(exc, PeerAbortedError):
            reason = str(exc)
        else:
            reason = f"{me} could not join its {groups[failed[0]][0]} group: {failure_reason(exc)}"
        _abort_groups([g for g, error in zip(groups, errors, strict=True) if error is None], reason)
        raise TransportError(reason) from exc

    def finalize(self) -> None:
        for transport in (self.sender, self.up, self.relay, self.fanout, self.local):
            if transport is not None:
                transport.finalize()
        self.rank = None

    @property
    def last_stats(self) -> TransferStats | None:
        if self.trainer:
            return self.sender.last_stats if self.sender is not None else None
        return self._stats

    def abort_receive(self, reason: str) -> None:
        """Fail this rank's part of the sync before its stream started: every group hears it."""
        _abort_groups(self._groups(0), reason)

    # -- data --------------------------------------------------------------------------------

    @property
    def bucket_size(self) -> int:
        """The sending rank's bucket size in this sync (0 before it joined)."""
        return int(getattr(self.sender, "bucket_size", 0) or 0)

    async def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor] | FlushBucket]
        | AsyncIterable[tuple[str, torch.Tensor] | FlushBucket],
        *,
        align: AlignSpec = None,
    ) -> TransferStats:
        """The sending trainer rank's hop to the first host (``FLUSH_BUCKET`` among the items posts
        the open bucket, as with the built-in transports); a tensor larger than the bucket goes as
        bucket-sized pieces (:mod:`~verl_fastsync.transports.hosts_pieces`)."""
        if not self.trainer or self.sender is None:
            raise TransportError("fastsync hosts: send() on a rollout rank")
        size = self.bucket_size
        if size < 1:
            return await self.sender.send(named_tensors, align=align)  # type: ignore[arg-type]
        counts = [0]
        stats = await self.sender.send(split_pieces(named_tensors, size, counts), align=align)  # type: ignore[arg-type]
        return dataclasses.replace(stats, tensors=counts[0])

    async def receive(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.trainer or self.rank is None or self.rank < 1:
            raise TransportError(f"fastsync hosts: receive() on rank {self.rank}; only rollout ranks receive")
        self._stats = None
        plan = self.plan
        pieces: Pieces | None
        if "up" in plan and self.up is not None:
            onward = []
            if "down" in plan and self.relay is not None:
                onward.append(Group(self.relay, [int(f) for f in plan["down_fleet"]], "down"))
            if "fanout" in plan and self.fanout is not None:
                onward.append(Group(self.fanout, [int(f) for f in plan["local_fleet"]], "fanout"))
            up = Group(self.up, [int(f) for f in plan["up_fleet"]], "up")
            size = getattr(self.up, "bucket_size", 0) or 1
            options = self.options
            pieces = Pieces(self._me(), self._destinations.allocate)
            relay = Relay(
                up, onward, self.rank, self.decode_item, options.device, 2 * size, options.timeout_s, pieces
            )
            stream: AsyncGenerator[tuple[str, torch.Tensor], None] = relay.stream()
            source: EngineTransport = self.up
            decode = None
            assemble: Pieces | None = None
        else:
            direct = "direct" in plan and self.up is not None
            source = self.up if direct else self.local  # type: ignore[assignment]
            if source is None:
                raise TransportError("fastsync hosts: this rank joined no group")
            stream = source.receive()  # type: ignore[assignment]
            decode = self.decode_item if direct else None
            # pieces come from the trainer, or from the leader's fan-out as they arrived there
            pieces = assemble = Pieces(self._me(), self._destinations.allocate)
        async for name, tensor in stream:
            if assemble is not None:
                try:
                    whole = assemble.feed(name, tensor)
                except Exception as exc:
                    await stream.athrow(exc)
                    raise
                del tensor
                if whole is None:
                    continue
                name, tensor = whole
                del whole
            if decode is not None and not is_reserved(name):
                try:
                    name, tensor = decode(name, tensor)
                except Exception as exc:
                    await stream.athrow(exc)
                    raise
            if decode is not None and tensor.device != torch.device(self.options.device):
                tensor = tensor.to(self.options.device)  # a direct receiver's buffers are host memory
            item = (name, tensor)
            del tensor
            try:
                yield item
            except BaseException as exc:
                # thrown in by whoever drives this stream (the consumer failed or stopped): the
                # stream below takes it down its own failure path, which tells every other rank
                with contextlib.suppress(BaseException):
                    if isinstance(exc, GeneratorExit):
                        await stream.aclose()
                    else:
                        await stream.athrow(exc)
                raise
            del item
        if assemble is not None:
            assemble.finish()
        self._stats = count_of(source.last_stats, pieces)

    def _me(self) -> str:
        return self._labels[self.rank] if self.rank is not None and self.rank < len(self._labels) else "?"


def _abort_groups(groups: list[tuple[str, EngineTransport, dict[str, Any], list[int]]], reason: str) -> None:
    """Tell every group this rank joined that its sync failed: as the sender where it sends onward,
    through its receive side elsewhere."""
    for what, transport, _kwargs, _fleet in groups:
        if what in ("down", "fanout"):
            abort_sender(transport, reason)
        else:
            abort = getattr(transport, "abort_receive", None)
            if callable(abort):
                abort(reason)
