"""Python workers inside a network namespace, driven over JSON lines (no pickle).

:meth:`verl_fastsync.tools.netns.NamespacePair.spawn` starts one with ``ip netns exec`` in a private
UTS namespace whose hostname resolves to that side's veth address; :class:`NetnsWorker` is the
driver's handle, :func:`worker_main` what runs inside (``python -m verl_fastsync.tools.netns_worker
--worker HOSTNAME``).

Workers speak JSON lines (no pickle) over stdin/stdout:

* worker -> driver, once: ``{"type": "ready", "pid": ..., "netns": ..., "hostname": ...}``
* driver -> worker: ``{"type": "call", "id": n, "fn": "package.module:function", "kwargs": {...}}``
  or ``{"type": "exit"}``
* worker -> driver: ``{"type": "result", "id": n, "ok": true, "value": ...}`` or
  ``{"type": "result", "id": n, "ok": false, "error": "...", "traceback": "..."}``

Calls run one at a time in the worker; the function gets the JSON ``kwargs`` and returns a JSON
value. Anything the worker's libraries print goes to its stderr, never into the protocol stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from verl_fastsync.tools.netns import Endpoint

__all__ = ["CPUS_ENV", "NetnsWorker", "WorkerError", "worker_main"]

CPUS_ENV = "FASTSYNC_NETNS_CPUS"
"""Environment variable of a worker (``env`` of :meth:`NamespaceStar.spawn`): the CPUs it runs on,
comma-separated, set before it runs anything (one CPU per side: two hosts that do not share cores)."""


class WorkerError(RuntimeError):
    """A worker's call failed, the worker died, or it gave no answer in time."""


# --------------------------------------------------------------------------------------------------
# the worker (driver side)


class NetnsWorker:
    """A Python process inside a namespace, driven over JSON lines (see the module docstring)."""

    def __init__(
        self,
        end: Endpoint,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        mount_ns: str | None = None,
        hostname: str | None = None,
    ) -> None:
        """``mount_ns``: a mount namespace file to enter first (a simulated host's own ``/dev/shm``,
        :class:`~verl_fastsync.tools.netns_shm.ShmHosts`); ``ip netns exec`` copies its mounts.
        ``hostname``: the worker's hostname (default ``end.hostname``; another name must resolve in
        ``end``'s namespace too: :meth:`~verl_fastsync.tools.netns_star.NamespaceStar.add_name`)."""
        self.end = end
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env["NETNS_NAME"] = end.netns
        cmd = ["ip", "netns", "exec", end.netns, sys.executable, "-m", "verl_fastsync.tools.netns_worker",
               "--worker", hostname or end.hostname]  # fmt: skip
        if mount_ns is not None:
            cmd = ["nsenter", f"--mount={mount_ns}", *cmd]
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


def worker_main(hostname: str) -> int:
    # protocol on a private copy of stdout; fd 1 (what C libraries and print use) goes to stderr
    proto: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _exit_with_driver()
    _become_host(hostname)
    cpus = os.environ.get(CPUS_ENV)
    if cpus:  # before anything sizes itself by the CPUs it may use (e.g. the delta codec's threads)
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
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
        sys.exit(worker_main(sys.argv[2]))
    print(
        "usage: python -m verl_fastsync.tools.netns_worker --worker HOSTNAME (started by NamespacePair.spawn)"
    )
    sys.exit(2)
