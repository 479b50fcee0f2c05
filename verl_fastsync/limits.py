"""The one rule of each bucket size and timeout, shared by every path (chunks, transports, the
colocated path, the config parser): :func:`validate_timeout`, :func:`validate_bucket_size` and
:data:`DEFAULT_TIMEOUT_S`; and the host memory buckets are sized against
(:func:`host_memory_available`). It imports nothing of the package and no torch, so the lowest layer
(:mod:`verl_fastsync.chunks`) takes the bucket-size rule from here without knowing the config.
"""

from __future__ import annotations

import math
import os

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
    """The memory this process may still take, in bytes: the host's ``MemAvailable`` (psutil where
    there is no ``/proc/meminfo``), or less where a memory cgroup limits this process (a container's
    limit: the kernel kills there, whatever the host has; :func:`cgroup_memory_available`). What
    ``bucket_bytes=auto`` sizes host buckets against and what doctor checks a delta sync's base
    against."""
    available = meminfo_available()
    limited = cgroup_memory_available()
    return available if limited is None else min(available, limited)


def meminfo_available() -> int:
    """The host's ``MemAvailable`` in bytes (psutil where there is no ``/proc/meminfo``)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    import psutil

    return int(psutil.virtual_memory().available)


_NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is none."""


def cgroup_memory_available(proc: str = "/proc/self") -> int | None:
    """What the memory cgroups of the process at ``proc`` still allow, in bytes: over the process's
    cgroup and each ancestor that has a limit (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), the least of the limit minus the usage plus the inactive file pages
    (page cache the kernel reclaims before it kills: the cgroup's counterpart of ``MemAvailable``).
    None where no memory cgroup limits it or the cgroup files cannot be read (not Linux, cgroupfs
    not mounted)."""
    try:
        with open(f"{proc}/cgroup") as fh:
            groups = [line.rstrip("\n").split(":", 2) for line in fh if line.count(":") >= 2]
        with open(f"{proc}/mountinfo") as fh:
            mounts = [line.split() for line in fh]
    except OSError:
        return None
    least: int | None = None
    for fields in mounts:
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or sep < 5:
            continue
        root, mountpoint, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup2":
            version, path = 2, next((g[2] for g in groups if g[0] == "0" and g[1] == ""), None)
        elif fstype == "cgroup" and "memory" in options.split(","):
            version, path = 1, next((g[2] for g in groups if "memory" in g[1].split(",")), None)
        else:
            continue
        if path is None:
            continue
        root = root.rstrip("/")
        if root and path != root and not path.startswith(root + "/"):
            continue  # this mount shows another part of the hierarchy
        relative = path[len(root) :].strip("/")
        parts = relative.split("/") if relative else []
        for depth in range(len(parts), -1, -1):  # the process's own cgroup, then each ancestor
            here = _cgroup_available(os.path.join(mountpoint, *parts[:depth]), version)
            if here is not None and (least is None or here < least):
                least = here
    return least


def _cgroup_available(directory: str, version: int) -> int | None:
    """Limit minus usage plus inactive file pages of the memory cgroup at ``directory``; None
    without a limit there (or no memory files: a v2 cgroup without the memory controller)."""
    names = (
        ("memory.max", "memory.current")
        if version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    try:
        with open(os.path.join(directory, names[0])) as fh:
            text = fh.read().strip()
        if text == "max" or not text.isdigit() or int(text) >= _NO_LIMIT:
            return None
        limit = int(text)
        with open(os.path.join(directory, names[1])) as fh:
            usage = int(fh.read().strip())
        inactive = 0
        wanted = "inactive_file" if version == 2 else "total_inactive_file"
        with open(os.path.join(directory, "memory.stat")) as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == wanted:
                    inactive = int(value)
                    break
    except (OSError, ValueError):
        return None
    return max(0, limit - usage + inactive)
