"""verl-fastsync bench: weight sync measured next to stock verl and the raw limit, in one run.

Sections (each between real processes; every time a median of --repeats with min and max):
cleanup (the cleanup policies at both boundaries, in a process holding a trainer-like heap),
transfer (every transport moving a synthetic model, next to verl's path and the raw mechanism for
the same bytes), idle (CPU seconds per idle minute of each transport), scale (seconds against model
bytes and tensor count), e2e, crosshost, delta and fanout (from verl_fastsync.tools.e2e / .crosshost /
.delta_bench / .fanout when present).

Package layout: options (presets, validation), measure (RSS, CPU time, memcpy, the CPU device
stand-in), protocol (child processes, JSON lines), cleanup, worker (transfer worker, fastsync
paths), baselines (verl's paths and raw mechanisms, labelled), transfer (trials, the transfer /
idle / scale sections), external (e2e, crosshost, delta, fanout), schema (rows, JSON schema), report (tables),
plot, run (one run). The JSON schema is docs/bench-schema.md.
"""

from __future__ import annotations

from verl_fastsync.tools.bench.cleanup import build_heap, make_garbage
from verl_fastsync.tools.bench.measure import CpuDevice, bench_device, memcpy_seconds, worker_threads
from verl_fastsync.tools.bench.options import (
    BOUNDARIES,
    CPU_TRANSPORTS,
    GIB,
    GPU_TRANSPORTS,
    KINDS,
    MIB,
    POLICIES,
    SCHEMA_VERSION,
    SECTIONS,
    TRANSPORTS,
    BenchOptionError,
    BenchOptions,
    BenchSchemaError,
    full_options,
    parse_config,
)
from verl_fastsync.tools.bench.plot import write_plot
from verl_fastsync.tools.bench.report import WIDTH, Progress, render_table
from verl_fastsync.tools.bench.run import run_bench
from verl_fastsync.tools.bench.schema import iter_rows, validate_bench_json

__all__ = [
    "BOUNDARIES",
    "CPU_TRANSPORTS",
    "GIB",
    "GPU_TRANSPORTS",
    "KINDS",
    "MIB",
    "POLICIES",
    "SCHEMA_VERSION",
    "SECTIONS",
    "TRANSPORTS",
    "WIDTH",
    "BenchOptionError",
    "BenchOptions",
    "BenchSchemaError",
    "CpuDevice",
    "Progress",
    "bench_device",
    "build_heap",
    "full_options",
    "iter_rows",
    "make_garbage",
    "memcpy_seconds",
    "parse_config",
    "render_table",
    "run_bench",
    "validate_bench_json",
    "worker_threads",
    "write_plot",
]
