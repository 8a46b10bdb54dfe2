#!/usr/bin/env bash
# Rollout-scaling sweep (SALT, arXiv 2606.05800, §4.4, Fig. 4(c)/(d)): GRPO, DAPO and both + SALT for G in
# {2, 4, ..., 256} rollouts per prompt at a FIXED rollout budget, DeepSeek-R1-Distill-Qwen-1.5B on MATH-TRAIN.
#
# Reproduces  "when G increases from 2 to 256, GRPO and DAPO exhibit diminishing returns, whereas SALT yields
#             consistent gains" (§4.4): every run makes STEPS rollout steps of BUDGET trained rollouts (prompts per
#             step x G = BUDGET), with the same optimizer steps and LR schedule for every G, from a pool of POOL
#             prompts (small G revisits the pool over several episodes; large G uses its first BUDGET * STEPS / G
#             prompts once). Each run logs PR and n_eff (Fig. 4(d); baselines via --salt.diagnostics) and, with
#             EVAL=1, gets the ACC / Pass@8 evaluation of train_math_grpo.sh.
# Recipe      SALT Table 4 for everything but the group size (see train_math_grpo.sh / train_math_dapo.sh for the
#             flag mapping): T 0.6, LR 1e-6 constant, KL loss 0.001 (k3), entropy 0, 1024 + 8192 tokens, mini-batch
#             32 prompts x 8 = 256 samples (--train.batch_size 256, held fixed in samples for every G: 2 optimizer
#             steps per rollout step); DAPO adds clip 0.2/0.28, token-level loss, dynamic filtering, +-1 rewards.
# Open        The text gives no budget, step count, model or dataset for Fig. 4(c). Chosen: BUDGET=512 rollouts per
#             step (Table 4's 64 prompts x 8), STEPS=128, POOL=4096 prompts of MATH-TRAIN (powers of two, so every
#             G splits them evenly), the 1.5B model and MATH-TRAIN of Table 8's ablations (same section).
# Differs     DAPO: dynamic filtering replaces all-correct / all-wrong groups with new prompts, so a DAPO run consumes
#             the pool faster than STEPS x BUDGET / G prompts and ends after fewer than STEPS steps (0.11.2 has no
#             step cap; the episodes end when the prompts do); the trained rollouts per step stay BUDGET. The
#             generation-batch caveats of train_math_dapo.sh apply.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); the runs are submitted one after another (each
#             `ray job submit` waits for its job).
# Wall time   rough estimate, not measured: 128 steps of 512 rollouts is ~55 % of a MATH-TRAIN run of
#             train_math_grpo.sh (Table 11: 7-8 h on 8 x H20), so ~4-5 h per run plus ~1-2 h of eval, 32 runs
#             ~1 week on one node. Run subsets with G_LIST / METHODS, or several clusters.
# Model       deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
# Data        MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval), AIME24 + AIME25 for validation; written to DATA_DIR
#             by prepare_math_data.py on first use.
# Outputs     SAVE_ROOT/rollout-scaling/r1-distill-qwen-1.5B_math_train_G<G>/<method>/seed<k>/: compare methods at
#             one G with `openrlhf-geo report SAVE_ROOT/rollout-scaling/r1-distill-qwen-1.5B_math_train_G<G>
#             --baseline grpo`.
#
# Usage       bash examples/scripts/sweep_rollout_scaling.sh
#             G_LIST="8 64" METHODS="grpo grpo-salt" SEED=2026 bash examples/scripts/sweep_rollout_scaling.sh
# Edit        the switches below, the cluster and paths in lib/common.sh (or set them in the environment), the recipe
#             blocks here and in lib/common.sh for other hyperparameters. Needs a running Ray cluster with `pip install
#             "openrlhf-geo[openrlhf]"` on every node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees.
#             WANDB_API_KEY set -> wandb logging (the key travels in the job's command line); TensorBoard logs are
#             always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$SCRIPT_DIR/lib/common.sh"

