"""Helpers for tests/test_colocated.py: model specs, digests, verl's module loaded by file path, and
the child-process entry point (spawned, so everything here is importable at module level)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

SHM_PREFIX = "verl_fastsync_"


# ------------------------------------------------------------------ model specs


def make_weights(kind: str, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Deterministic named tensors. ``kind``: ``small``, ``oversize``, ``experts``, ``mixed``."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    small = [
        ("model.embed_tokens.weight", rnd(64, 48, dtype=torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", rnd(48, 48)),
        ("model.layers.0.self_attn.q_proj.bias", rnd(48, dtype=torch.float16)),
        ("model.layers.0.input_layernorm.weight", rnd(48, dtype=torch.bfloat16)),
        ("model.layers.0.scale", rnd(dtype=torch.float32)),  # 0-dim
        ("model.layers.0.position_ids", torch.arange(37, dtype=torch.int64)),
        ("model.layers.0.empty", torch.empty(0, 4)),
        ("model.layers.0.mask", torch.arange(13) % 2 == 0),
    ]
    oversize = [
        ("lm_head.weight", rnd(1000, 700, dtype=torch.bfloat16)),  # 1.4 MB
        ("model.norm.weight", rnd(700)),
        ("model.layers.1.mlp.down_proj.weight", rnd(600, 500)),  # 1.2 MB
    ]
    experts = [
        ("model.layers.0.mlp.experts.w13_weight", rnd(16, 64, 512, dtype=torch.bfloat16)),  # 1 MiB
        ("model.layers.0.mlp.experts.w2_weight", rnd(12, 256, 96)),  # 1.1 MiB, 96 KiB/expert
        ("model.layers.0.mlp.gate.weight", rnd(16, 48)),
    ]
    plain = [  # float32 only: what verl's own shm path carries in every release (0.7.1-0.9.0 do not
        # align offsets to the dtype, so mixed dtypes break their receiver's view)
        ("model.embed_tokens.weight", rnd(64, 48)),
        ("model.layers.0.self_attn.q_proj.weight", rnd(48, 48)),
        ("model.layers.0.input_layernorm.weight", rnd(48)),
    ]
    if kind == "plain":
        return plain
    if kind == "small":
        return small
    if kind == "oversize":
        return oversize
    if kind == "experts":
        return experts
    if kind == "mixed":
        return small + oversize + experts
    raise ValueError(f"unknown weight kind {kind!r}")


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def describe(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], str, str]]:
    return [(n, tuple(t.shape), str(t.dtype), digest(t)) for n, t in weights]


# ------------------------------------------------------------------ verl's module by file path


class CpuDevice(types.SimpleNamespace):
    """What verl's shm path needs from ``get_torch_device()`` on a CPU-only host."""

    def synchronize(self) -> None:
        return None

    def ipc_collect(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def verl_bwt_path() -> str:
    import verl

    return os.path.join(
        os.path.dirname(verl.__file__), "workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py"
    )


def load_verl_bwt(name: str = "verl_bwt_under_test") -> types.ModuleType:
    """verl's ``bucketed_weight_transfer`` loaded by file path (its package ``__init__`` imports
    vllm), with the device lookups replaced for a CPU-only host."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, verl_bwt_path())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cpu = CpuDevice()
    module.get_torch_device = lambda: cpu  # type: ignore[attr-defined]
    if hasattr(module, "is_support_ipc"):
        module.is_support_ipc = lambda: False  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def callback_takes_is_last() -> bool:
    """verl 0.9.x passes ``(weights, is_last)``; 0.7.1/0.8.0 ``(weights)``."""
    import verl

    major, minor = (int(p) for p in verl.__version__.split(".")[:2])
    return (major, minor) >= (0, 9)


# ------------------------------------------------------------------ resources


def shm_segments() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX))
    except FileNotFoundError:
        return []


def resources(owner_pid: int) -> dict[str, int]:
    """This process's open files, fds, RSS, and the shm segments (and their mappings here) owned by
    ``owner_pid`` (other processes on the host may run syncs of their own)."""
    import psutil

    proc = psutil.Process()
    prefix = f"{SHM_PREFIX}{owner_pid}_"
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if f"/{prefix}" in line)
    return {
        "fds": proc.num_fds(),
        "files": len(proc.open_files()),
        "rss": proc.memory_info().rss,
        "shm": sum(1 for s in shm_segments() if s.startswith(prefix)),
        "maps": mapped,
    }


# ------------------------------------------------------------------ child process


def _recorder(
    want_digest: bool, is_last_cb: bool
) -> tuple[list[tuple[str, tuple[int, ...], str, str]], list[bool], Callable[..., None]]:
    """A callback in verl's convention (``(weights)`` or ``(weights, is_last)``) that records what
    it received (digests only when ``want_digest``)."""
    received: list[tuple[str, tuple[int, ...], str, str]] = []
    flags: list[bool] = []

    def record(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            received.append(
                (name, tuple(tensor.shape), str(tensor.dtype), digest(tensor) if want_digest else "")
            )

    def with_is_last(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        record(weights)
        flags.append(is_last)

    def without_is_last(weights: list[tuple[str, torch.Tensor]]) -> None:
        record(weights)

    return received, flags, with_is_last if is_last_cb else without_is_last


def receiver_main(
    conn: Any,
    zmq_handle: str,
    n_syncs: int,
    use_verl_module: bool,
    is_last_cb: bool,
    digest_every: int,
    digest_first: int,
    owner_pid: int,
) -> None:
    """Receive ``n_syncs`` syncs; report per-sync digests (every ``digest_every``) and resources."""
    try:
        if use_verl_module:
            from verl_fastsync.colocated import install_colocated

            module = load_verl_bwt()
            install_colocated(module)
            receiver_cls: Callable[..., Any] = module.BucketedWeightReceiver
        else:
            from verl_fastsync.colocated import ColocatedReceiver

            receiver_cls = ColocatedReceiver
        for i in range(n_syncs):
            want = i < digest_first or i % digest_every == 0 or i == n_syncs - 1
            received, flags, callback = _recorder(want, is_last_cb)
            receiver = receiver_cls(zmq_handle=zmq_handle, device=torch.device("cpu"), use_shm=True)
            receiver.receive_weights(callback)
            conn.send(("sync", i, received, flags, type(receiver).__name__, resources(owner_pid)))
        conn.send(("done", resources(owner_pid)))
    except BaseException as exc:  # report, never hang the parent
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


# ------------------------------------------------------------------ adversarial producers


class LazyModel:
    """Tensors made on demand (each one's bytes in a fresh numpy buffer), with a count of how many
    produced buffers are still alive anywhere: the sender's retention made visible.

    ``sizes``: element counts (float32). Tensor ``i`` holds ``i + 1`` everywhere. ``live_before``
    records, each time the producer is asked for tensor ``i > 0``, how many earlier buffers are alive;
    ``peak_live_bytes`` is the most produced bytes alive at once.
    """

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.live = 0
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.live_before: list[int] = []

    def _freed(self, nbytes: int) -> None:
        self.live -= 1
        self.live_bytes -= nbytes

    def make(self, i: int) -> torch.Tensor:
        import weakref

        import numpy as np

        buf = np.full(self.sizes[i], float(i + 1), dtype=np.float32)
        self.live += 1
        self.live_bytes += buf.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(buf, self._freed, buf.nbytes)
        return torch.from_numpy(buf)

    def __iter__(self) -> Any:
        for i in range(len(self.sizes)):
            if i:
                self.live_before.append(self.live)
            yield f"layer.{i}.weight", self.make(i)

    def expected(self) -> list[tuple[str, tuple[int, ...], str, str]]:
        return [
            (f"layer.{i}.weight", (n,), "torch.float32", digest(torch.full((n,), float(i + 1))))
            for i, n in enumerate(self.sizes)
        ]


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_sender_main(conn: Any, zmq_handle: str, sizes: list[int], bucket_mb: float, syncs: int) -> None:
    """Send a lazily produced model ``syncs`` times; report, per sync, (RSS baseline taken before the
    producer starts, peak RSS during the sync, live earlier tensors at each producer request). The
    first sync is cold (it allocates the slots); imports a first sync would do are done before."""
    try:
        import asyncio

        import zmq  # noqa: F401  (imported by the first sync otherwise: not the sender's memory)

        from verl_fastsync.colocated import ColocatedSender
        from verl_fastsync.plugins import plugin_manager

        plugin_manager()
        figures = []
        for _ in range(syncs):
            sender = ColocatedSender(zmq_handle, bucket_size_mb=bucket_mb, use_shm=True, timeout_s=120)
            model = LazyModel(sizes)
            baseline = vm_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the peak (VmHWM) to the current RSS
            asyncio.run(sender.async_send_weights(iter(model)))
            figures.append((baseline << 10, vm_kib("VmHWM") << 10, model.live_before))
        conn.send(("ok", figures))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


def one_sync_receiver_main(conn: Any, zmq_handle: str) -> None:
    """A receiver process that takes one sync and exits (a restarted vLLM worker's first sync)."""
    try:
        from verl_fastsync.colocated import ColocatedReceiver

        received: list[Any] = []
        receiver = ColocatedReceiver(zmq_handle, torch.device("cpu"), timeout_s=120)
        receiver.receive_weights(lambda weights, is_last: received.extend(describe(weights)))
        conn.send(("ok", received))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
    finally:
        conn.close()
