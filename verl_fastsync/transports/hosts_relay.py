"""A host leader's relay (:mod:`verl_fastsync.transports.hosts`): what arrives from upstream goes on to
the next host as it arrived (a piece of a large tensor at once, a delta still encoded), to the host's
other ranks through shared memory (a piece at once too; a delta decoded, so whole) and to this rank's
own consumer (whole), bucket by bucket.

The two onward sends run on threads of their own, each fed by a :class:`Feed` that holds at most a
bounded number of bytes: the upstream stream is read as fast as the slowest of the three takes
items, so no side waits on another longer than that bound. A feed that runs dry posts its open
bucket at once (``FLUSH_BUCKET``): onward buckets follow the upstream ones instead of waiting to fill.

Failures: whatever fails first (the upstream sender, an onward receiver, this rank's consumer) ends
the other two at once with the same cause and the fleet rank where it happened; each group's
``rank_labels`` list the whole fleet after its own ranks, so an origin travels as
``len(group) + fleet rank`` and every rank names the same rank.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from verl_fastsync.chunks import FLUSH_BUCKET, FlushBucket
from verl_fastsync.transports.base import (
    ConsumerError,
    EngineTransport,
    PeerAbortedError,
    TransferStats,
    TransportError,
    failure_reason,
)
from verl_fastsync.transports.hosts_pieces import Pieces, is_piece
from verl_fastsync.transports.lanes_plan import is_reserved
from verl_fastsync.wire import Abort

__all__ = ["Feed", "Group", "Relay", "abort_sender"]

Item = tuple[str, torch.Tensor]
ItemMap = Callable[[str, torch.Tensor], Item]


class Feed:
    """Items from the relay (on its event loop) to one sender's thread, at most ``limit`` bytes
    queued (one item always fits); ends when the relay ends it or fails it."""

    def __init__(self, limit: int) -> None:
        self._items: collections.deque[tuple[Item, int]] = collections.deque()
        self._bytes = 0
        self._limit = max(1, limit)
        self._cv = threading.Condition()
        self._ended = False
        self._error: BaseException | None = None
        self._group: Group | None = None
        self._send: asyncio.Future[TransferStats] | None = None

    def watch(self, group: Group, send: asyncio.Future[TransferStats]) -> None:
        """The send this feed feeds: a put while it has failed raises its error."""
        self._group, self._send = group, send

    async def put(self, item: Item) -> None:
        nbytes = item[1].numel() * item[1].element_size()
        while True:
            send = self._send
            if send is not None and send.done() and self._group is not None:
                raise _SendFailed(self._group, send.exception() or TransportError("the send ended early"))
            with self._cv:
                if self._error is not None:
                    return
                if not self._items or self._bytes + nbytes <= self._limit:
                    self._items.append((item, nbytes))
                    self._bytes += nbytes
                    self._cv.notify_all()
                    return
            await asyncio.sleep(0.002)  # full: the sender is behind (rare; the link is the limit)

    def end(self) -> None:
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = error
            self._items.clear()
            self._bytes = 0
            self._cv.notify_all()

    def items(self) -> Iterator[Item | FlushBucket]:
        """What the sender's ``send`` iterates (on its thread)."""
        flushed = True
        while True:
            with self._cv:
                while not self._items and not self._ended and self._error is None and flushed:
                    self._cv.wait(1.0)
                if self._error is not None:
                    raise self._error
                entry = None
                if self._items:
                    entry = self._items.popleft()
                    self._bytes -= entry[1]
                elif self._ended:
                    return
            if entry is None:
                flushed = True  # nothing to pack now: post what is packed
                yield FLUSH_BUCKET
                continue
            flushed = False
            item = entry[0]
            del entry
            yield item
            del item


@dataclass
class Group:
    """One group this rank takes part in: its transport and the fleet rank of each member."""

    transport: EngineTransport
    fleet: list[int]
    what: str

    def origin_in(self, fleet_rank: int) -> int:
        """The transfer rank naming ``fleet_rank`` in this group (the fleet follows the members)."""
        return len(self.fleet) + fleet_rank

    def fleet_of(self, origin: int | None, default: int) -> int:
        if origin is None or origin < 0:
            return default
        return self.fleet[origin] if origin < len(self.fleet) else origin - len(self.fleet)


def abort_sender(transport: EngineTransport, reason: str, origin: int | None = None) -> None:
    """Best effort: tell the receivers of a joined sender's group that the sync failed."""
    post = getattr(transport, "_post_abort", None)
    with contextlib.suppress(Exception):
        if callable(post):
            post(Abort(reason=reason, rank=0 if origin is None else origin))
    close = getattr(transport, "_safe_close", None)
    if callable(close):
        close()


class _SendFailed(Exception):
    def __init__(self, group: Group, error: BaseException) -> None:
        super().__init__(str(error))
        self.group, self.error = group, error


