"""The colocated sender (drop-in for verl's ``BucketedWeightSender``)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterable, Iterable
from typing import Any

import torch

from verl_fastsync.chunks import Bucket, ChunkMeta
from verl_fastsync.colocated.channel import EventHook, _Channel, _noop_hook
from verl_fastsync.colocated.memory import SlotMemory, _resolve_memory, seal_slot
from verl_fastsync.colocated.planner import colocated_planner, with_checksums
from verl_fastsync.colocated.protocol import (
    ENV_VERIFY,
    METRIC_PREFIX,
    SCHEMA_VERSION,
    Abort,
    Ack,
    BucketMsg,
    ColocatedError,
    ColocatedProtocolError,
    Hello,
    HelloAck,
    Message,
    Ready,
    _check_timeout,
    _env_flag,
    _PeerFailed,
    colocated_transport_name,
)
from verl_fastsync.colocated.slots import _LAST_METRICS, NUM_SLOTS, _sender_slots, _SenderSlots
from verl_fastsync.io.fence import synchronize_device
from verl_fastsync.limits import validate_bucket_size

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

    Ownership: each tensor's bytes are copied into a slot (device copies fenced) before the producer
    is asked for the next tensor, and no reference to a yielded tensor is kept, so a producer may
    reuse or change a tensor as soon as it has yielded it. The sender's memory beyond the producer's
    is the two slots.
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
        self.bucket_size = validate_bucket_size(bucket_size_mb, "bucket_size_mb", mib=True)
        self.zmq_handle = zmq_handle
        self.bucket_size_mb = bucket_size_mb
        self.use_shm = bool(use_shm)
        name = transport or colocated_transport_name(self.use_shm) or ("shm" if self.use_shm else "ipc")
        self.transport = memory.name if memory is not None else name
        self.timeout_s = _check_timeout(timeout_s)
        self.verify = _env_flag(ENV_VERIFY) if verify is None else bool(verify)
        self.device_module = device_module
        self._memory = memory
        self._hook = event_hook or _noop_hook
        self.last_metrics: dict[str, float] = {}
        if memory is None and self.transport == "ipc":
            # fail here, naming the fix, rather than at the first sync (never fall back to shm)
            self._memory = self._make_memory()
            probe = getattr(self._memory, "device", None)
            if callable(probe):
                probe()

    def _make_memory(self) -> SlotMemory:
        if self._memory is not None:
            return self._memory
        return _resolve_memory(self.transport, device_module=self.device_module)

    def _slots(self, mapped: tuple[str, ...] | None) -> _SenderSlots:
        return _sender_slots(self.zmq_handle, self.transport, self.bucket_size, self._make_memory, mapped)

    def _fence_types(self, types: set[str], device_resident: bool) -> None:
        """Wait for the copies that touched these device types (the injected device module's
        ``synchronize`` when one was given, else :mod:`verl_fastsync.io.fence`)."""
        if self.device_module is not None:
            if types or device_resident:
                self.device_module.synchronize()
        else:
            for device_type in sorted(types):
                synchronize_device(torch.device(device_type))

    async def async_send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[Any]
    ) -> None:
        """Send ``(name, tensor)`` pairs (sync iterable or async iterator) to the receiver."""
        start = time.perf_counter()
        run = _SendRun(self, self._slots(None))
        try:
            await run.handshake()
            run.phase = "plan"
            if isinstance(weights, AsyncIterable):
                aiterator = weights.__aiter__()
                while True:
                    try:
                        item = await aiterator.__anext__()
                    except StopAsyncIteration:
                        break
                    run.take(item)
                    del item  # no reference to a yielded tensor while the producer makes the next
            else:
                iterator = iter(weights)
                while True:
                    try:
                        item = next(iterator)
                    except StopIteration:
                        break
                    run.take(item)
                    del item
                    await asyncio.sleep(0)
            run.finish()
        except BaseException as exc:
            run.fail(exc)
            raise
        finally:
            run.channel.close()
        self._record(run, time.perf_counter() - start)

    def _record(self, run: _SendRun, seconds: float) -> None:
        total = run.planner.total_bytes
        stats = run.stats
        self.last_metrics = {
            f"{METRIC_PREFIX}bytes": float(total),
            f"{METRIC_PREFIX}buckets": float(stats["buckets"]),
            f"{METRIC_PREFIX}tensors": float(run.planner.num_tensors),
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


class _SendRun:
    """The state of one sync on the sender (channel, open bucket, buckets in flight)."""

    def __init__(self, owner: ColocatedSender, slots: _SenderSlots) -> None:
        self.owner = owner
        self.hook = owner._hook
        self.slots = slots
        self.sync_id = uuid.uuid4().hex[:12]
        self.channel = _Channel(owner.zmq_handle, "sender", owner.timeout_s, bind=True)
        self.planner = colocated_planner(owner.bucket_size, acquire=self._acquire, on_full=self._on_full)
        self.inflight: dict[int, tuple[int, list[str]]] = {}  # slot -> (seq, tensor names)
        self.seq = 0  # the next bucket to open
        self.open_device = torch.device("cpu")  # where the bucket being packed lives
        self.finishing = self.final_sent = False
        self.stats: dict[str, Any] = {"slot_waits": 0, "slot_wait_s": 0.0, "chunked": 0, "buckets": 0}
        self.phase = "hello"
        self.names_in_flight: list[str] = []
        self.peer_reported = False  # the failure is the receiver's own report: no abort back

    # ------------------------------------------------------------------ handshake

    def _hello(self) -> Hello:
        return Hello(
            schema_version=SCHEMA_VERSION,
            sync_id=self.sync_id,
            transport=self.owner.transport,
            slots=list(self.slots.descs),
            sender_pid=os.getpid(),
            verify=self.owner.verify,
        )

    async def handshake(self) -> None:
        channel = self.channel
        deadline = time.monotonic() + self.owner.timeout_s
        reply: Message | None = None
        while reply is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise channel._timeout("waiting for", "hello", None, ())
            # short waits that yield to the event loop: the request that starts the receiver may be
            # an awaitable of this same loop (SGLang's update_weights_from_tensor)
            got = channel.recv_within(min(0.005, left), "hello")
            if got is None:
                await asyncio.sleep(0.001)
                continue
            if isinstance(got, Ready):  # a receiver announced itself (again): (re)send the hello
                self.slots = self.owner._slots(tuple(got.mapped))
                channel.send(self._hello(), "hello")
            elif getattr(got, "sync_id", None) == self.sync_id:
                reply = got
                channel.peer_locked = True
            # else: a stale message of an earlier sync (ignored)
        if isinstance(reply, Abort):
            self.peer_reported = True
            raise ColocatedError(f"verl-fastsync sender: the receiver aborted at hello: {reply.reason}")
        if not isinstance(reply, HelloAck):
            raise ColocatedProtocolError(f"verl-fastsync sender: expected hello_ack, got {reply!r}")
        if reply.error is not None:
            self.peer_reported = True
            raise ColocatedError(f"verl-fastsync sender: the receiver could not map the slots: {reply.error}")
        # the receiver maps the slots: drop their names (nothing left in /dev/shm if we are killed)
        sealed = [seal_slot(self.slots.memory, desc) for desc in self.slots.descs]
        self.slots.sealed = self.slots.sealed or all(sealed)

    # ------------------------------------------------------------------ packing

    def take(self, item: Any) -> None:
        """Copy one produced tensor's bytes into the slots (the planner sends buckets as they fill)
        and fence any device copy before returning: the caller then drops its last reference."""
        name, tensor = _pair(item)
        self.names_in_flight = [name]
        device = tensor.device
        self.planner.add(name, tensor)  # copies; keeps no reference
        del tensor
        if device.type != "cpu" or self.open_device.type != "cpu":
            self.owner._fence_types({device.type, self.open_device.type} - {"cpu"}, False)
        self.phase = "plan"

    def _acquire(self, index: int) -> torch.Tensor:
        """The planner needs bucket ``index``'s buffer: its slot, once the receiver released it."""
        slot = index % NUM_SLOTS
        if slot in self.inflight:
            self.phase = "wait-slot"
            self._wait_ack(slot)
        self.phase = "pack"
        self.hook("pack", {"slot": slot, "seq": index})
        self.seq = index + 1
        tensor = self.slots.tensors[slot]
        self.open_device = tensor.device
        return tensor

    def _on_full(self, bucket: Bucket) -> None:
        """A bucket is complete (the planner fenced its copies): hand it to the receiver."""
        self._send(bucket.index, bucket.metas, is_last=self.finishing)

    def _send(self, seq: int, metas: list[ChunkMeta], is_last: bool) -> None:
        slot = seq % NUM_SLOTS
        slot_tensor = self.slots.tensors[slot]
        types = {slot_tensor.device.type} - {"cpu"}
        self.owner._fence_types(types, bool(getattr(self.slots.memory, "device_resident", False)))
        self.hook("fence", {"slot": slot, "seq": seq})
        if self.owner.verify:
            metas = with_checksums(metas, slot_tensor)
        names = [m.name for m in metas]
        self.stats["chunked"] += sum(1 for m in metas if not m.is_whole and m.chunk_offset == 0)
        self.phase = "send-bucket"
        msg = BucketMsg(
            schema_version=SCHEMA_VERSION,
            sync_id=self.sync_id,
            seq=seq,
            slot=slot,
            chunks=metas,
            is_last=is_last,
        )
        self.channel.send(msg, "send-bucket", seq, names)
        self.inflight[slot] = (seq, names)
        self.hook("send", {"slot": slot, "seq": seq, "is_last": is_last})
        self.stats["buckets"] += 1
        self.final_sent = is_last

    def finish(self) -> None:
        """Send the last bucket (an empty one when the sync was empty or its last bucket was sent
        because it was full), then wait for every ack."""
        self.finishing = True
        self.planner.finish()  # the open bucket, if any, goes out through _on_full as the last
        if not self.final_sent:
            self._acquire(self.seq)
            self._send(self.seq - 1, [], is_last=True)
        self.phase = "drain"
        for slot in sorted(self.inflight, key=lambda s: self.inflight[s][0]):
            self._wait_ack(slot)

    def _wait_ack(self, slot: int) -> None:
        channel = self.channel
        aseq, anames = self.inflight[slot]
        t0 = time.perf_counter()
        waited = not channel.socket.poll(0)
        msg = channel.recv("wait-ack", aseq, anames)
        while isinstance(msg, Ready) or (isinstance(msg, HelloAck) and msg.sync_id == self.sync_id):
            msg = channel.recv("wait-ack", aseq, anames)  # late copies of the handshake
        if isinstance(msg, Abort):
            self.peer_reported = True
            raise ColocatedError(f"verl-fastsync sender: the receiver aborted bucket {aseq}: {msg.reason}")
        if not isinstance(msg, Ack) or msg.sync_id != self.sync_id:
            raise ColocatedProtocolError(
                f"verl-fastsync sender: expected the ack of bucket {aseq} (slot {slot}), got {msg!r}"
            )
        if msg.error is not None:
            self.peer_reported = True
            raise ColocatedError(
                f"verl-fastsync sender: the receiver failed on bucket {msg.seq} (tensors {anames[:4]}): "
                f"{msg.error}"
            )
        # acks come in order: one connection keeps order and the receiver handles buckets in order
        if msg.slot != slot or msg.seq != aseq:
            raise ColocatedProtocolError(
                f"verl-fastsync sender: out-of-order ack (bucket {msg.seq}, slot {msg.slot}); "
                f"expected bucket {aseq}, slot {slot}"
            )
        del self.inflight[slot]
        self.hook("ack", {"slot": slot, "seq": aseq})
        if waited:
            self.stats["slot_waits"] += 1
            self.stats["slot_wait_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ failure

    def fail(self, exc: BaseException) -> None:
        """Tell the receiver why (unless the failure is its own report), then let ``exc`` propagate
        (an :class:`Exception` wrapped in a :class:`ColocatedError` naming phase and bucket)."""
        if isinstance(exc, _PeerFailed):
            raise self.channel.peer_failure() from None
        if not self.peer_reported:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            try:
                self.channel.send_nowait(
                    Abort(
                        schema_version=SCHEMA_VERSION,
                        sync_id=self.sync_id,
                        reason=f"{reason} (sender phase {self.phase}, bucket {self.seq - 1})",
                    )
                )
            except Exception:
                pass
        if isinstance(exc, Exception) and not isinstance(exc, ColocatedError):
            raise ColocatedError(
                f"verl-fastsync sender failed in phase {self.phase} (bucket {max(self.seq - 1, 0)}, tensors "
                f"{self.names_in_flight[:4]}): {exc!r}"
            ) from exc


def _pair(item: Any) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise TypeError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str):
        raise TypeError(f"a weight name must be a str, got {type(name).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return name, tensor
