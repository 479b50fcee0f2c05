"""Slot memory: what a ``("colocated", name)`` transport provides (POSIX shm, CUDA IPC)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import torch

from verl_fastsync.colocated.protocol import (
    ENV_ENABLE,
    ColocatedError,
    ColocatedProtocolError,
    IpcHandle,
    SlotDesc,
)
from verl_fastsync.io import shm
from verl_fastsync.io.fence import device_module

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# slot memory (what a colocated transport provides)
# ---------------------------------------------------------------------------------------------


class SlotMemory(Protocol):
    """Memory for the persistent slots: the object a ``("colocated", name)`` transport factory returns.

    ``device_resident`` is true when slots live in accelerator memory (the sender then fences on
    the device before each handover).
    """

    name: str
    device_resident: bool

    def allocate(self, index: int, nbytes: int) -> tuple[torch.Tensor, SlotDesc]:
        """Sender: a flat ``uint8`` slot of ``nbytes`` and its exportable description."""
        ...

    def release(self, desc: SlotDesc) -> None:
        """Sender: free a slot (the caller has dropped every reference to its tensor)."""
        ...

    def attach(self, desc: SlotDesc, device: torch.device) -> torch.Tensor:
        """Receiver: map a slot described by ``desc``; returns a flat ``uint8`` tensor."""
        ...

    def detach(self, desc: SlotDesc) -> None:
        """Receiver: drop the mapping (the caller has dropped every view into it)."""
        ...


def seal_slot(memory: SlotMemory, desc: SlotDesc) -> bool:
    """Sender, once the receiver mapped ``desc``: drop what lets another process attach it (the shm
    name). True when the slot can no longer be attached (a new receiver then needs new slots);
    optional for third-party slot memory (``seal(desc) -> bool``)."""
    seal = getattr(memory, "seal", None)
    return bool(seal(desc)) if callable(seal) else False


SHM_PREFIX = "verl_fastsync_"
"""Segment names are ``/verl_fastsync_<owner pid>_<128 random bits>`` (:mod:`verl_fastsync.io.shm`)."""


def sweep_dead_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink slot segments whose owner process no longer exists (a sender killed before the
    receiver attached); once per process, before its first allocation."""
    return shm.sweep_dead_segments(SHM_PREFIX, shm_dir)


class ShmSlotMemory:
    """POSIX shared-memory slots through the one segment helper (:mod:`verl_fastsync.io.shm`):
    mode 0600, random names, unlinked as soon as the receiver attached (:meth:`seal`)."""

    name = "shm"
    device_resident = False

    def __init__(self, **_: Any) -> None:
        self._segments: dict[str, shm.Segment] = {}

    def allocate(self, index: int, nbytes: int) -> tuple[torch.Tensor, SlotDesc]:
        segment = shm.Segment.create(nbytes, prefix=SHM_PREFIX)
        token = uuid.uuid4().hex[:16]
        self._segments[token] = segment
        assert segment.tensor is not None
        desc = SlotDesc(index=index, nbytes=nbytes, token=token, shm_name="/" + segment.name)
        return segment.tensor, desc

    def _drop(self, desc: SlotDesc) -> None:
        segment = self._segments.pop(desc.token, None)
        if segment is not None and not segment.close():
            # a view into the slot is still referenced (e.g. a callback kept a tensor): the mapping
            # goes with that last view. Never gc.collect() here.
            logger.warning("verl-fastsync: slot %d (%s) still has live views", desc.index, desc.shm_name)

    def release(self, desc: SlotDesc) -> None:
        try:
            self._drop(desc)
        finally:
            if desc.shm_name is not None:
                shm.unlink_quietly(desc.shm_name)

    def seal(self, desc: SlotDesc) -> bool:
        """Unlink the segment's name (both mappings stay valid): nothing is left in /dev/shm for a
        sender killed later, and no other process can attach the slot."""
        segment = self._segments.get(desc.token)
        if segment is not None:
            segment.unlink()
        return True

    def attach(self, desc: SlotDesc, device: torch.device) -> torch.Tensor:
        if desc.shm_name is None:
            raise ColocatedProtocolError(f"slot {desc.index} has no shared-memory name (transport mismatch)")
        try:
            segment = shm.Segment.attach(desc.shm_name, desc.nbytes)
        except shm.SegmentError as exc:
            raise ColocatedProtocolError(f"slot {desc.index}: {exc}") from None
        self._segments[desc.token] = segment
        assert segment.tensor is not None
        return segment.tensor

    def detach(self, desc: SlotDesc) -> None:
        self._drop(desc)


