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

Metrics of each sync (``fastsync/<boundary>/<field>``) go to one INFO log line per rank (logger
``verl_fastsync.verl.adapter``) and to :func:`last_sync_metrics`. No release carries the naive path's
return value back to the trainer (the managers return ``{}`` or nothing), so verl's own return
value is kept unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from verl_fastsync import cleanup, plugins
from verl_fastsync.config import FastsyncConfig, FastsyncConfigError, config_from_rollout, validate_names

logger = logging.getLogger(__name__)

ENGINE_WORKERS = "verl.workers.engine_workers"
LEGACY_WORKERS = ("verl.workers.fsdp_workers", "verl.workers.megatron_workers")
CHECKPOINT_ENGINE = "verl.checkpoint_engine"
BUCKETED_TRANSFER = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"

_STATE_ATTR = "_verl_fastsync_state"
_MARK = "__verl_fastsync_wrapped__"


# --------------------------------------------------------------------------------------------
# post-import hook


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the adapter's callbacks on the fresh module."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: Sequence[Callable[[ModuleType], None]]):
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_callbacks(module, self._callbacks)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._resolving = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        callbacks = self.callbacks.get(fullname)
        resolving: set[str] = self._resolving.__dict__.setdefault("names", set())
        if not callbacks or fullname in resolving:
            return None
        resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            resolving.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, callbacks)
        return spec


def _run_callbacks(module: ModuleType, callbacks: Sequence[Callable[[ModuleType], None]]) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception:  # a failed patch must never break verl: it runs unpatched
            logger.exception("verl-fastsync: patching %s failed; that part of verl runs unchanged", module)


_FINDER = _PostImportFinder()
_INSTALL_LOCK = threading.Lock()


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    _FINDER.callbacks.setdefault(module_name, []).append(callback)
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        _run_callbacks(module, [callback])


def install_into_verl() -> None:
    """Install the plugin (idempotent: the entry point and the env route may both call it)."""
    with _INSTALL_LOCK:
        if _FINDER in sys.meta_path:
            return
        sys.meta_path.insert(0, _FINDER)
        when_imported(ENGINE_WORKERS, _patch_engine_workers)
        for name in LEGACY_WORKERS:
            when_imported(name, _patch_legacy_workers)
        when_imported(CHECKPOINT_ENGINE, _register_checkpoint_engine)
        when_imported(BUCKETED_TRANSFER, _install_colocated)


# --------------------------------------------------------------------------------------------
# per-worker state and the sync scope


class WorkerState:
    """The fastsync config of one worker and its plugin manager, resolved once."""

    def __init__(self, config: FastsyncConfig):
        self.config = config
        self.pm = plugins.plugin_manager(tuple(config.disabled_plugins)) if config.enable else None
        if self.pm is not None:
            validate_names(config, self.pm)
        check_colocated_switch(config, os.environ)
        self.last_metrics: dict[str, float] = {}
        self.syncs = 0


