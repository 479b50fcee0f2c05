"""Which processes can share memory: an identity read from a file in ``/dev/shm``.

Two processes are one *host* for the one-copy-per-host layer (:mod:`verl_fastsync.transports.hosts`)
exactly when they can open the same POSIX shared-memory files, which is what the shm fan-out needs. A
hostname does not prove it (two containers may share a name and not ``/dev/shm``; one container may
see another's ``/dev/shm`` under a different name), so the identity is a random id *stored in*
``/dev/shm``: the first process to look creates the file (written under a private name, then linked
to the shared one: a reader never sees it half-written, and of two creators exactly one wins), every
later process reads it. Equal ids mean the processes read the same file, so they share the memory;
a process that cannot create or read it (no ``/dev/shm``, read-only, full) has no identity and runs
the direct path.
"""

from __future__ import annotations

import os
import uuid

__all__ = ["SHM_DIR", "host_identity"]

SHM_DIR = "/dev/shm"
_NAME = "verl_fastsync_host_id.{uid}"


def host_identity(directory: str = SHM_DIR) -> tuple[str | None, str]:
    """``(id, "")`` for this process's shared-memory domain, or ``(None, why)`` when it has none."""
    path = os.path.join(directory, _NAME.format(uid=os.getuid()))
    try:
        return _read(path), ""
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"
    private = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(private, "x", encoding="ascii") as out:
            out.write(uuid.uuid4().hex)
        try:
            os.link(private, path)
        except FileExistsError:
            pass  # another process made it first: its id is the host's
        finally:
            os.unlink(private)
        return _read(path), ""
    except (OSError, ValueError) as exc:
        return None, f"cannot create {path}: {exc}"


def _read(path: str) -> str:
    with open(path, encoding="ascii") as src:
        text = src.read().strip()
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"unexpected content {text[:40]!r}")
    return text
