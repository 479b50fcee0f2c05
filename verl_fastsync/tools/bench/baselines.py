"""What fastsync is measured against, run inside a bench worker process, each labelled for what it is.

* ``verl-stand-in``: verl's own colocated ``BucketedWeightSender``/``Receiver(use_shm=True)``, with
  a CPU device module standing in for the accelerator it expects.
* ``verl-reconstruction``: verl has no gloo engine; its engines' bucketing (``split_weight_chunks``
  / ``merge_weight_chunks``, verl 0.8.0+) is driven over a plain gloo broadcast.
* ``verl``: verl's own ``NIXLCheckpointEngine`` on CPU DRAM, with two CPU shims (labelled on the
  row): its pinned bucket allocation without ``pin_memory`` (CPU torch has no pinned allocator) and
  ``torch.cuda.synchronize`` as the CPU stream's synchronize.
* ``raw``: the mechanism alone, the limit a transport can reach: a ``torch.distributed`` gloo
  broadcast of the same bytes between the same two processes; a NIXL WRITE of the same bytes
  between two agents in the same two processes; both processes copying the bytes at the same time
  (the floor of any path that packs on one side and loads on the other).

Every class here has the same shape as the fastsync paths in :mod:`.worker`: ``setup()`` per sync
(metadata for the peer), ``connect(metas)``, ``transfer(tensors)``, ``end_sync()``, ``close()``.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import importlib
import importlib.util
import os
import time
import uuid
import warnings
from typing import Any

from verl_fastsync.tools.bench.measure import CpuDevice
from verl_fastsync.tools.bench.options import MIB

NIXL_SHIMS = (
    "CPU shims: bucket buffers allocated without pin_memory, torch.cuda.synchronize -> CPU's; topology "
    "shim: no next agent for the only rollout rank (verl's build_topology gives it the trainer)"
)


def import_verl_module(name: str) -> Any:
    """Import a verl module without cupy's "nccl library could not be loaded" warning, which verl's
    checkpoint engines trigger on every host without NCCL (the user did nothing to cause it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"\s*nccl library could not be loaded", category=UserWarning
        )
        return importlib.import_module(name)


def verl_version() -> str | None:
    """The importable verl's version, read from its ``version/version`` file without importing verl
    (an import takes about 10 s)."""
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(next(iter(spec.submodule_search_locations)), "version", "version")) as f:
            return f.read().strip()
    except OSError:
        try:
            from importlib.metadata import version

            return version("verl")
        except Exception:
            return None


class _Path:
    """Default no-op lifecycle."""

    def setup(self) -> dict[str, Any]:
        return {}

    def connect(self, metas: list[Any]) -> None:
        return None

    def end_sync(self) -> None:
        return None

    def close(self) -> None:
        self.end_sync()


# ---- verl's colocated sender/receiver on a CPU device stand-in --------------------------------


@functools.cache
def load_verl_bucketed_module() -> Any:
    """verl's vLLM-side bucketed sender/receiver module, loaded by file path and pointed at the CPU.

    The ``vllm_rollout`` package ``__init__`` imports vLLM, so the module is loaded from its file;
    its device helpers are replaced by the CPU stand-in (there is no accelerator and no CUDA IPC).
    """
    import verl

    path = os.path.join(
        os.path.dirname(verl.__file__), "workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
    )
    if not os.path.exists(path):
        raise RuntimeError(f"not available: verl {verl_version()} has no {path}")
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
    importlib.import_module("verl.workers.rollout.utils")  # imported on the first send: load it now
    return module


class VerlColocatedStandIn(_Path):
    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        self.role, self.trial = role, trial
        self.mod = load_verl_bucketed_module()

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        import torch

        t = self.trial
        if self.role == "sender":
            sender = self.mod.BucketedWeightSender(
                t["zmq"], bucket_size_mb=t["bucket_bytes"] // MIB, use_shm=True
            )
            asyncio.run(sender.async_send_weights(iter(tensors)))
        else:
            dest = dict(tensors)

            def on_bucket(weights: list[tuple[str, Any]], is_last: bool = False) -> None:
                for name, w in weights:
                    dest[name].copy_(w)

            receiver = self.mod.BucketedWeightReceiver(t["zmq"], torch.device("cpu"), use_shm=True)
            receiver.receive_weights(on_bucket)
        return {}


# ---- gloo: verl's split/merge over a gloo broadcast, and the raw broadcast -------------------


