"""The persistent, double-buffered slots of this process (sender and receiver side)."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verl_fastsync.colocated.memory import SlotMemory
from verl_fastsync.colocated.protocol import SlotDesc

logger = logging.getLogger(__name__)


@dataclass
class _SenderSlots:
    memory: SlotMemory
    nbytes: int
    tensors: list[torch.Tensor]
    descs: list[SlotDesc]
    sealed: bool = False
    """The receiver mapped them and they can no longer be attached by another process."""

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(d.token for d in self.descs)


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
    zmq_handle: str,
    memory_name: str,
    nbytes: int,
    make: Callable[[], SlotMemory],
    mapped: tuple[str, ...] | None = None,
) -> _SenderSlots:
    """This process's slots for ``zmq_handle``, (re-)allocated when the bucket size changed or when
    they are sealed and the receiver (``mapped``: the tokens it maps) does not map them."""
    key = (zmq_handle, memory_name)
    with _LOCK:
        current = _SENDER_SLOTS.get(key)
        stale = current is not None and current.sealed and mapped is not None and mapped != current.tokens
        if current is not None and current.nbytes == nbytes and not stale:
            return current
        if current is not None:
            logger.info(
                "verl-fastsync: re-allocating the slots of %s (%s)",
                zmq_handle,
                "a new receiver" if stale else f"bucket size {current.nbytes} -> {nbytes} bytes",
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
