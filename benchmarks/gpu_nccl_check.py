"""GPU check of the ``nccl`` engine transport on one GPU, plain and with delta sync; no verl.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless they look like
two hosts: each rank here sets its own ``NCCL_HOSTID``, so NCCL connects them with its network (socket)
transport, as it would two hosts. Trainer rank 0 and one rollout rank run the transport's lifecycle the
way verl's manager drives it (``prepare``, ``build_topology``, ``init_process_group``, send / receive,
``finalize``) for every sync. The trainer's weights live on the GPU (bf16, one tensor larger than the
bucket: chunked); between syncs 3% of every tensor's elements change. Plain syncs yield device tensors;
delta syncs (:class:`DeltaEncoder` on the sender, with a bucket flushed per bucket of model bytes, as the
engine does; :class:`DeltaDecoder` on the receiver) yield host tensors. The receiver rebuilds the
expected weights itself (same seeds) and checks every yielded tensor byte for byte.

Run: ``python benchmarks/gpu_nccl_check.py --out nccl_gpu.json [--mib 512] [--bucket-mib 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

MIB = 1 << 20


def _model(mib: int, bucket: int, step: int) -> list[tuple[str, Any]]:
    """bf16 tensors on the GPU: 8 equal ones and one of 2.5 buckets; each step changes 3% of them."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    each = max(1, (mib * MIB - 5 * bucket // 2) // 8 // 2)
    shapes = [(f"layer{i}.weight", (each,)) for i in range(8)] + [("embed.weight", (5 * bucket // 4,))]
    model = [
        (name, torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)) for name, shape in shapes
    ]
    for k in range(1, step + 1):
        gen = torch.Generator(device="cuda").manual_seed(k)
        for _, tensor in model:
            pick = torch.rand(tensor.shape, generator=gen, device="cuda") < 0.03
            tensor[pick] = (tensor[pick].float() + 0.01).to(torch.bfloat16)
    torch.cuda.synchronize()
    return model


def _digest(tensor: Any) -> int:
    import torch
    import xxhash

    host = tensor.detach().to("cpu").contiguous().view(-1)
    return xxhash.xxh3_64_intdigest(host.view(torch.uint8).numpy().data)


def _rank(rank: int, conn: Connection, mib: int, bucket: int) -> None:
    os.environ["NCCL_HOSTID"] = f"fastsync-gpu-check-{rank}"  # two "hosts" on one GPU (see docstring)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # their "network" is this machine's loopback
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    try:
        from verl_fastsync.delta.stream import DeltaDecoder, DeltaEncoder
        from verl_fastsync.transports.base import TransportOptions
        from verl_fastsync.transports.nccl import NcclTransport
        from verl_fastsync.transports.sending import flush_every

        transport = NcclTransport(TransportOptions(device="cuda", timeout_s=120.0, is_master=rank == 0))
        encoder, decoder = DeltaEncoder(), DeltaDecoder()
        while True:
            cmd, args = conn.recv()
            if cmd == "exit":
                conn.send(("ok", None))
                return
            if cmd == "prepare":
                conn.send(("ok", dict(transport.prepare(), bucket_size=bucket)))
            elif cmd == "init":
                transport.init_process_group(**args)
                conn.send(("ok", None))
            elif cmd == "finalize":
                transport.finalize()
                conn.send(("ok", None))
            elif cmd == "sync":
                conn.send(
                    (
                        "ok",
                        asyncio.run(
                            _sync(rank, transport, encoder, decoder, flush_every, mib, bucket, **args)
                        ),
                    )
                )
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _sync(
    rank: int, transport: Any, encoder: Any, decoder: Any, flush_every: Any, mib: int, bucket: int,
    step: int, delta: bool, against: str | None, epoch: str,
) -> dict[str, Any]:  # fmt: skip
    model = _model(mib, bucket, step)
    start = time.perf_counter()
    if rank == 0:
        if delta:
            encoder.begin(against, epoch)
            stats = encoder.stats
            items: Any = flush_every(encoder.stream(model), bucket, lambda: stats.model_bytes)
        else:
            items = model
        sent = await transport.send(items)
        seconds = time.perf_counter() - start
        if delta:
            encoder.commit()
        out = {"seconds": seconds, "wire_bytes": sent.bytes, "buckets": sent.buckets}
        if delta:
            out.update(model_bytes=encoder.stats.model_bytes, delta_tensors=encoder.stats.delta_tensors,
                       encode_s=encoder.stats.codec_s)  # fmt: skip
        return out
    want = {name: _digest(tensor) for name, tensor in model}
    if delta:
        decoder.begin(against, epoch)
    got: dict[str, int] = {}
    devices = set()
    async for name, tensor in transport.receive():
        if delta:
            name, tensor = decoder.decode(name, tensor)
        devices.add(tensor.device.type)
        got[name] = _digest(tensor)
    seconds = time.perf_counter() - start
    if delta:
        decoder.commit()
    bad = sorted(n for n in want if got.get(n) != want[n])
    return {
        "seconds": seconds,
        "exact": not bad and set(got) == set(want),
        "bad": bad,
        "devices": sorted(devices),
    }


def _call(conns: list[Connection], cmd: str, args: list[Any], timeout: float = 300.0) -> list[Any]:
    for conn, arg in zip(conns, args, strict=True):
        conn.send((cmd, arg))
    out = []
    for i, conn in enumerate(conns):
        if not conn.poll(timeout):
            raise TimeoutError(f"rank {i}: no answer to {cmd} in {timeout} s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"rank {i}: {cmd}: {value}")
        out.append(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    bucket = args.bucket_mib * MIB
    from verl_fastsync.transports.nccl import NcclTransport

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(rank, child, args.mib, bucket), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    result: dict[str, Any] = {"mib": args.mib, "bucket_mib": args.bucket_mib, "syncs": []}
    plan = [(0, False), (1, False), (0, True), (1, True), (2, True), (3, True)]
    epoch: str | None = None
    try:
        for step, delta in plan:
            meta = _call(conns, "prepare", [None, None])
            actor, rollout = NcclTransport.build_topology(1, 1, meta)
            _call(conns, "init", [{k: v[0] for k, v in actor.items()}, {k: v[0] for k, v in rollout.items()}])
            new_epoch = f"e{step}"
            sync = {"step": step, "delta": delta, "against": epoch if delta else None, "epoch": new_epoch}
            sender, receiver = _call(conns, "sync", [sync, sync])
            _call(conns, "finalize", [None, None])
            if delta:
                epoch = new_epoch
            row = {
                "step": step,
                "delta": delta,
                "diffed": sync["against"] is not None,
                "sender": sender,
                "receiver": receiver,
            }
            result["syncs"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)
            if not receiver["exact"]:
                raise AssertionError(f"sync {row}: the received weights differ from the trainer's")
        _call(conns, "exit", [None, None], timeout=60)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
