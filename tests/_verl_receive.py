"""Rollout side of the failure-path tests, run inside a harness worker (``Cluster.post(i, "exec", ...)``):
verl's own ``CheckpointEngineWorker.update_weights`` method body (the release under test, with the
plugin installed as in a real worker) driving the ``fastsync`` engine into a server adapter that
fails like a vLLM/SGLang load error. Stand-ins (test only): the worker object is a namespace with
verl's two attributes (no Ray actor), and the adapter is :class:`FailingAdapter` (no vLLM process).

The event loop lives as long as the process, as a Ray async actor's does: nothing closes a receive
stream behind the test's back (``asyncio.run`` would, at its end).
"""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace
from typing import Any

from _transport_harness import digest  # type: ignore[import-not-found]

_LOOP: asyncio.AbstractEventLoop | None = None


def actor_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP


class LoadError(RuntimeError):
    """What the adapter raises: the shape of a rollout engine's load failure."""


class FailingAdapter:
    """verl's server adapter as ``update_weights`` sees it. ``fail_at``: raise while loading that
    tensor (0-based); ``stop_at``: return after that many tensors (an adapter that stopped early);
    ``hold``: keep every tensor until the end, then let go (SGLang batches); ``gc_at``: drop what the
    worker kept from an earlier failure and run a garbage-collection pass while loading that tensor."""

    def __init__(
        self,
        worker: Any,
        fail_at: int | None = None,
        stop_at: int | None = None,
        hold: bool = False,
        gc_at: int | None = None,
        stall_s: float = 0.0,
    ) -> None:
        self.worker = worker
        self.fail_at, self.stop_at, self.hold, self.gc_at, self.stall_s = (
            fail_at,
            stop_at,
            hold,
            gc_at,
            stall_s,
        )
        self.digests: list[Any] = []
        self.held: list[tuple[str, Any]] = []
        self.failed_at = 0.0

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        async for name, tensor in weights:
            index = len(self.digests)
            if index == self.gc_at:
                self.worker.kept = None  # the framework lets go of the earlier failure...
                gc.collect()  # ...and a collection runs in the middle of this sync
            if index == self.fail_at:
                if self.stall_s:
                    time.sleep(self.stall_s)  # a slow load: this rank stops progressing meanwhile
                self.failed_at = time.time()
                raise LoadError(f"load_weights failed on purpose at tensor {index} ({name})")
            if self.stop_at is not None and index >= self.stop_at:
                return
            if self.hold:
                self.held.append((name, tensor))
                self.digests.append(None)
            else:
                self.digests.append(digest(name, tensor))
            del tensor
        self.digests = [digest(n, t) for n, t in self.held] if self.hold else self.digests


def verl_update_weights(worker: Any, unwrapped: bool = False, **adapter: Any) -> dict[str, Any]:
    """Run verl's ``CheckpointEngineWorker.update_weights`` once on this rank's engine.
    ``unwrapped``: verl's method without the plugin's wrapper (what the plugin fixes), to build the
    state a stale stream leaves. The exception is kept on ``worker.kept`` (its traceback keeps the
    receive stream's frames alive, as a framework's error handling does)."""
    from verl_fastsync.verl.adapter import install_into_verl

    install_into_verl()
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    method = CheckpointEngineWorker.update_weights
    if unwrapped:
        method = method.__wrapped__
    server = FailingAdapter(worker, **adapter)
    worker.adapter = server
    this = SimpleNamespace(checkpoint_engine=worker.engine, server_adapter=server)
    try:
        actor_loop().run_until_complete(method(this, global_steps=1))
    except Exception as exc:
        worker.kept = exc
        return {
            "status": "err",
            "error": f"{type(exc).__name__}: {exc}",
            "failed_at": server.failed_at,
            "loaded": len(server.digests),
        }
    digests = server.digests
    held_metric = worker.engine.last_metrics.get("fastsync/transfer/consumer_held_bytes_receiver")
    server.held.clear()  # the adapter loaded the batch and lets go of it
    return {
        "status": "ok",
        "digests": digests,
        "metrics": dict(worker.engine.last_metrics),
        "held": held_metric,
    }
