#!/usr/bin/env bash
# HH-RLHF step 2 of 2: GRPO vs GRPO + GeoAlign from the SFT model of train_hh_sft.sh, rewarded by ArmoRM
# (GeoAlign, arXiv 2606.26917, §5, App. B).
#
# Reproduces  GeoAlign's HH-RLHF setting (§5.1, App. B.1, B.3): RL of the SFT'd Qwen3-1.7B-Base / 4B-Base on the
#             17,226 HH-RLHF prompts held out from SFT (App. B.1; prepare_hh_data.py), 8 rollouts per prompt,
#             GeoAlign's rlhf preset (alpha 0.12, §5.1), ArmoRM (RLHFlow/ArmoRM-Llama3-8B-v0.1) scored as its model
#             card does (remote code, `.score`). NOISE_RATE=0.05 | 0.1 corrupts that fraction of each prompt's
#             rewards by reassigning them to the group's extremes (below the group mean -> the group max, and vice
#             versa; §5.3, Table 3; the paper runs these on Qwen3-1.7B). GEOALIGN=1 adds the curation and changes
#             nothing else. Prompts are HH's raw "\n\nHuman: ...\n\nAssistant:" text ("the conversation from the
#             dataset directly as the input prompt", App. B.3), with no chat template, so Qwen3's thinking mode
#             (enable_thinking, App. B.3) does not arise.
# Evaluation  in training: the proxy reward (ArmoRM score) of one response per prompt of the HH-RLHF test split
#             (§5.1, App. B.2), every EVAL_STEPS steps, logged as eval_default_pass1. The LLM-judge scores (Qwen-MAX,
#             App. B.2) need an external endpoint: `openrlhf-geo judge` compares two runs' response files; producing
#             those files from the final models is not scripted here.
# Recipe      From the text: 17,226 RL prompts disjoint from SFT, 8 rollouts, alpha 0.12, ArmoRM reward, GRPO (App.
#             B.4). NOT in the text (Table 6 survives only as its caption), so these cannot be checked: LR 5e-7
#             (constant after 3 % warmup), 128 prompts per step, 512 samples per optimizer step (2 per rollout step),
#             KL loss 0.01 (k3), clip 0.2, per-sequence loss averaging, temperature 1.0 (rollout and eval), 512 new
#             tokens, one pass over the RL prompts (~135 steps), eval every 10 steps (the interval App. B.2 gives for
#             math).
# Reward      default: ArmoRM runs inside each vLLM engine as a reward-function file (one 8B copy in bf16 per GPU,
#             hence vLLM's lower memory share). Alternative: serve it on a GPU outside this Ray cluster with
#             serve_armorm.sh and set RM_URL=http://HOST:5000/get_reward.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper: one
#             node of 8 x A100-80G.
# Wall time   the paper (App. B.3, 8 x A100): SFT + RL 12-13 h for 1.7B, 16-17 h for 4B; not measured here.
# Models      policy: SFT_MODEL from train_hh_sft.sh for the same MODEL_SIZE (Qwen/Qwen3-1.7B-Base or
#             Qwen/Qwen3-4B-Base after SFT); reward: RLHFlow/ArmoRM-Llama3-8B-v0.1
# Data        DATA_DIR/hh/hh_rl.jsonl and hh_test.jsonl from prepare_hh_data.py (run by train_hh_sft.sh)
#
# Usage       bash examples/scripts/train_hh_rl.sh                               # GRPO + ArmoRM, 1.7B
#             GEOALIGN=1 NOISE_RATE=0.05 bash examples/scripts/train_hh_rl.sh
#             GEOALIGN=1 MODEL_SIZE=4B bash examples/scripts/train_hh_rl.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node, and hub access for ArmoRM's remote code; DATA_DIR, SFT_MODEL and SAVE_ROOT must be on a
#             filesystem every node sees. WANDB_API_KEY set -> wandb logging (the key travels in the job's command
#             line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
GEOALIGN=${GEOALIGN:-0}        # 1: --geoalign.enable --geoalign.preset rlhf
NOISE_RATE=${NOISE_RATE:-0}    # 0 | 0.05 | 0.1: fraction of each prompt's rollouts whose reward is swapped
MODEL_SIZE=${MODEL_SIZE:-1.7B} # 1.7B | 4B: picks the SFT model of train_hh_sft.sh
RM_URL=${RM_URL:-}             # empty: ArmoRM inside the vLLM engines; http://HOST:PORT/get_reward: serve_armorm.sh
SEED=${SEED:-42}

