"""Cleanup A/B on a real caching allocator: ``light`` vs ``adaptive`` vs ``aggressive`` (verl 0.9.0).

For each boundary and policy, with a trainer-like Python heap (``--heap-objects``, default 3,000,000
GC-tracked objects in reference cycles) alive in this process:

1. ``--cached-mib`` of device blocks are allocated and freed, so the caching allocator holds them
   (reserved, not allocated), as after a training step;
2. ``--cycle-mib`` of device tensors are left inside unreachable Python reference cycles (the one
   case in which ``gc.collect()`` can give device memory back), plus 1% of the heap as plain garbage
   cycles; ``--cycle-mib 0`` leaves only the plain garbage;
3. the policy runs through ``verl_fastsync.cleanup.run_boundary``, which measures wall seconds and
   the reserved/allocated bytes it freed; the policy reports ``gc_ran``/``gc_collected``.

Writes one JSON object (``--out``) and prints a table. Runs on CPU too (device ``cpu``, nothing is
cached there), which is how it is checked without a GPU; it imports CUDA only through torch.

Usage: ``python benchmarks/gpu_cleanup_check.py --out cleanup.json [--heap-objects N] [--repeats R]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from typing import Any

MIB = 1 << 20


class _Holder:
    """A node of a garbage cycle that holds a device tensor."""

    __slots__ = ("peer", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.peer: Any = None


def _leave_cycles_holding(device_name: str, mib: int, pieces: int = 16) -> None:
    """Device tensors held only by unreachable reference cycles in the oldest GC generation (as
    :func:`verl_fastsync.tools.bench.make_garbage` leaves them): only a full ``gc.collect()`` frees them."""
    import torch

    if mib <= 0:
        return
    holder: list[Any] = []
    per = max(1, mib // pieces) * MIB
    for _ in range(pieces):
        a = _Holder(torch.empty(per, dtype=torch.uint8, device=device_name))
        b = _Holder(None)
        a.peer, b.peer = b, a
        holder.append(a)
    gc.collect(1)
    holder.clear()


def _cache_blocks(device_name: str, mib: int) -> None:
    import torch

    if mib <= 0 or device_name == "cpu":
        return
    blocks = [torch.empty(64 * MIB, dtype=torch.uint8, device=device_name) for _ in range(max(1, mib // 64))]
    del blocks


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from verl_fastsync import plugins
    from verl_fastsync.cleanup import run_boundary
    from verl_fastsync.config import FastsyncConfig
    from verl_fastsync.tools.bench import BOUNDARIES, bench_device, build_heap, make_garbage

    device, device_name, source = bench_device()
    t0 = time.perf_counter()
    heap = build_heap(args.heap_objects)
    gc.collect()
    heap_objects = len(gc.get_objects())
    heap_seconds = time.perf_counter() - t0
    pm = plugins.get_plugin_manager()
    config = FastsyncConfig()
    policies = args.policies.split(",")
    records: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for cycle_mib in sorted({0, args.cycle_mib}):
            for boundary in BOUNDARIES:
                for policy_name in policies:
                    policy = plugins.select_cleanup(pm, boundary, policy_name)
                    _cache_blocks(device_name, args.cached_mib)
                    _leave_cycles_holding(device_name, cycle_mib)
                    make_garbage(max(3, args.heap_objects // 100))
                    reserved_before = int(getattr(device, "memory_reserved", lambda: 0)())
                    record = run_boundary(boundary, policy_name, policy, device, config)
                    row = dataclasses.asdict(record) | {
                        "repeat": rep,
                        "cycle_mib": cycle_mib,
                        "reserved_before_bytes": reserved_before,
                    }
                    records.setdefault((boundary, policy_name, cycle_mib), []).append(row)
                    print(
                        f"{boundary:<22} {policy_name:<10} cycles {cycle_mib:>5} MiB  rep {rep}: "
                        f"{record.seconds * 1000:8.1f} ms  "
                        f"freed {record.reserved_freed_bytes / MIB:9.1f} MiB  "
                        f"gc_collected {record.gc_collected}",
                        file=sys.stderr,
                    )
                    # start the next measurement from the same state: drop what the policy left
                    gc.collect()
                    device.empty_cache()
    rows = []
    for (boundary, policy_name, cycle_mib), recs in records.items():
        secs = [r["seconds"] for r in recs]
        rows.append(
            {
                "boundary": boundary,
                "policy": policy_name,
                "cycle_mib": cycle_mib,
                "cached_mib": args.cached_mib,
                "repeats": len(recs),
                "seconds": statistics.median(secs),
                "seconds_min": min(secs),
                "seconds_max": max(secs),
                "gc_ran": any(r["gc_ran"] for r in recs),
                "gc_collected": int(statistics.median(r["gc_collected"] for r in recs)),
                "reserved_freed_bytes": int(statistics.median(r["reserved_freed_bytes"] for r in recs)),
                "allocated_freed_bytes": int(statistics.median(r["allocated_freed_bytes"] for r in recs)),
                "attempts": max(r["attempts"] for r in recs),
                "raw": recs,
            }
        )
    ratios = {}
    for boundary in BOUNDARIES:
        for cycle_mib in sorted({0, args.cycle_mib}):
            by = {r["policy"]: r for r in rows if r["boundary"] == boundary and r["cycle_mib"] == cycle_mib}
            if "light" in by and "aggressive" in by and by["light"]["seconds"] > 0:
                ratios[f"{boundary}/cycles_{cycle_mib}mib"] = (
                    by["aggressive"]["seconds"] / by["light"]["seconds"]
                )
    del heap
    return {
        "schema_version": 1,
        "check": "gpu_cleanup",
        "device": device_name,
        "device_source": source,
        "torch_version": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "heap_objects": heap_objects,
        "heap_build_seconds": heap_seconds,
        "rows": rows,
        "aggressive_over_light": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--heap-objects", type=int, default=3_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cached-mib", type=int, default=4096, help="device MiB left cached before each call"
    )
    parser.add_argument("--cycle-mib", type=int, default=1024, help="device MiB held by garbage cycles")
    parser.add_argument("--policies", default="light,adaptive,aggressive")
    args = parser.parse_args(argv)
    result = run(args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"\n{'boundary':<22} {'policy':<10} {'cycles':>6}  {'ms':>8}  {'freed MiB':>9}  gc_collected")
    for r in result["rows"]:
        print(
            f"{r['boundary']:<22} {r['policy']:<10} {r['cycle_mib']:>6}  {r['seconds'] * 1000:8.1f}  "
            f"{r['reserved_freed_bytes'] / MIB:9.1f}  {r['gc_collected']}"
        )
    print(f"aggressive/light: {result['aggressive_over_light']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
