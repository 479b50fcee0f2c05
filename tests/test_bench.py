"""``verl-fastsync bench``: one tiny end-to-end run (real processes, real verl, gloo, NIXL, shm) and
the report's rules on synthetic documents (width, whole errors, not-available rows, ratios).

Nothing here asserts on timings: speed is what the bench reports, not what a test checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_fastsync.tools import bench, models
from verl_fastsync.tools.bench import schema
from verl_fastsync.tools.bench.report import WIDTH, render_table

ROOT = Path(__file__).resolve().parent.parent
TINY_GIB = 0.004


def _run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verl_fastsync.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def tiny_bench(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _run_cli(
        "bench",
        "--model", "dense-small,moe-small",
        "--size-gib", str(TINY_GIB),
        "--bucket-mib", "1",
        "--repeats", "1",
        "--heap-objects", "30000",
        "--sections", "cleanup,transfer,idle,scale",
        "--idle-s", "0.5",
        "--scale-sizes", "1",
        "--scale-pieces", "1,2",
        "--json", str(out),
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _rows(doc: dict[str, Any], section: str, label: str, model: str | None = None) -> list[dict[str, Any]]:
    return [r for r in doc[section] if r["row"] == label and (model is None or r.get("model") == model)]


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(450)
def test_bench_tiny_run_document_and_table(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    proc, doc = tiny_bench
    bench.validate_bench_json(doc)
    assert doc["schema_version"] == bench.SCHEMA_VERSION and doc["memcpy_gbps"] > 0
    # the table is on stdout, the progress display on stderr; no line wider than the terminal rule
    for title in ("CLEANUP", "TRANSFER", "IDLE", "SCALE"):
        assert title in proc.stdout
    assert "cleanup:" in proc.stderr and "transfer:" in proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= WIDTH
    # a user did nothing to cause cupy's NCCL warning (its import: test_verl_checkpoint_engine_import_...)
    assert "nccl library could not be loaded" not in proc.stderr + proc.stdout
    # sections not asked for stay empty (e2e / crosshost: tests/test_bench_external.py)
    assert doc["e2e"] == doc["crosshost"] == [] and doc["skipped"] == {}


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(450)
def test_bench_tiny_run_rows_say_what_they_are(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]], verl_version: tuple[int, int, int]
) -> None:
    _, doc = tiny_bench
    kinds = {r["row"]: r["kind"] for r in doc["transfer"]}
    assert kinds["verl colocated shm"] == "verl-stand-in"
    assert kinds["verl gloo split/merge"] == "verl-reconstruction"
    assert kinds["verl nixl engine+shims"] == "verl"
    assert kinds["raw gloo broadcast"] == kinds["raw nixl WRITE"] == kinds["memcpy"] == "raw"
    assert "pin_memory" in _rows(doc, "transfer", "verl nixl engine+shims")[0]["note"]
    assert {r["kind"] for r in doc["cleanup"] if r["policy"] == "aggressive"} == {"verl-reconstruction"}
    for model in ("dense-small", "moe-small"):
        spec = models.model_spec(model, int(TINY_GIB * bench.GIB))
        [row] = _rows(doc, "transfer", "verl colocated shm", model)
        assert row["bytes"] == spec.nbytes
        if spec.largest_tensor_bytes > row["bucket_bytes"]:
            # verl's shared-memory sender cannot carry a tensor larger than its bucket: its own error, whole
            assert row["status"].startswith("error: ") and "too large to fit in the bucket" in row["status"]
            assert " ".join(row["status"].split())[:200] in " ".join(render_table(doc).split())
        elif verl_version >= (0, 8, 0):
            assert row["status"] == "ok" and row["verified"] is True
        [gloo] = _rows(doc, "transfer", "verl gloo split/merge", model)
        if verl_version >= (0, 8, 0):
            assert gloo["status"] == "ok" and gloo["verified"] is True, gloo
        else:  # 0.7.1 has no split/merge: the path does not exist there
            assert gloo["status"].startswith("not available: ") and "split_weight_chunks" in gloo["status"]
        # fastsync carries every model on every CPU transport, bytes checked
        for label in (
            "fastsync colocated shm",
            "fastsync engine shm",
            "fastsync engine shm zc",
            "fastsync engine gloo",
            "fastsync engine nixl",
        ):
            [r] = _rows(doc, "transfer", label, model)
            assert r["status"] == "ok" and r["verified"] is True, r
    import torch

    if not torch.cuda.is_available():
        for r in doc["transfer"]:
            if r["transport"] in ("nccl", "ipc"):
                assert r["status"].startswith("not available: "), r


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(450)
def test_bench_tiny_run_ratios_are_same_run_and_finite(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    _, doc = tiny_bench
    baselines = {r["row"]: r["baseline"] for r in doc["transfer"]}
    assert baselines["fastsync engine shm"] == "memcpy"
    # what the safe receiver default costs: zero-copy against the copying default, same run
    assert baselines["fastsync engine shm zc"] == "fastsync engine shm"
    assert baselines["fastsync engine gloo"] == baselines["verl gloo split/merge"] == "raw gloo broadcast"
    assert baselines["fastsync engine nixl"] == baselines["verl nixl engine+shims"] == "raw nixl WRITE"
    for r in doc["transfer"]:
        if r["status"] != "ok":
            assert r["ratio"] is None and r["median_s"] is None
            continue
        assert len(r["seconds"]) == 1 and r["median_s"] == r["seconds"][0]
        if r["baseline"] is not None:
            base = next(b for b in doc["transfer"] if b["row"] == r["baseline"] and b["model"] == r["model"])
            assert r["ratio"] == pytest.approx(base["median_s"] / r["median_s"])
    # one measurement per configuration: the scale section reuses the transfer section's row
    for s in doc["scale"]:
        same = [t for t in doc["transfer"] if t["row"] == s["row"] and t["model"] == s["model"]
                and t["bytes"] == s["bytes"] and t["tensor_count"] == s["tensor_count"]
                and t["bucket_bytes"] == s["bucket_bytes"]]  # fmt: skip
        if same:
            assert same[0]["seconds"] == s["seconds"]
    # cleanup: seconds added per call, not a ratio
    added = doc["cleanup_info"]["aggressive_added_seconds"]
    assert set(added) == set(bench.BOUNDARIES) and all(isinstance(v, float) for v in added.values())


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(450)
def test_bench_tiny_run_idle_rows(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    _, doc = tiny_bench
    idle = {r["row"]: r for r in doc["idle"]}
    assert "bench workers alone" in idle
    for label in (
        "fastsync engine shm",
        "fastsync engine gloo",
        "fastsync engine nixl",
        "verl nixl engine+shims",
    ):
        row = idle[label]
        assert row["status"] == "ok", row
        assert row["cpu_seconds_per_minute"] >= 0 and row["idle_seconds"] == 0.5
    # no progress thread spinning between syncs (NIXL's own burns a core: ~60 CPU-s per minute)
    assert idle["fastsync engine nixl"]["cpu_seconds_per_minute"] < 12, idle["fastsync engine nixl"]


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(450)
def test_bench_tiny_run_cleanup_rows(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    _, doc = tiny_bench
    rows = {(r["boundary"], r["policy"]): r for r in doc["cleanup"]}
    assert set(rows) == {(b, p) for b in bench.BOUNDARIES for p in bench.POLICIES}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["device"] == "cpu"
    for boundary in bench.BOUNDARIES:
        assert rows[(boundary, "aggressive")]["gc_ran"] is True
        assert rows[(boundary, "light")]["gc_ran"] is False
    assert doc["cleanup_info"]["objects"] >= 30000  # the heap child really held the requested objects


# ---------------------------------------------------------------------------- synthetic documents


def _transfer_row(
    label: str, kind: str, seconds: list[float], status: str = "ok", **kw: Any
) -> dict[str, Any]:
    base = {"memcpy": None, "raw gloo broadcast": "memcpy"}.get(label, "raw gloo broadcast")
    extra = {"model": "moe-small", "bucket_bytes": 16 * bench.MIB if label != "memcpy" else None,
             "path": "engine", "gbps": None, "peak_sender_bytes": None, "peak_receiver_bytes": None,
             "tensor_count": 69, "largest_tensor_bytes": 1 << 24}  # fmt: skip
    row = schema.make_row(
        label, kind, "gloo", seconds if status == "ok" else [], 1 << 28, status, base, "n", **extra
    )
    row.update(kw)
    if row["median_s"]:
        row["gbps"] = row["bytes"] / row["median_s"] / 1e9
    return row


LONG_ERROR = "error: AssertionError: " + " ".join(f"word{i}" for i in range(80))


def _doc() -> dict[str, Any]:
    rows = [
        _transfer_row("memcpy", "raw", [0.05, 0.06, 0.055]),
        _transfer_row("raw gloo broadcast", "raw", [0.1, 0.12, 0.11]),
        _transfer_row("fastsync engine gloo", "fastsync", [0.2, 0.25, 0.22]),
        _transfer_row("verl gloo split/merge", "verl-reconstruction", [], status=LONG_ERROR),
        _transfer_row(
            "fastsync engine nccl", "fastsync", [], status="not available: needs CUDA (torch.cuda)"
        ),
    ]
    schema.fill_ratios(rows)
    cleanup = [
        schema.make_row(p, "fastsync" if p != "aggressive" else "verl-reconstruction", "-", [s], None, "ok",
                        boundary=b, policy=p, gc_ran=p == "aggressive", gc_collected=0)
        for b in bench.BOUNDARIES for p, s in (("light", 1e-9), ("aggressive", 0.4))
    ]  # fmt: skip
    return {
        "schema_version": bench.SCHEMA_VERSION, "verl_version": "0.9.1", "memcpy_gbps": 5.0,
        "options": {"repeats": 3, "preset": "quick"}, "host": {"cpus": 2, "cuda": False},
        "cleanup_info": {"device": "cpu", "objects": 1000,
                         "aggressive_added_seconds": {b: 0.4 for b in bench.BOUNDARIES}},
        "skipped": {"e2e": "verl_fastsync.tools.e2e is not installed in this checkout"},
        "cleanup": cleanup, "transfer": rows, "idle": [], "scale": [], "e2e": [], "crosshost": [],
    }  # fmt: skip


def test_synthetic_document_validates() -> None:
    bench.validate_bench_json(_doc())


def test_table_fits_width_and_prints_errors_whole_below() -> None:
    text = render_table(_doc())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    table_line = next(line for line in lines if "verl gloo split/merge" in line and "error [" in line)
    assert "word79" not in table_line  # the table holds a reference, not the message
    flat = " ".join(text.split())
    assert "[1] " + LONG_ERROR in flat  # whole, below
    assert lines.index(table_line) < next(i for i, line in enumerate(lines) if line.startswith("[1] error"))
    assert "not available at any bucket size: fastsync engine nccl [2]" in text
    assert "[2] not available: needs CUDA (torch.cuda)" in flat
    assert "E2E (real vLLM): skipped: verl_fastsync.tools.e2e is not installed" in flat
    # cleanup: seconds added per call, never a ratio against a near-zero time
    assert "+400.0 ms" in text and "x" not in next(
        line for line in lines if line.startswith("aggressive adds")
    )


@pytest.mark.parametrize("tiny", [0.0, 1e-9, 5e-5])
def test_ratio_never_divides_by_about_zero(tiny: float) -> None:
    rows = [
        _transfer_row("raw gloo broadcast", "raw", [0.1]),
        _transfer_row("fastsync engine gloo", "fastsync", [tiny]),
    ]
    schema.fill_ratios(rows)
    assert rows[1]["ratio"] is None
    rows = [
        _transfer_row("raw gloo broadcast", "raw", [tiny]),
        _transfer_row("fastsync engine gloo", "fastsync", [0.1]),
    ]
    schema.fill_ratios(rows)
    assert rows[1]["ratio"] is None


def test_ratio_only_against_the_same_bytes() -> None:
    other = _transfer_row("raw gloo broadcast", "raw", [0.1], bytes=123)
    rows = [other, _transfer_row("fastsync engine gloo", "fastsync", [0.2])]
    schema.fill_ratios(rows)
    assert rows[1]["ratio"] is None
    rows.insert(0, _transfer_row("raw gloo broadcast", "raw", [0.1]))
    schema.fill_ratios(rows)
    assert rows[2]["ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d.update(schema_version=1), "schema_version=1"),
        (lambda d: d.update(memcpy_gbps=0), "memcpy_gbps"),
        (lambda d: d["cleanup"][0].pop("gc_ran"), "cleanup[0] lacks required key 'gc_ran'"),
        (lambda d: d["transfer"][0].update(status="failed"), "allowed: ok, 'not available"),
        (lambda d: d["transfer"][3].update(status="error: "), "needs a reason"),
        (lambda d: d["transfer"][0].update(kind="other"), "allowed: fastsync, verl, raw"),
        (lambda d: d["transfer"][0].update(bytes="10"), "transfer[0].bytes"),
        (lambda d: d["transfer"][0].update(seconds=[True]), "list of numbers"),
        (lambda d: d.update(scale={}), "scale must be a list"),
        (lambda d: d.pop("skipped"), "skipped"),
    ],
)
def test_validate_bench_json_rejects(mutate: Any, message: str) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(bench.BenchSchemaError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bench.validate_bench_json(doc)


def test_write_plot_png_with_failures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    bench.write_plot(_doc(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schema_doc_lists_every_required_key() -> None:
    """docs/bench-schema.md is the contract: every key the validator requires is documented there."""
    text = (ROOT / "docs" / "bench-schema.md").read_text()
    required = {
        "schema_version",
        "verl_version",
        "memcpy_gbps",
        "skipped",
        *bench.SECTIONS,
        *schema.ROW_FIELDS,
    }
    for fields in schema.SECTION_FIELDS.values():
        required |= set(fields)
    missing = sorted(key for key in required if f"`{key}`" not in text)
    assert not missing, f"undocumented keys: {missing}"
    assert f"(version {bench.SCHEMA_VERSION})" in text
    for kind in bench.KINDS:
        assert f"`{kind}`" in text


_IMPORT = """
import warnings, sys
warnings.simplefilter("default")
if sys.argv[1] == "bench":
    from verl_fastsync.tools.bench.baselines import import_verl_module
    import_verl_module("verl.checkpoint_engine.nixl_checkpoint_engine")
else:
    import verl.checkpoint_engine.nixl_checkpoint_engine
"""


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(300)
def test_verl_checkpoint_engine_import_without_cupy_nccl_warning() -> None:
    """On a host without NCCL, importing verl's checkpoint engine makes cupy warn; the bench's import
    silences exactly that warning (and a plain import shows that the warning is real here)."""
    pytest.importorskip("nixl")
    pytest.importorskip("cupy")

    def run(how: str) -> str:
        # "plain" without the plugin (verl 0.9.x would load it through its entry point, and the
        # plugin silences the warning too): shows that the warning is real on this host
        env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"} if how == "plain" else None
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT, how], capture_output=True, text=True, timeout=250, env=env
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    plain = run("plain")
    if "nccl library could not be loaded" not in plain:
        pytest.skip("cupy finds an NCCL library on this host: nothing to silence")
    assert "nccl library could not be loaded" not in run("bench")
