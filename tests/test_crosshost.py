"""Cross-host section: every row moves the same bytes between two namespaces (checked by digest),
rows carry the bench schema and same-run baselines, nothing is left behind, and the section says
why when namespaces cannot be made."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from verl_fastsync.tools import crosshost
from verl_fastsync.tools.crosshost import CrosshostOptions, run_section
from verl_fastsync.tools.netns import list_netns, unavailable_reason

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

KEYS = {"row", "kind", "transport", "seconds", "bytes", "status", "baseline", "note"}
SMALL = CrosshostOptions(payload_mib=12, repeats=2, bucket_mib=2, shape_gbit=(10.0,), timeout_s=240.0)


@pytest.fixture(scope="module")
def section() -> tuple[list[dict[str, Any]], set[str], set[str]]:
    before = list_netns()
    rows = run_section(SMALL)
    return rows, before, list_netns()


@needs_netns
@pytest.mark.timeout(900)
def test_every_row_moves_the_same_bytes_across_namespaces(section: Any) -> None:
    rows, _, _ = section
    # a row is "ok" only when the receiver's xxh3 digest equals the sender's after its repeats
    assert {r["row"]: r["status"] for r in rows} == {r["row"]: "ok" for r in rows}
    labels = [r["row"] for r in rows]
    for needed in ("fastsync gloo", "fastsync nixl", crosshost.RAW_GLOO, crosshost.LINK_1):
        assert needed in labels
    assert any("tc 10 Gbit/s" in label for label in labels)


@needs_netns
@pytest.mark.timeout(900)
def test_rows_follow_the_bench_schema_with_same_run_baselines(section: Any) -> None:
    rows, _, _ = section
    by_label = {r["row"]: r for r in rows}
    for r in rows:
        assert set(r) == KEYS
        assert r["kind"] in ("fastsync", "raw")
        assert r["bytes"] == SMALL.payload_mib << 20
        assert len(r["seconds"]) == SMALL.repeats and all(s > 0 for s in r["seconds"])
        if r["baseline"] is not None:
            assert by_label[r["baseline"]]["status"] == "ok"
    assert by_label["fastsync gloo"]["baseline"] == crosshost.RAW_GLOO
    candidates = (crosshost.RAW_NIXL_SPIN, crosshost.RAW_NIXL_POLL, crosshost.RAW_NIXL_THREAD)
    # the fastest raw NIXL row of this run is the one fastsync nixl is compared with
    nixl = [by_label[x] for x in candidates]
    fastest = min(nixl, key=lambda r: statistics.median(r["seconds"]))
    assert by_label["fastsync nixl"]["baseline"] == fastest["row"]
    table = crosshost.format_rows(rows)
    assert "fastsync nixl" in table and "GB/s" in table


@needs_netns
@pytest.mark.timeout(900)
def test_no_namespace_is_left_behind(section: Any) -> None:
    _, before, after = section
    assert after == before


def test_a_digest_mismatch_is_an_error_not_a_figure() -> None:
    with pytest.raises(RuntimeError, match="bytes differ"):
        crosshost._timed({"starts": [0.0, 1.0], "digest": "aa"}, {"ends": [0.5, 1.5], "digest": "bb"})
    assert crosshost._timed(
        {"starts": [0.0, 1.0], "digest": "aa"}, {"ends": [0.5, 1.25], "digest": "aa"}
    ) == [0.25]


def test_a_failing_row_is_reported_and_the_rest_still_run() -> None:
    def broken() -> tuple[list[float], str]:
        raise ConnectionError("peer vanished")

    row = crosshost._row("x", "raw", "tcp", broken, None, 10)
    assert row["status"] == "error: ConnectionError: peer vanished" and row["seconds"] == []


def test_without_namespaces_every_row_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        crosshost, "unavailable_reason", lambda: "creating network namespaces needs CAP_NET_ADMIN"
    )

    def no_pair(*args: object, **kwargs: object) -> None:
        raise AssertionError("no namespace may be made when they are unavailable")

    monkeypatch.setattr(crosshost, "NamespacePair", no_pair)
    rows = crosshost.bench_section(quick=True)
    assert rows and all(set(r) == KEYS for r in rows)
    assert all(r["status"].startswith("not available: network namespaces cannot be made here") for r in rows)
    assert all("CAP_NET_ADMIN" in r["status"] and r["seconds"] == [] for r in rows)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("payload_mib", 0, "payload_mib must be a positive int"),
        ("repeats", True, "repeats must be"),
        ("shape_gbit", (0.0,), r"shape_gbit values must be in \(0, 400\]"),
    ],
)
def test_bad_options_say_what_is_allowed(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_section(CrosshostOptions(**{field: value}))  # type: ignore[arg-type]
