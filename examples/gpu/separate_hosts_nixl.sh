#!/usr/bin/env bash
# Recipe (b): trainer and rollout on separate hosts (2 trainer hosts, 2 rollout hosts, 8 GPUs each),
# weights over NIXL (RDMA where the NICs have it), every trainer rank sending a share (senders=all).
# See docs/engine.md and docs/senders.md. Start the Ray cluster over all four hosts first.
# Usage: MODEL=... DATA=... bash examples/gpu/separate_hosts_nixl.sh [override ...]
set -euo pipefail
. "$(dirname "$0")/_run.sh"
LAYOUT=(
    # verl's v1 trainer, disaggregated: the rollout has GPUs of its own and weights move through a
    # checkpoint engine
    trainer.v1.trainer_mode=separate_async
    actor_rollout_ref.hybrid_engine=false
    trainer.nnodes=2
    trainer.n_gpus_per_node=8
    actor_rollout_ref.rollout.nnodes=2
    actor_rollout_ref.rollout.n_gpus_per_node=8
)
FASTSYNC=(
    actor_rollout_ref.rollout.checkpoint_engine.backend=fastsync
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.transport=nixl
    # every trainer rank sends a byte-balanced share on its own lane (16 here); senders=2 sends one
    # share per trainer host instead (the first ranks, spread over hosts)
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.senders=all
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.bucket_bytes=auto
)
exec "${VERL_MAIN[@]}" "${RUN[@]}" "${LAYOUT[@]}" "${FASTSYNC[@]}" "$@"
