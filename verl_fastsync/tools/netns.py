"""Two simulated hosts on one machine: a pair of network namespaces joined by a veth link.

:class:`NamespacePair` creates two network namespaces with unique names, joins them with a veth
pair created directly inside them (the link never exists in the root namespace), gives each end an
address from the RFC 2544 benchmarking range ``198.18.0.0/15`` that exists only inside its
namespace (no route to it anywhere else), optionally shapes both ends with ``tc`` (token bucket),
and deletes everything again on exit, on an exception and on Ctrl-C/SIGTERM. Namespaces left by a
process that was killed outright are swept by the next pair (their names carry the creator's pid).

Each side also looks like a separate host: :meth:`NamespacePair.spawn` starts a Python worker with
``ip netns exec`` in a private UTS namespace whose hostname resolves (through
``/etc/netns/<name>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``) to that side's
veth address, so code that advertises "this host's address" advertises the link's.

The workers and their JSON-lines protocol: :mod:`verl_fastsync.tools.netns_worker`.
Requires root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

from verl_fastsync.tools.netns_worker import NetnsWorker, WorkerError

__all__ = [
    "PREFIX",
    "Endpoint",
    "NamespacePair",
    "NetnsUnavailableError",
    "NetnsWorker",
    "WorkerError",
    "list_netns",
    "shape_device",
    "sweep_stale",
    "unavailable_reason",
    "write_hosts",
]

PREFIX = "fsx"
"""Every namespace this module creates is named ``fsx-<pid>-<token>-a|b``."""

_BENCH_NET = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: reserved for benchmarking
_CMD_TIMEOUT_S = 60.0


class NetnsUnavailableError(RuntimeError):
    """Namespaces cannot be made here; the message says why."""


# --------------------------------------------------------------------------------------------------
# ip / tc plumbing


def _run(args: list[str], check: bool = True, timeout_s: float = _CMD_TIMEOUT_S) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def list_netns() -> set[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"])
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def unavailable_reason() -> str | None:
    """``None`` when namespace pairs can be made here, else why not (for a skip message)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    try:
        with open("/proc/self/status") as fh:
            caps = next((int(line.split()[1], 16) for line in fh if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    missing = [name for name, bit in (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21)) if not caps >> bit & 1]
    if missing:
        return f"creating network namespaces needs {' and '.join(missing)} (run as root)"
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", probe])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed here: {exc}"
    with contextlib.suppress(Exception):
        _run(["ip", "netns", "del", probe])
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_netns(name: str) -> None:
    with contextlib.suppress(Exception):
        _run(["ip", "netns", "del", name], check=False)
    shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-...`` whose creating process is gone; their names."""
    swept = []
    for name in sorted(list_netns()):
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _delete_netns(name)
            swept.append(name)
    return swept


def _root_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show"]).splitlines():
        dest = line.split()[0] if line.strip() else "default"
        if dest != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(dest, strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    """A random /30 of the benchmarking range that no root-namespace address or route overlaps."""
    taken = _root_networks()
    blocks = _BENCH_NET.num_addresses // 4
    for _ in range(64):
        base = _BENCH_NET.network_address + 4 * secrets.randbelow(blocks)
        net = ipaddress.IPv4Network(f"{base}/30")
        if not any(net.overlaps(other) for other in taken):
            return net
    raise RuntimeError(f"no free /30 in {_BENCH_NET} (every candidate overlaps a root-namespace route)")


def write_hosts(end: Endpoint) -> None:
    """``/etc/netns/<netns>/hosts`` (mounted over ``/etc/hosts`` by ``ip netns exec``): the
    namespace's hostname resolves to its address."""
    etc = os.path.join("/etc/netns", end.netns)
    os.makedirs(etc, exist_ok=True)
    with open(os.path.join(etc, "hosts"), "w") as fh:
        fh.write(f"127.0.0.1 localhost\n{end.addr} {end.hostname}\n")


def shape_device(netns: str, dev: str, rate_gbit: float | None) -> None:
    """Token-bucket shape ``dev``'s egress (in ``netns``) to ``rate_gbit`` Gbit/s; ``None``: unshaped."""
    if rate_gbit is None:
        _run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        return
    burst = max(1 << 20, int(rate_gbit * 1e9 / 8 / 250))  # >= 4 ms of traffic per refill
    _run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root",
          "tbf", "rate", f"{rate_gbit}gbit", "burst", str(burst), "latency", "20ms"])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the pair


