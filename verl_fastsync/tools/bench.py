"""``verl-fastsync bench``: cleanup policies, weight transports and scaling, side by side, in one run.

Sections (each measured between real processes, medians of ``--repeats`` with min and max):

``cleanup``
    Every cleanup policy (``light``, ``adaptive``, ``aggressive`` = verl 0.9.0's
    ``aggressive_empty_cache(force_sync=True)``) at both boundaries, run through
    :func:`verl_fastsync.cleanup.run_boundary` in a child process that holds a trainer-like Python heap
    (``--heap-objects`` GC-tracked objects in reference cycles, plus 1% of that as fresh unreachable
    cycles before every call, the garbage a training step leaves behind). The device module is verl's
    ``get_torch_device()`` when it works on this host, else torch's own accelerator module, else the
    :class:`CpuDevice` stand-in (reported as ``device: cpu``): on CPU there is no caching allocator,
    so the section measures what the policies cost in garbage collection.
``transfer``
    Every available transport moving a synthetic model (:mod:`verl_fastsync.tools.models`) between two
    processes, at every bucket size, next to the stock verl path for the same model: verl's
    bucketed shared-memory sender/receiver (``impl: verl``, transport ``shm``) and verl's own NIXL
    checkpoint engine; a row with ``status: failed`` and verl's error where verl cannot carry it.
``scale``
    Seconds against model bytes (several sizes) and against tensor count at equal bytes.

The JSON schema is documented in ``docs/bench-schema.md``; :func:`validate_bench_json` checks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TextIO

SCHEMA_VERSION = 1
MIB = 1 << 20
GIB = 1 << 30

POLICIES = ("light", "adaptive", "aggressive")
BOUNDARIES = ("pre_resume_cleanup", "post_transfer_cleanup")
CPU_TRANSPORTS = ("shm", "gloo", "nixl")
GPU_TRANSPORTS = ("nccl", "ipc")
_MARK = "@@verl-fastsync-bench "


class BenchSchemaError(ValueError):
    """A bench JSON document that does not follow ``docs/bench-schema.md``."""


class BenchOptionError(ValueError):
    """A bench option with a value that cannot work."""


# --------------------------------------------------------------------------------------------------
# options


@dataclasses.dataclass
class BenchOptions:
    """What ``verl-fastsync bench`` runs (defaults: a full run in under 3 minutes on 2 CPU cores)."""

    models: tuple[str, ...] = ("dense-small", "moe-small")
    size_gib: float = 0.25
    bucket_mib: tuple[int, ...] = (16, 64)
    repeats: int = 3
    heap_objects: int = 3_000_000
    transports: tuple[str, ...] | None = None
    """None: every transport this host can run."""
    sections: tuple[str, ...] = ("cleanup", "transfer", "scale")
    scale_sizes: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    """Model sizes of the scale section, as multiples of ``size_gib``."""
    scale_pieces: tuple[int, ...] = (1, 4, 16)
    """Tensor-count multipliers of the scale section (equal bytes)."""
    seed: int = 0
    timeout_s: float = 300.0
    """Upper bound for every child process / transfer."""

    def check(self) -> None:
        from verl_fastsync.tools.models import PRESETS

        for m in self.models:
            if m not in PRESETS:
                raise BenchOptionError(f"--model {m!r}: unknown preset; allowed: {', '.join(PRESETS)}")
        if not (self.size_gib > 0 and math.isfinite(self.size_gib)):
            raise BenchOptionError(f"--size-gib {self.size_gib!r}: must be a positive number")
        if not self.bucket_mib or any(b <= 0 for b in self.bucket_mib):
            raise BenchOptionError(f"--bucket-mib {self.bucket_mib!r}: must be positive integers (MiB)")
        if self.repeats < 1:
            raise BenchOptionError(f"--repeats {self.repeats}: must be >= 1")
        if self.heap_objects < 0:
            raise BenchOptionError(f"--heap-objects {self.heap_objects}: must be >= 0")
        allowed = ("cleanup", "transfer", "scale")
        for s in self.sections:
            if s not in allowed:
                raise BenchOptionError(f"--sections {s!r}: unknown section; allowed: {', '.join(allowed)}")
        if self.transports is not None:
            # any registered name works (third-party transports too); these are the built-in ones
            known = CPU_TRANSPORTS + GPU_TRANSPORTS
            for t in self.transports:
                if not t or not t.replace("-", "").replace("_", "").isalnum():
                    raise BenchOptionError(
                        f"--transports {t!r}: not a transport name; built-in: {', '.join(known)}"
                    )
        if any(p < 1 for p in self.scale_pieces) or any(s <= 0 for s in self.scale_sizes):
            raise BenchOptionError("--scale-sizes and --scale-pieces must be positive")
        if self.timeout_s <= 0:
            raise BenchOptionError(f"--timeout {self.timeout_s}: must be positive")


# --------------------------------------------------------------------------------------------------
# progress


class Progress:
    """One-line progress display on stderr (a plain log line per step when stderr is not a TTY)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_len = 0

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.monotonic() - self.start:6.1f}s] {message}"
        if self._tty:
            pad = max(0, self._last_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------------------------------
# device adapter


class CpuDevice:
    """Stand-in for a torch device module on a host without an accelerator.

    CPU tensors have no caching allocator: ``empty_cache`` has nothing to return and
    ``memory_reserved``/``memory_allocated`` are 0. ``synchronize`` waits for torch's CPU stream.
    There is deliberately no ``mem_get_info``: the ``adaptive`` policy then sees no device-memory
    pressure and never collects garbage, which is what it would do on a host with room to spare.
    """

    name = "cpu"

    def empty_cache(self) -> None:
        return None

    def synchronize(self) -> None:
        import torch

        torch.cpu.synchronize()

    def ipc_collect(self) -> None:
        """No CUDA IPC on a CPU host (verl 0.7.1's shared-memory path calls it unconditionally)."""
        return None

    def memory_reserved(self) -> int:
        return 0

    def memory_allocated(self) -> int:
        return 0


def bench_device(prefer_verl: bool = True) -> tuple[Any, str, str]:
    """The device module the cleanup policies get, its name and where it came from.

    Order: verl's ``get_torch_device()`` (what the workers use) when ``synchronize()`` and
    ``empty_cache()`` work on it; else ``torch.cuda`` when CUDA is available; else :class:`CpuDevice`.
    """
    if prefer_verl:
        try:
            from verl.utils.device import get_device_name, get_torch_device

            module = get_torch_device()
            module.synchronize()
            module.empty_cache()
            return module, str(get_device_name()), "verl.utils.device.get_torch_device()"
        except Exception:
            pass
    import torch

    if torch.cuda.is_available():
        return torch.cuda, "cuda", "torch.cuda"
    return CpuDevice(), "cpu", "verl_fastsync.tools.bench.CpuDevice (no accelerator)"


# --------------------------------------------------------------------------------------------------
# small helpers


def _median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _verl_version() -> str | None:
    try:
        from importlib.metadata import version

        import verl

        return str(getattr(verl, "__version__", None) or version("verl"))
    except Exception:
        return None


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class _DevicePeak:
    """Peak bytes the device's caching allocator handed out above what was allocated at the start
    (memory mapped from another process through CUDA IPC is not counted)."""

    def __init__(self, device: str) -> None:
        self.active = device.startswith("cuda")
        self.extra = 0
        self._start = 0

    def __enter__(self) -> _DevicePeak:
        if self.active:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            import torch

            torch.cuda.synchronize()
            self.extra = max(0, torch.cuda.max_memory_allocated() - self._start)


def _malloc_trim() -> None:
    """glibc ``malloc_trim(0)``: return free heap memory to the OS (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _RssSampler:
    """Peak resident set size above the resident set at the start.

    The kernel's high-water mark (``VmHWM``) is reset at the start (``/proc/self/clear_refs`` = 5)
    and read at the end, so no spike is missed; where that reset is not allowed, ``VmRSS`` is sampled
    every millisecond instead."""

    def __init__(self, interval_s: float = 0.001, baseline: int | None = None) -> None:
        self.interval_s = interval_s
        _malloc_trim()  # give freed heap pages back first, so reuse of them shows as growth
        self.baseline = baseline if baseline is not None else (_status_bytes("VmRSS") or 0)
        self.peak = self.baseline
        self._hwm = self._reset_hwm()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_bytes("VmRSS") or 0)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> _RssSampler:
        if not self._hwm:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5)
        self.peak = max(self.peak, _status_bytes("VmHWM" if self._hwm else "VmRSS") or 0)

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.baseline)


def worker_threads() -> int:
    """torch intra-op threads per transfer process: the sender and the receiver share the host's
    cores (on a 2-core host, more threads than cores make OpenMP spin and copies crawl)."""
    return max(1, (os.cpu_count() or 2) // 2)


def measure_memcpy_gbps(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Host memcpy bandwidth (GB/s, 1e9 bytes/s) of ``torch.Tensor.copy_``, median of ``repeats``,
    with the thread count of one transfer process (:func:`worker_threads`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads())
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / statistics.median(times) / 1e9


def _exit_with_parent() -> None:
    """Child processes end when the bench that started them is gone (no orphan blocked in a transfer)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-parent-watch").start()


# --------------------------------------------------------------------------------------------------
# child processes (hidden sub-commands of `python -m verl_fastsync.tools.bench`)


class _Child:
    """A child process speaking JSON lines (marked with ``_MARK``) on stdout, commands on stdin."""

    def __init__(self, args: Sequence[str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_fastsync.tools.bench", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._name = " ".join(args)
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                with self._cond:
                    self._lines.append(line[len(_MARK) :])
                    self._cond.notify_all()
        with self._cond:
            self._lines.append("")  # EOF marker
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-40]

    def stderr_tail(self) -> str:
        return "".join(self._stderr[-8:]).strip()

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        with self._cond:
            while not self._lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"child {self._name} gave no answer in {timeout_s or self.timeout_s:.0f} s"
                    )
                self._cond.wait(left)
            line = self._lines.pop(0)
        if not line:
            self.proc.wait(timeout=5)
            raise RuntimeError(
                f"child {self._name} exited with {self.proc.returncode}: {self.stderr_tail()[-800:]}"
            )
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.send({"op": "exit"})
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)


