"""The verl adapter: the one module that knows how verl 0.7.1, 0.8.0, 0.9.0 and 0.9.1 differ.

Nothing is patched at ``import verl_fastsync`` time. :func:`install_into_verl` registers a
post-import hook; when verl imports one of the modules below, the adapter patches it:

=============================================  =================================================
module                                         patch
=============================================  =================================================
``verl.workers.engine_workers``                ``ActorRolloutRefWorker.__init__`` (validate the
                                               config at worker start), ``.update_weights``
                                               (the colocated ``naive`` sync, every release),
                                               module globals ``aggressive_empty_cache`` and
                                               ``get_torch_device`` (transparent outside a sync)
``verl.workers.fsdp_workers``,                 0.7.1's legacy path: ``ActorRolloutRefWorker
``verl.workers.megatron_workers``              .rollout_mode`` (GRPO default there) + the same
                                               globals; later releases have no ``rollout_mode``
``verl.checkpoint_engine``                     registers the ``fastsync`` checkpoint engine
``verl.workers.rollout.vllm_rollout``          colocated sender/receiver substitution
``.bucketed_weight_transfer``
=============================================  =================================================

The same hook hands :mod:`verl_fastsync.colocated.memory` (not verl's) this process's plugin registry
as its transport lookup when it is imported: the colocated path sits below the registry, which
registers its built-in transports.

Where verl cleans up around the colocated sync, per release (line numbers of each wheel):

=========  ==================================================  ====================================
release    before ``resume(["weights"])``                      after transfer/offload
=========  ==================================================  ====================================
0.7.1      legacy fsdp: ``aggressive_empty_cache`` (start of   ``aggressive_empty_cache``
           ``rollout_mode``, and after QAT); engine path: none
0.8.0      none                                                ``aggressive_empty_cache``
0.9.0      ``aggressive_empty_cache(force_sync=True)``         ``aggressive_empty_cache``
0.9.1      ``get_torch_device().empty_cache()``                ``synchronize()`` + ``empty_cache()``,
                                                               then ``torch.distributed.barrier``
=========  ==================================================  ====================================

While a sync runs with ``fastsync.enable: true`` (a per-task context variable, so concurrent
coroutines of the same actor are unaffected) the adapter follows the sync's phases:

* ``pre``: verl's own cleanup calls are dropped. Right before ``rollout.resume(tags=["weights"])``
  - or the first ``rollout.update_weights`` when verl does not resume weights - the
  ``pre_resume_cleanup`` policy runs, once.
* ``transfer``: verl's first cleanup call after the transfer (``aggressive_empty_cache`` on
  0.7.1-0.9.0, the ``synchronize()`` on 0.9.1) is where ``post_transfer_cleanup`` runs, once: after
  the transfer and the actor offload, before the 0.9.1 barrier and before
  ``resume(tags=["kv_cache"])``. If verl made no such call, it runs before ``resume(["kv_cache"])``
  or at the end of the sync.
* ``post``: further cleanup calls of verl are dropped; ``synchronize()`` always passes through.

With ``enable`` false or absent every wrapper calls straight through: verl makes exactly its own
calls in its own order. ``aggressive_empty_cache`` at the end of ``init_model`` and the non-naive
checkpoint-engine path are never touched.

A device fence (``synchronize()`` on verl's real device module) always precedes
``resume(tags=["kv_cache"])``: verl's own fence at that boundary lived inside the cleanup call the
adapter replaces, and ``post_transfer_cleanup=none`` (or a third-party policy) must not lose it.

With ``enable: true`` a patch that could not be applied (verl changed) fails the worker at start,
naming the verl module and what was missing (:mod:`verl_fastsync.verl.importhook`); a vLLM worker
process with ``VERL_FASTSYNC_COLOCATED`` on fails its import of ``bucketed_weight_transfer`` the same
way, so a switched sender never faces an unswitched receiver.

Metrics of each sync (``fastsync/<boundary>/<field>``, and ``fastsync/colocated/*``) go to one INFO
log line per rank (logger ``verl_fastsync.verl.adapter``), to :func:`last_sync_metrics`, and are the
return value of the worker's naive ``update_weights`` where verl's own is ``None``; the driver side
merges them into the step metrics (:mod:`verl_fastsync.verl.metrics`).

The checks a worker runs at start (config vs environment vs patches) live in
:mod:`verl_fastsync.verl.startup`.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from verl_fastsync import cleanup, plugins, selection
from verl_fastsync.config import ENV_COLOCATED, FastsyncConfig, config_from_rollout
from verl_fastsync.verl import importhook, metrics, startup
from verl_fastsync.verl.importhook import MARK, PatchRequiredError, require, when_imported

logger = logging.getLogger(__name__)

ENGINE_WORKERS = "verl.workers.engine_workers"
LEGACY_WORKERS = ("verl.workers.fsdp_workers", "verl.workers.megatron_workers")
CHECKPOINT_ENGINE = "verl.checkpoint_engine"
CHECKPOINT_BASE = "verl.checkpoint_engine.base"
TRACKING = "verl.utils.tracking"
BUCKETED_TRANSFER = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
COLOCATED_MEMORY = "verl_fastsync.colocated.memory"
"""Not verl's: the colocated path, which sits below the plugin registry, gets this process's
registry as its transport lookup when it is imported (:func:`verl_fastsync.selection.wire_colocated`)."""
PATCHED_MODULES = (
    ENGINE_WORKERS,
    *LEGACY_WORKERS,
    CHECKPOINT_ENGINE,
    CHECKPOINT_BASE,
    TRACKING,
    BUCKETED_TRANSFER,
)

_STATE_ATTR = "_verl_fastsync_state"
_INSTALL_LOCK = threading.Lock()


def install_into_verl() -> None:
    """Install the plugin (idempotent: the entry point and the env route may both call it)."""
    with _INSTALL_LOCK:
        if not importhook.install_finder():
            return
        when_imported(ENGINE_WORKERS, _patch_engine_workers)
        for name in LEGACY_WORKERS:
            when_imported(name, _patch_legacy_workers)
        when_imported(CHECKPOINT_ENGINE, _register_checkpoint_engine)
        when_imported(CHECKPOINT_BASE, metrics.patch_checkpoint_manager)
        when_imported(CHECKPOINT_BASE, _patch_checkpoint_engine_worker)
        when_imported(TRACKING, metrics.patch_tracking)
        when_imported(BUCKETED_TRANSFER, _install_colocated)
        when_imported(COLOCATED_MEMORY, selection.wire_colocated)


# --------------------------------------------------------------------------------------------
# per-worker state and the sync scope


class WorkerState:
    """The fastsync config of one worker and its plugin registry, resolved (and checked) once."""

    def __init__(self, config: FastsyncConfig, environ: Any = None):
        environ = os.environ if environ is None else environ
        self.config = config
        self.registry: plugins.Registry | None = None
        if config.enable:
            startup.check_patches_applied(PATCHED_MODULES)
            startup.check_disabled_plugins(config, environ)
            self.registry = plugins.registry(config.disabled_plugins)
            selection.validate_names(config, self.registry)
        startup.check_colocated_switch(config, environ)
        self.last_metrics: dict[str, float] = {}
        self.syncs = 0


def _rollout_config(worker_config: Any) -> Any:
    if worker_config is None:
        return None
    return (
        worker_config.get("rollout")
        if hasattr(worker_config, "get")
        else getattr(worker_config, "rollout", None)
    )


def _state_of(worker: Any) -> WorkerState:
    state = worker.__dict__.get(_STATE_ATTR)
    if state is None:
        state = WorkerState(config_from_rollout(_rollout_config(getattr(worker, "config", None))))
        worker.__dict__[_STATE_ATTR] = state
    return state


def last_sync_metrics(worker: Any) -> dict[str, float]:
    """The ``fastsync/*`` metrics of the worker's most recent colocated sync (empty before one)."""
    state = worker.__dict__.get(_STATE_ATTR)
    return dict(state.last_metrics) if state is not None else {}


def _device() -> Any:
    from verl.utils.device import get_torch_device

    return get_torch_device()


class _SyncScope:
    def __init__(self, state: WorkerState, device: Any):
        self.state = state
        self.device = device
        self.phase = "pre"
        self.records: list[cleanup.PhaseRecord] = []
        self.replaced_verl_calls: list[str] = []
        self.fences = 0

    def _run(self, boundary: str) -> None:
        assert self.state.registry is not None
        name = getattr(self.state.config, boundary)
        policy = self.state.registry.cleanup_policy(boundary, name, key=self.state.config.key(boundary))
        self.records.append(cleanup.run_boundary(boundary, name, policy, self.device, self.state.config))

    def before_weights(self) -> None:
        if self.phase == "pre":
            self._run("pre_resume_cleanup")
            self.phase = "transfer"

    def after_transfer(self) -> None:
        if self.phase == "transfer":
            self._run("post_transfer_cleanup")
            self.phase = "post"

    def verl_cleanup(self, what: str) -> None:
        """verl wanted to clean up here: the policy of the boundary replaces it."""
        self.replaced_verl_calls.append(what)
        self.after_transfer()

    def verl_synchronize(self) -> None:
        self.after_transfer()

    def before_kv_cache(self) -> None:
        """The post-transfer boundary ends here at the latest, then a device fence: whatever the
        policy did, every copy of the transfer and the offload is complete before the KV cache is
        mapped back (verl's own fence lived inside the cleanup call fastsync replaced)."""
        self.after_transfer()
        self.device.synchronize()
        self.fences += 1

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for record in self.records:
            out.update(record.metrics())
        out["fastsync/sync/verl_cleanup_calls_replaced"] = float(len(self.replaced_verl_calls))
        return out


_ACTIVE: contextvars.ContextVar[_SyncScope | None] = contextvars.ContextVar(
    "verl_fastsync_sync", default=None
)


class _RolloutProxy:
    """Stands in for ``worker.rollout`` during a sync to see ``resume`` and ``update_weights``."""

    __slots__ = ("_fastsync_scope", "_fastsync_target")

    def __init__(self, target: Any, scope: _SyncScope):
        object.__setattr__(self, "_fastsync_target", target)
        object.__setattr__(self, "_fastsync_scope", scope)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fastsync_target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fastsync_target, name, value)

    async def resume(self, *args: Any, **kwargs: Any) -> Any:
        tags = kwargs.get("tags", args[0] if args else None) or ()
        if "weights" in tags:
            self._fastsync_scope.before_weights()
        if "kv_cache" in tags:
            self._fastsync_scope.before_kv_cache()
        return await self._fastsync_target.resume(*args, **kwargs)

    async def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        self._fastsync_scope.before_weights()
        return await self._fastsync_target.update_weights(*args, **kwargs)


class _DeviceProxy:
    """verl's device module as seen by the worker module during a sync."""

    def __init__(self, device: Any, scope: _SyncScope):
        self._device = device
        self._scope = scope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def empty_cache(self) -> None:
        self._scope.verl_cleanup("empty_cache")

    def synchronize(self, *args: Any, **kwargs: Any) -> Any:
        self._scope.verl_synchronize()
        return self._device.synchronize(*args, **kwargs)


async def _run_sync(worker: Any, state: WorkerState, call: Callable[[], Any], step: Any) -> Any:
    scope = _SyncScope(state, _device())
    token = _ACTIVE.set(scope)
    rollout = worker.__dict__.get("rollout")
    if rollout is not None:
        worker.__dict__["rollout"] = _RolloutProxy(rollout, scope)
    try:
        result = await call()
        scope.after_transfer()
    finally:
        if rollout is not None:
            worker.__dict__["rollout"] = rollout
        _ACTIVE.reset(token)
    state.syncs += 1
    state.last_metrics = scope.metrics()
    if state.config.colocated_transport is not None:
        state.last_metrics.update(_colocated_sender_metrics())
    logger.info(
        "fastsync sync #%d (step %s): %s; replaced verl calls: %s",
        state.syncs,
        step,
        ", ".join(f"{r.boundary}={r.policy} {r.seconds * 1e3:.2f} ms gc={r.gc_ran}" for r in scope.records),
        scope.replaced_verl_calls or "none",
    )
    # verl's naive path returns None; the metrics take its place so the driver can collect them
    return dict(state.last_metrics) if result is None else result


def _colocated_sender_metrics() -> dict[str, float]:
    import sys

    module = sys.modules.get("verl_fastsync.colocated")
    get = getattr(module, "get_last_metrics", None)
    return dict(get("sender")) if callable(get) else {}


# --------------------------------------------------------------------------------------------
# the patches


def _global_step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs.get("global_steps", args[0] if args else None)


def _is_naive(worker: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # 0.8.0+: update_weights(global_steps=None, mode="auto"); 0.7.1: update_weights(global_steps=None)
    mode = kwargs.get("mode", args[1] if len(args) > 1 else "auto")
    if mode == "auto":
        mode = worker.config.rollout.checkpoint_engine.backend
    return bool(mode == "naive")


def _wrap_init(cls: type) -> None:
    original = cls.__init__  # type: ignore[misc]
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # Validate before verl builds anything: a bad value fails at worker start, not at the first sync.
        worker_config = kwargs.get("config", args[0] if args else None)
        state = WorkerState(config_from_rollout(_rollout_config(worker_config)))
        original(self, *args, **kwargs)
        self.__dict__[_STATE_ATTR] = state

    setattr(__init__, MARK, True)
    cls.__init__ = __init__  # type: ignore[misc]


def _wrap_sync_method(cls: type, name: str, naive_only: bool) -> None:
    original = require(cls, name, f"{cls.__module__}.{cls.__qualname__}")
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state_of(self)
        if not state.config.enable or (naive_only and not _is_naive(self, args, kwargs)):
            return await original(self, *args, **kwargs)
        return await _run_sync(
            self, state, lambda: original(self, *args, **kwargs), _global_step(args, kwargs)
        )

    setattr(wrapper, MARK, True)
    setattr(cls, name, wrapper)


def _shim_module_globals(module: ModuleType) -> None:
    """Route the worker module's cleanup calls through the active sync scope (transparent outside)."""
    original_aggressive = getattr(module, "aggressive_empty_cache", None)
    if original_aggressive is not None and not getattr(original_aggressive, MARK, False):

        @functools.wraps(original_aggressive)
        def aggressive_empty_cache(*args: Any, **kwargs: Any) -> Any:
            scope = _ACTIVE.get()
            if scope is None:
                return original_aggressive(*args, **kwargs)
            scope.verl_cleanup("aggressive_empty_cache")
            return None

        setattr(aggressive_empty_cache, MARK, True)
        module.aggressive_empty_cache = aggressive_empty_cache  # type: ignore[attr-defined]

    original_device = getattr(module, "get_torch_device", None)
    if original_device is not None and not getattr(original_device, MARK, False):

        @functools.wraps(original_device)
        def get_torch_device() -> Any:
            scope = _ACTIVE.get()
            device = _device()
            return device if scope is None else _DeviceProxy(device, scope)

        setattr(get_torch_device, MARK, True)
        module.get_torch_device = get_torch_device  # type: ignore[attr-defined]


def _patch_engine_workers(module: ModuleType) -> None:
    cls = require(module, "ActorRolloutRefWorker", module.__name__)
    _wrap_init(cls)  # first: a later failure is then reported when the worker starts
    _shim_module_globals(module)
    _wrap_sync_method(cls, "update_weights", naive_only=True)


def _patch_legacy_workers(module: ModuleType) -> None:
    cls = getattr(module, "ActorRolloutRefWorker", None)
    if cls is None or not hasattr(cls, "rollout_mode"):  # 0.8.0+: no legacy colocated sync to wrap
        return
    _wrap_init(cls)
    _shim_module_globals(module)
    _wrap_sync_method(cls, "rollout_mode", naive_only=False)
    async_cls = getattr(module, "AsyncActorRolloutRefWorker", None)
    if async_cls is not None and "update_weights" in vars(async_cls):
        _wrap_legacy_update_weights(async_cls)


def _wrap_legacy_update_weights(cls: type) -> None:
    """0.7.1's legacy ``update_weights`` returns True after ``rollout_mode``: hand the metrics instead."""
    original = cls.update_weights  # type: ignore[attr-defined]
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        metrics = last_sync_metrics(self)
        return metrics if result is True and metrics else result

    setattr(update_weights, MARK, True)
    cls.update_weights = update_weights  # type: ignore[attr-defined]


def _register_checkpoint_engine(module: ModuleType) -> None:
    from verl_fastsync.verl.engine import register_engine

    register_engine()


def _patch_checkpoint_engine_worker(module: ModuleType) -> None:
    """``CheckpointEngineWorker.update_weights`` (every release) hands ``receive_weights()`` to the
    server adapter and lets its exception propagate without closing the stream: for the ``fastsync``
    engine, end the receive side in a ``finally`` so that the trainer hears of the failure at once
    (:meth:`~verl_fastsync.verl.engine.FastsyncCheckpointEngine.end_receive`). It is the only
    caller of an engine's ``receive_weights`` in verl 0.7.1-0.9.1 (the colocated path has its own
    receiver), so there is no other receive side to wrap."""
    cls = require(module, "CheckpointEngineWorker", module.__name__)
    original = require(cls, "update_weights", f"{module.__name__}.CheckpointEngineWorker")
    if getattr(original, MARK, False):
        return
    from verl_fastsync.verl.engine import FastsyncCheckpointEngine

    @functools.wraps(original)
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, FastsyncCheckpointEngine):
            return await original(self, *args, **kwargs)
        try:
            result = await original(self, *args, **kwargs)
        except BaseException as exc:
            await engine.end_receive(exc)
            raise
        await engine.end_receive(None)
        return result

    setattr(update_weights, MARK, True)
    cls.update_weights = update_weights


def _install_colocated(module: ModuleType) -> None:
    """Substitute verl's bucketed sender/receiver. In a process with ``VERL_FASTSYNC_COLOCATED`` on
    (a vLLM worker: the receiver) a failure fails the import itself: the sender is switched, so
    running verl's receiver would pair two protocols."""
    try:
        from verl_fastsync.colocated import install_colocated

        require(module, "BucketedWeightSender", module.__name__)
        require(module, "BucketedWeightReceiver", module.__name__)
        install_colocated(module)
    except Exception as exc:
        if str(os.environ.get(ENV_COLOCATED, "")).strip().lower() not in startup.OFF:
            raise PatchRequiredError(
                f"{ENV_COLOCATED}={os.environ.get(ENV_COLOCATED)!r} switches the colocated transfer to "
                f"fastsync, but {module.__name__} could not be patched ({type(exc).__name__}: {exc}); "
                f"refusing to run verl's own receiver against fastsync's sender"
            ) from exc
        raise
