"""Sections measured by other modules of ``verl_fastsync.tools``, rendered by the bench.

``e2e``: ``verl_fastsync.tools.e2e.bench_section(quick)`` (real vLLM, end to end);
``crosshost``: ``verl_fastsync.tools.crosshost.bench_section(quick)`` (two network namespaces);
``delta``: ``verl_fastsync.tools.delta_bench.bench_section(quick)`` (delta vs full syncs of real
optimizer steps across two network namespaces); ``fanout``:
``verl_fastsync.tools.fanout.bench_section(quick)`` (one trainer host, several rollout hosts and ranks,
each on its own link to a switch).
Each returns a list of row dicts (``row``, ``kind``, ``transport``, ``seconds``, ``bytes``,
``status``, ``baseline``, ``note``; see ``docs/bench-schema.md``). A section is skipped, with the
reason, when its module is missing, raises, or every row it returns is ``not available``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from verl_fastsync.tools.bench.options import BenchSchemaError
from verl_fastsync.tools.bench.schema import NOT_AVAILABLE, fill_ratios, normalize_external

MODULES = {
    "e2e": "verl_fastsync.tools.e2e",
    "crosshost": "verl_fastsync.tools.crosshost",
    "delta": "verl_fastsync.tools.delta_bench",
    "fanout": "verl_fastsync.tools.fanout",
}
"""The module behind each of the :data:`~verl_fastsync.tools.bench.options.EXTERNAL` sections."""


def run_external_section(
    section: str, quick: bool, progress: Callable[[str], None]
) -> tuple[list[dict[str, Any]], str | None]:
    """(rows, None) or ([], why the section was skipped)."""
    name = MODULES[section]
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        return [], f"{name} is not installed in this checkout"
    progress(f"{section}: {name}.bench_section(quick={quick})")
    try:
        module = importlib.import_module(name)
        func = getattr(module, "bench_section", None)
        if func is None:
            return [], f"{name} has no bench_section(quick)"
        raw = func(quick=quick)
        rows = [normalize_external(r, section) for r in raw]
    except BenchSchemaError as exc:
        return [], f"{name}.bench_section returned a malformed row: {exc}"
    except Exception as exc:
        return [], f"{name}.bench_section raised {type(exc).__name__}: {exc}"
    if not rows:
        return [], f"{name}.bench_section returned no rows"
    if all(r["status"].startswith(NOT_AVAILABLE) for r in rows):
        reasons = sorted({r["status"][len(NOT_AVAILABLE) :] for r in rows})
        return [], "; ".join(reasons)
    fill_ratios(rows)
    return rows, None
