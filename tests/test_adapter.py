"""The colocated sync of the real verl release, wrapped by the adapter, with recorded calls."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from _plugin_dist import write_plugin_dist
from _verl_fakes import (
    Events,
    FakeDevice,
    compose_config,
    engine_worker,
    fastsync_overrides,
    install_recorders,
    legacy_fsdp_worker,
    run,
    stub_gpu_only,
)

import verl_fastsync
from verl_fastsync import plugins
from verl_fastsync.config import FastsyncConfigError
from verl_fastsync.verl import adapter, importhook, metrics, startup

pytestmark = [pytest.mark.verl, pytest.mark.release, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def fresh_plugin_managers() -> Any:
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def ew(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = importlib.import_module("verl.workers.engine_workers")
    stub_gpu_only(monkeypatch, module)
    return module


def sync(ew: Any, monkeypatch: pytest.MonkeyPatch, overrides: list[str], stock: bool = False) -> Events:
    """Run the release's naive ``update_weights`` once and return the recorded calls."""
    events = Events()
    install_recorders(monkeypatch, events, FakeDevice(events))
    worker = engine_worker(ew, compose_config(overrides), events)
    method = ew.ActorRolloutRefWorker.update_weights
    run((method.__wrapped__ if stock else method)(worker, global_steps=3))
    assert worker.rollout.received == ["layer.weight", "layer.bias"]
    return events


def test_patched_on_import(ew: Any) -> None:
    assert getattr(ew.ActorRolloutRefWorker.update_weights, importhook.MARK)
    assert getattr(ew.ActorRolloutRefWorker.__init__, importhook.MARK)
    # verl's dispatch metadata survives the wrapper
    original = ew.ActorRolloutRefWorker.update_weights.__wrapped__
    assert vars(original).keys() - {"__wrapped__"} <= vars(ew.ActorRolloutRefWorker.update_weights).keys()


def test_install_twice_is_idempotent(ew: Any) -> None:
    before = ew.ActorRolloutRefWorker.update_weights
    verl_fastsync.install()
    adapter._patch_engine_workers(ew)
    assert ew.ActorRolloutRefWorker.update_weights is before
    assert sys.meta_path.count(importhook.FINDER) == 1


