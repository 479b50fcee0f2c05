"""The TCP-controlled base of the multi-host engine transports (``nixl``, ``nccl``).

:class:`TcpControlledTransport` speaks the control protocol of
:class:`~verl_fastsync.transports.controlled.ControlledTransport` over ``tcp://`` (bound on
``options.host``, or this host's address) instead of a private ``ipc://`` socket, so receivers may
live on other hosts. It owns no buffers: a subclass provides them and moves the bytes (NIXL WRITEs,
NCCL broadcasts).
"""

from __future__ import annotations

from typing import Any

from verl_fastsync.transports.base import TransportError, default_host
from verl_fastsync.transports.controlled import ControlledTransport

__all__ = ["TcpControlledTransport"]


class TcpControlledTransport(ControlledTransport):
    """Control protocol over TCP; subclasses supply buffers and data movement."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._bind_addr = ""

    def _control_host(self) -> str:
        self._bind_addr = self.options.host or default_host()
        return self._bind_addr

    @classmethod
    def _topology_extra(
        cls, actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        endpoint = actor_metadata[0].get("endpoint")
        if not endpoint:
            raise TransportError(
                f"{cls.name} transport: trainer rank 0 reported no control endpoint (is_master=True?)"
            )
        return {"endpoint": endpoint}
