"""Benchmark support for engine transports: one trainer process -> one rollout process, real
transports, driven through the same lifecycle as verl's checkpoint-engine manager. No verl needed.

:func:`run_engine_transfer` is what ``verl-fastsync bench`` calls.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import traceback
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["normalize_spec", "run_engine_transfer"]

_BLOCK = 1 << 20


def normalize_spec(named_tensors_spec: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` triples from a model spec (an object with ``.tensors``), an iterable of
    objects with ``name``/``shape``/``dtype`` attributes, or an iterable of triples."""
    items: Iterable[Any] = getattr(named_tensors_spec, "tensors", named_tensors_spec)
    out: list[tuple[str, tuple[int, ...], str]] = []
    for item in items:
        if hasattr(item, "name") and hasattr(item, "shape"):
            name, shape, dtype = item.name, item.shape, getattr(item, "dtype", "bfloat16")
        else:
            name, shape, dtype = item
        out.append((str(name), tuple(int(s) for s in shape), str(dtype).removeprefix("torch.")))
    if not out:
        raise ValueError("run_engine_transfer: the model spec has no tensors")
    return out


def _materialize(spec: list[tuple[str, tuple[int, ...], str]], seed: int) -> Iterator[tuple[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (2 * _BLOCK,), generator=gen, dtype=torch.uint8)
    for index, (name, shape, dtype) in enumerate(spec):
        tdtype = getattr(torch, dtype)
        tensor = torch.empty(shape, dtype=tdtype)
        data = tensor.view(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        shift = (index * 7919) % _BLOCK
        for off in range(0, data.numel(), _BLOCK):
            n = min(_BLOCK, data.numel() - off)
            data[off : off + n].copy_(block[shift : shift + n])
        if tdtype == torch.bool:
            tensor = tensor.view(torch.uint8).bitwise_and_(1).view(torch.bool)
        yield name, tensor


def _digest(tensor: Any) -> int:
    from verl_fastsync.chunks import byte_view, chunk_checksum

    return chunk_checksum(byte_view(tensor))


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - non-Linux
        pass
    return 0


def _reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:  # pragma: no cover
        pass
    return _status_kib("VmRSS") * 1024


def _memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host memcpy bandwidth (median of ``repeats``): the same byte copy the transports use."""
    import torch

    from verl_fastsync.chunks import copy_bytes

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    copy_bytes(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy_bytes(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


async def _send(engine: Any, model: list[tuple[str, Any]], bucket: int) -> Any:
    from verl_fastsync.chunks import aplan_buckets

    return await engine.send(aplan_buckets(iter(model), bucket))


async def _receive(engine: Any, verify: bool) -> tuple[list[str], list[int]]:
    names: list[str] = []
    digests: list[int] = []
    async for name, tensor in engine.receive():
        names.append(name)
        if verify:
            digests.append(_digest(tensor))
        del tensor
    return names, digests


def _model_memcpy_gbps(model: list[tuple[str, Any]], bucket: int, repeats: int = 3) -> float:
    """The transfer's lower bound on one host: plan the model into buckets and pack every bucket into
    one bucket-sized buffer (one memcpy of every byte, no transport, no receiver)."""
    import torch

    from verl_fastsync.chunks import pack_bucket, plan_buckets

    buffer = torch.empty(bucket, dtype=torch.uint8)
    buffer.fill_(0)
    total = sum(t.numel() * t.element_size() for _, t in model)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for planned in plan_buckets(iter(model), bucket):
            pack_bucket(planned, buffer)
        times.append(time.perf_counter() - t0)
    return total / statistics.median(times) / 1e9


def _child(conn: Connection, transport: str, options: dict[str, Any], spec: Any, role: str) -> None:
    import asyncio

    from verl_fastsync.plugins import plugin_manager, select_transport
    from verl_fastsync.transports.base import TransportOptions

    factory = select_transport(plugin_manager(), transport, "engine")
    engine = factory(TransportOptions(**options))
    model = list(_materialize(spec, seed=1)) if role == "sender" else []
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                conn.send(("ok", None))
                return
            if cmd == "memcpy":
                conn.send(("ok", (_memcpy_gbps(), _model_memcpy_gbps(model, arg))))
            elif cmd == "prepare":
                conn.send(("ok", engine.prepare()))
            elif cmd == "init":
                engine.init_process_group(**arg)
                conn.send(("ok", None))
            elif cmd == "finalize":
                engine.finalize()
                conn.send(("ok", None))
            elif cmd == "send":
                bucket = arg["bucket"]
                digests = [_digest(t) for _, t in model] if arg["verify"] else []
                base = _reset_peak()
                start = time.monotonic()
                stats = asyncio.run(_send(engine, model, bucket))
                peak = _status_kib("VmHWM") * 1024 - base
                conn.send(
                    ("ok", {"start": start, "stats": stats.as_metrics(), "rss": peak, "digests": digests})
                )
            elif cmd == "receive":
                verify = arg["verify"]
                base = _reset_peak()
                names, digests = asyncio.run(_receive(engine, verify))
                end = time.monotonic()
                peak = _status_kib("VmHWM") * 1024 - base
                stats = engine.last_stats
                conn.send(
                    (
                        "ok",
                        {
                            "end": end,
                            "stats": stats.as_metrics() if stats else {},
                            "rss": peak,
                            "names": names,
                            "digests": digests,
                        },
                    )
                )
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException as exc:
            try:
                engine.finalize()
            except Exception:
                pass
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class _Peer:
    def __init__(self, ctx: Any, transport: str, options: dict[str, Any], spec: Any, role: str) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, transport, options, spec, role), daemon=True)
        self.proc.start()
        child.close()

    def post(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def wait(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"bench {self.role} gave no answer within {timeout:.0f}s")
        try:
            reply = self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"bench {self.role} died (exit code {self.proc.exitcode})") from exc
        if reply[0] == "err":
            raise RuntimeError(f"bench {self.role}: {reply[1]}")
        return reply[1]

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("exit", None))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def run_engine_transfer(
    transport: str,
    named_tensors_spec: Any,
    bucket_bytes: int,
    repeats: int = 3,
    *,
    timeout_s: float = 600.0,
    verify_bytes: bool = True,
    measure_memcpy: bool = True,
) -> dict[str, Any]:
    """Move a synthetic model from a trainer process to a rollout process ``repeats`` times.

    The first run is a warm-up that also checks the bytes (per-tensor xxhash on both sides, not
    timed) when ``verify_bytes``; the timed runs follow. Seconds run from the sender starting
    ``send`` to the receiver having every tensor (host monotonic clock).

    :return: ``status`` (``"ok"`` or ``"failed"`` with ``error``), ``transport``, ``bytes``,
        ``tensors``, ``bucket_bytes``, ``repeats``, ``seconds`` (median), ``seconds_all``, ``gbps``
        (1e9 bytes/s, median run), ``peak_sender_bytes`` / ``peak_receiver_bytes`` (the transports'
        own accounting: bucket buffers + incomplete destination tensors), ``rss_peak_sender_bytes`` /
        ``rss_peak_receiver_bytes`` (kernel RSS high-water mark over the transfer, max over runs),
        ``largest_tensor_bytes``, ``bytes_identical``, ``memcpy_gbps`` (one hot 256 MiB host memcpy)
        and ``model_memcpy_gbps`` (this model packed into one bucket-sized buffer, no transport: the
        transfer's floor), both measured in the sender process of the same run.
    """
    from verl_fastsync.chunks import validate_bucket_size
    from verl_fastsync.plugins import plugin_manager, select_transport

    spec = normalize_spec(named_tensors_spec)
    validate_bucket_size(bucket_bytes)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    import torch

    total = sum((int(torch.Size(shape).numel()) * getattr(torch, dtype).itemsize) for _, shape, dtype in spec)
    largest = max(int(torch.Size(shape).numel()) * getattr(torch, dtype).itemsize for _, shape, dtype in spec)
    result: dict[str, Any] = {
        "transport": transport,
        "bytes": total,
        "tensors": len(spec),
        "bucket_bytes": bucket_bytes,
        "largest_tensor_bytes": largest,
        "repeats": repeats,
        "status": "ok",
    }
    factory: Any = select_transport(plugin_manager(), transport, "engine")
    ctx = mp.get_context("spawn")
    options = {"timeout_s": timeout_s, "host": "127.0.0.1"}
    sender = _Peer(ctx, transport, dict(options, is_master=True), spec, "sender")
    receiver = _Peer(ctx, transport, options, spec, "receiver")
    wait = timeout_s + 60
    try:
        if measure_memcpy:
            sender.post("memcpy", bucket_bytes)
            result["memcpy_gbps"], result["model_memcpy_gbps"] = sender.wait(wait)
        seconds: list[float] = []
        peaks = {"ps": 0.0, "pr": 0.0, "rs": 0, "rr": 0}
        for run in range(repeats + 1):
            check = verify_bytes and run == 0
            sender.post("prepare")
            receiver.post("prepare")
            metadata = [dict(sender.wait(wait), bucket_size=bucket_bytes)]
            metadata.append(dict(receiver.wait(wait), bucket_size=bucket_bytes))
            actor, rollout = factory.build_topology(1, 1, metadata)
            sender.post("init", {k: v[0] for k, v in actor.items()})
            receiver.post("init", {k: v[0] for k, v in rollout.items()})
            sender.wait(wait)
            receiver.wait(wait)
            sender.post("send", {"bucket": bucket_bytes, "verify": check})
            receiver.post("receive", {"verify": check})
            sent = sender.wait(wait)
            got = receiver.wait(wait)
            sender.post("finalize")
            receiver.post("finalize")
            sender.wait(wait)
            receiver.wait(wait)
            if check:
                result["bytes_identical"] = got["digests"] == sent["digests"] and got["names"] == [
                    n for n, _, _ in spec
                ]
            if run == 0:
                continue
            seconds.append(got["end"] - sent["start"])
            peaks["ps"] = max(peaks["ps"], sent["stats"].get("fastsync/transfer/peak_extra_bytes_sender", 0))
            peaks["pr"] = max(peaks["pr"], got["stats"].get("fastsync/transfer/peak_extra_bytes_receiver", 0))
            peaks["rs"] = max(peaks["rs"], sent["rss"])
            peaks["rr"] = max(peaks["rr"], got["rss"])
        median = statistics.median(seconds)
        result.update(
            seconds=median,
            seconds_all=seconds,
            gbps=total / median / 1e9 if median > 0 else 0.0,
            peak_sender_bytes=int(peaks["ps"]),
            peak_receiver_bytes=int(peaks["pr"]),
            rss_peak_sender_bytes=int(peaks["rs"]),
            rss_peak_receiver_bytes=int(peaks["rr"]),
        )
    except Exception as exc:
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        sender.close()
        receiver.close()
    return result
