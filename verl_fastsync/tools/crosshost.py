"""Cross-host figures on one machine: gloo and nixl between two network namespaces, against the
raw link and the raw library, measured in the same run.

Two simulated hosts (:class:`~verl_fastsync.tools.netns.NamespacePair`: own network namespace,
hostname and veth address each) run one worker each; host ``a`` sends, host ``b`` receives. Every
row moves the same payload (random bytes) from ``a`` to ``b``, ``repeats`` times after one
untimed warm-up, and checks afterwards that ``b`` holds exactly ``a``'s bytes (xxh3 digest).
A repeat's seconds run from the sender starting to the receiver holding every byte (both sides
read the same system-wide monotonic clock).

Rows: the raw link (TCP sockets, 1 and 4 streams; optionally under ``tc`` shaping), a raw
``torch.distributed`` gloo broadcast, fastsync's ``gloo`` engine transport, a raw NIXL WRITE with
notification (receiver busy-polling, and polling every 0.2 ms), fastsync's ``nixl`` engine
transport. NIXL runs on host memory over UCX with ``UCX_TLS=tcp`` bound to the veth device.
fastsync rows go through the public engine-transport API for each sync (prepare, build_topology,
init_process_group, send/receive, finalize); only send -> last byte received is timed (the setup
is in the note), and the receiver copies every tensor into its preallocated destination, as a
rollout's weight loader does.

Run ``python -m verl_fastsync.tools.crosshost [--quick]``; the bench calls :func:`bench_section`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from verl_fastsync.tools.netns import NamespacePair, NetnsWorker, unavailable_reason

__all__ = ["CrosshostOptions", "bench_section", "format_rows", "run_section"]

MIB = 1 << 20
_HERE = "verl_fastsync.tools.crosshost"
_STATE: dict[Any, Any] = {}  # per worker process: sockets, groups, agents, buffers


@dataclass
class CrosshostOptions:
    payload_mib: int = 1024
    repeats: int = 5
    bucket_mib: int = 64
    streams: int = 4
    shape_gbit: tuple[float, ...] = (10.0, 25.0)
    timeout_s: float = 300.0
    only: str | None = None
    """Run only the rows whose label contains this text (and no shaped rows)."""

    def check(self) -> None:
        for key in ("payload_mib", "repeats", "bucket_mib", "streams"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if any(not 0 < g <= 400 for g in self.shape_gbit):
            raise ValueError(f"shape_gbit values must be in (0, 400] Gbit/s, got {self.shape_gbit!r}")


QUICK = CrosshostOptions(payload_mib=128, repeats=3, shape_gbit=(10.0,), timeout_s=120.0)

# --------------------------------------------------------------------------------------------------
# worker side (runs inside a namespace; every function takes and returns JSON values)


def _payload(nbytes: int) -> Any:
    import torch

    key = ("payload", nbytes)
    if key not in _STATE:
        gen = torch.Generator().manual_seed(nbytes)
        _STATE[key] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return _STATE[key]


def _digest(tensors: list[Any]) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(memoryview(t.contiguous().view(-1).view(__import__("torch").uint8).numpy()))
    return h.hexdigest()


def _buffer(nbytes: int) -> Any:
    import torch

    key = ("buffer", nbytes)
    if key not in _STATE:
        _STATE[key] = torch.zeros(nbytes, dtype=torch.uint8)
    return _STATE[key]


def reset() -> None:
    """Drop every socket, group, agent and buffer of the previous row."""
    for value in list(_STATE.values()):
        for closer in ("close", "abort", "finalize"):
            if hasattr(value, closer) and not isinstance(value, type):
                try:
                    getattr(value, closer)()
                except Exception:
                    pass
                break
    _STATE.clear()


def _slices(nbytes: int, parts: int) -> list[tuple[int, int]]:
    step = -(-nbytes // parts)
    return [(i, min(nbytes, i + step)) for i in range(0, nbytes, step)]


def tcp_listen(addr: str, streams: int) -> int:
    srv = socket.create_server((addr, 0), backlog=streams)
    _STATE["srv"] = srv
    return int(srv.getsockname()[1])


def tcp_recv(nbytes: int, streams: int, repeats: int) -> dict[str, Any]:
    buf = _buffer(nbytes)
    srv = _STATE.pop("srv")
    srv.settimeout(120)
    conns = [srv.accept()[0] for _ in range(streams)]
    srv.close()
    view = memoryview(buf.numpy())
    ends = []

    def pull(conn: socket.socket, lo: int, hi: int) -> None:
        while lo < hi:
            got = conn.recv_into(view[lo:hi])
            if got == 0:
                raise ConnectionError("sender closed the connection early")
            lo += got

    with ThreadPoolExecutor(streams) as pool:
        for _ in range(repeats):
            futures = [
                pool.submit(pull, c, lo, hi)
                for c, (lo, hi) in zip(conns, _slices(nbytes, streams), strict=True)
            ]
            for f in futures:
                f.result()
            ends.append(time.monotonic())
            conns[0].sendall(b"k")
    for c in conns:
        c.close()
    return {"ends": ends, "digest": _digest([buf])}


def tcp_send(addr: str, port: int, nbytes: int, streams: int, repeats: int) -> dict[str, Any]:
    data = _payload(nbytes)
    view = memoryview(data.numpy())
    conns = [socket.create_connection((addr, port), timeout=120) for _ in range(streams)]
    starts = []
    with ThreadPoolExecutor(streams) as pool:
        for _ in range(repeats):
            starts.append(time.monotonic())
            futures = [
                pool.submit(c.sendall, view[lo:hi])
                for c, (lo, hi) in zip(conns, _slices(nbytes, streams), strict=True)
            ]
            for f in futures:
                f.result()
            if conns[0].recv(1) != b"k":
                raise ConnectionError("receiver closed the connection before acknowledging")
    for c in conns:
        c.close()
    return {"starts": starts, "digest": _digest([data])}


def gloo_store(addr: str, timeout_s: float) -> int:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(addr, 0, 2, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    _STATE["store"] = store
    return int(store.port)


def gloo_broadcast(
    addr: str, port: int, rank: int, nbytes: int, repeats: int, timeout_s: float
) -> dict[str, Any]:
    """A plain two-rank ProcessGroupGloo (default options) broadcasting the payload from rank 0."""
    import datetime

    import torch
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout_s)
    store = _STATE.get("store") or dist.TCPStore(addr, port, 2, False, td)
    pg: Any = dist.ProcessGroupGloo(store, rank, 2, td)
    _STATE["pg"] = pg
    data = _payload(nbytes) if rank == 0 else _buffer(nbytes)
    ack = torch.zeros(1, dtype=torch.uint8)
    stamps = []
    for _ in range(repeats):
        t0 = time.monotonic()
        pg.broadcast([data], dist.BroadcastOptions()).wait(td)
        t1 = time.monotonic()
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        pg.broadcast([ack], opts).wait(td)
        stamps.append(t0 if rank == 0 else t1)
    return {"starts" if rank == 0 else "ends": stamps, "digest": _digest([data])}


def _model(nbytes: int, bucket: int) -> list[tuple[str, int, int]]:
    """(name, offset, size) covering the payload: one tensor of 2.5 buckets (at most a quarter of
    the payload; split into chunks when larger than a bucket), then 16 MiB tensors."""
    pieces, off, i = [], 0, 0
    first = min(nbytes // 4, 5 * bucket // 2) & ~1
    while off < nbytes:
        size = first if i == 0 else min(16 * MIB, nbytes - off)
        pieces.append((f"layer{i}.weight", off, size))
        off, i = off + size, i + 1
    return pieces


def fs_prepare(transport: str, is_master: bool, bucket: int, timeout_s: float) -> dict[str, Any]:
    from verl_fastsync.plugins import plugin_manager, select_transport
    from verl_fastsync.transports.base import TransportOptions

    if "fs" not in _STATE:
        factory = select_transport(plugin_manager(), transport, "engine")
        _STATE["fs_factory"] = factory
        _STATE["fs"] = factory(TransportOptions(is_master=is_master, timeout_s=timeout_s))
    return dict(_STATE["fs"].prepare(), bucket_size=bucket)


def fs_topology(metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    actor, rollout = _STATE["fs_factory"].build_topology(1, 1, metadata)
    return [{k: v[0] for k, v in actor.items()}, {k: v[0] for k, v in rollout.items()}]


def fs_init(kwargs: dict[str, Any]) -> None:
    _STATE["fs"].init_process_group(**kwargs)


def fs_send(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    from verl_fastsync.chunks import aplan_buckets

    data = _STATE.get(("payload", nbytes))
    if data is None:
        data = _payload(nbytes)
    tensors = [
        (name, data[off : off + size].view(torch.bfloat16)) for name, off, size in _model(nbytes, bucket)
    ]
    start = time.monotonic()
    asyncio.run(_STATE["fs"].send(aplan_buckets(iter(tensors), bucket)))
    return {"start": start, "digest": _digest([t for _, t in tensors])}


def fs_receive(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    dest = _STATE.get("fs_dest")
    if dest is None:
        dest = {
            name: torch.zeros(size // 2, dtype=torch.bfloat16) for name, _, size in _model(nbytes, bucket)
        }
        _STATE["fs_dest"] = dest

    async def consume() -> None:
        async for name, tensor in _STATE["fs"].receive():
            dest[name].copy_(tensor)

    asyncio.run(consume())
    return {"end": time.monotonic(), "digest": _digest(list(dest.values()))}


def fs_finalize() -> None:
    _STATE["fs"].finalize()


def nixl_agent(nbytes: int, sender: bool) -> dict[str, Any]:
    import os

    from nixl._api import nixl_agent, nixl_agent_config

    name = f"crosshost-{'a' if sender else 'b'}-{os.getpid()}"
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf = _payload(nbytes) if sender else _buffer(nbytes)
    _STATE["nixl"] = agent
    _STATE["nixl_reg"] = agent.register_memory([buf])
    _STATE["nixl_buf"] = buf
    return {
        "agent": name,
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "addr": buf.data_ptr(),
    }


def _wait(check: Callable[[], bool], spin: bool, deadline: float, what: str) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done by the deadline")
        if not spin:
            time.sleep(0.0002)


def nixl_write(
    peer: dict[str, Any], nbytes: int, repeats: int, spin: bool, timeout_s: float
) -> dict[str, Any]:
    agent, buf = _STATE["nixl"], _STATE["nixl_buf"]
    remote_name = agent.add_remote_agent(base64.b64decode(peer["metadata"]))
    local = agent.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(int(peer["addr"]), nbytes, 0)], "DRAM")
    starts = []
    for i in range(repeats):
        starts.append(time.monotonic())
        handle = agent.initialize_xfer("WRITE", local, remote, remote_name, f"fsx{i}".encode())
        if agent.transfer(handle) == "ERR":
            raise RuntimeError(f"NIXL WRITE {i} failed to start")
        state = {"s": ""}

        def done(h: Any = handle, s: dict[str, str] = state) -> bool:
            s["s"] = agent.check_xfer_state(h)
            if s["s"] == "ERR":
                raise RuntimeError("NIXL WRITE failed")
            return s["s"] == "DONE"

        _wait(done, spin, time.monotonic() + timeout_s, f"NIXL WRITE {i}")
        agent.release_xfer_handle(handle)
    return {"starts": starts, "digest": _digest([buf])}


def nixl_wait(sender: str, repeats: int, spin: bool, timeout_s: float) -> dict[str, Any]:
    agent, buf = _STATE["nixl"], _STATE["nixl_buf"]
    ends = []
    for i in range(repeats):
        tag = f"fsx{i}".encode()
        _wait(
            functools.partial(agent.check_remote_xfer_done, sender, tag),
            spin,
            time.monotonic() + timeout_s,
            f"notif {i}",
        )
        ends.append(time.monotonic())
    return {"ends": ends, "digest": _digest([buf])}


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
    reps = run.opts.repeats + 1
    port = run.call("b", "tcp_listen", addr=run.pair.b.addr, streams=streams)
    sent, got = run.both(
        f"{_HERE}:tcp_send",
        {"addr": run.pair.b.addr, "port": port, "nbytes": run.nbytes, "streams": streams, "repeats": reps},
        f"{_HERE}:tcp_recv",
        {"nbytes": run.nbytes, "streams": streams, "repeats": reps},
    )
    return _timed(sent, got), f"{streams} TCP stream(s), sendall/recv_into"


def _raw_gloo(run: _Run) -> tuple[list[float], str]:
    reps, t = run.opts.repeats + 1, run.opts.timeout_s
    port = run.call("a", "gloo_store", addr=run.pair.a.addr, timeout_s=t)
    kw = {"addr": run.pair.a.addr, "port": port, "nbytes": run.nbytes, "repeats": reps, "timeout_s": t}
    sent, got = run.both(
        f"{_HERE}:gloo_broadcast", dict(kw, rank=0), f"{_HERE}:gloo_broadcast", dict(kw, rank=1)
    )
    return _timed(sent, got), "one ProcessGroupGloo.broadcast of the whole payload, default options"


def _fastsync(run: _Run, transport: str) -> tuple[list[float], str]:
    common = {"transport": transport, "bucket": run.bucket, "timeout_s": run.opts.timeout_s}
    starts, ends, setups, digests = [], [], [], ("", "")
    for _ in range(run.opts.repeats + 1):
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
    return seconds, f"{run.opts.bucket_mib} MiB buckets; setup per sync {setup:.2f} s (not timed)"


def _raw_nixl(run: _Run, spin: bool) -> tuple[list[float], str]:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise _NotAvailable(f"nixl is not importable ({exc})") from exc
    reps, t = run.opts.repeats + 1, run.opts.timeout_s
    peer = run.call("b", "nixl_agent", nbytes=run.nbytes, sender=False)
    mine = run.call("a", "nixl_agent", nbytes=run.nbytes, sender=True)
    sent, got = run.both(
        f"{_HERE}:nixl_write",
        {"peer": peer, "nbytes": run.nbytes, "repeats": reps, "spin": spin, "timeout_s": t},
        f"{_HERE}:nixl_wait",
        {"sender": mine["agent"], "repeats": reps, "spin": spin, "timeout_s": t},
    )
    how = "busy-polling" if spin else "polling every 0.2 ms"
    return _timed(sent, got), f"one WRITE of the whole payload with a notification; both sides {how}"


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


def run_section(opts: CrosshostOptions) -> list[dict[str, Any]]:
    """Every row (see the module docstring), in one pair of namespaces. A row's baseline is the
    fastest of its candidate rows in this run (e.g. the faster raw NIXL wait mode)."""
    opts.check()
    nbytes = opts.payload_mib * MIB
    link = (LINK_1, LINK_N.format(n=opts.streams))
    nixl = (RAW_NIXL_SPIN, RAW_NIXL_POLL)
    specs: list[tuple[str, str, str, tuple[str, ...], Callable[[_Run], tuple[list[float], str]]]] = [
        (link[0], "raw", "tcp", (), functools.partial(_tcp, streams=1)),
        (link[1], "raw", "tcp", (), functools.partial(_tcp, streams=opts.streams)),
        (RAW_GLOO, "raw", "gloo", link, _raw_gloo),
        ("fastsync gloo", "fastsync", "gloo", (RAW_GLOO,), functools.partial(_fastsync, transport="gloo")),
        (nixl[0], "raw", "nixl", link, functools.partial(_raw_nixl, spin=True)),
        (nixl[1], "raw", "nixl", link, functools.partial(_raw_nixl, spin=False)),
        ("fastsync nixl", "fastsync", "nixl", nixl, functools.partial(_fastsync, transport="nixl")),
    ]
    specs = [s for s in specs if opts.only is None or opts.only.lower() in s[0].lower()]
    reason = unavailable_reason()
    rows: list[dict[str, Any]] = []
    if reason is not None:
        rows = [_row(s[0], s[1], s[2], _raise_na(reason), None, nbytes) for s in specs]
    else:
        with NamespacePair() as pair:
            run = _Run(pair, opts)
            try:
                for label, kind, transport, _, fn in specs:
                    rows.append(_row(label, kind, transport, functools.partial(fn, run), run, nbytes))
                for gbit in opts.shape_gbit if opts.only is None else ():
                    pair.shape(gbit)
                    measure = functools.partial(_tcp, run, streams=opts.streams)
                    row = _row(f"{link[1]}, tc {gbit:g} Gbit/s", "raw", "tcp", measure, run, nbytes)
                    row["note"] += f"; tc tbf {gbit:g} Gbit/s = {gbit / 8:.2f} GB/s on both veth ends"
                    rows.append(row)
                pair.shape(None)
            finally:
                run.drop()
    median = {r["row"]: statistics.median(r["seconds"]) for r in rows if r["status"] == "ok" and r["seconds"]}
    for row, spec in zip(rows, specs, strict=False):
        measured = [c for c in spec[3] if c in median]
        row["baseline"] = min(measured, key=median.__getitem__) if measured else (spec[3] or (None,))[0]
    return rows


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
    parser.add_argument("--bucket-mib", type=int)
    parser.add_argument("--only", help="only the rows whose label contains this text")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    opts = CrosshostOptions(**vars(QUICK)) if args.quick else CrosshostOptions()
    for key in ("payload_mib", "repeats", "bucket_mib", "only"):
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
