"""gloo with several rollout ranks: one rank's failure ends the sync on every rank at once, each
error carrying the first cause and verl's name of the rank that failed; a failed side frees its
threads and sockets at once and never delays its process's exit.

Every rollout rank runs verl's own ``CheckpointEngineWorker.update_weights`` (``_verl_receive``) in a
spawned process; the trainer runs the engine's ``send_weights``. gloo's ``abort()`` closes nothing and
a broadcast blocked in ``Work.wait`` cannot be interrupted: before the fix the healthy rollout ranks
waited out the whole ``timeout_s`` ("timed out after 60s waiting for trainer rank 0"), and the
failed rank's process needed ``timeout_s`` more to exit (its receive thread stayed blocked).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _transport_harness import Cluster, TensorSpec, expected_digests  # type: ignore[import-not-found]

pytestmark = [pytest.mark.verl, pytest.mark.fleet]

TIMEOUT_S = 60  # every rank's timeout_s: the old code waited it out
BOUND_S = 15  # "at once" on a loaded 2-core host: far below TIMEOUT_S, far above the ~0.1 s it takes
MODEL = [TensorSpec(f"layer{i}.w", (900,), "float32") for i in range(12)]  # one tensor per 4 KiB bucket
STALL_S = 30  # the trainer's busy producer in the exit test
CAUSE = "the consumer failed: LoadError: load_weights failed on purpose at tensor 4"

RECEIVE = """
import time
from _verl_receive import verl_update_weights
result = verl_update_weights(worker, **{kw})
result["ended"] = time.time()
"""

# a send still running after BOUND_S prints every thread's stack (shown with a failing test's output)
SEND = """
import faulthandler, time
from _transport_harness import TensorSpec
faulthandler.dump_traceback_later({bound})
try:
    worker.send({specs!r}, {seed}, {extra!r})
    result = {{"status": "ok", "ended": time.time()}}
except Exception as exc:
    result = {{"status": "err", "error": f"{{type(exc).__name__}}: {{exc}}", "ended": time.time()}}
finally:
    faulthandler.cancel_dump_traceback_later()
