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

Workers speak JSON lines (no pickle) over stdin/stdout:

* worker -> driver, once: ``{"type": "ready", "pid": ..., "netns": ..., "hostname": ...}``
* driver -> worker: ``{"type": "call", "id": n, "fn": "package.module:function", "kwargs": {...}}``
  or ``{"type": "exit"}``
* worker -> driver: ``{"type": "result", "id": n, "ok": true, "value": ...}`` or
  ``{"type": "result", "id": n, "ok": false, "error": "...", "traceback": "..."}``

Calls run one at a time in the worker; the function gets the JSON ``kwargs`` and returns a JSON
value. Anything the worker's libraries print goes to its stderr, never into the protocol stream.
Requires root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

__all__ = [
    "PREFIX",
    "Endpoint",
    "NamespacePair",
    "NetnsUnavailableError",
    "NetnsWorker",
    "WorkerError",
    "list_netns",
    "sweep_stale",
    "unavailable_reason",
]

PREFIX = "fsx"
"""Every namespace this module creates is named ``fsx-<pid>-<token>-a|b``."""

_BENCH_NET = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: reserved for benchmarking
_CMD_TIMEOUT_S = 60.0


class NetnsUnavailableError(RuntimeError):
    """Namespaces cannot be made here; the message says why."""


class WorkerError(RuntimeError):
    """A worker's call failed, the worker died, or it gave no answer in time."""


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


# --------------------------------------------------------------------------------------------------
# the pair


@dataclass(frozen=True)
class Endpoint:
    """One simulated host: its namespace, veth device, address and hostname."""

    netns: str
    dev: str
    addr: str
    hostname: str


_LIVE: set[NamespacePair] = set()


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
                etc = os.path.join("/etc/netns", end.netns)
                os.makedirs(etc, exist_ok=True)
                with open(os.path.join(etc, "hosts"), "w") as fh:
                    fh.write(f"127.0.0.1 localhost\n{end.addr} {end.hostname}\n")
            if self.rate_gbit is not None:
                self.shape(self.rate_gbit)
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, rate_gbit: float | None) -> None:
        """Token-bucket shape both ends' egress to ``rate_gbit`` Gbit/s (``None``: remove shaping)."""
        for end in (self.a, self.b):
            if rate_gbit is None:
                _run(
                    ["ip", "netns", "exec", end.netns, "tc", "qdisc", "del", "dev", end.dev, "root"],
                    check=False,
                )
                continue
            burst = max(1 << 20, int(rate_gbit * 1e9 / 8 / 250))  # >= 4 ms of traffic per refill
            _run(["ip", "netns", "exec", end.netns, "tc", "qdisc", "replace", "dev", end.dev, "root",
                  "tbf", "rate", f"{rate_gbit}gbit", "burst", str(burst), "latency", "20ms"])  # fmt: skip
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


# --------------------------------------------------------------------------------------------------
# the worker (driver side)


