"""The delta bench: real AdamW steps synced by a ``delta=false`` and a ``delta=true`` engine across two
namespaces; every sync's bytes are checked by digest (a mismatch raises), delta moves fewer bytes when
few values changed and the same bytes when all did, and nothing is left behind."""

from __future__ import annotations

import os

import pytest

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
