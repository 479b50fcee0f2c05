"""What a person reads: the progress line, the tables (at most :data:`WIDTH` columns; every
``not available`` reason and error printed whole below its table) and the summary lines."""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any, TextIO

from verl_fastsync.tools.bench.options import EXTERNAL, GIB, MIB

WIDTH = 120


class Progress:
    """One-line progress display on stderr (a plain log line per step when stderr is not a TTY)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_len = 0

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.monotonic() - self.start:6.1f}s] {message}"
        if self._tty:
            line = line[: WIDTH - 1]
            pad = max(0, self._last_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.0f} MiB" if n >= 16 * MIB else f"{n / MIB:.1f} MiB"


def fmt_bucket(n: int | None) -> str:
    return "-" if n is None else f"{n // MIB}M"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def fmt_range(lo: float | None, hi: float | None, scale: float = 1.0, digits: int = 3) -> str:
    if lo is None or hi is None:
        return "-"
    return f"{lo * scale:.{digits}f}-{hi * scale:.{digits}f}"


class Notes:
    """Footnotes: every status that is not ``ok`` gets a number, its text is printed whole below."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def status(self, status: str) -> str:
        if status == "ok":
            return "ok"
        if status not in self.texts:
            self.texts.append(status)
        label = "n/a" if status.startswith("not available") else "error"
        return f"{label} [{self.texts.index(status) + 1}]"

    def render(self, start: int = 0) -> list[str]:
        out = []
        for i, text in enumerate(self.texts[start:], start + 1):
            out += textwrap.wrap(
                f"[{i}] {' '.join(text.split())}", WIDTH, subsequent_indent="    ",
                break_long_words=False, break_on_hyphens=False,
            )  # fmt: skip
        return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    """Columns padded to their widest cell; ``right`` marks the numeric (right-aligned) columns."""
    right = right or [False] * len(headers)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


_SHORT_BASE = {
    "memcpy": "memcpy",
    "raw gloo broadcast": "raw gloo",
    "raw nixl WRITE": "raw nixl",
    "fastsync engine shm": "default",
    "memcpy both procs": "memcpy x2",
}


def _ratio_cell(r: dict[str, Any]) -> str:
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.2f} {_SHORT_BASE.get(r['baseline'], r['baseline'])}"


def _peak_cell(r: dict[str, Any]) -> str:
    s, rc = r.get("peak_sender_bytes"), r.get("peak_receiver_bytes")
    if s is None and rc is None:
        return "-"
    return f"{(s or 0) / MIB:.0f}/{(rc or 0) / MIB:.0f}"


def _cleanup(result: dict[str, Any], notes: Notes) -> list[str]:
    info = result.get("cleanup_info", {})
    device = info.get("device")
    what = " (stand-in: no caching allocator, so this is garbage-collection cost)" if device == "cpu" else ""
    out = _wrap(f"CLEANUP: device {device}{what}; heap of {info.get('objects', 0):,} GC-tracked objects")
    rows = []
    for r in result["cleanup"]:
        ok = r["status"] == "ok"
        rows.append([
            r["boundary"], r["policy"], r["kind"],
            f"{r['median_s'] * 1000:.2f}" if ok else "-",
            fmt_range(r["min_s"], r["max_s"], 1000, 2) if ok else "-",
            {True: "yes", False: "no", None: "-"}[r["gc_ran"]],
            f"{r['gc_collected']:,}" if r.get("gc_collected") is not None else "-",
            notes.status(r["status"]),
        ])  # fmt: skip
    headers = ["boundary", "policy", "kind", "median ms", "min-max ms", "gc", "collected", "status"]
    out.append(table(headers, rows, [False, False, False, True, True, False, True, False]))
    added = info.get("aggressive_added_seconds", {})
    shown = [f"{b} {'-' if v is None else f'{v * 1000:+.1f} ms'}" for b, v in added.items()]
    if shown:
        out += _wrap("aggressive adds per call (median, vs light, same run): " + ", ".join(shown))
    return out


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, int, list[dict[str, Any]]]]:
    seen: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        seen.setdefault((r["model"], r["bytes"]), []).append(r)
    return [(m, b, rs) for (m, b), rs in seen.items()]


