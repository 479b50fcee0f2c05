"""The vLLM worker extension the e2e engine is started with (runs inside vLLM's worker process).

It *is* verl 0.9.1's ``vLLMColocateWorkerExtension`` (``update_weights_from_ipc`` and everything it
calls are verl's, unchanged); this subclass only adds what a test needs to look inside the worker:
switch the per-process colocated setting, select verl's platform, read every parameter back, and load a
reference copy of a checkpoint with vLLM's own file loader. At construction it applies the vLLM-CPU
weight-keeping shim (:func:`verl_fastsync.tools.e2e.cpu_platform.keep_cpu_linear_weights`).
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.utils import (
    vLLMColocateWorkerExtension,
)

from verl_fastsync.tools.e2e.cpu_shims import (
    keep_cpu_linear_weights,
    refresh_cpu_moe_prepack_on_reload,
    set_verl_platform,
)


def tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


class E2EWorkerExtension(vLLMColocateWorkerExtension):
    """verl's worker extension plus read-back helpers (see the module docstring)."""

    def __new__(cls, **kwargs: Any) -> Any:
        keep_cpu_linear_weights()
        refresh_cpu_moe_prepack_on_reload()
        return super().__new__(cls, **kwargs)

    def _runner(self) -> Any:
        """vLLM's model runner (an attribute of the worker class this extension is mixed into)."""
        return getattr(self, "model_runner")  # noqa: B009

    def e2e_env(self, updates: dict[str, str | None]) -> int:
        """Set (value) or unset (None) environment variables in this worker; returns its pid."""
        for key, value in updates.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        return os.getpid()

    def e2e_platform(self, cpu: bool) -> str:
        return set_verl_platform(cpu)

    def e2e_digests(self) -> dict[str, str]:
        """blake2b of the bytes of every parameter of the served model, by vLLM parameter name."""
        model = self._runner().model
        return {name: tensor_digest(p) for name, p in model.named_parameters()}

    def e2e_load_checkpoint(self, model_dir: str) -> int:
        """Load ``model_dir``'s safetensors with vLLM's own file iterator into the served model (the
        reference a transport's result is compared with); returns the number of tensors read."""
        from vllm.model_executor.model_loader.utils import (
            process_weights_after_loading,
        )
        from vllm.model_executor.model_loader.weight_utils import (
            safetensors_weights_iterator,
        )

        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        count = 0

        def counted() -> Any:
            nonlocal count
            for item in safetensors_weights_iterator(files, False):
                count += 1
                yield item

        runner = self._runner()
        runner.model.load_weights(counted())
        process_weights_after_loading(runner.model, runner.vllm_config.model_config, self.device)
        return count