class IpcSlotMemory:
    """CUDA-IPC (or any torch device with ``_share_cuda_``) slots, exported once per allocation."""

    name = "ipc"
    device_resident = True

    def __init__(self, device_module: Any = None, device: torch.device | str | None = None, **_: Any) -> None:
        self._device_module = device_module
        self._device = torch.device(device) if device is not None else None
        self._tensors: dict[str, torch.Tensor] = {}

    def _module(self, device_type: str) -> Any:
        return self._device_module if self._device_module is not None else device_module(device_type)

    def device(self) -> torch.device:
        """The device slots are allocated on; a clear error where there is none with IPC."""
        if self._device is not None:
            return self._device
        try:
            from verl.utils.device import get_device_id, get_device_name

            device = torch.device(f"{get_device_name()}:{get_device_id()}")
        except Exception:
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        if device.type == "cpu" or (device.type == "cuda" and not torch.cuda.is_available()):
            raise ColocatedError(ipc_unavailable_message(device))
        return device

    def seal(self, desc: SlotDesc) -> bool:
        """Nothing to drop: a CUDA-IPC handle can be opened by a restarted receiver too."""
        return False

    def allocate(self, index: int, nbytes: int) -> tuple[torch.Tensor, SlotDesc]:
        from torch.multiprocessing.reductions import reduce_tensor

        device = self.device()
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # the allocation (and whatever last used this memory) must be done before another process
        # maps it: a handle exported while that work is queued races with it
        self._module(device.type).synchronize()
        _, args = reduce_tensor(tensor)
        # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
        #  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
        #  event_sync_required) - torch's rebuild_cuda_tensor arguments
        handle = IpcHandle(
            device=int(args[6]),
            handle=bytes(args[7]),
            storage_size_bytes=int(args[8]),
            storage_offset_bytes=int(args[9]),
            ref_counter_handle=bytes(args[11]),
            ref_counter_offset=int(args[12]),
            event_handle=None if args[13] is None else bytes(args[13]),
            event_sync_required=bool(args[14]),
        )
        token = uuid.uuid4().hex[:16]
        self._tensors[token] = tensor
        return tensor, SlotDesc(index=index, nbytes=nbytes, token=token, ipc=handle)

    def release(self, desc: SlotDesc) -> None:
        tensor = self._tensors.pop(desc.token, None)
        if tensor is not None:
            device_type = tensor.device.type
            del tensor
            module = self._module(device_type)
            if hasattr(module, "ipc_collect"):
                module.ipc_collect()

    def attach(self, desc: SlotDesc, device: torch.device) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if desc.ipc is None:
            raise ColocatedProtocolError(f"slot {desc.index} has no IPC handle (transport mismatch)")
        h = desc.ipc
        # the receiver's own device index: the two processes may see different CUDA_VISIBLE_DEVICES
        index = device.index if device.index is not None else h.device
        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            (desc.nbytes,),
            (1,),
            0,
            torch.storage.UntypedStorage,
            torch.uint8,
            index,
            h.handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            False,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle,
            h.event_sync_required,
        )
        self._tensors[desc.token] = tensor
        return tensor

    def detach(self, desc: SlotDesc) -> None:
        tensor = self._tensors.pop(desc.token, None)
        if tensor is not None:
            device_type = tensor.device.type
            del tensor
            module = self._module(device_type)
            if hasattr(module, "ipc_collect"):
                module.ipc_collect()


def ipc_unavailable_message(device: Any) -> str:
    return (
        f"colocated transport 'ipc' needs an accelerator with CUDA IPC, but this process has none "
        f"(device {device}, torch.cuda.is_available()={torch.cuda.is_available()}); use the colocated "
        f"transport 'shm' (+actor_rollout_ref.rollout.custom.fastsync.colocated_transport=shm and "
        f"{ENV_ENABLE}=shm)"
    )


def make_shm_memory(**kwargs: Any) -> ShmSlotMemory:
    """Factory registered as the ``("colocated", "shm")`` transport."""
    return ShmSlotMemory(**kwargs)


def make_ipc_memory(**kwargs: Any) -> IpcSlotMemory:
    """Factory registered as the ``("colocated", "ipc")`` transport."""
    return IpcSlotMemory(**kwargs)


MemoryFactory = Callable[..., SlotMemory]
"""A ``("colocated", name)`` transport factory: ``factory(**kwargs) -> SlotMemory``."""
TransportLookup = Callable[[str], MemoryFactory]
"""``lookup(name) -> factory``; raises for a name it does not know."""

_BUILTIN: dict[str, MemoryFactory] = {"ipc": make_ipc_memory, "shm": make_shm_memory}


def builtin_transport(name: str) -> MemoryFactory:
    """This package's own colocated transports: the lookup until :func:`use_transport_lookup` is called."""
    factory = _BUILTIN.get(name)
    if factory is None:
        raise ValueError(f"{ENV_ENABLE}={name!r}: unknown colocated transport; available: ipc, shm")
    return factory


_lookup: TransportLookup = builtin_transport


def use_transport_lookup(lookup: TransportLookup) -> None:
    """Resolve colocated transport names with ``lookup`` in this process.

    This package sits below the plugin registry (the registry registers its ``shm`` and ``ipc``), so it
    is handed the registry's lookup rather than importing it: the adapter passes
    :func:`verl_fastsync.selection.colocated_transport` when this module is imported, in every process
    that imports ``verl_fastsync`` (:func:`verl_fastsync.verl.adapter.install_into_verl`)."""
    global _lookup
    _lookup = lookup


def _resolve_memory(name: str, **kwargs: Any) -> SlotMemory:
    factory = _lookup(name)
    memory = factory(**kwargs)
    for attr in ("allocate", "release", "attach", "detach"):
        if not callable(getattr(memory, attr, None)):
            raise TypeError(
                f"colocated transport {name!r} returned {type(memory).__name__}, which lacks {attr}(); "
                f"a colocated transport factory must return a SlotMemory"
            )
    return memory  # type: ignore[no-any-return, unused-ignore]
