"""What each side of a delta sync keeps from sync to sync (:class:`Side`, the base of
:class:`~verl_fastsync.delta.stream.DeltaEncoder` and :class:`~verl_fastsync.delta.stream.DeltaDecoder`):
the base and its epoch, the undo journal of the sync running, its figures (:class:`DeltaStats`), and
whether delta sync is still on.

**Off for the run.** Before a side adds base bytes it asks its :class:`~verl_fastsync.delta.room.Room`
whether the host can hold them. When not, the side keeps no more base in that sync and drops it when
the sync ends; from the next sync on it reports why in ``prepare()``, the topology tells every side,
and every sync is full with no base anywhere (``fastsync/transfer/delta_off`` = 1; the warning is
logged once per side). The weights still arrive exactly; only the bytes a delta would have saved move.
Imports torch and the other ``verl_fastsync.delta`` modules only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator

from verl_fastsync.delta.bases import UNDO_FRACTION, Base, UndoJournal
from verl_fastsync.delta.codec import DeltaError, Patch
from verl_fastsync.delta.room import Room

__all__ = ["DeltaStats", "DeltaSyncError", "Side"]

_log = logging.getLogger("verl_fastsync.delta.stream")  # (the logger a side used before it had a module)


class DeltaSyncError(DeltaError):
    """A delta sync cannot go on: a receiver lacks the base a delta names, or the rebuilt bytes are not
    the sender's. The sync fails; the next one is full."""


@dataclasses.dataclass
class DeltaStats:
    """One side's delta figures for one sync (``fastsync/transfer/delta_*`` metrics)."""

    delta_sync: bool = False
    """The sync diffed against a base (else: full)."""
    model_bytes: int = 0
    """Bytes of the tensors (what a full sync moves)."""
    wire_bytes: int = 0
    """Bytes of what went on the wire instead."""
    delta_tensors: int = 0
    raw_tensors: int = 0
    changed_elements: int = 0
    """Elements that differ from the base, over the tensors sent as deltas."""
    compared_elements: int = 0
    """Elements of the tensors sent as deltas."""
    codec_s: float = 0.0
    """Seconds this side spent encoding (sender) or rebuilding (receiver), base copies included."""
    off: bool = False
    """Delta sync is off for the run: a side had no room for its base (:class:`Side`)."""

    def as_metrics(self, full_syncs: int) -> dict[str, float]:
        changed = self.changed_elements / self.compared_elements if self.compared_elements else 0.0
        return {
            "fastsync/transfer/delta_sync": float(self.delta_sync),
            "fastsync/transfer/delta_full_syncs": float(full_syncs),
            "fastsync/transfer/delta_model_bytes": float(self.model_bytes),
            "fastsync/transfer/delta_wire_bytes": float(self.wire_bytes),
            "fastsync/transfer/delta_tensors": float(self.delta_tensors),
            "fastsync/transfer/delta_raw_tensors": float(self.raw_tensors),
            "fastsync/transfer/delta_changed_fraction": changed,
            "fastsync/transfer/delta_codec_s": self.codec_s,
            "fastsync/transfer/delta_off": float(self.off),
        }


