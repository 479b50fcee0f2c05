"""Colocated weight sync: trainer -> inference-engine workers on the same devices.

This replaces verl's ``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``
(``BucketedWeightSender`` / ``BucketedWeightReceiver``) with a transport that

* keeps a **persistent, double-buffered bucket** (two slots) per process and socket path: the slots
  are allocated - and for CUDA IPC exported - once, re-allocated only when the bucket size changes,
  and released at process exit (:func:`release_colocated_resources`). verl allocates (and on ROCm
  leaks) one bucket per sync.
* **pipelines** the two slots: the trainer packs one slot while the receiver loads the other; a slot
  is packed again only after the receiver acknowledged it.
* **fences** every handover: the sender waits for its copies into a slot (a device event on the
  current stream, through verl's ``get_torch_device()`` when verl is importable, else
  ``torch.<device type>``) before the slot is announced; the receiver synchronizes its device, drops
  every view into the slot and only then acknowledges. Oversize tensors go through the slots too, so
  no per-tensor IPC handle is ever exported (verl exports oversize weights without a fence).
* handles **oversize weights on both paths** (shm and IPC) by chunking them through the slots
  (:mod:`verl_fastsync.chunks`) and merging them on the receiver's device; tensors stacked along a
  leading expert dimension (MoE ``...experts.<param>`` shaped ``[E, ...]``) are chunked on expert
  boundaries so every chunk is a valid ``[e0:e1]`` slice.
* never calls ``gc.collect()``; never pickles: control messages are msgspec structs with a
  ``schema_version``, over pyzmq on the same ``ipc://`` path verl uses (the socket file is made
  ``0600``): the sender binds a ROUTER, the receiver connects a DEALER with a fresh routing id and
  announces itself (``Ready``, resent until the ``Hello`` arrives), so a receiver of the previous
  sync that is still closing can neither take nor inject a message of this one.
* costs, by design, ``2 x bucket`` bytes held for the process lifetime on the sender (device
  memory for ``ipc``, ``/dev/shm`` for ``shm``) and one mapping of them in the receiver; pick the
  bucket with that in mind (verl's default of 2048 MiB means 4 GiB; 256-512 MiB buckets already
  keep the pipeline busy).
* puts a timeout on every blocking wait; the error names the peer, the phase, the bucket and the
  tensors in flight.

Expert slices and vLLM
----------------------
vLLM's ``FusedMoE.weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)`` loads one
expert at a time, and the model ``load_weights`` of checkpoints with stacked experts (gpt-oss, Llama 4,
Qwen3-VL-MoE: ``experts.gate_up_proj`` shaped ``[E, ...]``) iterate ``for expert_id in
range(num_experts)`` over the *whole* stacked tensor. Handing such a loader an ``[e0:e1]`` slice under
the original name would load it as experts ``0..e1-e0-1``: the generic ``load_weights`` path does
**not** accept slices, so by default the receiver merges a chunked tensor into one full-size buffer
on its device before calling the engine's callback (peak extra memory: the largest chunked tensor).
Where the caller can route a slice itself (e.g. calling ``FusedMoE.weight_loader`` per expert id),
pass ``expert_slice_loader=fn(name, first_expert, stop_expert, slice_tensor)`` to the receiver:
expert-aligned chunks are then handed to ``fn`` straight from the slot, without any merge buffer.

Enabling, per process
---------------------
The decision is made **per process, when a sender/receiver object is constructed**, from the
environment variable :data:`ENV_ENABLE` (``VERL_FASTSYNC_COLOCATED``):

* unset, ``""``, ``0``, ``false``, ``off``: verl's original classes are used, untouched;
* ``1``, ``true``, ``on``, ``auto``: fastsync; the slot memory follows verl's ``use_shm`` argument
  (``shm`` when verl would use shared memory, else ``ipc``);
* ``shm`` or ``ipc``: fastsync with that colocated transport (any name registered through the
  ``weight_transport`` hook with ``kind="colocated"`` is accepted).

Why an environment variable: the receiver runs inside vLLM's worker subprocesses, which verl spawns
through the vLLM server actor; they see neither the trainer's config nor Ray actor options, but they
inherit the environment of the server actor. The user therefore sets both the config key and the
variable, which reaches every actor::

    +actor_rollout_ref.rollout.custom.fastsync.colocated_transport=shm
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_FASTSYNC_COLOCATED=shm

and the adapter checks at trainer-worker start that the two agree
(:func:`verl_fastsync.verl.adapter.check_colocated_switch`), so a forgotten half fails before the first
sync. The receiver follows the transport named by the sender's first message, so only the on/off
decision must agree; when it does not, the fastsync side fails with a timeout that says so (the
socket types differ: no hang).

Hooking verl
------------
:func:`install_colocated` takes verl's imported ``bucketed_weight_transfer`` module and replaces
its two classes by switches that build the fastsync objects when enabled and verl's own otherwise.
The adapter calls it when ``verl.workers.rollout.vllm_rollout.bucketed_weight_transfer`` is
imported (in the trainer worker and in every vLLM worker process). Both verl call sites are then
served unchanged: the full sync (``update_weights_from_ipc``) and, on 0.9.1, the delta flushes
(``delta_weight_transfer``), whose callbacks take ``(weights, is_last)``.

Timeouts: every wait is bounded by ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`, or
:data:`ENV_TIMEOUT` in the environment, which the adapter can set from ``custom.fastsync.timeout_s``).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import math
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, Union

import msgspec
import torch

from verl_fastsync.chunks import (
    BUCKET_ALIGN,
    Assembler,
    Bucket,
    ChunkCorruptedError,
    ChunkMeta,
    DuplicateTensorError,
    bucket_chunk_views,
    byte_view,
    chunk_checksum,
    dtype_to_str,
    leading_slice_bytes,
    pack_bucket,
    str_to_dtype,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_ENABLE",
    "ENV_TIMEOUT",
    "METRIC_PREFIX",
    "SCHEMA_VERSION",
    "ColocatedError",
    "ColocatedProtocolError",
    "ColocatedReceiver",
    "ColocatedSender",
    "ColocatedTimeoutError",
    "IpcSlotMemory",
    "ShmSlotMemory",
    "SlotDesc",
    "SlotMemory",
    "colocated_enabled",
    "colocated_transport_name",
    "expert_alignment",
    "get_last_metrics",
    "install_colocated",
    "release_colocated_resources",
]

SCHEMA_VERSION = 1
"""Version of the control messages; a peer speaking another version is refused."""

ENV_ENABLE = "VERL_FASTSYNC_COLOCATED"
"""Per-process switch (see the module docstring for the values)."""

ENV_TIMEOUT = "VERL_FASTSYNC_COLOCATED_TIMEOUT_S"
ENV_VERIFY = "VERL_FASTSYNC_COLOCATED_VERIFY"
"""``1``: the sender attaches an xxhash checksum to every chunk and the receiver checks it (the adapter
sets it in the trainer process from ``custom.fastsync.verify``)."""
"""Override of the default timeout (seconds) of every blocking wait."""

DEFAULT_TIMEOUT_S = 600.0
"""Default timeout of one blocking wait (generous: a vLLM worker may be slow to start receiving)."""

METRIC_PREFIX = "fastsync/colocated/"

_OFF = frozenset({"", "0", "false", "off", "no"})
_ON = frozenset({"1", "true", "on", "yes", "auto"})


class ColocatedError(RuntimeError):
    """A colocated weight sync failed."""


class ColocatedTimeoutError(ColocatedError, TimeoutError):
    """A blocking wait of a colocated sync ran past its timeout."""


class ColocatedProtocolError(ColocatedError):
    """The peer sent something this side cannot accept (version, order, content)."""


class _PeerFailed(Exception):
    """Internal: the peer reported a failure while we were sending; read it with ``recv()``."""


# ---------------------------------------------------------------------------------------------
# control messages (msgspec, never pickle)
# ---------------------------------------------------------------------------------------------


class IpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A CUDA-IPC export of one slot (the fields torch's ``rebuild_cuda_tensor`` needs)."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class SlotDesc(msgspec.Struct, frozen=True, kw_only=True):
    """One slot of the persistent bucket, as the receiver needs it to map it."""

    index: int
    nbytes: int
    token: str
    """Unique per allocation: a receiver keeps its mapping while the token is unchanged."""
    shm_name: str | None = None
    ipc: IpcHandle | None = None


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    """Receiver -> sender, resent until the hello arrives: "this routing id receives this sync"."""

    schema_version: int
    receiver_pid: int


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    schema_version: int
    sync_id: str
    transport: str
    slots: list[SlotDesc]
    sender_pid: int
    verify: bool = False


class HelloAck(msgspec.Struct, tag="hello_ack", kw_only=True):
    schema_version: int
    sync_id: str
    error: str | None = None


class BucketMsg(msgspec.Struct, tag="bucket", kw_only=True):
    schema_version: int
    sync_id: str
    seq: int
    slot: int
    chunks: list[ChunkMeta]
    is_last: bool


class Ack(msgspec.Struct, tag="ack", kw_only=True):
    schema_version: int
    sync_id: str
    seq: int
    slot: int
    error: str | None = None


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    schema_version: int
    sync_id: str
    reason: str


Message = Union[Ready, Hello, HelloAck, BucketMsg, Ack, Abort]  # noqa: UP007 (a runtime value for msgspec)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class _Versioned(msgspec.Struct):
    """Any message, read only for its ``schema_version`` (other fields are ignored)."""

    schema_version: int = SCHEMA_VERSION


_VERSION_DECODER = msgspec.msgpack.Decoder(_Versioned)


# ---------------------------------------------------------------------------------------------
# configuration helpers
# ---------------------------------------------------------------------------------------------


def colocated_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether fastsync's colocated path is enabled for this process (:data:`ENV_ENABLE`)."""
    return colocated_transport_name(False, environ) is not None


