#!/usr/bin/env bash
# GRPO vs GRPO + GeoAlign: math RLVR on Qwen3-1.7B / Qwen3-4B, DAPO-Math-17k, optional reward flips
# (GeoAlign, arXiv 2606.26917).
#
# Reproduces  the GeoAlign paper's math setting: 16 rollouts per prompt, GeoAlign's math preset (alpha 0.05,
#             projector early stop at validation accuracy 0.95), Best-Random replacement of flagged rollouts, with
#             clean rewards or with 10 % of each prompt's rewards flipped (NOISE_RATE=0.1), where GeoAlign also
#             logs detection precision / recall / AUROC against the injected flips. GEOALIGN=1 adds the curation
#             and changes nothing else.
# Recipe      16 rollouts and alpha 0.05 are the paper's; the other values are NOT verified against the GeoAlign
#             paper (not available when this script was written): the GRPO recipe of train_math_grpo.sh
#             (lr 1e-6, k3 KL loss 1e-3, per-sequence loss averaging, 2 optimizer steps per rollout step) with
#             128 prompts x 16 samples, temperature 1.0 and 8k-token responses.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated; the
#             GeoAlign projector trains on the CPU of OpenRLHF's trainer actor.
# Wall time   rough estimate from token counts, not measured: ~5-8 min per rollout step on one node for 1.7B
#             (one pass over DAPO-Math-17k = 136 steps, 12-18 h); about 2x that for 4B.
# Models      Qwen/Qwen3-1.7B | Qwen/Qwen3-4B (thinking mode, the chat template's default)
# Data        DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k, deduplicated, boxed-answer instruction), AIME 2024
#             for in-training eval; written to DATA_DIR by prepare_math_data.py on first use.
#
# Usage       bash examples/scripts/train_math_geoalign.sh                        # GRPO, 1.7B, clean rewards
#             GEOALIGN=1 NOISE_RATE=0.1 MODEL_SIZE=4B bash examples/scripts/train_math_geoalign.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb
#             logging (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
GEOALIGN=${GEOALIGN:-0}        # 1: --geoalign.enable --geoalign.preset math
NOISE_RATE=${NOISE_RATE:-0}    # 0 | 0.1: fraction of each prompt's rollouts whose 0/1 reward is flipped
MODEL_SIZE=${MODEL_SIZE:-1.7B} # 1.7B | 4B
SEED=${SEED:-42}

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Recipe (16 rollouts and alpha 0.05 from the GeoAlign paper; the rest NOT verified against it, see the header)
DATASET=dapo_math_17k
PROMPTS_PER_STEP=128
SAMPLES_PER_PROMPT=16
TRAIN_BATCH=1024 # rollouts per optimizer step: 2 optimizer steps per rollout step
LR=1e-6
KL_COEF=1e-3 # k3 estimator, as a loss term
EPS_CLIP=0.2
TEMPERATURE=1.0
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=8192
NUM_EPISODES=1
EVAL_STEPS=10
GEOALIGN_ALPHA=0.05

case "$MODEL_SIZE" in
  1.7B) MODEL=Qwen/Qwen3-1.7B ZERO_STAGE=2 ;;
  4B) MODEL=Qwen/Qwen3-4B ZERO_STAGE=3 ;;
  *) echo "MODEL_SIZE must be 1.7B or 4B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac
case "$GEOALIGN" in
  0) METHOD=grpo GEOALIGN_ARGS=() ;;
  1) METHOD=grpo-geoalign
     GEOALIGN_ARGS=(--geoalign.enable --geoalign.preset math --geoalign.alpha "$GEOALIGN_ALPHA") ;;
  *) echo "GEOALIGN must be 0 or 1 (got '$GEOALIGN')" >&2 && exit 2 ;;
esac
NOISE_ARGS=()
if [[ "$NOISE_RATE" != 0 ]]; then
  NOISE_ARGS=(--reward.noise.type flip --reward.noise.rate "$NOISE_RATE" --reward.noise.seed "$SEED")
  METHOD="${METHOD}_flip${NOISE_RATE}"
fi

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24
fi

RUN_NAME="qwen3-${MODEL_SIZE}_${DATASET}_${METHOD}_seed${SEED}"
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
  --algo.advantage.estimator group_norm
  "${GEOALIGN_ARGS[@]}" "${NOISE_ARGS[@]}"
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
