"""The peer side of :mod:`verl_fastsync.tools.crosshost_lanes`: one trainer or rollout rank holding
the ``fastsync`` checkpoint engine inside a namespace (called by name through
:mod:`verl_fastsync.tools.netns_worker`; JSON in, JSON out). Every trainer rank produces the same
weights (the payload of :mod:`verl_fastsync.tools.crosshost_peer`, as ``bfloat16`` tensors)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verl_fastsync.tools.crosshost_peer import _digest, _model, _payload

_STATE: dict[str, Any] = {}


def eng_new(
    transport: str,
    senders: Any,
    trainer: bool,
    is_master: bool,
    bucket: int,
    timeout_s: float,
    hosts: str | None = None,
) -> None:
    """A fresh engine (verl passes ``is_master`` to trainer engines only); ``hosts``: the
    ``engine_kwargs.fastsync.hosts`` key, passed only when given."""
    from verl_fastsync.verl.engine import FastsyncCheckpointEngine

    eng_close()
    kwargs: dict[str, Any] = {"transport": transport, "senders": senders, "timeout_s": timeout_s}
    if hosts is not None:
        kwargs["hosts"] = hosts
    if trainer:
        kwargs["is_master"] = is_master
    _STATE["engine"] = FastsyncCheckpointEngine(bucket_size=bucket, **kwargs)


def eng_prepare() -> dict[str, Any]:
    meta: dict[str, Any] = _STATE["engine"].prepare()
    return meta


def eng_topology(n_actor: int, n_rollout: int, metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's ``init_process_group`` kwargs (actor ranks first), as verl's manager builds them."""
    from verl_fastsync.verl.engine import FastsyncCheckpointEngine

    actor, rollout = FastsyncCheckpointEngine.build_topology(n_actor, n_rollout, metadata)
    return [{k: v[i] for k, v in actor.items()} for i in range(n_actor)] + [
        {k: v[i] for k, v in rollout.items()} for i in range(n_rollout)
    ]


def eng_init(kwargs: dict[str, Any]) -> None:
    _STATE["engine"].init_process_group(**kwargs)


def eng_send(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    data = _payload(nbytes)
    tensors = [(name, data[o : o + s].view(torch.bfloat16)) for name, o, s in _model(nbytes, bucket)]
    start = time.monotonic()
    metrics = asyncio.run(_STATE["engine"].send_weights(iter(tensors)))
    sent = metrics.get("fastsync/transfer/bytes", 0.0)
    return {"start": start, "bytes": sent, "digest": _digest([t for _, t in tensors])}


def eng_receive(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    dest = _STATE.get("dest")
    if dest is None:
        model = _model(nbytes, bucket)
        dest = _STATE["dest"] = {n: torch.zeros(s // 2, dtype=torch.bfloat16) for n, _, s in model}

    async def consume() -> None:
        async for name, tensor in _STATE["engine"].receive_weights():
            dest[name].copy_(tensor)

    asyncio.run(consume())
    return {"end": time.monotonic(), "digest": _digest(list(dest.values()))}


def eng_finalize() -> None:
    _STATE["engine"].finalize()


def eng_close() -> None:
    engine = _STATE.pop("engine", None)
    if engine is not None:
        try:
            engine.finalize()
        except Exception:
            pass
