"""A private ``/dev/shm`` per simulated host.

Every namespace :mod:`~verl_fastsync.tools.netns` and :mod:`~verl_fastsync.tools.netns_star` make
shares this machine's ``/dev/shm``: code that finds the ranks of one host by a file in ``/dev/shm``
(as the engine's hosts layer does) would take every simulated host for one. :class:`ShmHosts` makes,
per simulated host, a persistent mount namespace (bound to a file, as ``ip netns`` binds network
namespaces) whose ``/dev/shm`` is a fresh ``tmpfs`` of ``size_mib``. A worker started with
``mount_ns=hosts.path(i)`` (:class:`~verl_fastsync.tools.netns_worker.NetnsWorker`) enters it with
``nsenter`` before ``ip netns exec``, which copies its caller's mounts into a mount namespace of its
own: the ``tmpfs`` (the same one) comes along, so every rank of host ``i``, whatever its network
namespace, shares host ``i``'s ``/dev/shm`` and no other host's.

The mount namespaces are made with ``--propagation slave``: mounts made later in this machine's
namespace (``ip netns add`` binds ``/run/netns/<name>``) still reach them, theirs never leave. Their
files live in ``/run/fastsync-shm/<prefix>-<pid>-<token>/`` (bound on itself and made private: a
mount namespace cannot be bound on a shared mount). :meth:`ShmHosts.close` (also at interpreter exit,
and on a failed open) unmounts and removes everything; what a killed creator left is swept by the
next :meth:`ShmHosts.open`. Needs root and util-linux's ``unshare`` and ``nsenter``;
:func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess

from verl_fastsync.tools.netns import _LIVE, _pid_alive, _run
from verl_fastsync.tools.netns import unavailable_reason as netns_unavailable_reason

__all__ = [
    "SHM_PREFIX",
    "SHM_ROOT",
    "ShmHosts",
    "ShmHostsUnavailableError",
    "sweep_stale",
    "unavailable_reason",
]

SHM_ROOT = "/run/fastsync-shm"
SHM_PREFIX = "fsm"


class ShmHostsUnavailableError(RuntimeError):
    """A private ``/dev/shm`` per simulated host cannot be made here; the message says why."""


class ShmHosts:
    """``hosts`` mount namespaces, each with its own ``/dev/shm`` (see the module docstring). Use as a
    context manager; :meth:`path` is what a worker of host ``i`` enters."""

    def __init__(self, hosts: int, size_mib: int, prefix: str = SHM_PREFIX) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 64:
            raise ValueError(f"hosts must be an int in [1, 64], got {hosts!r}")
        if isinstance(size_mib, bool) or not isinstance(size_mib, int) or size_mib < 1:
            raise ValueError(f"size_mib must be a positive int (MiB of /dev/shm per host), got {size_mib!r}")
        if not prefix.isalnum():
            raise ValueError(f"prefix must be letters/digits, got {prefix!r}")
        self.prefix, self.size_mib = prefix, size_mib
        self.dir = os.path.join(SHM_ROOT, f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}")
        self.paths = [os.path.join(self.dir, f"host{i}") for i in range(hosts)]
        self._open = False

    def path(self, host: int) -> str:
        """The mount namespace file of host ``host`` (``nsenter --mount=<path>``)."""
        if not self._open:
            raise RuntimeError("ShmHosts.path before open()")
        return self.paths[host]

    def open(self) -> ShmHosts:
        reason = _tools_missing()
        if reason is not None:
            raise ShmHostsUnavailableError(reason)
        sweep_stale(self.prefix)
        _LIVE.add(self)
        self._open = True
        try:
            os.makedirs(self.dir)
            _run(["mount", "--bind", self.dir, self.dir])
            _run(["mount", "--make-private", self.dir])
            for path in self.paths:
                with open(path, "w"):
                    pass
                _run(["unshare", f"--mount={path}", "--propagation", "slave", "mount", "-t", "tmpfs",
                      "-o", f"size={self.size_mib}m,mode=1777", "fastsync-shm", "/dev/shm"])  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Unmount and remove every host's file and the run's folder (idempotent)."""
        if self._open:
            _remove_dir(self.dir)
            self._open = False
        _LIVE.discard(self)

    def __enter__(self) -> ShmHosts:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_dir(folder: str) -> None:
    """Unmount the namespace files in ``folder``, then ``folder``'s own bind mount; remove it all. A
    namespace lives on while a process is in it and is freed, its ``tmpfs`` with it, when the last
    one leaves."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            with contextlib.suppress(Exception):
                _run(["umount", path], check=False)
    with contextlib.suppress(Exception):
        _run(["umount", folder], check=False)
    shutil.rmtree(folder, ignore_errors=True)


def sweep_stale(prefix: str = SHM_PREFIX) -> list[str]:
    """Remove the folders ``<prefix>-<pid>-...`` of :data:`SHM_ROOT` whose creator is gone; their names."""
    swept = []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(SHM_ROOT)):
            parts = name.split("-")
            if (
                len(parts) == 3
                and parts[0] == prefix
                and parts[1].isdigit()
                and not _pid_alive(int(parts[1]))
            ):
                _remove_dir(os.path.join(SHM_ROOT, name))
                swept.append(name)
    return swept


def _tools_missing() -> str | None:
    for tool in ("unshare", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"`{tool}` (util-linux) is not installed"
    return None


def unavailable_reason(probe: bool = True) -> str | None:
    """``None`` when simulated hosts with their own ``/dev/shm`` can be made here, else why not.
    ``probe``: also make (and remove) one such host."""
    reason = netns_unavailable_reason() or _tools_missing()
    if reason is not None or not probe:
        return reason
    try:
        with ShmHosts(1, 1, prefix=SHM_PREFIX + "probe"):
            pass
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"a mount namespace with its own /dev/shm cannot be made here: {exc}"
    return None
