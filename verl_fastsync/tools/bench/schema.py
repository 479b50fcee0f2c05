"""The bench's rows and their JSON schema (``docs/bench-schema.md``): one row shape for every
section, its construction, the same-run ratios, and the validator."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from verl_fastsync.tools.bench.measure import median_min_max, ratio
from verl_fastsync.tools.bench.options import BOUNDARIES, KINDS, SCHEMA_VERSION, SECTIONS, BenchSchemaError

NOT_AVAILABLE = "not available: "
ERROR = "error: "

ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "row": (str,),
    "kind": (str,),
    "transport": (str,),
    "seconds": (list,),
    "bytes": (int, type(None)),
    "status": (str,),
    "baseline": (str, type(None)),
    "note": (str,),
    "median_s": (float, int, type(None)),
    "min_s": (float, int, type(None)),
    "max_s": (float, int, type(None)),
    "ratio": (float, int, type(None)),
}
"""Keys of every row of every section (the keys the ``e2e``, ``crosshost`` and ``delta`` modules return
are the first eight; the bench adds the last four)."""

LATER_SECTIONS = ("delta", "fanout")
"""Sections added within schema version 2: a document of an earlier bench may lack them."""

SECTION_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "cleanup": {"boundary": (str,), "policy": (str,), "gc_ran": (bool, type(None))},
    "transfer": {
        "model": (str, type(None)),
        "bucket_bytes": (int, type(None)),
        "path": (str,),
        "gbps": (float, int, type(None)),
        "peak_sender_bytes": (int, type(None)),
        "peak_receiver_bytes": (int, type(None)),
    },
    "idle": {"cpu_seconds_per_minute": (float, int, type(None)), "idle_seconds": (float, int)},
    "scale": {"axis": (str,), "tensor_count": (int,), "bucket_bytes": (int, type(None))},
    "e2e": {},
    "crosshost": {},
    "fanout": {
        "host_kind": (str,),
        "hosts": (int,),
        "ranks_per_host": (int,),
        "senders": (int,),
        "link_gbit": (float, int),
        "trainer_link_models": (float, int, type(None)),
        "rollout_link_models": (list,),
        "rollout_out_models": (list,),
        "max_link_models": (float, int, type(None)),
        "busy": (float, int, type(None)),
        "vs_1x1": (float, int, type(None)),
    },
    "delta": {
        "link_gbit": (float, int),
        "one_host": (bool,),
        "lr": (float,),
        "step": (str,),
        "changed_fraction": (float, int),
        "wire_bytes": (int,),
        "encode_s": (float, int),
        "rebuild_s": (float, int),
    },
}


def make_row(
    row: str,
    kind: str,
    transport: str,
    seconds: Sequence[float],
    nbytes: int | None,
    status: str,
    baseline: str | None = None,
    note: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """A row; ``median_s``/``min_s``/``max_s`` from ``seconds`` (None unless ``status`` is ok),
    ``ratio`` filled by :func:`fill_ratios` once the whole section is known."""
    ok = status == "ok"
    med, lo, hi = median_min_max(list(seconds)) if ok else (None, None, None)
    return {
        "row": row,
        "kind": kind,
        "transport": transport,
        "seconds": [float(s) for s in seconds],
        "bytes": nbytes,
        "status": status,
        "baseline": baseline,
        "note": note,
        "median_s": med,
        "min_s": lo,
        "max_s": hi,
        "ratio": None,
        **extra,
    }


def normalize_external(raw: Any, section: str) -> dict[str, Any]:
    """A row from another module's ``bench_section`` -> a bench row (checked, derived keys added)."""
    if not isinstance(raw, dict):
        raise BenchSchemaError(f"{section}: a row must be a dict, got {type(raw).__name__}")
    missing = [k for k in ("row", "kind", "transport", "seconds", "bytes", "status") if k not in raw]
    if missing:
        raise BenchSchemaError(f"{section}: row {raw.get('row')!r} lacks {', '.join(missing)}")
    if raw["kind"] not in KINDS:
        raise BenchSchemaError(
            f"{section}: row {raw['row']!r} kind={raw['kind']!r}; allowed: {', '.join(KINDS)}"
        )
    if not isinstance(raw["status"], str) or not is_status(raw["status"]):
        raise BenchSchemaError(
            f"{section}: row {raw['row']!r} status={raw['status']!r}; "
            "allowed: ok, 'not available: ...', 'error: ...'"
        )
    extra = {k: v for k, v in raw.items() if k not in ROW_FIELDS}
    return make_row(
        str(raw["row"]),
        str(raw["kind"]),
        str(raw["transport"]),
        [float(s) for s in raw["seconds"] or []],
        raw["bytes"],
        str(raw["status"]),
        raw.get("baseline"),
        str(raw.get("note") or ""),
        **extra,
    )


