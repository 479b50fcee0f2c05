"""Driver side of the sync metrics: the workers' ``fastsync/*`` numbers into verl's step metrics.

A worker's colocated sync returns its metrics from ``update_weights`` where verl's own returns
``None`` (:mod:`verl_fastsync.verl.adapter`). verl's ``CheckpointEngineManager`` drops that value on
every release, so the driver captures the object refs of the workers' ``update_weights`` calls
(``CheckpointEngineManager.__init__`` wraps its worker group's method, :func:`patch_checkpoint_manager`)
and :class:`verl.utils.tracking.Tracking` ``.log`` merges their ``fastsync/*`` keys (mean over ranks)
into the next step's metrics (:func:`patch_tracking`): wandb, tensorboard, console, ... on every
release.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from verl_fastsync.verl.importhook import MARK, require

logger = logging.getLogger(__name__)


class _MetricsInbox:
    """Driver side: the pending results of the workers' ``update_weights`` calls, merged into the
    next ``Tracking.log``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Any] = []

    def add(self, refs: Any) -> None:
        with self._lock:
            self._pending.append(refs)

    def take(self) -> dict[str, float]:
        with self._lock:
            pending, self._pending = self._pending, []
        results: list[Any] = []
        for refs in pending:
            try:
                results.extend(_resolve(refs))
            except Exception as exc:  # a failed sync has already raised in verl's own ray.get
                logger.debug("verl-fastsync: no metrics from a failed update_weights: %r", exc)
        return merge_rank_metrics(results)


def _resolve(refs: Any) -> list[Any]:
    items = refs if isinstance(refs, list | tuple) else [refs]
    if any(type(item).__name__ == "ObjectRef" for item in items):
        import ray

        return list(ray.get(list(items), timeout=60))
    return list(items)


def merge_rank_metrics(results: list[Any]) -> dict[str, float]:
    """The mean over ranks of every ``fastsync/*`` number in the workers' results."""
    sums: dict[str, list[float]] = {}
    for result in results:
        if not isinstance(result, Mapping):
            continue
        for key, value in result.items():
            if isinstance(key, str) and key.startswith("fastsync/") and isinstance(value, int | float):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(values) / len(values) for key, values in sorted(sums.items())}


INBOX = _MetricsInbox()


def capture_worker_group(group: Any) -> None:
    """Wrap ``group.update_weights`` so the refs it returns reach :data:`INBOX`."""
    method = getattr(group, "update_weights", None)
    if method is None or getattr(method, MARK, False):
        return

    @functools.wraps(method)
    def update_weights(*args: Any, **kwargs: Any) -> Any:
        refs = method(*args, **kwargs)
        INBOX.add(refs)
        return refs

    setattr(update_weights, MARK, True)
    try:
        group.update_weights = update_weights
    except Exception as exc:  # a group that refuses attributes: metrics stay in the workers' logs
        logger.debug("verl-fastsync: cannot capture %r.update_weights: %r", group, exc)


def patch_checkpoint_manager(module: ModuleType) -> None:
    """``verl.checkpoint_engine.base``: the manager captures its trainer worker group."""
    cls = require(module, "CheckpointEngineManager", module.__name__)
    original = cls.__init__
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # 0.7.1/0.8.0 name the trainer's worker group `trainer`, 0.9.0+ `actor_wg`
        group = getattr(self, "actor_wg", None) or getattr(self, "trainer", None)
        if group is not None:
            capture_worker_group(group)

    setattr(__init__, MARK, True)
    cls.__init__ = __init__


def patch_tracking(module: ModuleType) -> None:
    """``verl.utils.tracking``: ``Tracking.log`` adds the pending ``fastsync/*`` metrics."""
    cls = require(module, "Tracking", module.__name__)
    original = require(cls, "log", f"{module.__name__}.Tracking")
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def log(self: Any, data: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        metrics = INBOX.take()
        if metrics and isinstance(data, Mapping):
            data = {**data, **{k: v for k, v in metrics.items() if k not in data}}
        return original(self, data, step, *args, **kwargs)

    setattr(log, MARK, True)
    cls.log = log