case "$MODEL_SIZE" in
  1.7B | 4B) ;;
  *) echo "MODEL_SIZE must be 1.7B or 4B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
SFT_MODEL=${SFT_MODEL:-$SAVE_ROOT/qwen3-${MODEL_SIZE,,}-base_hh_sft/final} # train_hh_sft.sh's output
ARMORM=${ARMORM:-RLHFlow/ArmoRM-Llama3-8B-v0.1}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Recipe. From the paper: 8 rollouts, alpha 0.12. Table 6 is not in the text: every other value is unchecked.
SAMPLES_PER_PROMPT=8
GEOALIGN_ALPHA=0.12
PROMPTS_PER_STEP=128 # unchecked
TRAIN_BATCH=512      # unchecked: samples per optimizer step, 2 optimizer steps per rollout step
LR=5e-7              # unchecked
KL_COEF=0.01         # unchecked: k3 estimator, as a loss term
EPS_CLIP=0.2         # unchecked
TEMPERATURE=1.0      # unchecked (rollout and eval)
MAX_PROMPT_LEN=1024  # unchecked
MAX_NEW_TOKENS=512   # unchecked
EVAL_STEPS=10        # unchecked

case "$GEOALIGN" in
  0) METHOD=grpo GEOALIGN_ARGS=() ;;
  1) METHOD=grpo-geoalign
     GEOALIGN_ARGS=(--geoalign.enable --geoalign.preset rlhf --geoalign.alpha "$GEOALIGN_ALPHA") ;;
  *) echo "GEOALIGN must be 0 or 1 (got '$GEOALIGN')" >&2 && exit 2 ;;
esac
case "$NOISE_RATE" in
  0) NOISE_ARGS=() ;;
  0.05 | 0.1)
    NOISE_ARGS=(--reward.noise.type swap --reward.noise.rate "$NOISE_RATE" --reward.noise.seed "$SEED")
    METHOD="${METHOD}_swap${NOISE_RATE}" ;;
  *) echo "NOISE_RATE must be 0, 0.05 or 0.1 (got '$NOISE_RATE')" >&2 && exit 2 ;;
esac
HH_DIR="$DATA_DIR/hh"
if [[ ! -f "$HH_DIR/hh_rl.jsonl" || ! -f "$HH_DIR/hh_test.jsonl" ]]; then
  python3 "$SCRIPT_DIR/prepare_hh_data.py" --out "$HH_DIR"
fi
# In the vLLM engines, ArmoRM shares each GPU with vLLM, the actor and the reference model.
REWARD=${RM_URL:-openrlhf_geo/rewards/armorm.py} # a file path is relative to working_dir, on every node
VLLM_MEM=0.4

SETTING="qwen3-${MODEL_SIZE,,}-base-hh-sft_armorm"
RUN_DIR="$SAVE_ROOT/$SETTING/$METHOD/seed$SEED"
RUN_NAME="${SETTING}_${METHOD}_seed${SEED}"
VLLM_TP=1
WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.group "${SETTING}_${METHOD}" --logger.wandb.run_name "$RUN_NAME")
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
  --data.prompt_dataset "$HH_DIR/hh_rl.jsonl" --data.input_key prompt
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url "$REWARD"
  --eval.dataset "$HH_DIR/hh_test.jsonl" --eval.steps "$EVAL_STEPS"
  --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt 1
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
  --ckpt.output_dir "$RUN_DIR/final" --ckpt.path "$RUN_DIR/ckpt" --ckpt.save_hf
  --ckpt.save_steps 32 --ckpt.max_num 3 --ckpt.load_enable
  --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard" "${WANDB_ARGS[@]}"
)

echo "submitting $RUN_NAME to $RAY_ADDRESS (reward: $REWARD; outputs in $RUN_DIR)"
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf_geo.cli train-ppo-ray \
  "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}"
