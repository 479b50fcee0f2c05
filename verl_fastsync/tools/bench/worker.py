"""A transfer worker process (sender or receiver) and fastsync's own paths.

The parent (:mod:`.transfer`) drives a pair of workers through one trial at a time with these
commands (JSON lines, see :mod:`.protocol`):

``prepare``   build the trial's path (once per trial: an engine lives across syncs, as in verl) and
              run its per-sync setup; answers the path's metadata for the peer
``init``      connect with the peers' metadata (verl's ``build_topology`` + ``init_process_group``)
``run``       one timed sync, then the path's per-sync teardown (``finalize``)
``idle``      sit idle for N seconds with the trial's path alive; answers the CPU seconds spent
``exit``      end the process
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import threading
import time
from typing import Any, ClassVar

import verl_fastsync.tools.bench.baselines as baselines
from verl_fastsync.tools.bench.measure import (
    CpuDevice,
    DevicePeak,
    RssSampler,
    cpu_seconds,
    malloc_trim,
    status_bytes,
    worker_threads,
)
from verl_fastsync.tools.bench.options import MIB
from verl_fastsync.tools.bench.protocol import emit, pack, unpack


def engine_factory(transport: str) -> Any:
    """The fastsync engine transport class registered under ``transport``."""
    from verl_fastsync import plugins

    return plugins.select_transport(plugins.plugin_manager(), transport, "engine")


def available_transports(kind: str) -> list[str]:
    """Names of the registered fastsync transports of ``kind`` (``engine`` or ``colocated``)."""
    try:
        from verl_fastsync import plugins

        return list(plugins.available_transports(plugins.get_plugin_manager(), kind))
    except Exception:
        return []


class FastsyncEngine(baselines._Path):
    """A fastsync engine transport, created once per trial (the ``fastsync`` checkpoint engine makes
    its transport once) and taken through verl's per-sync lifecycle."""

    zero_copy = False  # the engine's default: received tensors stay valid (lent buckets, or copies)
    extra: ClassVar[dict[str, Any]] = {}
    """The transport's own ``engine_kwargs.fastsync`` options."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        from verl_fastsync.transports.base import TransportOptions

        self.role, self.trial = role, trial
        self.factory = engine_factory(trial["transport"])
        options = TransportOptions(
            is_master=role == "sender",
            timeout_s=trial["timeout_s"],
            device=trial.get("device", "cpu"),
            zero_copy=self.zero_copy,
            extra=dict(self.extra),
        )
        self.transport = self.factory(options)
        self.setup_seconds: float | None = None

    def setup(self) -> dict[str, Any]:
        meta: dict[str, Any] = self.transport.prepare()
        return meta

    def connect(self, metas: list[Any]) -> None:
        actor, rollout = self.factory.build_topology(1, 1, metas)
        kwargs = {k: v[0] for k, v in (actor if self.role == "sender" else rollout).items()}
        kwargs["bucket_size"] = self.trial["bucket_bytes"]
        t0 = time.perf_counter()
        self.transport.init_process_group(**kwargs)
        self.setup_seconds = time.perf_counter() - t0

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        transport = self.transport
        if self.role == "sender":
            stats = asyncio.run(transport.send(iter(tensors)))
        else:
            dest = dict(tensors)

            async def consume() -> None:
                async for name, tensor in transport.receive():
                    dest[name].copy_(tensor)

            asyncio.run(consume())
            stats = transport.last_stats
        return {
            "setup_seconds": self.setup_seconds,
            "transport_peak_bytes": getattr(stats, "peak_extra_bytes", None),
        }

    def end_sync(self) -> None:
        self.transport.finalize()


class FastsyncColocated(baselines._Path):
    """fastsync's colocated sender/receiver (verl makes a new sender per weight update)."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        self.role, self.trial = role, trial
        self.mod = importlib.import_module("verl_fastsync.colocated")

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        import torch

        t = self.trial
        device = torch.device(t.get("device", "cpu"))
        dev_module = CpuDevice() if device.type == "cpu" else None
        if self.role == "sender":
            sender = self.mod.ColocatedSender(
                t["zmq"], bucket_size_mb=t["bucket_bytes"] // MIB, use_shm=t["transport"] == "shm",
                transport=t["transport"], timeout_s=t["timeout_s"], device_module=dev_module,
            )  # fmt: skip
            asyncio.run(sender.async_send_weights(iter(tensors)))
        else:
            dest = dict(tensors)

            def on_bucket(weights: list[tuple[str, Any]], is_last: bool = False) -> None:
                for name, w in weights:
                    dest[name].copy_(w)

            receiver = self.mod.ColocatedReceiver(
                t["zmq"], device, use_shm=t["transport"] == "shm", timeout_s=t["timeout_s"],
                device_module=dev_module, zero_copy=True,  # what verl's switch uses (verl's contract)
            )  # fmt: skip
            receiver.receive_weights(on_bucket)
        return {}


class FastsyncEngineZeroCopy(FastsyncEngine):
    """The same, receiving with ``zero_copy=True`` (the consumer copies each tensor at once)."""

    zero_copy = True


class FastsyncEngineTwoSlots(FastsyncEngine):
    """The same over two slots (``engine_kwargs.fastsync.slots=2``: the shm pipeline of 0.2.0)."""

    extra: ClassVar[dict[str, Any]] = {"slots": 2}


