"""Delta sync figures (``engine_kwargs.fastsync.delta``): full vs delta syncs of the same weights, in
the same run, across two simulated hosts (:class:`~verl_fastsync.tools.netns_star.NamespaceStar` with
one leaf: the trainer's namespace, the rollout's, one veth link, unshaped or ``tc``-shaped).

The weights come from real optimizer steps: the trainer rank trains a stack of MLP blocks with AdamW
(fp32 master weights, a random regression batch per step) and every sync sends the ``bfloat16`` cast,
as verl's FSDP trainer does. Per learning rate, an untimed first sync, then ``steps`` optimizer steps,
then one re-initialisation (every value changes: the raw fallback). Each step is synced once by the
``delta=false`` engine and once by the ``delta=true`` one (both kept from step to step as in verl); a
sync is timed from ``send_weights`` starting to the rollout's consumer holding every byte (copied into
its parameters, checked by xxh3 digest against the trainer's weights).

Run ``python -m verl_fastsync.tools.delta_bench [--width 1024] [--layers 8] [--gbit 10,0]
[--one-host shm] [--pin]`` (``0``: unshaped; ``--one-host``: also both ranks in one namespace, rows
``host shm``; ``--pin``: the trainer's process on CPU 0 and the rollout's on CPU 1, so that the two
"hosts" do not share cores and one side's encode can overlap the other's rebuild as across real
hosts), or as the ``delta`` section of ``verl-fastsync bench`` (:func:`bench_section`: ``--sections
delta`` for the quick rows, ``--full`` for docs/benchmarks.md's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from verl_fastsync.tools.netns import unavailable_reason
from verl_fastsync.tools.netns_star import NamespaceStar
from verl_fastsync.tools.netns_worker import CPUS_ENV, NetnsWorker

__all__ = ["FULL", "QUICK", "DeltaBenchOptions", "bench_rows", "bench_section", "format_delta", "run_delta"]

_PEER = "verl_fastsync.tools.delta_bench_peer"
MIB = 1 << 20


@dataclass
class DeltaBenchOptions:
    width: int = 1024
    layers: int = 8
    steps: int = 3
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    gbits: tuple[float, ...] = (10.0, 0.0)
    transport: str = "gloo"
    bucket_mib: int = 32
    timeout_s: float = 300.0
    seed: int = 0
    engines: tuple[str, ...] = field(default=("full", "delta"))
    one_host: str | None = None
    """Also run both ranks in one namespace (one host) over this transport (``shm``): where delta
    has no link to save."""
    pin: bool = False
    """The trainer's process on CPU 0, the rollout's on CPU 1 (two hosts that do not share cores;
    each side's codec then runs on one thread). Not for the one-host rows."""


def _both(pairs: list[tuple[NetnsWorker, str, dict[str, Any]]], timeout_s: float) -> list[Any]:
    ids = [(w, w.submit(fn, kw)) for w, fn, kw in pairs]
    return [w.result(i, timeout_s) for w, i in ids]


def _sync(trainer: NetnsWorker, rollout: NetnsWorker, name: str, t: float) -> dict[str, Any]:
    ranks = [trainer, rollout]
    metadata = _both([(w, f"{_PEER}:eng_prepare", {"name": name}) for w in ranks], t)
    kwargs = rollout.call(f"{_PEER}:eng_topology", {"metadata": metadata}, t)
    _both(
        [(w, f"{_PEER}:eng_init", {"name": name, "kwargs": kw}) for w, kw in zip(ranks, kwargs, strict=True)],
        t,
    )
    sent, got = _both(
        [(trainer, f"{_PEER}:eng_send", {"name": name}), (rollout, f"{_PEER}:eng_receive", {"name": name})], t
    )
    _both([(w, f"{_PEER}:eng_finalize", {"name": name}) for w in ranks], t)
    if sent["digest"] != got["digest"]:
        raise RuntimeError(f"{name} sync: the rollout's weights differ from the trainer's")
    metrics = sent["metrics"]
    return {
        "seconds": got["end"] - sent["start"],
        "wire_bytes": metrics.get("fastsync/transfer/bytes", 0.0),
        "delta_sync": metrics.get("fastsync/transfer/delta_sync", 0.0),
        "encode_s": metrics.get("fastsync/transfer/delta_codec_s", 0.0),
        "buckets": metrics.get("fastsync/transfer/buckets", 0.0),
        "decode_s": got["metrics"].get("fastsync/transfer/delta_codec_s", 0.0),
    }


def _link(gbit: float, opts: DeltaBenchOptions, one_host: bool = False) -> list[dict[str, Any]]:
    t = opts.timeout_s
    rows: list[dict[str, Any]] = []
    with NamespaceStar(1, gbit or None) as star:
        pin = opts.pin and not one_host
        trainer = star.spawn(star.hub if one_host else star.leaves[0], env={CPUS_ENV: "0"} if pin else None)
        rollout = star.spawn(star.hub, env={CPUS_ENV: "1"} if pin else None)
        for name in opts.engines:
            sides = _both(
                [
                    (
                        w,
                        f"{_PEER}:eng_new",
                        {
                            "name": name,
                            "transport": opts.transport,
                            "delta": name == "delta",
                            "trainer": w is trainer,
                            "bucket": opts.bucket_mib * MIB,
                            "timeout_s": t,
                        },
                    )
                    for w in (trainer, rollout)
                ],
                t,
            )
        cpus = {"trainer": sides[0]["cpus"], "rollout": sides[1]["cpus"]}
        info = trainer.call(
            f"{_PEER}:train_init", {"width": opts.width, "layers": opts.layers, "seed": opts.seed}, t
        )
        for name in opts.engines:  # untimed: both engines hold the starting weights
            _sync(trainer, rollout, name, t)
        for lr in opts.lrs:
            plan = [(step, False) for step in range(1, opts.steps + 1)] + [(opts.steps + 1, True)]
            for step, reinit in plan:
                change = trainer.call(f"{_PEER}:train_step", {"lr": lr, "reinit": reinit}, t)
                row: dict[str, Any] = {
                    "gbit": gbit,
                    "one_host": one_host,
                    "transport": opts.transport,
                    "lr": lr,
                    "step": "re-init" if reinit else step,
                    "changed_fraction": change["changed_fraction"],
                    "model_bytes": info["bytes"],
                    "cpus": cpus,
                }
                for name in opts.engines:
                    row[name] = _sync(trainer, rollout, name, t)
                rows.append(row)
        for w in (trainer, rollout):
            w.call(f"{_PEER}:close", {}, t)
    return rows


def run_delta(opts: DeltaBenchOptions) -> dict[str, Any]:
    if opts.pin and not {0, 1} <= os.sched_getaffinity(0):
        raise ValueError(
            f"--pin runs the trainer on CPU 0 and the rollout on CPU 1; this process may use CPUs "
            f"{sorted(os.sched_getaffinity(0))}"
        )
    rows = [row for gbit in opts.gbits for row in _link(gbit, opts)]
    if opts.one_host:
        rows += _link(0.0, dataclasses.replace(opts, transport=opts.one_host), one_host=True)
    return {"options": vars(opts), "rows": rows}


def format_delta(result: dict[str, Any]) -> str:
    opts = result["options"]
    rows = result["rows"]
    size = rows[0]["model_bytes"] / MIB if rows else 0.0
    lines = [
        f"# {opts['transport']}, {size:.0f} MiB of bf16 weights, {opts['bucket_mib']} MiB buckets; "
        "full = delta=false, delta = delta=true, same weights, same run; encode s / rebuild s: the "
        "delta sync's seconds in the sender's encode and the receiver's rebuild"
        + ("; trainer on CPU 0, rollout on CPU 1" if opts.get("pin") else "")
    ]
    lines.append(
        f"{'link':>9} {'lr':>6} {'step':>7} {'changed':>8} {'full MiB':>8} {'delta MiB':>9} {'bytes x':>7} "
        f"{'full s':>7} {'delta s':>7} {'time x':>6} {'encode s':>8} {'rebuild s':>9}"
    )
    for r in rows:
        full, delta = r["full"], r["delta"]
        link = f"{r['gbit']:g} Gbit" if r["gbit"] else "unshaped"
        if r.get("one_host"):
            link = f"host {r['transport']}"
        lines.append(
            f"{link:>9} {r['lr']:6.0e} {r['step']!s:>7} {r['changed_fraction']:8.2%} "
            f"{full['wire_bytes'] / MIB:8.1f} {delta['wire_bytes'] / MIB:9.1f} "
            f"{full['wire_bytes'] / max(delta['wire_bytes'], 1):7.1f} "
            f"{full['seconds']:7.3f} {delta['seconds']:7.3f} "
            f"{full['seconds'] / delta['seconds']:6.2f} "
            f"{delta.get('encode_s', 0.0):8.3f} {delta.get('decode_s', 0.0):9.3f}"
        )
    return "\n".join(lines)


QUICK = DeltaBenchOptions(steps=2, lrs=(1e-6,), gbits=(10.0,))
"""The bench's quick ``delta`` rows: the benchmarks page's model (128 MiB of bf16), lr 1e-6, 10 Gbit/s,
two steps and a re-initialisation (about 30 s on 2 cores; a much smaller model measures per-sync
overheads)."""
FULL = DeltaBenchOptions(gbits=(10.0, 1.0, 0.0), one_host="shm")
"""The bench's ``--full`` ``delta`` rows: docs/benchmarks.md's (128 MiB, lr 1e-6 and 1e-5, 10 / 1 Gbit/s,
unshaped and one host; about 2 minutes)."""


def _label(r: dict[str, Any]) -> str:
    link = (
        f"host {r['transport']}"
        if r.get("one_host")
        else f"{r['gbit']:g} Gbit/s"
        if r["gbit"]
        else "unshaped"
    )
    return f"{link}, lr {r['lr']:g}, step {r['step']}"


def bench_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`run_delta`'s result as bench rows: per step a ``delta=false`` row and a ``delta=true``
    row whose baseline it is. ``bytes`` is the model's (what either sync delivers, so the bench pairs
    them); what crossed the link is ``wire_bytes``."""
    rows: list[dict[str, Any]] = []
    for r in result["rows"]:
        label = _label(r)
        for name in ("full", "delta"):
            if name not in r:
                continue
            sync = r[name]
            rows.append(
                {
                    "row": f"{label}: {name}",
                    "kind": "fastsync",
                    "transport": r["transport"],
                    "seconds": [float(sync["seconds"])],
                    "bytes": int(r["model_bytes"]),
                    "status": "ok",
                    "baseline": f"{label}: full" if name == "delta" else None,
                    "note": f"delta={str(name == 'delta').lower()}; {r['changed_fraction']:.2%} of the "
                    "values changed since the last sync",
                    "link_gbit": float(r["gbit"]),
                    "one_host": bool(r.get("one_host")),
                    "lr": float(r["lr"]),
                    "step": str(r["step"]),
                    "changed_fraction": float(r["changed_fraction"]),
                    "wire_bytes": int(sync["wire_bytes"]),
                    "encode_s": float(sync.get("encode_s", 0.0)),
                    "rebuild_s": float(sync.get("decode_s", 0.0)),
                }
            )
    return rows


def bench_section(quick: bool) -> list[dict[str, Any]]:
    """The ``delta`` section of ``verl-fastsync bench`` (:data:`QUICK` or :data:`FULL`; each side
    pinned to its own CPU when CPUs 0 and 1 are there)."""
    reason = unavailable_reason()
    if reason is not None:
        return [
            {
                "row": "delta sync",
                "kind": "fastsync",
                "transport": "gloo",
                "seconds": [],
                "bytes": None,
                "status": f"not available: network namespaces: {reason}",
            }
        ]
    opts = dataclasses.replace(QUICK if quick else FULL, pin={0, 1} <= os.sched_getaffinity(0))
    return bench_rows(run_delta(opts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_fastsync.tools.delta_bench")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--gbit", default="10,0", help="link rates in Gbit/s, 0 = unshaped")
    parser.add_argument("--transport", default="gloo")
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument(
        "--one-host", default=None, help="also both ranks in one namespace over this transport (shm)"
    )
    parser.add_argument(
        "--pin", action="store_true", help="trainer on CPU 0, rollout on CPU 1 (hosts that share no core)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    opts = DeltaBenchOptions(
        width=args.width,
        layers=args.layers,
        steps=args.steps,
        lrs=tuple(float(x) for x in args.lrs.split(",")),
        gbits=tuple(float(x) for x in args.gbit.split(",")),
        transport=args.transport,
        bucket_mib=args.bucket_mib,
        one_host=args.one_host,
        pin=args.pin,
    )
    t0 = time.monotonic()
    result = run_delta(opts)
    print(json.dumps(result, indent=1) if args.json else format_delta(result))
    print(f"# {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
