"""Whether a side of a delta sync may keep more base bytes in host memory (:class:`Room`).

A delta sync keeps the model's bytes in host memory on the sender and on every rollout rank, and verl
runs a rollout rank on every rollout GPU: an 8-GPU rollout host keeps 8 bases. Where that does not
fit, the kernel's OOM killer ends a vLLM worker or a trainer rank, and the run with it. So before a
side adds base bytes it asks its :class:`Room`; where they would leave less than a reserve of the
host's memory free, the side turns delta sync off for the run (:mod:`~verl_fastsync.delta.side`):
syncs go on, full, and no side keeps a base. Imports the package's limits only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from verl_fastsync.limits import cgroup_memory_available, host_memory_available, meminfo_available

__all__ = ["RECHECK_MIN", "RESERVE_FRACTION", "RESERVE_MIN", "Room", "reserve_for"]

RESERVE_MIN: Final = 4 << 30
"""Host memory a side leaves free, at least: what the processes around it (vLLM's host buffers, the
trainer's, Ray's object store) take after the bases were made."""
RESERVE_FRACTION: Final = 8
"""...and at least this fraction (1/8) of what was available when the side first made bases: the
bases of a host take at most 7/8 of it."""
RECHECK_MIN: Final = 64 << 20
"""Base bytes a side adds between two reads of the host's memory, at least (a read costs ~0.1 ms)."""


def reserve_for(available: int) -> int:
    """The bytes a side leaves free where ``available`` bytes were available when it first made
    bases (doctor checks a host against the same rule before a run)."""
    return max(RESERVE_MIN, available // RESERVE_FRACTION)


class Room:
    """Host memory one side may still fill with base bytes. It reads what is available
    (``read``: :func:`~verl_fastsync.limits.host_memory_available`, which sees a container's memory
    cgroup) at the first :meth:`take` of each sync and again after every sixteenth of the room it
    saw was taken, so that the ranks of one host, which take at the same time, see each other's
    bases before they overfill it."""

    def __init__(self, read: Callable[[], int] = host_memory_available) -> None:
        self._read = read
        self.reserve: int | None = None
        """Bytes left free (:data:`RESERVE_MIN`, :data:`RESERVE_FRACTION`), fixed at the first read."""
        self.available = 0
        """Host memory available at the last read."""
        self._left = 0
        self._since_read = 0
        self._recheck = 0
        self._stale = True

    def reset(self) -> None:
        """A sync begins: read the host's memory again at the next :meth:`take`."""
        self._stale = True

    def take(self, nbytes: int) -> bool:
        """Counts ``nbytes`` more base bytes if the reserve stays free; False (nothing counted) if not."""
        if self._stale or self._since_read >= self._recheck or nbytes > self._left:
            self._refresh()
        if nbytes > self._left:
            return False
        self._left -= nbytes
        self._since_read += nbytes
        return True

    def _refresh(self) -> None:
        self.available = self._read()
        if self.reserve is None:
            self.reserve = reserve_for(self.available)
        self._left = self.available - self.reserve
        self._since_read = 0
        self._recheck = max(RECHECK_MIN, self._left // 16)
        self._stale = False

    def refusal(self, name: str, nbytes: int) -> str:
        """Why :meth:`take` refused ``nbytes`` for ``name``, with the figures and what limits them."""
        gib, mib = 1 << 30, 1 << 20
        reserve = self.reserve or 0
        limited = cgroup_memory_available()
        where = (
            "this process's memory cgroup (a container's limit)"
            if limited is not None and limited < meminfo_available()
            else "this host"
        )
        return (
            f"keeping the delta base of {name!r} ({nbytes / mib:.1f} MiB more) would leave less than "
            f"{reserve / gib:.2f} GiB free in {where}: {self.available / gib:.2f} GiB available, "
            f"{max(0, self.available - reserve) / mib:.1f} MiB of it for bases"
        )