class Relay:
    """One leader's part of one sync (see the module docstring)."""

    def __init__(
        self,
        up: Group,
        onward: list[Group],
        me: int,
        decode: ItemMap | None,
        device: str,
        feed_limit: int,
        timeout_s: float,
        pieces: Pieces,
    ) -> None:
        self.up, self.onward, self.me = up, onward, me
        self.pieces = pieces
        self.decode, self.device = decode, torch.device(device)
        # a feed holds two of its sender's buckets: the next host's hop buckets, the host's buckets
        self.feeds = [Feed(max(feed_limit, 2 * _bucket_of(group.transport))) for group in onward]
        self.timeout_s = timeout_s
        self.stats: list[TransferStats | None] = [None] * len(onward)

    async def stream(self) -> AsyncGenerator[Item, None]:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.onward)), "fastsync-relay")
        sends = [
            asyncio.wrap_future(pool.submit(_run_send, group.transport, feed), loop=loop)
            for group, feed in zip(self.onward, self.feeds, strict=True)
        ]
        for group, feed, send in zip(self.onward, self.feeds, sends, strict=True):
            feed.watch(group, send)
        up_stream = self.up.transport.receive()
        assert isinstance(up_stream, AsyncGenerator)
        yielded = 0
        upcoming: asyncio.Future[Item] | None = None  # the upstream's next item, while it is awaited
        from_up = False
        try:
            while True:
                # wait for the next item and for the onward sends at once: a receiver that fails
                # onward ends the sync now, not when the next bucket arrives
                upcoming = asyncio.ensure_future(up_stream.__anext__())
                waited: list[asyncio.Future[Any]] = [upcoming, *sends]
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                self._check(sends)
                if not upcoming.done():  # a send ended cleanly before its feed did: cannot happen
                    raise TransportError("fastsync hosts: an onward send ended before the relay did")
                from_up = True
                try:
                    name, tensor = upcoming.result()
                except StopAsyncIteration:
                    upcoming = None
                    self.pieces.finish()
                    break
                from_up, upcoming = False, None
                # a piece goes onward at once: a hop costs one bucket, not one tensor; to the host's
                # ranks too unless a delta must be decoded whole first (each rank puts it together)
                piece = is_piece(name) and self.decode is None
                for group, feed in zip(self.onward, self.feeds, strict=True):
                    if group.what == "down" or (piece and group.what == "fanout"):
                        await feed.put((name, tensor))  # a delta still encoded to the next host
                whole = self.pieces.feed(name, tensor)
                del tensor
                if whole is None:
                    continue
                name, tensor = whole
                del whole
                if self.decode is not None and not is_reserved(name):
                    name, tensor = self.decode(name, tensor)
                for group, feed in zip(self.onward, self.feeds, strict=True):
                    if group.what == "fanout" and not piece:
                        await feed.put((name, tensor))
                out = (name, tensor if tensor.device == self.device else tensor.to(self.device))
                del tensor
                yield out
                del out
                yielded += 1
            for feed in self.feeds:
                feed.end()
            for index, send in enumerate(sends):
                try:
                    self.stats[index] = await send
                except BaseException as exc:
                    raise _SendFailed(self.onward[index], exc) from exc
        except BaseException as exc:
            await self._fail(exc, up_stream, sends, upcoming, from_up, yielded)
            if isinstance(exc, _SendFailed):
                raise exc.error from None
            raise
        finally:
            pool.shutdown(wait=False)

    def _check(self, sends: list[asyncio.Future[TransferStats]]) -> None:
        for group, send in zip(self.onward, sends, strict=True):
            if send.done():
                error = send.exception()
                if error is not None:
                    raise _SendFailed(group, error)

    async def _fail(
        self,
        exc: BaseException,
        up_stream: AsyncGenerator[Item, None],
        sends: list[asyncio.Future[TransferStats]],
        upcoming: asyncio.Future[Item] | None,
        from_up: bool,
        yielded: int,
    ) -> None:
        """End every other part of the sync with the first cause and where it happened."""
        failed: Group | None = None
        error = exc
        if isinstance(exc, _SendFailed):
            failed, error = exc.group, exc.error
        if isinstance(error, PeerAbortedError) and error.cause is not None:
            source = failed or self.up
            origin, cause = source.fleet_of(error.origin, self.me), error.cause
        elif failed is not None or from_up:
            origin, cause = self.me, failure_reason(error)
        else:
            origin, cause = self.me, failure_reason(error, yielded)
        for group, feed in zip(self.onward, self.feeds, strict=True):
            if group is not failed:
                feed.fail(PeerAbortedError(cause, group.origin_in(origin), cause))
        if not from_up:
            # the upstream sender hears the first cause and where it happened (its stream would
            # name this rank), then the stream ends: cancelled mid-wait or thrown into at its yield
            post = getattr(self.up.transport, "_post_abort", None)
            with contextlib.suppress(Exception):
                if callable(post):
                    post(Abort(reason=cause, rank=self.up.origin_in(origin)))
            relayed = PeerAbortedError(cause, self.up.origin_in(origin), cause)
            if upcoming is not None and not upcoming.done():
                upcoming.cancel(msg=ConsumerError(cause))
                with contextlib.suppress(BaseException):
                    await upcoming
            else:
                with contextlib.suppress(BaseException):
                    await up_stream.athrow(relayed)
        for send in sends:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(send), self.timeout_s)


def _bucket_of(transport: EngineTransport) -> int:
    return int(getattr(transport, "bucket_size", 0) or 0)


def _run_send(transport: EngineTransport, feed: Feed) -> TransferStats:
    # a built-in sender takes FLUSH_BUCKET among the items (SendingTransport.send)
    return asyncio.run(transport.send(feed.items()))  # type: ignore[arg-type]