def colocated_transport_name(use_shm: bool, environ: Any = None) -> str | None:
    """The colocated transport to use, or ``None`` when disabled. ``use_shm`` is verl's choice."""
    env = os.environ if environ is None else environ
    raw = str(env.get(ENV_ENABLE, "")).strip().lower()
    if raw in _OFF:
        return None
    if raw in _ON:
        return "shm" if use_shm else "ipc"
    if re.fullmatch(r"[a-z0-9_.-]+", raw):
        return raw
    raise ValueError(
        f"{ENV_ENABLE}={env.get(ENV_ENABLE)!r} is not valid; allowed: unset/0/false/off (verl's own "
        f"transfer), 1/true/on/auto (fastsync, shm or ipc as verl would pick), or a colocated transport "
        f"name such as shm or ipc"
    )


def _default_timeout() -> float:
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} must be a positive number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} must be a positive, finite number of seconds")
    return value


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _ON


def _with_checksums(metas: list[ChunkMeta], slot: torch.Tensor) -> list[ChunkMeta]:
    """``metas`` with the xxhash of each chunk's packed bytes (``verify``: a debugging aid that reads
    every byte once more; a device slot is read back to the host for it)."""
    out = []
    for meta in metas:
        data = slot[meta.bucket_offset : meta.bucket_offset + meta.chunk_size]
        out.append(msgspec.structs.replace(meta, checksum=chunk_checksum(data.cpu())))
    return out


