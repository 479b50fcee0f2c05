"""One bench run: the requested sections in order, into one JSON document (docs/bench-schema.md)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import time
from collections.abc import Callable
from typing import Any

from verl_fastsync.tools.bench.baselines import verl_version
from verl_fastsync.tools.bench.cleanup import run_cleanup_section
from verl_fastsync.tools.bench.external import run_external_section
from verl_fastsync.tools.bench.measure import memcpy_seconds
from verl_fastsync.tools.bench.options import EXTERNAL, MIB, SCHEMA_VERSION, SECTIONS, BenchOptions
from verl_fastsync.tools.bench.schema import validate_bench_json
from verl_fastsync.tools.bench.transfer import (
    MEMCPY,
    Runner,
    run_idle_section,
    run_scale_section,
    run_transfer_section,
)


def run_bench(opts: BenchOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the requested sections and return the JSON document (see docs/bench-schema.md)."""
    opts.check()
    progress = progress or (lambda _m: None)
    import torch

    started = time.time()
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "verl_version": verl_version(),
        "verl_fastsync_version": importlib.import_module("verl_fastsync").__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": {"cpus": os.cpu_count(), "cuda": torch.cuda.is_available(), "machine": platform.machine()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(opts).items()},
        "memcpy_gbps": None,
        "cleanup_info": {},
        "skipped": {},
        **{section: [] for section in SECTIONS},
    }
    runner = None
    if {"transfer", "idle", "scale"} & set(opts.sections):
        runner = Runner(opts, progress, device="cuda" if torch.cuda.is_available() else "cpu")
        # the workers import verl's modules (10-20 s) while the cleanup child builds its heap
        runner.preload()
    try:
        if "cleanup" in opts.sections:
            wait = runner.pair.wait_preload if runner is not None else None
            result["cleanup"], result["cleanup_info"] = run_cleanup_section(opts, progress, wait)
        if runner is not None:
            runner.pair.wait_preload()
        if runner is not None and "transfer" in opts.sections:
            result["transfer"] = run_transfer_section(runner)
        if runner is not None and "idle" in opts.sections:
            result["idle"] = run_idle_section(runner)
        if runner is not None and "scale" in opts.sections:
            result["scale"] = run_scale_section(runner, result["transfer"])
    finally:
        if runner is not None:
            runner.close()
    for section in EXTERNAL:
        if section in opts.sections:
            rows, why = run_external_section(section, opts.preset != "full", progress)
            result[section] = rows
            if why is not None:
                result["skipped"][section] = why
    memcpy = [r for r in result["transfer"] if r["row"] == MEMCPY and r["median_s"]]
    if memcpy:
        result["memcpy_gbps"] = memcpy[0]["bytes"] / memcpy[0]["median_s"] / 1e9
    else:
        seconds = sorted(memcpy_seconds(256 * MIB, 5))
        result["memcpy_gbps"] = 256 * MIB / seconds[len(seconds) // 2] / 1e9
    result["wall_seconds"] = time.monotonic() - t0
    validate_bench_json(result)
    return result
