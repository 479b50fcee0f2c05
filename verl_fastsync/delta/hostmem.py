"""Host memory for what a delta sync keeps or stages (:func:`host_buffer`): page-locked where asked for
and allowed, pageable otherwise, and what it takes (:func:`footprint`), for the memory guard.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every block up to
a power of two (a 1.09 GB embedding takes a 2 GiB block: ~15 GB of bases pinned ~29 GB) and keeps
freed blocks for later, so the guard counted about half of what was pinned and turning delta off gave
nothing back. Here a page-locked buffer is its own anonymous mapping of just its pages, registered
with CUDA (``cudaHostRegister``); when its last tensor goes it is unregistered and unmapped. So it
takes its size rounded up to a page, and dropping a base returns that memory to the host at once.

Where pinning is refused (no CUDA, a driver or memory limit), the buffer is pageable instead: the same
bytes, slower copies between host and device; logged once per process with the reason. Imports torch
and the standard library only.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from typing import Final

import torch

__all__ = ["PAGE", "PAGE_LOCK_MIN", "footprint", "host_buffer"]

_log = logging.getLogger(__name__)

PAGE: Final = mmap.PAGESIZE
"""A page-locked buffer takes whole pages of this many bytes."""

PAGE_LOCK_MIN: Final = 1 << 20
"""Bytes a base must have to be page-locked by default (a smaller one's copy is bound by its latency,
not by bandwidth, and each page-locked buffer is a mapping and a registration of its own: a model of
tens of thousands of small tensors would otherwise take as many)."""

_CUDA_HOST_REGISTER_PORTABLE: Final = 1
"""Page-locked for every CUDA context of the process, not only the current device's."""

_refusal_lock = threading.Lock()
_refusal_logged = False


def footprint(nbytes: int, page_locked: bool) -> int:
    """Host bytes a buffer of ``nbytes`` takes: whole pages when page-locked (what the host loses
    while it lives; a refused pinning takes no more than that either)."""
    return -(-nbytes // PAGE) * PAGE if page_locked else nbytes


def host_buffer(nbytes: int, page_locked: bool) -> torch.Tensor:
    """New flat ``uint8`` host memory of ``nbytes``: page-locked when ``page_locked`` and the host
    allows it, else pageable (the first refusal is logged)."""
    if not page_locked or nbytes <= 0:
        return torch.empty(max(0, nbytes), dtype=torch.uint8)
    try:
        return _page_locked(nbytes)
    except Exception as exc:  # any refusal: page-locking only makes the copies faster
        _refused(nbytes, exc)
        return torch.empty(nbytes, dtype=torch.uint8)


def _page_locked(nbytes: int) -> torch.Tensor:
    region = mmap.mmap(-1, nbytes)  # anonymous, whole pages, unmapped when the last reference goes
    tensor = torch.frombuffer(region, dtype=torch.uint8)  # (keeps ``region`` alive while it lives)
    address = tensor.data_ptr()
    _register(address, nbytes)
    # unregistered when the memory's last tensor goes; ``region`` (an argument here) is unmapped only
    # after that, never while still registered
    weakref.finalize(tensor.untyped_storage(), _release, address, region)
    return tensor


def _register(address: int, nbytes: int) -> None:
    """Page-locks ``nbytes`` at ``address`` with CUDA; raises what refused it."""
    cudart = torch.cuda.cudart()  # (raises without CUDA)
    code = int(cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code:
        name = cudart.cudaGetErrorString(cudart.cudaError(code))
        clear = getattr(cudart, "cudaGetLastError", None)  # (where bound: not left for a later check)
        if clear is not None:
            clear()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {name} (cudaError {code})")


def _unregister(address: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code:
        raise RuntimeError(f"cudaHostUnregister failed (cudaError {code})")


def _release(address: int, region: mmap.mmap) -> None:
    try:
        _unregister(address)
    except Exception as exc:  # (at interpreter exit CUDA may be gone: the process returns it all)
        _log.debug("fastsync: unregistering page-locked host memory at %#x: %s", address, exc)
    # ``region`` is unmapped once this returns (or once its last tensor's buffer is released)


def _refused(nbytes: int, exc: Exception) -> None:
    global _refusal_logged
    with _refusal_lock:
        first, _refusal_logged = not _refusal_logged, True
    if first:
        _log.warning(
            "fastsync: delta sync could not page-lock %d bytes of host memory (%s: %s); it uses pageable "
            "memory where pinning is refused: the same bytes, slower copies between host and device",
            nbytes,
            type(exc).__name__,
            exc,
        )
