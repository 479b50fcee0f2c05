# Shared by the recipes in this folder: the training run itself (GRPO on GSM8K; what you would write
# without fastsync) and how a recipe is launched. Source it; do not run it.
#
# VERL_MAIN is the command that gets the overrides: verl's trainer by default. The tests set it to
# `verl-fastsync doctor` to check every recipe without GPUs. Extra arguments of a recipe are appended
# as Hydra overrides (the last one wins).
MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-$HOME/data/gsm8k}
read -r -a VERL_MAIN <<<"${VERL_MAIN:-python3 -m verl.trainer.main_ppo}"
RUN=(
    algorithm.adv_estimator=grpo
    "data.train_files=$DATA/train.parquet"
    "data.val_files=$DATA/test.parquet"
    data.train_batch_size=256
    data.max_prompt_length=1024
    data.max_response_length=2048
    "actor_rollout_ref.model.path=$MODEL"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    trainer.logger=[console]
    trainer.project_name=fastsync_recipes
)
