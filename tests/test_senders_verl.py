"""``senders=all`` through verl's own ``CheckpointEngineManager.build_process_group`` (the release
under test): 2 trainer ranks and 2 rollout ranks, each a real Ray actor holding the ``fastsync``
engine; verl's method runs ``prepare`` on every rank, the engine's ``build_topology`` and every
rank's ``init_process_group``; then the trainer ranks send and the rollout ranks receive (what
verl's ``update_weights`` step 5 does through its worker classes), and ``finalize`` runs as verl's
step 6. Every byte is checked on both rollout ranks, twice. The per-release runs take gloo
(``_release``); every transport runs on verl 0.9.1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _release import transports  # type: ignore[import-not-found]
from _transport_harness import TensorSpec, expected_digests, synthetic_model  # type: ignore[import-not-found]

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent


@pytest.mark.parametrize("transport", transports("shm", "gloo", "nixl"))
def test_verl_manager_two_senders_two_rollout_ranks(ray_cluster: Any, transport: str) -> None:
    from verl.checkpoint_engine import base

    if not hasattr(base.CheckpointEngineManager, "build_process_group"):
        pytest.skip("this verl release has no CheckpointEngineManager.build_process_group")
    from _ray_ranks import Rank, RankGroup  # type: ignore[import-not-found]
    from verl.workers.config import CheckpointEngineConfig

    from verl_fastsync.verl.engine import register_engine

    register_engine()
    ray = ray_cluster
    paths = [str(ROOT), str(TESTS_DIR), os.environ.get("VERL_FASTSYNC_VERL_PATH", "")]
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
    ctor = {"bucket_size": 4096, "timeout_s": 120, "senders": "all", "verify": True}
    remote = ray.remote(num_cpus=0)(Rank).options(runtime_env=env)
    trainers = [remote.remote(transport, dict(ctor, is_master=i == 0), "trainer") for i in range(2)]
    rollouts = [remote.remote(transport, dict(ctor), "rollout") for _ in range(2)]
    try:
        config = CheckpointEngineConfig(backend="fastsync", update_weights_bucket_megabytes=1)
        manager = base.CheckpointEngineManager(config, RankGroup(trainers), [])
        model = synthetic_model(4096, dtypes=("float32", "bfloat16")) + [
            TensorSpec(f"layer{i}.w", (300 + 37 * i,), "float32") for i in range(8)
        ]
        for seed in (1, 2):
            manager.build_process_group(RankGroup(rollouts))
            results = ray.get(
                [t.send.remote(model, seed) for t in trainers] + [r.receive.remote() for r in rollouts],
                timeout=600,
            )
            ray.get(
                [h.execute_checkpoint_engine.remote("finalize") for h in trainers + rollouts], timeout=300
            )
            sent = [r["metrics"] for r in results[:2]]
            assert all(m["fastsync/transfer/tensors"] > 0 for m in sent), sent  # both trainer ranks sent
            assert sum(m["fastsync/transfer/tensors"] for m in sent) == len(model)
            expected = sorted(expected_digests(model, seed))
            for received in results[2:]:
                got = [tuple(d) for d in received["digests"]]
                assert len(got) == len(model) and sorted(got) == expected
    finally:
        for handle in trainers + rollouts:
            ray.kill(handle)
