"""Measuring instruments: resident-set and device-allocator peaks, process CPU time, host memcpy,
and the CPU stand-in for a torch device module."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from verl_fastsync.tools.bench.options import MIB

RATIO_FLOOR_S = 1e-4
"""A ratio against a median below this many seconds is not reported (it would divide by noise)."""


def median_min_max(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def ratio(baseline_s: float | None, seconds: float | None) -> float | None:
    """``baseline_s / seconds`` (throughput relative to the baseline, same bytes), or None when
    either is missing or a median is too small to divide by."""
    if baseline_s is None or seconds is None or seconds < RATIO_FLOOR_S or baseline_s < RATIO_FLOOR_S:
        return None
    return baseline_s / seconds


def worker_threads() -> int:
    """torch intra-op threads per transfer process: the sender and the receiver share the host's
    cores (on a 2-core host, more threads than cores make OpenMP spin and copies crawl)."""
    return max(1, (os.cpu_count() or 2) // 2)


def memcpy_seconds(nbytes: int, repeats: int, chunk: int = 256 * MIB) -> list[float]:
    """Seconds to copy ``nbytes`` with ``torch.Tensor.copy_`` (in pieces of at most ``chunk``
    bytes, so a 2 GiB model needs 512 MiB, not 4 GiB), one value per repeat after a warm-up, with
    the thread count of one transfer process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    try:
        size = min(nbytes, chunk)
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.zeros(size, dtype=torch.uint8)
        dst.copy_(src)
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                n = min(left, size)
                dst[:n].copy_(src[:n])
                left -= n
            out.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    t = os.times()
    return t.user + t.system


def malloc_trim() -> None:
    """glibc ``malloc_trim(0)``: return free heap memory to the OS (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RssSampler:
    """Peak resident set size above a baseline.

    The kernel's high-water mark (``VmHWM``) is reset at the start (``/proc/self/clear_refs`` = 5)
    and read at the end, so no spike is missed; where that reset is not allowed, ``VmRSS`` is sampled
    every millisecond instead."""

    def __init__(self, interval_s: float = 0.001, baseline: int | None = None) -> None:
        self.interval_s = interval_s
        malloc_trim()  # give freed heap pages back first, so reuse of them shows as growth
        self.baseline = baseline if baseline is not None else (status_bytes("VmRSS") or 0)
        self.peak = self.baseline
        self._hwm = self._reset_hwm()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_bytes("VmRSS") or 0)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        if not self._hwm:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5)
        self.peak = max(self.peak, status_bytes("VmHWM" if self._hwm else "VmRSS") or 0)

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.baseline)


class DevicePeak:
    """Peak bytes the device's caching allocator handed out above what was allocated at the start
    (memory mapped from another process through CUDA IPC is not counted)."""

    def __init__(self, device: str) -> None:
        self.active = device.startswith("cuda")
        self.extra = 0
        self._start = 0

    def __enter__(self) -> DevicePeak:
        if self.active:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            import torch

            torch.cuda.synchronize()
            self.extra = max(0, torch.cuda.max_memory_allocated() - self._start)


class CpuDevice:
    """Stand-in for a torch device module on a host without an accelerator.

    CPU tensors have no caching allocator: ``empty_cache`` has nothing to return and
    ``memory_reserved``/``memory_allocated`` are 0. ``synchronize`` waits for torch's CPU stream.
    There is deliberately no ``mem_get_info``: the ``adaptive`` policy then sees no device-memory
    pressure and never collects garbage, which is what it would do on a host with room to spare.
    """

    name = "cpu"

    def empty_cache(self) -> None:
        return None

    def synchronize(self) -> None:
        import torch

        torch.cpu.synchronize()

    def ipc_collect(self) -> None:
        """No CUDA IPC on a CPU host (verl 0.7.1's shared-memory path calls it unconditionally)."""
        return None

    def memory_reserved(self) -> int:
        return 0

    def memory_allocated(self) -> int:
        return 0


def bench_device(prefer_verl: bool = True) -> tuple[Any, str, str]:
    """The device module the cleanup policies get, its name and where it came from.

    Without an accelerator (``torch.accelerator``) the :class:`CpuDevice` stand-in, without
    importing verl. Otherwise verl's ``get_torch_device()`` (what the workers use) when
    ``synchronize()`` and ``empty_cache()`` work on it, else ``torch.cuda``.
    """
    import torch

    accelerator = getattr(torch, "accelerator", None)
    has_accelerator = (
        bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()
    )
    if not has_accelerator:
        return CpuDevice(), "cpu", "verl_fastsync.tools.bench.CpuDevice (no accelerator)"
    if prefer_verl:
        try:
            from verl.utils.device import get_device_name, get_torch_device

            module = get_torch_device()
            module.synchronize()
            module.empty_cache()
            return module, str(get_device_name()), "verl.utils.device.get_torch_device()"
        except Exception:
            pass
    if torch.cuda.is_available():
        return torch.cuda, "cuda", "torch.cuda"
    return CpuDevice(), "cpu", "verl_fastsync.tools.bench.CpuDevice (no accelerator)"
