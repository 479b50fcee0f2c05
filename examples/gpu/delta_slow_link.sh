#!/usr/bin/env bash
# Recipe (c): trainer and rollout in different places joined by a slow link (another datacenter, a
# 1-10 Gbit/s path): gloo over TCP, and delta sync, so each sync after the first sends only the
# values that changed. See docs/delta.md: it pays where the link is the limit, not on one host.
# Host memory: every rollout GPU's receiver keeps the model's bytes (8 GPUs, a 16 GB checkpoint: about
# 144 GiB per rollout host); give actor_rollout_ref.model.path as a local directory and
# `verl-fastsync doctor` checks that against this host's memory.
# Usage: MODEL=... DATA=... bash examples/gpu/delta_slow_link.sh [override ...]
set -euo pipefail
. "$(dirname "$0")/_run.sh"
LAYOUT=(
    trainer.v1.trainer_mode=separate_async
    actor_rollout_ref.hybrid_engine=false
    trainer.nnodes=1
    trainer.n_gpus_per_node=8
    actor_rollout_ref.rollout.nnodes=1
    actor_rollout_ref.rollout.n_gpus_per_node=8
)
FASTSYNC=(
    actor_rollout_ref.rollout.checkpoint_engine.backend=fastsync
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.transport=gloo
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.bucket_bytes=auto
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.delta=true
    # a slow link: a whole sync may take minutes; timeout_s bounds only a wait on a silent peer
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.timeout_s=1800
)
exec "${VERL_MAIN[@]}" "${RUN[@]}" "${LAYOUT[@]}" "${FASTSYNC[@]}" "$@"
