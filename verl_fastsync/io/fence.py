"""One device fence: wait until every copy that touched a buffer is complete before the buffer is
handed over (sent, checksummed, announced to a peer, or released to be refilled).

Host-to-host copies are synchronous (:func:`verl_fastsync.chunks.copy_bytes` is a plain memcpy), so a
fence over host memory only is free. Any copy that involves an accelerator is issued
``non_blocking`` on the current stream; that includes a device tensor copied into *pinned host
memory*, which returns before the bytes are there. :class:`DeviceFence` remembers every device a
copy touched (source and destination) and :meth:`DeviceFence.wait` synchronizes each of them.

Imports torch only (no verl): the device module is ``torch.<device type>`` (``torch.cuda``,
``torch.npu`` once ``torch_npu`` is imported, ...).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceFence", "device_module", "synchronize_device"]


def device_module(device_type: str) -> Any:
    """``torch.<device_type>`` (e.g. ``torch.cuda``); raises ``RuntimeError`` when torch has none."""
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "synchronize"):
        raise RuntimeError(f"torch has no device module with synchronize() for device type {device_type!r}")
    return module


def synchronize_device(device: torch.device) -> None:
    """Block until all work queued on ``device`` is complete (no-op for the CPU)."""
    if device.type == "cpu":
        return
    module = device_module(device.type)
    if device.index is None:
        module.synchronize()
    else:
        module.synchronize(device)


class DeviceFence:
    """The devices a set of copies touched, and one wait for all of them.

    Usage: ``fence.note(src, dst)`` after each (possibly asynchronous) copy; ``fence.wait()`` before
    the destination is handed over. ``wait`` clears the set, so one fence serves bucket after bucket.
    """

    def __init__(self) -> None:
        self._devices: set[torch.device] = set()

    def note(self, *tensors: torch.Tensor) -> None:
        """Record the devices of the tensors a copy read or wrote."""
        for tensor in tensors:
            if tensor.device.type != "cpu":
                self._devices.add(tensor.device)

    @property
    def pending(self) -> bool:
        """True when some noted copy involved a device (``wait`` would synchronize)."""
        return bool(self._devices)

    def wait(self) -> None:
        """Synchronize every noted device, then forget them."""
        devices, self._devices = self._devices, set()
        for device in devices:
            synchronize_device(device)
