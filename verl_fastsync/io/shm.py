"""One POSIX shared-memory segment helper for the engine and colocated paths.

* Names: ``fastsync_<owner pid>_<128 random bits>`` (:func:`new_segment_name`): unguessable, and the
  owner's pid lets :func:`sweep_dead_segments` remove what a killed owner left behind.
* Mode 0600, created with ``O_CREAT | O_EXCL`` (never opens someone else's segment by accident).
* ``shm_open`` + ``mmap`` directly rather than ``multiprocessing.shared_memory``: attaching through
  the latter registers the segment with the attaching process's resource tracker, which unlinks it
  when *that* process exits, under the owner's feet.
* :meth:`Segment.unlink` removes the name (mappings stay valid until each side closes them); the
  usual pattern is to unlink as soon as every peer has attached, so nothing is left in
  ``/dev/shm`` even if every process is killed afterwards.
* :meth:`Segment.close` drops the mapping; if a tensor view of it is still alive somewhere, the
  mapping goes with that last view (never ``gc.collect()``).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading

import numpy
import torch

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

logger = logging.getLogger(__name__)

__all__ = [
    "SEGMENT_PREFIX",
    "Segment",
    "SegmentError",
    "new_segment_name",
    "owner_pid",
    "sweep_dead_segments",
    "unlink_quietly",
]

SEGMENT_PREFIX = "fastsync_"
"""Every segment name starts with this (leak checks and the sweep look for it)."""

_SHM_DIR = "/dev/shm"


class SegmentError(RuntimeError):
    """A segment could not be created or attached (the message says which and why)."""


def _require_posix() -> None:
    if _posixshmem is None:  # pragma: no cover - non-POSIX
        raise SegmentError("POSIX shared memory (_posixshmem) is not available on this platform")


def new_segment_name(prefix: str = SEGMENT_PREFIX) -> str:
    """``<prefix><pid>_<32 hex digits>`` for a segment this process will own."""
    return f"{prefix}{os.getpid()}_{secrets.token_hex(16)}"


def owner_pid(name: str, prefix: str = SEGMENT_PREFIX) -> int | None:
    """The owner pid encoded in a segment name, or ``None`` if the name has no pid."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix) :].split("_", 1)[0]
    return int(head) if head.isdigit() else None


def unlink_quietly(name: str) -> None:
    """Remove a segment name; a missing name is not an error."""
    _require_posix()
    try:
        _posixshmem.shm_unlink("/" + name.lstrip("/"))
    except (FileNotFoundError, OSError):
        pass


class Segment:
    """One mapped POSIX shared-memory segment and a flat ``uint8`` tensor over it.

    :param name: segment name (without the leading ``/``); see :func:`new_segment_name`.
    :param size: bytes to create, or the least size an attached segment must have.
    :param create: create (mode 0600, exclusive) or attach to an existing segment.
    :param populate: fault every page in now (``MAP_POPULATE``), not during a timed transfer.
    """

    def __init__(self, name: str, size: int, create: bool, populate: bool = True) -> None:
        _require_posix()
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise SegmentError(f"segment size must be a positive int (bytes), got {size!r}")
        self.name = name.lstrip("/")
        self.size = size
        self.owner = create
        self.linked = True
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = _posixshmem.shm_open("/" + self.name, flags, mode=0o600)
        except FileNotFoundError as exc:
            raise SegmentError(f"shared-memory segment {self.name!r} does not exist (vanished?)") from exc
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                have = os.fstat(fd).st_size
                if have < size:
                    raise SegmentError(
                        f"shared-memory segment {self.name!r} has {have} bytes, {size} were announced"
                    )
            map_flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.map: mmap.mmap | None = mmap.mmap(fd, size, flags=map_flags)
        except BaseException:
            if create:
                unlink_quietly(self.name)
            raise
        finally:
            os.close(fd)
        # through NumPy, which holds a buffer export on the mapping for as long as any tensor or view
        # of it lives: close() then cannot unmap memory a consumer still reads (torch.frombuffer
        # keeps the object alive but releases its export, so close() unmapped under live views)
        array = numpy.frombuffer(self.map, dtype=numpy.uint8, count=size)
        self.tensor: torch.Tensor | None = torch.from_numpy(array)

    @classmethod
    def create(cls, size: int, prefix: str = SEGMENT_PREFIX, populate: bool = True) -> Segment:
        """A new segment with a fresh :func:`new_segment_name`; sweeps dead owners' segments first."""
        sweep_dead_segments(prefix)
        return cls(new_segment_name(prefix), size, create=True, populate=populate)

    @classmethod
    def attach(cls, name: str, size: int, populate: bool = True) -> Segment:
        """Map an existing segment of at least ``size`` bytes."""
        return cls(name, size, create=False, populate=populate)

    def unlink(self) -> None:
        """Remove the name (idempotent); mappings stay valid."""
        if self.linked:
            self.linked = False
            unlink_quietly(self.name)

    def close(self) -> bool:
        """Drop this side's mapping (idempotent). Returns False when a view still holds it (the
        mapping is then released with that view)."""
        self.tensor = None
        mm, self.map = self.map, None
        if mm is None:
            return True
        try:
            mm.close()
        except BufferError:
            logger.debug("verl-fastsync: segment %s still has live views; released with them", self.name)
            return False
        return True

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size}, owner={self.owner}, linked={self.linked})"


_SWEEP_LOCK = threading.Lock()
_SWEPT: set[str] = set()


def sweep_dead_segments(
    prefix: str = SEGMENT_PREFIX, shm_dir: str = _SHM_DIR, force: bool = False
) -> list[str]:
    """Unlink segments named ``<prefix><pid>_...`` whose owner process no longer exists (an owner
    killed before it could unlink). Runs once per process and prefix unless ``force``; returns the
    names removed. A process that still maps such a segment keeps its mapping (only the name goes)."""
    with _SWEEP_LOCK:
        if prefix in _SWEPT and not force:
            return []
        _SWEPT.add(prefix)
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        pid = owner_pid(name, prefix)
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        unlink_quietly(name)
        removed.append(name)
    if removed:
        logger.info("verl-fastsync: removed %d shared-memory segment(s) of dead processes", len(removed))
    return removed
