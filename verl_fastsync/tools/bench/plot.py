"""``--plot``: GB/s per bucket size, fastsync next to verl and the raw limit, one panel per
transport (and per model size). Three colours: fastsync, verl, raw. A path that fails at a bucket
size is drawn as a red X labelled "fails"; one the host cannot run as "n/a". Ticks only at the
bucket sizes that were measured."""

from __future__ import annotations

from typing import Any

from verl_fastsync.tools.bench.options import MIB
from verl_fastsync.tools.bench.report import fmt_bytes

COLOURS = {"fastsync": "#1f77b4", "verl": "#ff7f0e", "raw": "#9a9a9a"}
_FAMILY = {
    "fastsync": "fastsync",
    "verl": "verl",
    "verl-stand-in": "verl",
    "verl-reconstruction": "verl",
    "raw": "raw",
}
_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("colocated shm", ("fastsync colocated shm", "verl colocated shm")),
    ("engine shm", ("fastsync engine shm",)),
    ("gloo", ("fastsync engine gloo", "verl gloo split/merge", "raw gloo broadcast")),
    ("nixl", ("fastsync engine nixl", "verl nixl engine+shims", "raw nixl WRITE")),
    ("nccl", ("fastsync engine nccl", "verl nccl engine")),
    ("colocated ipc", ("fastsync colocated ipc",)),
)
"""Panel title -> the rows it compares (at most one per colour)."""


def _panel_rows(rows: list[dict[str, Any]], labels: tuple[str, ...]) -> list[dict[str, Any]]:
    return [r for r in rows if r["row"] in labels or r["row"] == "memcpy"]


def write_plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise RuntimeError(
            f"--plot needs matplotlib ({exc}); install it with `pip install matplotlib`"
        ) from exc
    rows = result["transfer"]
    groups: list[tuple[str, int]] = []
    for r in rows:
        if (r["model"], r["bytes"]) not in groups:
            groups.append((r["model"], r["bytes"]))

    def drawn(labels: tuple[str, ...]) -> bool:  # a panel with only "not available" rows is left out
        return any(r["row"] in labels and not r["status"].startswith("not available") for r in rows)

    panels = [p for p in _PANELS if drawn(p[1])] or list(_PANELS[:1])
    fig, axes = plt.subplots(
        max(1, len(groups)), len(panels), figsize=(4.6 * len(panels), 4.0 * max(1, len(groups)) + 0.8),
        squeeze=False,
    )  # fmt: skip
    for gi, (model, nbytes) in enumerate(groups or [("", 0)]):
        grows = [r for r in rows if r["model"] == model and r["bytes"] == nbytes]
        for ti, (title, labels) in enumerate(panels):
            ax = axes[gi][ti]
            _draw_panel(ax, _panel_rows(grows, labels))
            ax.set_title(f"{title}: {model} {fmt_bytes(nbytes)}", fontsize=12)
            ax.set_xlabel("bucket size", fontsize=11)
            if ti == 0:
                ax.set_ylabel("GB/s (higher is better)", fontsize=11)
            ax.grid(True, axis="y", alpha=0.3)
    names = {"fastsync": "fastsync", "verl": "verl", "raw": "raw limit (gloo broadcast, NIXL WRITE)"}
    handles: list[Any] = [Patch(color=c, label=names[n]) for n, c in COLOURS.items()]
    handles.append(
        Patch(facecolor="white", edgecolor="black", hatch="//", label="verl stand-in / reconstruction")
    )
    handles.append(plt.Line2D([], [], color="red", marker="x", linestyle="", markersize=10, label="fails"))
    top = 1 - 0.75 / fig.get_figheight()
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, top), ncol=len(handles), fontsize=11,
               frameon=False)  # fmt: skip
    fig.suptitle(
        f"verl-fastsync bench (verl {result.get('verl_version')}, one run; median of "
        f"{result.get('options', {}).get('repeats')})",
        y=1 - 0.15 / fig.get_figheight(), fontsize=13,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.0 / fig.get_figheight()))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    bars = [r for r in rows if r["bucket_bytes"] is not None]
    buckets = sorted({r["bucket_bytes"] for r in bars})
    families = ["fastsync", "verl", "raw"]
    width = 0.8 / len(families)
    top = max([r["gbps"] for r in rows if r["status"] == "ok" and r.get("gbps")] or [1.0])
    for r in bars:
        family = _FAMILY.get(r["kind"], "raw")
        x = buckets.index(r["bucket_bytes"]) - 0.4 + width * (families.index(family) + 0.5)
        if r["status"] == "ok" and r.get("gbps"):
            hatch = "//" if r["kind"] in ("verl-stand-in", "verl-reconstruction") else None
            ax.bar(
                x,
                r["gbps"],
                width * 0.9,
                color=COLOURS[family],
                hatch=hatch,
                edgecolor="black",
                linewidth=0.5,
            )
        elif r["status"].startswith("error"):
            ax.plot([x], [top * 0.04], marker="x", color="red", markersize=14, markeredgewidth=3)
            ax.text(
                x, top * 0.09, "fails", color="red", ha="center", va="bottom", fontsize=11, fontweight="bold"
            )
        else:
            ax.text(x, top * 0.04, "n/a", color="dimgrey", ha="center", va="bottom", fontsize=10)
    memcpy = [r for r in rows if r["row"] == "memcpy" and r["status"] == "ok"]
    if memcpy:
        ax.axhline(memcpy[0]["gbps"], color=COLOURS["raw"], linestyle="--", linewidth=1.5)
        ax.text(-0.45, memcpy[0]["gbps"], "memcpy", color="dimgrey", va="bottom", ha="left", fontsize=10)
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels([f"{b // MIB} MiB" for b in buckets], fontsize=11)
    ax.set_xlim(-0.5, max(0.5, len(buckets) - 0.5))
    ax.set_ylim(0, top * 1.15)
