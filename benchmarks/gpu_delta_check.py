"""GPU check of delta sync's two sides (``engine_kwargs.fastsync.delta``) with the trainer's weights in
device memory, as verl's FSDP trainer yields them; no verl, no transport (the codec's cost only).

A stack of MLP blocks (LayerNorm, ``width`` -> 4 x ``width`` -> ``width``, as ``delta_bench``) trains on
the GPU with AdamW (fp32 master weights, a random regression batch per step); after every step the
weights are cast to ``bfloat16`` on the device and synced through two :class:`DeltaEncoder` s (sending
ranks), each into its own :class:`DeltaDecoder` (a rollout rank: rebuild from its base, digest check):
``device_compare`` compares on the GPU (the default for device tensors: the base chunk goes to the
device, only the changed elements come back; on a CPU dry run the same code runs on the CPU),
``host_compare`` copies the tensor to the host and compares there on the codec's threads. Per step it
reports the fraction of values changed, the bytes a delta moves, the seconds of the device-to-host
copy alone, of each encode (copies included) and rebuild, and of the host codec alone on host copies
of the same bytes (``codec_host_s``: no device copy). Every rebuilt tensor is checked byte for byte
against the trainer's, and the two encoders' wire bytes against each other. From those seconds it
derives what bounds a sync on a 10 Gbit/s link (a derivation, not a measured sync: this machine has
one GPU and no second host).

With ``--profile``, one more step of the first learning rate is synced by the ``device_compare`` pair
under ``torch.profiler`` (CPU and CUDA activity) and ``cProfile``; the top entries of each go into the
JSON (``profile``), so a single device run shows where the encode's and the rebuild's seconds go
(that row's seconds include the profilers' overhead and are not used elsewhere).

Run: ``python benchmarks/gpu_delta_check.py --out delta_gpu.json [--gib 1] [--steps 3] [--profile]``;
without CUDA it runs on the CPU (a dry run of the script).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import xxhash

from verl_fastsync.delta import compare
from verl_fastsync.delta.codec import encode
from verl_fastsync.delta.stream import DeltaDecoder, DeltaEncoder

LINK_BYTES_S = 10e9 / 8  # 10 Gbit/s
TOP = 20
T = TypeVar("T")


def _profiled(call: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """``call()`` under torch's profiler and cProfile: its result and the top :data:`TOP` entries of each
    (torch ops and kernels by self time on the device where there is one, else on the CPU; Python
    functions by their own time)."""
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    python = cProfile.Profile()
    with torch.profiler.profile(activities=activities) as prof:
        python.enable()
        try:
            out = call()
        finally:
            python.disable()
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=TOP)
    stats = pstats.Stats(python)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:TOP]  # type: ignore[attr-defined]
    functions = [
        {"function": f"{path}:{line}({name})", "calls": calls, "own_s": own, "cumulative_s": cumulative}
        for (path, line, name), (_, calls, own, cumulative, _) in rows
    ]
    return out, {"torch": table.splitlines(), "python": functions}


def _sync(encoder: DeltaEncoder, decoder: DeltaDecoder, weights: list[tuple[str, torch.Tensor]], epoch: str,
          device: torch.device, profile: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One sync of ``weights``; with ``profile`` (a dict) the encode and the rebuild run under the
    profilers (:func:`_profiled`) and their top entries go into it."""
    against = encoder.epoch if encoder.epoch == decoder.epoch else None
    encoder.begin(against, epoch)
    decoder.begin(against, epoch)

    def run(call: Callable[[], T], what: str) -> T:
        if profile is None:
            return call()
        out, profile[what] = _profiled(call)
        return out

    start = time.perf_counter()
    wire = run(lambda: [encoder.encode(name, tensor) for name, tensor in weights], "encode")
    encode_s = time.perf_counter() - start
    wire_digest = xxhash.xxh3_64()
    for name, tensor in wire:
        wire_digest.update(name.encode())
        wire_digest.update(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().data)
    start = time.perf_counter()
    got = run(lambda: [decoder.decode(name, tensor) for name, tensor in wire], "rebuild")
    rebuild_s = time.perf_counter() - start
    encoder.commit()
    decoder.commit()
    host = [t.to("cpu") for _, t in weights]
    for (name, tensor), want in zip(got, host, strict=True):
        a = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        b = want.contiguous().view(-1).view(torch.uint8).numpy()
        if xxhash.xxh3_64_intdigest(a.data) != xxhash.xxh3_64_intdigest(b.data) or not (a == b).all():
            raise AssertionError(f"{name}: the rebuilt tensor differs from the trainer's")
    stats = encoder.stats
    return {
        "delta_sync": stats.delta_sync,
        "model_bytes": stats.model_bytes,
        "wire_bytes": stats.wire_bytes,
        "changed_fraction": stats.changed_elements / stats.compared_elements
        if stats.compared_elements
        else None,
        "raw_tensors": stats.raw_tensors,
        "encode_s": encode_s,
        "rebuild_s": rebuild_s,
        "wire_xxh3": wire_digest.hexdigest(),
    }