def check_colocated_switch(config: FastsyncConfig, environ: Any) -> None:
    """The colocated transport must be switched on in the config *and* in every process's environment.

    verl's vLLM worker processes (the receivers) never see the config, so the switch they read is the
    environment variable ``VERL_FASTSYNC_COLOCATED``, which reaches every Ray actor through
    ``+ray_kwargs.ray_init.runtime_env.env_vars``. A trainer worker starting with only one of the two
    would hit a protocol mismatch at its first sync; it fails here instead, saying what to add.
    """
    wanted = config.colocated_transport if config.enable else None
    raw = environ.get("VERL_FASTSYNC_COLOCATED", "")
    if wanted is None and raw.strip().lower() in ("", "0", "false", "off", "no"):
        return
    from verl_fastsync.colocated import ENV_ENABLE, ENV_TIMEOUT, ENV_VERIFY, colocated_transport_name

    try:
        named = colocated_transport_name(use_shm=wanted == "shm", environ=environ)
    except ValueError as exc:
        raise FastsyncConfigError(str(exc)) from exc
    override = f"+ray_kwargs.ray_init.runtime_env.env_vars.{ENV_ENABLE}"
    if wanted is None:
        raise FastsyncConfigError(
            f"{ENV_ENABLE}={raw!r} switches verl's colocated transfer to fastsync, but "
            f"{config.key('colocated_transport')} is not set (or {config.key('enable')} is false); "
            f"set both or neither"
        )
    if named != wanted:
        raise FastsyncConfigError(
            f"{config.key('colocated_transport')}={wanted!r} needs {ENV_ENABLE}={wanted} in every verl "
            f"process (vLLM's workers see no config), but this process has {ENV_ENABLE}={raw!r}; "
            f"add {override}={wanted}"
        )
    environ.setdefault(ENV_TIMEOUT, str(config.timeout_s))
    if config.verify:
        environ[ENV_VERIFY] = "1"


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

    def _run(self, boundary: str) -> None:
        assert self.state.pm is not None
        name = getattr(self.state.config, boundary)
        policy = plugins.select_cleanup(self.state.pm, boundary, name, key=self.state.config.key(boundary))
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
            self._fastsync_scope.after_transfer()
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
    if state.config.colocated_transport is not None and "verl_fastsync.colocated" in sys.modules:
        state.last_metrics.update(sys.modules["verl_fastsync.colocated"].get_last_metrics("sender"))
    logger.info(
        "fastsync sync #%d (step %s): %s; replaced verl calls: %s",
        state.syncs,
        step,
        ", ".join(f"{r.boundary}={r.policy} {r.seconds * 1e3:.2f} ms gc={r.gc_ran}" for r in scope.records),
        scope.replaced_verl_calls or "none",
    )
    return result


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
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # Validate before verl builds anything: a bad value fails at worker start, not at the first sync.
        worker_config = kwargs.get("config", args[0] if args else None)
        state = WorkerState(config_from_rollout(_rollout_config(worker_config)))
        original(self, *args, **kwargs)
        self.__dict__[_STATE_ATTR] = state

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__  # type: ignore[misc]


def _wrap_sync_method(cls: type, name: str, naive_only: bool) -> None:
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state_of(self)
        if not state.config.enable or (naive_only and not _is_naive(self, args, kwargs)):
            return await original(self, *args, **kwargs)
        return await _run_sync(
            self, state, lambda: original(self, *args, **kwargs), _global_step(args, kwargs)
        )

    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _shim_module_globals(module: ModuleType) -> None:
    """Route the worker module's cleanup calls through the active sync scope (transparent outside)."""
    original_aggressive = getattr(module, "aggressive_empty_cache", None)
    if original_aggressive is not None and not getattr(original_aggressive, _MARK, False):

        @functools.wraps(original_aggressive)
        def aggressive_empty_cache(*args: Any, **kwargs: Any) -> Any:
            scope = _ACTIVE.get()
            if scope is None:
                return original_aggressive(*args, **kwargs)
            scope.verl_cleanup("aggressive_empty_cache")
            return None

        setattr(aggressive_empty_cache, _MARK, True)
        module.aggressive_empty_cache = aggressive_empty_cache  # type: ignore[attr-defined]

    original_device = getattr(module, "get_torch_device", None)
    if original_device is not None and not getattr(original_device, _MARK, False):

        @functools.wraps(original_device)
        def get_torch_device() -> Any:
            scope = _ACTIVE.get()
            device = _device()
            return device if scope is None else _DeviceProxy(device, scope)

        setattr(get_torch_device, _MARK, True)
        module.get_torch_device = get_torch_device  # type: ignore[attr-defined]


def _patch_engine_workers(module: ModuleType) -> None:
    cls = module.ActorRolloutRefWorker
    _shim_module_globals(module)
    _wrap_init(cls)
    _wrap_sync_method(cls, "update_weights", naive_only=True)


def _patch_legacy_workers(module: ModuleType) -> None:
    cls = getattr(module, "ActorRolloutRefWorker", None)
    if cls is None or not hasattr(cls, "rollout_mode"):  # 0.8.0+: no legacy colocated sync to wrap
        return
    _shim_module_globals(module)
    _wrap_init(cls)
    _wrap_sync_method(cls, "rollout_mode", naive_only=False)


def _register_checkpoint_engine(module: ModuleType) -> None:
    try:
        from verl_fastsync.verl.engine import register_engine
    except ImportError as exc:  # pragma: no cover - engine module optional while it is built
        logger.debug("verl-fastsync checkpoint engine not available: %s", exc)
        return
    register_engine()


def _install_colocated(module: ModuleType) -> None:
    try:
        from verl_fastsync.colocated import install_colocated
    except ImportError as exc:  # pragma: no cover
        logger.debug("verl-fastsync colocated transport not available: %s", exc)
        return
    install_colocated(module)
