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
# Edit        the switches below, the cluster and paths in lib/common.sh (or set them in the environment), the recipe
#             blocks here and in lib/common.sh for other hyperparameters. Needs a running Ray cluster with `pip install
#             "openrlhf-geo[openrlhf]"` on every node, and hub access for ArmoRM's remote code; DATA_DIR, SFT_MODEL and
#             SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb logging (the key travels in
#             the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$SCRIPT_DIR/lib/common.sh"

# Switches
GEOALIGN=${GEOALIGN:-0}        # 1: --geoalign.enable --geoalign.preset rlhf
NOISE_RATE=${NOISE_RATE:-0}    # 0 | 0.05 | 0.1: fraction of each prompt's rollouts whose reward is swapped
MODEL_SIZE=${MODEL_SIZE:-1.7B} # 1.7B | 4B: picks the SFT model of train_hh_sft.sh
RM_URL=${RM_URL:-}             # empty: ArmoRM inside the vLLM engines; http://HOST:PORT/get_reward: serve_armorm.sh
SEED=${SEED:-42}

case "$MODEL_SIZE" in
  1.7B | 4B) ;;
  *) die "MODEL_SIZE must be 1.7B or 4B (got '$MODEL_SIZE')" ;;
esac

# Models (the cluster and paths: lib/common.sh)
SFT_MODEL=${SFT_MODEL:-$SAVE_ROOT/qwen3-${MODEL_SIZE,,}-base_hh_sft/final} # train_hh_sft.sh's output
ARMORM=${ARMORM:-RLHFlow/ArmoRM-Llama3-8B-v0.1}

# Recipe. From the paper: 8 rollouts, alpha 0.12. Table 6 is not in the text: every other value is unchecked.
SAMPLES_PER_PROMPT=8
GEOALIGN_ALPHA=0.12
PROMPTS_PER_STEP=128              # unchecked
TRAIN_BATCH=512                   # unchecked: samples per optimizer step, 2 optimizer steps per rollout step
LR=5e-7                           # unchecked
KL_COEF=0.01                      # unchecked: k3 estimator, as a loss term
EPS_CLIP=0.2                      # unchecked
TEMPERATURE=1.0                   # unchecked (rollout and eval)
MAX_PROMPT_LEN=1024               # unchecked
MAX_NEW_TOKENS=512                # unchecked
EVAL_STEPS=10                     # unchecked
NUM_EPISODES=1                    # unchecked
ROLLOUT_MICRO_BATCH=16            # unchecked
TRAIN_MICRO_BATCH=4               # unchecked
LR_SCHEDULER=constant_with_warmup # unchecked
LR_WARMUP_RATIO=0.03              # unchecked

case "$GEOALIGN" in
  0) METHOD=grpo METHOD_ARGS=() ;;
  1) METHOD=grpo-geoalign
     METHOD_ARGS=(--geoalign.enable --geoalign.preset rlhf --geoalign.alpha "$GEOALIGN_ALPHA") ;;
  *) die "GEOALIGN must be 0 or 1 (got '$GEOALIGN')" ;;
esac
reward_noise_args swap
HH_DIR="$DATA_DIR/hh"
if [[ ! -f "$HH_DIR/hh_rl.jsonl" || ! -f "$HH_DIR/hh_test.jsonl" ]]; then
  python3 "$SCRIPT_DIR/prepare_hh_data.py" --out "$HH_DIR"
fi
# In the vLLM engines, ArmoRM shares each GPU with vLLM, the actor and the reference model.
REWARD=${RM_URL:-openrlhf_geo/rewards/armorm.py} # a file path is relative to working_dir, on every node
VLLM_MEM=0.4

run_names "qwen3-${MODEL_SIZE,,}-base-hh-sft_armorm"
wandb_args "${SETTING}_${METHOD}"
# Job level: working_dir + env_vars only (see math_runtime_env). The ARMORM_* variables configure the
# reward-function file (ignored when RM_URL points at a server).
RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_ARMORM_MODEL": "%s", %s}}' "$REPO_DIR" \
  "$ARMORM" '"OPENRLHF_GEO_ARMORM_DTYPE": "bf16", "OPENRLHF_GEO_ARMORM_BATCH_SIZE": "16"')

engine_args 2 "$VLLM_MEM"
DATA_ARGS=(
  --actor.model_name_or_path "$SFT_MODEL"
  --data.prompt_dataset "$HH_DIR/hh_rl.jsonl" --data.input_key prompt
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url "$REWARD"
  --eval.dataset "$HH_DIR/hh_test.jsonl" --eval.steps "$EVAL_STEPS"
  --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt 1
)
schedule_args
grpo_args
log_args 32 3

echo "submitting $RUN_NAME to $RAY_ADDRESS (reward: $REWARD; outputs in $RUN_DIR)"
submit_train "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${SCHEDULE_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${METHOD_ARGS[@]}" "${NOISE_ARGS[@]}" "${LOG_ARGS[@]}"