class Side:
    """What the sender and a receiver share: the base, its epoch, the sync's bookkeeping."""

    role = "side"

    def __init__(self, room: Room | None = None) -> None:
        self.room = Room() if room is None else room
        """Host memory this side may still fill with base bytes."""
        self.off: str | None = None
        """Why delta sync is off for the run (this side had no room for its base, or the topology
        said another side had none); None while it is on."""
        self.passing = False
        """This sync keeps no base any more (delta is off): tensors pass as they are."""
        self.base: dict[str, Base] = {}
        self.epoch: str | None = None
        """Epoch of the base (None: no usable base)."""
        self.full_syncs = 0
        """Full syncs this side ran (the first one included)."""
        self.stats = DeltaStats()
        self.who = "delta sync"
        self.rolled_back = 0
        """Failed delta syncs whose base was put back at the epoch they diffed against."""
        self._against: str | None = None
        self._next: str | None = None
        self._open = False
        self._journal: UndoJournal | None = None
        self._seen: set[str] = set()

    def settle(self) -> None:
        """A sync that began and did not commit failed: put the base back at the epoch it diffed
        against (its journal is whole), or leave this side without an epoch. The engine calls this
        before it reports the epoch for the next sync; :meth:`begin` calls it too."""
        if not self._open:
            return
        self._open = False
        journal, self._journal = self._journal, None
        if journal is not None:
            journal.roll_back(self.base)
            self.epoch = self._against
            self.rolled_back += 1
        if self.off is not None:  # (no journal: delta is off, the base goes now)
            self.base.clear()
        self._seen = set()

    def begin(
        self, against: str | None, next_epoch: str, who: str = "delta sync", off: str | None = None
    ) -> None:
        """A sync starts: diff against the base of epoch ``against`` (None: a full sync), and name the
        base it leaves ``next_epoch``. ``off``: delta sync is off for the run (why; the topology
        says so when any side reported it): the sync is full and this side drops its base."""
        self.settle()
        if against is not None and against != self.epoch:
            raise DeltaSyncError(
                f"{who}: the topology says diff against base {against}, this {self.role} holds "
                f"{self.epoch or 'none'} (was the topology built from stale metadata?)"
            )
        if off is not None and against is not None:
            raise DeltaSyncError(f"{who}: the topology says diff against base {against} with delta off")
        if off is not None and self.off is None:
            self.off = off
            _log.warning("fastsync: delta sync is off for this run on this %s too: %s", self.role, off)
        self._against, self._next, self.who = against, next_epoch, who
        self.epoch = None  # from here the base changes: usable again only after commit() or settle()
        self._seen = set()
        self._open = True
        self.passing = self.off is not None
        if self.passing:
            self.base.clear()
        self.room.reset()
        self._journal = UndoJournal(int(UNDO_FRACTION * self.base_bytes)) if against is not None else None
        self.stats = DeltaStats(delta_sync=against is not None, off=self.passing)
        if against is None:
            self.full_syncs += 1

    def make_room(self, name: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more base bytes for ``name`` fit this host; if not, delta sync turns off
        for the run here (logged with the figures): this sync keeps no more base, it is dropped when
        the sync ends, and this side reports why for the next sync's topology (every side then runs
        full syncs and keeps no base)."""
        if self.passing:
            return False
        if nbytes <= 0 or self.room.take(nbytes):
            return True
        self.off = f"{self.role}: {self.room.refusal(name, nbytes)}"
        _log.warning(
            "fastsync: delta sync turned off for this run: %s; every sync from the next one is full and "
            "no side keeps a base (metric fastsync/transfer/delta_off)",
            self.off,
        )
        self.passing = True
        self.stats.off = True
        self._journal = None  # a failure from here leaves no epoch (there will be none anyway)
        return False

    def _check_open(self) -> None:
        if not self._open:
            raise DeltaSyncError(f"{self.who}: no sync is running (begin() first; a failed sync ended)")

    def _journal_patch(self, name: str, patch: Patch) -> None:
        journal = self._journal
        if journal is not None and not journal.room(patch.nbytes):
            self._journal = None  # past the limit: a failure from here leaves no epoch
        elif journal is not None:
            journal.patches[name] = patch

    @contextlib.contextmanager
    def _journaled(self) -> Iterator[None]:
        """A block that changes the base: if it raises, what it did may be in no journal, so the
        journal is dropped (a failure then leaves no epoch rather than a wrong one)."""
        try:
            yield
        except BaseException:
            self._journal = None
            raise

    def _journal_replaced(self, name: str, old: Base | None) -> bool:
        """Keeps ``old`` (replaced under ``name``) in the journal if it fits; False when there is no
        journal (any more). A base the consumer still holds costs the journal nothing: its memory
        stays taken by the consumer anyway (so a consumer that batches tensors before loading them,
        as verl's SGLang adapter does, does not cost a failed sync its roll-back)."""
        journal = self._journal
        if journal is None:
            return False
        if not journal.room(0 if old is None or not old.writable() else old.data.numel()):
            self._journal = None
            return False
        journal.replaced[name] = old
        return True

    def _take(self, name: str) -> None:
        self._check_open()
        if name in self._seen:
            raise DeltaSyncError(f"{self.who}: tensor {name!r} came twice in one sync")
        self._seen.add(name)

    def commit(self) -> None:
        """This side's part of the sync ended cleanly: the base is the new epoch's; tensors not sent
        in it leave the base. With delta off, the base is dropped and there is no epoch."""
        self._check_open()
        for name in set(self.base) - self._seen:
            del self.base[name]
        self._seen = set()
        self._open, self._journal = False, None
        if self.off is not None:
            self.base.clear()
            self.epoch = None
            return
        self.epoch = self._next

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Adds the seconds of the block to this sync's :attr:`DeltaStats.codec_s`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.codec_s += time.perf_counter() - start

    @property
    def base_bytes(self) -> int:
        return sum(entry.data.numel() for entry in self.base.values())
