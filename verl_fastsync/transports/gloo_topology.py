"""What every rank of a gloo group is handed (``build_topology``): the store's endpoint, the data host
and which group it builds or reuses (see the "Group epoch" part of :mod:`~verl_fastsync.transports.gloo`),
a function of the metadata every rank reported, so both sides agree without a handshake."""

from __future__ import annotations

import uuid
from typing import Any

from verl_fastsync.transports.base import TransportError

__all__ = ["choose_group", "topology_extra"]


def topology_extra(
    actor_metadata: list[dict[str, Any]], rollout_metadata: list[dict[str, Any]]
) -> dict[str, Any]:
    """The values every rank gets, from trainer rank 0's metadata (its store) and the rollout ranks'."""
    master = actor_metadata[0]
    if "port" not in master:
        raise TransportError("gloo transport: trainer rank 0 reported no store (is_master=True?)")
    local = all(m.get("host") == master.get("host") for m in rollout_metadata)
    return {
        "master_addr": "127.0.0.1" if local else master["addr"],
        "master_port": master["port"],
        "data_host": "127.0.0.1" if local else "",
        "gloo_group": choose_group(master, rollout_metadata),
    }


def choose_group(master: dict[str, Any], rollout_metadata: list[dict[str, Any]]) -> str:
    """The sender's epoch when every participant holds that group with the rank and world size it
    gets now (everyone reuses), else a fresh epoch (everyone rebuilds)."""
    world = 1 + len(rollout_metadata)
    held = master.get("gloo_group")
    fresh = str(master.get("gloo_next") or uuid.uuid4().hex)
    if not isinstance(held, list | tuple) or len(held) != 3 or list(held[1:]) != [0, world]:
        return fresh
    epoch = held[0]
    for rank, meta in enumerate(rollout_metadata, start=1):
        state = meta.get("gloo_group")
        if not isinstance(state, list | tuple) or list(state) != [epoch, rank, world]:
            return fresh
    return str(epoch)
