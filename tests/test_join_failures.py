"""A rollout rank that cannot join the transfer group (it cannot map the sender's buckets, its endpoint
is wrong, ...) fails in ``init_process_group`` at once; the trainer and the other rollout ranks, waiting
in the group's handshake (controlled transports: the sender for every hello, the receivers for their
welcome; gloo: the join barrier before gloo's rendezvous), hear its cause from that handshake
(``TransportCore.abort_join``) and end within moments, not by ``timeout_s``; the next sync is exact.
One trainer rank and four rollout ranks, each a spawned process running verl's checkpoint engine.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _transport_harness import Cluster, TensorSpec, expected_digests  # type: ignore[import-not-found]

pytestmark = [pytest.mark.verl, pytest.mark.fleet]

ROLLOUTS = 4
FAILING = 2  # verl's rollout rank that cannot join (harness process 1 + FAILING)
TIMEOUT_S = 60  # every rank's timeout_s: ending by it would be the defect
PROMPT_S = 15  # "at once" on a loaded 2-core host: far below TIMEOUT_S
MODEL = [TensorSpec(f"layer{i}.w", (900,), "float32") for i in range(6)]
CAUSE = "cannot map the sender's buckets on purpose"

# the failure happens inside the rank's transport, before it reached any peer; once only
CANNOT_JOIN = f"""
transport = worker.engine.transport
if hasattr(transport, "_make_sides"):  # one copy per host: this rank joins its host's shm group
    transport._make_sides()
    transport = transport.local
cls = type(transport)
original = cls._connect
def _connect(self, **kwargs):
    if not getattr(cls, "failed_once", False):
        cls.failed_once = True
        raise OSError({CAUSE!r})
    return original(self, **kwargs)
cls._connect = _connect
result = None
"""

RECEIVE = """
from _verl_receive import verl_update_weights
result = verl_update_weights(worker)
"""


def _init_all(cluster: Cluster) -> list[tuple[str, Any]]:
    """verl's manager: every rank's ``prepare``, ``build_topology``, then every rank's
    ``init_process_group`` at once; returns each rank's outcome."""
    metadata = cluster.call_all("prepare")
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from verl_fastsync.verl.engine import register_engine

    register_engine()
    actor, rollout = CheckpointEngineRegistry.get("fastsync").build_topology(1, ROLLOUTS, metadata)
    cluster.post(0, "init", {k: v[0] for k, v in actor.items()})
    for j in range(ROLLOUTS):
        cluster.post(1 + j, "init", {k: v[j] for k, v in rollout.items()})
    return [cluster.wait_result(i, timeout=3 * TIMEOUT_S) for i in range(1 + ROLLOUTS)]


@pytest.mark.timeout(10 * TIMEOUT_S)
@pytest.mark.parametrize("transport", ["gloo", "shm", "nixl"])
def test_a_rollout_rank_that_cannot_join_ends_every_rank_at_once_with_its_cause(transport: str) -> None:
    ctor = {"bucket_size": 4096, "timeout_s": TIMEOUT_S}
    with Cluster(transport, 1, ROLLOUTS, mode="engine", ctor=ctor, timeout=4 * TIMEOUT_S) as cluster:
        cluster.post(1 + FAILING, "exec", CANNOT_JOIN)
        cluster.wait(1 + FAILING)
        start = time.time()
        results = _init_all(cluster)
        seconds = time.time() - start
        for i, (status, error) in enumerate(results):
            print(f"{cluster.labels[i]}: {status} {str(error).splitlines()[0][:300]}")
        status, error = results[1 + FAILING]
        assert status == "err" and CAUSE in error, error
        checked = [0, *(1 + j for j in range(ROLLOUTS) if j != FAILING)]
        if transport != "shm" and results[0][0] == "ok":
            # one copy per host: the trainer joined its hop to the host's leader before the leader
            # heard that rank 2 cannot join the host's shm group; verl's manager fails the step on
            # the rollout ranks' errors and never calls send. (nixl: a send would fail at once with
            # the cause; gloo reads a cause published between syncs only at its timeout slices.)
            checked.remove(0)
        for i in checked:
            status, error = results[i]
            assert status == "err", (cluster.labels[i], error)
            assert f"rollout rank {FAILING} aborted the sync" in error and CAUSE in error, (
                cluster.labels[i],
                error,
            )
            assert "timed out" not in error, (cluster.labels[i], error)
        assert seconds < PROMPT_S, f"the ranks waiting for rollout rank {FAILING} took {seconds:.1f}s"
        print(f"{transport}: every rank ended {seconds:.2f}s after the inits were posted")
        cluster.call_all("finalize")
        # the next sync, every rollout rank through verl's worker method, delivers every byte
        cluster.build_process_group()
        cluster.post(0, "send", MODEL, 7, {})
        for j in range(ROLLOUTS):
            cluster.post(1 + j, "exec", RECEIVE)
        rollouts = [cluster.wait(1 + j) for j in range(ROLLOUTS)]
        cluster.wait(0)
        cluster.call_all("finalize")
        for j, result in enumerate(rollouts):
            assert result["status"] == "ok", (j, result)
            assert [tuple(d) for d in result["digests"]] == expected_digests(MODEL, 7), j
