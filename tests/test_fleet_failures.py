"""Failures in a fleet: one trainer rank and four rollout ranks, each rollout rank running verl's own
``CheckpointEngineWorker.update_weights`` (``_verl_receive``) on the ``shm`` and ``nixl`` engine
transports. A failure on any rank - a rollout's server adapter, the trainer's weight producer, a
rollout process that is killed - ends the sync on every rank within moments (not by a timeout), each
error carrying the first cause and verl's name of the rank where it happened; the healthy ranks never
report a symptom of the abort instead (a shared-memory segment the sender already released); the
failed sync leaves no thread, segment or channel behind; and the next sync delivers every byte.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from _transport_harness import Cluster, TensorSpec, expected_digests  # type: ignore[import-not-found]

pytestmark = [pytest.mark.verl, pytest.mark.fleet]

TRANSPORTS = ["shm", "nixl"]
ROLLOUTS = 4
FAILING = 2  # verl's rollout rank whose adapter fails (harness process 1 + FAILING)
TIMEOUT_S = 60  # every rank's timeout_s: ending by it would be the defect
PROMPT_S = 15  # "at once" on a loaded 2-core host: far below TIMEOUT_S, far above the ~50 ms it takes
MODEL = [TensorSpec(f"layer{i}.w", (900,), "float32") for i in range(12)]  # one tensor per 4 KiB bucket

RECEIVE = """
import time
from _verl_receive import verl_update_weights
result = verl_update_weights(worker, **{kw})
result["ended"] = time.time()
"""

SEND = """
import time
from _transport_harness import TensorSpec
try:
    result = {{"status": "ok", "value": worker.send({model!r}, {seed}, {extra!r})}}
except Exception as exc:
    result = {{"status": "err", "error": f"{{type(exc).__name__}}: {{exc}}"}}
result["ended"] = time.time()
"""

DIE = """
import os
import _verl_receive


async def dying(self, weights, **kwargs):
    loaded = 0
    async for _name, _tensor in weights:
        loaded += 1
        if loaded == 5:  # killed while loading its 5th tensor: no Abort, no reason
            os._exit(17)


_verl_receive.FailingAdapter.update_weights = dying
_verl_receive.verl_update_weights(worker)
"""

THREADS = """
import threading
import time
deadline = time.monotonic() + 1.0  # a failed sync frees its threads within a second
while time.monotonic() < deadline:
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("fastsync"))
    if not left:
        break
    time.sleep(0.02)
result = left
"""


def _cluster(transport: str) -> Cluster:
    # every rollout rank its own destination (hosts=off): the one-copy-per-host paths have their
    # own failure tests (test_hosts.py)
    ctor = {"bucket_size": 4096, "timeout_s": TIMEOUT_S, "hosts": "off"}
    return Cluster(transport, 1, ROLLOUTS, mode="engine", ctor=ctor, timeout=4 * TIMEOUT_S)


def _rollout(rank: int) -> int:
    """The harness process of verl's rollout rank ``rank``."""
    return 1 + rank


