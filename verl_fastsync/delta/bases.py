"""What a side of a delta sync keeps (:mod:`verl_fastsync.delta.stream`): each tensor's :class:`Base`
(its bytes as last synced, and what the consumer was lent of them) and, while a delta sync runs, the
:class:`UndoJournal` that puts the bases back if the sync fails. Imports torch and the delta codec and
the lending module only."""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from verl_fastsync.delta.codec import Patch
from verl_fastsync.delta.hostmem import footprint
from verl_fastsync.io.lending import Lease

__all__ = ["UNDO_FRACTION", "Base", "UndoJournal"]

UNDO_FRACTION: Final = 0.125
"""A side's undo journal holds at most this fraction of its base's bytes. It covers the deltas of
ordinary RL steps (the sparse form of 2-6% changed bf16 values is 4-12% of the bytes); a sync that
changes more (re-initialised weights, tensors going raw) stops journaling, rather than doubling the
base's memory, and if it then fails the next sync is full."""


@dataclasses.dataclass
class Base:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor
    """Flat ``uint8`` host bytes."""
    lease: Lease | None = None
    """A receiver's: what the consumer was given of :attr:`data` (while active, never written)."""
    page_locked: bool = False
    """:attr:`data` was asked for page-locked (:func:`~verl_fastsync.delta.hostmem.host_buffer`)."""

    @property
    def taken(self) -> int:
        """Host bytes :attr:`data` takes, as the memory guard counts them."""
        return footprint(self.data.numel(), self.page_locked)

    def writable(self) -> bool:
        """The consumer holds nothing of this base: the next sync may rebuild it in place."""
        return self.lease is None or not self.lease.active


class UndoJournal:
    """What one delta sync changed in a side's base so far, to put it back if the sync fails: per
    tensor, the :class:`~verl_fastsync.delta.codec.Patch` of an in-place update or the entry a new
    one replaced (None: the name was not in the base). Names come once per sync."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self.patches: dict[str, Patch] = {}
        self.replaced: dict[str, Base | None] = {}

    def room(self, nbytes: int) -> bool:
        """Counts ``nbytes`` more if they fit the limit."""
        if self.nbytes + nbytes > self.limit:
            return False
        self.nbytes += nbytes
        return True

    def roll_back(self, base: dict[str, Base]) -> None:
        """Puts ``base`` back as it was when the sync began. A tensor the consumer still holds is
        never written: its base is patched in a copy."""
        for name, old in self.replaced.items():
            if old is None:
                base.pop(name, None)
            else:
                base[name] = old
        for name, patch in self.patches.items():
            entry = base[name]
            if not entry.writable():
                entry = base[name] = Base(entry.dtype, entry.shape, entry.data.clone())
            patch.apply(entry.data)
