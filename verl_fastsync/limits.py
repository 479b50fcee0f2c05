"""The one rule of each bucket size and timeout, shared by every path (chunks, transports, the
colocated path, the config parser): :func:`validate_timeout`, :func:`validate_bucket_size` and
:data:`DEFAULT_TIMEOUT_S`; and the host memory buckets are sized against
(:func:`host_memory_available`). It imports nothing of the package and no torch, so the lowest layer
(:mod:`verl_fastsync.chunks`) takes the bucket-size rule from here without knowing the config.
"""

from __future__ import annotations

import math

DEFAULT_TIMEOUT_S = 600.0
"""Default limit of one blocking wait of a sync (seconds), on every path (generous: a vLLM worker may be
slow to start receiving)."""


def validate_timeout(value: object, what: str = "timeout_s") -> float:
    """``value`` as seconds if it is a finite number > 0 (not a bool); else ``TypeError`` (not a
    number) or ``ValueError``, both naming ``what``. Every timeout of the package goes through here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0 of seconds, got {value!r}")
    return float(value)


def validate_bucket_size(bucket_size: object, what: str = "bucket_size", *, mib: bool = False) -> int:
    """A bucket size in bytes: ``bucket_size`` if it is a positive int (not a bool), else ``TypeError``
    / ``ValueError`` naming ``what``. With ``mib=True`` ``bucket_size`` is a finite number of MiB
    (verl's ``bucket_size_mb``), converted to bytes, which must come to at least one byte; anything
    else is a ``ValueError``. Every bucket size of the package goes through here."""
    if mib:
        size = 0
        if isinstance(bucket_size, int | float) and not isinstance(bucket_size, bool):
            if math.isfinite(bucket_size) and bucket_size > 0:
                size = int(bucket_size * (1 << 20))
        if size <= 0:
            raise ValueError(f"{what} must be a positive number of MiB, got {bucket_size!r}")
        return size
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise TypeError(f"{what} must be a positive int (bytes), got {bucket_size!r}")
    if bucket_size <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {bucket_size}")
    return bucket_size


def host_memory_available() -> int:
    """This host's available memory in bytes (``MemAvailable``; psutil where there is no
    ``/proc/meminfo``): what ``bucket_bytes=auto`` sizes host buckets against and what doctor checks
    a delta sync's base against."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    import psutil

    return int(psutil.virtual_memory().available)
