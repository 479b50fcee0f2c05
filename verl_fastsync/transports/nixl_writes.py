"""The ``nixl`` sender's WRITEs: the bucket in flight, and the WRITEs a failed sync abandoned.

A NIXL WRITE lands in the receiver's memory without the receiver doing anything, and NIXL's
``release_xfer_handle`` may not cancel one still in progress. So a WRITE the sender gives up on (its
sync failed) is not forgotten: its handle stays here, *abandoned*, and is progressed until it leaves
the in-progress state (``DONE`` or ``ERR``); only then is it released. While any abandoned WRITE may
still move, the sender neither frees nor refills the buffer it reads, and it tells no receiver
it targets that a new sync may start (the ``Welcome`` of the next sync waits for them, bounded by
``timeout_s``): that is what makes "a receiver that saw the next ``Welcome`` may reuse its buffers"
true whatever order UCX delivers in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from verl_fastsync.wire import BucketReady

__all__ = ["BucketWrite", "WriteFailedError", "Writes"]

_POLL_SLEEP_S = 0.0002  # between state checks (each check progresses UCX); don't spin a core


class WriteFailedError(RuntimeError):
    """NIXL reported a WRITE of the bucket in flight as failed (``ident``: the receiver)."""

    def __init__(self, ident: bytes) -> None:
        super().__init__("WRITE failed")
        self.ident = ident


@dataclass
class BucketWrite:
    """One bucket's WRITEs, started and not yet seen complete (its ``BucketReady`` waits for them)."""

    slot: int
    message: BucketReady
    deadline: float
    handles: list[tuple[bytes, str, Any]] = field(default_factory=list)
    """``(receiver routing id, remote agent name, transfer handle)`` per receiver."""


class Writes:
    """The sender's WRITE bookkeeping (see the module docstring); ``agent`` is its NIXL agent."""

    def __init__(self) -> None:
        self.current: BucketWrite | None = None
        self.abandoned: list[tuple[str, Any]] = []
        """``(remote agent name, handle)`` of WRITEs given up on and maybe still in progress."""

    def pending(self, agent: Any) -> list[bytes]:
        """Receivers whose WRITE of the current bucket is still moving (each check progresses UCX).
        Raises :class:`WriteFailedError` for one that failed."""
        write = self.current
        if write is None:
            return []
        waiting: list[bytes] = []
        for ident, _name, handle in write.handles:
            state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise WriteFailedError(ident)
            if state != "DONE":
                waiting.append(ident)
        return waiting

    def finish(self, agent: Any) -> BucketWrite | None:
        """The current bucket landed everywhere: release its handles and hand it back."""
        write, self.current = self.current, None
        if write is not None:
            for _ident, _name, handle in write.handles:
                _release(agent, handle)
        return write

    def abandon(self) -> None:
        """The sync failed with the current bucket's WRITEs maybe in flight: keep their handles."""
        write, self.current = self.current, None
        if write is not None:
            self.abandoned.extend((name, handle) for _ident, name, handle in write.handles)

    def settle(self, agent: Any, deadline: float, agents: set[str] | None = None) -> list[str]:
        """Progress the abandoned WRITEs (those to ``agents`` only, when given) until each left the
        in-progress state or ``deadline`` passed; release those that did. Returns the remote agents
        of the WRITEs still in progress."""
        while True:
            still: list[tuple[str, Any]] = []
            for name, handle in self.abandoned:
                if agents is not None and name not in agents:
                    still.append((name, handle))
                    continue
                try:
                    state = agent.check_xfer_state(handle)
                except Exception:  # the handle is unusable: nothing of it can move any more
                    state = "ERR"
                if state == "PROC":
                    still.append((name, handle))
                else:
                    _release(agent, handle)
            self.abandoned = still
            moving = sorted({name for name, _ in still if agents is None or name in agents})
            if not moving or time.monotonic() >= deadline:
                return moving
            time.sleep(_POLL_SLEEP_S)

    @property
    def idle(self) -> bool:
        """No WRITE of this sender can be moving (none current, none abandoned)."""
        return self.current is None and not self.abandoned


def _release(agent: Any, handle: Any) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # pragma: no cover - best effort
        pass