@pytest.mark.parametrize("overrides", [[], fastsync_overrides(enable=False)], ids=["absent", "disabled"])
def test_disabled_makes_stock_calls(ew: Any, monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> None:
    stock = sync(ew, monkeypatch, overrides, stock=True)
    assert sync(ew, monkeypatch, overrides) == stock
    assert stock.before("resume:weights", "transfer") and stock.before("transfer", "resume:kv_cache")


def test_light_no_gc_and_ordered(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stock = sync(ew, monkeypatch, [], stock=True)
    events = sync(ew, monkeypatch, fastsync_overrides(enable=True))
    assert "gc" not in events
    pre = events[: events.index("resume:weights")]
    assert pre == ["empty_cache"]
    post = events[events.index("transfer") : events.index("resume:kv_cache")]
    # synchronize + empty_cache after the offload
    offload = post.index("offload:cpu")
    assert post[offload + 1 : offload + 3] == ["synchronize", "empty_cache"]
    assert post.count("empty_cache") == 1
    # decided by what stock verl does (0.9.1 and later: a cross-rank barrier before the KV cache),
    # never by the version number: the policy runs before that barrier
    assert ("barrier" in post) is ("barrier" in stock)
    if "barrier" in post:
        assert post.index("empty_cache") < post.index("barrier")
    # verl's own cleanup calls were replaced, not added to
    assert events.count("empty_cache") <= max(stock.count("empty_cache"), 2)
    # and a device fence right before the KV cache comes back
    assert events[events.index("resume:kv_cache") - 1] == "synchronize"


def test_aggressive_collects_before_resume(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    events = sync(ew, monkeypatch, fastsync_overrides(enable=True, pre_resume_cleanup="aggressive"))
    pre = events[: events.index("resume:weights")]
    assert pre[:3] == ["gc", "empty_cache", "synchronize"]
    post = events[events.index("transfer") : events.index("resume:kv_cache")]
    assert "gc" not in post


def test_adaptive_collects_only_when_short(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = fastsync_overrides(enable=True, pre_resume_cleanup="adaptive", adaptive_headroom_gib=8)
    assert "gc" not in sync(ew, monkeypatch, overrides)
    events = Events()
    install_recorders(monkeypatch, events, FakeDevice(events, free_bytes=1 << 30))
    worker = engine_worker(ew, compose_config(overrides), events)
    run(ew.ActorRolloutRefWorker.update_weights(worker, global_steps=1))
    assert events[: events.index("resume:weights")] == ["empty_cache", "gc", "empty_cache"]
    metrics = adapter.last_sync_metrics(worker)
    assert metrics["fastsync/pre_resume_cleanup/gc_ran"] == 1.0
    assert metrics["fastsync/post_transfer_cleanup/gc_ran"] == 0.0


def test_hooks_run_once_per_sync_and_metrics(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    events = Events()
    install_recorders(monkeypatch, events, FakeDevice(events))
    worker = engine_worker(ew, compose_config(fastsync_overrides(enable=True)), events)
    for step in range(3):
        run(ew.ActorRolloutRefWorker.update_weights(worker, global_steps=step))
    assert events.count("resume:weights") == 3
    metrics = adapter.last_sync_metrics(worker)
    for boundary in ("pre_resume_cleanup", "post_transfer_cleanup"):
        for field in ("seconds", "reserved_freed_bytes", "allocated_freed_bytes", "gc_ran", "gc_collected"):
            assert f"fastsync/{boundary}/{field}" in metrics


def test_non_naive_path_untouched(
    ew: Any, monkeypatch: pytest.MonkeyPatch, verl_version: tuple[int, ...]
) -> None:
    events = Events()
    install_recorders(monkeypatch, events, FakeDevice(events))
    config = compose_config(fastsync_overrides(enable=True))
    worker = engine_worker(ew, config, events)
    sent: list[str] = []

    class Engine:
        async def send_weights(self, weights: Any, global_steps: Any = None) -> None:
            sent.extend(name for name, _ in weights)

    worker.checkpoint_engine = Engine()
    worker.config.rollout.checkpoint_engine.backend = "nccl"
    run(ew.ActorRolloutRefWorker.update_weights(worker, global_steps=1))
    assert sent == ["layer.weight", "layer.bias"] and events == []
    assert adapter.last_sync_metrics(worker) == {}


def test_invalid_config_fails_at_worker_start(ew: Any) -> None:
    config = compose_config(fastsync_overrides(enable=True, pre_resume_cleanup="turbo"))
    with pytest.raises(FastsyncConfigError) as info:
        ew.ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor_rollout")
    message = str(info.value)
    assert "actor_rollout_ref.rollout.custom.fastsync.pre_resume_cleanup='turbo'" in message
    assert "adaptive, aggressive, light, none" in message


def test_typo_key_fails_at_worker_start(ew: Any) -> None:
    config = compose_config(["+actor_rollout_ref.rollout.custom.fastsync.enabel=true"])
    with pytest.raises(
        FastsyncConfigError, match=r"fastsync\.enabel=True: unknown key; allowed keys: enable, "
    ):
        ew.ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")


THIRD_PARTY = """
    from verl_fastsync import hookimpl
    from verl_fastsync.cleanup import CleanupOutcome

    def _takeover(ctx):
        ctx.device.events.append("third-party:" + ctx.boundary)
        return CleanupOutcome()

    @hookimpl
    def pre_resume_cleanup():
        return {"light": _takeover}
"""


def test_third_party_entry_point_takes_over(ew: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_plugin_dist(tmp_path, "fastsync_takeover", THIRD_PARTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    events = sync(ew, monkeypatch, fastsync_overrides(enable=True))
    assert events[: events.index("resume:weights")] == ["third-party:pre_resume_cleanup"]
    # the other boundary keeps the built-in
    post = events[events.index("transfer") : events.index("resume:kv_cache")]
    assert "empty_cache" in post
    # blocking it restores the built-in; the block list must reach every process (environment)
    plugins.reset()
    overrides = [
        *fastsync_overrides(enable=True),
        "+actor_rollout_ref.rollout.custom.fastsync.disabled_plugins=[fastsync_takeover]",
    ]
    with pytest.raises(FastsyncConfigError, match="VERL_FASTSYNC_DISABLED_PLUGINS=fastsync_takeover"):
        sync(ew, monkeypatch, overrides)
    monkeypatch.setenv("VERL_FASTSYNC_DISABLED_PLUGINS", "fastsync_takeover")
    events = sync(ew, monkeypatch, overrides)
    assert events[: events.index("resume:weights")] == ["empty_cache"]


def test_raising_plugin_is_named(ew: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_plugin_dist(
        tmp_path,
        "fastsync_broken",
        """
        from verl_fastsync import hookimpl

        @hookimpl
        def post_transfer_cleanup():
            raise RuntimeError("boom")
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = compose_config(fastsync_overrides(enable=True))
    with pytest.raises(
        plugins.PluginHookError,
        match=r"plugin 'fastsync_broken' \(fastsync-broken 1.0\) raised in hook post_transfer_cleanup",
    ):
        ew.ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")


def test_legacy_fsdp_rollout_mode(monkeypatch: pytest.MonkeyPatch, verl_version: tuple[int, ...]) -> None:
    fsdp = (
        importlib.import_module("verl.workers.fsdp_workers")
        if importlib.util.find_spec("verl.workers.fsdp_workers")
        else None
    )
    if fsdp is None or not hasattr(fsdp.ActorRolloutRefWorker, "rollout_mode"):
        pytest.skip(f"verl {verl_version} has no legacy rollout_mode (0.7.1 only)")
    assert getattr(fsdp.ActorRolloutRefWorker.rollout_mode, importhook.MARK)
    stub_gpu_only(monkeypatch, fsdp)
    monkeypatch.setattr(fsdp, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp, "convert_weight_keys", lambda params, model: params)

    def legacy(overrides: list[str], stock: bool = False) -> Events:
        events = Events()
        install_recorders(monkeypatch, events, FakeDevice(events))
        worker = legacy_fsdp_worker(fsdp, compose_config(overrides), events)
        method = fsdp.ActorRolloutRefWorker.rollout_mode
        run((method.__wrapped__ if stock else method)(worker))
        assert worker.rollout.received == ["weight", "bias"]
        return events

    stock = legacy([], stock=True)
    assert legacy([]) == stock
    assert stock.index("gc") < stock.index("resume:weights")

    light = legacy(fastsync_overrides(enable=True))
    assert "gc" not in light
    assert light[: light.index("resume:weights")] == ["empty_cache"]
    post = light[light.index("transfer") : light.index("resume:kv_cache")]
    assert post == ["transfer", "synchronize", "empty_cache", "synchronize"]  # policy, then the fence

    aggressive = legacy(fastsync_overrides(enable=True, pre_resume_cleanup="aggressive"))
    assert aggressive.index("gc") < aggressive.index("resume:weights")


def test_cleanup_outside_a_sync_is_verls_own(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """init_model's aggressive_empty_cache (and any call outside a sync) reaches verl unchanged."""
    events = Events()
    device = FakeDevice(events)
    install_recorders(monkeypatch, events, device)
    ew.aggressive_empty_cache(force_sync=True)
    assert events[:3] == ["gc", "empty_cache", "synchronize"]
    if hasattr(ew, "get_torch_device"):  # 0.7.1's engine_workers does not import it
        assert ew.get_torch_device() is device


@pytest.mark.parametrize(
    ("config", "env", "error"),
    [
        ({"enable": True, "colocated_transport": "shm"}, {"VERL_FASTSYNC_COLOCATED": "shm"}, None),
        ({"enable": True, "colocated_transport": "shm"}, {"VERL_FASTSYNC_COLOCATED": "1"}, None),
        (
            {"enable": True, "colocated_transport": "ipc"},
            {"VERL_FASTSYNC_COLOCATED": "ipc"},
            "colocated_transport='ipc' selects CUDA IPC, which this worker cannot use "
            "(torch.cuda.is_available() is False); use colocated_transport=shm",
        ),
        (
            {"enable": True, "colocated_transport": "shm", "timeout_s": 30},
            {"VERL_FASTSYNC_COLOCATED": "shm"},
            "fastsync.timeout_s=30 must also bound vLLM's receivers, which read "
            "VERL_FASTSYNC_COLOCATED_TIMEOUT_S (this process has unset); add "
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FASTSYNC_COLOCATED_TIMEOUT_S=30",
        ),
        (
            {"enable": True, "colocated_transport": "shm", "timeout_s": 30},
            {"VERL_FASTSYNC_COLOCATED": "shm", "VERL_FASTSYNC_COLOCATED_TIMEOUT_S": "600"},
            "(this process has 600)",
        ),
        (
            {"enable": True, "colocated_transport": "shm", "timeout_s": 30},
            {"VERL_FASTSYNC_COLOCATED": "shm", "VERL_FASTSYNC_COLOCATED_TIMEOUT_S": "30"},
            None,
        ),
        (
            {"enable": True, "colocated_transport": "shm", "verify": True},
            {"VERL_FASTSYNC_COLOCATED": "shm"},
            None,
        ),
        ({"enable": True}, {}, None),
        ({"enable": False, "colocated_transport": "shm"}, {}, None),
        (
            {"enable": True, "colocated_transport": "shm"},
            {},
            "needs VERL_FASTSYNC_COLOCATED=shm in every verl process (vLLM's workers see no config), "
            "but this process has VERL_FASTSYNC_COLOCATED=''; add "
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FASTSYNC_COLOCATED=shm",
        ),
        (
            {"enable": True, "colocated_transport": "shm"},
            {"VERL_FASTSYNC_COLOCATED": "ipc"},
            "this process has VERL_FASTSYNC_COLOCATED='ipc'",
        ),
        ({"enable": True}, {"VERL_FASTSYNC_COLOCATED": "shm"}, "set both or neither"),
        (
            {"enable": False, "colocated_transport": "shm"},
            {"VERL_FASTSYNC_COLOCATED": "1"},
            "set both or neither",
        ),
        ({"enable": True, "colocated_transport": "shm"}, {"VERL_FASTSYNC_COLOCATED": "sh m"}, "is not valid"),
    ],
)
def test_colocated_switch_must_agree(config: dict[str, Any], env: dict[str, str], error: str | None) -> None:
    import torch

    from verl_fastsync.config import parse_fastsync_config

    if torch.cuda.is_available() and error is not None and "CUDA IPC" in error:
        pytest.skip("needs a host without CUDA")
    parsed = parse_fastsync_config(config)
    if error is None:
        startup.check_colocated_switch(parsed, env)
        if parsed.enable and parsed.colocated_transport:
            # this process sends: the named transport and the config's timeout, not setdefault
            assert env["VERL_FASTSYNC_COLOCATED"] == parsed.colocated_transport
            assert env["VERL_FASTSYNC_COLOCATED_TIMEOUT_S"] == str(parsed.timeout_s)
            assert env.get("VERL_FASTSYNC_COLOCATED_VERIFY") == ("1" if parsed.verify else None)
    else:
        with pytest.raises(FastsyncConfigError) as info:
            startup.check_colocated_switch(parsed, env)
        assert error in str(info.value)


@pytest.mark.parametrize("policy", ["none", "fence-free"])
def test_fence_before_kv_cache_whatever_the_policy(
    ew: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, policy: str
) -> None:
    """verl's own fence at the KV-cache boundary lived inside the cleanup fastsync replaces."""
    write_plugin_dist(
        tmp_path,
        "fastsync_fencefree",
        """
        from verl_fastsync import hookimpl
        from verl_fastsync.cleanup import CleanupOutcome

        @hookimpl
        def post_transfer_cleanup():
            return {"fence-free": lambda ctx: CleanupOutcome()}
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    events = sync(ew, monkeypatch, fastsync_overrides(enable=True, post_transfer_cleanup=policy))
    kv = events.index("resume:kv_cache")
    last_transfer = max(i for i, e in enumerate(events) if e in ("transfer", "offload:cpu"))
    assert "synchronize" in events[last_transfer:kv], events
    assert events[kv - 1] == "synchronize"


def test_failed_patch_fails_the_worker_at_start(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verl whose worker lacks what fastsync patches: never a silent stock run under enable=true."""
    import types

    fake = types.ModuleType("verl.workers.engine_workers")

    class ActorRolloutRefWorker:
        def __init__(self, config: Any, role: str) -> None:
            self.config = config

    fake.ActorRolloutRefWorker = ActorRolloutRefWorker  # type: ignore[attr-defined]
    monkeypatch.setattr(importhook, "FAILURES", {})
    importhook.run_callbacks(fake, [adapter._patch_engine_workers])
    assert "has no 'update_weights'" in importhook.FAILURES["verl.workers.engine_workers"]
    config = compose_config(fastsync_overrides(enable=True))
    with pytest.raises(FastsyncConfigError) as info:
        ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    message = str(info.value)
    assert "could not patch this verl release (verl.workers.engine_workers:" in message
    assert "ActorRolloutRefWorker has no 'update_weights'" in message
    # disabled: verl runs unchanged, no error
    ActorRolloutRefWorker(compose_config([]).actor_rollout_ref, "actor_rollout")


def test_colocated_patch_failure_fails_the_receiver_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM worker with the switch on must not fall back to verl's receiver."""
    import types

    monkeypatch.setattr(importhook, "FAILURES", {})
    changed = types.ModuleType(adapter.BUCKETED_TRANSFER)
    changed.BucketedWeightSender = object  # type: ignore[attr-defined]  # the receiver was renamed
    monkeypatch.setenv("VERL_FASTSYNC_COLOCATED", "shm")
    with pytest.raises(importhook.PatchRequiredError, match="refusing to run verl's own receiver"):
        importhook.run_callbacks(changed, [adapter._install_colocated])
    assert "has no 'BucketedWeightReceiver'" in importhook.FAILURES[adapter.BUCKETED_TRANSFER]
    monkeypatch.delenv("VERL_FASTSYNC_COLOCATED")
    importhook.run_callbacks(changed, [adapter._install_colocated])  # switch off: logged, verl unchanged


def test_metrics_reach_the_step_metrics(ew: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker return value -> driver-side capture -> Tracking.log, on the release's real classes."""
    import verl.checkpoint_engine.base as base
    from verl.utils.tracking import Tracking

    assert getattr(base.CheckpointEngineManager.__init__, importhook.MARK)
    assert getattr(Tracking.log, importhook.MARK)
    events = Events()
    install_recorders(monkeypatch, events, FakeDevice(events))
    workers = [engine_worker(ew, compose_config(fastsync_overrides(enable=True)), events) for _ in range(2)]

    class Group:  # the worker group verl's manager drives (ONE_TO_ALL -> one result per rank)
        def update_weights(self, global_steps: Any = None, **kwargs: Any) -> list[Any]:
            return [
                run(ew.ActorRolloutRefWorker.update_weights(w, global_steps=global_steps)) for w in workers
            ]

    group = Group()
    metrics.capture_worker_group(group)
    results = group.update_weights(global_steps=1)
    assert all(r["fastsync/pre_resume_cleanup/gc_ran"] == 0.0 for r in results)
    logged: list[dict[str, Any]] = []

    class Backend:
        def log(self, data: dict[str, Any], step: int) -> None:
            logged.append(dict(data))

    tracker = Tracking.__new__(Tracking)
    tracker.logger = {"console": Backend()}
    tracker.log(data={"actor/loss": 1.0}, step=1)
    tracker.log(data={"actor/loss": 2.0}, step=2)
    assert logged[0]["actor/loss"] == 1.0
    assert "fastsync/pre_resume_cleanup/seconds" in logged[0]
    assert logged[0]["fastsync/post_transfer_cleanup/gc_ran"] == 0.0
    assert not any(k.startswith("fastsync/") for k in logged[1])  # taken once


def test_merge_rank_metrics_means_numbers_only() -> None:
    merged = metrics.merge_rank_metrics(
        [{"fastsync/a": 1.0, "other": 5, "fastsync/b": "x"}, {"fastsync/a": 3}, None, True]
    )
    assert merged == {"fastsync/a": 2.0}
