"""Slot memory: what a ``("colocated", name)`` transport provides (POSIX shm, CUDA IPC)."""

from __future__ import annotations

import logging
import mmap
import os
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

logger = logging.getLogger(__name__)


def _device_module(device_type: str) -> Any:
    """The torch device module for ``device_type`` (verl's ``get_torch_device()`` when present)."""
    try:
        from verl.utils.device import get_device_name, get_torch_device
    except Exception:  # verl absent (GPU check machine) or not importable here
        return getattr(torch, device_type)
    if get_device_name() == device_type:
        return get_torch_device()
    return getattr(torch, device_type)


def _fence(module: Any) -> None:
    """Wait until the work queued on the current stream (our copies) is done."""
    event_cls = getattr(module, "Event", None)
    if event_cls is not None:
        try:
            event = event_cls()
            event.record()
            event.synchronize()
            return
        except Exception:  # a device module whose Event cannot be recorded here
            pass
    module.synchronize()


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


def _shm_funcs() -> tuple[Callable[..., int], Callable[[str], None]]:
    import _posixshmem  # CPython's POSIX shm module (what multiprocessing.shared_memory uses)

    return _posixshmem.shm_open, _posixshmem.shm_unlink


class ShmSlotMemory:
    """POSIX shared-memory slots (``/dev/shm``), mode 0600.

    Mapped with ``mmap`` directly rather than ``multiprocessing.shared_memory``: attaching through
    the latter registers the segment with the attaching process's resource tracker, which unlinks it
    when *that* process exits (python 3.11), i.e. under the owner's feet.
    """

    name = "shm"
    device_resident = False

    def __init__(self, **_: Any) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def _map(self, shm_name: str, nbytes: int, create: bool) -> mmap.mmap:
        shm_open, shm_unlink = _shm_funcs()
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = shm_open(shm_name, flags, 0o600)
        try:
            if create:
                try:
                    os.ftruncate(fd, nbytes)
                except OSError:
                    shm_unlink(shm_name)
                    raise
            elif os.fstat(fd).st_size < nbytes:
                raise ColocatedProtocolError(
                    f"shared-memory segment {shm_name!r} has {os.fstat(fd).st_size} bytes, the sender "
                    f"announced {nbytes}"
                )
            return mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def allocate(self, index: int, nbytes: int) -> tuple[torch.Tensor, SlotDesc]:
        sweep_dead_segments()
        token = uuid.uuid4().hex[:16]
        shm_name = f"/{SHM_PREFIX}{os.getpid()}_{token}_{index}"
        mm = self._map(shm_name, nbytes, create=True)
        self._maps[token] = mm
        desc = SlotDesc(index=index, nbytes=nbytes, token=token, shm_name=shm_name)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), desc

    def release(self, desc: SlotDesc) -> None:
        mm = self._maps.pop(desc.token, None)
        try:
            if mm is not None:
                _close_map(mm, desc)
        finally:
            if desc.shm_name is not None:
                try:
                    _shm_funcs()[1](desc.shm_name)
                except FileNotFoundError:
                    pass

    def seal(self, desc: SlotDesc) -> bool:
        """Unlink the segment's name (both mappings stay valid): nothing is left in /dev/shm for a
        sender killed later, and no other process can attach the slot."""
        if desc.shm_name is not None:
            try:
                _shm_funcs()[1](desc.shm_name)
            except FileNotFoundError:
                pass
        return True

    def attach(self, desc: SlotDesc, device: torch.device) -> torch.Tensor:
        if desc.shm_name is None:
            raise ColocatedProtocolError(f"slot {desc.index} has no shared-memory name (transport mismatch)")
        mm = self._map(desc.shm_name, desc.nbytes, create=False)
        self._maps[desc.token] = mm
        return torch.frombuffer(mm, dtype=torch.uint8, count=desc.nbytes)

    def detach(self, desc: SlotDesc) -> None:
        mm = self._maps.pop(desc.token, None)
        if mm is not None:
            _close_map(mm, desc)


SHM_PREFIX = "verl_fastsync_"
"""Segment names are ``/verl_fastsync_<owner pid>_<token>_<slot>``."""

_SWEPT = False


def sweep_dead_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink slot segments whose owner process no longer exists (a sender killed before its
    ``atexit`` ran). Runs once per process, before its first allocation; returns what it removed.
    A receiver that still maps such a segment keeps its mapping (only the name goes)."""
    global _SWEPT
    if _SWEPT:
        return []
    _SWEPT = True
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        owner = name[len(SHM_PREFIX) :].split("_", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
            continue  # alive (or not ours to signal): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            _shm_funcs()[1]("/" + name)
            removed.append(name)
        except OSError:
            pass
    if removed:
        logger.info("verl-fastsync: removed %d shared-memory slot(s) of dead processes", len(removed))
    return removed


def _close_map(mm: mmap.mmap, desc: SlotDesc) -> None:
    try:
        mm.close()
    except BufferError:
        # A view into the slot is still referenced somewhere (e.g. a callback kept a tensor):
        # the mapping is then freed with that last view. Never gc.collect() here.
        logger.warning(
            "verl-fastsync: slot %d (%s) still has live views; its mapping is released with them",
            desc.index,
            desc.shm_name,
        )


class IpcSlotMemory:
    """CUDA-IPC (or any torch device with ``_share_cuda_``) slots, exported once per allocation."""

    name = "ipc"
    device_resident = True

    def __init__(self, device_module: Any = None, device: torch.device | str | None = None, **_: Any) -> None:
        self._device_module = device_module
        self._device = torch.device(device) if device is not None else None
        self._tensors: dict[str, torch.Tensor] = {}

    def _module(self, device_type: str) -> Any:
        return self._device_module if self._device_module is not None else _device_module(device_type)

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


def _resolve_memory(name: str, **kwargs: Any) -> SlotMemory:
    from verl_fastsync.plugins import plugin_manager, select_transport

    factory = select_transport(plugin_manager(), name, "colocated", key=ENV_ENABLE)
    memory = factory(**kwargs)
    for attr in ("allocate", "release", "attach", "detach"):
        if not callable(getattr(memory, attr, None)):
            raise TypeError(
                f"colocated transport {name!r} returned {type(memory).__name__}, which lacks {attr}(); "
                f"a colocated transport factory must return a SlotMemory"
            )
    return memory  # type: ignore[no-any-return, unused-ignore]
