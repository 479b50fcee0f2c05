"""``bucket_bytes=auto``: the size of one lane's bucket from the model's size, the number of lanes
and every participating rank's free memory (the rule is documented with the engine's keys in
:mod:`verl_fastsync.verl.engine`)."""

from __future__ import annotations

import torch

from verl_fastsync.limits import host_memory_available

__all__ = [
    "AUTO_CAP",
    "AUTO_DIVISOR",
    "AUTO_FIRST",
    "AUTO_FLOOR",
    "AUTO_FRACTION",
    "free_memory_bytes",
    "resolve_auto_bucket_size",
]

AUTO_FRACTION = 0.05
"""``bucket_bytes=auto``: one bucket is at most this fraction of the smallest free memory."""
AUTO_FLOOR = 16 << 20
"""``auto`` never goes below 16 MiB; a rank with less than ``AUTO_FLOOR / AUTO_FRACTION`` free fails."""
AUTO_CAP = 512 << 20
"""``auto`` never goes above 512 MiB."""
AUTO_DIVISOR = 16
"""``auto``: one bucket is the model's bytes divided by this (clamped to [floor, cap])."""
AUTO_FIRST = 64 << 20
"""``auto`` before the first sync, when the model's size is not known yet."""


def free_memory_bytes(device: str) -> int:
    """Free memory where buckets live: the accelerator's free memory for a device, else host
    ``MemAvailable``."""
    dev = torch.device(device)
    if dev.type != "cpu":
        from verl.utils.device import get_torch_device

        free, _total = get_torch_device().mem_get_info(dev)
        return int(free)
    return host_memory_available()


def resolve_auto_bucket_size(
    free_bytes: list[tuple[str, int]] | list[tuple[str, int, int]],
    model_bytes: int | None = None,
    lanes: int = 1,
) -> int:
    """The ``auto`` bucket size of one lane for ``[(rank label, free bytes[, lanes it holds buckets
    of]), ...]`` (one lane where not given), the model's size in bytes (``None``: not known yet) and
    the number of lanes (senders); see the module docstring."""
    if not free_bytes:
        raise ValueError("bucket_bytes=auto: no participating rank reported its free memory")
    if lanes < 1:
        raise ValueError(f"bucket_bytes=auto: lanes must be >= 1, got {lanes}")
    budgets = [(item[0], int(item[1]), int(item[2]) if len(item) > 2 else 1) for item in free_bytes]
    label, smallest, held = min(budgets, key=lambda item: item[1] // max(item[2], 1))
    by_memory = int(smallest * AUTO_FRACTION / max(held, 1)) // (1 << 20) * (1 << 20)
    if by_memory < AUTO_FLOOR:
        per = f" for the buckets of {held} lanes" if held > 1 else ""
        raise ValueError(
            f"bucket_bytes=auto: {label} has only {smallest / 2**20:.0f} MiB free{per}; auto needs at "
            f"least {held * AUTO_FLOOR / AUTO_FRACTION / 2**20:.0f} MiB ({AUTO_FRACTION:.0%} of it per "
            f"bucket, floor {AUTO_FLOOR >> 20} MiB a lane); set an explicit bucket_bytes"
        )
    if model_bytes is None or model_bytes <= 0:
        by_model = AUTO_FIRST
    else:
        by_model = -(-model_bytes // AUTO_DIVISOR)
        by_model = -(-by_model // (1 << 20)) * (1 << 20)  # whole MiB, rounded up
    by_model = min(max(by_model, AUTO_FLOOR), AUTO_CAP)
    # the K lanes of a rollout rank together hold about one sender's buckets
    per_lane = max(-(-by_model // lanes // (1 << 20)) * (1 << 20), AUTO_FLOOR)
    return min(per_lane, by_memory)
