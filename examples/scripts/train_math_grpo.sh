#!/usr/bin/env bash
# GRPO vs GRPO + SALT: math RLVR on DeepSeek-R1-Distill-Qwen-1.5B / -7B (SALT, arXiv 2606.05800).
#
# Reproduces  the SALT paper's math RLVR setting, GRPO arm: group_norm advantages, per-sequence loss averaging,
#             k3 KL loss, boxed-answer math-verify reward (1 correct / 0 otherwise); SALT=1 adds SALT's
#             reweighting of the group-normalized advantages and changes nothing else.
# Recipe      NOT verified against SALT Table 4 (the paper's table was not available when this script was
#             written). The values below are DeepScaleR's published GRPO recipe for DeepSeek-R1-Distill-Qwen-1.5B
#             (lr 1e-6, 128 prompts x 8 samples, 2 optimizer steps per rollout step, KL loss 1e-3, temperature 0.6,
#             8k-token responses); SALT uses the fork's defaults (full variant, 4096-dim sketch, whole batch).
#             Check them against Table 4 before quoting results as the paper's.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated.
# Wall time   rough estimate from token counts, not measured: ~2-3 min per rollout step on one node for 1.5B
#             (~175 steps, 6-9 h); about 4x that for 7B (1-1.5 days). SALT's overhead (sketch in the experience
#             forward, Gram on the trainer's CPU) has not been measured end to end.
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        MATH train (DigitalLearningGmbH/MATH-lighteval) or DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k),
#             AIME 2024 for in-training eval; written to DATA_DIR by prepare_math_data.py on first use.
#
# Usage       bash examples/scripts/train_math_grpo.sh                          # GRPO, 1.5B, MATH
#             SALT=1 MODEL_SIZE=7B DATASET=dapo_math_17k SEED=1 bash examples/scripts/train_math_grpo.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster (`ray start --head` on the head node, `ray start
#             --address=HEAD:6379` on the others) with `pip install "openrlhf-geo[openrlhf]"` on every node;
#             DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb logging
#             (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
SALT=${SALT:-0}                    # 1: --algo.advantage.estimator salt (group_norm reweighted by SALT)
MODEL_SIZE=${MODEL_SIZE:-1.5B}     # 1.5B | 7B
DATASET=${DATASET:-math_train}     # math_train | dapo_math_17k
SEED=${SEED:-42}

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# GRPO recipe (NOT verified against SALT Table 4; see the header)
PROMPTS_PER_STEP=128
SAMPLES_PER_PROMPT=8
TRAIN_BATCH=512 # rollouts per optimizer step: 2 optimizer steps per rollout step
LR=1e-6
KL_COEF=1e-3 # k3 estimator, as a loss term
EPS_CLIP=0.2
TEMPERATURE=0.6
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=8192
NUM_EPISODES=3
EVAL_STEPS=10

case "$MODEL_SIZE" in
  1.5B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B ZERO_STAGE=2 ;;
  7B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B ZERO_STAGE=3 ;;
  *) echo "MODEL_SIZE must be 1.5B or 7B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac
case "$DATASET" in
  math_train | dapo_math_17k) ;;
  *) echo "DATASET must be math_train or dapo_math_17k (got '$DATASET')" >&2 && exit 2 ;;
esac
case "$SALT" in
  0) METHOD=grpo ESTIMATOR_ARGS=(--algo.advantage.estimator group_norm) ;;
  1) METHOD=grpo-salt ESTIMATOR_ARGS=(
       --algo.advantage.estimator salt --salt.base group_norm
       --salt.variant full --salt.features sketch --salt.dim 4096
     ) ;;
  *) echo "SALT must be 0 or 1 (got '$SALT')" >&2 && exit 2 ;;
esac

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24
fi

RUN_NAME="r1-distill-qwen-${MODEL_SIZE}_${DATASET}_${METHOD}_seed${SEED}"
SAVE_PATH="$SAVE_ROOT/$RUN_NAME"
VLLM_TP=1
WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.group "${RUN_NAME%_seed*}" --logger.wandb.run_name "$RUN_NAME")
fi
# Job level: working_dir + env_vars only. The fork's ray.init adds py_modules and upstream's env vars;
# Ray rejects a field or env var set at both levels.
RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_MATH_MODE": "grpo"}}' "$REPO_DIR")

ENGINE_ARGS=(
  --actor.num_nodes "$NUM_NODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
  --ref.num_nodes "$NUM_NODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
  --vllm.num_engines $((NUM_NODES * GPUS_PER_NODE / VLLM_TP)) --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization 0.6 --vllm.sync_backend nccl --vllm.enforce_eager
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
  --ds.zero_stage "$ZERO_STAGE" --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --ds.packing_samples --train.dynamic_batch_enable
  --train.max_tokens_per_gpu 16384 --rollout.max_tokens_per_gpu 32768
)
DATA_ARGS=(
  --actor.model_name_or_path "$MODEL"
  --data.prompt_dataset "$DATA_DIR/$DATASET.jsonl" --data.input_key prompt --data.label_key answer
  --data.apply_chat_template
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
  --eval.dataset "$DATA_DIR/aime24.jsonl" --eval.steps "$EVAL_STEPS"
  --eval.temperature 0.6 --eval.n_samples_per_prompt 4
)
ALGO_ARGS=(
  --rollout.batch_size "$PROMPTS_PER_STEP" --rollout.n_samples_per_prompt "$SAMPLES_PER_PROMPT"
  --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 8 --train.micro_batch_size 1
  --train.num_episodes "$NUM_EPISODES" --train.max_epochs 1 --train.seed "$SEED"
  --rollout.temperature "$TEMPERATURE"
  --actor.adam.lr "$LR" --actor.lr_scheduler constant_with_warmup --actor.lr_warmup_ratio 0.03
  --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean
  --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
  "${ESTIMATOR_ARGS[@]}"
)
LOG_ARGS=(
  --ckpt.output_dir "$SAVE_PATH/final" --ckpt.path "$SAVE_PATH/ckpt" --ckpt.save_hf
  --ckpt.save_steps 20 --ckpt.max_num 3 --ckpt.load_enable
  --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE_PATH/tensorboard" "${WANDB_ARGS[@]}"
)

echo "submitting $RUN_NAME to $RAY_ADDRESS (outputs in $SAVE_PATH)"
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf_geo.cli train-ppo-ray \
  "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}"
