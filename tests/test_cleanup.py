"""The built-in cleanup policies, and the guard that ``light`` never collects garbage."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from verl_fastsync import cleanup
from verl_fastsync.cleanup import CleanupContext, CleanupOutcome, run_boundary
from verl_fastsync.config import FastsyncConfig

GIB = 1 << 30


class Device:
    """A caching-allocator stand-in: ``empty_cache`` releases what is cached."""

    def __init__(self, cached: list[int], free: int = 100 * GIB, allocated: int = 5 * GIB):
        self.calls: list[str] = []
        self.cached = cached  # bytes released by successive empty_cache calls
        self.reserved = allocated + sum(cached)
        self.allocated = allocated
        self.free = free

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        if self.cached:
            self.reserved -= self.cached.pop(0)

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def memory_reserved(self) -> int:
        return self.reserved

    def memory_allocated(self) -> int:
        return self.allocated

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, 141 * GIB


@pytest.fixture
def gc_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = gc.collect

    def collect(*args: Any) -> int:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(gc, "collect", collect)
    return calls


def ctx(device: Device, boundary: str = "pre_resume_cleanup", **config: Any) -> CleanupContext:
    return CleanupContext(boundary=boundary, device=device, config=FastsyncConfig(enable=True, **config))


@pytest.mark.parametrize("boundary", ["pre_resume_cleanup", "post_transfer_cleanup"])
def test_light_never_collects_garbage(boundary: str, gc_calls: list[int]) -> None:
    """Guard: nobody may silently reintroduce gc.collect() into the light path."""
    device = Device(cached=[8 * GIB], free=0)  # even with no free memory at all
    outcome = cleanup.BUILTIN_POLICIES[boundary]["light"](ctx(device, boundary))
    assert gc_calls == [] and outcome == CleanupOutcome()
    expected = ["empty_cache"] if boundary == "pre_resume_cleanup" else ["synchronize", "empty_cache"]
    assert device.calls == expected


def test_aggressive_matches_verl_090_retry_rule(gc_calls: list[int]) -> None:
    # attempt 1 frees 8 GiB (retry), attempt 2 frees 2 GiB (retry), attempt 3 is the last one
    device = Device(cached=[8 * GIB, 2 * GIB, 3 * GIB, 4 * GIB])
    outcome = cleanup.aggressive(ctx(device))
    assert outcome.gc_ran and outcome.attempts == 3 and len(gc_calls) == 3
    assert device.calls == ["empty_cache", "synchronize"] * 3
    # an attempt freeing < 1 GiB stops the loop
    device = Device(cached=[GIB // 2])
    assert cleanup.aggressive(ctx(device)).attempts == 1


def test_adaptive_collects_only_below_headroom(gc_calls: list[int]) -> None:
    policy = cleanup.BUILTIN_POLICIES["pre_resume_cleanup"]["adaptive"]
    roomy = Device(cached=[GIB], free=10 * GIB)
    assert policy(ctx(roomy, adaptive_headroom_gib=4)) == CleanupOutcome()
    assert gc_calls == [] and roomy.calls == ["empty_cache"]
    tight = Device(cached=[GIB], free=GIB)
    outcome = policy(ctx(tight, adaptive_headroom_gib=4))
    assert outcome.gc_ran and gc_calls == [1] and tight.calls == ["empty_cache", "empty_cache"]


def test_adaptive_without_mem_info_does_not_collect(gc_calls: list[int]) -> None:
    class NoInfo(Device):
        def mem_get_info(self) -> tuple[int, int]:
            raise RuntimeError("no device")

    policy = cleanup.BUILTIN_POLICIES["post_transfer_cleanup"]["adaptive"]
    assert policy(ctx(NoInfo(cached=[]), "post_transfer_cleanup")) == CleanupOutcome()
    assert gc_calls == []


def test_none_does_nothing(gc_calls: list[int]) -> None:
    device = Device(cached=[GIB])
    assert cleanup.no_cleanup(ctx(device)) == CleanupOutcome()
    assert device.calls == [] and gc_calls == []


def test_run_boundary_traces_freed_bytes() -> None:
    device = Device(cached=[3 * GIB])
    record = run_boundary("pre_resume_cleanup", "light", cleanup.light_pre_resume, device, FastsyncConfig())
    assert record.reserved_freed_bytes == 3 * GIB and record.allocated_freed_bytes == 0
    assert record.seconds >= 0 and not record.gc_ran
    metrics = record.metrics()
    assert metrics["fastsync/pre_resume_cleanup/reserved_freed_bytes"] == 3 * GIB


def test_run_boundary_rejects_bad_policy_result() -> None:
    with pytest.raises(TypeError, match="cleanup policy 'mine' at pre_resume_cleanup returned None"):
        run_boundary("pre_resume_cleanup", "mine", lambda c: None, Device(cached=[]), FastsyncConfig())  # type: ignore[arg-type,return-value]
