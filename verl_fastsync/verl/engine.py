"""The ``fastsync`` verl checkpoint engine (trainer rank 0 -> every rollout rank, chunked, bounded
memory). This is the only transport module that imports verl.

Select it with::

    actor_rollout_ref.rollout.checkpoint_engine.backend=fastsync
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.transport=shm   # gloo, nixl, nccl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.bucket_bytes=auto

``engine_kwargs.fastsync`` keys (all optional):

* ``transport`` (default ``"shm"``): an engine transport name from the ``weight_transport`` hook
  (built-ins ``shm``, ``gloo``, ``nixl``, ``nccl``; third-party plugins add more).
* ``bucket_bytes``: overrides verl's ``update_weights_bucket_megabytes``: a positive int (bytes),
  a string with a unit (``"64MiB"``, ``"1GiB"``, ``"512KiB"``) or ``"auto"``. (It cannot be named
  ``bucket_size``: verl already passes ``bucket_size=`` to the constructor.)
  ``auto`` sizes the bucket from the model and from free memory:

  - model: ``model bytes / AUTO_DIVISOR`` (16), clamped to [:data:`AUTO_FLOOR`, :data:`AUTO_CAP`]
    = [16 MiB, 512 MiB]. The model's size is what the trainer sent in the previous sync (every
    lane's share added up); before the first sync it is unknown and :data:`AUTO_FIRST` (64 MiB) is
    used. A 160 MiB model gets 16 MiB buckets, a 2 GiB model 128 MiB, models from 8 GiB up 512 MiB.
  - lanes: with ``K`` senders (``senders``) each lane's bucket is that figure divided by ``K``
    (rounded up to a MiB, at least the floor): a rollout rank holds the buckets of every lane, so
    its ``K`` lanes together take about what one sender's buckets take (a 16 GiB model, 8 senders:
    64 MiB a lane, 8 x 64 MiB = the 512 MiB of one sender).
  - memory: at most :data:`AUTO_FRACTION` (5%) of the smallest free memory among the participating
    ranks (every sending trainer rank and every rollout rank; a rollout rank's free memory divided
    by the ``K`` lanes it holds buckets of, and by 3 more over the hosts: a leader receives, relays
    and fans out), rounded down to a MiB. Free memory is the device's for
    device transports (``nccl``: its buffers live on the accelerator, from the first sync on), host
    ``MemAvailable`` for CPU ones, or what the process's memory cgroup still allows where that is
    less. When that is below the floor, the topology step fails naming the rank.

  Each side holds two buckets a lane for the engine's lifetime (shm keeps its segments between
  syncs).
* ``timeout_s`` (default 600): limit of every blocking wait; on expiry the error names the peer,
  the phase, the bucket index and the tensor in flight.
* ``verify`` (default false): xxhash checksum per chunk, checked by the receiver.
* ``device``: where received tensors are allocated (default ``"cpu"``; the ``nccl`` transport always
  receives on the current accelerator).
* ``zero_copy`` (default false): every received tensor keeps its bytes for as long as the consumer
  holds it (verl's SGLang ``ServerAdapter`` batches tensors before loading them, vLLM loads each at
  once: both are safe). On host memory the shm, gloo and nixl receivers do it without a copy: they
  lend views into the bucket and never refill a bucket the consumer still references. ``true``
  yields tensors carried whole in one chunk as views into the receive bucket, valid only until the
  consumer asks for the next tensor; it saves only the bookkeeping now.
* ``align_experts`` (default false): chunk boundaries of split tensors fall on dim-0 slices (MoE
  experts) when one slice fits a bucket.
* ``senders`` (default 1): how many trainer ranks send; an int or ``"all"``. With more than one,
  each sending rank sends a byte-balanced share on its own lane and every rollout rank merges the
  lanes (:mod:`verl_fastsync.transports.lanes`; the plan and the exactly-once checks:
  :mod:`verl_fastsync.transports.lanes_plan`). verl passes ``is_master`` to trainer engines only, so
  an engine constructed with it (True or False) is a trainer rank and prepares as a possible sender.
* ``hosts`` (default ``"auto"``): one copy per host for transports that declare it (``gloo``,
  ``nixl``): rollout ranks that share ``/dev/shm`` form a host, one rank per host receives across the
  network, hosts are chained bucket by bucket and each host's other ranks read what arrived from
  shared memory (:mod:`verl_fastsync.transports.hosts`; each lane of ``senders`` is its own chain).
  ``"off"``: every rollout rank is its own destination across the network.

* ``delta`` (default false): each tensor is sent as its difference from what was sent in the last
  sync, and every receiver rebuilds the full tensor before yielding it (:mod:`verl_fastsync.delta.stream`).
  The trainer's sending rank and every rollout rank keep the last synced weights in host memory (the
  model's bytes; a sender with several senders its share). A sync diffs only when every side holds
  the same base (compared in ``build_topology``); otherwise, for the first one, it is full
  (``fastsync/transfer/delta_full_syncs`` counts them). A delta sync that fails puts every side's
  base back at the epoch it diffed against (an undo journal of at most an eighth of the base), so
  the next sync diffs again; only a failed sync whose journal was dropped is followed by a full one.
  Receivers yield host tensors. A side whose host cannot hold its base turns delta off for the run
  on every side (:mod:`verl_fastsync.delta.side`; ``fastsync/transfer/delta_off``).

``send_weights`` returns ``fastsync/transfer/*`` metrics (bytes, buckets, chunks, tensors, seconds,
gbps, bucket_size, peak_extra_bytes_sender); the receiver's side is in ``last_metrics`` after
``receive_weights`` ends.

**A rollout failure reaches the trainer at once.** verl's ``CheckpointEngineWorker.update_weights``
hands ``receive_weights()`` to the server adapter and lets the adapter's exception propagate; nothing
closes the receive stream, so the transport could tell the trainer only when a garbage-collection
pass finalized it (the trainer meanwhile waited out ``timeout_s``). The plugin wraps that method
(:mod:`verl_fastsync.verl.adapter`) and calls :meth:`FastsyncCheckpointEngine.end_receive` in a
``finally``: the stream is closed with the consumer's own error as the reason every other rank sees,
or, when the adapter returned before the last tensor, with "the consumer stopped before the end".
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from verl_fastsync.chunks import leading_slice_bytes, validate_bucket_size
from verl_fastsync.config import engine_bucket_size, parse_bucket_bytes
from verl_fastsync.delta.stream import DeltaDecoder, DeltaEncoder
from verl_fastsync.selection import parse_engine_kwargs
from verl_fastsync.transports.base import (
    EngineTransport,
    EngineTransportFactory,
    TransportError,
    TransportOptions,
    consumer_error,
)
from verl_fastsync.transports.hosts import HostsFactory, HostsTransport, supports_hosts
from verl_fastsync.transports.hosts_topology import hosts_layout
from verl_fastsync.transports.lanes import LanesTransport, lanes_topology
from verl_fastsync.transports.sending import SendingTransport, delta_flush_bytes, flush_every
from verl_fastsync.verl.sizing import (
    AUTO_CAP,
    AUTO_DIVISOR,
    AUTO_FIRST,
    AUTO_FLOOR,
    AUTO_FRACTION,
    free_memory_bytes,
    resolve_auto_bucket_size,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_CAP",
    "AUTO_DIVISOR",
    "AUTO_FIRST",
    "AUTO_FLOOR",
    "AUTO_FRACTION",
    "ENGINE_NAME",
    "FastsyncCheckpointEngine",
    "free_memory_bytes",
    "parse_bucket_bytes",
    "register_engine",
    "resolve_auto_bucket_size",
]

ENGINE_NAME = "fastsync"


def _select_factory(name: str) -> EngineTransportFactory:
    from verl_fastsync.plugins import plugin_manager, select_transport

    if not isinstance(name, str) or not name:
        raise ValueError(f"engine_kwargs.fastsync.transport must be a non-empty string, got {name!r}")
    factory: EngineTransportFactory = select_transport(  # type: ignore[assignment]
        plugin_manager(), name, "engine", key="checkpoint_engine.engine_kwargs.fastsync.transport"
    )
    return factory


class _Receiving:
    """One sync's receive side on a rollout rank: its transport stream once started, and whether
    the stream reached its end."""

    __slots__ = ("finished", "stream", "tensors")

    def __init__(self) -> None:
        self.stream: AsyncGenerator[tuple[str, torch.Tensor], None] | None = None
        self.finished = False
        self.tensors = 0


async def _walk(weights: Iterable[Any] | AsyncIterable[Any]) -> None:
    if isinstance(weights, AsyncIterable):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


class FastsyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine ``fastsync``: bucketed, chunked, double-buffered, pluggable transport.

    Constructed by verl as ``new("fastsync", bucket_size=..., [is_master=...], **engine_kwargs["fastsync"])``.
    """

    # 0.9.0+ declares ``wire_format`` on the base class; harmless on 0.7.1/0.8.0.
    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        # the same validation (code and messages) as ``verl-fastsync doctor``
        settings = parse_engine_kwargs(engine_kwargs)
        explicit = engine_bucket_size(settings, bucket_size)
        self.bucket_size: int | None = None if explicit is None else validate_bucket_size(explicit)
        self.is_master = bool(is_master)
        self.transport_name = transport = settings.transport
        self.factory = _select_factory(transport)
        self.options = TransportOptions(
            is_master=self.is_master,
            timeout_s=settings.timeout_s,
            verify=settings.verify,
            device=settings.device,
            zero_copy=settings.zero_copy,
            extra=dict(settings.extra),
        )
        self.align_experts = settings.align_experts
        self.senders = settings.senders
        # one copy per host (hosts=auto) for gloo and nixl, each lane of several senders too
        self.hosts = settings.hosts == "auto" and supports_hosts(self.factory)
        self.transport: EngineTransport
        if self.senders == 1 and self.hosts:
            self.transport = HostsTransport(self.factory, self.options, trainer=is_master is not None)
        elif self.senders == 1:
            self.transport = self.factory(self.options)
        else:
            # verl passes is_master (True or False) to trainer engines only: a trainer rank prepares
            # as a potential sender, the topology picks who sends
            lanes = HostsFactory(self.factory) if self.hosts else self.factory
            self.transport = LanesTransport(lanes, self.options, trainer=is_master is not None)
        self.delta = settings.delta
        self.delta_encoder: DeltaEncoder | None = None
        self.delta_decoder: DeltaDecoder | None = None
        if self.delta:  # verl passes is_master to trainer engines only
            if is_master is not None:
                self.delta_encoder = DeltaEncoder()
            else:
                self.delta_decoder = DeltaDecoder()
        self._delta_plan: tuple[str | None, str, str | None] | None = None
        """This sync's (base epoch to diff against or None for a full sync, the next epoch, why delta
        is off for the run or None)."""
        self.last_metrics: dict[str, float] = {}
        self.model_bytes: int | None = None
        """Bytes trainer rank 0 sent in the last sync (sizes ``bucket_bytes=auto``)."""
        self._receiving: _Receiving | None = None

    # -- verl protocol -----------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        # the transport first: a multi-sender trainer rank makes its lane there, and auto sizes
        # against the memory its buffers live in
        transport_meta = self.transport.prepare()
        return {
            "engine": ENGINE_NAME,
            "transport": self.transport_name,
            "is_master": self.is_master,
            "senders": "all" if self.senders is None else self.senders,
            "hosts": self.hosts,
            "bucket_size": self.bucket_size,
            "free_bytes": free_memory_bytes(self._buffer_device()) if self.bucket_size is None else None,
            "model_bytes": self.model_bytes,
            "delta": {"epoch": self._delta_epoch(), "off": self._delta_off()} if self.delta else None,
            "transport_meta": transport_meta,
        }

    def _delta_epoch(self) -> str | None:
        side = self.delta_encoder or self.delta_decoder
        if side is None:
            return None
        rolled_back = side.rolled_back
        side.settle()  # a failed last sync puts its base back (or leaves none) before it is reported
        if side.rolled_back > rolled_back:
            logger.warning(
                "fastsync: the last sync failed; this %s's delta base is back at epoch %s, the next "
                "sync diffs against it if every side holds it",
                side.role,
                side.epoch,
            )
        return side.epoch

    def _delta_off(self) -> str | None:
        side = self.delta_encoder or self.delta_decoder
        return None if side is None else side.off

    def _buffer_device(self) -> str:
        """Where this rank's bucket buffers live (``auto`` sizes against that memory)."""
        device = getattr(self.transport, "buffer_device", None)
        return str(device()) if callable(device) else self.options.device

    @classmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        if len(metadata) != actor_world_size + rollout_world_size or not metadata:
            raise ValueError(
                f"fastsync build_topology: {len(metadata)} metadata entries for {actor_world_size} actor + "
                f"{rollout_world_size} rollout ranks"
            )
        if not metadata[0].get("is_master"):
            raise TransportError("fastsync: actor rank 0 must be the master (is_master=True)")
        names = {m.get("transport") for m in metadata}
        if len(names) != 1:
            raise ValueError(
                f"fastsync: ranks disagree on engine_kwargs.fastsync.transport: {sorted(map(str, names))}"
            )
        senders = {str(m.get("senders", 1)) for m in metadata}
        if len(senders) != 1:
            raise ValueError(f"fastsync: ranks disagree on engine_kwargs.fastsync.senders: {sorted(senders)}")
        factory = _select_factory(str(names.pop()))
        hosts = {bool(m.get("hosts")) for m in metadata}
        if len(hosts) != 1:
            raise ValueError("fastsync: ranks disagree on engine_kwargs.fastsync.hosts")
        if hosts.pop():
            factory = HostsFactory(factory)
        transport_meta = [m["transport_meta"] for m in metadata]
        lanes = 1
        if senders == {"1"}:
            actor, rollout = factory.build_topology(actor_world_size, rollout_world_size, transport_meta)
        else:
            count = senders.pop()
            number = None if count == "all" else int(count)
            actor, rollout = lanes_topology(
                factory, number, actor_world_size, rollout_world_size, transport_meta
            )
            lanes = len(actor["lane_senders"][0])
        sending = [r for r, lane in enumerate(actor.get("lane", [0])) if lane >= 0]
        participants = [(f"trainer rank {r}", metadata[r], 1) for r in sending]
        # a rollout rank holds the buckets of every lane; a hosts leader three groups' (in, on, fan out)
        held = lanes * (3 if isinstance(factory, HostsFactory) else 1)
        participants += [(f"rollout rank {j}", m, held) for j, m in enumerate(metadata[actor_world_size:])]
        sizes = {m.get("bucket_size") for _, m, _ in participants}
        if len(sizes) != 1:
            raise ValueError(f"fastsync: ranks disagree on the bucket size: {sorted(map(str, sizes))}")
        size = sizes.pop()
        if size is None:
            model_bytes = metadata[0].get("model_bytes")
            size = resolve_auto_bucket_size(
                [(label, int(m["free_bytes"]), held) for label, m, held in participants],
                int(model_bytes) if isinstance(model_bytes, int) else None,
                lanes,
            )
        actor["bucket_size"] = [size] * actor_world_size
        rollout["bucket_size"] = [size] * rollout_world_size
        deltas = {m.get("delta") is not None for m in metadata}
        if len(deltas) != 1:
            raise ValueError("fastsync: ranks disagree on engine_kwargs.fastsync.delta")
        if deltas.pop():
            sides = [(f"trainer rank {r}", metadata[r]["delta"]) for r in sending]
            sides += [(f"rollout rank {r}", m["delta"]) for r, m in enumerate(metadata[actor_world_size:])]
            epochs = {side.get("epoch") for _, side in sides}
            # diff only when every sender and every receiver holds the same base, made with the
            # same hosts leading (one base per host lives on its leader); else a full sync
            layout = hosts_layout(rollout)
            against = epochs.pop() if len(epochs) == 1 else None
            # every rank held a base last time (hosts off, a lane's direct first sync), or the same lead
            before = against.rpartition("@")[2] if against is not None else None
            if before not in (None, "", "direct", layout):
                against = None
            # a side with no room for its base turns delta off for everybody (each drops its base)
            off = next((f"{label}, {side['off']}" for label, side in sides if side.get("off")), None)
            plan = [None if off else against, f"{uuid.uuid4().hex}@{layout}", off]
            actor["delta_plan"] = [plan] * actor_world_size
            rollout["delta_plan"] = [plan] * rollout_world_size
        return actor, rollout

    def init_process_group(self, **kwargs: Any) -> None:
        self._receiving = None
        plan = kwargs.pop("delta_plan", None)
        self._delta_plan = (plan[0], str(plan[1]), plan[2] if len(plan) > 2 else None) if plan else None
        if self.delta and self._delta_plan is None:
            raise TransportError("fastsync: delta=true but the topology carries no delta_plan")
        self.transport.init_process_group(**kwargs)
        rank = kwargs.get("rank")
        if isinstance(rank, int) and rank > 0:
            self._receiving = _Receiving()
        size = kwargs.get("bucket_size")
        if isinstance(size, int) and not isinstance(size, bool):
            self.bucket_size_in_use = size

    def finalize(self) -> None:
        self._receiving = None
        self.transport.finalize()

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        rank = getattr(self.transport, "rank", 0)
        if rank is not None and rank < 0:
            # not part of the transfer group; producing each weight may be collective over the
            # trainer group, so the generator is still walked
            await _walk(weights)
            return {}
        size = getattr(self, "bucket_size_in_use", None) or self.bucket_size
        if size is None:
            raise TransportError("fastsync: send_weights before init_process_group (bucket size unknown)")
        align = (lambda _name, tensor: leading_slice_bytes(tensor)) if self.align_experts else None
        encoder = self.delta_encoder
        flushed = None
        if encoder is not None and self._delta_plan is not None:
            against, following, off = self._delta_plan
            encoder.begin(against, following, off=off)
            if isinstance(self.transport, LanesTransport):
                self.transport.encode_item = encoder.encode  # after the plan: each sender its share
            elif isinstance(self.transport, SendingTransport | HostsTransport):
                # a bucket goes out after each quarter bucket of model bytes: the receivers rebuild
                # one part while this side encodes the next (deltas alone would fill few buckets)
                delta = encoder.stats
                every = delta_flush_bytes(size)
                flushed = flush_every(encoder.stream(weights), every, lambda: delta.model_bytes)
            else:
                weights = encoder.stream(weights)
        if flushed is not None and isinstance(self.transport, SendingTransport | HostsTransport):
            stats = await self.transport.send(flushed, align=align)
        else:
            stats = await self.transport.send(weights, align=align)
        self.model_bytes = getattr(self.transport, "model_bytes", None) or stats.bytes
        self.last_metrics = stats.as_metrics()
        if encoder is not None and self._delta_plan is not None:
            encoder.commit()
            if not isinstance(self.transport, LanesTransport):
                self.model_bytes = encoder.stats.model_bytes
            self.last_metrics.update(encoder.stats.as_metrics(encoder.full_syncs))
        return dict(self.last_metrics)

    async def receive_weights(  # type: ignore[override]
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        receiving = self._receiving
        decoder = self.delta_decoder if self._delta_plan is not None else None
        decode = None
        if decoder is not None and self._delta_plan is not None:
            rank = getattr(self.transport, "rank", "?")
            against, following, off = self._delta_plan
            decoder.begin(against, following, who=f"delta sync, rollout rank {rank}", off=off)
            if isinstance(self.transport, LanesTransport | HostsTransport):
                # lanes: before their exactly-once tally; hosts: on each host's leader only
                self.transport.decode_item = decoder.decode
            else:
                decode = decoder.decode
        stream = self.transport.receive()
        if not isinstance(stream, AsyncGenerator):  # a third-party transport's iterator
            stream = _as_generator(stream)
        if receiving is not None:
            receiving.stream = stream
        async for item in stream:
            if decode is not None:
                try:
                    item = decode(*item)
                except Exception as exc:
                    # the transport's stream is suspended at its yield: fail it with the reason, so
                    # the sender learns it at once
                    with contextlib.suppress(BaseException):
                        await stream.athrow(exc)
                    raise
            yield item
            del item  # keep no reference to a tensor the consumer has moved on from
            if receiving is not None:
                receiving.tensors += 1
        if receiving is not None:
            receiving.finished = True
        stats = self.transport.last_stats
        if stats is not None:
            self.last_metrics = stats.as_metrics()
        if decoder is not None:
            decoder.commit()
            self.last_metrics.update(decoder.stats.as_metrics(decoder.full_syncs))

    async def end_receive(self, error: BaseException | None) -> None:
        """The consumer of this sync's :meth:`receive_weights` is done (verl's worker method returned,
        or raised ``error``). A receive stream that did not reach its end is closed now with the
        consumer's reason, so trainer rank 0 fails at once with it instead of waiting out
        ``timeout_s``; a stream never started aborts the sync the same way. Returning before the end
        without an error raises :class:`TransportError` (the rollout would run on half-updated
        weights); with ``error`` nothing is raised here (the caller re-raises ``error``)."""
        receiving, self._receiving = self._receiving, None
        if receiving is None or receiving.finished:
            return
        reason = consumer_error(error, receiving.tensors)
        stream = receiving.stream
        if stream is None:
            abort = getattr(self.transport, "abort_receive", None)
            if callable(abort):
                abort(str(reason))
        elif getattr(stream, "ag_frame", None) is not None and not getattr(stream, "ag_running", True):
            # the stream is suspended mid-sync: its failure path tells the sender, with the reason
            with contextlib.suppress(Exception):
                await stream.athrow(reason)
        if error is None:
            raise TransportError(
                f"fastsync: the server adapter returned after {receiving.tensors} tensors, before the "
                "end of the weights; the sync was aborted on every rank (the rollout must load every "
                "tensor it is sent)"
            )


async def _as_generator(
    items: AsyncIterable[tuple[str, torch.Tensor]],
) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    async for item in items:
        yield item
        del item


def register_engine() -> type[FastsyncCheckpointEngine]:
    """Register ``fastsync`` in verl's ``CheckpointEngineRegistry`` (idempotent; never touches
    other names such as verl's own ``nccl``/``nixl``)."""
    registry = CheckpointEngineRegistry._registry
    current = registry.get(ENGINE_NAME)
    if current is FastsyncCheckpointEngine:
        return FastsyncCheckpointEngine
    if current is not None and getattr(current, "__qualname__", "") != FastsyncCheckpointEngine.__qualname__:
        raise RuntimeError(
            f"checkpoint engine name {ENGINE_NAME!r} is already taken by "
            f"{current.__module__}.{current.__qualname__}"
        )
    CheckpointEngineRegistry.register(ENGINE_NAME)(FastsyncCheckpointEngine)
    return FastsyncCheckpointEngine
