"""Hook specifications of verl-fastsync (the contract third-party plugins implement).

Every hook *provides named implementations*: an implementation returns the mapping
``{name: implementation}`` of what its plugin provides (or ``None``/``{}`` for nothing), and the
host merges the mappings of every plugin (:mod:`verl_fastsync.plugins`). There is nothing to
append and nothing to forget:

* every name a plugin provides is listed in errors and by ``verl-fastsync doctor``;
* two third-party distributions providing one name is an error naming both distributions;
* a third-party name equal to a built-in one replaces the built-in, and doctor shows that it did;
* every returned object is type-checked once, when a process builds its registry (at worker start),
  in every process that uses it - not at the first weight sync.

The hooks are called once per process, when the registry is built, with keyword arguments only
(``weight_transport`` gets ``kind``; the cleanup hooks get nothing). An implementation may accept
fewer arguments than the spec names. Importing this module imports neither torch, cupy, nixl nor
verl.

Migrating from 0.1 (selection hooks ``(policy, available)`` / ``(name, kind, available)``): return
the mapping instead of appending to ``available`` and comparing the requested name, e.g.
``return {"twice": _empty_twice}``. A plugin still written in the 0.1 shape fails at start with an
error that says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from verl_fastsync import hookspec

if TYPE_CHECKING:
    from verl_fastsync.cleanup import CleanupPolicy
    from verl_fastsync.transports.base import TransportFactory


@hookspec
def pre_resume_cleanup() -> Mapping[str, CleanupPolicy] | None:
    """Cleanup policies for the boundary right before the rollout engine maps its weights back
    (``rollout.resume(tags=["weights"])``, or the first weight transfer when verl does not resume
    weights), after the trainer's last use of its training memory.

    Called by: the trainer worker process (verl's ``ActorRolloutRefWorker``) when it starts, and by
    ``verl-fastsync doctor`` and ``bench``.

    What a policy receives: one :class:`~verl_fastsync.cleanup.CleanupContext` (``boundary``,
    ``device`` = verl's ``get_torch_device()`` module, ``config`` = the run's
    :class:`~verl_fastsync.config.FastsyncConfig`); it must return a
    :class:`~verl_fastsync.cleanup.CleanupOutcome`. The selected policy
    (``custom.fastsync.pre_resume_cleanup``) runs exactly once per weight sync, replacing verl's own
    cleanup at this boundary.

    :return: ``{policy name: callable}`` for every policy this plugin provides (``None``: none).
        Results of all plugins are merged.
    """


@hookspec
def post_transfer_cleanup() -> Mapping[str, CleanupPolicy] | None:
    """Cleanup policies for the boundary after the weight transfer (and the actor offload, when
    enabled), before ``rollout.resume(tags=["kv_cache"])``; on verl 0.9.1 before verl's cross-rank
    barrier, never after it. A device fence (``synchronize()``) always precedes
    ``resume(["kv_cache"])`` whatever the policy does.

    Called by: the trainer worker process when it starts, and by ``verl-fastsync doctor`` and
    ``bench``.

    What a policy receives: one :class:`~verl_fastsync.cleanup.CleanupContext`, as for
    :func:`pre_resume_cleanup`; it returns a :class:`~verl_fastsync.cleanup.CleanupOutcome`. The
    selected policy (``custom.fastsync.post_transfer_cleanup``) runs exactly once per weight sync.

    :return: ``{policy name: callable}`` for every policy this plugin provides (``None``: none).
        Results of all plugins are merged.
    """


@hookspec
def weight_transport(kind: str) -> Mapping[str, TransportFactory] | None:
    """Transports that move weights from trainer to rollout, for one ``kind``.

    Called by: every process that builds a registry, once per kind, when it starts: the trainer
    worker (the sender of both kinds), verl's ``CheckpointEngineWorker`` (engine receiver), the
    driver's ``CheckpointEngineManager`` (``build_topology``), the vLLM worker processes (colocated
    receiver), ``verl-fastsync doctor`` and ``bench``.

    :param kind: ``"engine"`` (the ``fastsync`` checkpoint engine between separate trainer and
        rollout processes; selected by ``checkpoint_engine.engine_kwargs.fastsync.transport``) or
        ``"colocated"`` (trainer -> inference-engine workers on the same devices; selected by
        ``custom.fastsync.colocated_transport`` and ``VERL_FASTSYNC_COLOCATED``).
    :return: ``{transport name: factory}`` for every transport this plugin provides for ``kind``
        (``None``: none). What a factory receives:

        * ``kind="engine"``: ``factory(options: TransportOptions) -> EngineTransport`` (one instance
          per process, reused across syncs) and ``factory.build_topology(actor_world_size,
          rollout_world_size, metadata)``: an :class:`~verl_fastsync.transports.base.EngineTransport`
          subclass is such a factory. It may declare ``engine_options``: a mapping ``key ->
          validator(key, value) -> value`` of its own ``engine_kwargs.fastsync`` keys, which the
          worker and ``doctor`` validate with the same code.
        * ``kind="colocated"``: ``factory(device_module=...) -> SlotMemory`` (the slot memory of
          :mod:`verl_fastsync.colocated`).
    """
