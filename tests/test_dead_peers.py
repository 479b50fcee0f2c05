"""A peer that dies mid-sync where its pid cannot be watched (another host): its control connection
closes, and every other rank ends within moments naming it, not after ``timeout_s``.

One trainer rank and four rollout ranks, each rollout rank running verl's own
``CheckpointEngineWorker.update_weights`` (``_verl_receive``). The trainer's check of its receivers'
pids (which sees only processes on its own host) is switched off inside the trainer process, so the
only way to learn of a dead rollout process is its closed connection, as across hosts.
"""

from __future__ import annotations

import time

import pytest
from _transport_harness import Cluster  # type: ignore[import-not-found]
from test_fleet_failures import (  # type: ignore[import-not-found]
    FAILING,
    MODEL,
    PROMPT_S,
    RECEIVE,
    ROLLOUTS,
    SEND,
    _clean_syncs,
    _finalize_survivors,
    _kill_mid_sync,
    _no_threads_left,
    _rollout,
)

pytestmark = [pytest.mark.verl, pytest.mark.fleet]

TRANSPORTS = ["nixl", "shm"]
TIMEOUT_S = 120  # every rank's timeout_s: ending by it would be the defect

NO_PID_CHECK = """
import verl_fastsync.transports.controlled as controlled
controlled.process_ended = lambda pid: False  # as for a rollout process on another host
"""


def _cluster(transport: str) -> Cluster:
    # every rollout rank its own destination (hosts=off): the one-copy-per-host paths have their
    # own failure tests (test_hosts.py)
    ctor = {"bucket_size": 4096, "timeout_s": TIMEOUT_S, "hosts": "off"}
    return Cluster(transport, 1, ROLLOUTS, mode="engine", ctor=ctor, timeout=4 * TIMEOUT_S)


@pytest.mark.timeout(6 * TIMEOUT_S)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rollout_rank_that_dies_unseen_by_pid_ends_every_rank_naming_it(transport: str) -> None:
    """Rollout rank 2's process exits while loading its 5th tensor; the trainer cannot see its pid.
    Its closed connection ends the trainer's sync naming rollout rank 2, and the three healthy rollout
    ranks get that as the first cause, all within moments."""
    with _cluster(transport) as cluster:
        _clean_syncs(cluster, (1,))
        cluster.post(0, "exec", NO_PID_CHECK)
        cluster.wait(0)
        trainer, rollouts, started = _kill_mid_sync(cluster, seed=2)
        cause = "its connection to trainer rank 0 closed mid-sync (process died or network lost)"
        assert trainer["status"] == "err", trainer
        assert (
            f"{transport} transport, trainer rank 0: rollout rank {FAILING} failed: {cause}"
            in trainer["error"]
        )
        for rank, rollout in rollouts.items():
            assert rollout["status"] == "err", (rank, rollout)
            named = f"rollout rank {rank}: rollout rank {FAILING} aborted the sync: {cause}"
            assert named in rollout["error"], (rank, rollout["error"])
        ended = {"trainer rank 0": trainer["ended"] - started}
        ended.update({f"rollout rank {r}": rollout["ended"] - started for r, rollout in rollouts.items()})
        print(f"{transport}: rollout rank {FAILING} died; ranks ended after (s): {ended}")
        assert max(ended.values()) < PROMPT_S, ended
        _finalize_survivors(cluster)


@pytest.mark.timeout(6 * TIMEOUT_S)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_trainer_that_dies_ends_every_rollout_rank_at_once(transport: str) -> None:
    """The trainer's process exits after its producer yielded 5 tensors: each of the four rollout
    ranks ends within moments with "lost trainer rank 0", not after ``timeout_s``."""
    with _cluster(transport) as cluster:
        cluster.build_process_group()
        cluster.post(0, "exec", SEND.format(model=MODEL, seed=3, extra={"die_after": 5}))
        for rank in range(ROLLOUTS):
            cluster.post(_rollout(rank), "exec", RECEIVE.format(kw="{}"))
        started = time.time()
        rollouts = [cluster.wait(_rollout(rank)) for rank in range(ROLLOUTS)]
        assert cluster.wait_result(0)[0] == "err"  # the trainer died
        lost = "lost trainer rank 0: its connection closed mid-sync (process died or network lost)"
        for rank, rollout in enumerate(rollouts):
            assert rollout["status"] == "err", (rank, rollout)
            assert f"{transport} transport, rollout rank {rank}: {lost}" in rollout["error"], (rank, rollout)
        ended = {f"rollout rank {r}": rollouts[r]["ended"] - started for r in range(ROLLOUTS)}
        print(f"{transport}: trainer rank 0 died; ranks ended after (s): {ended}")
        assert max(ended.values()) < PROMPT_S, ended
        for rank in range(ROLLOUTS):
            cluster.post(_rollout(rank), "finalize")
            cluster.wait(_rollout(rank))
        _no_threads_left(cluster, [_rollout(r) for r in range(ROLLOUTS)])
