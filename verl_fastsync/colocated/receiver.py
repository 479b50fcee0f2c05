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
from verl_fastsync.colocated.memory import SlotMemory, _resolve_memory
from verl_fastsync.colocated.planner import is_expert_slice
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
from verl_fastsync.io.fence import synchronize_device

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
    0.7.1/0.8.0 pass one argument, 0.9.x two); ``callback_is_last`` forces either.

    Lifetime of the tensors handed over:

    * ``zero_copy=False`` (default): each tensor is the receiver's own copy on ``device`` (a chunked
      one is merged into one), valid for as long as the consumer holds it.
    * ``zero_copy=True``: whole tensors are views into the slot, valid only during the callback
      (verl's own receiver has this contract, and verl's callbacks copy or clone what they keep).
      After the callback the receiver checks that no view into the slot is still referenced; a
      consumer that kept one fails the sync with an error saying so (both sides), rather than
      reading bytes the next bucket overwrites.

    At most one chunked tensor is assembled at a time (the sender never starts one in a bucket that
    holds the end of another), so the merge memory (``recv_merge_peak_bytes``) is the largest
    chunked tensor; it counts merged tensors until the callback that receives them returns.

    Any failure (protocol error, timeout, a raising or interrupted callback, ``KeyboardInterrupt``,
    cancellation) is reported to the sender with its reason before this side raises; a bucket whose
    callback did not return normally is never acknowledged as loaded.

    :param expert_slice_loader: optional ``fn(name, first_expert, stop_expert, tensor)`` that takes
        expert-aligned chunks of stacked MoE tensors directly from the slot (no merge buffer; the
        ``zero_copy`` rule applies to them too).
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
        zero_copy: bool = False,
    ) -> None:
        self.zmq_handle = zmq_handle
        self.device = torch.device(device)
        self.use_shm = bool(use_shm)
        self.timeout_s = _check_timeout(timeout_s)
        self.device_module = device_module
        self._memory = memory
        self.callback_is_last = callback_is_last
        self.expert_slice_loader = expert_slice_loader
        self.zero_copy = bool(zero_copy)
        self._hook = event_hook or _noop_hook
        self.last_metrics: dict[str, float] = {}

    def _sync_device(self) -> None:
        if self.device_module is not None:
            self.device_module.synchronize()
        else:
            synchronize_device(self.device)
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

    def _mapped(self) -> list[str]:
        with _LOCK:
            current = _RECEIVER_SLOTS.get(self.zmq_handle)
            return list(current.tokens) if current is not None else []

    def receive_weights(self, on_bucket_received: Callable[..., Any]) -> None:
        """Receive one sync; call ``on_bucket_received`` once per bucket."""
        start = time.perf_counter()
        with_is_last = self.callback_is_last
        if with_is_last is None:
            with_is_last = _wants_is_last(on_bucket_received)
        run = _ReceiveRun(self)
        try:
            slots, verify = run.handshake()
            assembler = Assembler(self.device, zero_copy=self.zero_copy, verify=verify)
            while not run.next_bucket(slots, assembler, on_bucket_received, with_is_last):
                pass
        except BaseException as exc:
            run.fail(exc)
            raise
        finally:
            run.channel.close()
        seconds = time.perf_counter() - start
        self.last_metrics = {
            f"{METRIC_PREFIX}recv_bytes": float(run.nbytes),
            f"{METRIC_PREFIX}recv_buckets": float(run.nbuckets),
            f"{METRIC_PREFIX}recv_seconds": seconds,
            f"{METRIC_PREFIX}recv_callback_seconds": run.callback_s,
            f"{METRIC_PREFIX}recv_merge_peak_bytes": float(run.merge_peak),
            f"{METRIC_PREFIX}recv_copied_bytes": float(run.copied),
        }
        _LAST_METRICS["receiver"] = dict(self.last_metrics)
        logger.info(
            "verl-fastsync colocated receive: %.1f MB in %d buckets, %.3f s (%.3f s in the loader)",
            run.nbytes / 1e6,
            run.nbuckets,
            seconds,
            run.callback_s,
        )

    def _views(
        self, slot: torch.Tensor, metas: list[ChunkMeta], assembler: Assembler
    ) -> tuple[list[tuple[str, torch.Tensor]], int, int]:
        """The bucket's completed tensors, the bytes of those merged from chunks, and the bytes
        copied out of the slot for the consumer."""
        weights: list[tuple[str, torch.Tensor]] = []
        merged = copied = 0
        for meta, data in bucket_chunk_views(slot, metas):
            if self.expert_slice_loader is not None and not meta.is_whole and is_expert_slice(meta):
                if assembler.verify and chunk_checksum(data.cpu()) != meta.checksum:
                    raise ChunkCorruptedError(
                        f"tensor {meta.name!r}: chunk at byte {meta.chunk_offset} does not match the "
                        f"sender's checksum"
                    )
                dtype = str_to_dtype(meta.dtype)
                row = meta.total_bytes // meta.shape[0]
                first, stop = meta.chunk_offset // row, (meta.chunk_offset + meta.chunk_size) // row
                view = data if data.device == self.device else data.to(self.device)
                if not self.zero_copy and view.data_ptr() == data.data_ptr():
                    view = view.clone()
                    copied += view.numel()
                self.expert_slice_loader(
                    meta.name, first, stop, view.view(dtype).view((stop - first, *meta.shape[1:]))
                )
                del view
                continue
            done = assembler.feed(meta, data)
            if done and not meta.is_whole:
                merged += meta.total_bytes
            elif done and (data.device != self.device or not self.zero_copy):
                copied += meta.total_bytes
            weights.extend(done)
        return weights, merged, copied


