"""The fanout bench section: rollout hosts x ranks on ``tc``-shaped links to a switch namespace, models
per sync on each link from the veth counters, verl's NIXL engine (its chain) and the raw link in the
same run. Rows from synthetic measurements (schema, ratios, table), the options' errors, the section
without namespaces, and a real quick run through ``verl-fastsync bench --sections fanout``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_fastsync.tools import fanout, fanout_rows
from verl_fastsync.tools.bench import external, validate_bench_json
from verl_fastsync.tools.bench.report import WIDTH, render_table
from verl_fastsync.tools.netns import list_netns, unavailable_reason

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
MIB = 1 << 20


def _measured(seconds: list[float], trainer: float, hosts: list[float]) -> Any:
    def measure() -> dict[str, Any]:
        return {
            "seconds": seconds,
            "trainer_link_models": trainer,
            "rollout_link_models": hosts,
            "rollout_out_models": [0.0] * len(hosts),
            "max_link_models": max([trainer, *hosts]),
        }

    return measure


def _synthetic_rows() -> list[dict[str, Any]]:
    """What run_fanout returns for 1x1 and 1x4 (quick preset's 16 MiB at 2 Gbit/s), from made-up
    measurements; one row failed."""
    specs = [
        ((1, 1), "raw TCP, 1 stream", [0.07, 0.07], 1.0, [1.0]),
        ((1, 1), "verl NIXL engine", [0.4, 0.4], 1.0, [1.0]),
        ((1, 1), "fastsync gloo", [0.1, 0.1], 1.0, [1.0]),
        ((1, 4), "verl NIXL engine", [0.5, 0.5], 1.0, [1.0]),
        ((1, 4), "fastsync gloo", [0.3, 0.3], 3.0, [3.0]),
    ]
    rows = [fanout._row(None, "host", s, 1, w, _measured(sec, t, h)) for s, w, sec, t, h in specs]

    def boom() -> dict[str, Any]:
        raise RuntimeError("rollout ranks [2]: the received bytes differ from the trainer's model\nmore")

    rows.append(fanout._row(None, "host", (1, 4), 1, "fastsync nixl", boom))
    fanout_rows.fill_vs_1x1(rows)
    return rows


def test_rows_carry_links_ratios_and_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row: its shape, models per link, busy = busiest link's bytes / (rate x seconds), x 1x1
    against the same transport's 1x1 row, and (through the bench) verl's engine seconds / its own."""
    rows = _synthetic_rows()
    gloo14 = rows[4]
    assert gloo14["row"] == "link per host 1x4, 1 sender: fastsync gloo"
    assert gloo14["baseline"] == "link per host 1x4, 1 sender: verl NIXL engine"
    assert (gloo14["kind"], gloo14["transport"], gloo14["hosts"], gloo14["ranks_per_host"]) == (
        "fastsync",
        "gloo",
        1,
        4,
    )
    assert gloo14["vs_1x1"] == pytest.approx(3.0)
    assert gloo14["busy"] == pytest.approx(3 * 16 * MIB / (2e9 / 8) / 0.3)
    assert rows[0]["kind"] == "raw" and rows[0]["transport"] == "tcp" and rows[0]["baseline"] is None
    assert rows[3]["kind"] == "verl" and rows[3]["vs_1x1"] == pytest.approx(1.25)
    failed = rows[5]
    assert (
        failed["status"]
        == "error: RuntimeError: rollout ranks [2]: the received bytes differ from the trainer's model"
    )
    assert failed["busy"] is None and failed["vs_1x1"] is None and failed["trainer_link_models"] is None

    monkeypatch.setattr(fanout, "bench_section", lambda quick: rows)
    got, why = external.run_external_section("fanout", True, lambda _m: None)
    assert (
        why is None and got[4]["ratio"] == pytest.approx(0.5 / 0.3) and got[2]["ratio"] == pytest.approx(4.0)
    )
    doc = {"schema_version": 2, "verl_version": None, "memcpy_gbps": 5.0, "skipped": {}, "options": {},
           "host": {}, "cleanup": [], "transfer": [], "idle": [], "scale": [], "e2e": [], "crosshost": [],
           "fanout": got}  # fmt: skip
    validate_bench_json(doc)
    text = render_table(doc)
    assert "FANOUT" in text and max(len(line) for line in text.splitlines()) <= WIDTH
    line = next(x for x in text.splitlines() if "1x4" in x and "fastsync gloo" in x)
    cells = line.split()
    want = ["0.300", "3.00", "3.00", f"{gloo14['busy']:.2f}", "3.00", "1.67", "ok"]
    assert cells[cells.index("gloo") + 1 :] == want
    assert next(x for x in text.splitlines() if "fastsync nixl" in x).endswith("error [1]")
    assert "[1] error: RuntimeError: rollout ranks [2]: the received bytes differ" in text


def test_a_fanout_row_with_a_wrong_type_is_refused() -> None:
    rows = _synthetic_rows()
    from verl_fastsync.tools.bench.schema import BenchSchemaError, normalize_external

    bad = [normalize_external(r, "fanout") for r in rows]
    bad[2]["rollout_link_models"] = 3.0
    doc = {"schema_version": 2, "verl_version": None, "memcpy_gbps": 5.0, "skipped": {}, "cleanup": [],
           "transfer": [], "idle": [], "scale": [], "e2e": [], "crosshost": [], "fanout": bad}  # fmt: skip
    with pytest.raises(BenchSchemaError, match=r"fanout\[2\]\.rollout_link_models=3.0 must be list"):
        validate_bench_json(doc)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shapes": ((0, 2),)}, "shapes must be"),
        ({"rank_shapes": ((1, 0),)}, "rank_shapes must be (hosts, ranks per host) pairs"),
        ({"hosts": ("on",)}, "hosts ['on']: allowed: default, auto, off"),
        ({"shm_mib": 0}, "shm_mib must be a positive int"),
        ({"kinds": ("rank",), "senders": (4,), "rank_shapes": ((4, 4),)}, "at most 16"),
        ({"kinds": ("vm",)}, "kinds ['vm']: allowed: host, rank"),
        ({"transports": ("nccl",)}, "transports ['nccl']: allowed: gloo, nixl, verl-nixl"),
        ({"senders": (0,)}, "senders must be ints in [1, 8]"),
        ({"kinds": ("rank",), "senders": (8,), "shapes": ((4, 4),)}, "at most 16"),
        ({"payload_mib": 0}, "payload_mib must be a positive int"),
        ({"gbit": 0.0}, "gbit must be in (0, 400]"),
    ],
)
def test_bad_options_are_refused_naming_what_is_allowed(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        dataclasses.replace(fanout.QUICK, **change).check()
    assert message in str(err.value)


def test_without_namespaces_every_row_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """No namespaces here: every planned row is "not available" with the reason, and the bench skips
    the section with it (as crosshost and delta do)."""
    monkeypatch.setattr(
        fanout, "unavailable_reason", lambda: "creating network namespaces needs CAP_NET_ADMIN"
    )
    rows = fanout.bench_section(quick=True)
    assert [r["row"].split(": ")[1] for r in rows[:4]] == [
        "raw TCP, 1 stream",
        "verl NIXL engine",
        "fastsync gloo",
        "fastsync nixl",
    ]
    assert len(rows) == 1 + 3 * 3
    assert {r["status"] for r in rows} == {
        "not available: network namespaces: creating network namespaces needs CAP_NET_ADMIN"
    }
    got, why = external.run_external_section("fanout", True, lambda _m: None)
    assert got == [] and why == "network namespaces: creating network namespaces needs CAP_NET_ADMIN"


@needs_netns
@pytest.mark.timeout(900)
def test_the_bench_runs_the_fanout_section(tmp_path: Path) -> None:
    """``verl-fastsync bench --sections fanout`` for real (quick: 1x1, 1x4, 2x2 on one link per host,
    16 MiB, 2 Gbit/s): every row ok (every rollout rank's bytes checked each sync), at least one model
    on every link that must carry one, one copy per host where the engine does that (each simulated
    host its own /dev/shm), verl's chain the same bytes on every host link (its rank-to-rank hop
    inside a host does not cross the link), nothing left behind."""
    before = list_netns()
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_fastsync.tools.cli",
            "bench",
            "--sections",
            "fanout",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    validate_bench_json(doc)
    rows = {r["row"]: r for r in doc["fanout"]}
    assert doc["skipped"] == {} and all(r["status"] == "ok" for r in rows.values()), [
        (r["row"], r["status"]) for r in rows.values() if r["status"] != "ok"
    ]
    one_copy_per_host = fanout_rows.hosts_key_missing("gloo") is None
    shapes = {(r["hosts"], r["ranks_per_host"]) for r in rows.values()}
    assert shapes == {(1, 1), (1, 4), (2, 2)} and len(rows) == 10
    raw = rows["link per host 1x1, 1 sender: raw TCP, 1 stream"]
    assert raw["trainer_link_models"] == pytest.approx(1.0, abs=0.05)
    assert raw["rollout_link_models"] == [pytest.approx(1.0, abs=0.05)]
    for shape in ("1x1", "1x4", "2x2"):
        verl = rows[f"link per host {shape}, 1 sender: verl NIXL engine"]
        # its chain: what left the trainer crosses every host's link once, host 0 passes it on to host 1
        # (verl READs whole bucket buffers, so a part-filled last bucket crosses whole: >= 1 model)
        sent = verl["trainer_link_models"]
        assert sent >= 0.98 and verl["rollout_link_models"] == [pytest.approx(sent, abs=0.03)] * verl["hosts"]
        assert verl["rollout_out_models"][:-1] == [pytest.approx(sent, abs=0.03)] * (verl["hosts"] - 1), verl
        for tr in ("gloo", "nixl"):
            row = rows[f"link per host {shape}, 1 sender: fastsync {tr}"]
            # one copy per host (the engine's default where it has the hosts key): one model on every
            # link, host 1's included (were the simulated hosts one host for /dev/shm, host 1's ranks
            # would get theirs through shared memory and its link would carry none); else one per rank
            # at most
            copies = 1 if one_copy_per_host else row["ranks_per_host"]
            assert 0.98 <= row["trainer_link_models"] <= copies * row["hosts"] + 0.1, row
            assert all(0.98 <= m <= copies + 0.1 for m in row["rollout_link_models"]), row
            assert row["baseline"] == verl["row"] and row["ratio"] == pytest.approx(
                verl["median_s"] / row["median_s"]
            )
            assert row["vs_1x1"] == pytest.approx(
                row["median_s"] / rows[f"link per host 1x1, 1 sender: fastsync {tr}"]["median_s"]
            )
    assert "FANOUT" in proc.stdout and "verl NIXL engine" in proc.stdout
    # the bench has exited: a namespace it made would carry its (now dead) pid; others' runs may be live
    new = [(n, n.split("-")) for n in list_netns() - before]
    left = {n for n, parts in new if len(parts) < 2 or not Path(f"/proc/{parts[1]}").exists()}
    assert left == set(), left


class _NoFleet:
    """Stands in for the switch and its hosts: the rows' measurements are faked here, not sent."""

    def __init__(self, kind: str, opts: fanout.FanoutOptions) -> None:
        self.opts = opts

    def __enter__(self) -> _NoFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def drop(self) -> None:
        pass


def test_the_hosts_key_is_passed_only_where_a_row_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hosts`` values make a row each (``default`` passes no key: what a user gets); where the engine
    has no ``hosts`` key, those rows say so and nothing is measured for them; the others measure with
    the value they name."""
    measured: list[tuple[Any, ...]] = []

    def sync_row(fleet: Any, shape: Any, senders: int, transport: str, hosts: str) -> dict[str, Any]:
        measured.append((shape, senders, transport, hosts))
        return _measured([1.0], 1.0, [1.0] * shape[0])()

    monkeypatch.setattr(fanout, "unavailable_reason", lambda: None)
    monkeypatch.setattr(fanout, "shm_unavailable_reason", lambda: None)
    monkeypatch.setattr(fanout, "_Fleet", _NoFleet)
    monkeypatch.setattr(fanout, "_raw_row", lambda fleet: _measured([0.5], 1.0, [1.0])())
    monkeypatch.setattr(fanout, "_sync_row", sync_row)
    opts = dataclasses.replace(
        fanout.QUICK, shapes=((1, 1),), transports=("gloo", "nixl"), hosts=("default", "off")
    )
    monkeypatch.setattr(fanout, "hosts_key_missing", lambda tr: "no hosts key here" if tr == "nixl" else None)
    rows = {r["row"].split(": ")[1]: r for r in fanout.run_fanout(opts)}
    assert list(rows) == ["raw TCP, 1 stream", "fastsync gloo", "fastsync gloo, hosts off", "fastsync nixl",
                          "fastsync nixl, hosts off"]  # fmt: skip
    assert rows["fastsync nixl, hosts off"]["status"] == "not available: no hosts key here"
    assert measured == [
        ((1, 1), 1, "gloo", "default"),
        ((1, 1), 1, "gloo", "off"),
        ((1, 1), 1, "nixl", "default"),
    ]
    assert (
        rows["fastsync gloo, hosts off"]["transport"] == "gloo"
        and rows["fastsync gloo, hosts off"]["vs_1x1"] == 1.0
    )


def test_the_peer_passes_hosts_to_the_engine_only_when_given() -> None:
    """Without ``hosts`` the engine is made as before; with it, the engine gets the key (and refuses it
    by name where it does not know it)."""
    from verl_fastsync.tools import crosshost_lanes_peer as peer

    kw: dict[str, Any] = {"transport": "gloo", "senders": 1, "trainer": True, "is_master": True,
                          "bucket": MIB, "timeout_s": 30.0}  # fmt: skip
    try:
        peer.eng_new(**kw)
        assert peer._STATE["engine"].transport_name == "gloo"
        if fanout.hosts_key_missing("gloo") is None:
            peer.eng_new(**kw, hosts="off")
        else:
            with pytest.raises(ValueError, match=r"\['hosts'\]"):
                peer.eng_new(**kw, hosts="off")
    finally:
        peer.eng_close()


def test_markdown_tables_show_each_host_and_the_ratios() -> None:
    from verl_fastsync.tools.bench.schema import fill_ratios, normalize_external

    rows = [normalize_external(r, "fanout") for r in _synthetic_rows()]
    rows.append(
        normalize_external(
            fanout._row(
                None, "host", (4, 2), 4, "fastsync gloo, hosts off", _measured([0.6], 4.0, [2.0] * 4)
            ),
            "fanout",
        )
    )
    rows.append(
        normalize_external(
            fanout._row(
                None,
                "host",
                (4, 2),
                1,
                "fastsync gloo, hosts off",
                _measured([1.2], 4.0, [2.0, 3.0, 2.0, 2.0]),
            ),
            "fanout",
        )
    )
    fill_ratios(rows)
    text = fanout_rows.markdown_tables(rows)
    lines = text.splitlines()
    assert lines[0] == "link per host:" and lines[2].startswith("| shape | senders | what | s / sync |")
    assert "| 1x4 | 1 | gloo | 0.300 | 3.00 | 3.00 | 3.00 | " in text  # busy, x 1x1, verl s / s follow
    assert next(x for x in lines if "| 1x4 | 1 | gloo |" in x).endswith("| 3.00 | 1.67 |  |")
    assert "| 4x2 | 4 | gloo, hosts off | 0.600 | 4.00 | 2.00 x 4 | 4.00 |" in text
    assert next(x for x in lines if "| 4x2 | 4 |" in x).endswith("| 2.00x |")
    assert "| 4x2 | 1 | gloo, hosts off | 1.200 | 4.00 | 2.00, 3.00, 2.00, 2.00 |" in text
    assert "| 1x4 | 1 | nixl | error: RuntimeError: rollout ranks [2]" in text
    assert all(x.count("|") == 12 for x in lines if x.startswith("|")), text
