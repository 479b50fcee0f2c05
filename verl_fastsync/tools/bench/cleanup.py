"""The cleanup section: every cleanup policy at both boundaries, in a child process that holds a
trainer-like Python heap.

The heap is ``--heap-objects`` GC-tracked objects in reference cycles, plus 1% of that as fresh
unreachable cycles before every call (the garbage a training step leaves behind). Each policy runs
through :func:`verl_fastsync.cleanup.run_boundary`. On a host without an accelerator the device
is the :class:`~verl_fastsync.tools.bench.measure.CpuDevice` stand-in: there is no caching
allocator, so the section measures what the policies cost in garbage collection.

``aggressive`` is fastsync's re-implementation of verl 0.9.0's
``aggressive_empty_cache(force_sync=True)`` (verl's own function returns at once without an
accelerator), so its rows are labelled ``verl-reconstruction``.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from verl_fastsync.tools.bench.options import BOUNDARIES, MIB, POLICIES, BenchOptions
from verl_fastsync.tools.bench.protocol import Child, emit
from verl_fastsync.tools.bench.schema import ERROR, make_row


class _Node:
    __slots__ = ("payload", "peer")

    def __init__(self, payload: int) -> None:
        self.payload = payload
        self.peer: Any = None


def build_heap(objects: int) -> list[Any]:
    """A trainer-like Python heap of about ``objects`` GC-tracked objects (node <-> list <-> dict cycles)."""
    root: list[Any] = []
    for i in range(objects // 3):
        node = _Node(i)
        record = {"node": node, "step": i}
        node.peer = [record, i]
        root.append(node)
    return root


def make_garbage(objects: int) -> None:
    """Leave about ``objects`` unreachable objects in reference cycles in the oldest GC generation.

    They are kept alive through a young-generation collection (which promotes them, as objects that
    lived through a training step are), then dropped: only a full ``gc.collect()`` finds them, which
    is what a trainer's leftovers look like to the cleanup policies."""
    holder: list[Any] = []
    for i in range(objects // 3):
        node = _Node(i)
        node.peer = [{"node": node}, i]
        holder.append(node)
    gc.collect(1)  # survivors move to the oldest generation
    holder.clear()


def device_tensor(device_name: str, nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device_name)


def cleanup_child(heap_objects: int, repeats: int, policies: Sequence[str], cached_mib: int) -> None:
    """Child process: build the heap, then run every policy at every boundary ``repeats`` times."""
    from verl_fastsync import plugins
    from verl_fastsync.cleanup import run_boundary
    from verl_fastsync.config import FastsyncConfig
    from verl_fastsync.tools.bench.measure import bench_device

    device, device_name, source = bench_device()
    t0 = time.perf_counter()
    heap = build_heap(heap_objects)
    gc.collect()
    emit(
        {
            "event": "heap",
            "objects": len(gc.get_objects()),
            "seconds": time.perf_counter() - t0,
            "device": device_name,
            "device_source": source,
        }
    )
    import sys

    sys.stdin.readline()  # "go": the parent has finished whatever else was starting up
    pm = plugins.get_plugin_manager()
    config = FastsyncConfig()
    garbage = max(3, heap_objects // 100)
    for rep in range(repeats):
        for boundary in BOUNDARIES:
            for policy_name in policies:
                try:
                    policy = plugins.select_cleanup(pm, boundary, policy_name)
                    if cached_mib and device_name != "cpu":
                        # leave freed blocks in the caching allocator, as a finished training step does
                        blocks = [
                            device_tensor(device_name, 64 * MIB) for _ in range(max(1, cached_mib // 64))
                        ]
                        del blocks
                    make_garbage(garbage)
                    record = run_boundary(boundary, policy_name, policy, device, config)
                    emit({"event": "record", "repeat": rep, **dataclasses.asdict(record)})
                except Exception as exc:
                    emit(
                        {
                            "event": "error",
                            "repeat": rep,
                            "boundary": boundary,
                            "policy": policy_name,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
    del heap
    emit({"event": "done"})


_KIND = {"light": "fastsync", "adaptive": "fastsync", "aggressive": "verl-reconstruction"}
_NOTE = {
    "light": "fastsync's default: no garbage collection on the sync's critical path",
    "adaptive": "fastsync: collects garbage only when free device memory is below the headroom",
    "aggressive": "fastsync's re-implementation of verl 0.9.0's aggressive_empty_cache(force_sync=True) "
    "(verl's own returns at once without an accelerator)",
}


def run_cleanup_section(
    opts: BenchOptions, progress: Callable[[str], None], before_measuring: Callable[[], None] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Cleanup rows (one per boundary x policy; seconds per repeat) and section info, including
    ``aggressive_added_seconds`` (median seconds aggressive adds per call over light, per boundary)."""
    progress(f"cleanup: building a {opts.heap_objects:,}-object heap in a child process")
    child = Child(
        ["_cleanup-child", str(opts.heap_objects), str(opts.repeats), ",".join(POLICIES), "1024"],
        opts.timeout_s,
    )
    records: dict[tuple[str, str], list[dict[str, Any]]] = {}
    errors: dict[tuple[str, str], str] = {}
    info: dict[str, Any] = {}
    try:
        while True:
            msg = child.recv()
            if msg["event"] == "heap":
                info = {k: msg[k] for k in ("objects", "device", "device_source")}
                info["heap_build_seconds"] = msg["seconds"]
                if before_measuring is not None:
                    progress("cleanup: waiting for the transfer workers' imports (nothing runs beside it)")
                    before_measuring()
                child.send({"op": "go"})
            elif msg["event"] == "record":
                records.setdefault((msg["boundary"], msg["policy"]), []).append(msg)
                progress(
                    f"cleanup: {msg['policy']:<10} @ {msg['boundary']:<22} repeat {msg['repeat'] + 1}/"
                    f"{opts.repeats}: {msg['seconds'] * 1000:.1f} ms"
                )
            elif msg["event"] == "error":
                errors[(msg["boundary"], msg["policy"])] = msg["error"]
            elif msg["event"] == "done":
                break
    except (TimeoutError, RuntimeError) as exc:
        for b in BOUNDARIES:
            for p in POLICIES:
                errors.setdefault((b, p), str(exc))
    finally:
        child.kill()
    rows = []
    for boundary in BOUNDARIES:
        for policy in POLICIES:
            recs = records.get((boundary, policy), [])
            ok = bool(recs) and (boundary, policy) not in errors
            status = "ok" if ok else ERROR + errors.get((boundary, policy), "no result")

            def med(key: str, recs: list[dict[str, Any]] = recs, ok: bool = ok) -> int | None:
                return int(statistics.median(r[key] for r in recs)) if ok else None

            rows.append(
                make_row(
                    policy,
                    _KIND[policy],
                    "-",
                    [r["seconds"] for r in recs] if ok else [],
                    None,
                    status,
                    None,
                    _NOTE[policy],
                    boundary=boundary,
                    policy=policy,
                    gc_ran=any(r["gc_ran"] for r in recs) if ok else None,
                    gc_collected=med("gc_collected"),
                    attempts=max(r["attempts"] for r in recs) if ok else None,
                    reserved_freed_bytes=med("reserved_freed_bytes"),
                    allocated_freed_bytes=med("allocated_freed_bytes"),
                    device=info.get("device", "unknown"),
                    heap_objects=info.get("objects"),
                )
            )
    added: dict[str, float | None] = {}
    for boundary in BOUNDARIES:
        by = {r["policy"]: r for r in rows if r["boundary"] == boundary and r["status"] == "ok"}
        light, aggr = by.get("light"), by.get("aggressive")
        added[boundary] = aggr["median_s"] - light["median_s"] if light and aggr else None
        if aggr is not None:
            aggr["added_seconds_per_call"] = added[boundary]
    info["aggressive_added_seconds"] = added
    return rows, info
