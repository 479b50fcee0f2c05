"""The fanout bench's rows (:func:`verl_fastsync.tools.fanout.run_fanout`): their names, the ``x 1x1``
ratio, whether the engine has the ``hosts`` key, and (normalized and with ratios, as the bench stores
them) the markdown tables of ``docs/benchmarks.md``: one table per host kind, a row per
measured row, models per sync on the trainer host's link(s) and into each rollout host (the sum of its
links), the busiest single link, the time as a multiple of the same transport's 1x1 time, verl's NIXL
engine's time over the row's in the same shape, and (rows with several senders) one sender's time over
the row's. ``python -m verl_fastsync.tools.fanout --markdown`` prints them."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["KINDS", "Shape", "fastsync_what", "fill_vs_1x1", "hosts_key_missing", "label", "markdown_tables",
           "parse_what"]  # fmt: skip

KINDS = {"host": "link per host", "rank": "link per rank"}
"""Host kinds: the short name (options, command line) -> the label in rows and tables."""
Shape = tuple[int, int]


def fastsync_what(transport: str, hosts: str) -> str:
    """The ``what`` of a fastsync row: ``fastsync gloo`` (``hosts`` not passed), ``fastsync gloo,
    hosts off``."""
    return f"fastsync {transport}" + ("" if hosts == "default" else f", hosts {hosts}")


def label(kind: str, shape: Shape, senders: int, what: str) -> str:
    """A row's name, e.g. ``link per host 2x4, 1 sender: fastsync gloo``."""
    plural = "" if senders == 1 else "s"
    return f"{KINDS[kind]} {shape[0]}x{shape[1]}, {senders} sender{plural}: {what}"


def parse_what(what: str) -> tuple[str, str]:
    """(transport, hosts) of a fastsync row's ``what`` (:func:`fastsync_what`)."""
    transport, _, hosts = what.removeprefix("fastsync ").partition(", hosts ")
    return transport, hosts or "default"


def hosts_key_missing(transport: str) -> str | None:
    """``None`` when the ``fastsync`` engine of ``transport`` accepts ``engine_kwargs.fastsync.hosts``
    (checked as the engine checks its kwargs), else why not."""
    from verl_fastsync.config import FastsyncConfigError
    from verl_fastsync.selection import parse_engine_kwargs

    try:
        parse_engine_kwargs({"transport": transport, "hosts": "off"})
    except FastsyncConfigError as exc:
        first = str(exc).split(";")[0]
        return f"engine_kwargs.fastsync.hosts is not a key of this checkout's engine ({first})"
    return None


def fill_vs_1x1(rows: list[dict[str, Any]]) -> None:
    """``vs_1x1`` = the row's median seconds / the 1x1 row's of the same kind, senders and transport
    (a time multiple: 1.0 = fan-out costs nothing)."""

    def key(r: dict[str, Any]) -> tuple[str, int, str]:
        return r["host_kind"], r["senders"], r["row"].split(": ", 1)[1]

    ones = {key(r): r for r in rows if (r["hosts"], r["ranks_per_host"]) == (1, 1) and r["status"] == "ok"}
    for r in rows:
        one = ones.get(key(r))
        if r["status"] == "ok" and one is not None and r["seconds"]:
            r["vs_1x1"] = statistics.median(r["seconds"]) / statistics.median(one["seconds"])


_HEADER = (
    "| shape | senders | what | s / sync | trainer's link(s), models | each rollout host's link(s), models "
    "| busiest link | busy | x 1x1 | verl s / s | 1 sender s / s |"
)


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def _per_host(models: list[float]) -> str:
    """``2.00 x 4`` when every host got the same (to the shown digits), else ``3.01, 4.01``."""
    shown = [format(m, ".2f") for m in models]
    if len(shown) > 2 and len(set(shown)) == 1:
        return f"{shown[0]} x {len(shown)}"
    return ", ".join(shown)


def _what(row: dict[str, Any]) -> str:
    return row["row"].split(": ", 1)[1].removeprefix("fastsync ")


def markdown_tables(rows: list[dict[str, Any]]) -> str:
    """Every host kind's table (rows not measured: their status in the last column's place)."""
    by_key = {(r["host_kind"], r["hosts"], r["ranks_per_host"], r["senders"], _what(r)): r for r in rows}
    out: list[str] = []
    for kind in dict.fromkeys(r["host_kind"] for r in rows):
        out += [f"{kind}:", "", _HEADER, "|" + "---|" * _HEADER.count(" | ") + "---|"]
        for r in (r for r in rows if r["host_kind"] == kind):
            shape = f"{r['hosts']}x{r['ranks_per_host']}"
            if r["status"] != "ok":
                out.append(f"| {shape} | {r['senders']} | {_what(r)} | {r['status']} |" + " |" * 7)
                continue
            one = by_key.get((kind, r["hosts"], r["ranks_per_host"], 1, _what(r)))
            vs_one = None
            if r["senders"] > 1 and one is not None and one["status"] == "ok":
                vs_one = one["median_s"] / r["median_s"]
            cells = [
                shape,
                str(r["senders"]),
                _what(r),
                _num(r["median_s"], ".3f"),
                _num(r["trainer_link_models"]),
                _per_host(r["rollout_link_models"]),
                _num(r["max_link_models"]),
                _num(r["busy"]),
                _num(r["vs_1x1"]),
                _num(r["ratio"]),
                "" if vs_one is None else f"{vs_one:.2f}x",
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
