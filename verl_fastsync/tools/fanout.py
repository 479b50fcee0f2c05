"""Fan-out figures: one trainer host, H rollout hosts of R ranks each, every host on its own
``tc``-shaped link to a switch (:class:`~verl_fastsync.tools.netns_star.NamespaceStar` with
``switch=True``); what each sync costs in seconds and in bytes on each link.

Two host kinds. ``link per host`` (cloud VMs): a namespace per host, one link each; the host's
ranks are processes in its namespace (trainer ranks too: with 4 senders the 4 trainer ranks share
the trainer host's one link, as on one VM). ``link per rank`` (rail-optimized hosts, a NIC per GPU):
a namespace per rank with its own link, trainer ranks included (4 senders = 4 rails); the ranks of one
host share its hostname, each resolving it to its own link's address. Every simulated
host, the trainer's included, has its own ``/dev/shm`` (:class:`~verl_fastsync.tools.netns_shm.ShmHosts`:
a mount namespace per host, a ``tmpfs`` of ``shm_mib``), shared by that host's ranks only, whatever
their network namespaces: the engine's hosts layer, which finds the ranks of one host by a file in
``/dev/shm``, sees the hosts of the shape. Links are counted on the switch's side of
each veth (receive = what the host sent, transmit = what reached it), over the timed syncs only,
and reported as models per sync: per host, the sum of its links.

Rows, the same payload throughout (random bytes as ``bfloat16`` tensors; every trainer rank
produces the same): per host kind the raw link (one TCP stream, trainer host -> rollout host 0),
then per shape ``H x R`` verl's own ``NIXLCheckpointEngine`` (its chain, one sender:
:mod:`verl_fastsync.tools.fanout_peer`) and the ``fastsync`` engine (``gloo``, ``nixl``; each
``senders`` value, ``senders`` trainer ranks; each ``hosts`` value: ``default`` passes no
``hosts`` key, i.e. what a user gets, ``auto`` / ``off`` pass ``engine_kwargs.fastsync.hosts``, rows
"not available" where the engine has no such key) driven through verl's engine protocol per sync
(prepare, build_topology, init_process_group, send_weights / receive_weights, finalize; the engine
kept from sync to sync as in verl) by :mod:`verl_fastsync.tools.crosshost_lanes_peer`. A sync is
timed from the first trainer rank starting to the last rollout rank holding every byte (copied
into its destination, checked by xxh3 digest on every sync, the untimed warm-up included); a row is
the median of ``repeats`` syncs after that warm-up. ``busy`` = the busiest link's bytes / (link rate
x seconds): near 1 the link is the limit, well below it something else is (the CPU, latency).

Run ``python -m verl_fastsync.tools.fanout [--quick] [--shapes 1x1,1x8] [--kinds host,rank]
[--hosts default,off] ...``;
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
from verl_fastsync.tools.fanout_rows import (
    KINDS,
    Shape,
    fastsync_what,
    fill_vs_1x1,
    hosts_key_missing,
    label,
    parse_what,
)
from verl_fastsync.tools.netns import unavailable_reason
from verl_fastsync.tools.netns_shm import ShmHosts
from verl_fastsync.tools.netns_shm import unavailable_reason as shm_unavailable_reason
from verl_fastsync.tools.netns_star import NamespaceStar
from verl_fastsync.tools.netns_worker import NetnsWorker

__all__ = ["FULL", "KINDS", "QUICK", "FanoutOptions", "bench_section", "label", "run_fanout"]

_RAW = "verl_fastsync.tools.crosshost_peer"
_ENG = "verl_fastsync.tools.crosshost_lanes_peer"
_VERL = "verl_fastsync.tools.fanout_peer"
TRANSPORTS = ("gloo", "nixl", "verl-nixl")
HOSTS = ("default", "auto", "off")
"""``hosts`` values of the fastsync rows: ``default`` passes no ``hosts`` key (the engine's default),
``auto`` / ``off`` pass ``engine_kwargs.fastsync.hosts``."""
Place = tuple[int, int, int]
"""A worker's place: (leaf = its link's namespace, its index there, its host = its ``/dev/shm``)."""


@dataclasses.dataclass
class FanoutOptions:
    shapes: tuple[Shape, ...] = ((1, 1), (1, 8), (2, 4), (4, 2))
    """(rollout hosts, ranks per host); the first should be (1, 1): every row's "x 1x1" is against it."""
    rank_shapes: tuple[Shape, ...] | None = None
    """The shapes of the ``link per rank`` kind; ``None``: :attr:`shapes`."""
    kinds: tuple[str, ...] = ("host", "rank")
    senders: tuple[int, ...] = (1, 4)
    transports: tuple[str, ...] = TRANSPORTS
    hosts: tuple[str, ...] = ("default", "off")
    payload_mib: int = 64
    bucket_mib: int = 8
    repeats: int = 3
    gbit: float = 2.0
    timeout_s: float = 300.0
    shm_mib: int | None = None
    """Each simulated host's ``/dev/shm`` in MiB; ``None``: the payload + 8 buckets per sender."""

    def shapes_of(self, kind: str) -> tuple[Shape, ...]:
        return self.rank_shapes if kind == "rank" and self.rank_shapes is not None else self.shapes

    def host_shm_mib(self) -> int:
        return self.shm_mib or self.payload_mib + 8 * self.bucket_mib * max(self.senders)

    def check(self) -> None:
        for key in ("payload_mib", "bucket_mib", "repeats", "shm_mib"):
            value = getattr(self, key)
            if key == "shm_mib" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        for key in ("shapes", "rank_shapes"):
            shapes = getattr(self, key)
            if (shapes is not None or key == "shapes") and (
                not shapes or any(h < 1 or r < 1 for h, r in shapes)
            ):
                raise ValueError(f"{key} must be (hosts, ranks per host) pairs >= 1, got {shapes!r}")
        if not self.senders or any(k < 1 or k > 8 for k in self.senders):
            raise ValueError(f"senders must be ints in [1, 8], got {self.senders!r}")
        for name, allowed in (("kinds", tuple(KINDS)), ("transports", TRANSPORTS), ("hosts", HOSTS)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad or not getattr(self, name):
                raise ValueError(f"{name} {bad or '()'}: allowed: {', '.join(allowed)}")
        if "rank" in self.kinds and max(self.senders) + max(h * r for h, r in self.shapes_of("rank")) > 16:
            raise ValueError("link per rank: senders + rollout ranks must be at most 16 (one namespace each)")
        if not 0 < self.gbit <= 400:
            raise ValueError(f"gbit must be in (0, 400] Gbit/s, got {self.gbit!r}")


QUICK = FanoutOptions(
    shapes=((1, 1), (1, 4), (2, 2)),
    kinds=("host",),
    senders=(1,),
    hosts=("default",),
    payload_mib=16,
    repeats=2,
    timeout_s=120.0,
)
FULL = FanoutOptions(rank_shapes=((1, 1), (1, 4), (1, 8), (2, 4), (4, 2)))


class _Fleet:
    """The switch and its hosts for one host kind, with workers made on first use and kept from
    shape to shape (importing torch, NIXL and verl costs each process seconds). Host 0 is the
    trainer's, host ``1 + h`` rollout host ``h``; each has its own ``/dev/shm``. Use as a context
    manager."""

    def __init__(self, kind: str, opts: FanoutOptions) -> None:
        self.kind, self.opts = kind, opts
        self.max_senders = max(opts.senders)
        max_hosts = max(h for h, _ in opts.shapes_of(kind))
        if kind == "host":
            leaves = 1 + max_hosts
        else:
            leaves = self.max_senders + max(h * r for h, r in opts.shapes_of(kind))
        self.star = NamespaceStar(leaves, opts.gbit, switch=True)
        self.shm = ShmHosts(1 + max_hosts, opts.host_shm_mib())
        self.workers: dict[Place, NetnsWorker] = {}

    def __enter__(self) -> _Fleet:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.star)
            stack.enter_context(self.shm)
            stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()
        self.star.close()  # its workers first: a host's tmpfs is freed when its last process leaves
        self.shm.close()

    def trainer_place(self, t: int) -> Place:
        return (0, t, 0) if self.kind == "host" else (t, 0, 0)

    def rollout_place(self, shape: Shape, j: int) -> Place:
        host = 1 + j // shape[1]
        if self.kind == "host":
            return host, j % shape[1], host
        return self.max_senders + j, 0, host

    def worker(self, place: Place) -> NetnsWorker:
        if place not in self.workers:
            leaf = self.star.leaves[place[0]]
            env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": leaf.dev}
            # link per rank: the ranks of a host share its hostname, as on a real host with a NIC
            # per GPU (each resolves it to its own link's address); link per host: the leaf's name
            name = f"{self.star.prefix}-{self.star.token}-host{place[2]}" if self.kind == "rank" else None
            self.workers[place] = self.star.spawn(leaf, env, mount_ns=self.shm.path(place[2]), hostname=name)
        return self.workers[place]

    def keep_only(self, places: set[Place]) -> None:
        """Stop the workers this shape does not use (bounds the processes alive at once)."""
        for place in [p for p in self.workers if p not in places]:
            self.drop(place)

    def drop(self, place: Place | None = None) -> None:
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


