"""Cross-host figures on one machine: gloo and nixl between two network namespaces, against the
raw link and the raw library, measured in the same run.

Two simulated hosts (:class:`~verl_fastsync.tools.netns.NamespacePair`: own network namespace,
hostname and veth address each) run one worker each; host ``a`` sends, host ``b`` receives. Every
row moves the same payload (random bytes) from ``a`` to ``b``, ``repeats`` times in all, spread over
``rounds`` passes through the rows (each pass with its own untimed warm-up per row, so a load that
drifts over minutes reaches every row alike), and checks after each pass that ``b`` holds exactly
``a``'s bytes (xxh3 digest).
A repeat's seconds run from the sender starting to the receiver holding every byte (both sides
read the same system-wide monotonic clock).

Rows: the raw link (TCP sockets, 1 and N streams; also under ``tc`` shaping), a raw
``torch.distributed`` gloo broadcast, fastsync's ``gloo`` engine transport, a raw NIXL WRITE with a
notification (both sides polling every 0.2 ms; in the full run also busy-polling, and with a target
that checks only every 50 ms, which shows what UCX over TCP costs when the target does not progress),
fastsync's ``nixl`` engine transport. NIXL runs on host memory over UCX with ``UCX_TLS=tcp`` bound
to the veth device. fastsync rows go through the public engine-transport API for each sync
(prepare, build_topology, init_process_group, send/receive, finalize); only send -> last byte
received is timed (the setup is in the note), and the receiver copies every tensor into its
preallocated destination, as a rollout's weight loader does (the raw rows land in one buffer).
Each row's ratio is against the fastest of its baseline candidates in the same run: raw rows against
the raw link, fastsync rows against the raw library. The peer side is
:mod:`verl_fastsync.tools.crosshost_peer`.

Run ``python -m verl_fastsync.tools.crosshost [--quick]``; the bench calls :func:`bench_section`.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_fastsync.tools.crosshost_peer import MIB, POLL_S
from verl_fastsync.tools.netns import NamespacePair, NetnsWorker, unavailable_reason

__all__ = ["CrosshostOptions", "bench_section", "format_rows", "run_section"]

_HERE = "verl_fastsync.tools.crosshost_peer"


@dataclass
class CrosshostOptions:
    payload_mib: int = 1024
    repeats: int = 5
    rounds: int = 2
    """The rows run one after another ``rounds`` times, each time with a share of ``repeats``
    (and its own warm-up): a load that changes over minutes then reaches every row alike."""
    bucket_mib: int = 64
    streams: int = 4
    shape_gbit: tuple[float, ...] = (10.0, 25.0)
    timeout_s: float = 300.0
    quick_rows: bool = False
    """Leave out the rows that only explain (busy-polling NIXL, NIXL with an idle target)."""
    only: str | None = None
    """Run only the rows whose label contains this text (and no shaped rows)."""

    def check(self) -> None:
        for key in ("payload_mib", "repeats", "rounds", "bucket_mib", "streams"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if any(not 0 < g <= 400 for g in self.shape_gbit):
            raise ValueError(f"shape_gbit values must be in (0, 400] Gbit/s, got {self.shape_gbit!r}")


QUICK = CrosshostOptions(
    payload_mib=128, repeats=3, rounds=1, shape_gbit=(10.0,), timeout_s=120.0, quick_rows=True
)

# --------------------------------------------------------------------------------------------------
# driver side


class _NotAvailable(Exception):
    pass


class _Run:
    """The pair, its two workers and the options of one section run."""

    def __init__(self, pair: NamespacePair, opts: CrosshostOptions) -> None:
        self.pair, self.opts = pair, opts
        self.nbytes = opts.payload_mib * MIB
        self.bucket = opts.bucket_mib * MIB
        self.repeats = opts.repeats  # timed repeats of the current round
        self.a: NetnsWorker | None = None
        self.b: NetnsWorker | None = None

    def workers(self) -> tuple[NetnsWorker, NetnsWorker]:
        if (
            self.a is None
            or self.b is None
            or self.a.proc.poll() is not None
            or self.b.proc.poll() is not None
        ):
            self.drop()
            envs = [{"UCX_TLS": "tcp", "UCX_NET_DEVICES": end.dev} for end in (self.pair.a, self.pair.b)]
            self.a = self.pair.spawn("a", env=envs[0])
            self.b = self.pair.spawn("b", env=envs[1])
        return self.a, self.b

    def drop(self) -> None:
        for w in (self.a, self.b):
            if w is not None:
                w.kill()
        self.a = self.b = None

    def both(self, fa: str, ka: dict[str, Any], fb: str, kb: dict[str, Any]) -> tuple[Any, Any]:
        """Run ``fb`` on ``b`` and ``fa`` on ``a`` at the same time."""
        a, b = self.workers()
        ib = b.submit(fb, kb)
        ia = a.submit(fa, ka)
        t = self.opts.timeout_s * 2
        return a.result(ia, t), b.result(ib, t)

    def reset(self) -> None:
        a, b = self.workers()
        a.call(f"{_HERE}:reset", timeout_s=60)
        b.call(f"{_HERE}:reset", timeout_s=60)

    def call(self, side: str, fn: str, **kwargs: Any) -> Any:
        """``fn`` of this module on worker ``side`` (``"a"`` or ``"b"``)."""
        a, b = self.workers()
        return (a if side == "a" else b).call(f"{_HERE}:{fn}", kwargs, timeout_s=self.opts.timeout_s)


def _timed(sent: dict[str, Any], got: dict[str, Any]) -> list[float]:
    if sent["digest"] != got["digest"]:
        raise RuntimeError(
            f"bytes differ after the transfer: sent xxh3 {sent['digest']}, got {got['digest']}"
        )
    return [end - start for start, end in zip(sent["starts"], got["ends"], strict=True)][
        1:
    ]  # drop the warm-up


def _tcp(run: _Run, streams: int) -> tuple[list[float], str]:
    reps = run.repeats + 1
    port = run.call("b", "tcp_listen", addr=run.pair.b.addr, streams=streams)
    sent, got = run.both(
        f"{_HERE}:tcp_send",
        {"addr": run.pair.b.addr, "port": port, "nbytes": run.nbytes, "streams": streams, "repeats": reps},
        f"{_HERE}:tcp_recv",
        {"nbytes": run.nbytes, "streams": streams, "repeats": reps},
    )
    return _timed(sent, got), f"{streams} TCP stream(s), sendall / recv_into(MSG_WAITALL)"


def _raw_gloo(run: _Run) -> tuple[list[float], str]:
    reps, t = run.repeats + 1, run.opts.timeout_s
    port = run.call("a", "gloo_store", addr=run.pair.a.addr, timeout_s=t)
    kw = {"addr": run.pair.a.addr, "port": port, "nbytes": run.nbytes, "repeats": reps, "timeout_s": t}
    sent, got = run.both(
        f"{_HERE}:gloo_broadcast", dict(kw, rank=0), f"{_HERE}:gloo_broadcast", dict(kw, rank=1)
    )
    return _timed(sent, got), "one ProcessGroupGloo.broadcast of the whole payload, default options"


def _fastsync(run: _Run, transport: str) -> tuple[list[float], str]:
    common = {"transport": transport, "bucket": run.bucket, "timeout_s": run.opts.timeout_s}
    starts, ends, setups, digests = [], [], [], ("", "")
    for _ in range(run.repeats + 1):
        t0 = time.monotonic()
        meta_a, meta_b = run.both(
            f"{_HERE}:fs_prepare",
            dict(common, is_master=True),
            f"{_HERE}:fs_prepare",
            dict(common, is_master=False),
        )
        kw_a, kw_b = run.call("a", "fs_topology", metadata=[meta_a, meta_b])
        run.both(f"{_HERE}:fs_init", {"kwargs": kw_a}, f"{_HERE}:fs_init", {"kwargs": kw_b})
        setups.append(time.monotonic() - t0)
        size = {"nbytes": run.nbytes, "bucket": run.bucket}
        sent, got = run.both(f"{_HERE}:fs_send", size, f"{_HERE}:fs_receive", size)
        run.both(f"{_HERE}:fs_finalize", {}, f"{_HERE}:fs_finalize", {})
        starts.append(sent["start"])
        ends.append(got["end"])
        digests = (sent["digest"], got["digest"])
    seconds = _timed({"starts": starts, "digest": digests[0]}, {"ends": ends, "digest": digests[1]})
    setup = statistics.median(setups[1:])
    return seconds, (
        f"{run.opts.bucket_mib} MiB buckets, default options; memory passes the raw rows do not make: "
        "the sender packs into a bucket, the receiver hands out tensors of their own and the consumer "
        f"copies them into its destination; setup per sync {setup:.2f} s (not timed)"
    )


def _raw_nixl(run: _Run, spin: bool, target_s: float, thread: bool) -> tuple[list[float], str]:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise _NotAvailable(f"nixl is not importable ({exc})") from exc
    reps, t = run.repeats + 1, run.opts.timeout_s
    peer = run.call("b", "nixl_agent", nbytes=run.nbytes, sender=False, progress_thread=thread)
    mine = run.call("a", "nixl_agent", nbytes=run.nbytes, sender=True, progress_thread=thread)
    sent, got = run.both(
        f"{_HERE}:nixl_write",
        {"peer": peer, "nbytes": run.nbytes, "repeats": reps, "spin": spin, "timeout_s": t},
        f"{_HERE}:nixl_wait",
        {"sender": mine["agent"], "repeats": reps, "interval_s": target_s, "timeout_s": t},
    )
    how = "busy-polls" if spin else f"polls every {POLL_S * 1e3:g} ms"
    target = "busy-polls" if not target_s else f"checks every {target_s * 1e3:g} ms"
    return _timed(sent, got), (
        f"one WRITE of the payload + notification; sender {how}, target {target}; "
        f"NIXL progress thread {'on' if thread else 'off'}"
    )


def _row(
    row: str,
    kind: str,
    transport: str,
    measure: Callable[[], tuple[list[float], str]],
    run: _Run | None,
    nbytes: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "row": row,
        "kind": kind,
        "transport": transport,
        "seconds": [],
        "bytes": nbytes,
        "status": "ok",
        "baseline": None,
        "note": "",
    }
    try:
        out["seconds"], out["note"] = measure()
    except _NotAvailable as exc:
        out["status"] = f"not available: {exc}"
    except Exception as exc:
        out["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        if run is not None:
            run.drop()  # a failed row may leave a worker mid-protocol: start fresh ones
    finally:
        if run is not None and run.a is not None:
            try:
                run.reset()
            except Exception:
                run.drop()
    return out


LINK_1 = "raw link: TCP, 1 stream"
LINK_N = "raw link: TCP, {n} streams"
RAW_GLOO = "raw gloo broadcast"
RAW_NIXL_SPIN = "raw NIXL WRITE (busy-poll)"
RAW_NIXL_POLL = "raw NIXL WRITE (0.2 ms poll)"
RAW_NIXL_THREAD = "raw NIXL WRITE (0.2 ms poll, progress thread)"
RAW_NIXL_IDLE = "raw NIXL WRITE (progress thread, target checks every 50 ms)"


def run_section(opts: CrosshostOptions) -> list[dict[str, Any]]:
    """Every row (see the module docstring), in one pair of namespaces. A row's baseline is the
    fastest of its candidate rows in this run (e.g. the faster raw NIXL wait mode)."""
    opts.check()
    nbytes = opts.payload_mib * MIB
    link = (LINK_1, LINK_N.format(n=opts.streams))
    nixl = (RAW_NIXL_SPIN, RAW_NIXL_POLL, RAW_NIXL_THREAD)
    raw_nixl = functools.partial(_raw_nixl, spin=False, target_s=POLL_S, thread=False)
    specs: list[tuple[str, str, str, tuple[str, ...], Callable[[_Run], tuple[list[float], str]]]] = [
        (link[0], "raw", "tcp", (), functools.partial(_tcp, streams=1)),
        (link[1], "raw", "tcp", (), functools.partial(_tcp, streams=opts.streams)),
        (RAW_GLOO, "raw", "gloo", link, _raw_gloo),
        ("fastsync gloo", "fastsync", "gloo", (RAW_GLOO,), functools.partial(_fastsync, transport="gloo")),
        (nixl[0], "raw", "nixl", link, functools.partial(raw_nixl, spin=True, target_s=0.0)),
        (nixl[1], "raw", "nixl", link, raw_nixl),
        (nixl[2], "raw", "nixl", link, functools.partial(raw_nixl, thread=True)),
        (RAW_NIXL_IDLE, "raw", "nixl", link, functools.partial(raw_nixl, target_s=0.05, thread=True)),
        ("fastsync nixl", "fastsync", "nixl", nixl, functools.partial(_fastsync, transport="nixl")),
    ]
    if opts.quick_rows:  # the quick run keeps the raw NIXL row configured as fastsync's agent is
        specs = [s for s in specs if s[0] not in (RAW_NIXL_SPIN, RAW_NIXL_THREAD, RAW_NIXL_IDLE)]
    for gbit in opts.shape_gbit:
        specs.append(
            (f"{link[1]}, tc {gbit:g} Gbit/s", "raw", "tcp", (), functools.partial(_shaped, gbit=gbit))
        )
    specs = [s for s in specs if opts.only is None or opts.only.lower() in s[0].lower()]
    reason = unavailable_reason()
    rows: dict[str, dict[str, Any]] = {}
    if reason is not None:
        rows = {s[0]: _row(s[0], s[1], s[2], _raise_na(reason), None, nbytes) for s in specs}
    else:
        with NamespacePair() as pair:
            run = _Run(pair, opts)
            try:
                for rnd in range(opts.rounds):
                    run.repeats = opts.repeats // opts.rounds + (rnd < opts.repeats % opts.rounds)
                    for label, kind, transport, _, fn in specs if run.repeats else ():
                        row = _row(label, kind, transport, functools.partial(fn, run), run, nbytes)
                        first = rows.setdefault(label, row)
                        if first is not row and first["status"] == "ok":
                            first["seconds"] += row["seconds"]
                            first["status"] = row["status"]
            finally:
                run.drop()
    median = {
        k: statistics.median(r["seconds"]) for k, r in rows.items() if r["status"] == "ok" and r["seconds"]
    }
    for label, *_, candidates, _fn in specs:
        measured = [c for c in candidates if c in median]
        rows[label]["baseline"] = (
            min(measured, key=median.__getitem__) if measured else (candidates or (None,))[0]
        )
    return list(rows.values())


def _shaped(run: _Run, gbit: float) -> tuple[list[float], str]:
    """The raw link under ``tc`` token-bucket shaping of both veth ends."""
    run.pair.shape(gbit)
    try:
        seconds, note = _tcp(run, streams=run.opts.streams)
    finally:
        run.pair.shape(None)
    return seconds, f"{note}; tc tbf {gbit:g} Gbit/s = {gbit / 8:.2f} GB/s on both veth ends"


def _raise_na(reason: str) -> Callable[[], tuple[list[float], str]]:
    def measure() -> tuple[list[float], str]:
        raise _NotAvailable(f"network namespaces cannot be made here: {reason}")

    return measure


def bench_section(quick: bool) -> list[dict[str, Any]]:
    """The bench's cross-host rows (quick: 128 MiB, 3 repeats, about 30-60 s on 2 cores)."""
    return run_section(QUICK if quick else CrosshostOptions())


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A text table: median seconds, GB/s, and the ratio (baseline seconds / row seconds)."""
    med = {r["row"]: statistics.median(r["seconds"]) for r in rows if r["status"] == "ok" and r["seconds"]}
    lines = [f"{'row':44} {'median s':>9} {'GB/s':>6} {'ratio':>6}  baseline / status"]
    for r in rows:
        if r["row"] not in med:
            lines.append(f"{r['row']:44} {'':>9} {'':>6} {'':>6}  {r['status']}")
            continue
        s = med[r["row"]]
        base = r["baseline"]
        ratio = f"{med[base] / s:6.2f}" if base in med else f"{'':>6}"
        lines.append(
            f"{r['row']:44} {s:9.3f} {r['bytes'] / s / 1e9:6.2f} {ratio}  {base or '-'}; {r['note']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_fastsync.tools.crosshost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="128 MiB, 3 repeats, one shaped link row")
    parser.add_argument("--payload-mib", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--rounds", type=int, help="run the rows this many times, sharing the repeats")
    parser.add_argument("--bucket-mib", type=int)
    parser.add_argument("--only", help="only the rows whose label contains this text")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    opts = CrosshostOptions(**vars(QUICK)) if args.quick else CrosshostOptions()
    for key in ("payload_mib", "repeats", "rounds", "bucket_mib", "only"):
        if getattr(args, key) is not None:
            setattr(opts, key, getattr(args, key))
    try:
        opts.check()
    except ValueError as exc:
        parser.error(str(exc))
    t0 = time.monotonic()
    rows = run_section(opts)
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows))
    print(
        f"# {opts.payload_mib} MiB x {opts.repeats} repeats, {time.monotonic() - t0:.0f} s", file=sys.stderr
    )
    return 0 if all(not r["status"].startswith("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
