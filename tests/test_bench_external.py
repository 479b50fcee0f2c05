"""The e2e / crosshost sections the bench renders from other modules' ``bench_section(quick)``."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest

from verl_fastsync.tools.bench import external
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