_VERSUS = (
    ("colocated shm", "fastsync colocated shm", "verl colocated shm"),
    ("gloo", "fastsync engine gloo", "verl gloo split/merge"),
    ("nixl", "fastsync engine nixl", "verl nixl engine+shims"),
)


def _versus(rows: list[dict[str, Any]], buckets: list[int]) -> list[str]:
    """fastsync's speed over verl's per bucket (verl median / fastsync median, same run)."""
    out = []
    for bucket in buckets:
        by = {r["row"]: r for r in rows if r["bucket_bytes"] == bucket}
        parts = []
        for what, fast, verl in _VERSUS:
            f, v = by.get(fast), by.get(verl)
            if f is None or v is None:
                continue
            if f["status"] != "ok":
                parts.append(f"{what}: fastsync {f['status'].split(':')[0]}")
            elif v["status"] != "ok":
                parts.append(f"{what}: verl {'fails' if v['status'].startswith('error') else 'n/a'}")
            elif f["median_s"] and f["median_s"] >= 1e-4:
                parts.append(f"{what} {v['median_s'] / f['median_s']:.2f}x")
        if parts:
            out += _wrap(f"  bucket {fmt_bucket(bucket)}: " + "; ".join(parts), "    ")
    return out


def _transfer(result: dict[str, Any], notes: Notes) -> list[str]:
    out: list[str] = []
    for model, nbytes, rows in _groups(result["transfer"]):
        memcpy = next((r for r in rows if r["row"] == "memcpy"), None)
        first = rows[0]
        head = (
            f"TRANSFER: {model}, {fmt_bytes(nbytes)} ({first.get('tensor_count')} tensors, largest "
            f"{fmt_bytes(first.get('largest_tensor_bytes'))})"
        )
        if memcpy is not None and memcpy["status"] == "ok":
            head += (
                f"; memcpy of the same bytes {fmt_s(memcpy['median_s'])} s "
                f"({fmt_range(memcpy['min_s'], memcpy['max_s'])}), {memcpy['gbps']:.2f} GB/s"
            )
        out += ["", *_wrap(head)]
        body = []
        # a path the host cannot run at any bucket size: one line below the table, not a row per bucket
        missing: dict[str, str] = {}
        for r in rows:
            if r["status"].startswith("not available"):
                missing.setdefault(r["row"], r["status"])
        for label in list(missing):
            if any(r["row"] == label and r["status"] != missing[label] for r in rows):
                del missing[label]
        for r in rows:
            if r is memcpy or r["row"] in missing:
                continue
            ok = r["status"] == "ok"
            body.append([
                fmt_bucket(r["bucket_bytes"]), r["row"], r["kind"], fmt_s(r["median_s"]),
                fmt_range(r["min_s"], r["max_s"]), f"{r['gbps']:.2f}" if ok and r["gbps"] else "-",
                _ratio_cell(r), _peak_cell(r), notes.status(r["status"]),
            ])  # fmt: skip
        headers = [
            "bucket",
            "row",
            "kind",
            "median s",
            "min-max s",
            "GB/s",
            "x baseline",
            "peak MiB s/r",
            "status",
        ]
        out.append(table(headers, body, [True, False, False, True, True, True, False, True, False]))
        if missing:
            by_reason: dict[str, list[str]] = {}
            for label, status in missing.items():
                by_reason.setdefault(status, []).append(label)
            for status, labels in by_reason.items():
                out += _wrap(
                    f"not available at any bucket size: {', '.join(labels)} {notes.status(status)[4:]}"
                )
        buckets = sorted({r["bucket_bytes"] for r in rows if r["bucket_bytes"] is not None})
        versus = _versus(rows, buckets)
        if versus:
            out += ["fastsync vs verl, speed (verl median s / fastsync median s, same run):", *versus]
    return out


