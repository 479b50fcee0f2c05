"""The colocated sender (drop-in for verl's ``BucketedWeightSender``)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterable, Iterable
from typing import Any

import torch

from verl_fastsync.chunks import Bucket, ChunkMeta, pack_bucket
from verl_fastsync.colocated.channel import EventHook, _Channel, _noop_hook
from verl_fastsync.colocated.memory import SlotMemory, _device_module, _fence, _resolve_memory
from verl_fastsync.colocated.planner import WholeTensorPlanner, _with_checksums
from verl_fastsync.colocated.protocol import (
    ENV_VERIFY,
    METRIC_PREFIX,
    SCHEMA_VERSION,
    Abort,
    Ack,
    BucketMsg,
    ColocatedError,
    ColocatedProtocolError,
    ColocatedTimeoutError,
    Hello,
    HelloAck,
    Message,
    Ready,
    _check_timeout,
    _env_flag,
    _PeerFailed,
    colocated_transport_name,
)
from verl_fastsync.colocated.slots import _LAST_METRICS, NUM_SLOTS, _sender_slots

logger = logging.getLogger(__name__)


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