def _storage_refs(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s storage (``None`` where torch cannot tell)."""
    try:
        return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))
    except Exception:  # pragma: no cover - a torch without this introspection
        return None


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _ReceiveRun:
    """The state of one sync on the receiver."""

    def __init__(self, owner: ColocatedReceiver) -> None:
        self.owner = owner
        self.hook = owner._hook
        self.channel = _Channel(owner.zmq_handle, "receiver", owner.timeout_s, bind=False)
        self.sync_id = ""
        self.phase = "hello"
        self.expected_seq = 0
        self.in_bucket: tuple[int, int, list[str]] | None = None  # (seq, slot, names) being loaded
        self.peer_reported = False  # the failure is the sender's own abort: nothing to report back
        self.nbytes = self.nbuckets = self.merge_peak = self.copied = 0
        self.callback_s = 0.0

    def handshake(self) -> tuple[_ReceiverSlots, bool]:
        channel = self.channel
        deadline = time.monotonic() + self.owner.timeout_s
        hello: Message | None = None
        ready = Ready(schema_version=SCHEMA_VERSION, receiver_pid=os.getpid(), mapped=self.owner._mapped())
        while not isinstance(hello, Hello):
            left = deadline - time.monotonic()
            if left <= 0:
                raise channel._timeout("waiting for", "hello", None, ())
            channel.send(ready, "hello")
            hello = channel.recv_within(min(HELLO_RESEND_S, left), "hello")
            if isinstance(hello, Abort):
                self.peer_reported = True
                raise ColocatedError(f"verl-fastsync receiver: the sender aborted: {hello.reason}")
        self.sync_id = hello.sync_id
        try:
            slots = self.owner._attach(hello)
        except Exception as exc:
            channel.send(
                HelloAck(schema_version=SCHEMA_VERSION, sync_id=self.sync_id, error=_reason(exc)), "hello"
            )
            self.peer_reported = True  # told the sender already
            raise
        self.hook("hello_ack", {"tokens": slots.tokens})
        channel.send(HelloAck(schema_version=SCHEMA_VERSION, sync_id=self.sync_id), "hello")
        return slots, hello.verify

    def next_bucket(
        self,
        slots: _ReceiverSlots,
        assembler: Assembler,
        callback: Callable[..., Any],
        with_is_last: bool,
    ) -> bool:
        """Receive, load and acknowledge one bucket; True after the last one."""
        channel = self.channel
        self.phase = "wait-bucket"
        msg = channel.recv(self.phase, self.expected_seq, ())
        while isinstance(msg, Hello) and msg.sync_id == self.sync_id:  # resent hello: answer again
            channel.send(HelloAck(schema_version=SCHEMA_VERSION, sync_id=self.sync_id), "hello")
            msg = channel.recv(self.phase, self.expected_seq, ())
        if isinstance(msg, Abort):
            self.peer_reported = True
            raise ColocatedError(f"verl-fastsync receiver: the sender aborted: {msg.reason}")
        if not isinstance(msg, BucketMsg) or msg.sync_id != self.sync_id:
            raise ColocatedProtocolError(
                f"verl-fastsync receiver: expected bucket {self.expected_seq}, got {msg!r}"
            )
        if msg.seq != self.expected_seq or not 0 <= msg.slot < len(slots.tensors):
            raise ColocatedProtocolError(
                f"verl-fastsync receiver: bucket {msg.seq} in slot {msg.slot}; expected bucket "
                f"{self.expected_seq} in one of {len(slots.tensors)} slots"
            )
        seq, names = msg.seq, [m.name for m in msg.chunks]
        self.in_bucket = (seq, msg.slot, names)
        self.phase = "load"
        slot = slots.tensors[msg.slot]
        self.hook("bucket", {"seq": seq, "slot": msg.slot, "view": slot, "names": names})
        refs = _storage_refs(slot)
        try:
            weights, merged, copied = self.owner._views(slot, msg.chunks, assembler)
            self.merge_peak = max(self.merge_peak, assembler.in_progress_bytes + merged)
            self.copied += copied
            if msg.is_last:
                assembler.finish()
            t0 = time.perf_counter()
            if with_is_last:
                callback(weights, msg.is_last)
            else:
                callback(weights)
            self.callback_s += time.perf_counter() - t0
            self.owner._sync_device()
            del weights
        except Exception as exc:
            raise ColocatedError(
                f"verl-fastsync receiver failed loading bucket {seq} (tensors {names[:4]}): {_reason(exc)}"
            ) from exc
        self.hook("views_dropped", {"seq": seq})
        kept = _storage_refs(slot)
        if refs is not None and kept is not None and kept > refs:
            raise ColocatedError(
                f"verl-fastsync receiver: the consumer kept {kept - refs} view(s) into the slot of bucket "
                f"{seq} (tensors {names[:4]}) past its callback; with zero_copy=True a tensor is valid only "
                f"during the callback (the next bucket overwrites it): clone what you keep, or use "
                f"zero_copy=False"
            )
        # the views are dropped and the device is synced: the sender may now repack this slot
        self.hook("ack", {"seq": seq, "slot": msg.slot})  # recorded before it leaves
        channel.send(
            Ack(schema_version=SCHEMA_VERSION, sync_id=self.sync_id, seq=seq, slot=msg.slot),
            "ack",
            seq,
            names,
        )
        self.in_bucket = None
        self.nbytes += sum(m.chunk_size for m in msg.chunks)
        self.nbuckets += 1
        self.expected_seq += 1
        return msg.is_last

    def fail(self, exc: BaseException) -> None:
        """Tell the sender why this side fails (never as a success ack), unless the failure is the
        sender's own report; then let ``exc`` propagate."""
        if isinstance(exc, _PeerFailed):
            raise self.channel.peer_failure() from None
        if self.peer_reported or not self.sync_id:
            return  # before the hello there is no sync to fail
        where = f"receiver phase {self.phase}"
        try:
            if self.in_bucket is not None:
                seq, slot, _names = self.in_bucket
                self.channel.send_nowait(
                    Ack(
                        schema_version=SCHEMA_VERSION,
                        sync_id=self.sync_id,
                        seq=seq,
                        slot=slot,
                        error=f"{_reason(exc)} ({where})",
                    )
                )
            else:
                self.channel.send_nowait(
                    Abort(
                        schema_version=SCHEMA_VERSION,
                        sync_id=self.sync_id,
                        reason=f"{_reason(exc)} ({where}, waiting for bucket {self.expected_seq})",
                    )
                )
        except Exception:  # the sender is gone: nothing to tell
            pass
