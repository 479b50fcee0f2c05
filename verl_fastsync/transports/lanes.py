"""Several trainer ranks send at once (``engine_kwargs.fastsync.senders``): one lane per sending rank.

A *lane* is an ordinary single-sender engine transport group (shm, gloo, nixl, nccl or a third-party
one, unchanged): sending trainer rank ``s`` is rank 0 of lane ``j``'s group and every rollout rank a
receiver in it. :class:`LanesTransport` presents ``K`` lanes as one
:class:`~verl_fastsync.transports.base.EngineTransport` to the engine:

* ``prepare``: a trainer rank prepares one transport as a *potential* sender (it cannot know yet
  whether it will send); a rollout rank reports the metadata of each lane transport it holds, plus
  that of a fresh one for lanes it does not hold yet.
* :func:`lanes_topology` (the driver): picks the sending ranks
  (:func:`~verl_fastsync.transports.lanes_plan.choose_senders`), builds each lane's topology with the
  transport's own ``build_topology`` (1 sender + every rollout rank).
* ``send``: every sending rank walks the whole weight sequence, keeps the tensors the shared plan gives
  its lane (:class:`~verl_fastsync.transports.lanes_plan.LanePlan`), drops the others at once, and ends
  its lane with the manifest. Trainer ranks that do not send walk the sequence and send nothing.
* ``receive``: a rollout rank iterates its ``K`` lane streams concurrently and yields each tensor as
  soon as one lane completes it (exactly once; in arrival order, not producer order). A tensor handed
  out stays valid as the lane's transport says (lending receivers: as long as the consumer holds it).
* Failure: a lane that fails (its sender aborted with a reason, timed out, or broke the plan) fails
  the stream with an error naming the sender trainer rank; every other lane still running is closed
  with that reason, so its sender fails too, with it. A sender whose lane had already ended returns
  normally (its bytes all arrived); the sync fails on the rollout ranks and on the failing sender.
  Trainer ranks that disagree about the weights fail the sync naming the first difference and both
  ranks (:class:`~verl_fastsync.transports.lanes_plan.LaneTally`).
* Joining: a rollout rank joins its lanes concurrently (a lane whose join fails does not keep the
  others waiting for its hello); when one fails it aborts every lane with the cause, naming itself
  and the lane, so the senders learn it from the lanes' own abort path.
* Names: each lane's ``rank_labels`` name its sender "trainer rank s (lane k)" and the receivers
  "rollout rank j" (verl's ranks), so every lane transport's errors name verl's ranks.

Memory: a rollout rank holds each lane's buckets; a sender holds one lane's. ``bucket_bytes=auto``
sizes a lane's bucket from its share of the model, so the ``K`` lanes of a rollout rank hold about
what one sender's buckets take (:func:`verl_fastsync.verl.engine.resolve_auto_bucket_size`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch

from verl_fastsync.chunks import FLUSH_BUCKET, AlignSpec, FlushBucket
from verl_fastsync.transports.base import (
    ConsumerError,
    EngineTransport,
    EngineTransportFactory,
    PeerAbortedError,
    TransferStats,
    TransportError,
    TransportOptions,
    failure_reason,
    rank_labels,
)
from verl_fastsync.transports.hosts import HostsTransport
from verl_fastsync.transports.lanes_plan import (
    DESCRIPTIONS_NAME,
    MANIFEST_NAME,
    LanePlan,
    LaneTally,
    choose_senders,
    is_reserved,
    manifest_tensor,
    read_descriptions,
    read_manifest,
    tensor_nbytes,
)
from verl_fastsync.transports.sending import SendingTransport, aiter_items, delta_flush_bytes

__all__ = ["LanesTransport", "lane_label", "lanes_topology"]

ItemMap = Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]


def lane_label(sender: int, lane: int) -> str:
    """verl's name of a lane's sender."""
    return f"trainer rank {sender} (lane {lane})"


def lanes_topology(
    factory: EngineTransportFactory,
    senders: int | None,
    actor_world_size: int,
    rollout_world_size: int,
    metadata: list[dict[str, Any]],
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Per-rank ``init_process_group`` kwargs of a multi-sender sync from every rank's
    :meth:`LanesTransport.prepare` (actor ranks first). Each lane's own kwargs come from the
    transport's ``build_topology`` with one actor rank (its sender)."""
    actor_meta, rollout_meta = metadata[:actor_world_size], metadata[actor_world_size:]
    for rank, meta in enumerate(actor_meta):
        if not isinstance(meta.get("sender"), dict):
            raise TransportError(
                f"fastsync senders: trainer rank {rank} did not prepare as a sender (was it constructed "
                "with is_master=True/False, as verl's trainer does?)"
            )
    for rank, meta in enumerate(rollout_meta):
        if not isinstance(meta.get("fresh"), dict):
            raise TransportError(f"fastsync senders: rollout rank {rank} did not prepare as a receiver")
    chosen = choose_senders([str(m["sender"].get("host", "")) for m in actor_meta], senders)
    world = 1 + rollout_world_size
    actor: dict[str, list[Any]] = {
        "rank": [0 if rank in chosen else -1 for rank in range(actor_world_size)],
        "world_size": [world] * actor_world_size,
        "role": ["trainer"] * actor_world_size,
        "bucket_size": [None] * actor_world_size,
        "lane": [chosen.index(rank) if rank in chosen else -1 for rank in range(actor_world_size)],
        "lane_kwargs": [None] * actor_world_size,
        "lane_senders": [list(chosen) for _ in range(actor_world_size)],
    }
    rollout: dict[str, list[Any]] = {
        "rank": list(range(1, world)),
        "world_size": [world] * rollout_world_size,
        "role": ["rollout"] * rollout_world_size,
        "bucket_size": [None] * rollout_world_size,
        "lane": [-1] * rollout_world_size,
        "lane_kwargs": [[] for _ in range(rollout_world_size)],
        "lane_senders": [list(chosen) for _ in range(rollout_world_size)],
    }
    for lane, sender in enumerate(chosen):
        lane_meta = [actor_meta[sender]["sender"]]
        for meta in rollout_meta:
            held = meta.get("lanes") or []
            # a lane this rank holds no transport of yet gets a fresh one's metadata (its endpoints
            # closed again: it can only receive directly, which the hosts layer reads from "fresh")
            lane_meta.append(held[lane] if lane < len(held) else dict(meta["fresh"], fresh=True))
        build_lane = getattr(factory, "build_lane_topology", None)
        if callable(build_lane):  # the hosts layer: each lane's chain enters at another host and rail
            lane_actor, lane_rollout = build_lane(1, rollout_world_size, lane_meta, lane)
        else:
            lane_actor, lane_rollout = factory.build_topology(1, rollout_world_size, lane_meta)
        labels = rank_labels(rollout_world_size, sender=lane_label(sender, lane))
        lane_actor["rank_labels"] = [labels]
        lane_rollout["rank_labels"] = [labels] * rollout_world_size
        actor["lane_kwargs"][sender] = {key: values[0] for key, values in lane_actor.items()}
        for index in range(rollout_world_size):
            rollout["lane_kwargs"][index].append({key: values[index] for key, values in lane_rollout.items()})
    return actor, rollout


