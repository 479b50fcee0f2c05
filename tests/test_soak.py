"""Soak: N consecutive syncs of a small model in ONE long-lived sender/receiver process pair per CPU
transport (engine ``shm``, ``gloo``, ``nixl``; colocated ``shm``), measuring each process's RSS,
open fds and fastsync shared-memory mappings, and this pair's /dev/shm segments, after a warm-up
and at the end.

Asserted: RSS growth after warm-up < :data:`RSS_TOLERANCE`; fds, mappings and segments equal at
start and end; bytes identical on the first and the last sync (and every sync for colocated).
N is :data:`CI_SYNCS` by default and :data:`SOAK_SYNCS` with ``pytest --soak``. Figures are printed
(``pytest -s``, lines starting with ``SOAK``) and appended as JSON lines to
``$VERL_FASTSYNC_SOAK_REPORT`` when set (else to ``<tmp_path>/soak.jsonl``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fault_harness as fh
from _transport_harness import Cluster, expected_digests

CI_SYNCS = 50
SOAK_SYNCS = 1000
WARMUP = 5
RSS_TOLERANCE = 16 << 20
ENGINE_BUCKET = 4096
COLO_BUCKET_MB = 1 / 16

RESOURCES = "import _fault_harness as fh\nresult = fh.resources_now()"


def _syncs(request: pytest.FixtureRequest) -> int:
    return SOAK_SYNCS if request.config.getoption("--soak") else CI_SYNCS


def _resources(cluster: Cluster, rank: int) -> dict[str, int]:
    cluster.post(rank, "exec", RESOURCES)
    result: dict[str, int] = cluster.wait(rank)
    return result


def _report(row: dict[str, Any], tmp_path: Any) -> None:
    print("SOAK", json.dumps(row))
    path = os.environ.get("VERL_FASTSYNC_SOAK_REPORT") or str(tmp_path / "soak.jsonl")
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


def _check_flat(row: dict[str, Any]) -> None:
    for side in ("sender", "receiver"):
        start, end = row[side]["start"], row[side]["end"]
        growth = end["rss"] - start["rss"]
        assert growth < RSS_TOLERANCE, f"{row['transport']} {side}: RSS grew {growth / 2**20:.1f} MiB"
        assert end["fds"] == start["fds"], f"{row['transport']} {side}: fds {start['fds']} -> {end['fds']}"
        assert end["maps"] == start["maps"], f"{row['transport']} {side}: shm mappings {start} -> {end}"
    assert row["segments"]["end"] == row["segments"]["start"], row["segments"]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("transport", ["shm", "gloo", "nixl"])
def test_engine_soak(transport: str, request: pytest.FixtureRequest, tmp_path: Any) -> None:
    n = _syncs(request)
    specs = fh.fault_model(ENGINE_BUCKET)
    expected = expected_digests(specs)
    ctor = {"bucket_size": ENGINE_BUCKET, "timeout_s": 60}
    t0 = time.monotonic()
    with Cluster(transport, 1, 1, mode="transport", ctor=ctor, timeout=120) as cluster:
        start: list[Any] = []
        seg_start = 0
        for i in range(n):
            check = i in (0, n - 1)
            result = cluster.sync(specs, recv_extra={"hash": check})
            if check:
                assert [tuple(d) for d in result["receivers"][0]["digests"]] == expected, f"sync {i}"
            if i == WARMUP - 1:
                start = [_resources(cluster, 0), _resources(cluster, 1)]
                seg_start = len(cluster.leaked_segments())
        end = [_resources(cluster, 0), _resources(cluster, 1)]
        seg_end = len(cluster.leaked_segments())
    row = {
        "transport": f"engine-{transport}",
        "syncs": n,
        "warmup": WARMUP,
        "seconds": round(time.monotonic() - t0, 1),
        "sender": {"start": start[0], "end": end[0]},
        "receiver": {"start": start[1], "end": end[1]},
        "segments": {"start": seg_start, "end": seg_end},
    }
    _report(row, tmp_path)
    _check_flat(row)


@pytest.mark.timeout(1800)
def test_colocated_shm_soak(request: pytest.FixtureRequest, tmp_path: Any) -> None:
    n = _syncs(request)
    specs = fh.fault_model(int(COLO_BUCKET_MB * (1 << 20)))
    expected = expected_digests(specs)
    handle = f"ipc:///tmp/vfs-soak-{uuid.uuid4().hex[:12]}.sock"
    log = str(tmp_path / "soak.log")
    ctx = mp.get_context("spawn")
    pause = [WARMUP - 1, n - 1]  # both processes idle while measured
    s_parent, s_child = ctx.Pipe()
    r_parent, r_child = ctx.Pipe()
    sender = ctx.Process(
        target=fh.colocated_sender_main,
        args=(s_child, [handle], specs, COLO_BUCKET_MB, 60, {"pause_at": pause}, n),
        daemon=True,
    )
    receiver = ctx.Process(
        target=fh.colocated_receiver_main,
        args=(r_child, [handle], log, 60, {"pause_at": pause}, n),
        daemon=True,
    )
    t0 = time.monotonic()
    sender.start()
    receiver.start()
    s_child.close()
    r_child.close()
    conns = {"sender": s_parent, "receiver": r_parent}
    figures: dict[str, dict[str, Any]] = {"sender": {}, "receiver": {}}
    pids: dict[str, int] = {}
    segments: dict[str, int] = {}
    paused: set[str] = set()
    try:
        pending = set(conns)
        while pending:
            for side in list(pending):
                conn = conns[side]
                if not conn.poll(0.05):
                    continue
                msg = conn.recv()
                if msg[0] == "pid":
                    pids[side] = msg[1]
                elif msg[0] == "ok":
                    if msg[1] in pause:
                        key = "start" if msg[1] == WARMUP - 1 else "end"
                        figures[side][key] = msg[2]
                        paused.add(side)
                        if paused == {"sender", "receiver"}:
                            segments[key] = len(fh.colocated_segments_of(pids["sender"]))
                            for c in conns.values():
                                c.send("go")
                            paused.clear()
                elif msg[0] == "done":
                    pending.discard(side)
                else:
                    raise AssertionError(f"{side}: {msg}")
            for side in pending:
                proc = sender if side == "sender" else receiver
                assert proc.is_alive() or conns[side].poll(0), f"{side} died (exit code {proc.exitcode})"
        sender.join(60)
        receiver.join(60)
        assert sender.exitcode == 0 and receiver.exitcode == 0
    finally:
        for proc in (sender, receiver):
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    got = fh.read_digests(log)
    assert len(got) == n * len(expected)
    assert got == expected * n, "a sync delivered different bytes"
    row = {
        "transport": "colocated-shm",
        "syncs": n,
        "warmup": WARMUP,
        "seconds": round(time.monotonic() - t0, 1),
        "sender": figures["sender"],
        "receiver": figures["receiver"],
        "segments": segments,
        "segments_after_exit": len(fh.colocated_segments_of(pids["sender"])),
    }
    _report(row, tmp_path)
    _check_flat(row)
    # the two persistent slots stay mapped across syncs; their names are unlinked once attached
    assert segments["start"] == 0, segments
    assert row["segments_after_exit"] == 0
    path = fh.ipc_path(handle)
    assert path is not None and not os.path.exists(path)
