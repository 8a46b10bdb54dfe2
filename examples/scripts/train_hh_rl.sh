#!/usr/bin/env bash
# HH-RLHF step 2 of 2: GRPO vs GRPO + GeoAlign from the SFT model of train_hh_sft.sh, rewarded by ArmoRM
# (GeoAlign, arXiv 2606.26917, RLHF setting).
#
# Reproduces  GeoAlign's HH-RLHF setting: 8 rollouts per prompt, GeoAlign's rlhf preset (alpha 0.12, projector
#             early stop at validation accuracy 0.85), ArmoRM (RLHFlow/ArmoRM-Llama3-8B-v0.1) scored as its model
#             card does (remote code, `.score`), optionally with 10 % of each prompt's rewards swapped to the
#             group's extremes (NOISE_RATE=0.1). GEOALIGN=1 adds the curation and changes nothing else.
# Recipe      8 rollouts and alpha 0.12 are the paper's; the other values are NOT verified against the GeoAlign
#             paper (not available when this script was written): 128 prompts x 8 samples, 2 optimizer steps per
#             rollout step, lr 5e-7, k3 KL loss 0.01, temperature 1.0, 512-token responses, 16384 prompts.
# Reward      default: ArmoRM runs inside each vLLM engine as a reward-function file (one 8B copy in bf16 per GPU,
#             hence vLLM's lower memory share). Alternative: serve it on a GPU outside this Ray cluster with
#             serve_armorm.sh and set RM_URL=http://HOST:5000/get_reward.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated.
# Wall time   rough estimate, not measured: ~1-2 min per rollout step on one node (128 steps, 2-4 h).
# Models      policy: SFT_MODEL from train_hh_sft.sh (Qwen/Qwen3-1.7B-Base SFT); reward: ArmoRM-Llama3-8B-v0.1
# Data        Dahoas/full-hh-rlhf (train split, `prompt` column, HH's "Human:/Assistant:" text format)
#
# Usage       bash examples/scripts/train_hh_rl.sh                               # GRPO + ArmoRM
#             GEOALIGN=1 NOISE_RATE=0.1 bash examples/scripts/train_hh_rl.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node, and hub access for ArmoRM's remote code; SFT_MODEL and SAVE_ROOT must be on a filesystem every
#             node sees. WANDB_API_KEY set -> wandb logging (the key travels in the job's command line);
#             TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
GEOALIGN=${GEOALIGN:-0}     # 1: --geoalign.enable --geoalign.preset rlhf
NOISE_RATE=${NOISE_RATE:-0} # 0 | 0.1: fraction of each prompt's rollouts whose reward is swapped to an extreme
RM_URL=${RM_URL:-}          # empty: ArmoRM inside the vLLM engines; http://HOST:PORT/get_reward: serve_armorm.sh
SEED=${SEED:-42}

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
SFT_MODEL=${SFT_MODEL:-$SAVE_ROOT/qwen3-1.7b-base_hh_sft/final} # train_hh_sft.sh's output
ARMORM=${ARMORM:-RLHFlow/ArmoRM-Llama3-8B-v0.1}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Recipe (8 rollouts and alpha 0.12 from the GeoAlign paper; the rest NOT verified against it, see the header)
DATASET=Dahoas/full-hh-rlhf
MAX_PROMPTS=16384
PROMPTS_PER_STEP=128
SAMPLES_PER_PROMPT=8
TRAIN_BATCH=512 # rollouts per optimizer step: 2 optimizer steps per rollout step
LR=5e-7
KL_COEF=0.01 # k3 estimator, as a loss term
EPS_CLIP=0.2
TEMPERATURE=1.0
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=512
GEOALIGN_ALPHA=0.12

case "$GEOALIGN" in
  0) METHOD=grpo GEOALIGN_ARGS=() ;;
  1) METHOD=grpo-geoalign
     GEOALIGN_ARGS=(--geoalign.enable --geoalign.preset rlhf --geoalign.alpha "$GEOALIGN_ALPHA") ;;
  *) echo "GEOALIGN must be 0 or 1 (got '$GEOALIGN')" >&2 && exit 2 ;;
esac
NOISE_ARGS=()
if [[ "$NOISE_RATE" != 0 ]]; then
  NOISE_ARGS=(--reward.noise.type swap --reward.noise.rate "$NOISE_RATE" --reward.noise.seed "$SEED")
  METHOD="${METHOD}_swap${NOISE_RATE}"
fi
# In the vLLM engines, ArmoRM shares each GPU with vLLM, the actor and the reference model.
REWARD=${RM_URL:-openrlhf_geo/rewards/armorm.py} # a file path is relative to working_dir, on every node
VLLM_MEM=0.4

RUN_NAME="qwen3-1.7b-base-hh-sft_armorm_${METHOD}_seed${SEED}"
SAVE_PATH="$SAVE_ROOT/$RUN_NAME"
VLLM_TP=1
WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.group "${RUN_NAME%_seed*}" --logger.wandb.run_name "$RUN_NAME")
fi
# Job level: working_dir + env_vars only. The fork's ray.init adds py_modules and upstream's env vars;
# Ray rejects a field or env var set at both levels. The ARMORM_* variables configure the reward-function file
# (ignored when RM_URL points at a server).
RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_ARMORM_MODEL": "%s", %s}}' "$REPO_DIR" \
  "$ARMORM" '"OPENRLHF_GEO_ARMORM_DTYPE": "bf16", "OPENRLHF_GEO_ARMORM_BATCH_SIZE": "16"')

ENGINE_ARGS=(
  --actor.num_nodes "$NUM_NODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
  --ref.num_nodes "$NUM_NODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
  --vllm.num_engines $((NUM_NODES * GPUS_PER_NODE / VLLM_TP)) --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization "$VLLM_MEM" --vllm.sync_backend nccl --vllm.enforce_eager
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
  --ds.zero_stage 2 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --ds.packing_samples
)
DATA_ARGS=(
  --actor.model_name_or_path "$SFT_MODEL"
  --data.prompt_dataset "$DATASET" --data.input_key prompt --data.max_samples "$MAX_PROMPTS"
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url "$REWARD"
)
ALGO_ARGS=(
  --rollout.batch_size "$PROMPTS_PER_STEP" --rollout.n_samples_per_prompt "$SAMPLES_PER_PROMPT"
  --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 16 --train.micro_batch_size 4
  --train.num_episodes 1 --train.max_epochs 1 --train.seed "$SEED"
  --rollout.temperature "$TEMPERATURE"
  --actor.adam.lr "$LR" --actor.lr_scheduler constant_with_warmup --actor.lr_warmup_ratio 0.03
  --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean
  --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
  --algo.advantage.estimator group_norm
  "${GEOALIGN_ARGS[@]}" "${NOISE_ARGS[@]}"
)
LOG_ARGS=(
  --ckpt.output_dir "$SAVE_PATH/final" --ckpt.path "$SAVE_PATH/ckpt" --ckpt.save_hf
  --ckpt.save_steps 32 --ckpt.max_num 3 --ckpt.load_enable
  --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE_PATH/tensorboard" "${WANDB_ARGS[@]}"
)

echo "submitting $RUN_NAME to $RAY_ADDRESS (reward: $REWARD; outputs in $SAVE_PATH)"
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf_geo.cli train-ppo-ray \
  "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}"