# Switches
G_LIST=${G_LIST:-2 4 8 16 32 64 128 256} # rollouts per prompt
METHODS=${METHODS:-grpo grpo-salt dapo dapo-salt}
SEED=${SEED:-2025} # the paper's seeds: 2025 2026 2027 2028 2029
EVAL=${EVAL:-1}    # 1: evaluate each final model

# Fixed budget: every run = STEPS rollout steps x BUDGET rollouts (BUDGET, STEPS, POOL: powers of two)
BUDGET=512 # rollouts per rollout step = prompts per step x G (Table 4: 64 prompts x 8)
STEPS=128  # rollout steps per run
POOL=4096  # distinct prompts available (the first POOL of MATH-TRAIN; it has 7500)

# Table 4 recipe (salt_table4 in lib/common.sh; TRAIN_BATCH=256 samples per optimizer step, Table 4's mini-batch
# of 32 prompts x 8)
salt_table4
MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
DATASET=math_train
ENTROPY_COEF=0

check_eval_switch
for METHOD in $METHODS; do
  case "$METHOD" in
    grpo | grpo-salt | dapo | dapo-salt) ;;
    *) die "METHODS may hold grpo, grpo-salt, dapo and dapo-salt (got '$METHOD')" ;;
  esac
done

prepare_math_data

engine_args 2 0.6 "${DYNAMIC_BATCH_ARGS[@]}"

FAILED=()
for G in $G_LIST; do
  PROMPTS=$((BUDGET / G))
  VISITS=$((BUDGET * STEPS / G)) # prompt visits per run
  if ((G < 2 || PROMPTS * G != BUDGET || (VISITS > POOL && VISITS % POOL != 0))); then
    die "G=$G does not split BUDGET=$BUDGET x STEPS=$STEPS over POOL=$POOL evenly (use powers of two >= 2)"
  fi
  if ((VISITS > POOL)); then
    MAX_SAMPLES=$POOL EPISODES=$((VISITS / POOL))
  else
    MAX_SAMPLES=$VISITS EPISODES=1
  fi
  SETTING="r1-distill-qwen-1.5B_${DATASET}_G${G}"
  PROMPTS_PER_STEP=$PROMPTS SAMPLES_PER_PROMPT=$G NUM_EPISODES=$EPISODES
  salt_data_args --data.max_samples "$MAX_SAMPLES"
  schedule_args
  for METHOD in $METHODS; do
    case "$METHOD" in
      grpo*) MATH_MODE=grpo ALGO_ARGS=(--actor.eps_clip 0.2 --actor.loss_agg_mode seq-mean-token-mean) ;;
      dapo*) MATH_MODE=dapo ALGO_ARGS=(
          --actor.eps_clip_low_high 0.2 0.28 --actor.loss_agg_mode token-mean
          --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
        ) ;;
    esac
    case "$METHOD" in
      *-salt) ESTIMATOR_ARGS=("${SALT_ESTIMATOR_ARGS[@]}") ;;
      *) ESTIMATOR_ARGS=("${DIAGNOSTICS_ESTIMATOR_ARGS[@]}") ;;
    esac
    run_names "$SETTING" "$SAVE_ROOT/rollout-scaling/$SETTING"
    wandb_args "rollout-scaling_budget${BUDGET}_${METHOD}"
    math_runtime_env "$MATH_MODE" # rewards 1/0 or +1/-1 (App. C.2)
    log_args 32 2
    salt_eval_args
    echo "submitting $RUN_NAME: $PROMPTS prompts x G=$G per step, $EPISODES episode(s) over $MAX_SAMPLES prompts"
    # A failed run (e.g. out of memory at one G) is reported at the end; the sweep goes on.
    sweep_run "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${SCHEDULE_ARGS[@]}" \
      --actor.entropy_coef "$ENTROPY_COEF" "${KL_LOSS_ARGS[@]}" "${ALGO_ARGS[@]}" "${ESTIMATOR_ARGS[@]}" \
      "${LOG_ARGS[@]}"
  done
done
report_failures