def _bf16_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What verl's FSDP trainer yields: each parameter cast to bfloat16 on its device."""
    return [(name, p.detach().to(torch.bfloat16)) for name, p in model.named_parameters()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--gib", type=float, default=1.0, help="bf16 bytes of the model")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--profile", action="store_true", help="profile one more device_compare sync")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = max(1, round(args.gib * 2**30 / (2 * 8 * args.width * args.width)))  # blocks
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cpus": len(os.sched_getaffinity(0)),
        "codec_threads": compare.THREADS,
        "layers": layers,
        "width": args.width,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for lr in args.lrs:
        torch.manual_seed(0)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [
                torch.nn.LayerNorm(args.width),
                torch.nn.Linear(args.width, 4 * args.width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * args.width, args.width),
            ]
        model = torch.nn.Sequential(*blocks).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        sides = {
            "device_compare": (DeltaEncoder(compare_on_device=True), DeltaDecoder()),
            "host_compare": (DeltaEncoder(compare_on_device=False), DeltaDecoder()),
        }
        previous: list[torch.Tensor] | None = None

        for step in range(args.steps + 1):
            if step:
                batch = torch.randn(16, args.width, device=device)
                loss = torch.nn.functional.mse_loss(model(batch), torch.randn_like(batch))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            named = _bf16_weights(model)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _, tensor in named:
                tensor.to("cpu")
            d2h_s = time.perf_counter() - start
            row: dict[str, Any] = {"lr": lr, "step": step, "d2h_s": d2h_s}
            host = [tensor.to("cpu") for _, tensor in named]
            if previous is not None:  # the codec alone on host bytes (no device copy), the pool's threads
                start = time.perf_counter()
                for old, new in zip(previous, host, strict=True):
                    encode(
                        old.view(-1).view(torch.uint8), new.view(-1).view(torch.uint8), 2, update_base=True
                    )
                row["codec_host_s"] = time.perf_counter() - start
            previous = host
            for side, (encoder, decoder) in sides.items():
                row[side] = _sync(encoder, decoder, named, f"e{lr}-{step}", device)
                got = row[side]
                if got["delta_sync"]:
                    full_link = got["model_bytes"] / LINK_BYTES_S
                    bound = max(got["encode_s"], got["rebuild_s"], got["wire_bytes"] / LINK_BYTES_S)
                    ratio = full_link / bound
                    got["at_10gbit"] = {"full_link_s": full_link, "delta_bound_s": bound, "ratio": ratio}
            if row["device_compare"]["wire_xxh3"] != row["host_compare"]["wire_xxh3"]:
                raise AssertionError(f"lr {lr} step {step}: device and host compares sent different bytes")
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)
        if args.profile and lr == args.lrs[0]:  # one more step, synced by the device_compare pair only
            batch = torch.randn(16, args.width, device=device)
            loss = torch.nn.functional.mse_loss(model(batch), torch.randn_like(batch))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            encoder, decoder = sides["device_compare"]
            profile: dict[str, Any] = {"lr": lr, "step": args.steps + 1}
            profile["sync"] = _sync(
                encoder, decoder, _bf16_weights(model), f"e{lr}-profiled", device, profile
            )
            result["profile"] = profile
            print(json.dumps({"profile": profile["sync"]}), flush=True)
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)
        del model, optimizer, sides, previous
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
