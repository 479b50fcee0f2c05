"""CPU benchmark of the colocated path: fastsync's shared-memory transport against verl's own
shared-memory ``BucketedWeightSender``/``BucketedWeightReceiver``, with a same-run memcpy figure.

:func:`run_colocated_benchmark` runs the sender in the calling process and the receiver in a spawned
process (as trainer and vLLM worker are), for each implementation in turn, and returns one dict.
The receiver's callback copies every tensor into a preallocated destination (what a model loader
does), so a sync is: pack (sender) + load (receiver), both of them memory copies. One torch thread
per process, as in the engine workers on a busy host.

verl's module is loaded by file path (its package ``__init__`` imports vllm) with its device lookups
replaced for a CPU-only host (``get_torch_device`` -> a CPU stand-in, ``is_support_ipc`` -> False).
verl's shared-memory path refuses tensors larger than the bucket: pick ``bucket_bytes`` at least as
large as the model's largest tensor, or its row is reported as ``skipped``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
import uuid
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["load_verl_bwt_for_cpu", "memcpy_gbps", "run_colocated_benchmark"]

_MIB = 1 << 20


class _CpuDevice:
    """What verl's shm path calls on ``get_torch_device()``, for a host without an accelerator."""

    def synchronize(self) -> None:
        return None

    def ipc_collect(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def load_verl_bwt_for_cpu(name: str = "verl_fastsync_bench_verl_bwt") -> types.ModuleType:
    """verl's ``bucketed_weight_transfer`` module loaded by file path, device lookups for CPU."""
    if name in sys.modules:
        return sys.modules[name]
    import verl

    path = os.path.join(
        os.path.dirname(verl.__file__), "workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py"
    )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load verl's bucketed_weight_transfer from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cpu = _CpuDevice()
    module.get_torch_device = lambda: cpu  # type: ignore[attr-defined]
    if hasattr(module, "is_support_ipc"):
        module.is_support_ipc = lambda: False  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def memcpy_gbps(nbytes: int = 256 * _MIB, repeats: int = 5) -> float:
    """Best-of-``repeats`` GB/s of one ``copy_`` between two preallocated CPU buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _named_tensors(model_spec: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_spec, Sequence) and not isinstance(model_spec, str):
        return [(str(n), t) for n, t in model_spec]
    from verl_fastsync.models import ModelSpec, build_model

    if not isinstance(model_spec, ModelSpec):
        raise TypeError(
            "model_spec must be a verl_fastsync.models.ModelSpec or a list of (name, tensor) pairs, "
            f"got {type(model_spec).__name__}"
        )
    return build_model(model_spec)


def _receiver_process(
    conn: Any,
    impl: str,
    zmq_handle: str,
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
    n_syncs: int,
    timeout_s: float,
) -> None:
    try:
        torch.set_num_threads(1)
        import zmq

        zmq.Context.instance().setsockopt(zmq.RECONNECT_IVL, 10)  # both impls connect before the bind
        dest = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in layout}

        def load(weights: list[tuple[str, torch.Tensor]], is_last: bool = False) -> None:
            for name, tensor in weights:
                dest[name].copy_(tensor)

        if impl == "verl-shm":
            module = load_verl_bwt_for_cpu()
            make: Any = lambda: module.BucketedWeightReceiver(zmq_handle, torch.device("cpu"), use_shm=True)  # noqa: E731
            takes_is_last = "is_last" in (module.BucketedWeightReceiver.receive_weights.__doc__ or "")
        else:
            from verl_fastsync.colocated import ColocatedReceiver

            make = lambda: ColocatedReceiver(zmq_handle, "cpu", use_shm=True, timeout_s=timeout_s)  # noqa: E731
            takes_is_last = True

        def callback_one(weights: list[tuple[str, torch.Tensor]]) -> None:
            load(weights)

        callback = load if takes_is_last else callback_one
        conn.send(("ready",))
        for _ in range(n_syncs):
            make().receive_weights(callback)
        checksum = sum(float(t.float().sum()) for t in dest.values())
        conn.send(("done", checksum))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


class _Peer:
    """One implementation under test: its receiver process and its sender factory."""

    def __init__(
        self,
        impl: str,
        tensors: list[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        n_syncs: int,
        timeout_s: float,
    ) -> None:
        self.impl = impl
        self.timeout_s = timeout_s
        self.zmq_handle = f"ipc:///tmp/vfs-bench-{uuid.uuid4().hex[:12]}.sock"
        self.seconds: list[float] = []
        layout = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_receiver_process,
            args=(child, impl, self.zmq_handle, layout, n_syncs, timeout_s),
            daemon=True,
        )
        self.proc.start()
        child.close()
        bucket_mb = bucket_bytes / _MIB
        if impl == "verl-shm":
            if bucket_bytes % _MIB:
                raise ValueError(f"verl's sender takes whole MiB buckets; bucket_bytes={bucket_bytes}")
            module = load_verl_bwt_for_cpu()
            self.make: Any = lambda: module.BucketedWeightSender(
                self.zmq_handle, int(bucket_mb), use_shm=True
            )
        else:
            from verl_fastsync.colocated import ColocatedSender

            self.make = lambda: ColocatedSender(self.zmq_handle, bucket_mb, use_shm=True, timeout_s=timeout_s)

    def expect(self, what: str) -> Any:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"benchmark receiver ({self.impl}) sent no {what!r} within {self.timeout_s}s")
        msg = self.conn.recv()
        if msg[0] != what:
            raise RuntimeError(f"benchmark receiver ({self.impl}) failed: {msg[1:]}")
        return msg

    def sync(self, tensors: list[tuple[str, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        try:
            asyncio.run(self.make().async_send_weights(iter(tensors)))
        except Exception as exc:
            if self.conn.poll(0):
                raise RuntimeError(f"benchmark receiver ({self.impl}) reported: {self.conn.recv()}") from exc
            raise
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.proc.join(self.timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def summary(self, nbytes: int) -> dict[str, Any]:
        best, median = min(self.seconds), statistics.median(self.seconds)
        return {
            "seconds": self.seconds,
            "best_seconds": best,
            "median_seconds": median,
            "gbps": nbytes / best / 1e9,
            "median_gbps": nbytes / median / 1e9,
        }


def _run_interleaved(
    impls: list[str],
    tensors: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    repeats: int,
    timeout_s: float,
) -> dict[str, dict[str, Any]]:
    """One receiver process per implementation; syncs alternate between them (A, B, A, B, ...) so
    that the background load of a shared host hits every implementation alike."""
    warmup = 1
    peers = [_Peer(impl, tensors, bucket_bytes, warmup + repeats, timeout_s) for impl in impls]
    try:
        for peer in peers:
            peer.expect("ready")
        for i in range(warmup + repeats):
            for peer in peers if i % 2 == 0 else reversed(peers):
                seconds = peer.sync(tensors)
                if i >= warmup:
                    peer.seconds.append(seconds)
        expected = sum(float(t.float().sum()) for _, t in tensors)
        for peer in peers:
            got = peer.expect("done")[1]
            if abs(got - expected) > 1e-3 * max(1.0, abs(expected)):
                raise RuntimeError(
                    f"{peer.impl}: receiver checksum {got} differs from the sender's {expected}"
                )
    finally:
        for peer in peers:
            peer.stop()
        from verl_fastsync.colocated import release_colocated_resources

        release_colocated_resources()
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return {peer.impl: peer.summary(nbytes) for peer in peers}


def run_colocated_benchmark(
    model_spec: Any,
    bucket_bytes: int,
    repeats: int,
    *,
    timeout_s: float = 300.0,
    include_verl: bool = True,
) -> dict[str, Any]:
    """Measure fastsync's shm colocated path vs verl's own shm sender/receiver on CPU.

    :param model_spec: a :class:`verl_fastsync.models.ModelSpec` or a list of ``(name, tensor)``.
    :param bucket_bytes: bucket (slot) size in bytes; whole MiB for verl.
    :param repeats: timed syncs per implementation (after one warm-up sync).
    :return: ``{"model_bytes", "bucket_bytes", "repeats", "memcpy_gbps", "fastsync": {...},
        "verl": {...} | {"skipped": reason}, "fastsync_vs_memcpy", "fastsync_vs_verl"}``; each
        implementation's dict has ``seconds`` (list), ``best_seconds``, ``median_seconds``, ``gbps``
        (best of the repeats, as ``memcpy_gbps`` is: the host may be shared) and ``median_gbps``.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    tensors = _named_tensors(model_spec)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    largest = max((t.numel() * t.element_size() for _, t in tensors), default=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        memcpy = memcpy_gbps(min(max(nbytes, 16 * _MIB), 512 * _MIB))
        result: dict[str, Any] = {
            "model_bytes": nbytes,
            "largest_tensor_bytes": largest,
            "bucket_bytes": bucket_bytes,
            "repeats": repeats,
            "memcpy_gbps": memcpy,
        }
        impls = ["fastsync-shm"]
        if not include_verl:
            result["verl"] = {"skipped": "include_verl=False"}
        elif largest > bucket_bytes:
            result["verl"] = {
                "skipped": f"verl's shm path refuses a {largest}-byte tensor in a {bucket_bytes}-byte bucket"
            }
        else:
            impls.append("verl-shm")
        runs = _run_interleaved(impls, tensors, bucket_bytes, repeats, timeout_s)
        result["fastsync"] = runs["fastsync-shm"]
        if "verl-shm" in runs:
            result["verl"] = runs["verl-shm"]
    finally:
        torch.set_num_threads(threads)
    result["fastsync_vs_memcpy"] = result["fastsync"]["gbps"] / memcpy
    if "gbps" in result["verl"]:
        result["fastsync_vs_verl"] = result["fastsync"]["gbps"] / result["verl"]["gbps"]
    return result