def _same_group(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Rows that measure the same bytes: same model and size; a baseline without a bucket size
    (memcpy) serves every bucket size."""
    for key in ("model", "bytes", "boundary", "axis", "tensor_count"):
        if a.get(key) != b.get(key):
            return False
    return b.get("bucket_bytes") is None or a.get("bucket_bytes") == b.get("bucket_bytes")


def fill_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio`` = the baseline row's median seconds / this row's median seconds, both from this run
    (same bytes: > 1 is faster than the baseline); None when either is missing or too small."""
    for r in rows:
        if r["baseline"] is None or r["status"] != "ok":
            continue
        base = [b for b in rows if b["row"] == r["baseline"] and b is not r and _same_group(r, b)]
        if base and base[0]["status"] == "ok":
            r["ratio"] = ratio(base[0]["median_s"], r["median_s"])


def is_status(status: str) -> bool:
    return status == "ok" or status.startswith(NOT_AVAILABLE) or status.startswith(ERROR)


def _check_row(section: str, i: int, row: Any) -> None:
    where = f"{section}[{i}]"
    if not isinstance(row, dict):
        raise BenchSchemaError(f"{where} must be an object, got {type(row).__name__}")
    for key, types in {**ROW_FIELDS, **SECTION_FIELDS.get(section, {})}.items():
        if key not in row:
            raise BenchSchemaError(f"{where} lacks required key {key!r}")
        value = row[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise BenchSchemaError(f"{where}.{key}={value!r} must be {'/'.join(t.__name__ for t in types)}")
    if row["kind"] not in KINDS:
        raise BenchSchemaError(f"{where}.kind={row['kind']!r}; allowed: {', '.join(KINDS)}")
    if not is_status(row["status"]):
        raise BenchSchemaError(
            f"{where}.status={row['status']!r}; allowed: ok, 'not available: <reason>', 'error: <message>'"
        )
    for prefix in (NOT_AVAILABLE, ERROR):
        if row["status"].startswith(prefix) and not row["status"][len(prefix) :].strip():
            raise BenchSchemaError(f"{where}.status={row['status']!r} needs a reason")
    if row["status"] == "ok" and section != "idle" and row["median_s"] is None:
        raise BenchSchemaError(f"{where}: status ok needs seconds")
    if not all(isinstance(s, float | int) and not isinstance(s, bool) for s in row["seconds"]):
        raise BenchSchemaError(f"{where}.seconds must be a list of numbers")
    if section == "cleanup" and row["boundary"] not in BOUNDARIES:
        raise BenchSchemaError(f"{where}.boundary={row['boundary']!r}; allowed: {', '.join(BOUNDARIES)}")
    if section == "scale" and row["axis"] not in ("model_bytes", "tensor_count"):
        raise BenchSchemaError(f"{where}.axis={row['axis']!r}; allowed: model_bytes, tensor_count")


def validate_bench_json(obj: Any) -> None:
    """Raise :class:`BenchSchemaError` unless ``obj`` follows the bench schema (docs/bench-schema.md)."""
    if not isinstance(obj, dict):
        raise BenchSchemaError(f"the document must be an object, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BenchSchemaError(f"schema_version={version!r} must be an int")
    if version != SCHEMA_VERSION:
        raise BenchSchemaError(f"schema_version={version}; this validator reads {SCHEMA_VERSION}")
    if "verl_version" not in obj or not isinstance(obj["verl_version"], str | type(None)):
        raise BenchSchemaError("verl_version must be present (a string, or null without verl)")
    memcpy = obj.get("memcpy_gbps")
    if not isinstance(memcpy, int | float) or isinstance(memcpy, bool) or not memcpy > 0:
        raise BenchSchemaError(f"memcpy_gbps={memcpy!r} must be a positive number")
    skipped = obj.get("skipped")
    if not isinstance(skipped, dict) or not all(isinstance(v, str) for v in skipped.values()):
        raise BenchSchemaError("skipped must be an object {section: reason}")
    for section in SECTIONS:
        rows = obj.get(section, [] if section in LATER_SECTIONS else None)
        if not isinstance(rows, list):
            raise BenchSchemaError(f"{section} must be a list, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            _check_row(section, i, row)


def iter_rows(result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every row of every section."""
    for section in SECTIONS:
        yield from result.get(section, [])