def _check_timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        return _default_timeout()
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not (math.isfinite(timeout_s) and timeout_s > 0)
    ):
        raise ValueError(f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


_EXPERT_STACKED = re.compile(r"(^|\.)experts\.(?!\d+(\.|$))")


def expert_alignment(name: str, tensor: torch.Tensor) -> int | None:
    """Chunk alignment for a tensor stacked along a leading expert dimension, else ``None``.

    A name with an ``experts.`` component not followed by an expert index (``...mlp.experts.w13_weight``,
    ``...experts.gate_up_proj``) and at least two dimensions is treated as ``[E, ...]``: chunks are
    cut on multiples of one expert's bytes. Per-expert names (``experts.3.up_proj.weight``) are not.
    """
    if tensor.dim() >= 2 and tensor.shape[0] > 1 and _EXPERT_STACKED.search(name):
        return leading_slice_bytes(tensor)
    return None


class WholeTensorPlanner:
    """Bucket planner of the colocated path: a tensor that fits in a bucket is never split (it
    starts a new bucket when the current one has no room for it), so the receiver hands it over as
    a view into the slot with no merge copy; only a tensor larger than a bucket is chunked, on
    expert boundaries for stacked MoE tensors (:func:`expert_alignment`). Its first chunk fills the
    room left in the current bucket. Emits :class:`~verl_fastsync.chunks.Bucket` objects of
    :class:`~verl_fastsync.chunks.ChunkMeta` like the chunk core's planner.
    """

    def __init__(self, bucket_size: int) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive int (bytes), got {bucket_size!r}")
        self.bucket_size = bucket_size
        self._bucket = Bucket(index=0)
        self._offset = 0
        self._names: set[str] = set()
        self.num_tensors = 0
        self.total_bytes = 0

    def _close(self, out: list[Bucket]) -> None:
        if self._bucket.chunks:
            out.append(self._bucket)
            self._bucket = Bucket(index=self._bucket.index + 1)
        self._offset = 0

    def _place(self, meta_fields: dict[str, Any], data: torch.Tensor, start: int, n: int, at: int) -> None:
        meta = ChunkMeta(chunk_offset=start, chunk_size=n, bucket_offset=at, **meta_fields)
        self._bucket.chunks.append((meta, data[start : start + n]))
        self._offset = at + n
        self._bucket.nbytes = self._offset

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Plan one tensor; return the buckets it completed."""
        if name in self._names:
            raise DuplicateTensorError(f"tensor {name!r} appears twice in one weight sync")
        self._names.add(name)
        data = byte_view(tensor)
        total = data.numel()
        fields: dict[str, Any] = {
            "name": name,
            "shape": tuple(int(s) for s in tensor.shape),
            "dtype": dtype_to_str(tensor.dtype),
            "total_bytes": total,
            "tensor_index": self.num_tensors,
        }
        self.num_tensors += 1
        self.total_bytes += total
        size = self.bucket_size
        out: list[Bucket] = []
        at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
        if total <= size:
            if at + total > size:
                self._close(out)
                at = 0
            self._place(fields, data, 0, total, at)
            return out
        unit = expert_alignment(name, tensor) or 1
        if unit > size:
            unit = 1  # one expert does not fit in a bucket: plain byte chunks
        done = 0
        while done < total:
            at = -(-self._offset // BUCKET_ALIGN) * BUCKET_ALIGN
            n = min(total - done, ((size - at) // unit) * unit if at < size else 0)
            if n <= 0:
                self._close(out)
                continue
            self._place(fields, data, done, n, at)
            done += n
            if self._offset >= size:
                self._close(out)
        return out

    def finish(self) -> list[Bucket]:
        """The last partial bucket, if any."""
        out: list[Bucket] = []
        self._close(out)
        return out


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

    def allocate(self, index: int, nbytes: int) -> tuple[torch.Tensor, SlotDesc]:
        from torch.multiprocessing.reductions import reduce_tensor

        device = self._device
        if device is None:
            try:
                from verl.utils.device import get_device_id, get_device_name

                device = torch.device(f"{get_device_name()}:{get_device_id()}")
            except Exception:
                device = torch.device("cuda", torch.cuda.current_device())
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
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


# ---------------------------------------------------------------------------------------------
# persistent slots (process-wide)
# ---------------------------------------------------------------------------------------------


@dataclass
class _SenderSlots:
    memory: SlotMemory
    nbytes: int
    tensors: list[torch.Tensor]
    descs: list[SlotDesc]


@dataclass
class _ReceiverSlots:
    memory: SlotMemory
    tokens: tuple[str, ...]
    tensors: list[torch.Tensor] = field(default_factory=list)
    descs: list[SlotDesc] = field(default_factory=list)


_LOCK = threading.RLock()
_SENDER_SLOTS: dict[tuple[str, str], _SenderSlots] = {}
_RECEIVER_SLOTS: dict[str, _ReceiverSlots] = {}
_LAST_METRICS: dict[str, dict[str, float]] = {}
_ATEXIT_REGISTERED = False
NUM_SLOTS = 2


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(release_colocated_resources)
        _ATEXIT_REGISTERED = True


def _release_sender(slots: _SenderSlots) -> None:
    descs = slots.descs
    slots.tensors.clear()
    for desc in descs:
        slots.memory.release(desc)


def _release_receiver(slots: _ReceiverSlots) -> None:
    descs = slots.descs
    slots.tensors.clear()
    for desc in descs:
        slots.memory.detach(desc)


def release_colocated_resources() -> None:
    """Release every persistent slot of this process (sender and receiver side). Runs at exit."""
    with _LOCK:
        while _SENDER_SLOTS:
            _, slots = _SENDER_SLOTS.popitem()
            _release_sender(slots)
        while _RECEIVER_SLOTS:
            _, rslots = _RECEIVER_SLOTS.popitem()
            _release_receiver(rslots)


def _sender_slots(
    zmq_handle: str, memory_name: str, nbytes: int, make: Callable[[], SlotMemory]
) -> _SenderSlots:
    key = (zmq_handle, memory_name)
    with _LOCK:
        current = _SENDER_SLOTS.get(key)
        if current is not None and current.nbytes == nbytes:
            return current
        if current is not None:
            logger.info(
                "verl-fastsync: bucket size changed %d -> %d bytes; re-allocating the slots of %s",
                current.nbytes,
                nbytes,
                zmq_handle,
            )
            del _SENDER_SLOTS[key]
            _release_sender(current)
        memory = make()
        tensors: list[torch.Tensor] = []
        descs: list[SlotDesc] = []
        try:
            for index in range(NUM_SLOTS):
                tensor, desc = memory.allocate(index, nbytes)
                tensors.append(tensor)
                descs.append(desc)
        except BaseException:
            tensors.clear()
            for desc in descs:
                memory.release(desc)
            raise
        slots = _SenderSlots(memory=memory, nbytes=nbytes, tensors=tensors, descs=descs)
        _SENDER_SLOTS[key] = slots
        _register_atexit()
        return slots


def get_last_metrics(role: str = "sender") -> dict[str, float]:
    """The metrics of this process's last completed sync for ``role`` (``sender`` or ``receiver``)."""
    if role not in ("sender", "receiver"):
        raise ValueError(f"role must be 'sender' or 'receiver', got {role!r}")
    return dict(_LAST_METRICS.get(role, {}))


# ---------------------------------------------------------------------------------------------
# sockets
# ---------------------------------------------------------------------------------------------


def _ipc_path(zmq_handle: str) -> str | None:
    return zmq_handle[len("ipc://") :] if zmq_handle.startswith("ipc://") else None


def _remove_path(zmq_handle: str) -> None:
    path = _ipc_path(zmq_handle)
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


class _Channel:
    """One sync's control channel: the sender binds a ROUTER, the receiver connects a DEALER with a
    fresh routing id and announces itself with :class:`Ready` (resent until the hello arrives). The
    sender talks only to the routing id it chose, so a receiver of an earlier sync that is still
    closing, or a connection to a sender that is going away, cannot take a message of this sync.
    Every wait has a timeout; messages are msgspec-encoded :data:`Message` structs."""

    def __init__(self, zmq_handle: str, role: str, timeout_s: float, bind: bool) -> None:
        import zmq

        if not isinstance(zmq_handle, str) or "://" not in zmq_handle:
            raise ValueError(
                f"zmq_handle must be a ZMQ endpoint such as 'ipc:///tmp/x.sock', got {zmq_handle!r}"
            )
        self._zmq = zmq
        self.zmq_handle = zmq_handle
        self.role = role
        self.peer = "receiver" if role == "sender" else "sender"
        self.timeout_s = timeout_s
        self.bound = bind
        self.peer_id: bytes | None = None  # sender: the routing id of this sync's receiver
        self.peer_locked = False  # sender: set once that receiver acknowledged the hello
        self.early: list[Message] = []  # messages read while waiting to send
        ctx: Any = zmq.Context.instance()
        self.socket: Any = ctx.socket(zmq.ROUTER if bind else zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, _LINGER_MS)
        try:
            if bind:
                self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _remove_path(zmq_handle)
                self.socket.bind(zmq_handle)
                path = _ipc_path(zmq_handle)
                if path:
                    os.chmod(path, 0o600)
            else:
                self.socket.setsockopt(zmq.ROUTING_ID, b"r" + uuid.uuid4().bytes)
                # the sender binds per sync, usually after we connect: retry every millisecond, not
                # zmq's default 100 ms (which would be added to every sync)
                self.socket.setsockopt(zmq.RECONNECT_IVL, 1)
                self.socket.connect(zmq_handle)
        except BaseException:
            self.socket.close(0)
            raise

    def _where(self, phase: str, seq: int | None, tensors: Iterable[str]) -> str:
        names = list(tensors)
        shown = ", ".join(repr(n) for n in names[:4]) + (
            f" (+{len(names) - 4} more)" if len(names) > 4 else ""
        )
        return (
            f"{self.peer} at {self.zmq_handle}; phase={phase}, bucket={seq if seq is not None else '-'}, "
            f"tensors in flight=[{shown}]"
        )

    def _timeout(
        self, doing: str, phase: str, seq: int | None, tensors: Iterable[str]
    ) -> ColocatedTimeoutError:
        return ColocatedTimeoutError(
            f"verl-fastsync {self.role}: timed out after {self.timeout_s:.0f}s {doing} the "
            f"{self._where(phase, seq, tensors)}. Is the peer running with {ENV_ENABLE} set the same "
            f"way (fastsync on both sides or on neither)?"
        )

    def send(self, msg: Message, phase: str, seq: int | None = None, tensors: Iterable[str] = ()) -> None:
        """Send ``msg``; while the peer cannot take it, read what it sent meanwhile, so that an error
        ack or an abort from a peer that has gone away surfaces at once instead of as a timeout."""
        zmq = self._zmq
        frames = [_ENCODER.encode(msg)]
        if self.bound:
            if self.peer_id is None:
                raise ColocatedProtocolError("verl-fastsync sender: no receiver has announced itself yet")
            frames.insert(0, self.peer_id)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                # the receiver's connection is gone; it may have left an error ack behind
                while self.socket.poll(0, zmq.POLLIN):
                    self._stash_or_raise(phase, seq, tensors)
                if time.monotonic() >= deadline:
                    raise ColocatedError(
                        f"verl-fastsync {self.role}: the {self._where(phase, seq, tensors)} went away"
                    ) from None
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = self.socket.poll(min(left_ms, 50), zmq.POLLIN | zmq.POLLOUT)
            if events & zmq.POLLIN:
                self._stash_or_raise(phase, seq, tensors)
            if time.monotonic() >= deadline:
                raise self._timeout("sending to", phase, seq, tensors)

    def send_nowait(self, msg: Message) -> None:
        """Best effort, never blocks (an abort on the way out)."""
        frames = [_ENCODER.encode(msg)]
        if self.bound:
            if self.peer_id is None:
                return
            frames.insert(0, self.peer_id)
        self.socket.send_multipart(frames, self._zmq.NOBLOCK)

    def _stash_or_raise(self, phase: str, seq: int | None, tensors: Iterable[str]) -> None:
        early = self._recv_now(phase, seq, tensors)
        if early is None:
            return
        if isinstance(early, Abort) or (isinstance(early, Ack) and early.error is not None):
            self.early.insert(0, early)  # the caller turns _PeerFailed into the peer's error
            raise _PeerFailed()
        self.early.append(early)

    def recv_within(self, window_s: float, phase: str) -> Message | None:
        """Like :meth:`recv`, but ``None`` when nothing (for this sync) arrives within ``window_s``."""
        if self.early:
            return self.early.pop(0)
        deadline = time.monotonic() + window_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(left_ms, self._zmq.POLLIN):
                return None
            msg = self._recv_now(phase, None, ())
            if msg is not None:
                return msg

    def recv(self, phase: str, seq: int | None = None, tensors: Iterable[str] = ()) -> Message:
        msg = self.recv_within(self.timeout_s, phase)
        if msg is None:
            raise self._timeout("waiting for", phase, seq, tensors)
        return msg

    def peer_failure(self) -> ColocatedError:
        """The error for a failure the peer reported while we were sending (see :meth:`send`)."""
        early = self.early[0] if self.early else None
        if isinstance(early, Abort):
            return ColocatedError(f"verl-fastsync {self.role}: the {self.peer} aborted: {early.reason}")
        if isinstance(early, Ack):
            return ColocatedError(
                f"verl-fastsync {self.role}: the {self.peer} failed on bucket {early.seq}: {early.error}"
            )
        return ColocatedProtocolError(f"verl-fastsync {self.role}: the {self.peer} failed")

    def _recv_now(self, phase: str, seq: int | None, tensors: Iterable[str]) -> Message | None:
        """Read one message; ``None`` for one that is not from this sync's peer (ignored)."""
        frames = self.socket.recv_multipart()
        sender_id: bytes | None = None
        if self.bound:
            if len(frames) != 2:
                return None
            sender_id, raw = frames
        elif len(frames) != 1:
            return None
        else:
            raw = frames[0]
        # The version first, from a struct that only reads it: a peer of another release may have
        # changed the message fields, and the error must then name both versions.
        try:
            version = _VERSION_DECODER.decode(raw).schema_version
        except msgspec.DecodeError:
            version = SCHEMA_VERSION  # not a map with a version: the full decode below says why
        if version != SCHEMA_VERSION:
            raise ColocatedProtocolError(
                f"verl-fastsync {self.role}: the {self.peer} speaks schema version {version}, "
                f"this side {SCHEMA_VERSION}; install the same verl-fastsync version in both processes"
            )
        try:
            msg = _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise ColocatedProtocolError(
                f"verl-fastsync {self.role}: undecodable message from {self._where(phase, seq, tensors)}: "
                f"{exc} (is the peer verl's original transfer? set {ENV_ENABLE} identically on both sides)"
            ) from None
        if self.bound:
            if isinstance(msg, Ready):
                if self.peer_locked:
                    return None  # the next sync's receiver, early: not ours
                self.peer_id = sender_id  # during the handshake the newest receiver wins
                return msg
            if sender_id != self.peer_id:
                return None  # a receiver of an earlier sync
        return msg

    def close(self) -> None:
        # no disconnect() first: it would drop the last ack still queued. A closing receiver that
        # reconnects to the next sync's sender is ignored there (another routing id).
        # let a last ack or abort leave before the socket goes (close does not block on it)
        self.socket.close(_LINGER_MS)
        if self.bound:
            _remove_path(self.zmq_handle)


_LINGER_MS = 2000
HELLO_RESEND_S = 0.25
"""The sender resends its hello (idempotent, keyed by sync id) this often until it is acknowledged:
a receiver of the previous sync that is still closing may reconnect and take the first copy."""

EventHook = Callable[[str, dict[str, Any]], None]
"""Optional tracer: ``hook(event, fields)``; events ``pack``, ``fence``, ``send``, ``ack`` (sender),
``attach``, ``detach``, ``bucket``, ``device_sync``, ``views_dropped``, ``ack`` (receiver)."""


def _noop_hook(event: str, fields: dict[str, Any]) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# sender
# ---------------------------------------------------------------------------------------------


class ColocatedSender:
    """Drop-in for verl's ``BucketedWeightSender`` (same constructor and ``async_send_weights``).

    :param zmq_handle: ZMQ endpoint the sender binds (verl's ``ipc:///tmp/rl-colocate-zmq-...sock``).
    :param bucket_size_mb: size of one slot in MiB (two slots are kept).
    :param use_shm: verl's choice of shared memory over CUDA IPC; picks ``shm``/``ipc`` unless
        ``transport`` or :data:`ENV_ENABLE` names a transport.
    :param transport: colocated transport name (resolved through the ``weight_transport`` hook).
    :param timeout_s: timeout of every blocking wait (default :data:`DEFAULT_TIMEOUT_S` or
        :data:`ENV_TIMEOUT`).
    :param device_module: device module used for the fence (default: verl's ``get_torch_device()``
        or ``torch.<type>``).
    :param memory: an explicit :class:`SlotMemory` (overrides ``transport``).
    :param event_hook: optional tracer, see :data:`EventHook`.
    """

    def __init__(
        self,
        zmq_handle: str,
        bucket_size_mb: float = 512,
        use_shm: bool = False,
        *,
        transport: str | None = None,
        timeout_s: float | None = None,
        verify: bool | None = None,
        device_module: Any = None,
        memory: SlotMemory | None = None,
        event_hook: EventHook | None = None,
    ) -> None:
        if (
            isinstance(bucket_size_mb, bool)
            or not isinstance(bucket_size_mb, int | float)
            or not (math.isfinite(bucket_size_mb) and bucket_size_mb > 0)
        ):
            raise ValueError(f"bucket_size_mb must be a positive number of MiB, got {bucket_size_mb!r}")
        self.zmq_handle = zmq_handle
        self.bucket_size_mb = bucket_size_mb
        self.bucket_size = int(bucket_size_mb * (1 << 20))
        self.use_shm = bool(use_shm)
        name = transport or colocated_transport_name(self.use_shm) or ("shm" if self.use_shm else "ipc")
        self.transport = memory.name if memory is not None else name
        self.timeout_s = _check_timeout(timeout_s)
        self.verify = _env_flag(ENV_VERIFY) if verify is None else bool(verify)
        self.device_module = device_module
        self._memory = memory
        self._hook = event_hook or _noop_hook
        self.last_metrics: dict[str, float] = {}

    def _make_memory(self) -> SlotMemory:
        if self._memory is not None:
            return self._memory
        return _resolve_memory(self.transport, device_module=self.device_module)

    def _fence(
        self, slot_tensor: torch.Tensor, source_types: set[str], device_resident: bool, slot: int, seq: int
    ) -> None:
        types = set(source_types)
        if slot_tensor.device.type != "cpu":
            types.add(slot_tensor.device.type)
        if self.device_module is not None:
            if types or device_resident:
                _fence(self.device_module)
        else:
            for device_type in sorted(types):
                _fence(_device_module(device_type))
        self._hook("fence", {"slot": slot, "seq": seq})

    async def async_send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[Any]
    ) -> None:
        """Send ``(name, tensor)`` pairs (sync iterable or async iterator) to the receiver."""
        start = time.perf_counter()
        slots = _sender_slots(self.zmq_handle, self.transport, self.bucket_size, self._make_memory)
        sync_id = uuid.uuid4().hex[:12]
        channel = _Channel(self.zmq_handle, "sender", self.timeout_s, bind=True)
        planner = WholeTensorPlanner(self.bucket_size)
        inflight: dict[int, tuple[int, list[str]]] = {}  # slot -> (seq, tensor names)
        held: tuple[int, int, list[ChunkMeta]] | None = None
        stats = {"slot_waits": 0, "slot_wait_s": 0.0, "chunked": 0, "buckets": 0}
        phase, seq, names_in_flight = "hello", 0, []
        ok = False

        def wait_ack(slot: int) -> None:
            aseq, anames = inflight[slot]
            t0 = time.perf_counter()
            waited = not channel.socket.poll(0)
            msg = channel.recv("wait-ack", aseq, anames)
            while isinstance(msg, Ready) or (isinstance(msg, HelloAck) and msg.sync_id == sync_id):
                msg = channel.recv("wait-ack", aseq, anames)  # late copies of the handshake
            if isinstance(msg, Abort):
                raise ColocatedError(
                    f"verl-fastsync sender: the receiver aborted bucket {aseq}: {msg.reason}"
                )
            if not isinstance(msg, Ack) or msg.sync_id != sync_id:
                raise ColocatedProtocolError(
                    f"verl-fastsync sender: expected the ack of bucket {aseq} (slot {slot}), got {msg!r}"
                )
            if msg.error is not None:
                raise ColocatedError(
                    f"verl-fastsync sender: the receiver failed on bucket {msg.seq} "
                    f"(tensors {anames[:4]}): {msg.error}"
                )
            if msg.seq not in {s for s, _ in inflight.values()}:
                raise ColocatedProtocolError(f"verl-fastsync sender: ack for unknown bucket {msg.seq}")
            # acks come in order: a PAIR socket keeps order and the receiver handles buckets in order
            if msg.slot != slot or msg.seq != aseq:
                raise ColocatedProtocolError(
                    f"verl-fastsync sender: out-of-order ack (bucket {msg.seq}, slot {msg.slot}); "
                    f"expected bucket {aseq}, slot {slot}"
                )
            del inflight[slot]
            self._hook("ack", {"slot": slot, "seq": aseq})
            if waited:
                stats["slot_waits"] += 1
                stats["slot_wait_s"] += time.perf_counter() - t0

        def send_held(is_last: bool) -> None:
            assert held is not None
            hseq, hslot, metas = held
            names = [m.name for m in metas]
            channel.send(
                BucketMsg(
                    schema_version=SCHEMA_VERSION,
                    sync_id=sync_id,
                    seq=hseq,
                    slot=hslot,
                    chunks=metas,
                    is_last=is_last,
                ),
                "send-bucket",
                hseq,
                names,
            )
            inflight[hslot] = (hseq, names)
            self._hook("send", {"slot": hslot, "seq": hseq, "is_last": is_last})

        def stage(bucket: Bucket) -> None:
            nonlocal held, seq, names_in_flight, phase
            slot = seq % NUM_SLOTS
            if held is not None:
                send_held(False)
            names_in_flight = [m.name for m in bucket.metas]
            if slot in inflight:
                phase = "wait-slot"
                wait_ack(slot)
            phase = "pack"
            self._hook("pack", {"slot": slot, "seq": seq})
            types = {data.device.type for _, data in bucket.chunks if data.device.type != "cpu"}
            pack_bucket(bucket, slots.tensors[slot])
            metas = _with_checksums(bucket.metas, slots.tensors[slot]) if self.verify else bucket.metas
            stats["chunked"] += sum(1 for m in bucket.metas if not m.is_whole and m.chunk_offset == 0)
            self._fence(
                slots.tensors[slot], types, bool(getattr(slots.memory, "device_resident", False)), slot, seq
            )
            held = (seq, slot, metas)
            stats["buckets"] += 1
            seq += 1

        try:
            hello = Hello(
                schema_version=SCHEMA_VERSION,
                sync_id=sync_id,
                transport=self.transport,
                slots=list(slots.descs),
                sender_pid=os.getpid(),
                verify=self.verify,
            )
            deadline = time.monotonic() + self.timeout_s
            reply: Message | None = None
            while reply is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise channel._timeout("waiting for", "hello", None, ())
                # short waits that yield to the event loop: the request that starts the receiver
                # may be an awaitable of this same loop (SGLang's update_weights_from_tensor)
                got = channel.recv_within(min(0.005, left), "hello")
                if got is None:
                    await asyncio.sleep(0.001)
                    continue
                if isinstance(got, Ready):  # a receiver announced itself (again): (re)send the hello
                    channel.send(hello, "hello")
                elif getattr(got, "sync_id", None) == sync_id:
                    reply = got
                    channel.peer_locked = True
                # else: a stale message of an earlier sync (ignored)
            if isinstance(reply, Abort):
                raise ColocatedError(f"verl-fastsync sender: the receiver aborted at hello: {reply.reason}")
            if not isinstance(reply, HelloAck):
                raise ColocatedProtocolError(f"verl-fastsync sender: expected hello_ack, got {reply!r}")
            if reply.error is not None:
                raise ColocatedError(
                    f"verl-fastsync sender: the receiver could not map the slots: {reply.error}"
                )
            phase = "plan"
            if isinstance(weights, AsyncIterable):
                async for item in weights:
                    name, tensor = _pair(item)
                    for bucket in planner.add(name, tensor):
                        stage(bucket)
                    phase = "plan"
            else:
                for item in weights:
                    name, tensor = _pair(item)
                    for bucket in planner.add(name, tensor):
                        stage(bucket)
                    phase = "plan"
                    await asyncio.sleep(0)
            for bucket in planner.finish():
                stage(bucket)
            if held is None:  # empty sync: still tell the receiver it is over
                slot = seq % NUM_SLOTS
                held = (seq, slot, [])
                seq += 1
            send_held(True)
            phase = "drain"
            for slot in sorted(inflight, key=lambda s: inflight[s][0]):
                wait_ack(slot)
            ok = True
        except BaseException as exc:
            if isinstance(exc, _PeerFailed):
                raise channel.peer_failure() from None
            if not isinstance(exc, ColocatedTimeoutError | ColocatedProtocolError):
                try:
                    channel.send_nowait(
                        Abort(schema_version=SCHEMA_VERSION, sync_id=sync_id, reason=repr(exc))
                    )
                except Exception:
                    pass
            if isinstance(exc, Exception) and not isinstance(exc, ColocatedError):
                raise ColocatedError(
                    f"verl-fastsync sender failed in phase {phase} (bucket {seq}, tensors "
                    f"{names_in_flight[:4]}): {exc!r}"
                ) from exc
            raise
        finally:
            channel.close()
            if not ok:
                # a half-finished sync leaves slot contents undefined but the slots stay valid; the
                # next sync starts with a fresh hello, so nothing is torn down here.
                pass
        seconds = time.perf_counter() - start
        total = planner.total_bytes
        self.last_metrics = {
            f"{METRIC_PREFIX}bytes": float(total),
            f"{METRIC_PREFIX}buckets": float(stats["buckets"]),
            f"{METRIC_PREFIX}tensors": float(planner.num_tensors),
            f"{METRIC_PREFIX}chunked_tensors": float(stats["chunked"]),
            f"{METRIC_PREFIX}seconds": seconds,
            f"{METRIC_PREFIX}gbps": (total / seconds / 1e9) if seconds > 0 else 0.0,
            f"{METRIC_PREFIX}slot_waits": float(stats["slot_waits"]),
            f"{METRIC_PREFIX}slot_wait_seconds": float(stats["slot_wait_s"]),
            f"{METRIC_PREFIX}bucket_bytes": float(self.bucket_size),
        }
        _LAST_METRICS["sender"] = dict(self.last_metrics)
        logger.info(
            "verl-fastsync colocated sync (%s): %.1f MB in %d buckets, %.3f s, %.2f GB/s, %d slot waits",
            self.transport,
            total / 1e6,
            stats["buckets"],
            seconds,
            self.last_metrics[f"{METRIC_PREFIX}gbps"],
            stats["slot_waits"],
        )