class _Node:
    __slots__ = ("payload", "peer")

    def __init__(self, payload: int) -> None:
        self.payload = payload
        self.peer: Any = None


def build_heap(objects: int) -> list[Any]:
    """A trainer-like Python heap of about ``objects`` GC-tracked objects (node <-> list <-> dict cycles)."""
    root: list[Any] = []
    for i in range(objects // 3):
        node = _Node(i)
        record = {"node": node, "step": i}
        node.peer = [record, i]
        root.append(node)
    return root


def make_garbage(objects: int) -> None:
    """Leave about ``objects`` unreachable objects in reference cycles in the oldest GC generation.

    They are kept alive through a young-generation collection (which promotes them, as objects that
    lived through a training step are), then dropped: only a full ``gc.collect()`` finds them, which
    is what a trainer's leftovers look like to the cleanup policies."""
    import gc

    holder: list[Any] = []
    for i in range(objects // 3):
        node = _Node(i)
        node.peer = [{"node": node}, i]
        holder.append(node)
    gc.collect(1)  # survivors move to the oldest generation
    holder.clear()


def _cleanup_child(heap_objects: int, repeats: int, policies: Sequence[str], cached_mib: int) -> None:
    import gc

    from verl_fastsync import plugins
    from verl_fastsync.cleanup import run_boundary
    from verl_fastsync.config import FastsyncConfig

    device, device_name, source = bench_device()
    t0 = time.perf_counter()
    heap = build_heap(heap_objects)
    gc.collect()
    _emit(
        {
            "event": "heap",
            "objects": len(gc.get_objects()),
            "seconds": time.perf_counter() - t0,
            "device": device_name,
            "device_source": source,
        }
    )
    pm = plugins.get_plugin_manager()
    config = FastsyncConfig()
    garbage = max(3, heap_objects // 100)
    for rep in range(repeats):
        for boundary in BOUNDARIES:
            for policy_name in policies:
                try:
                    policy = plugins.select_cleanup(pm, boundary, policy_name)
                    if cached_mib and device_name != "cpu":
                        # leave freed blocks in the caching allocator, as a finished training step does
                        count = max(1, cached_mib // 64)
                        blocks = [device_tensor(device_name, 64 * MIB) for _ in range(count)]
                        del blocks
                    make_garbage(garbage)
                    record = run_boundary(boundary, policy_name, policy, device, config)
                    _emit({"event": "record", "repeat": rep, **dataclasses.asdict(record)})
                except Exception as exc:
                    _emit(
                        {
                            "event": "error",
                            "repeat": rep,
                            "boundary": boundary,
                            "policy": policy_name,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
    del heap
    _emit({"event": "done"})


def device_tensor(device_name: str, nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device_name)


# ---- stock verl transfer paths, run inside a worker process ------------------------------------


def _load_verl_bucketed_module() -> Any:
    """verl's vLLM-side bucketed sender/receiver module, loaded by file path and pointed at the CPU.

    The ``vllm_rollout`` package ``__init__`` imports vLLM, so the module is loaded from its file;
    its device helpers are replaced by the CPU stand-in (there is no accelerator and no CUDA IPC).
    """
    import verl

    path = os.path.join(
        os.path.dirname(verl.__file__), "workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
    )
    if not os.path.exists(path):
        raise RuntimeError(f"verl {_verl_version()} has no {path}")
    spec = importlib.util.spec_from_file_location("_verl_fastsync_bench_bucketed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    device = CpuDevice()
    patches: dict[str, Any] = {
        "get_torch_device": lambda: device,
        "is_support_ipc": lambda: False,
        "get_device_name": lambda: "cpu",
        "get_device_id": lambda: 0,
    }
    for name, value in patches.items():
        if hasattr(module, name):
            setattr(module, name, value)
    return module


def _pack(obj: Any) -> str:
    """Transport metadata (may hold bytes) -> text for the JSON-lines channel (msgpack, base64)."""
    import base64

    import msgspec

    return base64.b64encode(msgspec.msgpack.encode(obj)).decode("ascii")


def _unpack(text: str) -> Any:
    import base64

    import msgspec

    return msgspec.msgpack.decode(base64.b64decode(text))


def _verl_chunk_functions() -> tuple[Any, Any, Any]:
    """verl's ``split_weight_chunks``, ``merge_weight_chunks`` and ``TensorMeta`` (verl 0.8.0+)."""
    try:
        from verl.checkpoint_engine.base import TensorMeta, merge_weight_chunks, split_weight_chunks
    except ImportError as exc:
        raise RuntimeError(
            f"verl {_verl_version()} has no split_weight_chunks/merge_weight_chunks (added in 0.8.0): {exc}"
        ) from exc
    return split_weight_chunks, merge_weight_chunks, TensorMeta


def _broadcast_meta(metas: list[Any] | None) -> list[Any]:
    """Bucket metadata from rank 0 to rank 1 over gloo (msgspec-encoded, no pickle)."""
    import msgspec
    import torch
    import torch.distributed as dist

    if metas is not None:
        payload = msgspec.msgpack.encode(metas)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(length, src=0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)
        return metas
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0)
    buf = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    decoded: list[Any] = msgspec.msgpack.decode(buf.numpy().tobytes())
    return decoded


async def _verl_gloo_send(tensors: list[tuple[str, Any]], bucket_bytes: int) -> None:
    """verl's engine-side bucketing (``split_weight_chunks`` into a bucket, as its NCCL engine does),
    each full bucket broadcast over gloo with its metadata."""
    import torch
    import torch.distributed as dist

    split, _, _ = _verl_chunk_functions()
    buf = torch.empty(bucket_bytes, dtype=torch.uint8)
    metas: list[Any] = []
    offset = 0

    def flush(is_last: bool) -> None:
        _broadcast_meta([is_last, offset, metas])
        if offset:
            dist.broadcast(buf[:offset], src=0)

    async for meta, chunk in split(iter(tensors), bucket_bytes):
        if offset + meta.chunk_size > bucket_bytes:
            flush(False)
            metas, offset = [], 0
        buf[offset : offset + meta.chunk_size].copy_(chunk)
        metas.append(
            [meta.name, list(meta.shape), str(meta.dtype).removeprefix("torch."), meta.chunk_offset,
             meta.chunk_size, offset]
        )  # fmt: skip
        offset += meta.chunk_size
    flush(True)


async def _verl_gloo_receive(dest: dict[str, Any], bucket_bytes: int) -> None:
    """Buckets from gloo, their chunks merged by verl's ``merge_weight_chunks``, copied into ``dest``."""
    import torch
    import torch.distributed as dist

    _, merge, tensor_meta = _verl_chunk_functions()
    buf = torch.empty(bucket_bytes, dtype=torch.uint8)

    async def chunks() -> Any:
        while True:
            is_last, length, metas = _broadcast_meta(None)
            if length:
                dist.broadcast(buf[:length], src=0)
            for name, shape, dtype, chunk_offset, chunk_size, offset in metas:
                meta = tensor_meta(
                    name=name, shape=torch.Size(shape), dtype=getattr(torch, dtype),
                    chunk_offset=chunk_offset, chunk_size=chunk_size, offset=offset,
                )  # fmt: skip
                yield meta, buf[offset : offset + chunk_size]
            if is_last:
                return

    async for name, tensor in merge(chunks(), bucket_bytes):
        dest[name].copy_(tensor)


class _Worker:
    """State of one transfer worker: cached models and the verl module."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._models: dict[tuple[str, float, int, int, str], list[tuple[str, Any]]] = {}
        self._verl: Any = None
        self._engine: Any = None
        self._init_seconds: float | None = None
        self._transport_peak: int | None = None
        self._trial_id: str | None = None
        self._trial_baseline: int | None = None

    def model(self, trial: dict[str, Any]) -> list[tuple[str, Any]]:
        from verl_fastsync.tools.models import build_model, model_spec, split_spec

        device = trial.get("device", "cpu")
        key = (trial["model"], trial["size_bytes"], trial["pieces"], trial["seed"], device)
        if key not in self._models:
            self._models.clear()
            spec = model_spec(trial["model"], trial["size_bytes"])
            if trial["pieces"] > 1:
                spec = split_spec(spec, trial["pieces"])
            tensors = build_model(spec, seed=trial["seed"], device=device)
            if self.role == "receiver":  # the rollout's own weights: the destination, zeroed
                for _, t in tensors:
                    t.zero_()
            self._models[key] = tensors
        return self._models[key]

    def prepare(self, trial: dict[str, Any]) -> list[tuple[str, Any]]:
        """Everything before the timed part: the model and the transfer module."""
        tensors = self.model(trial)
        if trial["impl"] == "verl-shm":
            if self._verl is None:
                self._verl = _load_verl_bucketed_module()
                # imported by the sender on its first send: load it now, outside the measurement
                importlib.import_module("verl.workers.rollout.utils")
        elif trial["impl"] == "fastsync-colocated":
            importlib.import_module("verl_fastsync.colocated")
        elif trial["impl"] == "verl-gloo":
            _verl_chunk_functions()  # raises on releases without them
            self._gloo_group(trial)
        elif trial["impl"] == "fastsync-engine":
            from verl_fastsync import plugins

            factory = plugins.select_transport(plugins.plugin_manager(), trial["transport"], "engine")
            getattr(factory, "load", lambda: None)()  # import the transport's module now
        else:
            raise RuntimeError(f"unknown worker impl {trial['impl']!r}")
        if trial["zmq"] != self._trial_id:
            # a new trial: free what the previous one kept between syncs (colocated slots), then
            # take the memory baseline every run of this trial is measured against, so buffers a
            # transport keeps from sync to sync count as its extra memory
            if "verl_fastsync.colocated" in sys.modules:
                sys.modules["verl_fastsync.colocated"].release_colocated_resources()
            _malloc_trim()
            self._trial_id = trial["zmq"]
            self._trial_baseline = _status_bytes("VmRSS")
        return tensors

    def prepare_engine(self, trial: dict[str, Any]) -> dict[str, Any]:
        """A fresh engine transport for one sync (verl's lifecycle): its ``prepare()`` metadata."""
        from verl_fastsync import plugins
        from verl_fastsync.transports.base import TransportOptions

        if self._engine is not None:
            self._engine.finalize()
            self._engine = None
        factory = plugins.select_transport(plugins.plugin_manager(), trial["transport"], "engine")
        options = TransportOptions(
            is_master=self.role == "sender", timeout_s=trial["timeout_s"], device=trial.get("device", "cpu")
        )
        self._engine = factory(options)
        meta = self._engine.prepare()
        return {"meta": _pack(meta)}

    def init_engine(self, kwargs: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        assert self._engine is not None
        self._engine.init_process_group(**kwargs)
        self._init_seconds = time.perf_counter() - t0

    def _run_engine(self, trial: dict[str, Any], tensors: list[tuple[str, Any]]) -> None:
        engine = self._engine
        assert engine is not None, "init the engine transport first"
        try:
            if self.role == "sender":
                stats = asyncio.run(engine.send(iter(tensors)))
            else:
                dest = dict(tensors)

                async def consume() -> None:
                    async for name, tensor in engine.receive():
                        dest[name].copy_(tensor)

                asyncio.run(consume())
                stats = engine.last_stats
            self._transport_peak = getattr(stats, "peak_extra_bytes", None)
        finally:
            engine.finalize()
            self._engine = None

    def _gloo_group(self, trial: dict[str, Any]) -> Any:
        """A two-rank gloo group between this worker pair (sender rank 0), made once."""
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{trial['gloo_port']}",
                rank=0 if self.role == "sender" else 1,
                world_size=2,
                timeout=__import__("datetime").timedelta(seconds=trial["timeout_s"]),
            )
        return dist.group.WORLD

    def _run_verl_gloo(self, trial: dict[str, Any], tensors: list[tuple[str, Any]]) -> None:
        if self.role == "sender":
            asyncio.run(_verl_gloo_send(tensors, trial["bucket_bytes"]))
        else:
            asyncio.run(_verl_gloo_receive(dict(tensors), trial["bucket_bytes"]))

    def _endpoints(self, trial: dict[str, Any]) -> tuple[Any, Any]:
        """(sender, receiver) factories of the trial's implementation."""
        import torch

        bucket_mib = trial["bucket_bytes"] // MIB
        device_name = trial.get("device", "cpu")
        device = torch.device(device_name)
        if trial["impl"] in ("verl-gloo", "fastsync-engine"):
            return (None, None)
        if trial["impl"] == "verl-shm":
            mod = self._verl
            return (
                lambda: mod.BucketedWeightSender(trial["zmq"], bucket_size_mb=bucket_mib, use_shm=True),
                lambda: mod.BucketedWeightReceiver(trial["zmq"], device, use_shm=True),
            )
        from verl_fastsync import colocated

        dev_module = CpuDevice() if device.type == "cpu" else None
        use_shm = trial["transport"] == "shm"
        return (
            lambda: colocated.ColocatedSender(
                trial["zmq"],
                bucket_size_mb=bucket_mib,
                use_shm=use_shm,
                transport=trial["transport"],
                timeout_s=trial["timeout_s"],
                device_module=dev_module,
            ),
            lambda: colocated.ColocatedReceiver(
                trial["zmq"],
                device,
                use_shm=use_shm,
                timeout_s=trial["timeout_s"],
                device_module=dev_module,
            ),
        )

    def run(self, trial: dict[str, Any]) -> dict[str, Any]:
        from verl_fastsync.tools.models import fingerprint

        tensors = self.prepare(trial)
        make_sender, make_receiver = self._endpoints(trial)
        device_peak = _DevicePeak(trial.get("device", "cpu"))
        with _RssSampler(baseline=self._trial_baseline) as rss, device_peak:
            t_start = time.perf_counter()
            if trial["impl"] == "verl-gloo":
                self._run_verl_gloo(trial, tensors)
            elif trial["impl"] == "fastsync-engine":
                self._run_engine(trial, tensors)
            elif self.role == "sender":
                asyncio.run(make_sender().async_send_weights(iter(tensors)))
            else:
                dest = dict(tensors)

                def on_bucket(weights: list[tuple[str, Any]], is_last: bool = False) -> None:
                    for name, w in weights:
                        dest[name].copy_(w)

                make_receiver().receive_weights(on_bucket)
            t_end = time.perf_counter()
        result: dict[str, Any] = {
            "t_start": t_start,
            "t_end": t_end,
            # host RSS growth for host transfers; the caching allocator's peak for device ones
            "peak_extra_bytes": device_peak.extra if device_peak.active else rss.extra,
            "setup_seconds": self._init_seconds,
            "transport_peak_bytes": self._transport_peak,
        }
        self._init_seconds = self._transport_peak = None
        if trial.get("verify", True):
            result["fingerprint"] = sum(fingerprint(t) for _, t in tensors)
            if self.role == "receiver":  # reset the destination for the next repeat
                for _, t in tensors:
                    t.zero_()
        return result


def _worker_main(role: str) -> None:
    import torch

    torch.set_num_threads(worker_threads())
    worker = _Worker(role)
    _emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        try:
            if cmd.get("op") == "prepare":
                worker.prepare(cmd["trial"])
                engine = cmd["trial"]["impl"] == "fastsync-engine"
                extra = worker.prepare_engine(cmd["trial"]) if engine else {}
                _emit({"event": "prepared", "ok": True, **extra})
                continue
            if cmd.get("op") == "init":
                worker.init_engine(_unpack(cmd["kwargs"]))
                _emit({"event": "initialised", "ok": True})
                continue
            _emit({"event": "result", "ok": True, **worker.run(cmd["trial"])})
        except BaseException as exc:
            _emit({"event": "result", "ok": False, "error": f"{type(exc).__name__}: {exc}".strip()})


def _probe_verl_nixl(bucket_bytes: int) -> None:
    """Construct verl's own NIXL checkpoint engine on CPU DRAM and prepare it; report what happens."""
    try:
        from verl.checkpoint_engine import nixl_checkpoint_engine as mod

        engine = mod.NIXLCheckpointEngine(bucket_size=bucket_bytes, device="cpu")
        engine.prepare()
        _emit({"event": "probe", "ok": True})
    except BaseException as exc:
        _emit({"event": "probe", "ok": False, "error": f"{type(exc).__name__}: {exc}".strip()})


# --------------------------------------------------------------------------------------------------
# sections


def run_cleanup_section(
    opts: BenchOptions, progress: Callable[[str], None]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Cleanup rows (one per boundary x policy, medians over repeats) and section info."""
    progress(f"cleanup: building a {opts.heap_objects:,}-object heap in a child process")
    child = _Child(
        ["_cleanup-child", str(opts.heap_objects), str(opts.repeats), ",".join(POLICIES), "1024"],
        opts.timeout_s,
    )
    records: dict[tuple[str, str], list[dict[str, Any]]] = {}
    errors: dict[tuple[str, str], str] = {}
    info: dict[str, Any] = {}
    try:
        while True:
            msg = child.recv()
            if msg["event"] == "heap":
                info = {k: msg[k] for k in ("objects", "device", "device_source")}
                info["heap_build_seconds"] = msg["seconds"]
            elif msg["event"] == "record":
                records.setdefault((msg["boundary"], msg["policy"]), []).append(msg)
                progress(
                    f"cleanup: {msg['policy']:<10} @ {msg['boundary']:<22} repeat {msg['repeat'] + 1}/"
                    f"{opts.repeats}: {msg['seconds'] * 1000:.1f} ms"
                )
            elif msg["event"] == "error":
                errors[(msg["boundary"], msg["policy"])] = msg["error"]
            elif msg["event"] == "done":
                break
    except (TimeoutError, RuntimeError) as exc:
        for b in BOUNDARIES:
            for p in POLICIES:
                errors.setdefault((b, p), str(exc))
    finally:
        child.kill()
    rows = []
    for boundary in BOUNDARIES:
        for policy in POLICIES:
            recs = records.get((boundary, policy), [])
            row: dict[str, Any] = {
                "boundary": boundary,
                "policy": policy,
                "device": info.get("device", "unknown"),
                "heap_objects": info.get("objects"),
                "repeats": len(recs),
            }
            if recs and (boundary, policy) not in errors:
                med, lo, hi = _median_min_max([r["seconds"] for r in recs])
                row.update(
                    status="ok",
                    error=None,
                    seconds=med,
                    seconds_min=lo,
                    seconds_max=hi,
                    gc_ran=any(r["gc_ran"] for r in recs),
                    gc_collected=int(statistics.median(r["gc_collected"] for r in recs)),
                    attempts=max(r["attempts"] for r in recs),
                    reserved_freed_bytes=int(statistics.median(r["reserved_freed_bytes"] for r in recs)),
                    allocated_freed_bytes=int(statistics.median(r["allocated_freed_bytes"] for r in recs)),
                )
            else:
                row.update(
                    status="failed",
                    error=errors.get((boundary, policy), "no result"),
                    seconds=None,
                    seconds_min=None,
                    seconds_max=None,
                    gc_ran=None,
                    gc_collected=None,
                    attempts=None,
                    reserved_freed_bytes=None,
                    allocated_freed_bytes=None,
                )
            rows.append(row)
    ratios: dict[str, float | None] = {}
    for boundary in BOUNDARIES:
        by = {r["policy"]: r for r in rows if r["boundary"] == boundary and r["status"] == "ok"}
        light, aggr = by.get("light"), by.get("aggressive")
        ratios[boundary] = (
            (aggr["seconds"] / light["seconds"]) if light and aggr and light["seconds"] > 0 else None
        )
    info["aggressive_over_light"] = ratios
    return rows, info


@dataclasses.dataclass
class _Trial:
    transport: str
    impl: str
    kind: str
    model: str
    size_bytes: int
    bucket_bytes: int
    pieces: int = 1


def _failed_row(trial: _Trial, error: str, **extra: Any) -> dict[str, Any]:
    from verl_fastsync.tools.models import model_spec, split_spec

    spec = model_spec(trial.model, trial.size_bytes)
    if trial.pieces > 1:
        spec = split_spec(spec, trial.pieces)
    row: dict[str, Any] = {
        "transport": trial.transport,
        "impl": "verl" if trial.impl.startswith("verl") else "fastsync",
        "kind": trial.kind,
        "model": trial.model,
        "model_bytes": spec.nbytes,
        "tensor_count": len(spec.tensors),
        "largest_tensor_bytes": spec.largest_tensor_bytes,
        "bucket_bytes": trial.bucket_bytes,
        "status": "failed",
        "error": error,
        "repeats": 0,
        "seconds": None,
        "seconds_min": None,
        "seconds_max": None,
        "gbps": None,
        "fraction_of_memcpy": None,
        "peak_sender_bytes": None,
        "peak_receiver_bytes": None,
        "verified": None,
    }
    row.update(extra)
    return row


def _ok_row(
    trial: _Trial,
    seconds: list[float],
    peaks_s: list[int],
    peaks_r: list[int],
    memcpy: float,
    verified: bool | None,
    **extra: Any,
) -> dict[str, Any]:
    row = _failed_row(trial, "")
    med, lo, hi = _median_min_max(seconds)
    gbps = row["model_bytes"] / med / 1e9 if med > 0 else None
    row.update(
        status="ok",
        error=None,
        repeats=len(seconds),
        seconds=med,
        seconds_min=lo,
        seconds_max=hi,
        gbps=gbps,
        fraction_of_memcpy=(gbps / memcpy) if gbps and memcpy else None,
        peak_sender_bytes=max(peaks_s) if peaks_s else None,
        peak_receiver_bytes=max(peaks_r) if peaks_r else None,
        verified=verified,
    )
    row.update(extra)
    return row


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _WorkerPair:
    """A persistent sender and receiver process for the stock verl paths."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.sender: _Child | None = None
        self.receiver: _Child | None = None
        self.gloo_port = _free_port()

    def _ensure(self) -> tuple[_Child, _Child]:
        if self.sender is None or self.sender.proc.poll() is not None:
            self.sender = _Child(["_worker", "sender"], self.timeout_s)
            self.sender.recv()
        if self.receiver is None or self.receiver.proc.poll() is not None:
            self.receiver = _Child(["_worker", "receiver"], self.timeout_s)
            self.receiver.recv()
        return self.sender, self.receiver

    def run(
        self, trial: _Trial, seed: int, zmq: str, device: str = "cpu", verify: bool = True
    ) -> dict[str, Any]:
        sender, receiver = self._ensure()
        payload = dataclasses.asdict(trial) | {
            "seed": seed,
            "zmq": zmq,
            "timeout_s": self.timeout_s,
            "device": device,
            "verify": verify,
            "gloo_port": self.gloo_port,
        }
        for child in (receiver, sender):
            child.send({"op": "prepare", "trial": payload})
        readies = [child.recv() for child in (receiver, sender)]
        for ready in readies:
            if not ready["ok"]:
                self._reset()
                return ready
        if trial.impl == "fastsync-engine":
            # the driver's part of verl's checkpoint-engine lifecycle: build_topology, then
            # init_process_group on both ranks at once
            try:
                from verl_fastsync import plugins

                factory: Any = plugins.select_transport(plugins.plugin_manager(), trial.transport, "engine")
                meta_r, meta_s = (_unpack(r["meta"]) for r in readies)
                actor, rollout = factory.build_topology(1, 1, [meta_s, meta_r])
                kwargs_s = {k: v[0] for k, v in actor.items()} | {"bucket_size": trial.bucket_bytes}
                kwargs_r = {k: v[0] for k, v in rollout.items()} | {"bucket_size": trial.bucket_bytes}
            except Exception as exc:
                self._reset()
                return {"ok": False, "error": f"build_topology: {type(exc).__name__}: {exc}"}
            receiver.send({"op": "init", "kwargs": _pack(kwargs_r)})
            sender.send({"op": "init", "kwargs": _pack(kwargs_s)})
            for child in (receiver, sender):
                ready = child.recv()
                if not ready["ok"]:
                    self._reset()
                    return ready
        receiver.send({"op": "run", "trial": payload})
        sender.send({"op": "run", "trial": payload})
        s = sender.recv()
        if not s["ok"]:
            # the receiver waits for buckets that will never come: replace the pair (a gloo group
            # with a dead peer cannot be reused either)
            self._reset()
            return s
        r = receiver.recv()
        if not r["ok"]:
            return r
        return {
            "ok": True,
            "seconds": r["t_end"] - s["t_start"],
            "peak_sender": s["peak_extra_bytes"],
            "peak_receiver": r["peak_extra_bytes"],
            "verified": (s.get("fingerprint") == r.get("fingerprint")) if verify else None,
            "setup_seconds": max(s.get("setup_seconds") or 0.0, r.get("setup_seconds") or 0.0),
            "transport_peak_sender": s.get("transport_peak_bytes"),
            "transport_peak_receiver": r.get("transport_peak_bytes"),
        }

    def _reset(self) -> None:
        """Replace both processes (after a failure one of them may be blocked on the other)."""
        for child in (self.sender, self.receiver):
            if child is not None:
                child.kill()
        self.sender = self.receiver = None
        self.gloo_port = _free_port()

    def close(self) -> None:
        for child in (self.sender, self.receiver):
            if child is not None:
                child.close()


_NOTES = {
    "fastsync-engine": "verl_fastsync engine transport (prepare/build_topology/init/send/receive/finalize)",
    "verl-gloo": "verl split_weight_chunks/merge_weight_chunks (its NCCL engine's bucketing) over gloo",
    "verl-shm": "verl BucketedWeightSender/Receiver(use_shm=True), CPU stand-in device",
    "fastsync-colocated": "verl_fastsync.colocated ColocatedSender/Receiver",
}


def _run_pair_rows(
    trials: Iterable[_Trial],
    opts: BenchOptions,
    memcpy: float,
    progress: Callable[[str], None],
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Rows for the colocated paths (verl's and fastsync's), run in a persistent process pair."""
    rows = []
    pair = _WorkerPair(opts.timeout_s)
    try:
        for trial in trials:
            seconds: list[float] = []
            ps: list[int] = []
            pr: list[int] = []
            setup: list[float] = []
            tps: list[int | None] = []
            tpr: list[int | None] = []
            verified = True
            error = None
            label = "verl" if trial.impl.startswith("verl") else "fastsync"
            # one socket path per trial, reused by its repeats (as a trainer reuses it every sync)
            zmq = f"ipc://{tempfile.gettempdir()}/verl-fastsync-bench-{uuid.uuid4().hex[:12]}.sock"
            for rep in range(opts.repeats + 1):
                progress(
                    f"transfer: {label} {trial.kind} {trial.transport} {trial.model} "
                    f"{trial.size_bytes / MIB:.0f} MiB x{trial.pieces}, "
                    f"bucket {trial.bucket_bytes // MIB} MiB, "
                    + (f"repeat {rep}/{opts.repeats}" if rep else "warm-up + byte check")
                )
                try:
                    # run 0 is an untimed warm-up (the steady state is every sync after the first)
                    # that checks the received bytes (the destination starts zeroed)
                    res = pair.run(trial, opts.seed, zmq, device, verify=rep == 0)
                except (TimeoutError, RuntimeError) as exc:
                    pair.close()
                    pair = _WorkerPair(opts.timeout_s)
                    res = {"ok": False, "error": str(exc)}
                if not res["ok"]:
                    error = f"{label}: {res['error']}"
                    break  # failures here are deterministic (e.g. verl: a tensor larger than the bucket)
                if res["verified"] is not None:
                    verified = verified and res["verified"]
                if rep == 0:
                    continue
                seconds.append(res["seconds"])
                setup.append(res["setup_seconds"])
                ps.append(res["peak_sender"])
                pr.append(res["peak_receiver"])
                tps.append(res["transport_peak_sender"])
                tpr.append(res["transport_peak_receiver"])
            note = _NOTES.get(trial.impl, trial.impl)
            if error is not None:
                rows.append(_failed_row(trial, error, note=note))
            elif not verified:
                why = "received bytes differ from the sent model"
                if trial.impl == "verl-shm" and (_verl_version() or "").startswith("0.7."):
                    why += (
                        " (verl 0.7.x's receiver acknowledges a shared-memory bucket before its callback"
                        " reads it; on an accelerator the .to(device) copy made before the ack keeps that"
                        " safe, on a CPU host it is a view, so the sender overwrites the bucket being read)"
                    )
                rows.append(_failed_row(trial, why, note=note))
            else:
                extra: dict[str, Any] = {"note": note}
                if trial.impl == "fastsync-engine":
                    # connect + allocate (init_process_group), outside `seconds`, once per sync
                    extra["setup_seconds"] = statistics.median(setup)
                    # the transport's own accounting (bucket buffers + incomplete tensors)
                    for key, values in (("sender", tps), ("receiver", tpr)):
                        known = [x for x in values if x is not None]
                        extra[f"transport_peak_{key}_bytes"] = max(known) if known else None
                rows.append(_ok_row(trial, seconds, ps, pr, memcpy, verified, **extra))
    finally:
        pair.close()
    return rows


def _verl_nixl_rows(trials: Iterable[_Trial], opts: BenchOptions) -> list[dict[str, Any]]:
    """verl's own NIXL checkpoint engine: prepared once on CPU DRAM; its error becomes the row."""
    trials = list(trials)
    if not trials:
        return []
    child = _Child(["_probe-verl-nixl", str(trials[0].bucket_bytes)], opts.timeout_s)
    try:
        msg = child.recv()
    except (TimeoutError, RuntimeError) as exc:
        msg = {"ok": False, "error": str(exc)}
    finally:
        child.kill()
    note = "verl NIXLCheckpointEngine(device='cpu')"
    if msg.get("ok"):
        error = (
            "not available: verl's NIXL engine prepares on this host, but it needs a Ray actor "
            "topology the bench does not build"
        )
    else:
        error = f"verl: {msg.get('error')}"
    return [_failed_row(t, error, note=note) for t in trials]


def _available_fastsync(kind: str) -> list[str]:
    try:
        from verl_fastsync import plugins

        return plugins.available_transports(plugins.get_plugin_manager(), kind)
    except Exception:
        return []


def _run_rows(
    trials: list[_Trial], opts: BenchOptions, memcpy: float, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Run trials with the harness of their implementation (one process pair for all colocated
    trials, so models are built once); rows come back in the order of ``trials``."""
    import torch

    groups: dict[str, list[tuple[int, _Trial]]] = {}
    for i, trial in enumerate(trials):
        if trial.impl == "verl-nixl":
            key = "verl-nixl"
        elif trial.transport in GPU_TRANSPORTS:
            key = "pair-device"
        else:
            key = "pair-cpu"
        groups.setdefault(key, []).append((i, trial))
    results: list[dict[str, Any] | None] = [None] * len(trials)
    for key, items in groups.items():
        batch = [t for _, t in items]
        if key == "verl-nixl":
            progress("transfer: verl nixl (preparing verl's NIXL checkpoint engine on this host)")
            rows = _verl_nixl_rows(batch, opts)
        else:
            device = "cuda" if key == "pair-device" and torch.cuda.is_available() else "cpu"
            rows = _run_pair_rows(batch, opts, memcpy, progress, device)
        for (i, _), row in zip(items, rows, strict=True):
            results[i] = row
    return [r for r in results if r is not None]


def _transport_plan(opts: BenchOptions) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """(transport, impl, kind) triples to run and, for requested transports that cannot run, why."""
    import torch

    has_cuda = torch.cuda.is_available()
    wanted = opts.transports or (CPU_TRANSPORTS + (GPU_TRANSPORTS if has_cuda else ()))
    engine = set(_available_fastsync("engine"))
    colocated = set(_available_fastsync("colocated"))
    plan: list[tuple[str, str, str]] = []
    skipped: dict[str, str] = {}
    for name in wanted:
        if name in GPU_TRANSPORTS and not has_cuda:
            skipped[name] = "not available: needs CUDA (torch.cuda.is_available() is False)"
            continue
        if name in colocated:
            plan.append((name, "fastsync-colocated", "colocated"))
        if name in engine or (name not in colocated and name != "ipc"):
            # an engine transport that is not registered still gets its row (failed, with why)
            plan.append((name, "fastsync-engine", "engine"))
        if name == "ipc" and name not in colocated:
            plan.append((name, "fastsync-colocated", "colocated"))
        if name == "shm":
            plan.append((name, "verl-shm", "colocated"))
        if name == "gloo":
            plan.append((name, "verl-gloo", "engine"))
        if name == "nixl":
            plan.append((name, "verl-nixl", "engine"))
    return plan, skipped


def run_transfer_section(
    opts: BenchOptions, memcpy: float, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    size = int(opts.size_gib * GIB)
    plan, skipped = _transport_plan(opts)
    colocated = set(_available_fastsync("colocated"))
    trials: list[_Trial] = []
    rows: list[dict[str, Any]] = []
    for model in opts.models:
        for b in opts.bucket_mib:
            for transport, impl, kind in plan:
                trial = _Trial(transport, impl, kind, model, size, b * MIB)
                if impl == "fastsync-colocated" and transport not in colocated:
                    rows.append(
                        _failed_row(
                            trial, f"not available: no colocated transport {transport!r} is registered"
                        )
                    )
                    continue
                trials.append(trial)
    rows = _run_rows(trials, opts, memcpy, progress) + rows
    for name, why in skipped.items():
        for model in opts.models:
            for b in opts.bucket_mib:
                kind = "colocated" if name == "ipc" else "engine"
                rows.append(_failed_row(_Trial(name, "fastsync-" + kind, kind, model, size, b * MIB), why))
    return rows


def run_scale_section(
    opts: BenchOptions, memcpy: float, progress: Callable[[str], None], transfer_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Seconds against model bytes and against tensor count (equal bytes), for the fastest working
    fastsync transport and the stock verl shm path next to it, with the first preset and the largest
    bucket."""
    model = opts.models[0]
    bucket = max(opts.bucket_mib) * MIB
    size = int(opts.size_gib * GIB)
    ok = [
        r
        for r in transfer_rows
        if r["status"] == "ok" and r["model"] == model and r["bucket_bytes"] == bucket
    ]
    fast = [r for r in ok if r["impl"] == "fastsync"]
    picks: list[tuple[str, str, str]] = []
    if fast:
        best = min(fast, key=lambda r: r["seconds"])
        picks.append((best["transport"], "fastsync-" + best["kind"], best["kind"]))
    if any(r["impl"] == "verl" and r["transport"] == "shm" for r in ok) or not picks:
        picks.append(("shm", "verl-shm", "colocated"))
    trials: list[_Trial] = []
    axes: list[str] = []
    for transport, impl, kind in picks:
        for f in opts.scale_sizes:
            trials.append(_Trial(transport, impl, kind, model, int(size * f), bucket))
            axes.append("model_bytes")
        for p in opts.scale_pieces:
            trials.append(_Trial(transport, impl, kind, model, size, bucket, pieces=p))
            axes.append("tensor_count")
    rows = _run_rows(trials, opts, memcpy, progress)
    return [{"axis": axis, **row} for axis, row in zip(axes, rows, strict=True)]


# --------------------------------------------------------------------------------------------------
# orchestration


def run_bench(opts: BenchOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the requested sections and return the JSON document (see docs/bench-schema.md)."""
    opts.check()
    progress = progress or (lambda _m: None)
    import torch

    started = time.time()
    t0 = time.monotonic()
    progress("measuring memcpy bandwidth")
    memcpy = measure_memcpy_gbps()
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "verl_version": _verl_version(),
        "verl_fastsync_version": importlib.import_module("verl_fastsync").__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": {"cpus": os.cpu_count(), "cuda": torch.cuda.is_available(), "machine": platform.machine()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(opts).items()},
        "memcpy_gbps": memcpy,
        "cleanup": [],
        "cleanup_info": {},
        "transfer": [],
        "scale": [],
    }
    if "cleanup" in opts.sections:
        result["cleanup"], result["cleanup_info"] = run_cleanup_section(opts, progress)
    if "transfer" in opts.sections:
        result["transfer"] = run_transfer_section(opts, memcpy, progress)
    if "scale" in opts.sections:
        result["scale"] = run_scale_section(opts, memcpy, progress, result["transfer"])
    result["wall_seconds"] = time.monotonic() - t0
    validate_bench_json(result)
    return result


# --------------------------------------------------------------------------------------------------
# schema


_CLEANUP_FIELDS: dict[str, tuple[type, ...]] = {
    "boundary": (str,),
    "policy": (str,),
    "status": (str,),
    "seconds": (float, int, type(None)),
    "gc_ran": (bool, type(None)),
}
_TRANSFER_FIELDS: dict[str, tuple[type, ...]] = {
    "transport": (str,),
    "impl": (str,),
    "model": (str,),
    "model_bytes": (int,),
    "bucket_bytes": (int,),
    "status": (str,),
    "error": (str, type(None)),
    "seconds": (float, int, type(None)),
    "gbps": (float, int, type(None)),
    "fraction_of_memcpy": (float, int, type(None)),
    "peak_sender_bytes": (int, type(None)),
    "peak_receiver_bytes": (int, type(None)),
}
_SCALE_FIELDS: dict[str, tuple[type, ...]] = {
    "axis": (str,),
    **_TRANSFER_FIELDS,
    "tensor_count": (int,),
}


def _check_row(section: str, i: int, row: Any, fields: dict[str, tuple[type, ...]]) -> None:
    where = f"{section}[{i}]"
    if not isinstance(row, dict):
        raise BenchSchemaError(f"{where} must be an object, got {type(row).__name__}")
    for key, types in fields.items():
        if key not in row:
            raise BenchSchemaError(f"{where} lacks required key {key!r}")
        value = row[key]
        if isinstance(value, bool) and bool not in types:
            raise BenchSchemaError(f"{where}.{key}={value!r} must be {'/'.join(t.__name__ for t in types)}")
        if not isinstance(value, types):
            raise BenchSchemaError(f"{where}.{key}={value!r} must be {'/'.join(t.__name__ for t in types)}")
    if row["status"] not in ("ok", "failed"):
        raise BenchSchemaError(f"{where}.status={row['status']!r}; allowed: ok, failed")
    if row["status"] == "ok" and row["seconds"] is None:
        raise BenchSchemaError(f"{where}: status ok needs seconds")
    if row["status"] == "failed" and not row.get("error"):
        raise BenchSchemaError(f"{where}: status failed needs an error message")
    if "impl" in fields and row["impl"] not in ("fastsync", "verl"):
        raise BenchSchemaError(f"{where}.impl={row['impl']!r}; allowed: fastsync, verl")
    if "boundary" in fields and row["boundary"] not in BOUNDARIES:
        raise BenchSchemaError(f"{where}.boundary={row['boundary']!r}; allowed: {', '.join(BOUNDARIES)}")
    if "axis" in fields and row["axis"] not in ("model_bytes", "tensor_count"):
        raise BenchSchemaError(f"{where}.axis={row['axis']!r}; allowed: model_bytes, tensor_count")


def validate_bench_json(obj: Any) -> None:
    """Raise :class:`BenchSchemaError` unless ``obj`` follows the bench schema (docs/bench-schema.md)."""
    if not isinstance(obj, dict):
        raise BenchSchemaError(f"the document must be an object, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BenchSchemaError(f"schema_version={version!r} must be an int")
    if version != SCHEMA_VERSION:
        raise BenchSchemaError(f"schema_version={version}; this validator reads {SCHEMA_VERSION}")
    if "verl_version" not in obj or not isinstance(obj["verl_version"], (str, type(None))):
        raise BenchSchemaError("verl_version must be present (a string, or null without verl)")
    memcpy = obj.get("memcpy_gbps")
    if not isinstance(memcpy, (int, float)) or isinstance(memcpy, bool) or not memcpy > 0:
        raise BenchSchemaError(f"memcpy_gbps={memcpy!r} must be a positive number")
    for section, fields in (
        ("cleanup", _CLEANUP_FIELDS),
        ("transfer", _TRANSFER_FIELDS),
        ("scale", _SCALE_FIELDS),
    ):
        rows = obj.get(section)
        if not isinstance(rows, list):
            raise BenchSchemaError(f"{section} must be a list, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            _check_row(section, i, row, fields)


# --------------------------------------------------------------------------------------------------
# output


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= GIB:
        return f"{n / GIB:.2f}G"
    return f"{n / MIB:.1f}M"


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _short(error: str | None, width: int = 120) -> str:
    if not error:
        return ""
    error = " ".join(error.split())
    error = re.sub(r"torch\.Size\((\[[^\]]*\])\)", r"\1", error)
    error = re.sub(r"\btorch\.(bfloat16|float16|float32|float64|u?int\d+|bool)\b", r"\1", error)
    return error if len(error) <= width else error[: width - 3] + "..."


def render_table(result: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    parts = [
        f"verl-fastsync bench  (verl {result.get('verl_version')}, torch {result.get('torch_version')}, "
        f"{result['host']['cpus']} CPUs, cuda={result['host']['cuda']})",
        f"memcpy: {result['memcpy_gbps']:.2f} GB/s",
    ]
    if result["cleanup"]:
        info = result.get("cleanup_info", {})
        parts.append(
            f"\nCLEANUP  (device {info.get('device')}, heap {info.get('objects', 0):,} GC objects, "
            f"median of {result['options']['repeats']})"
        )
        rows = []
        for r in result["cleanup"]:
            if r["status"] == "ok":
                rows.append(
                    [
                        r["boundary"],
                        r["policy"],
                        f"{r['seconds'] * 1000:.1f}",
                        f"{r['seconds_min'] * 1000:.1f}-{r['seconds_max'] * 1000:.1f}",
                        str(r["gc_ran"]),
                        str(r["gc_collected"]),
                        _fmt_bytes(r["reserved_freed_bytes"]),
                        "",
                    ]
                )
            else:
                rows.append([r["boundary"], r["policy"], "-", "-", "-", "-", "-", _short(r["error"])])
        parts.append(
            _table(["boundary", "policy", "ms", "min-max", "gc_ran", "collected", "freed", "error"], rows)
        )
        ratios = info.get("aggressive_over_light", {})
        extra = {}
        for b in ratios:
            by = {r["policy"]: r for r in result["cleanup"] if r["boundary"] == b and r["status"] == "ok"}
            if "light" in by and "aggressive" in by:
                extra[b] = f" (+{by['aggressive']['seconds'] - by['light']['seconds']:.3f} s per call)"
        shown = [f"{b}: {'-' if v is None else f'{v:.1f}x'}{extra.get(b, '')}" for b, v in ratios.items()]
        parts.append("aggressive/light seconds: " + ", ".join(shown))
    for section in ("transfer", "scale"):
        if not result[section]:
            continue
        parts.append(
            f"\n{section.upper()}  (median of {result['options']['repeats']}; "
            "peaks: growth above start, host RSS / device allocator)"
        )
        rows = []
        for r in result[section]:
            head = [r["axis"]] if section == "scale" else []
            row = [
                *head,
                r["transport"],
                r["impl"],
                r["kind"],
                r["model"],
                _fmt_bytes(r["model_bytes"]),
                str(r["tensor_count"]),
                _fmt_bytes(r["bucket_bytes"]),
            ]
            if r["status"] == "ok":
                row += [
                    _fmt_s(r["seconds"]),
                    f"{_fmt_s(r['seconds_min'])}-{_fmt_s(r['seconds_max'])}",
                    f"{r['gbps']:.2f}",
                    f"{r['fraction_of_memcpy']:.2f}" if r["fraction_of_memcpy"] is not None else "-",
                    _fmt_bytes(r["peak_sender_bytes"]),
                    _fmt_bytes(r["peak_receiver_bytes"]),
                    "ok",
                ]
            else:
                row += ["-"] * 6 + ["FAILED: " + _short(r["error"])]
            rows.append(row)
        headers = [
            "transport",
            "impl",
            "kind",
            "model",
            "bytes",
            "tensors",
            "bucket",
            "s",
            "min-max",
            "GB/s",
            "of memcpy",
            "peak send",
            "peak recv",
            "status",
        ]
        parts.append(_table((["axis"] if section == "scale" else []) + headers, rows))
    if "wall_seconds" in result:
        parts.append(f"\nwall time: {result['wall_seconds']:.1f} s")
    return "\n".join(parts)


def write_plot(result: dict[str, Any], path: str) -> None:
    """GB/s and peak memory against bucket size, one line per (transport, kind, impl, model)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            f"--plot needs matplotlib ({exc}); install it with `pip install verl-fastsync[plot]` "
            "or `pip install matplotlib`"
        ) from exc
    series: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in result["transfer"]:
        if r["status"] == "ok":
            series.setdefault((r["transport"], r.get("kind", ""), r["impl"], r["model"]), []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    paths = sorted({(t, k) for t, k, _, _ in series})
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(paths)}
    markers = {m: "osD^v"[i % 5] for i, m in enumerate(sorted({m for *_, m in series}))}
    for (transport, kind, impl, model), rows in sorted(series.items()):
        rows.sort(key=lambda r: r["bucket_bytes"])
        x = [r["bucket_bytes"] / MIB for r in rows]
        style = {
            "color": colors[(transport, kind)],
            "marker": markers[model],
            "linestyle": "-" if impl == "fastsync" else "--",
            "label": f"{impl} {transport} {kind} ({model})",
        }
        ax1.plot(x, [r["gbps"] for r in rows], **style)
        peak = [max(r["peak_sender_bytes"] or 0, r["peak_receiver_bytes"] or 0) / MIB for r in rows]
        ax2.plot(x, peak, **style)
    ax1.axhline(result["memcpy_gbps"], color="grey", linestyle=":", label="memcpy (same run)")
    for ax, ylabel in ((ax1, "GB/s"), (ax2, "peak extra MiB (max of sender, receiver)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(
        f"verl-fastsync bench (verl {result.get('verl_version')}): solid = fastsync, dashed = stock verl"
    )
    fig.subplots_adjust(left=0.05, right=0.74, wspace=0.25)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_child(argv: Sequence[str]) -> int:
    """Hidden sub-commands used by the bench's own child processes."""
    cmd, *rest = argv
    _exit_with_parent()
    if cmd == "_cleanup-child":
        heap, repeats, policies, cached = rest
        _cleanup_child(int(heap), int(repeats), policies.split(","), int(cached))
    elif cmd == "_worker":
        _worker_main(rest[0])
    elif cmd == "_probe-verl-nixl":
        _probe_verl_nixl(int(rest[0]))
    else:
        raise SystemExit(f"unknown bench child command {cmd!r}")
    return 0


def iter_rows(result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every row of every section (for summaries)."""
    for section in ("cleanup", "transfer", "scale"):
        yield from result.get(section, [])


if __name__ == "__main__":
    sys.exit(main_child(sys.argv[1:]))