def gloo_world(trial: dict[str, Any], role: str) -> None:
    """A two-rank gloo default group between this worker pair (sender rank 0), made once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{trial['gloo_port']}",
            rank=0 if role == "sender" else 1,
            world_size=2,
            timeout=datetime.timedelta(seconds=trial["timeout_s"]),
        )


@functools.cache
def _verl_chunk_functions() -> tuple[Any, Any, Any]:
    try:
        mod = import_verl_module("verl.checkpoint_engine.base")
        return mod.split_weight_chunks, mod.merge_weight_chunks, mod.TensorMeta
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"not available: verl {verl_version()} has no split_weight_chunks/merge_weight_chunks "
            f"(added in 0.8.0): {exc}"
        ) from exc


def _broadcast_meta(metas: list[Any] | None) -> list[Any]:
    """Bucket metadata from rank 0 to rank 1 over gloo (msgspec-encoded, no pickle)."""
    import msgspec
    import torch
    import torch.distributed as dist

    if metas is not None:
        payload = msgspec.msgpack.encode(metas)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)
        return metas
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0)
    buf = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    decoded: list[Any] = msgspec.msgpack.decode(buf.numpy().tobytes())
    return decoded


class VerlGlooReconstruction(_Path):
    """verl's engine-side bucketing (``split_weight_chunks`` into a bucket, as its NCCL engine does),
    each full bucket broadcast over gloo with its metadata; ``merge_weight_chunks`` on the receiver."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        self.role, self.trial = role, trial
        self.split, self.merge, self.tensor_meta = _verl_chunk_functions()

    def connect(self, metas: list[Any]) -> None:
        gloo_world(self.trial, self.role)

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        coro = self._send(tensors) if self.role == "sender" else self._receive(dict(tensors))
        asyncio.run(coro)
        return {}

    async def _send(self, tensors: list[tuple[str, Any]]) -> None:
        import torch
        import torch.distributed as dist

        bucket_bytes = self.trial["bucket_bytes"]
        buf = torch.empty(bucket_bytes, dtype=torch.uint8)
        metas: list[Any] = []
        offset = 0

        def flush(is_last: bool) -> None:
            _broadcast_meta([is_last, offset, metas])
            if offset:
                dist.broadcast(buf[:offset], src=0)

        async for meta, chunk in self.split(iter(tensors), bucket_bytes):
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

    async def _receive(self, dest: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        bucket_bytes = self.trial["bucket_bytes"]
        buf = torch.empty(bucket_bytes, dtype=torch.uint8)
        tensor_meta = self.tensor_meta

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

        async for name, tensor in self.merge(chunks(), bucket_bytes):
            dest[name].copy_(tensor)


def _pieces(total: int, bucket: int) -> list[int]:
    return [min(bucket, total - off) for off in range(0, total, bucket)]


class RawGloo(_Path):
    """A plain ``torch.distributed.broadcast`` of the model's bytes, one bucket-sized piece at a time."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        import torch

        self.role, self.trial = role, trial
        self.buf = torch.ones(trial["bucket_bytes"], dtype=torch.uint8)

    def connect(self, metas: list[Any]) -> None:
        gloo_world(self.trial, self.role)

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        import torch.distributed as dist

        total = sum(t.numel() * t.element_size() for _, t in tensors)
        for n in _pieces(total, self.trial["bucket_bytes"]):
            dist.broadcast(self.buf[:n], src=0)
        return {}


class RawMemcpyPair(_Path):
    """Both processes copy the model's bytes at the same time, bucket-sized pieces through one warm
    buffer: the sender from its weights into the buffer, the receiver from the buffer into its
    weights. Two passes over every byte, one in each process: what a path that packs on the sender
    and loads on the receiver costs with no transport in between."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        import torch

        self.role, self.trial = role, trial
        self.buf = torch.ones(trial["bucket_bytes"], dtype=torch.uint8)

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        import torch

        step = self.buf.numel()
        for _, tensor in tensors:
            flat = tensor.reshape(-1).view(torch.uint8)
            for off in range(0, flat.numel(), step):
                piece = flat[off : off + step]
                if self.role == "sender":
                    self.buf[: piece.numel()].copy_(piece)
                else:
                    piece.copy_(self.buf[: piece.numel()])
        return {}


# ---- NIXL: verl's own engine with CPU shims, and a raw WRITE --------------------------------


class _TorchCpuShim:
    """``torch`` for verl's NIXL engine module on a CPU host (see :data:`NIXL_SHIMS`)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.cuda = type("cuda", (), {"synchronize": staticmethod(torch.cpu.synchronize)})()

    def zeros(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return self._torch.zeros(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


@functools.cache
def load_verl_nixl_module() -> Any:
    import torch

    mod = import_verl_module("verl.checkpoint_engine.nixl_checkpoint_engine")
    if not torch.cuda.is_available():
        mod.torch = _TorchCpuShim()
    return mod


class VerlNixlEngine(_Path):
    """verl's ``NIXLCheckpointEngine(device="cpu")``, created once (as verl's worker does) and taken
    through verl's per-sync lifecycle: prepare, build_topology, init_process_group, send/receive,
    finalize."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        self.role, self.trial = role, trial
        self.mod = load_verl_nixl_module()
        self.engine = self.mod.NIXLCheckpointEngine(
            bucket_size=trial["bucket_bytes"], device="cpu", is_master=role == "sender"
        )
        self.prepared = False

    def setup(self) -> dict[str, Any]:
        meta = self.engine.prepare()
        self.prepared = True
        return {
            "agent_name": meta.agent_name,
            "agent_metadata": meta.agent_metadata,
            "zmq_ip": meta.zmq_ip,
            "zmq_port": meta.zmq_port,
        }

    def connect(self, metas: list[Any]) -> None:
        full = [self.mod.NixlAgentMetadata(**m) for m in metas]
        actor, rollout = self.mod.NIXLCheckpointEngine.build_topology(1, 1, full)
        kwargs = {k: v[0] for k, v in (actor if self.role == "sender" else rollout).items() if k != "method"}
        if self.role == "receiver":
            # topology shim: for one rollout rank verl's build_topology slices metadata[-1 + 1:], the
            # whole list, and gives the last rank the trainer as its next agent (its own
            # init_process_group then refuses it); the last rank has no next agent
            kwargs["next_agent_metadata"] = None
        self.engine.init_process_group(**kwargs)

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        engine = self.engine
        if self.role == "sender":
            asyncio.run(engine.send_weights(iter(tensors)))
        else:
            dest = dict(tensors)

            async def consume() -> None:
                async for name, weight in engine.receive_weights():
                    dest[name].copy_(weight)

            asyncio.run(consume())
        return {}

    def end_sync(self) -> None:
        if self.prepared:
            self.prepared = False
            self.engine.finalize()