def _sync_row(fleet: _Fleet, shape: Shape, senders: int, transport: str, hosts: str) -> dict[str, Any]:
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
            if hosts != "default":
                kw["hosts"] = hosts
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
    if verl:
        # verl's engine stays in its workers with its NIXL agent: rows after it on the same workers
        # ran up to 2x slower (4x2 gloo at 2 Gbit/s: 0.99 s, 0.50-0.55 s on fresh workers)
        for place in {*trainer_places, *rollout_places}:
            fleet.drop(place)
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
    transport = {"raw TCP, 1 stream": "tcp", "verl NIXL engine": "nixl"}.get(what) or parse_what(what)[0]
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
        row["status"] = f"error: {type(exc).__name__}: {text}"[:2000]  # every failed rank (_both)
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
        for shape in opts.shapes_of(kind):
            if "verl-nixl" in opts.transports:
                plan.append((kind, shape, 1, "verl NIXL engine"))
            for tr in (t for t in opts.transports if t != "verl-nixl"):
                plan += [(kind, shape, k, fastsync_what(tr, h)) for h in opts.hosts for k in opts.senders]

    def not_available(k: str, s: Shape, n: int, w: str, why: str) -> dict[str, Any]:
        def na() -> dict[str, Any]:
            raise RuntimeError("unreachable")

        return dict(_row(None, k, s, n, w, na), status=f"not available: {why}")

    reason = unavailable_reason()
    why = f"network namespaces: {reason}" if reason else None
    if why is None and (reason := shm_unavailable_reason()) is not None:
        why = f"a /dev/shm per simulated host: {reason}"
    if why is not None:
        return [not_available(*p, why) for p in plan]
    no_key = {tr: hosts_key_missing(tr) for tr in opts.transports if tr != "verl-nixl"}
    rows = []
    for kind in opts.kinds:
        with _Fleet(kind, opts) as fleet:
            for k, shape, senders, what in (p for p in plan if p[0] == kind):
                tr, hosts = ("verl-nixl", "") if what.startswith("verl") else parse_what(what)
                if hosts not in ("", "default") and no_key[tr]:
                    rows.append(not_available(k, shape, senders, what, str(no_key[tr])))
                    continue
                measure: Callable[[], dict[str, Any]] = (
                    functools.partial(_raw_row, fleet)
                    if what.startswith("raw")
                    else functools.partial(_sync_row, fleet, shape, senders, tr, hosts)
                )
                rows.append(_row(fleet, k, shape, senders, what, measure))
                if progress is not None:
                    r = rows[-1]
                    progress(f"{r['row']}: {r['status']}, {r['seconds']} s, links {r['trainer_link_models']}")
    fill_vs_1x1(rows)
    return rows


