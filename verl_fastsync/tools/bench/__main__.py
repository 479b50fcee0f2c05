"""The bench's child processes: ``python -m verl_fastsync.tools.bench <command> ...`` (hidden;
started by the bench itself, see :mod:`verl_fastsync.tools.bench.protocol`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main_child(argv: Sequence[str]) -> int:
    from verl_fastsync.tools.bench.protocol import exit_with_parent

    if not argv:
        raise SystemExit(
            "verl_fastsync.tools.bench runs the bench's child processes; use `verl-fastsync bench`"
        )
    cmd, *rest = argv
    exit_with_parent()
    if cmd == "_cleanup-child":
        from verl_fastsync.tools.bench.cleanup import cleanup_child

        heap, repeats, policies, cached = rest
        cleanup_child(int(heap), int(repeats), policies.split(","), int(cached))
    elif cmd == "_worker":
        from verl_fastsync.tools.bench.worker import worker_main

        worker_main(rest[0])
    else:
        raise SystemExit(f"unknown bench child command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main_child(sys.argv[1:]))