def _idle(result: dict[str, Any], notes: Notes) -> list[str]:
    rows = result["idle"]
    window = rows[0]["idle_seconds"] if rows else 0
    out = [
        "",
        *_wrap(
            f"IDLE: CPU seconds per idle minute, sender + receiver process, after one sync with the path's "
            f"resources alive ({window:g} s window; the clock counts in 0.01 s ticks)"
        ),
    ]
    body = [
        [r["row"], r["kind"], r["transport"],
         "-" if r["cpu_seconds_per_minute"] is None else f"{r['cpu_seconds_per_minute']:.2f}",
         notes.status(r["status"])]
        for r in rows
    ]  # fmt: skip
    out.append(
        table(["row", "kind", "transport", "CPU-s/min", "status"], body, [False, False, False, True, False])
    )
    return out


def _scale(result: dict[str, Any], notes: Notes) -> list[str]:
    out = ["", "SCALE: seconds against model bytes and against tensor count at equal bytes"]
    body = [
        [r["axis"], r["row"], fmt_bytes(r["bytes"]), str(r["tensor_count"]), fmt_bucket(r["bucket_bytes"]),
         fmt_s(r["median_s"]), fmt_range(r["min_s"], r["max_s"]),
         f"{r['gbps']:.2f}" if r.get("gbps") else "-", notes.status(r["status"])]
        for r in result["scale"]
    ]  # fmt: skip
    headers = ["axis", "row", "bytes", "tensors", "bucket", "median s", "min-max s", "GB/s", "status"]
    out.append(table(headers, body, [False, False, True, True, True, True, True, True, False]))
    return out


_TITLES = {
    "e2e": "E2E (real vLLM)",
    "crosshost": "CROSSHOST (two network namespaces)",
    "fanout": "FANOUT (one trainer host, H rollout hosts x R ranks, each host or rank on its own tc-shaped "
    "link to a switch; models per sync on each link from the veth counters)",
    "delta": "DELTA (one sync per step, delta=true vs delta=false of the same weights; real AdamW steps; "
    "two network namespaces)",
}


def _external(result: dict[str, Any], section: str, notes: Notes) -> list[str]:
    title = _TITLES[section]
    if section in result.get("skipped", {}):
        return ["", *_wrap(f"{title}: skipped: {result['skipped'][section]}", "    ")]
    if section == "delta":
        return _delta(result, title)
    if section == "fanout":
        return ["", *_wrap(title), fanout_table(result["fanout"], notes)]
    body = [
        [r["row"], r["kind"], r["transport"], fmt_bytes(r["bytes"]), fmt_s(r["median_s"]),
         fmt_range(r["min_s"], r["max_s"]), str(len(r["seconds"])),
         "-" if r["ratio"] is None else f"{r['ratio']:.2f} {r['baseline']}"[:24], notes.status(r["status"])]
        for r in result[section]
    ]  # fmt: skip
    headers = ["row", "kind", "transport", "bytes", "median s", "min-max s", "n", "x baseline", "status"]
    return ["", title, table(headers, body, [False, False, False, True, True, True, True, False, False])]


def _delta(result: dict[str, Any], title: str) -> list[str]:
    """One line per step: the delta=false and delta=true syncs of the same weights side by side."""
    rows = {r["row"]: r for r in result["delta"]}
    body = []
    for r in result["delta"]:
        full = rows.get(r["baseline"] or "")
        if full is None or r["status"] != "ok" or full["status"] != "ok":
            continue
        link = f"{r['link_gbit']:g} Gbit/s" if r["link_gbit"] else "unshaped"
        faster = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        body.append(
            [f"host {r['transport']}" if r["one_host"] else link, f"{r['lr']:g}", r["step"],
             f"{r['changed_fraction']:.2%}", fmt_bytes(full["wire_bytes"]), fmt_bytes(r["wire_bytes"]),
             f"{full['wire_bytes'] / max(r['wire_bytes'], 1):.1f}x", fmt_s(full["median_s"]),
             fmt_s(r["median_s"]), faster, fmt_s(r["encode_s"]), fmt_s(r["rebuild_s"])]
        )  # fmt: skip
    headers = ["link", "lr", "step", "changed", "full", "delta", "fewer bytes", "full s", "delta s", "faster",
               "encode s", "rebuild s"]  # fmt: skip
    right = [False, True, True, True, True, True, True, True, True, True, True, True]
    return ["", *_wrap(title), table(headers, body, right)]


