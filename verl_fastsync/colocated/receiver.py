"""The colocated receiver (drop-in for verl's ``BucketedWeightReceiver``)."""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from verl_fastsync.chunks import (
    Assembler,
    ChunkCorruptedError,
    ChunkMeta,
    bucket_chunk_views,
    chunk_checksum,
    str_to_dtype,
)
from verl_fastsync.colocated.channel import HELLO_RESEND_S, EventHook, _Channel, _noop_hook
from verl_fastsync.colocated.memory import SlotMemory, _device_module, _resolve_memory
from verl_fastsync.colocated.planner import _EXPERT_STACKED
from verl_fastsync.colocated.protocol import (
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
    _PeerFailed,
)
from verl_fastsync.colocated.slots import (
    _LAST_METRICS,
    _LOCK,
    _RECEIVER_SLOTS,
    _ReceiverSlots,
    _register_atexit,
    _release_receiver,
)

logger = logging.getLogger(__name__)

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