def _run(
    cluster: Cluster,
    seed: int,
    send_extra: dict[str, Any] | None = None,
    adapters: dict[int, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One sync with every rank's end time: (trainer, rollout ranks 0..3)."""
    cluster.build_process_group()
    cluster.post(0, "exec", SEND.format(model=MODEL, seed=seed, extra=send_extra or {}))
    for rank in range(ROLLOUTS):
        cluster.post(_rollout(rank), "exec", RECEIVE.format(kw=repr((adapters or {}).get(rank, {}))))
    rollouts = [cluster.wait(_rollout(rank)) for rank in range(ROLLOUTS)]
    trainer = cluster.wait(0)
    cluster.call_all("finalize")
    return trainer, rollouts


def _clean_syncs(cluster: Cluster, seeds: tuple[int, ...]) -> None:
    for seed in seeds:
        trainer, rollouts = _run(cluster, seed)
        assert trainer["status"] == "ok", trainer
        for rank, rollout in enumerate(rollouts):
            assert rollout["status"] == "ok", (rank, rollout)
            assert [tuple(d) for d in rollout["digests"]] == expected_digests(MODEL, seed), rank


def _producer_failure(cluster: Cluster, transport: str) -> None:
    """The trainer's weight generator raises after 5 tensors: each of the four rollout ranks fails at
    once with the producer's error, named as trainer rank 0's; the next sync is exact."""
    trainer, rollouts = _run(cluster, 4, send_extra={"raise_after": 5})
    assert trainer["status"] == "err" and "producer failed on purpose after 5 tensors" in trainer["error"]
    raised_at = float(trainer["error"].rsplit("at t=", 1)[1].split()[0].rstrip(";)"))
    for rank, rollout in enumerate(rollouts):
        error = rollout["error"]
        assert rollout["status"] == "err", (rank, rollout)
        assert (
            f"{transport} transport, rollout rank {rank}: trainer rank 0 aborted the sync: "
            "RuntimeError: producer failed on purpose after 5 tensors" in error
        ), (rank, error)
        assert "vanished" not in error, error
        assert rollout["ended"] - raised_at < PROMPT_S, (rank, rollout["ended"] - raised_at)
    assert not cluster.leaked_segments()
    _no_threads_left(cluster, list(range(1 + ROLLOUTS)))
    _clean_syncs(cluster, (5,))


def _no_threads_left(cluster: Cluster, indexes: list[int]) -> None:
    for index in indexes:
        cluster.post(index, "exec", THREADS)
        assert cluster.wait(index) == [], f"{cluster.labels[index]} kept threads of the failed sync"


@pytest.mark.timeout(10 * TIMEOUT_S)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_adapter_or_producer_failure_ends_every_rank_at_once_with_its_cause(transport: str) -> None:
    """Rollout rank 2's adapter raises loading its 5th tensor. Every rank ends within moments: the
    failing rank with the adapter's error (what verl's caller sees), the trainer and the three healthy
    rollout ranks with that error named as rollout rank 2's, once - not a shared-memory segment that
    "does not exist (vanished?)" (shm: the healthy ranks found the segments the failed sender had
    released before its Abort reached them), not the trainer's own error wrapping it (nixl: the
    cause nested in the relaying trainer's text). Then two clean syncs deliver every byte, and a
    failure of the trainer's producer reaches the four rollout ranks the same way."""
    cause = "the consumer failed: LoadError: load_weights failed on purpose at tensor 4 (layer4.w)"
    with _cluster(transport) as cluster:
        trainer, rollouts = _run(cluster, 1, adapters={FAILING: {"fail_at": 4}})
        failed = rollouts[FAILING]
        assert failed["status"] == "err", failed
        assert failed["error"].startswith("LoadError: load_weights failed"), failed  # the adapter's
        errors = {"trainer rank 0": trainer}
        errors.update({f"rollout rank {r}": rollouts[r] for r in range(ROLLOUTS) if r != FAILING})
        for who, result in errors.items():
            assert result["status"] == "err", (who, result)
            error = result["error"]
            assert error.count(cause) == 1, (who, error)  # the first cause, once
            named = f"{transport} transport, {who}: rollout rank {FAILING} aborted the sync: {cause}"
            assert named in error, (who, error)
            assert "vanished" not in error, (who, error)  # a symptom, not the cause
            assert "PeerAbortedError: " not in error.partition(": ")[2], (who, error)  # not nested
            seconds = result["ended"] - failed["failed_at"]
            assert seconds < PROMPT_S, f"{who} ended {seconds:.1f}s after rollout rank {FAILING} failed"
        ended = max(r["ended"] for r in [trainer, *rollouts]) - failed["failed_at"]
        print(f"{transport}, {ROLLOUTS} rollout ranks: every rank ended {ended:.3f}s after the failure")
        assert not cluster.leaked_segments()
        _no_threads_left(cluster, list(range(1 + ROLLOUTS)))
        _clean_syncs(cluster, (2, 3))
        _producer_failure(cluster, transport)


def _kill_mid_sync(cluster: Any, seed: int) -> tuple[dict[str, Any], dict[int, dict[str, Any]], float]:
    """One sync in which rollout rank ``FAILING``'s process exits at its 5th tensor: (the trainer's
    result, each healthy rollout rank's result, when the ranks were started)."""
    cluster.build_process_group()
    cluster.post(0, "exec", SEND.format(model=MODEL, seed=seed, extra={}))
    for rank in range(ROLLOUTS):
        cluster.post(_rollout(rank), "exec", DIE if rank == FAILING else RECEIVE.format(kw="{}"))
    started = time.time()
    rollouts = {rank: cluster.wait(_rollout(rank)) for rank in range(ROLLOUTS) if rank != FAILING}
    trainer = cluster.wait(0)
    assert cluster.wait_result(_rollout(FAILING))[0] == "err"  # the process died
    return trainer, rollouts, started


def _finalize_survivors(cluster: Any) -> None:
    """Finalize every rank but the dead one; nothing may be left: no segment, no fastsync thread."""
    survivors = [0, *(_rollout(r) for r in range(ROLLOUTS) if r != FAILING)]
    for index in survivors:
        cluster.post(index, "finalize")
        cluster.wait(index)
    assert not cluster.leaked_segments()
    _no_threads_left(cluster, survivors)


@pytest.mark.timeout(10 * TIMEOUT_S)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_killed_rollout_rank_ends_the_others_at_once_naming_it(transport: str) -> None:
    """Rollout rank 2's process exits while loading its 5th tensor (killed: it sends nothing). The
    trainer notices within moments that the process is gone, not after ``timeout_s``, and every rank
    fails naming rollout rank 2."""
    with _cluster(transport) as cluster:
        trainer, rollouts, started = _kill_mid_sync(cluster, seed=6)
        gone = f"rollout rank {FAILING} failed: its process (pid "
        assert trainer["status"] == "err" and gone in trainer["error"], trainer
        assert "ended during the sync (killed or crashed)" in trainer["error"], trainer
        for rank, rollout in rollouts.items():
            error = rollout["error"]
            assert rollout["status"] == "err", (rank, rollout)
            named = f"rollout rank {rank}: rollout rank {FAILING} aborted the sync: its process (pid"
            assert named in error, (rank, error)
            assert "ended during the sync (killed or crashed)" in error, error
        ended = max(r["ended"] for r in [trainer, *rollouts.values()]) - started
        assert ended < PROMPT_S, f"the ranks ended {ended:.1f}s after the sync started"
        _finalize_survivors(cluster)


@pytest.mark.timeout(900)
def test_verl_manager_four_rollout_ranks_one_fails_every_rank_ends_with_its_cause(ray_cluster: Any) -> None:
    """The same failure driven by verl's own ``CheckpointEngineManager.build_process_group`` over real
    Ray actors (shm, 4 rollout ranks): every rank ends within moments with rollout rank 2's error, and
    the next sync the manager builds is exact on every rank."""
    from verl.checkpoint_engine import base

    if not hasattr(base.CheckpointEngineManager, "build_process_group"):
        pytest.skip("this verl release has no CheckpointEngineManager.build_process_group")
    from _fleet_ranks import FleetRank  # type: ignore[import-not-found]
    from _ray_ranks import RankGroup  # type: ignore[import-not-found]
    from verl.workers.config import CheckpointEngineConfig

    from verl_fastsync.verl.engine import register_engine

    register_engine()
    ray = ray_cluster
    tests = Path(__file__).resolve().parent
    paths = [str(tests.parent), str(tests), os.environ.get("VERL_FASTSYNC_VERL_PATH", "")]
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
    ctor = {"bucket_size": 4096, "timeout_s": TIMEOUT_S}
    remote = ray.remote(num_cpus=0)(FleetRank).options(runtime_env=env)
    trainer = remote.remote("shm", dict(ctor, is_master=True), "trainer")
    rollouts = [remote.remote("shm", dict(ctor), "rollout") for _ in range(ROLLOUTS)]
    cause = "the consumer failed: LoadError: load_weights failed on purpose at tensor 4 (layer4.w)"
    try:
        config = CheckpointEngineConfig(backend="fastsync", update_weights_bucket_megabytes=1)
        manager = base.CheckpointEngineManager(config, RankGroup([trainer]), [])
        for seed, failing in ((1, FAILING), (2, None)):
            manager.build_process_group(RankGroup(rollouts))
            adapters = [{"fail_at": 4} if rank == failing else {} for rank in range(ROLLOUTS)]
            results = ray.get(
                [trainer.run.remote(SEND.format(model=MODEL, seed=seed, extra={}))]
                + [
                    r.run.remote(RECEIVE.format(kw=repr(kw)))
                    for r, kw in zip(rollouts, adapters, strict=True)
                ],
                timeout=600,
            )
            ray.get(
                [h.execute_checkpoint_engine.remote("finalize") for h in [trainer, *rollouts]], timeout=300
            )
            if failing is None:
                assert all(r["status"] == "ok" for r in results), results
                for rollout in results[1:]:
                    assert [tuple(d) for d in rollout["digests"]] == expected_digests(MODEL, seed)
                continue
            failed_at = results[1 + failing]["failed_at"]
            for index, result in enumerate(results):
                if index == 1 + failing:
                    assert result["error"].startswith("LoadError"), result
                    continue
                assert result["status"] == "err", result
                assert f"rollout rank {failing} aborted the sync: {cause}" in result["error"], result
                assert result["ended"] - failed_at < PROMPT_S, result
    finally:
        for handle in [trainer, *rollouts]:
            ray.kill(handle)


def test_the_shm_host_check_names_the_sender_and_the_rollout_ranks_elsewhere() -> None:
    """``shm`` needs one host: the error names the sending trainer rank as the metadata labels it (a
    lane's sender is not trainer rank 0) and each rollout rank on another host by verl's number."""
    from verl_fastsync.transports.base import TransportError
    from verl_fastsync.transports.shm import ShmTransport

    here, there = {"host": "a", "bucket_size": 1}, {"host": "b", "bucket_size": 1}
    sender = dict(here, endpoint="ipc:///x", label="trainer rank 2 (lane 1)")
    with pytest.raises(TransportError) as caught:
        ShmTransport.build_topology(1, 3, [sender, here, there, there])
    message = str(caught.value)
    assert "trainer rank 2 (lane 1) is on 'a', rollout rank 1 on 'b', rollout rank 2 on 'b'" in message
    assert "trainer rank 0" not in message and "rollout rank 0" not in message, message
    with pytest.raises(TransportError, match="trainer rank 0 is on 'a', rollout rank 0 on 'b'"):
        ShmTransport.build_topology(1, 1, [dict(here, endpoint="ipc:///x"), there])
