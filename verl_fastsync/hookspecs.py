"""Hook specifications of verl-fastsync.

All three hooks are *selection* hooks (``firstresult=True``), in the style of pytest-xdist's
``pytest_xdist_make_scheduler``: the user names what they want in the config, every implementation
is asked in turn (third-party first; the built-ins are ``trylast``), and the first one that owns the
name returns the object that does the work. An implementation that does not own the name returns
``None``.

Each implementation also appends the names it owns to ``available``. When no implementation claims
the name, the caller has therefore seen every implementation and can raise an error that lists
every valid name (``verl-fastsync doctor`` uses the same call to list them).

Call these hooks with keyword arguments only. Importing this module imports neither torch, cupy nor
nixl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_fastsync import hookspec

if TYPE_CHECKING:
    from verl_fastsync.cleanup import CleanupPolicy
    from verl_fastsync.transports.base import TransportFactory


@hookspec(firstresult=True)
def pre_resume_cleanup(policy: str, available: list[str]) -> CleanupPolicy | None:
    """Select the device-memory cleanup run after the trainer's last use of its training memory,
    right before the rollout engine maps its weights back (``rollout.resume(tags=["weights"])``,
    or the first weight transfer when verl does not resume weights).

    Called once when the worker starts (to validate the config) and once per weight sync; the
    returned policy runs exactly once per sync and replaces verl's own cleanup at this boundary.

    :param policy: the policy name from ``custom.fastsync.pre_resume_cleanup``.
    :param available: append the names this implementation owns (even when returning ``None``).
    :return: a :class:`~verl_fastsync.cleanup.CleanupPolicy` callable if this implementation owns
        ``policy``, else ``None``. Stops at first non-None result, see firstresult.
    """


@hookspec(firstresult=True)
def post_transfer_cleanup(policy: str, available: list[str]) -> CleanupPolicy | None:
    """Select the device-memory cleanup run after the weight transfer (and the actor offload, when
    enabled), before ``rollout.resume(tags=["kv_cache"])``. On verl 0.9.1 it runs before verl's
    cross-rank barrier, never after it.

    Called once when the worker starts (to validate the config) and once per weight sync; the
    returned policy runs exactly once per sync and replaces verl's own cleanup at this boundary.

    :param policy: the policy name from ``custom.fastsync.post_transfer_cleanup``.
    :param available: append the names this implementation owns (even when returning ``None``).
    :return: a :class:`~verl_fastsync.cleanup.CleanupPolicy` callable if this implementation owns
        ``policy``, else ``None``. Stops at first non-None result, see firstresult.
    """


@hookspec(firstresult=True)
def weight_transport(name: str, kind: str, available: list[str]) -> TransportFactory | None:
    """Select the transport that moves weights from trainer to rollout.

    :param name: the transport name (``checkpoint_engine.engine_kwargs.fastsync.transport`` for the
        ``fastsync`` checkpoint engine, ``custom.fastsync.colocated_transport`` for colocated sync).
    :param kind: ``"engine"`` (between separate trainer and rollout processes, driven by verl's
        checkpoint-engine protocol) or ``"colocated"`` (trainer -> inference-engine workers on the
        same devices).
    :param available: append the names this implementation owns for ``kind``.
    :return: a :class:`~verl_fastsync.transports.base.TransportFactory` if this implementation
        owns ``name`` for ``kind``, else ``None``. Stops at first non-None result, see firstresult.
    """
