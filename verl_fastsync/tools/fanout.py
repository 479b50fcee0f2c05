"""Fan-out figures: one trainer host, H rollout hosts of R ranks each, every host on its own
``tc``-shaped link to a switch (:class:`~verl_fastsync.tools.netns_star.NamespaceStar` with
``switch=True``); what each sync costs in seconds and in bytes on each link.

Two host kinds. ``link per host`` (cloud VMs): a namespace per host, one link each; the host's
ranks are processes in its namespace (trainer ranks too: with 4 senders the 4 trainer ranks share
the trainer host's one link, as on one VM). ``link per rank`` (rail-optimized hosts, a NIC per GPU):
a namespace per rank with its own link, trainer ranks included (4 senders = 4 rails); the ranks of
one host share ``/dev/shm`` (every namespace here does). Links are counted on the switch's side of
each veth (receive = what the host sent, transmit = what reached it), over the timed syncs only,
and reported as models per sync: per host, the sum of its links.

Rows, the same payload throughout (random bytes as ``bfloat16`` tensors; every trainer rank
produces the same): per host kind the raw link (one TCP stream, trainer host -> rollout host 0),
then per shape ``H x R`` verl's own ``NIXLCheckpointEngine`` (its chain, one sender:
:mod:`verl_fastsync.tools.fanout_peer`) and the ``fastsync`` engine (``gloo``, ``nixl``; each
``senders`` value, ``senders`` trainer ranks) driven through verl's engine protocol per sync
(prepare, build_topology, init_process_group, send_weights / receive_weights, finalize; the engine
kept from sync to sync as in verl) by :mod:`verl_fastsync.tools.crosshost_lanes_peer`. A sync is
timed from the first trainer rank starting to the last rollout rank holding every byte (copied
into its destination, checked by xxh3 digest on every sync, the untimed warm-up included); a row is
the median of ``repeats`` syncs after that warm-up. ``busy`` = the busiest link's bytes / (link rate
x seconds): near 1 the link is the limit, well below it something else is (the CPU, latency).

Run ``python -m verl_fastsync.tools.fanout [--quick] [--shapes 1x1,1x8] [--kinds host,rank] ...``;
the bench calls :func:`bench_section`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from verl_fastsync.tools.crosshost_lanes import _both
from verl_fastsync.tools.crosshost_peer import MIB
from verl_fastsync.tools.netns import unavailable_reason
from verl_fastsync.tools.netns_star import NamespaceStar
from verl_fastsync.tools.netns_worker import NetnsWorker

__all__ = ["FULL", "KINDS", "QUICK", "FanoutOptions", "bench_section", "label", "run_fanout"]

_RAW = "verl_fastsync.tools.crosshost_peer"
_ENG = "verl_fastsync.tools.crosshost_lanes_peer"
_VERL = "verl_fastsync.tools.fanout_peer"
KINDS = {"host": "link per host", "rank": "link per rank"}
"""Host kinds: the short name (options, command line) -> the label in rows and tables."""
TRANSPORTS = ("gloo", "nixl", "verl-nixl")
Shape = tuple[int, int]


@dataclasses.dataclass
class FanoutOptions:
    shapes: tuple[Shape, ...] = ((1, 1), (1, 8), (2, 4), (4, 2))
    """(rollout hosts, ranks per host); the first should be (1, 1): every row's "x 1x1" is against it."""
    kinds: tuple[str, ...] = ("host", "rank")
    senders: tuple[int, ...] = (1, 4)
    transports: tuple[str, ...] = TRANSPORTS
    payload_mib: int = 64
    bucket_mib: int = 8
    repeats: int = 3
    gbit: float = 2.0
    timeout_s: float = 300.0

    def check(self) -> None:
        for key in ("payload_mib", "bucket_mib", "repeats"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if not self.shapes or any(h < 1 or r < 1 for h, r in self.shapes):
            raise ValueError(f"shapes must be (hosts, ranks per host) pairs >= 1, got {self.shapes!r}")
        if not self.senders or any(k < 1 or k > 8 for k in self.senders):
            raise ValueError(f"senders must be ints in [1, 8], got {self.senders!r}")
        for name, allowed in (("kinds", tuple(KINDS)), ("transports", TRANSPORTS)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad or not getattr(self, name):
                raise ValueError(f"{name} {bad or '()'}: allowed: {', '.join(allowed)}")
        if "rank" in self.kinds and max(self.senders) + max(h * r for h, r in self.shapes) > 16:
            raise ValueError("link per rank: senders + rollout ranks must be at most 16 (one namespace each)")
        if not 0 < self.gbit <= 400:
            raise ValueError(f"gbit must be in (0, 400] Gbit/s, got {self.gbit!r}")


QUICK = FanoutOptions(
    shapes=((1, 1), (1, 4), (2, 2)), kinds=("host",), senders=(1,), payload_mib=16, repeats=2, timeout_s=120.0
)
FULL = FanoutOptions()


def label(kind: str, shape: Shape, senders: int, what: str) -> str:
    """A row's name, e.g. ``link per host 2x4, 1 sender: fastsync gloo``."""
    plural = "" if senders == 1 else "s"
    return f"{KINDS[kind]} {shape[0]}x{shape[1]}, {senders} sender{plural}: {what}"


class _Fleet:
    """The switch and its hosts for one host kind, with workers made on first use and kept from
    shape to shape (importing torch, NIXL and verl costs each process seconds)."""

    def __init__(self, kind: str, opts: FanoutOptions) -> None:
        self.kind, self.opts = kind, opts
        self.max_senders = max(opts.senders)
        if kind == "host":
            leaves = 1 + max(h for h, _ in opts.shapes)
        else:
            leaves = self.max_senders + max(h * r for h, r in opts.shapes)
        self.star = NamespaceStar(leaves, opts.gbit, switch=True)
        self.workers: dict[tuple[int, int], NetnsWorker] = {}

    def trainer_place(self, t: int) -> tuple[int, int]:
        return (0, t) if self.kind == "host" else (t, 0)

    def rollout_place(self, shape: Shape, j: int) -> tuple[int, int]:
        if self.kind == "host":
            return 1 + j // shape[1], j % shape[1]
        return self.max_senders + j, 0

    def worker(self, place: tuple[int, int]) -> NetnsWorker:
        if place not in self.workers:
            leaf = self.star.leaves[place[0]]
            env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": leaf.dev}
            self.workers[place] = self.star.spawn(leaf, env)
        return self.workers[place]

    def keep_only(self, places: set[tuple[int, int]]) -> None:
        """Stop the workers this shape does not use (bounds the processes alive at once)."""
        for place in [p for p in self.workers if p not in places]:
            self.drop(place)

    def drop(self, place: tuple[int, int] | None = None) -> None:
        for p in [place] if place is not None else list(self.workers):
            worker = self.workers.pop(p)
            with contextlib.suppress(Exception):
                worker.kill()
            if worker in self.star.workers:
                self.star.workers.remove(worker)

    def host_links(self, shape: Shape, senders: int) -> tuple[list[int], list[list[int]]]:
        """The leaves of the trainer host and of each rollout host."""
        hosts, ranks = shape
        if self.kind == "host":
            return [0], [[1 + h] for h in range(hosts)]
        trainer = list(range(senders))
        return trainer, [[self.max_senders + h * ranks + r for r in range(ranks)] for h in range(hosts)]


def _links(
    before: list[tuple[int, int]], after: list[tuple[int, int]], syncs: int, nbytes: int
) -> list[tuple[float, float]]:
    """Per link (models sent by its host, models received) per sync."""
    return [
        ((a[0] - b[0]) / syncs / nbytes, (a[1] - b[1]) / syncs / nbytes)
        for b, a in zip(before, after, strict=True)
    ]


def _sync_row(fleet: _Fleet, shape: Shape, senders: int, transport: str) -> dict[str, Any]:
    opts = fleet.opts
    nbytes, bucket, t = opts.payload_mib * MIB, opts.bucket_mib * MIB, opts.timeout_s
    n_rollout = shape[0] * shape[1]
    trainer_places = [fleet.trainer_place(i) for i in range(senders)]
    rollout_places = [fleet.rollout_place(shape, j) for j in range(n_rollout)]
    fleet.keep_only(
        set(trainer_places) | set(rollout_places) | {fleet.trainer_place(i) for i in range(fleet.max_senders)}
    )
    trainers = [fleet.worker(p) for p in trainer_places]
    rollouts = [fleet.worker(p) for p in rollout_places]
    ranks = [*trainers, *rollouts]
    verl = transport == "verl-nixl"
    peer = _VERL if verl else _ENG
    pre = "vn_" if verl else "eng_"
    calls: list[tuple[NetnsWorker, str, dict[str, Any]]] = []
    for i, w in enumerate(ranks):
        trainer = i < senders
        if verl:
            calls.append((w, f"{_VERL}:vn_new", {"trainer": trainer, "is_master": i == 0, "bucket": bucket}))
        else:
            kw = {"transport": transport, "senders": "all" if senders > 1 else 1, "trainer": trainer,
                  "is_master": i == 0, "bucket": bucket, "timeout_s": t}  # fmt: skip
            calls.append((w, f"{_ENG}:eng_new", kw))
    _both(calls, 2 * t)
    seconds: list[float] = []
    before: list[tuple[int, int]] = []
    for rep in range(opts.repeats + 1):
        if rep == 1:
            before = fleet.star.link_bytes()  # the warm-up (setup, first connections) is not counted
        metadata = _both([(w, f"{peer}:{pre}prepare", {}) for w in ranks], t)
        topo = {"n_actor": senders, "n_rollout": n_rollout, "metadata": metadata}
        kwargs = rollouts[0].call(f"{peer}:{pre}topology", topo, t)
        _both([(w, f"{peer}:{pre}init", {"kwargs": kw}) for w, kw in zip(ranks, kwargs, strict=True)], 2 * t)
        size = {"nbytes": nbytes, "bucket": bucket}
        ends = _both(
            [
                (w, f"{peer}:{pre}send" if i < senders else f"{peer}:{pre}receive", size)
                for i, w in enumerate(ranks)
            ],
            2 * t,
        )
        _both([(w, f"{peer}:{pre}finalize", {}) for w in ranks], t)
        wrong = [j for j, r in enumerate(ends[senders:]) if r["digest"] != ends[0]["digest"]]
        if wrong:
            raise RuntimeError(f"rollout ranks {wrong}: the received bytes differ from the trainer's model")
        seconds.append(max(r["end"] for r in ends[senders:]) - min(r["start"] for r in ends[:senders]))
    links = _links(before, fleet.star.link_bytes(), opts.repeats, nbytes)
    trainer_leaves, host_leaves = fleet.host_links(shape, senders)
    return {
        "seconds": seconds[1:],
        "trainer_link_models": sum(links[i][0] for i in trainer_leaves),
        "rollout_link_models": [sum(links[i][1] for i in leaves) for leaves in host_leaves],
        "rollout_out_models": [sum(links[i][0] for i in leaves) for leaves in host_leaves],
        "max_link_models": max(max(links[i]) for i in trainer_leaves + [i for h in host_leaves for i in h]),
    }


def _raw_row(fleet: _Fleet) -> dict[str, Any]:
    """One TCP stream from the trainer host to rollout host 0 (the link's own limit)."""
    opts = fleet.opts
    nbytes, t, reps = opts.payload_mib * MIB, opts.timeout_s, opts.repeats + 1
    sender = fleet.worker(fleet.trainer_place(0))
    receiver = fleet.worker(fleet.rollout_place((1, 1), 0))
    addr = fleet.star.leaves[fleet.rollout_place((1, 1), 0)[0]].addr
    before = fleet.star.link_bytes()
    port = receiver.call(f"{_RAW}:tcp_listen", {"addr": addr, "streams": 1}, t)
    sent, got = _both(
        [
            (
                sender,
                f"{_RAW}:tcp_send",
                {"addr": addr, "port": port, "nbytes": nbytes, "streams": 1, "repeats": reps},
            ),
            (receiver, f"{_RAW}:tcp_recv", {"nbytes": nbytes, "streams": 1, "repeats": reps}),
        ],
        2 * t,
    )
    links = _links(before, fleet.star.link_bytes(), reps, nbytes)
    for w in (sender, receiver):
        w.call(f"{_RAW}:reset", {}, 60)
    if sent["digest"] != got["digest"]:
        raise RuntimeError("raw TCP: the received bytes differ from the sent ones")
    trainer_leaves, host_leaves = fleet.host_links((1, 1), 1)
    return {
        "seconds": [e - s for s, e in zip(sent["starts"], got["ends"], strict=True)][1:],
        "trainer_link_models": links[trainer_leaves[0]][0],
        "rollout_link_models": [links[host_leaves[0][0]][1]],
        "rollout_out_models": [links[host_leaves[0][0]][0]],
        "max_link_models": max(links[trainer_leaves[0]][0], links[host_leaves[0][0]][1]),
    }


def _row(
    fleet: _Fleet | None,
    kind: str,
    shape: Shape,
    senders: int,
    what: str,
    measure: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    opts = fleet.opts if fleet else QUICK
    transport = {"raw TCP, 1 stream": "tcp", "verl NIXL engine": "nixl"}.get(what, what.rsplit(" ", 1)[-1])
    row: dict[str, Any] = {
        "row": label(kind, shape, senders, what),
        "kind": "raw" if what.startswith("raw") else "verl" if what.startswith("verl") else "fastsync",
        "transport": transport,
        "seconds": [],
        "bytes": opts.payload_mib * MIB,
        "status": "ok",
        "baseline": None if what.startswith(("raw", "verl")) else label(kind, shape, 1, "verl NIXL engine"),
        "note": "",
        "host_kind": KINDS[kind],
        "hosts": shape[0],
        "ranks_per_host": shape[1],
        "senders": senders,
        "link_gbit": float(opts.gbit),
        "trainer_link_models": None,
        "rollout_link_models": [],
        "rollout_out_models": [],
        "max_link_models": None,
        "busy": None,
        "vs_1x1": None,
    }
    try:
        row.update(measure())
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        row["status"] = f"error: {type(exc).__name__}: {text}"[:400]
        if fleet is not None:
            fleet.drop()  # a failed row may leave workers mid-protocol: the next row starts fresh ones
    if row["status"] == "ok" and row["seconds"]:
        link_bytes_per_s = opts.gbit * 1e9 / 8
        row["busy"] = (
            row["max_link_models"] * row["bytes"] / link_bytes_per_s / statistics.median(row["seconds"])
        )
    return row


def run_fanout(opts: FanoutOptions, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every row (see the module docstring): per host kind, one switch and its hosts; ``progress``
    gets a line per finished row."""
    opts.check()
    plan: list[tuple[str, Shape, int, str]] = []
    for kind in opts.kinds:
        plan.append((kind, (1, 1), 1, "raw TCP, 1 stream"))
        for shape in opts.shapes:
            if "verl-nixl" in opts.transports:
                plan.append((kind, shape, 1, "verl NIXL engine"))
            for tr in (t for t in opts.transports if t != "verl-nixl"):
                plan += [(kind, shape, k, f"fastsync {tr}") for k in opts.senders]
    reason = unavailable_reason()
    if reason is not None:

        def na() -> dict[str, Any]:
            raise RuntimeError("unreachable")

        rows = [_row(None, k, s, n, w, na) for k, s, n, w in plan]
        for r in rows:
            r["status"] = f"not available: network namespaces: {reason}"
        return rows
    rows = []
    for kind in opts.kinds:
        fleet = _Fleet(kind, opts)
        with fleet.star:
            for k, shape, senders, what in (p for p in plan if p[0] == kind):
                tr = "verl-nixl" if what.startswith("verl") else what.split()[-1]
                measure: Callable[[], dict[str, Any]] = (
                    functools.partial(_raw_row, fleet)
                    if what.startswith("raw")
                    else functools.partial(_sync_row, fleet, shape, senders, tr)
                )
                rows.append(_row(fleet, k, shape, senders, what, measure))
                if progress is not None:
                    r = rows[-1]
                    progress(f"{r['row']}: {r['status']}, {r['seconds']} s, links {r['trainer_link_models']}")
            fleet.drop()
    _fill_vs_1x1(rows)
    return rows


def _fill_vs_1x1(rows: list[dict[str, Any]]) -> None:
    """``vs_1x1`` = the row's median seconds / the 1x1 row's of the same kind, senders and transport
    (a time multiple: 1.0 = fan-out costs nothing)."""

    def key(r: dict[str, Any]) -> tuple[str, int, str]:
        return r["host_kind"], r["senders"], r["row"].split(": ", 1)[1]

    ones = {key(r): r for r in rows if (r["hosts"], r["ranks_per_host"]) == (1, 1) and r["status"] == "ok"}
    for r in rows:
        one = ones.get(key(r))
        if r["status"] == "ok" and one is not None and r["seconds"]:
            r["vs_1x1"] = statistics.median(r["seconds"]) / statistics.median(one["seconds"])


def bench_section(quick: bool) -> list[dict[str, Any]]:
    """The ``fanout`` section of ``verl-fastsync bench`` (:data:`QUICK` or :data:`FULL`)."""
    return run_fanout(dataclasses.replace(QUICK if quick else FULL))


def main(argv: list[str] | None = None) -> int:
    from verl_fastsync.tools.bench.report import fanout_table
    from verl_fastsync.tools.bench.schema import fill_ratios, normalize_external

    parser = argparse.ArgumentParser(
        prog="python -m verl_fastsync.tools.fanout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the bench's quick preset")
    parser.add_argument("--shapes", help="HOSTSxRANKS,... e.g. 1x1,1x8,2x4")
    parser.add_argument("--kinds", help="host,rank")
    parser.add_argument("--senders", help="e.g. 1,4")
    parser.add_argument("--transports", help=",".join(TRANSPORTS))
    parser.add_argument("--payload-mib", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--gbit", type=float)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    opts = dataclasses.replace(QUICK if args.quick else FULL)
    if args.shapes:
        opts.shapes = tuple((int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes.split(","))
    for key, conv in (("kinds", str), ("senders", int), ("transports", str)):
        if getattr(args, key):
            setattr(opts, key, tuple(conv(v) for v in getattr(args, key).split(",")))
    for key in ("payload_mib", "repeats", "gbit"):
        if getattr(args, key) is not None:
            setattr(opts, key, getattr(args, key))
    try:
        opts.check()
    except ValueError as exc:
        parser.error(str(exc))
    t0 = time.monotonic()
    rows = [normalize_external(r, "fanout") for r in run_fanout(opts, lambda m: print(m, file=sys.stderr))]
    fill_ratios(rows)
    print(json.dumps(rows, indent=1) if args.json else fanout_table(rows))
    print(
        f"# {opts.payload_mib} MiB, {opts.gbit:g} Gbit/s links, {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0 if all(not r["status"].startswith("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
