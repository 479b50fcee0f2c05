"""The ``fastsync`` verl checkpoint engine, against the verl release under test.

Driven exactly as verl's ``CheckpointEngineManager`` drives a registered engine: constructed through
``CheckpointEngineRegistry.new("fastsync", ...)`` (trainer ranks with ``is_master``), ``prepare`` on
every rank, ``build_topology`` on the class from ``CheckpointEngineRegistry.get``, each rank's
``init_process_group`` kwargs, ``send_weights`` on every trainer rank concurrently with
``receive_weights`` on every rollout rank, ``finalize`` everywhere. Each rank is a spawned process.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from _transport_harness import Cluster, TensorSpec, expected_digests, synthetic_model  # type: ignore[import-not-found]

pytestmark = [pytest.mark.verl, pytest.mark.release]

MIB = 1 << 20


@pytest.fixture(scope="module")
def engine_cls() -> Any:
    from verl_fastsync.verl.engine import register_engine

    return register_engine()


def test_registration_is_idempotent_and_leaves_verl_engines(engine_cls: Any) -> None:
    import verl.checkpoint_engine as ce
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    from verl_fastsync.verl.engine import register_engine

    before = dict(CheckpointEngineRegistry._registry)
    assert register_engine() is engine_cls
    assert register_engine() is engine_cls
    after = dict(CheckpointEngineRegistry._registry)
    assert after == before
    assert CheckpointEngineRegistry.get("fastsync") is engine_cls
    assert issubclass(engine_cls, CheckpointEngine)
    for name in ("naive", "nccl", "nixl"):
        if name in before:
            assert after[name] is before[name]
            assert after[name] is not engine_cls
    assert ce is not None
    # every abstract method of this release's base class is implemented
    assert not getattr(engine_cls, "__abstractmethods__", set())
    assert inspect.isasyncgenfunction(engine_cls.receive_weights)
    assert inspect.iscoroutinefunction(engine_cls.send_weights)


def test_constructor_validation(engine_cls: Any) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from verl_fastsync.plugins import UnknownPluginNameError

    with pytest.raises(
        UnknownPluginNameError, match=r"fastsync.transport='tcp-over-email'.*available: .*shm"
    ):
        CheckpointEngineRegistry.new("fastsync", bucket_size=MIB, transport="tcp-over-email")
    with pytest.raises(TypeError, match=r"unknown engine_kwargs.fastsync key\(s\) \['bucket_mb'\]"):
        CheckpointEngineRegistry.new("fastsync", bucket_size=MIB, bucket_mb=3)
    for bad in (0, -5, "lots", "12 parsecs", 1.5, True, "-3MiB"):
        with pytest.raises(ValueError, match="bucket_bytes"):
            CheckpointEngineRegistry.new("fastsync", bucket_size=MIB, bucket_bytes=bad)
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes=0"):
        CheckpointEngineRegistry.new("fastsync", bucket_size=0)
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
        CheckpointEngineRegistry.new("fastsync", bucket_size=MIB, timeout_s=-1)
    engine = CheckpointEngineRegistry.new("fastsync", bucket_size=MIB, bucket_bytes="64MiB", is_master=True)
    assert engine.bucket_size == 64 * MIB and engine.is_master
    assert CheckpointEngineRegistry.new("fastsync", bucket_size=MIB, bucket_bytes="auto").bucket_size is None


def _meta(bucket: int | None, free: int | None, master: bool = False) -> dict[str, Any]:
    return {
        "engine": "fastsync",
        "transport": "shm",
        "is_master": master,
        "bucket_size": bucket,
        "free_bytes": free,
        "transport_meta": {"transport": "shm", "host": "h", **({"endpoint": "ipc:///x"} if master else {})},
    }


def test_auto_bucket_size(engine_cls: Any) -> None:
    """``auto``: model bytes / 16 clamped to [16 MiB, 512 MiB], at most 5% of the smallest free
    memory; 64 MiB before the first sync (model size unknown)."""
    from verl_fastsync.verl.engine import AUTO_CAP, AUTO_FIRST, AUTO_FLOOR, AUTO_FRACTION

    gib = 1 << 30
    metadata = [_meta(None, 8 * gib, True), _meta(None, 1 * gib), _meta(None, 4 * gib), _meta(None, 2 * gib)]
    # the non-master trainer rank (index 1) does not take part: the smallest participant has 2 GiB
    actor, rollout = engine_cls.build_topology(2, 2, metadata)
    assert actor["bucket_size"] == [AUTO_FIRST] * 2 and rollout["bucket_size"] == [AUTO_FIRST] * 2
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2]

    def sized(model_bytes: int | None, free: int = 1 << 50) -> int:
        meta = [_meta(None, free, True), _meta(None, free)]
        meta[0]["model_bytes"] = model_bytes
        return int(engine_cls.build_topology(1, 1, meta)[0]["bucket_size"][0])

    assert sized(160 * MIB) == AUTO_FLOOR == 16 * MIB  # a 160 MiB model: 16 MiB buckets, not 1 GiB
    assert sized(2 * gib) == 128 * MIB
    assert sized(100 * gib) == AUTO_CAP == 512 * MIB
    # free memory limits it: 5% of 1 GiB
    assert sized(100 * gib, free=gib) == int(gib * AUTO_FRACTION) // MIB * MIB
    small = [_meta(None, 8 * gib, True), _meta(None, int(AUTO_FLOOR / AUTO_FRACTION) - MIB)]
    with pytest.raises(ValueError, match=r"bucket_bytes=auto: rollout rank 0 has only \d+ MiB free"):
        engine_cls.build_topology(1, 1, small)


def test_topology_disagreements(engine_cls: Any) -> None:
    with pytest.raises(ValueError, match="disagree on the bucket size"):
        engine_cls.build_topology(1, 1, [_meta(MIB, None, True), _meta(2 * MIB, None)])
    other = _meta(MIB, None)
    other["transport"] = "gloo"
    with pytest.raises(ValueError, match=r"disagree on engine_kwargs\.fastsync\.transport"):
        engine_cls.build_topology(1, 1, [_meta(MIB, None, True), other])
    with pytest.raises(RuntimeError, match="must be the master"):
        engine_cls.build_topology(1, 1, [_meta(MIB, None), _meta(MIB, None)])


@pytest.mark.timeout(900)
def test_engine_protocol_end_to_end(engine_cls: Any) -> None:
    """2 trainer ranks (rank 1 only walks its generator) -> 1 rollout rank (several rollout ranks: see
    test_transports.py), real processes, through
    verl's registry; shm over bucket sizes 1 KiB..> model, verify on, auto bucket; then gloo, nixl."""
    model = synthetic_model(4096, dtypes=("float32", "bfloat16", "float8_e4m3fn"))
    expected = expected_digests(model)
    ctor = {"bucket_size": 4096, "timeout_s": 60}
    with Cluster("shm", n_actor=2, n_rollout=1, mode="engine", ctor=ctor, timeout=240) as cluster:
        runs: list[tuple[str, dict[str, Any]]] = [
            ("shm", {"bucket_bytes": 1024}),
            ("shm", {"bucket_bytes": 1536, "slots": 2}),
            ("shm", {"bucket_bytes": 2048, "slots": 4}),
            ("shm", {"bucket_bytes": "1MiB", "verify": True, "slots": None}),
            ("shm", {"bucket_bytes": "auto", "verify": False}),
            ("gloo", {"bucket_bytes": 4099}),
            ("nixl", {"bucket_bytes": 2048}),
        ]
        for transport, kwargs in runs:
            cluster.renew(transport, **kwargs)
            result = cluster.sync(model)
            for receiver in result["receivers"]:
                assert [tuple(d) for d in receiver["digests"]] == expected, (transport, kwargs)
                assert receiver["metrics"]["fastsync/transfer/tensors"] == len(model)
            master, other = result["senders"]
            assert other["metrics"] == {}
            metrics = master["metrics"]
            for key in ("bytes", "buckets", "chunks", "seconds", "gbps", "peak_extra_bytes_sender"):
                assert f"fastsync/transfer/{key}" in metrics
            assert metrics["fastsync/transfer/tensors"] == len(model)
            bucket = metrics["fastsync/transfer/bucket_size"]
            slots = (kwargs.get("slots") or 3) if transport == "shm" else 2  # the others pipeline over two
            # shm: one spare segment more where the consumer's loop variable keeps a bucket lent
            spares = 1 if transport == "shm" else 0
            assert metrics["fastsync/transfer/peak_extra_bytes_sender"] <= (slots + spares) * bucket
            if transport == "shm":  # one segment per slot, whatever the consumer does
                assert metrics["fastsync/transfer/peak_extra_bytes_sender"] >= slots * bucket
        assert cluster.leaked_segments() == set()


def test_sender_metrics_shape_matches_release(engine_cls: Any) -> None:
    """``send_weights`` accepts ``global_steps`` on releases that pass it and works without it (0.7.1)."""
    params = inspect.signature(engine_cls.send_weights).parameters
    assert "global_steps" in params and params["global_steps"].default is None
    assert "global_steps" in inspect.signature(engine_cls.receive_weights).parameters
    assert TensorSpec("x", (1,)).dtype == "float32"
