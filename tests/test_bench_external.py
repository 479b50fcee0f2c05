"""The e2e / crosshost / delta sections the bench renders from other modules' ``bench_section(quick)``."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest

from verl_fastsync.tools import delta_bench
from verl_fastsync.tools.bench import BenchSchemaError, external, validate_bench_json
from verl_fastsync.tools.bench.report import WIDTH, render_table


def _fake(monkeypatch: pytest.MonkeyPatch, section: str, func: Any) -> list[bool]:
    name = external.MODULES[section]
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    calls: list[bool] = []

    def bench_section(quick: bool) -> Any:
        calls.append(quick)
        return func()

    module.bench_section = bench_section  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def _row(
    label: str, kind: str, seconds: list[float], status: str = "ok", baseline: str | None = None
) -> dict[str, Any]:
    return {"row": label, "kind": kind, "transport": "gloo", "seconds": seconds, "bytes": 1 << 30,
            "status": status, "baseline": baseline, "note": "between two network namespaces"}  # fmt: skip


def test_rows_from_the_module_with_same_run_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake(monkeypatch, "crosshost", lambda: [
        _row("raw link (iperf-like)", "raw", [1.0, 1.2, 1.1]),
        _row("fastsync engine gloo", "fastsync", [2.0, 2.2, 2.4], baseline="raw link (iperf-like)"),
        _row("verl nixl engine", "verl", [], status="not available: no UCX in namespaces"),
    ])  # fmt: skip
    rows, why = external.run_external_section("crosshost", True, lambda _m: None)
    assert calls == [True] and why is None
    assert rows[1]["median_s"] == 2.2 and rows[1]["ratio"] == pytest.approx(1.1 / 2.2)
    assert rows[2]["ratio"] is None and rows[2]["median_s"] is None
    doc = {"options": {}, "host": {}, "cleanup": [], "transfer": [], "idle": [], "scale": [], "e2e": [],
           "crosshost": rows, "skipped": {}}  # fmt: skip
    text = render_table(doc)
    assert "CROSSHOST" in text and "n/a [1]" in text and "[1] not available: no UCX in namespaces" in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_missing_module_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, external.MODULES["e2e"], None)  # import of it fails
    rows, why = external.run_external_section("e2e", True, lambda _m: None)
    assert rows == [] and why is not None and "verl_fastsync.tools.e2e" in why


def test_all_not_available_is_skipped_with_their_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(
        monkeypatch,
        "e2e",
        lambda: [_row("vLLM sync", "fastsync", [], status="not available: no vLLM installed")],
    )
    rows, why = external.run_external_section("e2e", False, lambda _m: None)
    assert rows == [] and why == "no vLLM installed"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"row": "x"}, "lacks"),
        (_row("x", "made-up", [1.0]), "kind='made-up'"),
        (_row("x", "raw", [1.0], status="fine"), "status='fine'"),
    ],
)
def test_malformed_rows_skip_the_section_naming_the_problem(
    monkeypatch: pytest.MonkeyPatch, bad: dict[str, Any], message: str
) -> None:
    _fake(monkeypatch, "crosshost", lambda: [bad])
    rows, why = external.run_external_section("crosshost", True, lambda _m: None)
    assert rows == [] and why is not None and "malformed" in why and message in why


def test_a_raising_module_is_skipped_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> list[dict[str, Any]]:
        raise PermissionError("cannot create network namespaces: Operation not permitted")

    _fake(monkeypatch, "crosshost", boom)
    rows, why = external.run_external_section("crosshost", True, lambda _m: None)
    assert rows == [] and why is not None and "Operation not permitted" in why


def test_delta_rows_pair_each_step_and_render_one_line_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta section's rows (from :func:`delta_bench.bench_rows`): a full and a delta row per step,
    the same model bytes (so the bench fills the delta row's ratio against the full one), what crossed
    the link in ``wire_bytes``; the table puts both syncs of a step on one line."""
    mib = 1 << 20

    def step(gbit: float, one_host: bool, lr: float, name: Any, changed: float, full_s: float,
             delta_s: float, wire: int) -> dict[str, Any]:  # fmt: skip
        return {"gbit": gbit, "one_host": one_host, "transport": "shm" if one_host else "gloo", "lr": lr,
                "step": name, "changed_fraction": changed, "model_bytes": 128 * mib,
                "full": {"seconds": full_s, "wire_bytes": 128 * mib},
                "delta": {"seconds": delta_s, "wire_bytes": wire, "encode_s": 0.05,
                          "decode_s": 0.02}}  # fmt: skip

    result = {"rows": [step(10.0, False, 1e-6, 2, 0.0345, 0.12, 0.06, 8 * mib),
                       step(0.0, True, 1e-5, "re-init", 0.999, 0.03, 0.06, 128 * mib)]}  # fmt: skip
    _fake(monkeypatch, "delta", lambda: delta_bench.bench_rows(result))
    rows, why = external.run_external_section("delta", True, lambda _m: None)
    assert why is None and [r["row"] for r in rows] == [
        "10 Gbit/s, lr 1e-06, step 2: full",
        "10 Gbit/s, lr 1e-06, step 2: delta",
        "host shm, lr 1e-05, step re-init: full",
        "host shm, lr 1e-05, step re-init: delta",
    ]
    assert rows[1]["ratio"] == pytest.approx(2.0) and rows[3]["ratio"] == pytest.approx(0.5)
    assert rows[0]["ratio"] is None and rows[1]["wire_bytes"] == 8 * mib and rows[1]["bytes"] == 128 * mib
    doc = {"schema_version": 2, "verl_version": None, "memcpy_gbps": 5.0, "options": {}, "host": {},
           "cleanup": [], "transfer": [], "idle": [], "scale": [], "e2e": [], "crosshost": [], "delta": rows,
           "skipped": {}}  # fmt: skip
    validate_bench_json(doc)
    lines = render_table(doc).splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    step2 = next(line for line in lines if line.startswith("10 Gbit/s"))
    want = "10 Gbit/s | 1e-06 | 2 | 3.45% | 128 MiB | 8.0 MiB | 16.0x | 0.120 | 0.060 | 2.00x | 0.050 | 0.020"
    assert step2.split() == want.replace(" |", "").split()
    assert next(line for line in lines if line.startswith("host shm")).split()[-3] == "0.50x"


def test_a_document_from_before_the_delta_section_still_validates() -> None:
    doc = {"schema_version": 2, "verl_version": None, "memcpy_gbps": 5.0, "skipped": {}, "cleanup": [],
           "transfer": [], "idle": [], "scale": [], "e2e": [], "crosshost": []}  # fmt: skip
    validate_bench_json(doc)
    with pytest.raises(BenchSchemaError, match="crosshost must be a list"):
        validate_bench_json({k: v for k, v in doc.items() if k != "crosshost"})
