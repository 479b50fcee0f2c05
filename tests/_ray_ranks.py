"""One trainer or rollout rank as a real Ray actor, for driving verl's own ``CheckpointEngineManager``:
the rank holds the ``fastsync`` engine (built as verl builds it, through ``_transport_harness``'s
worker) and answers ``execute_checkpoint_engine(method, **kwargs)`` as verl's workers do. The worker
group around the actors (:class:`RankGroup`) dispatches one call per rank, like verl's
``RayWorkerGroup`` does for that method; it is a stand-in for verl's worker classes (which need GPUs
and a model), not for Ray."""

from __future__ import annotations

from typing import Any

from _transport_harness import TensorSpec, _Worker  # type: ignore[import-not-found]


class Rank:
    def __init__(self, transport: str, ctor: dict[str, Any], role: str) -> None:
        self.worker = _Worker("engine", transport, ctor, role)
        self.worker.new()

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker.engine, method)(*args, **kwargs)

    def send(self, specs: list[TensorSpec], seed: int) -> dict[str, Any]:
        return self.worker.send(specs, seed, {})  # type: ignore[no-any-return]

    def receive(self) -> dict[str, Any]:
        return self.worker.receive({})  # type: ignore[no-any-return]


class RankGroup:
    """What ``CheckpointEngineManager.build_process_group`` uses of a worker group."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.world_size = len(handles)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list[Any]) -> list[Any]:
        return [
            handle.execute_checkpoint_engine.remote(
                method[i], **{key: values[i] for key, values in kwargs.items()}
            )
            for i, handle in enumerate(self.handles)
        ]
