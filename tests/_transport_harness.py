"""Multi-process harness driving engine transports the way verl's ``CheckpointEngineManager`` does:
``prepare`` on every rank, ``build_topology`` on the class (here, in the parent = the "driver"),
``init_process_group`` with each rank's kwargs, ``send`` on trainer rank 0 concurrently with
``receive`` on every rollout rank, then ``finalize`` everywhere.

Each rank is a real spawned process; every wait on a child has a timeout. Two modes:

* ``mode="engine"``: the rank holds verl's registered ``fastsync`` checkpoint engine (needs verl).
* ``mode="transport"``: the rank holds the bare transport (no verl import at all).

Models are described by a spec (list of :class:`TensorSpec`) and rebuilt deterministically in
each process, so the driver can compare digests (bytes, names, shapes, dtypes, order) without
shipping tensors around. The harness uses multiprocessing pipes between the test and its workers:
that is test plumbing, not the product's control channel.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# glibc raises its mmap threshold after the first large free, so freed tensors then stay in the heap
# and an RSS peak measures the allocator's hoarding instead of what the code under test holds. With
# the threshold fixed, every large tensor is its own mapping and goes back to the OS when freed.
EXACT_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@contextmanager
def child_env(env: dict[str, str] | None) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` while children are started (spawned children inherit it)."""
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    noncontig: bool = False
    lazy: str = ""
    """``"conj"`` (a conjugate view; a complex dtype), ``"neg"`` (a negative-bit view) or ``"strided"``
    (each element 3 apart: a one-element tensor with a non-unit stride): tensors whose bytes only the
    transports' byte view reads right."""


def _lazy_view(spec: TensorSpec, tensor: Any) -> Any:
    import torch

    if spec.lazy == "conj":
        return tensor.conj()
    if spec.lazy == "neg":
        return torch._neg_view(tensor)
    if spec.lazy == "strided":
        wide = torch.zeros((*tensor.shape, 3), dtype=tensor.dtype)
        wide[..., 1] = tensor
        return wide[..., 1]
    return tensor


