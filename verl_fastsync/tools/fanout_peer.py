"""The peer side of :mod:`verl_fastsync.tools.fanout` for verl's own ``NIXLCheckpointEngine``: one
trainer or rollout rank inside a namespace, called by name through
:mod:`verl_fastsync.tools.netns_worker` (JSON in, JSON out). verl's engine is created once per
process (as verl's worker does) and taken through verl's per-sync lifecycle: ``prepare``,
``build_topology`` (its chain: trainer rank 0 -> rollout 0 -> rollout 1 -> ...), ``init_process_group``,
``send_weights``/``receive_weights``, ``finalize``. It runs on CPU DRAM with the CPU shims of
:func:`verl_fastsync.tools.bench.baselines.load_verl_nixl_module`. The payload, model and digest are
:mod:`verl_fastsync.tools.crosshost_peer`'s, so its bytes are the fastsync rows' bytes.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from verl_fastsync.tools.crosshost_peer import _digest, _model, _payload

_STATE: dict[str, Any] = {}


def vn_new(trainer: bool, is_master: bool, bucket: int) -> None:
    """verl's engine for this rank (``is_master`` as verl passes it to trainer ranks)."""
    from verl_fastsync.tools.bench.baselines import load_verl_nixl_module

    if "engine" in _STATE and _STATE["bucket"] == bucket and _STATE["master"] == is_master:
        return  # reused from shape to shape, as verl keeps its engine for the whole run
    mod = load_verl_nixl_module()
    _STATE.update(
        mod=mod,
        bucket=bucket,
        master=is_master,
        engine=mod.NIXLCheckpointEngine(bucket_size=bucket, device="cpu", is_master=trainer and is_master),
    )


def vn_prepare() -> dict[str, Any]:
    meta = _STATE["engine"].prepare()
    return {
        "agent_name": meta.agent_name,
        "agent_metadata": base64.b64encode(meta.agent_metadata).decode(),
        "zmq_ip": meta.zmq_ip,
        "zmq_port": meta.zmq_port,
    }


def vn_topology(n_actor: int, n_rollout: int, metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's ``init_process_group`` kwargs (actor ranks first) from verl's ``build_topology``,
    metadata as JSON (base64 agent metadata)."""
    from verl_fastsync.tools.bench.baselines import load_verl_nixl_module

    mod = load_verl_nixl_module()
    full = [
        mod.NixlAgentMetadata(**dict(m, agent_metadata=base64.b64decode(m["agent_metadata"])))
        for m in metadata
    ]
    actor, rollout = mod.NIXLCheckpointEngine.build_topology(n_actor, n_rollout, full)
    per_rank = [{k: v[i] for k, v in actor.items() if k != "method"} for i in range(n_actor)]
    per_rank += [{k: v[i] for k, v in rollout.items() if k != "method"} for i in range(n_rollout)]
    if n_rollout == 1:
        # verl's build_topology gives a single rollout rank the whole list as "next" (metadata[0:]);
        # the last rank of the chain has no next agent (baselines.NIXL_SHIMS says the same)
        per_rank[-1]["next_agent_metadata"] = None
    for kw in per_rank:
        for key in ("prev_agent_metadata", "next_agent_metadata"):
            m = kw[key]
            if m is not None:
                kw[key] = {
                    "agent_name": m.agent_name,
                    "agent_metadata": base64.b64encode(m.agent_metadata).decode(),
                    "zmq_ip": m.zmq_ip,
                    "zmq_port": m.zmq_port,
                }
    return per_rank


def vn_init(kwargs: dict[str, Any]) -> None:
    mod = _STATE["mod"]
    for key in ("prev_agent_metadata", "next_agent_metadata"):
        m = kwargs[key]
        if m is not None:
            kwargs[key] = mod.NixlAgentMetadata(
                **dict(m, agent_metadata=base64.b64decode(m["agent_metadata"]))
            )
    _STATE["engine"].init_process_group(**kwargs)


def vn_send(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    data = _payload(nbytes)
    tensors = [(name, data[o : o + s].view(torch.bfloat16)) for name, o, s in _model(nbytes, bucket)]
    start = time.monotonic()
    asyncio.run(_STATE["engine"].send_weights(iter(tensors)))
    return {"start": start, "bytes": float(nbytes), "digest": _digest([t for _, t in tensors])}


def vn_receive(nbytes: int, bucket: int) -> dict[str, Any]:
    import torch

    dest = _STATE.get(f"dest {nbytes}")
    if dest is None:
        dest = {n: torch.zeros(s // 2, dtype=torch.bfloat16) for n, _, s in _model(nbytes, bucket)}
        _STATE[f"dest {nbytes}"] = dest

    async def consume() -> None:
        async for name, tensor in _STATE["engine"].receive_weights():
            dest[name].copy_(tensor)

    asyncio.run(consume())
    return {"end": time.monotonic(), "digest": _digest(list(dest.values()))}


def vn_finalize() -> None:
    _STATE["engine"].finalize()
