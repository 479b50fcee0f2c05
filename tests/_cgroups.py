"""A real memory cgroup for tests (:func:`memory_cgroup`): a child of the test process's own, with a
limit, for processes that must see a container's memory limit."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _own_memory_cgroup() -> tuple[str, int] | None:
    """The directory of this process's memory cgroup and its version, where cgroupfs shows it."""
    groups = [line.rstrip("\n").split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    for fields in (line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()):
        sep = fields.index("-")
        root, mountpoint, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup" and "memory" in options.split(","):
            path = next((g[2] for g in groups if "memory" in g[1].split(",")), None)
            version = 1
        elif fstype == "cgroup2":
            path = next((g[2] for g in groups if g[0] == "0" and g[1] == ""), None)
            version = 2
        else:
            continue
        if path is None or not path.startswith(root):
            continue
        directory = os.path.join(mountpoint, path[len(root) :].lstrip("/"))
        if version == 2 and "memory" not in Path(directory, "cgroup.controllers").read_text().split():
            continue  # (a hybrid host: memory is a v1 controller)
        return directory, version
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[str, int]]:
    """A new child of this process's memory cgroup limited to ``limit`` bytes: (directory, cgroup
    version); a process joins it by writing its pid to ``cgroup.procs``. Skips the test where this
    machine does not let it make one (no memory cgroup, not root, v2 without the controller
    delegated). Removed when the block ends (its processes must have exited or left)."""
    own = _own_memory_cgroup()
    if own is None:
        pytest.skip("no memory cgroup visible in /proc/self/mountinfo")
    parent, version = own
    directory = os.path.join(parent, f"fastsync-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(directory)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here ({exc})")
    try:
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        try:
            Path(directory, name).write_text(str(limit))
        except OSError as exc:  # (v2: the parent does not delegate the memory controller)
            pytest.skip(f"cannot limit a memory cgroup here ({exc})")
        yield directory, version
    finally:
        for _ in range(100):  # the processes have exited; the kernel may take a moment to empty it
            try:
                os.rmdir(directory)
                break
            except OSError:
                time.sleep(0.1)