def _as_generator(
    stream: AsyncIterator[tuple[str, torch.Tensor]],
) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    """A lane's receive stream (the built-in transports' are async generators already)."""
    if isinstance(stream, AsyncGenerator):
        return stream
    return aiter_items(stream)


def _is_control(future: asyncio.Future[Any]) -> bool:
    """A lane's finished ``__anext__`` holds something other than a weight (a description record,
    the manifest, the end or an error)."""
    if future.cancelled() or future.exception() is not None:
        return True
    return is_reserved(str(future.result()[0]))


def _lane_error(exc: BaseException, label: str) -> BaseException:
    """``exc`` of a lane, naming its sender (same exception class where it takes a message)."""
    if isinstance(exc, TransportError):
        try:
            wrapped = type(exc)(f"{label}: {exc}")
        except TypeError:  # pragma: no cover - a third-party subclass with another signature
            wrapped = TransportError(f"{label}: {exc}")
        return wrapped
    return TransportError(f"{label}: {failure_reason(exc)}")


class LanesTransport(EngineTransport):
    """``K`` single-sender lanes as one engine transport (see the module docstring).

    :param factory: the lanes' transport (what ``engine_kwargs.fastsync.transport`` names).
    :param trainer: this rank is a trainer rank (verl passes ``is_master`` to trainer engines only).
    """

    name = "lanes"

    def __init__(self, factory: EngineTransportFactory, options: TransportOptions, trainer: bool) -> None:
        super().__init__(options)
        self.factory = factory
        self.trainer = trainer
        self.lane_options = dataclasses.replace(options, is_master=True) if trainer else options
        self.lanes: list[EngineTransport] = []
        self.rank: int | None = None
        self.lane = -1
        self.senders: list[int] = []
        self.model_bytes: int | None = None
        """Bytes of the whole sync (every lane) the last time this rank sent."""
        self.encode_item: ItemMap | None = None
        """Applied to each tensor of this sender's share after the plan placed it (delta sync)."""
        self.decode_item: ItemMap | None = None
        """Applied to each received tensor before the exactly-once tally (delta sync)."""
        self._stats: TransferStats | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        if self.trainer:
            if not self.lanes:
                self.lanes.append(self.factory(self.lane_options))
            return {"sender": self.lanes[0].prepare()}
        fresh = self.factory(self.lane_options)
        try:
            fresh_meta = fresh.prepare()
        finally:
            fresh.finalize()
        return {"lanes": [lane.prepare() for lane in self.lanes], "fresh": fresh_meta}

    @classmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        raise TransportError("LanesTransport: use lanes_topology(factory, senders, ...) (it needs both)")

    def buffer_device(self) -> str:
        """Where a lane's buffers live (a device transport's accelerator, from the first sync on: a
        rollout rank that holds no lane yet asks a fresh one)."""
        probe = self.lanes[0] if self.lanes else self.factory(self.lane_options)
        try:
            device = getattr(probe, "buffer_device", None)
            return str(device()) if callable(device) else self.options.device
        finally:
            if not self.lanes:
                probe.finalize()

    def init_process_group(self, **kwargs: Any) -> None:
        self.rank = int(kwargs["rank"])
        self.lane = int(kwargs.get("lane", -1))
        self.senders = [int(rank) for rank in kwargs.get("lane_senders") or []]
        size = kwargs.get("bucket_size")
        lane_kwargs = kwargs.get("lane_kwargs")
        if self.trainer:
            if self.lane >= 0 and isinstance(lane_kwargs, dict):
                self.lanes[0].init_process_group(**dict(lane_kwargs, bucket_size=size))
            return
        if not isinstance(lane_kwargs, list) or len(lane_kwargs) != len(self.senders):
            raise TransportError("fastsync senders: a rollout rank needs one lane_kwargs per sender")
        while len(self.lanes) < len(lane_kwargs):
            self.lanes.append(self.factory(self.lane_options))
        for extra in self.lanes[len(lane_kwargs) :]:
            extra.finalize()
        del self.lanes[len(lane_kwargs) :]
        self._join([dict(lane_kw, bucket_size=size) for lane_kw in lane_kwargs], kwargs.get("rank_labels"))

    def _join(self, lane_kwargs: list[dict[str, Any]], labels: Any) -> None:
        """Join every lane at once (one thread each: a lane's handshake waits for every receiver's
        hello, and a lane that cannot be joined must not keep this rank from saying hello on the
        others). If one fails, every lane is aborted with the first cause, naming this rollout rank
        and the lane: the joined ones through their transport, the others through their group's
        handshake (``abort_join``)."""
        me = self._me(labels)

        def join(lane: int) -> BaseException | None:
            try:
                self.lanes[lane].init_process_group(**lane_kwargs[lane])
            except BaseException as exc:
                return exc
            return None

        # lanes over the hosts join one after the other, in lane order on every rank (no rank waits on
        # a later lane of another): two lanes' shm groups joined at once between the same two ranks,
        # in opposite directions, lost their connections in the handshake under load
        workers = 1 if getattr(self.factory, "build_lane_topology", None) else len(self.lanes)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastsync-lanes") as pool:
            errors = list(pool.map(join, range(len(self.lanes))))
        failed = [lane for lane, exc in enumerate(errors) if exc is not None]
        if not failed:
            return
        lane = failed[0]
        exc = errors[lane]
        assert exc is not None
        reason = f"{me} could not join {self._label(lane)}: {failure_reason(exc)}"
        for other, error in enumerate(errors):  # the lanes it never joined hear it from their handshake
            abort_join = getattr(self.lanes[other], "abort_join", None)
            if error is not None and not isinstance(error, PeerAbortedError) and callable(abort_join):
                abort_join(reason, **lane_kwargs[other])
        self.abort_receive(reason)
        raise TransportError(reason) from exc

    def _me(self, labels: Any = None) -> str:
        """verl's name of this rank ("rollout rank j"; the topology's label where it gave one)."""
        rank = self.rank if self.rank is not None else 0
        if isinstance(labels, list | tuple) and 0 <= rank < len(labels):
            return str(labels[rank])
        return f"rollout rank {rank - 1}" if rank >= 1 else f"trainer rank {self.senders[self.lane]}"

    def finalize(self) -> None:
        for transport in self.lanes:
            transport.finalize()

    @property
    def last_stats(self) -> TransferStats | None:
        return self._stats

    def _label(self, lane: int) -> str:
        return lane_label(self.senders[lane], lane)

    @staticmethod
    def _abort_lane(transport: EngineTransport, reason: str) -> None:
        abort = getattr(transport, "abort_receive", None)
        if callable(abort):
            with contextlib.suppress(Exception):
                abort(reason)

    def abort_receive(self, reason: str) -> None:
        """Fail every lane of this rank's sync before its receive stream started."""
        for transport in self.lanes:
            self._abort_lane(transport, reason)

    # -- sending -----------------------------------------------------------------------------

    async def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        *,
        align: AlignSpec = None,
    ) -> TransferStats:
        if self.rank is None or self.rank < 0 or self.lane < 0:
            async for _ in aiter_items(named_tensors):
                pass
            return TransferStats()
        plan = LanePlan(len(self.senders))
        extra = [0, 0]  # bytes and items of this lane's descriptions and manifest (not weights)
        encode = self.encode_item
        transport = self.lanes[0]
        # encoded items are a fraction of the bytes they stand for: a bucket goes out after each
        # quarter bucket of this share's model bytes (see delta_flush_bytes, FLUSH_BUCKET)
        every = (
            delta_flush_bytes(transport.bucket_size)
            if encode is not None and isinstance(transport, SendingTransport | HostsTransport)
            else 0
        )

        # the other lanes' bytes after which this lane's pending descriptions go out at once (a
        # rollout rank holds what it got until every sender described it; see lanes_plan)
        flushes = isinstance(transport, SendingTransport | HostsTransport)  # FLUSH_BUCKET among items
        describe_every = int(getattr(transport, "bucket_size", 0)) if flushes else 0

        async def share() -> AsyncIterator[tuple[str, torch.Tensor] | FlushBucket]:
            since = foreign = 0
            async for name, tensor in aiter_items(named_tensors):
                nbytes = tensor_nbytes(tensor)
                dtype = str(tensor.dtype).removeprefix("torch.")
                mine = plan.assign(name, nbytes, dtype, tensor.shape) == self.lane
                foreign += 0 if mine else nbytes
                if mine or (describe_every and foreign >= describe_every):
                    # what this sender walked up to here (its own tensor last)
                    record = plan.descriptions()
                    if record is not None:
                        extra[0], extra[1] = extra[0] + tensor_nbytes(record[1]), extra[1] + 1
                        yield record
                if mine:
                    yield encode(name, tensor) if encode is not None else (name, tensor)
                    since += nbytes
                    if every and since >= every:
                        since = foreign = 0
                        yield FLUSH_BUCKET
                elif describe_every and foreign >= describe_every:
                    since = foreign = 0
                    yield FLUSH_BUCKET
                del tensor  # not ours, or the transport owns its bytes now
            record = plan.descriptions()
            if record is not None:
                extra[0], extra[1] = extra[0] + tensor_nbytes(record[1]), extra[1] + 1
                yield record
            manifest = manifest_tensor(plan.manifest(self.lane, self.senders[self.lane]))
            extra[0], extra[1] = extra[0] + tensor_nbytes(manifest), extra[1] + 1
            yield MANIFEST_NAME, manifest

        if isinstance(transport, SendingTransport | HostsTransport):
            stats = await transport.send(share(), align=align)
        else:  # (which never flushes: ``every`` is 0)
            stats = await transport.send(cast(AsyncIterator[tuple[str, torch.Tensor]], share()), align=align)
        self.model_bytes = plan.total_bytes
        stats = dataclasses.replace(
            stats, bytes=stats.bytes - extra[0], tensors=max(stats.tensors - extra[1], 0)
        )
        self._stats = stats
        return stats

    # -- receiving ---------------------------------------------------------------------------

    async def receive(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self.trainer or self.rank is None or self.rank < 1 or not self.lanes:
            raise TransportError(
                f"fastsync senders: receive() on rank {self.rank}; only rollout ranks receive"
            )
        who = f"{self.lanes[0].name} transport, rollout rank {self.rank - 1}"
        decode = self.decode_item
        if decode is not None and all(hasattr(lane, "decode_item") for lane in self.lanes):
            for transport in self.lanes:  # the hosts layer decodes on each host's leader (one base a host)
                transport.decode_item = decode  # type: ignore[attr-defined]
            decode = None
        tally = LaneTally(self.senders, who)
        streams = [_as_generator(transport.receive()) for transport in self.lanes]
        pending: dict[int, asyncio.Future[Any]] = {}
        start = time.perf_counter()
        yielded = 0
        failed_lane = -1
        holding = -1  # the lane whose item is out now (its stream is suspended at its yield)
        self._stats = None
        try:
            for lane, stream in enumerate(streams):
                pending[lane] = asyncio.ensure_future(stream.__anext__())
            while pending:
                await asyncio.wait(list(pending.values()), return_when=asyncio.FIRST_COMPLETED)
                # descriptions, manifests and ends first: a tensor is checked against all known
                done = sorted((not _is_control(fut), lane) for lane, fut in pending.items() if fut.done())
                for _data, lane in done:
                    future = pending.pop(lane)
                    try:
                        name, tensor = future.result()
                    except StopAsyncIteration:
                        tally.end(lane)
                        out = tally.release()  # (a lane that walked fewer tensors raises here)
                    except BaseException as exc:
                        failed_lane = lane
                        raise _lane_error(exc, self._label(lane)) from exc
                    else:
                        holding = lane  # its stream is suspended at its yield until resumed below
                        out = []
                        if name == MANIFEST_NAME:
                            tally.manifest(lane, read_manifest(tensor, self._label(lane)))
                        elif name.startswith(DESCRIPTIONS_NAME):
                            tally.describe(lane, read_descriptions(tensor, self._label(lane)))
                            out = tally.release()
                        else:
                            if decode is not None:
                                name, tensor = decode(name, tensor)
                            out = tally.hand_out(tally.take(lane, name, tensor), name, tensor)
                        del tensor  # held (as its own copy where lent) or handed out below
                    while out:
                        item = out.pop(0)
                        yield item
                        yielded += 1
                        del item  # keep nothing the consumer moved on from
                    if holding == lane:
                        pending[lane] = asyncio.ensure_future(streams[lane].__anext__())
                    holding = -1
            tally.finish()
        except BaseException as exc:
            await self._close_lanes(streams, pending, holding, failed_lane, exc, yielded)
            raise
        self._stats = self._merged_stats(tally, time.perf_counter() - start)

    async def _close_lanes(
        self,
        streams: list[AsyncGenerator[tuple[str, torch.Tensor], None]],
        pending: dict[int, asyncio.Future[Any]],
        holding: int,
        failed_lane: int,
        exc: BaseException,
        yielded: int,
    ) -> None:
        """The sync failed (``exc``): close every lane still open with the reason, so each sender
        fails at once with it."""
        # a lane's error already names its sender
        reason = (
            f"the sync failed on another lane: {exc}" if failed_lane >= 0 else failure_reason(exc, yielded)
        )
        if holding >= 0:
            with contextlib.suppress(BaseException):
                await streams[holding].athrow(ConsumerError(reason))
        for lane, future in pending.items():
            if future.done():
                # an item is waiting: the lane's stream is suspended, its failure path takes the reason
                with contextlib.suppress(BaseException):
                    future.result()
                with contextlib.suppress(BaseException):
                    await streams[lane].athrow(ConsumerError(reason))
            else:
                # running: the cancellation carries the reason to the lane's failure path
                future.cancel(msg=ConsumerError(reason))
                with contextlib.suppress(BaseException):
                    await future
        pending.clear()

    def _merged_stats(self, tally: LaneTally, seconds: float) -> TransferStats:
        lane_stats = [s for s in (t.last_stats for t in self.lanes) if s is not None]
        stats = TransferStats(role="receiver", seconds=seconds, tensors=sum(tally.counts))
        stats.bytes = sum(tally.nbytes)
        for lane in lane_stats:
            stats.buckets += lane.buckets
            stats.chunks += lane.chunks
            stats.bucket_size = max(stats.bucket_size, lane.bucket_size)
            stats.buffer_bytes += lane.buffer_bytes
            stats.peak_extra_bytes += lane.peak_extra_bytes
            stats.copied_bytes += lane.copied_bytes
            stats.held_bytes += lane.held_bytes
        return stats