PATHS: dict[str, Any] = {
    "fastsync-engine": FastsyncEngine,
    "fastsync-engine-zero-copy": FastsyncEngineZeroCopy,
    "fastsync-engine-two-slots": FastsyncEngineTwoSlots,
    "fastsync-colocated": FastsyncColocated,
    "verl-colocated": baselines.VerlColocatedStandIn,
    "verl-gloo": baselines.VerlGlooReconstruction,
    "verl-nixl": baselines.VerlNixlEngine,
    "raw-gloo": baselines.RawGloo,
    "raw-memcpy-pair": baselines.RawMemcpyPair,
    "raw-nixl": baselines.RawNixl,
}
"""Trial ``impl`` -> the class that runs it in a worker."""


class Worker:
    """State of one transfer worker: the model (cached), the current trial's path."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._models: dict[tuple[Any, ...], list[tuple[str, Any]]] = {}
        self.path: Any = None
        self.trial_id: str | None = None
        self.baseline_rss: int | None = None

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

    def end_trial(self) -> None:
        if self.path is not None:
            try:
                self.path.close()
            finally:
                self.path = None
        colocated = sys.modules.get("verl_fastsync.colocated")
        release = getattr(colocated, "release_colocated_resources", None)
        if release is not None:
            release()
        self.trial_id = None

    def prepare(self, trial: dict[str, Any]) -> dict[str, Any]:
        """The trial's path (made on its first sync) and its per-sync setup."""
        self.model(trial)
        if trial["id"] != self.trial_id:
            # a new trial: free what the previous one kept between syncs, then take the memory
            # baseline every sync of this trial is measured against (so buffers a path keeps from
            # sync to sync count as its extra memory)
            self.end_trial()
            malloc_trim()
            self.baseline_rss = status_bytes("VmRSS")
            self.path = PATHS[trial["impl"]](self.role, trial)
            self.trial_id = trial["id"]
        return {"meta": pack(self.path.setup())}

    def run(self, trial: dict[str, Any]) -> dict[str, Any]:
        from verl_fastsync.tools.models import fingerprint

        tensors = self.model(trial)
        device_peak = DevicePeak(trial.get("device", "cpu"))
        try:
            start_at = trial.get("start_at")
            if start_at is not None:  # a row that needs both processes to start at once
                time.sleep(max(0.0, start_at - time.perf_counter()))
            with RssSampler(baseline=self.baseline_rss) as rss, device_peak:
                t_start = time.perf_counter()
                extra = self.path.transfer(tensors)
                t_end = time.perf_counter()
        finally:
            self.path.end_sync()
        result: dict[str, Any] = {
            "t_start": t_start,
            "t_end": t_end,
            # host RSS growth for host transfers; the caching allocator's peak for device ones
            "peak_extra_bytes": device_peak.extra if device_peak.active else rss.extra,
            **extra,
        }
        if trial.get("verify"):
            result["fingerprint"] = sum(fingerprint(t) for _, t in tensors)
            if self.role == "receiver":  # reset the destination for the next repeat
                for _, t in tensors:
                    t.zero_()
        return result

    def idle(self, seconds: float) -> dict[str, Any]:
        c0, w0 = cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        return {"cpu_seconds": cpu_seconds() - c0, "wall_seconds": time.monotonic() - w0}


def _handle(worker: Worker, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.get("op")
    try:
        if op == "prepare":
            answer = worker.prepare(cmd["trial"])
        elif op == "init":
            worker.path.connect([unpack(m) for m in cmd["metas"]])
            answer = {}
        elif op == "idle":
            answer = worker.idle(cmd["seconds"])
        elif op == "end":
            worker.end_trial()
            answer = {}
        elif op == "preload":
            for name in cmd["impls"]:
                try:
                    baselines.PRELOAD[name]()
                except Exception:
                    pass  # the trial reports it
            answer = {}
        elif op == "run":
            answer = worker.run(cmd["trial"])
        else:
            raise ValueError(f"unknown worker command {op!r}")
        return {"event": op, "ok": True, **answer}
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}".strip()
        if isinstance(exc, RuntimeError) and str(exc).startswith("not available: "):
            message = str(exc)
        elif isinstance(exc, ImportError):
            message = f"not available: {message}"
        return {"event": op, "ok": False, "error": message}


THREADED = ("init", "run")
"""Commands that may wait for the peer: they run in a thread the parent can ``abandon``."""


def worker_main(role: str) -> None:
    """Serve commands from stdin. ``run`` goes to a thread, so that when the peer failed the parent
    can ``abandon`` a receiver still waiting for bytes and keep using this process (its imports,
    its model) instead of starting a new one."""
    import torch

    torch.set_num_threads(worker_threads())
    worker = Worker(role)
    lock = threading.Lock()
    current: dict[str, Any] = {}

    def answer(obj: dict[str, Any]) -> None:
        with lock:
            emit(obj)

    answer({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "exit":
            break
        if op in THREADED:
            token = object()

            def job(cmd: dict[str, Any] = cmd, token: object = token) -> None:
                result = _handle(worker, cmd)
                with lock:
                    if current.get("token") is token:
                        current.clear()
                        emit(result)

            with lock:
                current["token"] = token
            threading.Thread(target=job, daemon=True, name="bench-transfer").start()
            continue
        if op == "abandon":
            with lock:
                abandoned = bool(current)
                current.clear()
                if abandoned:  # the stuck transfer keeps its objects; the next trial starts afresh
                    worker.path, worker.trial_id = None, None
                emit({"event": "abandon", "ok": True, "abandoned": abandoned})
            continue
        answer(_handle(worker, cmd))
    worker.end_trial()
