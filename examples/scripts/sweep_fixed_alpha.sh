#!/usr/bin/env bash
# Fixed-alpha sweep (SALT, arXiv 2606.05800, §4.3, Fig. 4(b), App. F.3.1): GRPO + SALT with the mixing coefficient
# held at alpha in {0, 0.25, 0.5, 0.75, 1} instead of SALT's adaptive alpha_t, DeepSeek-R1-Distill-Qwen-1.5B on
# MATH-TRAIN, then the ACC / Pass@8 evaluation.
#
# Reproduces  the fixed-alpha control a' = P_k a + alpha P_k^perp [a]_+ (App. F.3.1, "fixed-alpha"; Table 8's
#             "+ Fixed-alpha_t" row) swept over the values of Fig. 4(b), which plots accuracy against n_eff: every
#             run logs PR and n_eff. The adaptive reference is `SALT=1 bash examples/scripts/train_math_grpo.sh`
#             (its alpha_t is logged as salt/alpha), the baseline `bash examples/scripts/train_math_grpo.sh`: both
#             write next to these runs, so `openrlhf-geo report` compares all of them.
# Recipe      SALT Table 4 with GRPO, exactly as train_math_grpo.sh (see its header for the flag mapping): 8 rollouts
#             at T 0.6, LR 1e-6, KL loss 0.001, entropy 0, 1024 + 8192 tokens, 64 prompts per step, mini-batch 32
#             prompts (--train.batch_size 256), 2 epochs; only --salt.variant fixed-alpha --salt.alpha A differ
#             from SALT=1 there.
# Open        Fig. 4(b) names neither model nor dataset; Table 8 (the same ablations) uses the 1.5B model on
#             MATH-TRAIN, chosen here. Seeds as in App. H (2025-2029), one per invocation.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); the runs are submitted one after another (each
#             `ray job submit` waits for its job).
# Wall time   the paper's Table 11 gives 7:58 h for 1.5B + SALT on MATH-TRAIN (8 x H20, VeRL), not measured here;
#             5 runs + eval ~2 days on one node.
# Model       deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
# Data        MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval), AIME24 + AIME25 for validation; written to DATA_DIR
#             by prepare_math_data.py on first use. Eval benchmarks: DATA_DIR/benchmarks/ if present, else the hub.
# Outputs     SAVE_ROOT/r1-distill-qwen-1.5B_math_train/grpo-salt-alpha<A>/seed<k>/ (final/, ckpt/, tensorboard/,
#             eval summary.json); `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-1.5B_math_train --baseline grpo`.
#
# Usage       bash examples/scripts/sweep_fixed_alpha.sh
#             ALPHAS="0.25 0.75" SEED=2026 bash examples/scripts/sweep_fixed_alpha.sh
# Edit        the switches below, the cluster and paths in lib/common.sh (or set them in the environment), the recipe
#             block in lib/common.sh (salt_table4) for other hyperparameters. Needs a running Ray cluster with `pip
#             install "openrlhf-geo[openrlhf]"` on every node; DATA_DIR and SAVE_ROOT must be on a filesystem every node
#             sees. WANDB_API_KEY set -> wandb logging (the key travels in the job's command line); TensorBoard logs are
#             always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$SCRIPT_DIR/lib/common.sh"

# Switches
ALPHAS=${ALPHAS:-0 0.25 0.5 0.75 1} # Fig. 4(b)
SEED=${SEED:-2025}                  # the paper's seeds: 2025 2026 2027 2028 2029
EVAL=${EVAL:-1}                     # 1: evaluate each final model

# GRPO recipe: SALT Table 4 (as train_math_grpo.sh; its shared block is salt_table4 in lib/common.sh)
salt_table4
MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
DATASET=math_train
ENTROPY_COEF=0
EPS_CLIP=0.2

check_eval_switch
for ALPHA in $ALPHAS; do
  if ! [[ "$ALPHA" =~ ^(0|1|0?\.[0-9]+|1\.0*)$ ]]; then
    die "ALPHAS must hold numbers in [0, 1] (got '$ALPHA')"
  fi
done

prepare_math_data

SETTING="r1-distill-qwen-1.5B_${DATASET}"
math_runtime_env grpo # rewards 1 / 0 (App. C.2)
engine_args 2 0.6 "${DYNAMIC_BATCH_ARGS[@]}"
# shellcheck disable=SC2119
salt_data_args
schedule_args
RECIPE_ARGS=(
  "${DATA_ARGS[@]}" "${SCHEDULE_ARGS[@]}"
  --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean --actor.entropy_coef "$ENTROPY_COEF"
  "${KL_LOSS_ARGS[@]}"
  --algo.advantage.estimator salt --salt.base group_norm
)

FAILED=()
for ALPHA in $ALPHAS; do
  METHOD="grpo-salt-alpha$ALPHA"
  run_names "$SETTING"
  wandb_args "${SETTING}_${METHOD}"
  log_args 20 3
  salt_eval_args
  echo "submitting $RUN_NAME (outputs in $RUN_DIR)"
  # A failed run is reported at the end; the sweep goes on.
  sweep_run "${ENGINE_ARGS[@]}" "${RECIPE_ARGS[@]}" --salt.variant fixed-alpha --salt.alpha "$ALPHA" "${LOG_ARGS[@]}"
done
report_failures