def fanout_table(rows: list[dict[str, Any]], notes: Notes | None = None) -> str:
    """The fanout section: per row its shape, seconds, models per sync on the trainer host's link and
    on the busiest rollout host's, ``busy`` (the busiest link's share of its rate: ~1 = link-bound),
    its time as a multiple of the 1x1 row's, and verl's NIXL engine's seconds / its own (> 1: faster
    than verl's engine in the same shape). Without ``notes`` the statuses follow the table."""
    own = notes is None
    notes = notes or Notes()

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    body = [
        [r["host_kind"], f"{r['hosts']}x{r['ranks_per_host']}", str(r["senders"]), r["row"].split(": ", 1)[1],
         fmt_s(r["median_s"]), num(r["trainer_link_models"], ".2f"),
         num(max(r["rollout_link_models"], default=None), ".2f"), num(r["busy"], ".2f"),
         num(r["vs_1x1"], ".2f"), num(r["ratio"], ".2f"), notes.status(r["status"])]
        for r in rows
    ]  # fmt: skip
    headers = ["host kind", "shape", "snd", "what", "s/sync", "trainer link", "max host link", "busy",
               "x 1x1", "verl/s", "status"]  # fmt: skip
    right = [False, True, True, False, True, True, True, True, True, True, False]
    return "\n".join([table(headers, body, right), *(notes.render() if own else [])])


def _legend(result: dict[str, Any]) -> list[str]:
    """What each row is (rows with the same description share a line)."""
    by_note: dict[str, list[str]] = {}
    seen: set[str] = set()
    for section in ("transfer", "idle"):
        for r in result.get(section, []):
            note = r["note"].split("; CPU seconds")[0]
            if r.get("copies") and note:
                note += f" [passes over each byte: {r['copies']}]"
            if note and r["row"] not in seen:
                seen.add(r["row"])
                by_note.setdefault(note, []).append(r["row"])
    out = ["", "What each row is:"]
    for note, labels in by_note.items():
        out += _wrap(f"  {', '.join(labels)}: {note}", "      ")
    return out


def render_table(result: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run (lines of at most :data:`WIDTH`)."""
    host = result.get("host", {})
    opts = result.get("options", {})
    parts = _wrap(
        f"verl-fastsync bench, {opts.get('preset', '?')} preset (verl {result.get('verl_version')}, "
        f"torch {result.get('torch_version')}, {host.get('cpus')} CPUs, "
        f"{'CUDA' if host.get('cuda') else 'no CUDA'})"
    )
    parts += _wrap(
        f"Every time: median of {opts.get('repeats')} timed repeats with min-max, after one untimed warm-up "
        "sync that also checks the received bytes. Ratios are from this run only; x baseline = baseline "
        "median / row median (same bytes; > 1 is faster). peak MiB s/r: resident-set growth of sender, "
        "receiver."
    )
    notes = Notes()
    sections: list[tuple[bool, Any]] = [
        (bool(result["cleanup"]), lambda: ["", *_cleanup(result, notes)]),
        (bool(result["transfer"]), lambda: _transfer(result, notes)),
        (bool(result["idle"]), lambda: _idle(result, notes)),
        (bool(result["scale"]), lambda: _scale(result, notes)),
    ]
    for section in EXTERNAL:
        shown = bool(result.get(section)) or section in result.get("skipped", {})
        sections.append((shown, lambda section=section: _external(result, section, notes)))
    for shown, render in sections:
        if shown:
            start = len(notes.texts)
            parts += render()
            parts += notes.render(start)  # this section's reasons and errors, whole, below its table
    if result["transfer"] or result["idle"]:
        parts += _legend(result)
    if "wall_seconds" in result:
        parts.append(f"\nwall time: {result['wall_seconds']:.1f} s")
    return "\n".join(parts)
