"""Test doubles for what cannot exist here (a GPU, a rollout engine), recording every call.

The worker itself is verl's real class, its config is composed by Hydra from the release's own
``ppo_trainer`` config, and the method under test is the release's real ``update_weights`` /
``rollout_mode`` body (the pattern of verl's ``tests/checkpoint_engine/test_global_steps_on_cpu.py``).
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

GIB = 1 << 30
_REAL_COLLECT = gc.collect  # captured once: recorders installed twice in a test must not chain


class Events(list[str]):
    def before(self, first: str, second: str) -> bool:
        return self.index(first) < self.index(second)


class FakeDevice:
    """A device module (like torch.cuda) that records cleanup calls."""

    def __init__(self, events: Events, free_bytes: int = 80 * GIB):
        self.events = events
        self.free_bytes = free_bytes

    def empty_cache(self) -> None:
        self.events.append("empty_cache")

    def synchronize(self) -> None:
        self.events.append("synchronize")

    def is_available(self) -> bool:
        return True

    def memory_reserved(self) -> int:
        return 0

    def memory_allocated(self) -> int:
        return 0

    def mem_get_info(self) -> tuple[int, int]:
        return self.free_bytes, 141 * GIB


class FakeRollout:
    def __init__(self, events: Events):
        self.events = events
        self.received: list[str] = []

    async def resume(self, tags: list[str]) -> None:
        self.events.append("resume:" + ",".join(tags))

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        if hasattr(weights, "__aiter__"):
            self.received.extend([name async for name, _ in weights])
        else:
            self.received.extend(name for name, _ in weights)
        self.events.append("transfer")


class FakeTrainEngine:
    is_param_offload_enabled = True

    def __init__(self, events: Events):
        self.events = events

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterable[tuple[str, torch.Tensor]], None]:
        return iter([("layer.weight", torch.ones(4)), ("layer.bias", torch.zeros(2))]), None

    def to(self, device: str, **kwargs: Any) -> None:
        self.events.append(f"offload:{device}")


def compose_config(overrides: list[str]) -> Any:
    """The release's own ``ppo_trainer`` config composed by Hydra with ``overrides``."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def fastsync_overrides(**values: Any) -> list[str]:
    out = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"+actor_rollout_ref.rollout.custom.fastsync.{key}={text}")
    return out


def install_recorders(monkeypatch: pytest.MonkeyPatch, events: Events, device: FakeDevice) -> None:
    """Send verl's device, GC and barrier calls to ``events``."""
    import verl.utils.device
    import verl.utils.memory_utils

    monkeypatch.setattr(verl.utils.device, "get_torch_device", lambda: device)
    monkeypatch.setattr(verl.utils.memory_utils, "get_torch_device", lambda: device)

    def collect(*args: Any) -> int:
        events.append("gc")
        return _REAL_COLLECT(*args)

    monkeypatch.setattr(gc, "collect", collect)
    if torch.distributed.is_available():
        monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: events.append("barrier"))


def stub_gpu_only(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> None:
    """Allocator settings only exist with a CUDA/NPU device: make them no-ops in a worker module."""
    if hasattr(module, "set_expandable_segments"):
        monkeypatch.setattr(module, "set_expandable_segments", lambda enable: None)
    if hasattr(module, "log_gpu_memory_usage"):  # reads torch.cuda.mem_get_info directly
        monkeypatch.setattr(module, "log_gpu_memory_usage", lambda *args, **kwargs: None)


def engine_worker(module: ModuleType, config: Any, events: Events) -> Any:
    """verl's real engine ActorRolloutRefWorker, built without Ray, with fake device-side parts."""
    cls = module.ActorRolloutRefWorker
    worker = cls.__new__(cls)
    worker.config = config.actor_rollout_ref
    worker.rollout = FakeRollout(events)
    worker.actor = SimpleNamespace(engine=FakeTrainEngine(events))
    worker.layered_summon = False
    worker.peft_merge = False
    worker.base_sync_done = True
    return worker


def legacy_fsdp_worker(module: ModuleType, config: Any, events: Events) -> Any:
    """0.7.1's legacy FSDP ActorRolloutRefWorker (``rollout_mode``), without Ray or FSDP."""
    cls = module.ActorRolloutRefWorker
    worker = cls.__new__(cls)
    worker.config = config.actor_rollout_ref
    worker.rollout = FakeRollout(events)
    worker.actor_module_fsdp = torch.nn.Linear(2, 2)
    worker._is_offload_param = False
    worker._qat_enabled = False
    worker.layered_summon = False
    worker.base_sync_done = True
    return worker


def run(coro: Any) -> Any:
    return asyncio.run(coro)
