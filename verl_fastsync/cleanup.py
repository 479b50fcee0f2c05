"""Built-in device-memory cleanup policies and the phase trace around each boundary.

Why: verl 0.9.0 ran ``aggressive_empty_cache(force_sync=True)`` before resuming the rollout weights.
Its ``gc.collect()`` freed 0 device bytes yet cost 0.56-0.69 s per call (each retry another
0.55-0.63 s). The ``empty_cache()`` is what frees the 7.7-40.6 GiB per rank that the rollout needs.

Policies (the same names at both boundaries):

``light``      pre-resume: ``empty_cache()``; post-transfer: ``synchronize()`` + ``empty_cache()``
               (what verl 0.9.1 does). Never collects garbage.
``adaptive``   ``light``, then ``gc.collect()`` + ``empty_cache()`` only when the device's free memory
               is below ``adaptive_headroom_gib`` - the one case GC can help: unreachable Python
               cycles holding device tensors.
``aggressive`` verl 0.9.0's ``aggressive_empty_cache(force_sync=True)``: per attempt ``gc.collect()``,
               ``empty_cache()``, ``synchronize()``; up to 3 attempts while an attempt freed >= 1 GiB
               of reserved memory.
``none``       nothing.

A policy is a callable ``(CleanupContext) -> CleanupOutcome``. The caller (:func:`run_boundary`)
measures wall time and device-memory deltas, so a third-party policy only does the cleanup and says
whether it collected garbage.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from verl_fastsync import hookimpl

if TYPE_CHECKING:  # config sits above the policies (it imports the plugin registry)
    from verl_fastsync.config import FastsyncConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
AGGRESSIVE_MAX_ATTEMPTS = 3
AGGRESSIVE_RETRY_FREED_BYTES = GIB


@dataclasses.dataclass(frozen=True)
class CleanupContext:
    """What a policy gets: the boundary, verl's device module and the run's config."""

    boundary: str
    """``pre_resume_cleanup`` or ``post_transfer_cleanup``."""
    device: Any
    """The device module from ``verl.utils.device.get_torch_device()`` (torch.cuda, torch.npu, ...)."""
    config: FastsyncConfig


@dataclasses.dataclass(frozen=True)
class CleanupOutcome:
    """What a policy reports back."""

    gc_ran: bool = False
    gc_collected: int = 0
    attempts: int = 1


CleanupPolicy = Callable[[CleanupContext], CleanupOutcome]


def _reserved(device: Any) -> int:
    fn = getattr(device, "memory_reserved", None)
    try:
        return int(fn()) if fn is not None else 0
    except Exception:  # a device module without a caching allocator (CPU)
        return 0


def _allocated(device: Any) -> int:
    fn = getattr(device, "memory_allocated", None)
    try:
        return int(fn()) if fn is not None else 0
    except Exception:
        return 0


def _free_bytes(device: Any) -> int | None:
    fn = getattr(device, "mem_get_info", None)
    if fn is None:
        return None
    try:
        return int(fn()[0])
    except Exception:  # no device present / not initialised
        return None


def light_pre_resume(ctx: CleanupContext) -> CleanupOutcome:
    ctx.device.empty_cache()
    return CleanupOutcome()


def light_post_transfer(ctx: CleanupContext) -> CleanupOutcome:
    ctx.device.synchronize()
    ctx.device.empty_cache()
    return CleanupOutcome()


def aggressive(ctx: CleanupContext) -> CleanupOutcome:
    collected = 0
    attempts = 0
    while attempts < AGGRESSIVE_MAX_ATTEMPTS:
        attempts += 1
        before = _reserved(ctx.device)
        collected += gc.collect()
        ctx.device.empty_cache()
        ctx.device.synchronize()
        if before - _reserved(ctx.device) < AGGRESSIVE_RETRY_FREED_BYTES:
            break
    return CleanupOutcome(gc_ran=True, gc_collected=collected, attempts=attempts)


def _adaptive(light: CleanupPolicy) -> CleanupPolicy:
    def adaptive(ctx: CleanupContext) -> CleanupOutcome:
        light(ctx)
        free = _free_bytes(ctx.device)
        if free is None or free >= ctx.config.adaptive_headroom_gib * GIB:
            return CleanupOutcome()
        collected = gc.collect()
        ctx.device.empty_cache()
        return CleanupOutcome(gc_ran=True, gc_collected=collected)

    return adaptive


def no_cleanup(ctx: CleanupContext) -> CleanupOutcome:
    return CleanupOutcome()


BUILTIN_POLICIES: dict[str, dict[str, CleanupPolicy]] = {
    "pre_resume_cleanup": {
        "light": light_pre_resume,
        "adaptive": _adaptive(light_pre_resume),
        "aggressive": aggressive,
        "none": no_cleanup,
    },
    "post_transfer_cleanup": {
        "light": light_post_transfer,
        "adaptive": _adaptive(light_post_transfer),
        "aggressive": aggressive,
        "none": no_cleanup,
    },
}


@hookimpl
def pre_resume_cleanup() -> Mapping[str, CleanupPolicy]:
    return BUILTIN_POLICIES["pre_resume_cleanup"]


@hookimpl
def post_transfer_cleanup() -> Mapping[str, CleanupPolicy]:
    return BUILTIN_POLICIES["post_transfer_cleanup"]


@dataclasses.dataclass(frozen=True)
class PhaseRecord:
    """The phase trace of one boundary of one sync."""

    boundary: str
    policy: str
    seconds: float
    reserved_freed_bytes: int
    allocated_freed_bytes: int
    gc_ran: bool
    gc_collected: int
    attempts: int

    def metrics(self) -> dict[str, float]:
        """``fastsync/<boundary>/<field>`` metrics (numbers only, as verl's trackers want)."""
        prefix = f"fastsync/{self.boundary}"
        return {
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/reserved_freed_bytes": float(self.reserved_freed_bytes),
            f"{prefix}/allocated_freed_bytes": float(self.allocated_freed_bytes),
            f"{prefix}/gc_ran": float(self.gc_ran),
            f"{prefix}/gc_collected": float(self.gc_collected),
            f"{prefix}/attempts": float(self.attempts),
        }


def run_boundary(
    boundary: str, policy_name: str, policy: CleanupPolicy, device: Any, config: FastsyncConfig
) -> PhaseRecord:
    """Run ``policy`` once at ``boundary`` and trace it."""
    reserved, allocated = _reserved(device), _allocated(device)
    start = time.perf_counter()
    outcome = policy(CleanupContext(boundary=boundary, device=device, config=config))
    seconds = time.perf_counter() - start
    if not isinstance(outcome, CleanupOutcome):
        raise TypeError(
            f"cleanup policy {policy_name!r} at {boundary} returned {outcome!r}; "
            "a policy must return a verl_fastsync.cleanup.CleanupOutcome"
        )
    return PhaseRecord(
        boundary=boundary,
        policy=policy_name,
        seconds=seconds,
        reserved_freed_bytes=reserved - _reserved(device),
        allocated_freed_bytes=allocated - _allocated(device),
        gc_ran=outcome.gc_ran,
        gc_collected=outcome.gc_collected,
        attempts=outcome.attempts,
    )