def build_tensor(spec: TensorSpec, seed: int, lazy: bool = True) -> Any:
    import torch

    dtype = getattr(torch, spec.dtype)
    shape = tuple(spec.shape)
    if spec.noncontig and len(shape) >= 1:
        base_shape = (*shape[:-1], 2 * shape[-1])
    else:
        base_shape = shape
    numel = 1
    for dim in base_shape:
        numel *= dim
    gen = torch.Generator().manual_seed(seed)
    nbytes = numel * dtype.itemsize
    if dtype == torch.bool:
        raw = torch.randint(0, 2, (numel,), generator=gen, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    tensor = raw.view(dtype).reshape(base_shape)
    if spec.noncontig and len(shape) >= 1:
        tensor = tensor[..., ::2]
    return _lazy_view(spec, tensor) if lazy else tensor


def iter_model(specs: list[TensorSpec], seed: int = 0, step: int = 0) -> Any:
    """The model of ``seed``; ``step > 0``: the same model with about 2% of each tensor's elements
    replaced (a different 2% per step), as consecutive optimizer steps change few values."""
    for i, spec in enumerate(specs):
        tensor = build_tensor(spec, seed * 100003 + i, lazy=False)
        if step and tensor.numel():
            tensor = tensor.clone()  # contiguous, same shape
            flat = tensor.reshape(-1)
            other = build_tensor(spec, seed * 100003 + i + 7919 * step, lazy=False).reshape(-1)
            where = slice(step % 17, None, 50)
            flat[where] = other[where]
        yield spec.name, _lazy_view(spec, tensor)


def digest(name: str, tensor: Any) -> tuple[str, tuple[int, ...], str, str]:
    from verl_fastsync.chunks import byte_view, dtype_to_str

    data = byte_view(tensor)
    h = hashlib.sha256()
    if data.numel():
        h.update(memoryview(data.numpy()))  # no copy
    sha = h.hexdigest()
    return name, tuple(tensor.shape), dtype_to_str(tensor.dtype), sha


def expected_digests(
    specs: list[TensorSpec], seed: int = 0, step: int = 0
) -> list[tuple[str, tuple[int, ...], str, str]]:
    return [digest(n, t) for n, t in iter_model(specs, seed, step)]


# ------------------------------------------------------------------------------------------
# memory measurement: reset the kernel's RSS high-water mark, then read it back
# ------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> int:
    """Reset VmHWM (Linux ``clear_refs`` 5) and return current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


# ------------------------------------------------------------------------------------------
# worker process
# ------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, mode: str, transport: str, ctor: dict[str, Any], role: str) -> None:
        self.mode = mode
        self.transport_name = transport
        self.role = role
        self.engine: Any = None
        self.ctor = ctor

    def new(self) -> None:
        ctor = dict(self.ctor)
        if self.mode == "engine":
            from verl.checkpoint_engine.base import CheckpointEngineRegistry

            from verl_fastsync.verl.engine import register_engine

            register_engine()
            register_engine()  # idempotent
            self.engine = CheckpointEngineRegistry.new("fastsync", transport=self.transport_name, **ctor)
        else:
            from verl_fastsync.plugins import plugin_manager, select_transport
            from verl_fastsync.transports.base import TransportOptions

            self.bucket = ctor.pop("bucket_size")
            factory = select_transport(plugin_manager(), self.transport_name, "engine")
            self.engine = factory(TransportOptions(**ctor))

    def prepare(self) -> Any:
        meta = self.engine.prepare()
        if self.mode == "transport":
            meta = dict(meta, bucket_size=self.bucket)
        return meta

    def init(self, kwargs: dict[str, Any]) -> None:
        self.engine.init_process_group(**kwargs)
        if self.mode == "transport":
            self.bucket = kwargs.get("bucket_size", self.bucket)

    def send(self, specs: list[TensorSpec], seed: int, extra: dict[str, Any]) -> dict[str, Any]:
        """``extra["producer"]`` picks the weight generator: ``"list"`` (default: tensors made before
        the memory baseline), ``"lazy"`` (each tensor made when asked for, after the baseline),
        ``"staging"`` (one staging buffer per dtype refilled for every tensor, as a gathering
        producer does) or ``"restore"`` (tensors overwritten in place after the last yield, as a
        merged-LoRA producer restoring its weights does)."""
        producer = extra.get("producer", "list")
        model = list(iter_model(specs, seed, int(extra.get("step", 0)))) if producer != "lazy" else []
        die_after = extra.get("die_after")
        raise_after = extra.get("raise_after")

        def fail(i: int) -> None:
            """``extra["raise_after"]``: the producer raises once it has yielded that many tensors
            (the message carries the wall-clock time of the raise, for timing the abort path)."""
            if raise_after is not None and i >= raise_after:
                raise RuntimeError(f"producer failed on purpose after {i} tensors at t={time.time():.6f}")

        delays = extra.get("delay_s") or {}

        def gen() -> Any:
            for i, item in enumerate(model):
                if die_after is not None and i >= die_after:
                    os._exit(17)
                fail(i)
                if delays.get(i):  # a slow producer: ``delay_s={index: seconds}`` before that tensor
                    time.sleep(delays[i])
                yield item

        def lazy() -> Any:
            for i, spec in enumerate(specs):
                fail(i)
                yield spec.name, build_tensor(spec, seed * 100003 + i)

        def staging() -> Any:
            import torch

            buffers: dict[Any, Any] = {}
            for name, tensor in model:
                flat = tensor.contiguous().reshape(-1)
                buf = buffers.get(tensor.dtype)
                if buf is None or buf.numel() < flat.numel():
                    buf = buffers[tensor.dtype] = torch.empty(max(1, 2 * flat.numel()), dtype=tensor.dtype)
                view = buf[: flat.numel()]
                view.copy_(flat)
                yield name, view.view(tensor.shape)
                view.zero_()  # refilled for the next tensor

        def restore() -> Any:
            import torch

            originals = [(name, tensor.clone()) for name, tensor in model]
            yield from originals
            for _name, tensor in originals:  # restore in place after the last yield
                if tensor.numel():
                    tensor.view(-1)[:] = torch.zeros(1, dtype=tensor.dtype)

        weights: Any = {"list": gen, "lazy": lazy, "staging": staging, "restore": restore}[producer]()
        if extra.get("async_gen"):

            async def agen() -> Any:
                for item in model:
                    yield item

            weights = agen()
        base = reset_peak_rss()
        t0 = time.perf_counter()
        if self.mode == "engine":
            metrics = asyncio.run(self.engine.send_weights(weights))
        else:

            async def run() -> Any:
                return await self.engine.send(weights)

            metrics = asyncio.run(run()).as_metrics()
        seconds = time.perf_counter() - t0
        return {"metrics": metrics, "rss_delta": peak_rss() - base, "seconds": seconds}

    def receive(self, extra: dict[str, Any]) -> dict[str, Any]:
        import torch

        digest("warm-up", torch.zeros(3))  # first .numpy() imports numpy: not the transfer's memory
        base = reset_peak_rss()
        digests: list[Any] = []

        held: list[tuple[int, str, Any]] = []

        async def run() -> None:
            gen = self.engine.receive_weights() if self.mode == "engine" else self.engine.receive()
            async for name, tensor in gen:
                if extra.get("die_after") is not None and len(digests) >= extra["die_after"]:
                    os._exit(17)
                if extra.get("raise_after") is not None and len(digests) >= extra["raise_after"]:
                    raise RuntimeError(f"consumer failed on purpose after {len(digests)} tensors")
                # a stuck consumer: ``stall_s`` seconds after its first tensor, or a mapping
                # {tensors handled: seconds} to stall more than once; blocks the loop like a stuck load
                stalls = extra.get("stall_s") or {}
                if not isinstance(stalls, dict):
                    stalls = {1: stalls}
                if stalls.get(len(digests)):
                    time.sleep(stalls[len(digests)])
                every = int(extra.get("hold_every") or 1)
                if extra.get("hold") and len(digests) % every == 0:
                    # batches everything, loads at the end (SGLang); "views": keeps only a view
                    kept = tensor.view(tensor.shape) if extra["hold"] == "views" else tensor
                    held.append((len(digests), name, kept))
                    digests.append((name,))
                    del kept
                elif extra.get("hash", True):
                    digests.append(digest(name, tensor))
                else:
                    digests.append((name,))
                if not extra.get("keep_loop_var"):
                    del tensor  # like a consumer that copied it: keep nothing
                # else like ``for name, t in weights: load(t)``: t lives until the next tensor

        async def cancelled() -> None:
            task = asyncio.ensure_future(run())
            while len(digests) < extra["cancel_after"] and not task.done():
                await asyncio.sleep(0.001)
            task.cancel()
            await task

        async def cancelled_at() -> None:
            task = asyncio.ensure_future(run())
            await asyncio.sleep(extra["cancel_at_s"])  # the stream is waiting for the next bucket
            task.cancel()
            await task

        t0 = time.perf_counter()
        try:
            if extra.get("cancel_at_s") is not None:
                asyncio.run(cancelled_at())
            else:
                asyncio.run(cancelled() if extra.get("cancel_after") is not None else run())
        finally:
            if extra.get("keep_held"):  # a consumer that keeps what it got, even from a failed sync
                self.kept_earlier = [(name, tensor) for _, name, tensor in held]
        for index, name, tensor in held:
            digests[index] = digest(name, tensor)
        held.clear()
        seconds = time.perf_counter() - t0
        if extra.get("report_kept"):  # digests of what was kept earlier, read after this sync
            kept = getattr(self, "kept_earlier", [])
            digests = [digest(name, tensor) for name, tensor in kept]
        if self.mode == "engine":
            metrics = dict(self.engine.last_metrics)
        else:
            stats = self.engine.last_stats
            metrics = stats.as_metrics() if stats is not None else {}
        return {"digests": digests, "metrics": metrics, "rss_delta": peak_rss() - base, "seconds": seconds}

    def finalize(self) -> None:
        self.engine.finalize()

    def set_bucket(self, size: Any) -> None:
        if self.mode == "engine":
            self.engine.bucket_size = size
        else:
            self.bucket = size

    def renew(self, transport: str, ctor: dict[str, Any]) -> None:
        """Switch this rank to another transport / constructor kwargs (on top of the earlier ones; a
        key given as None is dropped)."""
        if self.engine is not None:
            self.engine.finalize()
        self.transport_name = transport
        self.ctor = {k: v for k, v in dict(self.ctor, **ctor).items() if v is not None}
        self.new()


def _exact_rss() -> None:
    """Fix glibc's mmap threshold at 1 MiB: larger blocks are then always mapped on allocation and
    unmapped on free, so RSS follows the live tensors (glibc's adaptive threshold otherwise keeps
    freed multi-MiB blocks on its heap, and a producer's garbage would look like the sender's)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _log_segments(path: str) -> None:
    """Record the name of every shared-memory segment this process creates or maps (leak checks
    must not depend on other processes using /dev/shm at the same time)."""
    from verl_fastsync.transports import shm

    original = shm.Segment.__init__

    def init(self: Any, name: str, size: int, create: bool, populate: bool = True) -> None:
        with open(path, "a") as fh:
            fh.write(name + "\n")
        original(self, name, size, create, populate)

    shm.Segment.__init__ = init  # type: ignore[method-assign]


def _worker_main(
    conn: Connection, mode: str, transport: str, ctor: dict[str, Any], role: str, segment_log: str = ""
) -> None:
    sys.path.insert(0, ROOT)
    _exact_rss()
    if segment_log:
        _log_segments(segment_log)
    worker = _Worker(mode, transport, ctor, role)
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            if cmd == "exec":
                namespace: dict[str, Any] = {"worker": worker}
                exec(args[0], namespace)
                result = namespace.get("result")
            else:
                result = getattr(worker, cmd)(*args)
            conn.send(("ok", result))
        except BaseException as exc:  # report to the driver
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class WorkerError(RuntimeError):
    def __init__(self, rank: str, message: str, tb: str) -> None:
        super().__init__(f"{rank}: {message}\n{tb}")
        self.message = message


class Cluster:
    """Trainer ranks (index 0 is master) + rollout ranks, each a spawned process."""

    def __init__(
        self,
        transport: str,
        n_actor: int = 1,
        n_rollout: int = 1,
        mode: str = "engine",
        ctor: dict[str, Any] | None = None,
        rollout_ctor: dict[str, Any] | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.mode = mode
        self.timeout = timeout
        self.n_actor, self.n_rollout = n_actor, n_rollout
        ctx = mp.get_context("spawn")
        ctor = dict(ctor or {})
        fd, self.segment_log = tempfile.mkstemp(prefix="fastsync-segments-")
        os.close(fd)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.labels: list[str] = []
        for i in range(n_actor + n_rollout):
            rank_ctor = dict(ctor)
            if i < n_actor:
                rank_ctor["is_master"] = i == 0
                label = f"trainer{i}"
            else:
                rank_ctor.update(rollout_ctor or {})
                label = f"rollout{i - n_actor}"
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    child,
                    mode,
                    transport,
                    rank_ctor,
                    "trainer" if i < n_actor else "rollout",
                    self.segment_log,
                ),
                daemon=True,
            )
            with child_env(env):
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
            self.labels.append(label)
        self.call_all("new")

    # -- plumbing ------------------------------------------------------------------------------

    def post(self, i: int, cmd: str, *args: Any) -> None:
        self.conns[i].send((cmd, args))

    def wait(self, i: int, timeout: float | None = None) -> Any:
        conn = self.conns[i]
        if not conn.poll(self.timeout if timeout is None else timeout):
            raise TimeoutError(f"{self.labels[i]} gave no answer within {timeout or self.timeout}s")
        try:
            reply = conn.recv()
        except EOFError as exc:
            died = f"process died (exit code {self.procs[i].exitcode})"
            raise WorkerError(self.labels[i], died, "") from exc
        if reply[0] == "err":
            raise WorkerError(self.labels[i], reply[1], reply[2])
        return reply[1]

    def wait_result(self, i: int, timeout: float | None = None) -> tuple[str, Any]:
        """("ok", value) or ("err", message) without raising."""
        try:
            return "ok", self.wait(i, timeout)
        except WorkerError as exc:
            return "err", exc.message

    def call_all(self, cmd: str, *args: Any) -> list[Any]:
        for i in range(len(self.conns)):
            self.post(i, cmd, *args)
        return [self.wait(i) for i in range(len(self.conns))]

    # -- verl's manager protocol ---------------------------------------------------------------

    def build_process_group(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        metadata = self.call_all("prepare")
        if self.mode == "engine":
            from verl.checkpoint_engine.base import CheckpointEngineRegistry

            from verl_fastsync.verl.engine import register_engine

            register_engine()
            cls: Any = CheckpointEngineRegistry.get("fastsync")
        else:
            from verl_fastsync.plugins import plugin_manager, select_transport

            cls = select_transport(plugin_manager(), self.transport, "engine")
        actor_kw, rollout_kw = cls.build_topology(self.n_actor, self.n_rollout, metadata)
        for key, values in actor_kw.items():
            assert len(values) == self.n_actor, key
        for key, values in rollout_kw.items():
            assert len(values) == self.n_rollout, key
        for i in range(self.n_actor + self.n_rollout):
            src, j = (actor_kw, i) if i < self.n_actor else (rollout_kw, i - self.n_actor)
            self.post(i, "init", {k: v[j] for k, v in src.items()})
        for i in range(self.n_actor + self.n_rollout):
            self.wait(i)
        return actor_kw, rollout_kw

    def sync(
        self,
        specs: list[TensorSpec],
        seed: int = 0,
        send_extra: dict[str, Any] | None = None,
        recv_extra: dict[str, Any] | None = None,
        finalize: bool = True,
    ) -> dict[str, Any]:
        """One full weight sync; returns sender + receiver results (raises on any rank's error)."""
        self.build_process_group()
        for i in range(self.n_actor):
            self.post(i, "send", specs, seed, send_extra or {})
        for i in range(self.n_actor, self.n_actor + self.n_rollout):
            self.post(i, "receive", recv_extra or {})
        results = [self.wait(i) for i in range(len(self.conns))]
        if finalize:
            self.call_all("finalize")
        return {"senders": results[: self.n_actor], "receivers": results[self.n_actor :]}

    def set_bucket(self, size: Any) -> None:
        self.call_all("set_bucket", size)

    def renew(self, transport: str, **ctor: Any) -> None:
        self.transport = transport
        self.call_all("renew", transport, ctor)

    def close(self) -> None:
        for i, conn in enumerate(self.conns):
            try:
                if self.procs[i].is_alive():
                    conn.send(("exit", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def leaked_segments(self) -> set[str]:
        """Segments created or mapped by this cluster's processes that still exist in /dev/shm."""
        with open(self.segment_log) as fh:
            names = {line.strip() for line in fh if line.strip()}
        return {name for name in names if os.path.exists(os.path.join("/dev/shm", name))}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        leaked = self.leaked_segments()
        os.unlink(self.segment_log)
        if exc[0] is None:
            assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"


def shm_segments() -> set[str]:
    """Names of this transport's segments currently in /dev/shm."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("fastsync_")}
    except FileNotFoundError:  # pragma: no cover
        return set()


def synthetic_model(
    bucket: int, dtypes: tuple[str, ...] = ("float32", "bfloat16", "int8")
) -> list[TensorSpec]:
    """Small tensors mixed with tensors 1x-10x the bucket, 0-dim, 0-size and non-contiguous ones."""
    specs: list[TensorSpec] = []
    for layer, dtype in enumerate(dtypes):
        import torch

        item = getattr(torch, dtype).itemsize
        specs += [
            TensorSpec(f"l{layer}.bias", (7,), dtype),
            TensorSpec(f"l{layer}.big1x", (max(1, bucket // item),), dtype),
            TensorSpec(f"l{layer}.scalar", (), dtype),
            TensorSpec(f"l{layer}.big3x", (3, max(1, bucket // item)), dtype),
            TensorSpec(f"l{layer}.empty", (0, 4), dtype),
            TensorSpec(f"l{layer}.t", (5, 33), dtype, noncontig=True),
        ]
    specs.append(TensorSpec("experts", (10, max(1, bucket // 4)), "float32"))
    specs.append(TensorSpec("mask", (13,), "bool"))
    return specs
