"""The peer side of :mod:`verl_fastsync.tools.delta_bench` (called by name through
:mod:`verl_fastsync.tools.netns_worker`; JSON in, JSON out): the trainer rank trains a small model
with AdamW (fp32 master weights) and offers its ``bfloat16`` cast as the weights of each sync; each
side holds two ``fastsync`` engines, ``full`` (``delta=false``) and ``delta`` (``delta=true``), so the
two are measured on the same weights in the same run."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

_STATE: dict[str, Any] = {}


def _digest(tensors: list[Any]) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        if t.numel():
            h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def train_init(width: int, layers: int, seed: int) -> dict[str, Any]:
    """A stack of ``layers`` MLP blocks (``width`` -> 4 x ``width`` -> ``width``, LayerNorm, residual)."""
    import torch

    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [
            torch.nn.LayerNorm(width),
            torch.nn.Linear(width, 4 * width),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width),
        ]
    model = torch.nn.Sequential(*blocks)
    _STATE["model"] = model
    _STATE["opt"] = None
    _STATE["width"] = width
    _publish()
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": _STATE["bytes"]}


def train_step(lr: float, reinit: bool = False) -> dict[str, Any]:
    """One AdamW step at ``lr`` on a random regression batch (``reinit``: new random weights
    instead, so every value changes)."""
    import torch

    model = _STATE["model"]
    if reinit:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * p.std().clamp_min(1e-3))
        _STATE["opt"] = None
    else:
        opt = _STATE.get("opt")
        if opt is None or opt.param_groups[0]["lr"] != lr:
            opt = _STATE["opt"] = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        x = torch.randn(16, _STATE["width"])
        loss = torch.nn.functional.mse_loss(model(x), torch.randn_like(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
    previous = _STATE["weights"]
    _publish()
    changed = total = 0
    for (_, old), (_, new) in zip(previous, _STATE["weights"], strict=True):
        changed += int((old.view(torch.int16) != new.view(torch.int16)).sum())
        total += new.numel()
    return {"changed_fraction": changed / total}


def _publish() -> None:
    import torch

    with torch.no_grad():
        weights = [
            (name, p.detach().to(torch.bfloat16).clone()) for name, p in _STATE["model"].named_parameters()
        ]
    _STATE["weights"] = weights
    _STATE["bytes"] = sum(t.numel() * t.element_size() for _, t in weights)


def eng_new(
    name: str, transport: str, delta: bool, trainer: bool, bucket: int, timeout_s: float
) -> dict[str, Any]:
    """Makes the engine; returns the CPUs this process runs on and the delta codec's thread count."""
    from verl_fastsync.delta.compare import THREADS
    from verl_fastsync.verl.engine import FastsyncCheckpointEngine

    kwargs: dict[str, Any] = {"transport": transport, "delta": delta, "timeout_s": timeout_s}
    if trainer:
        kwargs["is_master"] = True
    engines = _STATE.setdefault("engines", {})
    engines[name] = FastsyncCheckpointEngine(bucket_size=bucket, **kwargs)
    return {"cpus": sorted(os.sched_getaffinity(0)), "codec_threads": THREADS}


def eng_prepare(name: str) -> dict[str, Any]:
    meta: dict[str, Any] = _STATE["engines"][name].prepare()
    return meta


def eng_topology(metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from verl_fastsync.verl.engine import FastsyncCheckpointEngine

    actor, rollout = FastsyncCheckpointEngine.build_topology(1, 1, metadata)
    return [{k: v[0] for k, v in actor.items()}, {k: v[0] for k, v in rollout.items()}]


def eng_init(name: str, kwargs: dict[str, Any]) -> None:
    _STATE["engines"][name].init_process_group(**kwargs)


def eng_send(name: str) -> dict[str, Any]:
    weights = _STATE["weights"]
    start = time.monotonic()
    metrics = asyncio.run(_STATE["engines"][name].send_weights(iter(weights)))
    return {"start": start, "metrics": metrics, "digest": _digest([t for _, t in weights])}


def eng_receive(name: str) -> dict[str, Any]:
    import torch

    engine = _STATE["engines"][name]
    dest: dict[str, Any] = _STATE.setdefault("dest", {})

    async def consume() -> None:
        async for key, tensor in engine.receive_weights():
            held = dest.get(key)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                held = dest[key] = torch.empty_like(tensor)
            held.copy_(tensor)  # as vLLM's load_weights copies into its parameters

    asyncio.run(consume())
    end = time.monotonic()
    return {"end": end, "metrics": dict(engine.last_metrics), "digest": _digest(list(dest.values()))}


def eng_finalize(name: str) -> None:
    _STATE["engines"][name].finalize()


def close() -> None:
    for engine in _STATE.pop("engines", {}).values():
        try:
            engine.finalize()
        except Exception:
            pass
