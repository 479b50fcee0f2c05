#!/usr/bin/env bash
# Recipe (a): trainer and vLLM colocated on one 8-GPU host (verl's default layout), with fastsync's
# cleanup policy at both boundaries of the sync and its colocated CUDA-IPC transport.
# See docs/colocated.md. Usage: MODEL=... DATA=... bash examples/gpu/colocated_vllm_8gpu.sh [override ...]
set -euo pipefail
. "$(dirname "$0")/_run.sh"
LAYOUT=(
    trainer.nnodes=1
    trainer.n_gpus_per_node=8
    # CUDA IPC moves the weights in buckets of this size; the transport keeps two of them on each
    # trainer GPU for the whole run (2 x 512 MiB)
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512
)
FASTSYNC=(
    +actor_rollout_ref.rollout.custom.fastsync.enable=true
    # light (the default): empty_cache() only, no gc.collect() on the sync's critical path;
    # adaptive: also collect garbage when the GPU has less than adaptive_headroom_gib free
    +actor_rollout_ref.rollout.custom.fastsync.pre_resume_cleanup=light
    +actor_rollout_ref.rollout.custom.fastsync.post_transfer_cleanup=light
    +actor_rollout_ref.rollout.custom.fastsync.colocated_transport=ipc
    # vLLM's worker processes never see the config: the same switch in every process's environment
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_FASTSYNC_COLOCATED=ipc
)
exec "${VERL_MAIN[@]}" "${RUN[@]}" "${LAYOUT[@]}" "${FASTSYNC[@]}" "$@"