class NetnsWorker:
    """A Python process inside a namespace, driven over JSON lines (see the module docstring)."""

    def __init__(
        self, end: Endpoint, env: dict[str, str] | None = None, start_timeout_s: float = 120.0
    ) -> None:
        self.end = end
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env["NETNS_NAME"] = end.netns
        cmd = ["ip", "netns", "exec", end.netns, sys.executable, "-m", "verl_fastsync.tools.netns",
               "--worker", end.hostname]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        self._next_id = 0
        self._results: dict[int, dict[str, Any]] = {}
        self._eof = False
        self._cond = threading.Condition()
        self._stderr: deque[str] = deque(maxlen=60)
        threading.Thread(target=self._read_stdout, daemon=True, name=f"netns-{end.netns}-out").start()
        threading.Thread(target=self._read_stderr, daemon=True, name=f"netns-{end.netns}-err").start()
        self.info = self._wait_id(-1, start_timeout_s, "start")

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self._stderr.append(f"[not protocol] {line}")
                continue
            key = -1 if msg.get("type") == "ready" else int(msg.get("id", -2))
            with self._cond:
                self._results[key] = msg
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def stderr_tail(self, lines: int = 15) -> str:
        return "".join(list(self._stderr)[-lines:]).strip()

    def _fail(self, what: str) -> WorkerError:
        return WorkerError(f"worker in {self.end.netns}: {what}; its stderr ends with:\n{self.stderr_tail()}")

    def _wait_id(self, key: int, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._results:
                if self._eof:
                    code = self.proc.wait(timeout=10)
                    raise self._fail(f"exited with code {code} during {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(f"no answer to {what} within {timeout_s:.0f} s")
                self._cond.wait(min(left, 1.0))
            return self._results.pop(key)

    def submit(self, fn: str, kwargs: dict[str, Any] | None = None) -> int:
        """Start ``fn`` (``"package.module:function"``) with JSON ``kwargs``; returns the call id."""
        if self.proc.poll() is not None:
            raise self._fail(f"exited with code {self.proc.returncode} before {fn}")
        self._next_id += 1
        line = json.dumps({"type": "call", "id": self._next_id, "fn": fn, "kwargs": kwargs or {}})
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._fail(f"stdin closed ({exc}) before {fn}") from exc
        return self._next_id

    def result(self, call_id: int, timeout_s: float) -> Any:
        """The value of call ``call_id``; :class:`WorkerError` on failure, death or timeout."""
        msg = self._wait_id(call_id, timeout_s, f"call {call_id}")
        if not msg.get("ok"):
            raise WorkerError(
                f"worker in {self.end.netns}: {msg.get('error')}\n{msg.get('traceback', '')}".rstrip()
            )
        return msg.get("value")

    def call(self, fn: str, kwargs: dict[str, Any] | None = None, timeout_s: float = 300.0) -> Any:
        """:meth:`submit` then :meth:`result`."""
        return self.result(self.submit(fn, kwargs), timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"type": "exit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()


# --------------------------------------------------------------------------------------------------
# the worker (inside the namespace)

_CLONE_NEWUTS = 0x04000000


def _exit_with_driver() -> None:
    """End this worker when the driver that started it is gone (no orphan left in a namespace)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="netns-driver-watch").start()


def _become_host(hostname: str) -> None:
    """Own UTS namespace and hostname."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), f"unshare(CLONE_NEWUTS) failed: {os.strerror(ctypes.get_errno())}")
    import socket

    socket.sethostname(hostname)


def _resolve(fn: str) -> Any:
    module, sep, attr = fn.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"fn must be 'package.module:function', got {fn!r}")
    return getattr(importlib.import_module(module), attr)


def _worker_main(hostname: str) -> int:
    # protocol on a private copy of stdout; fd 1 (what C libraries and print use) goes to stderr
    proto: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _exit_with_driver()
    _become_host(hostname)
    netns = os.environ.get("NETNS_NAME", "")
    proto.write(
        json.dumps({"type": "ready", "pid": os.getpid(), "netns": netns, "hostname": hostname}) + "\n"
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            print(f"netns worker: not a JSON line: {line[:200]!r}", file=sys.stderr)
            continue
        if msg.get("type") == "exit":
            break
        call_id = msg.get("id")
        try:
            value = _resolve(str(msg.get("fn")))(**(msg.get("kwargs") or {}))
            text = json.dumps({"type": "result", "id": call_id, "ok": True, "value": value})
        except BaseException as exc:  # report to the driver (a value JSON cannot carry too), keep serving
            error = f"{type(exc).__name__}: {exc}"
            text = json.dumps(
                {
                    "type": "result",
                    "id": call_id,
                    "ok": False,
                    "error": error,
                    "traceback": traceback.format_exc(),
                }
            )
        proto.write(text + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2]))
    print("usage: python -m verl_fastsync.tools.netns --worker HOSTNAME (started by NamespacePair.spawn)")
    sys.exit(2)
