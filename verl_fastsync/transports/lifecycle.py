"""The lifecycle half of :class:`~verl_fastsync.transports.buffered.BufferedTransport`: rank and
bucket bookkeeping, ``init_process_group`` / ``finalize`` / ``release``, what a side is doing right
now (:class:`InFlight`, for error messages) and the error constructors. No data moves here; the sender
side is :mod:`verl_fastsync.transports.sending`, the receiver side
:mod:`verl_fastsync.transports.buffered`.
"""

from __future__ import annotations

from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from verl_fastsync.chunks import validate_bucket_size
from verl_fastsync.transports.base import (
    SENDER_RANK,
    EngineTransport,
    PeerAbortedError,
    TransferStats,
    TransportOptions,
    TransportTimeoutError,
    base_topology,
    failure_reason,
    rank_labels,
)

__all__ = ["InFlight", "TransportCore"]


@dataclass
class InFlight:
    """What a side is doing right now, for error messages."""

    phase: str = "idle"
    bucket: int | None = None
    tensor: str | None = None
    last_tensor: str | None = None

    def describe(self) -> str:
        bucket = "none" if self.bucket is None else str(self.bucket)
        if self.tensor is not None:
            tensor = repr(self.tensor)
        elif self.last_tensor is not None:
            tensor = f"none (last complete: {self.last_tensor!r})"
        else:
            tensor = "none"
        return f"phase {self.phase!r}, bucket {bucket}, tensor in flight {tensor}"