def _pair(item: Any) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise TypeError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str):
        raise TypeError(f"a weight name must be a str, got {type(name).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return name, tensor


# ---------------------------------------------------------------------------------------------
# receiver
# ---------------------------------------------------------------------------------------------

ExpertSliceLoader = Callable[[str, int, int, torch.Tensor], None]


def _wants_is_last(callback: Callable[..., Any]) -> bool:
    """Whether verl's callback takes ``(weights, is_last)`` (0.9.x) rather than ``(weights)``."""
    try:
        sig = inspect.signature(callback)
    except (TypeError, ValueError):
        return True
    positional = 0
    for param in sig.parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            return True
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 2


class ColocatedReceiver:
    """Drop-in for verl's ``BucketedWeightReceiver`` (same constructor and ``receive_weights``).

    The callback gets ``(weights)`` or ``(weights, is_last)``, matching its own signature (verl
    0.7.1/0.8.0 pass one argument, 0.9.x two); ``callback_is_last`` forces either. The tensors handed
    over are views into the slot (or, for chunked tensors, one merged tensor on ``device``) and are
    valid only during the callback: clone what must outlive it.

    :param expert_slice_loader: optional ``fn(name, first_expert, stop_expert, tensor)`` that takes
        expert-aligned chunks of stacked MoE tensors directly from the slot (no merge buffer).
    """

    def __init__(
        self,
        zmq_handle: str,
        device: torch.device | str,
        use_shm: bool = False,
        *,
        timeout_s: float | None = None,
        device_module: Any = None,
        memory: SlotMemory | None = None,
        callback_is_last: bool | None = None,
        expert_slice_loader: ExpertSliceLoader | None = None,
        event_hook: EventHook | None = None,
    ) -> None:
        self.zmq_handle = zmq_handle
        self.device = torch.device(device)
        self.use_shm = bool(use_shm)
        self.timeout_s = _check_timeout(timeout_s)
        self.device_module = device_module
        self._memory = memory
        self.callback_is_last = callback_is_last
        self.expert_slice_loader = expert_slice_loader
        self._hook = event_hook or _noop_hook
        self.last_metrics: dict[str, float] = {}

    def _sync_device(self) -> None:
        if self.device_module is not None:
            self.device_module.synchronize()
        elif self.device.type != "cpu":
            _device_module(self.device.type).synchronize()
        self._hook("device_sync", {})

    def _attach(self, hello: Hello) -> _ReceiverSlots:
        tokens = tuple(d.token for d in hello.slots)
        with _LOCK:
            current = _RECEIVER_SLOTS.get(self.zmq_handle)
            if current is not None and current.tokens == tokens:
                return current
            if current is not None:
                del _RECEIVER_SLOTS[self.zmq_handle]
                _release_receiver(current)
                self._hook("detach", {"tokens": current.tokens})
            memory = self._memory
            if memory is None:
                memory = _resolve_memory(hello.transport, device_module=self.device_module)
            slots = _ReceiverSlots(memory=memory, tokens=tokens)
            try:
                for desc in hello.slots:
                    slots.tensors.append(memory.attach(desc, self.device))
                    slots.descs.append(desc)
            except BaseException:
                _release_receiver(slots)
                raise
            _RECEIVER_SLOTS[self.zmq_handle] = slots
            _register_atexit()
            self._hook("attach", {"tokens": tokens})
            return slots

    def receive_weights(self, on_bucket_received: Callable[..., Any]) -> None:
        """Receive one sync; call ``on_bucket_received`` once per bucket."""
        start = time.perf_counter()
        with_is_last = self.callback_is_last
        if with_is_last is None:
            with_is_last = _wants_is_last(on_bucket_received)
        channel = _Channel(self.zmq_handle, "receiver", self.timeout_s, bind=False)
        expected_seq, nbytes, nbuckets, callback_s = 0, 0, 0, 0.0
        phase, seq = "hello", None
        names: list[str] = []
        sync_id = ""
        try:
            deadline = time.monotonic() + self.timeout_s
            hello: Message | None = None
            ready = Ready(schema_version=SCHEMA_VERSION, receiver_pid=os.getpid())
            while not isinstance(hello, Hello):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise channel._timeout("waiting for", "hello", None, ())
                channel.send(ready, "hello")
                hello = channel.recv_within(min(HELLO_RESEND_S, left), "hello")
                if isinstance(hello, Abort):
                    raise ColocatedError(f"verl-fastsync receiver: the sender aborted: {hello.reason}")
            sync_id = hello.sync_id
            try:
                slots = self._attach(hello)
            except Exception as exc:
                channel.send(
                    HelloAck(schema_version=SCHEMA_VERSION, sync_id=sync_id, error=repr(exc)), "hello"
                )
                raise
            self._hook("hello_ack", {"tokens": slots.tokens})
            channel.send(HelloAck(schema_version=SCHEMA_VERSION, sync_id=sync_id), "hello")
            assembler = Assembler(self.device, zero_copy=True, verify=hello.verify)
            while True:
                phase = "wait-bucket"
                msg = channel.recv(phase, expected_seq, names)
                if isinstance(msg, Hello) and msg.sync_id == sync_id:  # resent hello: answer again
                    channel.send(HelloAck(schema_version=SCHEMA_VERSION, sync_id=sync_id), "hello")
                    continue
                if isinstance(msg, Abort):
                    raise ColocatedError(f"verl-fastsync receiver: the sender aborted: {msg.reason}")
                if not isinstance(msg, BucketMsg) or msg.sync_id != sync_id:
                    raise ColocatedProtocolError(
                        f"verl-fastsync receiver: expected bucket {expected_seq}, got {msg!r}"
                    )
                if msg.seq != expected_seq or not 0 <= msg.slot < len(slots.tensors):
                    raise ColocatedProtocolError(
                        f"verl-fastsync receiver: bucket {msg.seq} in slot {msg.slot}; expected bucket "
                        f"{expected_seq} in one of {len(slots.tensors)} slots"
                    )
                seq = msg.seq
                names = [m.name for m in msg.chunks]
                phase = "load"
                self._hook("bucket", {"seq": seq, "slot": msg.slot, "view": slots.tensors[msg.slot]})
                error: str | None = None
                try:
                    weights = self._views(slots.tensors[msg.slot], msg.chunks, assembler)
                    if msg.is_last:
                        assembler.finish()
                    t0 = time.perf_counter()
                    if with_is_last:
                        on_bucket_received(weights, msg.is_last)
                    else:
                        on_bucket_received(weights)
                    callback_s += time.perf_counter() - t0
                    self._sync_device()
                    del weights
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    raise ColocatedError(
                        f"verl-fastsync receiver failed loading bucket {seq} (tensors {names[:4]}): {error}"
                    ) from exc
                finally:
                    # views dropped (above) before the ack; the sender may now repack this slot
                    self._hook("views_dropped", {"seq": seq})
                    self._hook("ack", {"seq": seq, "slot": msg.slot})  # recorded before it leaves
                    channel.send(
                        Ack(
                            schema_version=SCHEMA_VERSION,
                            sync_id=sync_id,
                            seq=seq,
                            slot=msg.slot,
                            error=error,
                        ),
                        "ack",
                        seq,
                        names,
                    )
                nbytes += sum(m.chunk_size for m in msg.chunks)
                nbuckets += 1
                expected_seq += 1
                if msg.is_last:
                    break
        except _PeerFailed:
            raise channel.peer_failure() from None
        finally:
            channel.close()
        seconds = time.perf_counter() - start
        self.last_metrics = {
            f"{METRIC_PREFIX}recv_bytes": float(nbytes),
            f"{METRIC_PREFIX}recv_buckets": float(nbuckets),
            f"{METRIC_PREFIX}recv_seconds": seconds,
            f"{METRIC_PREFIX}recv_callback_seconds": callback_s,
            f"{METRIC_PREFIX}recv_merge_peak_bytes": float(assembler.peak_in_progress_bytes),
        }
        _LAST_METRICS["receiver"] = dict(self.last_metrics)
        logger.info(
            "verl-fastsync colocated receive: %.1f MB in %d buckets, %.3f s (%.3f s in the loader)",
            nbytes / 1e6,
            nbuckets,
            seconds,
            callback_s,
        )

    def _views(
        self, slot: torch.Tensor, metas: list[ChunkMeta], assembler: Assembler
    ) -> list[tuple[str, torch.Tensor]]:
        weights: list[tuple[str, torch.Tensor]] = []
        for meta, data in bucket_chunk_views(slot, metas):
            if self.expert_slice_loader is not None and not meta.is_whole and self._is_expert_slice(meta):
                if assembler.verify and chunk_checksum(data.cpu()) != meta.checksum:
                    raise ChunkCorruptedError(
                        f"tensor {meta.name!r}: chunk at byte {meta.chunk_offset} does not match the "
                        f"sender's checksum"
                    )
                dtype = str_to_dtype(meta.dtype)
                row = meta.total_bytes // meta.shape[0]
                first, stop = meta.chunk_offset // row, (meta.chunk_offset + meta.chunk_size) // row
                view = data if data.device == self.device else data.to(self.device)
                self.expert_slice_loader(
                    meta.name, first, stop, view.view(dtype).view((stop - first, *meta.shape[1:]))
                )
                continue
            weights.extend(assembler.feed(meta, data))
        return weights

    @staticmethod
    def _is_expert_slice(meta: ChunkMeta) -> bool:
        if len(meta.shape) < 2 or meta.shape[0] <= 1 or not _EXPERT_STACKED.search(meta.name):
            return False
        row = meta.total_bytes // meta.shape[0]
        return row > 0 and meta.chunk_offset % row == 0 and meta.chunk_size % row == 0


# ---------------------------------------------------------------------------------------------
# substitution into verl
# ---------------------------------------------------------------------------------------------

_INSTALLED_ATTR = "_verl_fastsync_colocated_originals"


def install_colocated(module: ModuleType) -> None:
    """Replace ``BucketedWeightSender``/``BucketedWeightReceiver`` in verl's imported
    ``bucketed_weight_transfer`` module by switches: each construction builds a fastsync object when
    :func:`colocated_enabled` is true in this process, verl's own class (untouched) otherwise.

    Idempotent. The switches subclass verl's classes so ``isinstance`` checks and attribute lookups
    by verl keep working; ``__wrapped__`` holds the original.
    """
    if getattr(module, _INSTALLED_ATTR, None) is not None:
        return
    orig_sender: Any = getattr(module, "BucketedWeightSender")  # noqa: B009
    orig_receiver: Any = getattr(module, "BucketedWeightReceiver")  # noqa: B009

    class BucketedWeightSender(orig_sender):
        __wrapped__ = orig_sender
        __doc__ = orig_sender.__doc__

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            use_shm = _arg(args, kwargs, 2, "use_shm", False)
            if colocated_transport_name(bool(use_shm)) is not None:
                return ColocatedSender(*args, **kwargs)
            return orig_sender(*args, **kwargs)

    class BucketedWeightReceiver(orig_receiver):
        __wrapped__ = orig_receiver
        __doc__ = orig_receiver.__doc__

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if colocated_enabled():
                return ColocatedReceiver(*args, **kwargs)
            return orig_receiver(*args, **kwargs)

    for switch, orig in ((BucketedWeightSender, orig_sender), (BucketedWeightReceiver, orig_receiver)):
        switch.__module__ = orig.__module__
        switch.__qualname__ = orig.__qualname__
    setattr(module, _INSTALLED_ATTR, (orig_sender, orig_receiver))
    setattr(module, "BucketedWeightSender", BucketedWeightSender)  # noqa: B010
    setattr(module, "BucketedWeightReceiver", BucketedWeightReceiver)  # noqa: B010


def uninstall_colocated(module: ModuleType) -> None:
    """Undo :func:`install_colocated` (restores verl's classes)."""
    originals = getattr(module, _INSTALLED_ATTR, None)
    if originals is None:
        return
    setattr(module, "BucketedWeightSender", originals[0])  # noqa: B010
    setattr(module, "BucketedWeightReceiver", originals[1])  # noqa: B010
    delattr(module, _INSTALLED_ATTR)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default