class RawNixl(_Path):
    """Two NIXL agents (UCX, DRAM) in the same two processes; the sender WRITEs the model's bytes,
    one bucket-sized piece at a time, into the receiver's registered buffer; the last WRITE carries
    a notification the receiver waits for."""

    def __init__(self, role: str, trial: dict[str, Any]) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        self.role, self.trial = role, trial
        self.name = f"bench-raw-{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self.buf = torch.ones(trial["bucket_bytes"], dtype=torch.uint8)
        self.reg = self.agent.register_memory(self.buf)
        self.peer: str | None = None
        self.peer_addr = 0
        self.tag = 0

    def setup(self) -> dict[str, Any]:
        return {"name": self.name, "md": self.agent.get_agent_metadata(), "addr": int(self.buf.data_ptr())}

    def connect(self, metas: list[Any]) -> None:
        if self.role == "sender" and self.peer is None:
            peer = self.agent.add_remote_agent(metas[1]["md"])
            self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            self.peer_addr = metas[1]["addr"]
        elif self.role == "receiver" and self.peer is None:
            peer = self.agent.add_remote_agent(metas[0]["md"])  # both ways, as the transports connect
            self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)

    def transfer(self, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        self.tag += 1
        notif = f"done-{self.tag}".encode()
        deadline = time.monotonic() + self.trial["timeout_s"]
        if self.role == "receiver":
            while True:
                got = self.agent.get_new_notifs()
                if any(notif in msgs for msgs in got.values()):
                    return {}
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw nixl: no WRITE notification from {self.peer}")
                time.sleep(0.0002)
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        pieces = _pieces(total, self.trial["bucket_bytes"])
        for i, n in enumerate(pieces):
            local = self.agent.get_xfer_descs([(int(self.buf.data_ptr()), n, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(self.peer_addr, n, 0)], "DRAM")
            last = i == len(pieces) - 1
            handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer, notif if last else b"")
            try:
                state = self.agent.transfer(handle)
                while state not in ("DONE", "ERR"):
                    if time.monotonic() > deadline:
                        raise TimeoutError("raw nixl: WRITE did not complete")
                    time.sleep(0.0002)
                    state = self.agent.check_xfer_state(handle)
                if state == "ERR":
                    raise RuntimeError("raw nixl: WRITE failed")
            finally:
                self.agent.release_xfer_handle(handle)
        return {}

    def close(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None


PRELOAD: dict[str, Any] = {
    "verl-colocated": load_verl_bucketed_module,
    "verl-gloo": _verl_chunk_functions,
    "verl-nixl": load_verl_nixl_module,
    "raw-nixl": lambda: importlib.import_module("nixl._api"),
    "fastsync-colocated": lambda: importlib.import_module("verl_fastsync.colocated"),
}
"""What a worker can import before any measurement (verl's modules take 10-20 s to import)."""
