"""Multi-sender figures (``engine_kwargs.fastsync.senders``): K trainer hosts, one rollout host, each
trainer host on its own ``tc``-shaped link (:class:`~verl_fastsync.tools.netns_star.NamespaceStar`).

One run, the same payload throughout (random bytes as ``bfloat16`` tensors, one of 2.5 buckets then
16 MiB ones; every trainer rank produces the same): the raw baselines on link 0 (one TCP stream; a
raw gloo broadcast; a raw NIXL WRITE polled every 0.2 ms as fastsync's agent is), then per transport
the ``fastsync`` engine with ``max(K)`` trainer ranks (one per leaf) and one rollout rank, for each
``senders`` value. A sync is timed from the first trainer rank starting ``send_weights`` to the
rollout rank's consumer holding every byte (copied into its destination, checked by xxh3 digest);
each row is the median of ``repeats`` syncs after an untimed warm-up, the engine and its lanes reused
from sync to sync as in verl. ``speed-up`` = the ``senders=1`` row's seconds / the row's, same run;
``vs raw`` = the raw library's seconds on one link / the ``senders=1`` row's.

Run ``python -m verl_fastsync.tools.crosshost_lanes [--payload-mib N] [--gbit G] [--senders 1,2,4]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from verl_fastsync.tools.crosshost_peer import MIB, POLL_S
from verl_fastsync.tools.netns_star import NamespaceStar
from verl_fastsync.tools.netns_worker import NetnsWorker

__all__ = ["LanesOptions", "format_lanes", "run_lanes"]

_PEER = "verl_fastsync.tools.crosshost_peer"
_ENG = "verl_fastsync.tools.crosshost_lanes_peer"


@dataclass
class LanesOptions:
    payload_mib: int = 256
    bucket_mib: int = 8
    repeats: int = 3
    gbit: float = 2.0
    senders: tuple[int, ...] = (1, 2, 4)
    transports: tuple[str, ...] = ("gloo", "nixl")
    timeout_s: float = 300.0


def _both(pairs: list[tuple[NetnsWorker, str, dict[str, Any]]], timeout_s: float) -> list[Any]:
    """Every call's result, in order. When calls fail, every call is still waited for (each ends
    within its own timeout) and the error names each failed call by its position: the first one in
    order is often a rank that only waited for the rank that failed first."""
    ids = [(w, w.submit(fn, kw)) for w, fn, kw in pairs]
    results: list[Any] = []
    failed: list[tuple[int, Exception]] = []
    for index, (w, i) in enumerate(ids):
        try:
            results.append(w.result(i, timeout_s))
        except Exception as exc:
            failed.append((index, exc))
    if len(failed) == 1:
        raise failed[0][1]
    if failed:
        parts = [f"call {index}: {type(exc).__name__}: {_first_line(exc)}"[:300] for index, exc in failed]
        summary = f"{len(failed)} of {len(pairs)} calls failed: " + " | ".join(parts)
        raise RuntimeError(summary) from failed[0][1]
    return results


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _raw(a: NetnsWorker, b: NetnsWorker, star: NamespaceStar, opts: LanesOptions) -> dict[str, float]:
    nbytes, reps, t = opts.payload_mib * MIB, opts.repeats + 1, opts.timeout_s
    out: dict[str, float] = {}

    def timed(sent: dict[str, Any], got: dict[str, Any]) -> float:
        if sent["digest"] != got["digest"]:
            raise RuntimeError("raw row: bytes differ")
        return statistics.median([e - s for s, e in zip(sent["starts"], got["ends"], strict=True)][1:])

    port = b.call(f"{_PEER}:tcp_listen", {"addr": star.hub_addrs[0], "streams": 1}, t)
    sent, got = _both(
        [
            (
                a,
                f"{_PEER}:tcp_send",
                {"addr": star.hub_addrs[0], "port": port, "nbytes": nbytes, "streams": 1, "repeats": reps},
            ),
            (b, f"{_PEER}:tcp_recv", {"nbytes": nbytes, "streams": 1, "repeats": reps}),
        ],
        2 * t,
    )
    out["raw TCP, 1 stream"] = timed(sent, got)
    for w in (a, b):
        w.call(f"{_PEER}:reset", {}, 60)
    port = a.call(f"{_PEER}:gloo_store", {"addr": star.leaves[0].addr, "timeout_s": t}, t)
    kw = {"addr": star.leaves[0].addr, "port": port, "nbytes": nbytes, "repeats": reps, "timeout_s": t}
    sent, got = _both(
        [(a, f"{_PEER}:gloo_broadcast", dict(kw, rank=0)), (b, f"{_PEER}:gloo_broadcast", dict(kw, rank=1))],
        2 * t,
    )
    out["raw gloo broadcast"] = timed(sent, got)
    for w in (a, b):
        w.call(f"{_PEER}:reset", {}, 60)
    try:
        peer = b.call(f"{_PEER}:nixl_agent", {"nbytes": nbytes, "sender": False, "progress_thread": False}, t)
        mine = a.call(f"{_PEER}:nixl_agent", {"nbytes": nbytes, "sender": True, "progress_thread": False}, t)
        sent, got = _both(
            [
                (
                    a,
                    f"{_PEER}:nixl_write",
                    {"peer": peer, "nbytes": nbytes, "repeats": reps, "spin": False, "timeout_s": t},
                ),
                (
                    b,
                    f"{_PEER}:nixl_wait",
                    {"sender": mine["agent"], "repeats": reps, "interval_s": POLL_S, "timeout_s": t},
                ),
            ],
            2 * t,
        )
        out["raw NIXL WRITE"] = timed(sent, got)
    except Exception as exc:  # nixl not installed, or UCX refused
        print(f"raw NIXL WRITE: {exc}", file=sys.stderr)
    for w in (a, b):
        w.call(f"{_PEER}:reset", {}, 60)
    return out


def _engine_row(
    star: NamespaceStar,
    trainers: list[NetnsWorker],
    rollout: NetnsWorker,
    transport: str,
    senders: int,
    opts: LanesOptions,
) -> dict[str, Any]:
    nbytes, bucket, t = opts.payload_mib * MIB, opts.bucket_mib * MIB, opts.timeout_s
    ranks = [*trainers, rollout]
    count = "all" if senders >= len(trainers) else senders
    _both(
        [
            (
                w,
                f"{_ENG}:eng_new",
                {
                    "transport": transport,
                    "senders": count,
                    "trainer": i < len(trainers),
                    "is_master": i == 0,
                    "bucket": bucket,
                    "timeout_s": t,
                },
            )
            for i, w in enumerate(ranks)
        ],
        t,
    )
    seconds, per_sender = [], []
    rx_before = star.rx_bytes()
    for _ in range(opts.repeats + 1):
        metadata = _both([(w, f"{_ENG}:eng_prepare", {}) for w in ranks], t)
        kwargs = rollout.call(
            f"{_ENG}:eng_topology", {"n_actor": len(trainers), "n_rollout": 1, "metadata": metadata}, t
        )
        _both([(w, f"{_ENG}:eng_init", {"kwargs": kw}) for w, kw in zip(ranks, kwargs, strict=True)], 2 * t)
        size = {"nbytes": nbytes, "bucket": bucket}
        results = _both(
            [(w, f"{_ENG}:eng_send" if w is not rollout else f"{_ENG}:eng_receive", size) for w in ranks],
            2 * t,
        )
        _both([(w, f"{_ENG}:eng_finalize", {}) for w in ranks], t)
        if results[-1]["digest"] != results[0]["digest"]:
            raise RuntimeError(
                f"{transport} senders={senders}: the rollout rank's bytes differ from the model"
            )
        seconds.append(results[-1]["end"] - min(r["start"] for r in results[:-1]))
        per_sender = [r["bytes"] for r in results[:-1]]
    _both([(w, f"{_ENG}:eng_close", {}) for w in ranks], t)
    rx = [
        (after - before) / (opts.repeats + 1)
        for before, after in zip(rx_before, star.rx_bytes(), strict=True)
    ]
    return {
        "link_bytes_per_sync": rx,
        "transport": transport,
        "senders": senders,
        "seconds": statistics.median(seconds[1:]),
        "all_seconds": seconds[1:],
        "bytes_per_link": per_sender,
    }


def run_lanes(opts: LanesOptions) -> dict[str, Any]:
    """Raw baselines and every (transport, senders) row; see the module docstring."""
    leaves = max(opts.senders)
    with NamespaceStar(leaves, opts.gbit) as star:
        env = {"UCX_TLS": "tcp"}
        trainers = [star.spawn(leaf, dict(env, UCX_NET_DEVICES=leaf.dev)) for leaf in star.leaves]
        rollout = star.spawn(star.hub, dict(env, UCX_NET_DEVICES=",".join(star.hub_devs)))
        raw = _raw(trainers[0], rollout, star, opts)
        rows = [
            _engine_row(star, trainers, rollout, tr, k, opts) for tr in opts.transports for k in opts.senders
        ]
    single = {r["transport"]: r["seconds"] for r in rows if r["senders"] == 1}
    for row in rows:
        row["speedup"] = single[row["transport"]] / row["seconds"] if row["transport"] in single else None
    return {"options": vars(opts), "raw": raw, "rows": rows}


def format_lanes(result: dict[str, Any]) -> str:
    opts = result["options"]
    nbytes = opts["payload_mib"] * MIB
    raw = result["raw"]
    lines = [
        f"# {opts['payload_mib']} MiB, {opts['bucket_mib']} MiB buckets, {opts['gbit']:g} Gbit/s per link"
    ]
    for label, s in raw.items():
        lines.append(f"{label:34} {s:8.3f} s {nbytes / s / 1e9:6.3f} GB/s")
    base = {"gloo": raw.get("raw gloo broadcast"), "nixl": raw.get("raw NIXL WRITE")}
    header = f"{'transport':9} {'senders':>7} {'s/sync':>8} {'GB/s':>6} {'speed-up':>8} {'vs raw':>6}"
    lines.append(header + "  MiB sent per sender; MiB per link (veth counters, all traffic)")
    for r in result["rows"]:
        vs = base.get(r["transport"])
        ratio = f"{vs / r['seconds']:6.2f}" if vs and r["senders"] == 1 else f"{'':>6}"
        links = ", ".join(f"{b / MIB:.0f}" for b in r["bytes_per_link"])
        links += "; " + ", ".join(f"{b / MIB:.0f}" for b in r["link_bytes_per_sync"])
        lines.append(
            f"{r['transport']:9} {r['senders']:7d} {r['seconds']:8.3f} {nbytes / r['seconds'] / 1e9:6.3f} "
            f"{r['speedup']:8.2f} {ratio}  {links}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_fastsync.tools.crosshost_lanes")
    parser.add_argument("--payload-mib", type=int, default=256)
    parser.add_argument("--bucket-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gbit", type=float, default=2.0)
    parser.add_argument("--senders", default="1,2,4")
    parser.add_argument("--transports", default="gloo,nixl")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    opts = LanesOptions(
        payload_mib=args.payload_mib,
        bucket_mib=args.bucket_mib,
        repeats=args.repeats,
        gbit=args.gbit,
        senders=tuple(int(k) for k in args.senders.split(",")),
        transports=tuple(args.transports.split(",")),
    )
    t0 = time.monotonic()
    result = run_lanes(opts)
    print(json.dumps(result, indent=1) if args.json else format_lanes(result))
    print(f"# {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