@dataclass(frozen=True)
class Endpoint:
    """One simulated host: its namespace, veth device, address and hostname."""

    netns: str
    dev: str
    addr: str
    hostname: str


_LIVE: set[Any] = set()
"""Every open pair (and :class:`~verl_fastsync.tools.netns_star.NamespaceStar`): closed at exit."""


def _close_all_live() -> None:
    for pair in list(_LIVE):
        pair.close()


atexit.register(_close_all_live)


class NamespacePair:
    """Two namespaces and a veth link between them (see the module docstring). Use as a context
    manager; :meth:`close` is idempotent and also runs at interpreter exit and on SIGTERM."""

    def __init__(self, rate_gbit: float | None = None, prefix: str = PREFIX) -> None:
        if rate_gbit is not None and not (isinstance(rate_gbit, int | float) and 0 < rate_gbit <= 400):
            raise ValueError(f"rate_gbit must be a number of Gbit/s in (0, 400] or None, got {rate_gbit!r}")
        if not prefix.isalnum() or len(prefix) > 4:
            raise ValueError(
                f"prefix must be 1-4 letters/digits (it is part of device names), got {prefix!r}"
            )
        self.prefix = prefix
        self.rate_gbit = rate_gbit
        token = secrets.token_hex(3)
        self.token = token
        net = _pick_subnet()
        hosts = list(net.hosts())
        self.a = Endpoint(
            f"{prefix}-{os.getpid()}-{token}-a", f"{prefix}{token}a", str(hosts[0]), f"{prefix}-{token}-a"
        )
        self.b = Endpoint(
            f"{prefix}-{os.getpid()}-{token}-b", f"{prefix}{token}b", str(hosts[1]), f"{prefix}-{token}-b"
        )
        self.prefixlen = net.prefixlen
        self.workers: list[NetnsWorker] = []
        self._open = False
        self._old_sigterm: Any = None

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> NamespacePair:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        sweep_stale(self.prefix)
        _LIVE.add(self)
        self._open = True
        self._install_sigterm()
        try:
            for end in (self.a, self.b):
                _run(["ip", "netns", "add", end.netns])
            _run(["ip", "link", "add", self.a.dev, "netns", self.a.netns, "type", "veth",
                  "peer", "name", self.b.dev, "netns", self.b.netns])  # fmt: skip
            for end in (self.a, self.b):
                _run(["ip", "-n", end.netns, "addr", "add", f"{end.addr}/{self.prefixlen}", "dev", end.dev])
                _run(["ip", "-n", end.netns, "link", "set", "lo", "up"])
                _run(["ip", "-n", end.netns, "link", "set", end.dev, "up"])
                write_hosts(end)
            if self.rate_gbit is not None:
                self.shape(self.rate_gbit)
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, rate_gbit: float | None) -> None:
        """Token-bucket shape both ends' egress to ``rate_gbit`` Gbit/s (``None``: remove shaping)."""
        for end in (self.a, self.b):
            shape_device(end.netns, end.dev, rate_gbit)
        self.rate_gbit = rate_gbit

    def close(self) -> None:
        """Stop the workers, delete both namespaces (and with them the veth pair)."""
        for worker in self.workers:
            worker.kill()
        self.workers = []
        if self._open:
            for end in (self.a, self.b):
                _delete_netns(end.netns)
            self._open = False
        _LIVE.discard(self)
        self._restore_sigterm()

    def __enter__(self) -> NamespacePair:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return  # someone else handles it; atexit still cleans up when they exit normally

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)  # unwinds through __exit__/finally, then atexit

        self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- workers ---------------------------------------------------------------------------------

    def endpoint(self, side: str) -> Endpoint:
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        return self.a if side == "a" else self.b

    def spawn(
        self, side: str, env: dict[str, str] | None = None, start_timeout_s: float = 120.0
    ) -> NetnsWorker:
        """A Python worker inside ``side``'s namespace (and its own hostname)."""
        if not self._open:
            raise RuntimeError("NamespacePair.spawn before open()")
        end = self.endpoint(side)
        worker = NetnsWorker(end, env=env, start_timeout_s=start_timeout_s)
        self.workers.append(worker)
        return worker
