"""verl's trainer-side objects for the e2e driver: the real ``ServerAdapter`` (vLLM rollout client)
and the real ``CheckpointEngineWorker.update_weights`` body, with the two shims this host needs.

Shims (test-side, named in the report):

* :class:`InProcessServerHandle` stands in for verl's ``vLLMHttpServer`` Ray actor: the adapter calls
  ``server_handle.collective_rpc.remote(...)``, ``clear_kv_cache.remote()`` and
  ``set_global_steps.remote(...)``; here they run against an in-process ``vllm.LLM`` whose engine core
  (the vLLM worker) is a separate process. The weights never pass through this hop (they go trainer
  process -> vLLM worker over zmq + shared memory, as in verl), only the RPC that starts the receiver.
  Why: a Ray cluster plus verl's HTTP server actor add ~15 s start and ~1 GiB on this 2-core machine
  and carry no weight bytes.
* ``ray.get_runtime_context().get_job_id()`` is answered with the run's job id while the adapter is
  constructed (it would start a local Ray cluster only to name the zmq socket); the vLLM worker gets
  the same id through ``VERL_RAY_JOB_ID``, as verl's server does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

# Not the loop's default executor: ``asyncio.run`` joins that one, and a vLLM worker stuck in verl's
# receiver (verl's failure paths never time out) would then hang the trainer too.
_RPC_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="e2e-rpc")


class _Remote:
    """``obj.method.remote(...)`` -> an asyncio future that starts at once (like a Ray ObjectRef)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(_RPC_THREADS, lambda: self._fn(*args, **kwargs))


class InProcessServerHandle:
    """The three ``vLLMHttpServer`` methods verl's ``ServerAdapter.update_weights`` calls."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.global_steps: int | None = None
        self.collective_rpc = _Remote(self._collective_rpc)
        self.clear_kv_cache = _Remote(self._clear_kv_cache)
        self.set_global_steps = _Remote(self._set_global_steps)

    def _collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return self.llm.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs or {})

    def _clear_kv_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _set_global_steps(self, steps: int) -> None:
        self.global_steps = steps


def make_server_adapter(llm_handle: InProcessServerHandle, bucket_mb: int, job_id: str) -> Any:
    """verl 0.9.1's real ``ServerAdapter`` for rollout rank 0 of replica 0, bucket ``bucket_mb``."""
    import ray
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout import (
        ServerAdapter,
    )

    config = RolloutConfig(
        name="vllm",
        tensor_model_parallel_size=1,
        free_cache_engine=False,
        checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=bucket_mb),
    )
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("RAY_LOCAL_WORLD_SIZE", "1")
    context = mock.Mock()
    context.get_job_id.return_value = job_id
    with mock.patch.object(ray, "get_runtime_context", return_value=context):
        # model_config/device_mesh: unused by update_weights (verl's CheckpointEngineWorker also passes
        # device_mesh=None)
        none: Any = None
        adapter: Any = ServerAdapter(config=config, model_config=none, device_mesh=none, replica_rank=0)
    adapter.server_handle = llm_handle
    return adapter


async def checkpoint_worker_update(engine: Any, adapter: Any, global_steps: int | None = None) -> None:
    """Run verl's own ``CheckpointEngineWorker.update_weights`` body (receive from the checkpoint
    engine, feed the server adapter) on ``engine``/``adapter``. The Ray ``Worker`` base (worker group,
    process group) is not constructed: the method only reads these two attributes."""
    from types import SimpleNamespace

    from verl.checkpoint_engine.base import CheckpointEngineWorker

    fake_self = SimpleNamespace(checkpoint_engine=engine, server_adapter=adapter)
    await CheckpointEngineWorker.update_weights(fake_self, global_steps=global_steps)