"""

# what a failed side still holds a moment after its failure: threads still in the gloo transport's
# code (a receive blocked in a broadcast), native threads (gloo's) and connected TCP sockets (the
# group's and the store's)
HELD = """
import gc, sys, time, traceback
from verl_fastsync.transports.gloo_abort import connected_sockets
time.sleep({settle})
gc.collect()
result = {{
    "threads": [
        ident for ident, frame in sys._current_frames().items()
        if any("transports/gloo" in f.filename for f in traceback.extract_stack(frame))
    ],
    "native_threads": int(next(l for l in open("/proc/self/status") if l.startswith("Threads:")).split()[1]),
    "sockets": len(connected_sockets()),
}}
"""


def _cluster(n_rollout: int) -> Cluster:
    # the gloo group of every rollout rank (hosts=off): the hosts layer has its own tests (test_hosts.py)
    ctor = {"bucket_size": 4096, "timeout_s": TIMEOUT_S, "hosts": "off"}
    return Cluster("gloo", 1, n_rollout, mode="engine", ctor=ctor, timeout=4 * TIMEOUT_S)


def _exec(cluster: Cluster, rank: int, code: str) -> Any:
    cluster.post(rank, "exec", code)
    return cluster.wait(rank)


def _start_sync(cluster: Cluster, seed: int, adapters: dict[int, dict[str, Any]]) -> None:
    """Trainer rank 0 sends; harness rollout ``j`` (verl's rollout rank ``j``) runs verl's method
    with ``adapters.get(j)`` (``{"die": n}``: its process dies after ``n`` tensors instead)."""
    cluster.build_process_group()
    cluster.post(0, "exec", SEND.format(bound=BOUND_S, specs=MODEL, seed=seed, extra={}))
    for j in range(cluster.n_rollout):
        adapter = adapters.get(j, {})
        if "die" in adapter:
            cluster.post(1 + j, "receive", {"die_after": adapter["die"]})
        else:
            cluster.post(1 + j, "exec", RECEIVE.format(kw=repr(adapter)))


def _clean_sync(cluster: Cluster, seed: int) -> None:
    _start_sync(cluster, seed, {})
    results = [cluster.wait(i) for i in range(len(cluster.conns))]
    cluster.call_all("finalize")
    assert [r["status"] for r in results] == ["ok"] * len(results), results
    for j, result in enumerate(results[1:]):
        assert [tuple(d) for d in result["digests"]] == expected_digests(MODEL, seed), f"rollout rank {j}"


@pytest.mark.timeout(12 * TIMEOUT_S)
@pytest.mark.parametrize("n_rollout", [2, 4])
def test_one_adapter_error_ends_every_rank_at_once_with_its_cause(n_rollout: int) -> None:
    """Rollout rank ``n - 1``'s adapter raises loading the 5th tensor: the trainer and every other
    rollout rank fail within moments, each naming that rank and the adapter's error; the failed
    rank frees its gloo threads and sockets at once; the next syncs deliver every byte."""
    failing = n_rollout - 1
    with _cluster(n_rollout) as cluster:
        _clean_sync(cluster, 1)  # the group is built and reused: the failure hits a persistent one
        baseline = _exec(cluster, 1 + failing, HELD.format(settle=0))
        _start_sync(cluster, 2, {failing: {"fail_at": 4}})
        results = [cluster.wait(i) for i in range(len(cluster.conns))]
        held = _exec(cluster, 1 + failing, HELD.format(settle=1.0))
        cluster.call_all("finalize")
        failed_at = results[1 + failing]["failed_at"]
        ended = {cluster.labels[i]: round(r["ended"] - failed_at, 3) for i, r in enumerate(results)}
        print(f"gloo, {n_rollout} rollout ranks: seconds from the failure until each rank ended: {ended}")
        for i, result in enumerate(results):
            print(f"  {cluster.labels[i]}: {result['error'].splitlines()[0][:400]}")
            assert result["status"] == "err", (cluster.labels[i], result)
            assert CAUSE.split(": ", 1)[1] in result["error"], (cluster.labels[i], result["error"])
            assert "timed out" not in result["error"], (cluster.labels[i], result["error"])
        assert results[1 + failing]["error"].startswith("LoadError"), results[1 + failing]
        for i in [0, *(1 + j for j in range(n_rollout) if j != failing)]:
            error = results[i]["error"]
            assert f"rollout rank {failing} aborted the sync: {CAUSE}" in error, (cluster.labels[i], error)
        trainer_error = results[0]["error"]
        assert "trainer rank 0" in trainer_error, trainer_error
        for j in range(n_rollout):
            if j != failing:
                assert f"gloo transport, rollout rank {j}:" in results[1 + j]["error"], results[1 + j]
        slowest = max(ended.values())
        assert slowest < BOUND_S, f"a rank learned of the failure after {slowest:.1f}s: {ended}"
        assert held["threads"] == [] and held["sockets"] == 0, (held, baseline)
        assert held["native_threads"] <= baseline["native_threads"] - 8, (held, baseline)  # gloo's 8 workers
        _clean_sync(cluster, 3)
        _clean_sync(cluster, 4)


@pytest.mark.timeout(12 * TIMEOUT_S)
@pytest.mark.parametrize("victim", ["rollout rank 1", "trainer rank 0"])
def test_a_rank_that_dies_mid_sync_ends_every_other_rank_at_once(victim: str) -> None:
    """A process killed mid-sync (``os._exit``: its sockets close as with SIGKILL, it publishes
    nothing): every other rank fails within moments (the kernel closes the dead rank's
    connections, the first rank to notice publishes what it saw), never by its own timeout."""
    with _cluster(4) as cluster:
        _clean_sync(cluster, 1)
        if victim == "trainer rank 0":
            cluster.build_process_group()
            cluster.post(0, "send", MODEL, 2, {"die_after": 4})
            for j in range(4):
                cluster.post(1 + j, "exec", RECEIVE.format(kw="{}"))
            survivors = [1, 2, 3, 4]
        else:
            _start_sync(cluster, 2, {1: {"die": 4}})
            survivors = [0, 1, 3, 4]
        started = time.time()
        dead = 2 if victim == "rollout rank 1" else 0
        assert cluster.wait_result(dead, timeout=3 * TIMEOUT_S)[0] == "err"  # it died
        results = {i: cluster.wait(i) for i in survivors}
        ended = {cluster.labels[i]: round(r["ended"] - started, 3) for i, r in results.items()}
        print(f"gloo, {victim} killed mid-sync: seconds until each other rank ended: {ended}")
        for i, result in results.items():
            print(f"  {cluster.labels[i]}: {result['error'].splitlines()[0][:400]}")
            assert result["status"] == "err", (cluster.labels[i], result)
            assert "timed out" not in result["error"], (cluster.labels[i], result["error"])
            if victim == "rollout rank 1":
                assert "the connection to rollout rank 1 closed" in result["error"], result["error"]
        assert max(ended.values()) < BOUND_S, ended


@pytest.mark.timeout(12 * TIMEOUT_S)
def test_a_failed_receive_never_delays_process_exit() -> None:
    """The rollout's adapter fails while the trainer's producer is busy for 30 s (a slow gather): the
    rollout's receive thread waits for the next bucket's header. The old code left that thread
    blocked in gloo (``abort()`` closes nothing and the trainer, alive and still holding the group,
    sends nothing) and the process's exit waited for it: until the trainer's next bucket or
    ``timeout_s``. Now the rollout frees it at once: its process exits within moments, and the
    trainer, once its producer returns, fails with the rollout's cause."""
    with _cluster(1) as cluster:
        cluster.build_process_group()
        cluster.post(
            0,
            "exec",
            SEND.format(bound=STALL_S + BOUND_S, specs=MODEL, seed=5, extra={"delay_s": {6: STALL_S}}),
        )
        cluster.post(1, "exec", RECEIVE.format(kw=repr({"fail_at": 4})))
        rollout = cluster.wait(1)
        assert rollout["status"] == "err" and rollout["error"].startswith("LoadError"), rollout
        held = _exec(cluster, 1, HELD.format(settle=1.0))
        assert held["threads"] == [] and held["sockets"] == 0, held
        started = time.monotonic()
        cluster.post(1, "exit")
        cluster.procs[1].join(timeout=3 * TIMEOUT_S)
        seconds = time.monotonic() - started
        print(f"gloo: the failed rollout's process exited {seconds:.2f}s after its exit was asked")
        assert not cluster.procs[1].is_alive() and seconds < 10, f"exit took {seconds:.1f}s"
        trainer = cluster.wait(0)
        assert trainer["status"] == "err" and f"rollout rank 0 aborted the sync: {CAUSE}" in trainer["error"]
