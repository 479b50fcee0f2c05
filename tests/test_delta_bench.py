"""The delta bench: real AdamW steps synced by a ``delta=false`` and a ``delta=true`` engine across two
namespaces; every sync's bytes are checked by digest (a mismatch raises), delta moves fewer bytes when
few values changed and the same bytes when all did, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_fastsync.tools.bench import validate_bench_json
from verl_fastsync.tools.delta_bench import DeltaBenchOptions, format_delta, run_delta
from verl_fastsync.tools.netns import list_netns, unavailable_reason

REASON = unavailable_reason()
PIN = {0, 1} <= os.sched_getaffinity(0)  # (CI's machine has two cores)
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


@needs_netns
@pytest.mark.timeout(900)
def test_delta_bench_rows_follow_the_changed_values() -> None:
    before = list_netns()
    opts = DeltaBenchOptions(
        width=128, layers=2, steps=2, lrs=(1e-6,), gbits=(0.0,), bucket_mib=1, one_host="shm", pin=PIN
    )
    result = run_delta(opts)
    assert list_netns() == before
    rows = result["rows"]
    assert [(r["step"], r["one_host"], r["transport"]) for r in rows] == [
        (1, False, "gloo"),
        (2, False, "gloo"),
        ("re-init", False, "gloo"),
        (1, True, "shm"),
        (2, True, "shm"),
        ("re-init", True, "shm"),
    ]
    for row in rows[:2] + rows[3:5]:
        assert 0.0 < row["changed_fraction"] < 0.2
        assert row["delta"]["delta_sync"] == 1.0 and row["full"]["delta_sync"] == 0.0
        assert row["delta"]["wire_bytes"] < 0.5 * row["full"]["wire_bytes"], row
        assert row["delta"]["encode_s"] > 0.0 and row["delta"]["decode_s"] > 0.0
    everything = sorted(os.sched_getaffinity(0))
    for row in rows:  # --pin: two "hosts" that share no core; not the one-host rows
        pinned = {"trainer": [0], "rollout": [1]}
        assert row["cpus"] == (
            pinned if not row["one_host"] else {"trainer": everything, "rollout": everything}
        )
    for again in (rows[2], rows[5]):
        assert again["changed_fraction"] > 0.9
        assert again["delta"]["wire_bytes"] == again["full"]["wire_bytes"] == again["model_bytes"]
    text = format_delta(result)
    assert (
        "re-init" in text
        and "unshaped" in text
        and "host shm" in text
        and ("trainer on CPU 0" in text) == PIN
    )


@needs_netns
@pytest.mark.timeout(600)
def test_the_bench_runs_the_delta_section(tmp_path: Path) -> None:
    """``verl-fastsync bench --sections delta``: the quick delta rows in the bench's JSON (valid against
    its schema, each delta row's ratio against the full sync of the same step) and its table."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "verl_fastsync.tools.cli", "bench", "--sections", "delta", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    validate_bench_json(doc)
    assert doc["skipped"] == {} and doc["transfer"] == [] and doc["crosshost"] == []
    rows = doc["delta"]
    steps = [(r["step"], r["row"].rsplit(": ", 1)[1]) for r in rows]
    assert steps == [(s, e) for s in ("1", "2", "re-init") for e in ("full", "delta")], steps
    for full, delta in zip(rows[::2], rows[1::2], strict=True):
        assert delta["baseline"] == full["row"] and full["baseline"] is None
        assert delta["bytes"] == full["bytes"] == full["wire_bytes"] > 0
        assert delta["ratio"] == pytest.approx(full["median_s"] / delta["median_s"])
        assert (delta["link_gbit"], delta["lr"], delta["one_host"]) == (10.0, 1e-6, False)
        assert full["encode_s"] == 0.0 < delta["encode_s"]
    for delta in rows[1:4:2]:  # steps 1 and 2: a few % changed, a fraction of the bytes moved
        assert 0.0 < delta["changed_fraction"] < 0.2 and delta["wire_bytes"] < 0.5 * delta["bytes"], delta
    assert rows[5]["changed_fraction"] > 0.9 and rows[5]["wire_bytes"] == rows[5]["bytes"]
    assert "DELTA (one sync per step" in proc.stdout and "re-init" in proc.stdout