class TransportCore(EngineTransport):
    """Lifecycle and bookkeeping shared by both sides of a double-buffered engine transport.

    Subclasses provide :meth:`_connect` / :meth:`_close` (and :meth:`_end_sync` when they keep
    resources from sync to sync). Set ``prefetch = True`` when ``_recv_next`` itself moves the data
    (e.g. a collective) so bucket ``k+1`` arrives while the consumer handles bucket ``k``; it must
    then not share a non-thread-safe handle with ``_release_slot``.
    """

    prefetch: ClassVar[bool] = False

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self.rank: int | None = None
        self.world_size = 0
        self.role = "?"
        self.bucket_size = 0
        self.slots = self._configured_slots()
        """Bucket buffers the sender fills in turn (bucket ``k`` goes to slot ``k % slots``)."""
        self.inflight = InFlight()
        self.rank_labels: list[str] = []
        """verl's name of each transfer rank (``init_process_group``'s ``rank_labels``)."""
        self._stats: TransferStats | None = None
        self.sync_generation = 0
        """Bumped when a sync starts (``init_process_group``) and when it ends (``finalize``): a
        receive stream acts on the transport only while the generation it started in is current, so
        a stream of an earlier sync closed or garbage-collected later touches nothing."""
        self._executor: ThreadPoolExecutor | None = None

    def _configured_slots(self) -> int:
        """How many slots this transport pipelines over (two; a transport where a slot costs little
        may use more, see :class:`~verl_fastsync.transports.shm.ShmTransport`)."""
        return 2

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        actor, rollout = base_topology(actor_world_size, rollout_world_size, metadata)
        extra = cls._topology_extra(metadata[:actor_world_size], metadata[actor_world_size:])
        for key, value in extra.items():
            actor[key] = [value] * actor_world_size
            rollout[key] = [value] * rollout_world_size
        return actor, rollout

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Values every rank gets (e.g. the master endpoint from ``actor_metadata[0]``)."""
        return {}

    def init_process_group(self, **kwargs: Any) -> None:
        topology = dict(kwargs)
        self._end_open_stream()
        self.sync_generation += 1
        rank = kwargs.pop("rank")
        world_size = kwargs.pop("world_size")
        role = kwargs.pop("role", "trainer" if rank <= 0 else "rollout")
        bucket_size = kwargs.pop("bucket_size", None)
        self.rank, self.world_size, self.role = int(rank), int(world_size), str(role)
        labels = kwargs.pop("rank_labels", None)
        self.rank_labels = (
            [str(label) for label in labels]
            # a group of the hosts layer lists the whole fleet after its own ranks (relayed causes)
            if isinstance(labels, list | tuple) and len(labels) >= self.world_size
            else rank_labels(max(self.world_size - 1, 0))
        )
        if self.rank < 0:
            return
        self.bucket_size = validate_bucket_size(bucket_size)
        self.inflight = InFlight(phase="init_process_group")
        if self.rank != SENDER_RANK:
            # a receiver whose previous sync was never finalized starts with a fresh channel; the
            # sender's endpoints were opened by this sync's prepare()
            self._safe_end_sync()
        try:
            self._connect(**kwargs)
        except BaseException as exc:
            if not isinstance(exc, PeerAbortedError):  # a peer's cause is already out
                self.abort_join(f"{self.me} could not join the group: {failure_reason(exc)}", **topology)
            self._safe_close()
            raise
        self.inflight = InFlight()

    def abort_join(self, reason: str, **kwargs: Any) -> None:
        """Tell the group described by the topology ``kwargs`` (one rank's ``init_process_group``
        arguments) that this rank (``kwargs["rank"]``) cannot join it, without joining: the ranks
        waiting in its handshake fail at once with ``reason`` instead of waiting out ``timeout_s``.
        Best effort, never raises (a group this rank cannot reach may not hear it)."""
        try:
            self._abort_join(reason, kwargs)
        except Exception:  # pragma: no cover - best effort: the peers' own timeout is the fallback
            pass

    def _abort_join(self, reason: str, kwargs: dict[str, Any]) -> None:
        """Deliver ``Abort(reason, rank=kwargs["rank"])`` to the group's handshake (hook; default:
        nothing, the peers wait out ``timeout_s``)."""

    def finalize(self) -> None:
        """End of one sync (verl calls it after every sync): close what is per sync. Resources a
        transport keeps for the next sync (see :meth:`_end_sync`) stay; a failed sync already freed
        everything."""
        self._end_open_stream()
        self.sync_generation += 1
        self._safe_end_sync()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self.rank = None

    def release(self) -> None:
        """Free everything now, including what a transport keeps between syncs (idempotent)."""
        self.finalize()
        self._safe_close()

    def _end_open_stream(self) -> None:
        """A sync ends or a new one starts: fail a receive stream of this side that never ended
        (hook; see :class:`~verl_fastsync.transports.buffered.BufferedTransport`)."""

    def _end_sync(self) -> None:
        """What ``finalize`` closes; default: everything (:meth:`_close`). A transport that keeps
        buffers from sync to sync overrides this to close only its per-sync endpoints."""
        self._close()

    def _safe_end_sync(self) -> None:
        try:
            self._end_sync()
        except Exception:  # pragma: no cover - cleanup is best effort
            pass

    def _safe_close(self) -> None:
        try:
            self._close()
        except Exception:  # pragma: no cover - cleanup is best effort
            pass

    @abstractmethod
    def _connect(self, **kwargs: Any) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    @property
    def last_stats(self) -> TransferStats | None:
        return self._stats

    @property
    def receivers(self) -> int:
        return self.world_size - 1

    def _buffer_bytes(self) -> int:
        """Bytes of bucket buffers this side allocated (default: one bucket per slot)."""
        return self.slots * self.bucket_size

    def label(self, rank: int | None) -> str:
        """verl's name for transfer rank ``rank`` ("trainer rank 2 (lane 1)", "rollout rank 3")."""
        if rank is not None and 0 <= rank < len(self.rank_labels):
            return self.rank_labels[rank]
        if rank == SENDER_RANK:
            return "trainer rank 0"
        return f"rollout rank {rank - 1}" if isinstance(rank, int) and rank > 0 else f"rank {rank}"

    @property
    def me(self) -> str:
        """This side's own name for error texts: "<transport> transport, <verl's rank name>"."""
        return f"{self.name} transport, {self.label(self.rank)}"

    def _timeout_error(self, peer: str, detail: str = "") -> TransportTimeoutError:
        extra = f" ({detail})" if detail else ""
        return TransportTimeoutError(
            f"{self.me}: timed out after "
            f"{self.options.timeout_s:g}s waiting for {peer}{extra}; {self.inflight.describe()}"
        )

    def _abort_error(self, peer: str, reason: str) -> PeerAbortedError:
        return PeerAbortedError(f"{self.me}: {peer} aborted the sync: {reason}; {self.inflight.describe()}")
