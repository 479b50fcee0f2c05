"""What the workers of tests/test_fanout_hosts.py run inside their namespaces (called by name; kept
apart so that a worker does not import the test module and its probes)."""

from __future__ import annotations

import os


def put(name: str, text: str) -> None:
    with open(os.path.join("/dev/shm", name), "w") as fh:
        fh.write(text)


def peek(name: str) -> str | None:
    try:
        with open(os.path.join("/dev/shm", name)) as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def whoami() -> list[str]:
    import socket

    host = socket.gethostname()
    return [host, socket.gethostbyname(host)]
