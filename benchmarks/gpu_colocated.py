#!/usr/bin/env python
"""Single-GPU check of the colocated CUDA-IPC path (no verl needed: torch + CUDA + this package).

Two processes on one GPU, as trainer and vLLM worker are in colocated mode: this process sends a
synthetic ~16 GB bf16 model through :class:`verl_fastsync.colocated.ColocatedSender` (``ipc``
transport: two persistent slots exported once), a spawned process receives it with
:class:`~verl_fastsync.colocated.ColocatedReceiver` and copies every tensor into its own
preallocated parameters (what a model loader does). The model has an embedding and an LM head
larger than a bucket (flat chunks) and MoE layers with experts stacked ``[E, ...]`` larger than a
bucket (expert-aligned chunks), so the oversize paths are exercised.

Checked and measured:

* bit exactness: after the timed syncs the receiver regenerates every tensor from its seed and
  compares the raw bits (``int16`` views, so NaN patterns compare equal) with what it loaded;
* GB/s of the sync (best and median over the repeats, after one warm-up sync) against a
  device-to-device ``copy_`` of a large buffer measured in the same run;
* the sender's per-sync metrics (``fastsync/colocated/*``) and the slot bytes.

Usage: ``python benchmarks/gpu_colocated.py OUT_DIR [--size-gb 16] [--bucket-mb 512] [--repeats 3]``
writes ``OUT_DIR/gpu_colocated.json`` (and prints it). Exit status 0 only when bit-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1 << 30
MIB = 1 << 20


def layout(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes (bf16) of a synthetic MoE model of about ``size_bytes``."""
    hidden, vocab, kv, experts, inter = 8192, 128_000, 1024, 16, 2048
    head = [("model.embed_tokens.weight", (vocab, hidden))]
    tail = [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]

    def layer(i: int) -> list[tuple[str, tuple[int, ...]]]:
        p = f"model.layers.{i}"
        return [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate.weight", (experts, hidden)),
            (f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, hidden)),
            (f"{p}.mlp.experts.down_proj", (experts, hidden, inter)),
        ]

    def nbytes(items: list[tuple[str, tuple[int, ...]]]) -> int:
        total = 0
        for _, shape in items:
            n = 2
            for d in shape:
                n *= d
            total += n
        return total

    fixed = nbytes(head + tail)
    per_layer = nbytes(layer(0))
    layers = max(1, round((size_bytes - fixed) / per_layer))
    out = list(head)
    for i in range(layers):
        out.extend(layer(i))
    return out + tail


def make_tensor(index: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Deterministic random bits (any bf16 pattern, NaNs included) for tensor ``index``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234 + index)
    bits = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device, generator=gen)
    return bits.view(torch.bfloat16)


def d2d_gbps(device: torch.device, nbytes: int = 4 * GIB, repeats: int = 5) -> float:
    """Best-of GB/s of one device-to-device ``copy_`` (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def receiver_main(conn: Any, zmq_handle: str, size_bytes: int, n_syncs: int, timeout_s: float) -> None:
    try:
        from verl_fastsync.colocated import ColocatedReceiver, release_colocated_resources

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        names = layout(size_bytes)
        dest = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in names}
        seen: set[str] = set()

        def load(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            for name, tensor in weights:
                dest[name].copy_(tensor)
                seen.add(name)

        conn.send(("ready",))
        recv_metrics: list[dict[str, float]] = []
        for _ in range(n_syncs):
            receiver = ColocatedReceiver(zmq_handle, device, use_shm=False, timeout_s=timeout_s)
            receiver.receive_weights(load)
            recv_metrics.append(receiver.last_metrics)
        torch.cuda.synchronize()
        mismatched = []
        for index, (name, shape) in enumerate(names):
            expected = make_tensor(index, shape, device)
            if not torch.equal(dest[name].view(torch.int16), expected.view(torch.int16)):
                mismatched.append(name)
            del expected
        missing = sorted(set(dest) - seen)
        peak = torch.cuda.max_memory_allocated(device)
        release_colocated_resources()
        conn.send(("done", mismatched, missing, recv_metrics[-1], peak))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--size-gb", type=float, default=16.0)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    result: dict[str, Any] = {"ok": False, "args": vars(args)}
    out_path = os.path.join(args.out_dir, "gpu_colocated.json")
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible")
        from verl_fastsync.colocated import ColocatedSender, release_colocated_resources

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        size_bytes = int(args.size_gb * GIB)
        names = layout(size_bytes)
        result.update(
            device=torch.cuda.get_device_name(device),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            tensors=len(names),
        )
        result["d2d_copy_gbps"] = d2d_gbps(device)
        weights = [(name, make_tensor(i, shape, device)) for i, (name, shape) in enumerate(names)]
        model_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        result["model_bytes"] = model_bytes
        result["largest_tensor_bytes"] = max(t.numel() * t.element_size() for _, t in weights)
        result["bucket_bytes"] = args.bucket_mb * MIB
        torch.cuda.synchronize()

        zmq_handle = f"ipc:///tmp/vfs-gpu-colocated-{uuid.uuid4().hex[:12]}.sock"
        warmup = 1
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=receiver_main,
            args=(child, zmq_handle, size_bytes, warmup + args.repeats, args.timeout_s),
            daemon=True,
        )
        proc.start()
        child.close()
        try:
            if not parent.poll(args.timeout_s):
                raise TimeoutError("receiver did not start")
            msg = parent.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"receiver failed to start:\n{msg[1]}")
            seconds: list[float] = []
            metrics: dict[str, float] = {}
            for i in range(warmup + args.repeats):
                sender = ColocatedSender(
                    zmq_handle, args.bucket_mb, use_shm=False, transport="ipc", timeout_s=args.timeout_s
                )
                t0 = time.perf_counter()
                asyncio.run(sender.async_send_weights(iter(weights)))
                if i >= warmup:
                    seconds.append(time.perf_counter() - t0)
                metrics = sender.last_metrics
            if not parent.poll(args.timeout_s + 600):
                raise TimeoutError("receiver did not report its verification")
            msg = parent.recv()
            if msg[0] != "done":
                raise RuntimeError(f"receiver failed:\n{msg[1]}")
            _, mismatched, missing, recv_metrics, recv_peak = msg
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        best, median = min(seconds), statistics.median(seconds)
        result.update(
            seconds=seconds,
            best_gbps=model_bytes / best / 1e9,
            median_gbps=model_bytes / median / 1e9,
            sender_metrics=metrics,
            receiver_metrics=recv_metrics,
            receiver_peak_allocated_bytes=recv_peak,
            sender_peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
            mismatched=mismatched,
            missing=missing,
            bit_exact=not mismatched and not missing,
        )
        result["best_vs_d2d"] = result["best_gbps"] / result["d2d_copy_gbps"]
        result["ok"] = bool(result["bit_exact"])
        release_colocated_resources()
    except BaseException:
        result["error"] = traceback.format_exc()
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=2, default=str)
    print(json.dumps({k: v for k, v in result.items() if k not in ("seconds",)}, indent=2, default=str))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
