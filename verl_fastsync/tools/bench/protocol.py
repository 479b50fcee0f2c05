"""The bench's child processes and the JSON-lines protocol they speak.

A child is ``python -m verl_fastsync.tools.bench <command> ...``. It reads one JSON command per line
on stdin and answers with JSON lines on stdout, each prefixed with :data:`MARK` (anything else a
library prints on stdout is ignored). A child ends when its parent is gone, so no orphan stays
blocked in a transfer.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

MARK = "@@verl-fastsync-bench "


def emit(obj: dict[str, Any]) -> None:
    """One answer line from a child."""
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def pack(obj: Any) -> str:
    """Transport metadata (may hold bytes) -> text for the JSON-lines channel (msgpack, base64)."""
    import msgspec

    return base64.b64encode(msgspec.msgpack.encode(obj)).decode("ascii")


def unpack(text: str) -> Any:
    import msgspec

    return msgspec.msgpack.decode(base64.b64decode(text))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def exit_with_parent() -> None:
    """End this child when the bench that started it is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-parent-watch").start()


class Child:
    """A child process speaking JSON lines (marked with :data:`MARK`) on stdout, commands on stdin."""

    def __init__(self, args: Sequence[str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_fastsync.tools.bench", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.name = " ".join(args)
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                with self._cond:
                    self._lines.append(line[len(MARK) :])
                    self._cond.notify_all()
        with self._cond:
            self._lines.append("")  # EOF marker
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-40]

    def stderr_tail(self) -> str:
        return "".join(self._stderr[-8:]).strip()

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"child {self.name} gave no answer in {limit:.0f} s")
                self._cond.wait(left)
            line = self._lines.pop(0)
        if not line:
            self.proc.wait(timeout=5)
            raise RuntimeError(
                f"child {self.name} exited with {self.proc.returncode}: {self.stderr_tail()[-800:]}"
            )
        result: dict[str, Any] = json.loads(line)
        return result

    def try_recv(self) -> dict[str, Any] | None:
        """The next answer if one is waiting, else None (an exited child raises RuntimeError)."""
        with self._cond:
            if not self._lines:
                return None
        return self.recv(timeout_s=1)

    def wait_any(self, timeout_s: float) -> None:
        """Block until an answer is waiting or ``timeout_s`` passed."""
        with self._cond:
            if not self._lines:
                self._cond.wait(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.send({"op": "exit"})
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