def bench_section(quick: bool) -> list[dict[str, Any]]:
    """The ``fanout`` section of ``verl-fastsync bench`` (:data:`QUICK` or :data:`FULL`)."""
    return run_fanout(dataclasses.replace(QUICK if quick else FULL))


def main(argv: list[str] | None = None) -> int:
    from verl_fastsync.tools.bench.report import fanout_table
    from verl_fastsync.tools.bench.schema import fill_ratios, normalize_external
    from verl_fastsync.tools.fanout_rows import markdown_tables

    parser = argparse.ArgumentParser(
        prog="python -m verl_fastsync.tools.fanout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the bench's quick preset")
    parser.add_argument("--shapes", help="HOSTSxRANKS,... e.g. 1x1,1x8,2x4")
    parser.add_argument("--rank-shapes", help="the link per rank kind's shapes (default: --shapes)")
    parser.add_argument("--kinds", help="host,rank")
    parser.add_argument("--senders", help="e.g. 1,4")
    parser.add_argument("--transports", help=",".join(TRANSPORTS))
    parser.add_argument("--hosts", help=f"{','.join(HOSTS)} (default passes no hosts key)")
    parser.add_argument("--payload-mib", type=int)
    parser.add_argument("--bucket-mib", type=int)
    parser.add_argument("--shm-mib", type=int, help="each simulated host's /dev/shm")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--gbit", type=float)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="print docs/benchmarks.md's tables")
    parser.add_argument("--save", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    opts = dataclasses.replace(QUICK if args.quick else FULL)
    for key in ("shapes", "rank_shapes"):
        if getattr(args, key):
            shapes = tuple(
                (int(s.split("x")[0]), int(s.split("x")[1])) for s in getattr(args, key).split(",")
            )
            setattr(opts, key, shapes)
    if args.shapes and not args.rank_shapes:
        opts.rank_shapes = None
    for key, conv in (("kinds", str), ("senders", int), ("transports", str), ("hosts", str)):
        if getattr(args, key):
            setattr(opts, key, tuple(conv(v) for v in getattr(args, key).split(",")))
    for key in ("payload_mib", "bucket_mib", "shm_mib", "repeats", "gbit"):
        if getattr(args, key) is not None:
            setattr(opts, key, getattr(args, key))
    try:
        opts.check()
    except ValueError as exc:
        parser.error(str(exc))
    t0 = time.monotonic()
    rows = [normalize_external(r, "fanout") for r in run_fanout(opts, lambda m: print(m, file=sys.stderr))]
    fill_ratios(rows)
    if args.save:
        with open(args.save, "w") as fh:
            json.dump(rows, fh, indent=1)
    print(
        json.dumps(rows, indent=1)
        if args.json
        else markdown_tables(rows)
        if args.markdown
        else fanout_table(rows)
    )
    print(
        f"# {opts.payload_mib} MiB, {opts.gbit:g} Gbit/s links, {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0 if all(not r["status"].startswith("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
