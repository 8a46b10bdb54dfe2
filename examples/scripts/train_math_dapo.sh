#!/usr/bin/env bash
# DAPO vs DAPO + SALT on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8 (SALT, arXiv 2606.05800).
#
# Reproduces  SALT's DAPO rows of Table 2 (§4.1): 2 epochs on DAPO-MATH or MATH-TRAIN, math-verify reward +1 correct
#             / -1 otherwise without overlong shaping (App. C.2), clip-higher, token-level loss and dynamic sampling
#             (Eq. 69). SALT=1 reweights the group-normalized advantages with SALT and changes nothing else; SALT=0
#             logs the same SALT geometry without touching the advantages. Then (EVAL=1) `openrlhf-geo eval`: ACC
#             (= Pass@1) and Pass@8 from 8 samples at T = 0.6 on AIME24, AIME25, GSM8K, MATH-500, GPQA-Diamond
#             (§4.1, App. D.2). The paper averages seeds 2025-2029 (App. H): run once per SEED.
# Recipe      SALT Table 4 (App. C.1), on OpenRLHF 0.11.2 (VeRL batch sizes count PROMPTS; 0.11.2's
#             --rollout.batch_size counts prompts, --train.batch_size SAMPLES):
#               Rollout samples per prompt 8 ....... --rollout.n_samples_per_prompt 8
#               Rollout temperature 0.6 ............ --rollout.temperature 0.6 (top-p 1, not in the table)
#               Learning rate 1e-6 ................. --actor.adam.lr 1e-6
#               Validation temperature 0.6 ......... --eval.temperature 0.6 and `eval --temperature 0.6`, 8 samples
#               Entropy coefficient 0 .............. --actor.entropy_coef 0 (no entropy loss; entropy is logged)
#               KL loss coefficient 0.001 .......... --algo.kl.use_loss --algo.kl.init_coef 0.001: Table 4 lists it
#                                                     for all runs and the DAPO block does not override it (Eq. 69,
#                                                     DAPO's own objective, has no KL term: KL_COEF=0 for that)
#               Prompt length 1024 ................. --data.max_len 9216 (prompt + response); no prompt cap
#               Response length 8192 ............... --rollout.max_new_tokens 8192
#               Train batch size 64 (prompts) ...... --rollout.batch_size 64 (groups kept after filtering)
#               Mini-batch size 32 (prompts) ....... --train.batch_size 256 (= 32 x 8 samples): 2 optimizer steps
#                                                     per rollout step; SALT's Gram is per mini-batch (default)
#               Training epochs 2 .................. --train.num_episodes 2 (1 PPO epoch per batch)
#               Filter groups enable True .......... --algo.dynamic_filtering_enable --algo.dynamic_filtering_range
#                                                     0 1: a group is kept iff 0 < mean 0/1 score < 1 (Eq. 69)
#               Clip ratio low 0.2 / high 0.28 ..... --actor.eps_clip_low_high 0.2 0.28
#             and token-level loss (Eq. 69) ........ --actor.loss_agg_mode token-mean
# Differs     "Generation batch size 128": VeRL samples 128 prompts at a time and keeps 64 surviving groups, dropping
#             the surplus; 0.11.2 samples --rollout.batch_size 64 prompts and replaces each filtered-out prompt by
#             one new prompt until 64 groups survive (a larger --rollout.vllm_generate_batch_size needs
#             --train.async_enable, i.e. off-policy async training). The trained batch is the same; 0.11.2 uses
#             fewer prompts per step, so an epoch has more steps than VeRL's.
#             "Max numbers of generation batches 10": no such cap in 0.11.2: it refills until 64 groups survive or
#             the epoch's prompts run out (VeRL stops with an error after 10 x 128 prompts).
#             The in-training eval logs the mean REWARD: eval_*_pass1 = 2 x accuracy - 1 with +-1 rewards (the
#             `openrlhf-geo eval` step reports accuracy).
# Open        Not in the text; VeRL's defaults: KL estimator k3 (low_var_kl), constant LR without warmup, in-training
#             validation every EVAL_STEPS=10 steps on AIME24 + AIME25. OpenRLHF's defaults: AdamW betas (0.9, 0.95),
#             no weight decay, gradient clip 1.0. No prompt-length cap in 0.11.2 (MATH/DAPO prompts are far shorter).
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper's Table 11 (8 x H20, VeRL), not measured here: 1.5B DAPO 7:17 h (MATH-TRAIN) / 16:01 h
#             (DAPO-MATH), + SALT 8:05 / 17:58; 7B DAPO 24:31 / 62:23, + SALT 25:58 / 66:04. Eval: 1-4 h on one GPU
#             (rough estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        DAPO-MATH (BytedTsinghua-SIA/DAPO-Math-17k, deduplicated, its "Answer:" instruction replaced by the
#             boxed-answer one) or MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval), AIME24 + AIME25 for validation;
#             written to DATA_DIR by prepare_math_data.py on first use. Eval benchmarks: DATA_DIR/benchmarks/ if
#             present, else the hub (GPQA-Diamond is gated: accept its terms and log in on the eval node).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/<method>/seed<k>/ (final/, ckpt/, tensorboard/, eval
#             summary.json); `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_<dataset> --baseline dapo`.
#
# Usage       bash examples/scripts/train_math_dapo.sh                        # DAPO, 1.5B, DAPO-MATH, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SALT=1 SEED=$s bash examples/scripts/train_math_dapo.sh; done
#             SALT=1 MODEL_SIZE=7B DATASET=math_train bash examples/scripts/train_math_dapo.sh
# Edit        the switches below, the cluster and paths in lib/common.sh (or set them in the environment), the recipe
#             blocks here and in lib/common.sh for other hyperparameters. Needs a running Ray cluster with `pip install
#             "openrlhf-geo[openrlhf]"` on every node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees.
#             WANDB_API_KEY set -> wandb logging (the key travels in the job's command line); TensorBoard logs are
#             always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$SCRIPT_DIR/lib/common.sh"

# Switches (and MODEL_SIZE, SEED, EVAL: salt_math_recipe in lib/common.sh)
SALT=${SALT:-0}                   # 1: --algo.advantage.estimator salt (group_norm reweighted by SALT)
DATASET=${DATASET:-dapo_math_17k} # dapo_math_17k | math_train

# DAPO recipe: SALT Table 4 (see the header for the mapping); its shared block is salt_math_recipe's
salt_math_recipe
ENTROPY_COEF=0
EPS_CLIP_LOW=0.2
EPS_CLIP_HIGH=0.28

case "$SALT" in
  0) METHOD=dapo ESTIMATOR_ARGS=("${DIAGNOSTICS_ESTIMATOR_ARGS[@]}") ;;
  1) METHOD=dapo-salt ESTIMATOR_ARGS=("${SALT_ESTIMATOR_ARGS[@]}") ;;
  *) die "SALT must be 0 or 1 (got '$SALT')" ;;
esac
METHOD_ARGS=(
  --actor.eps_clip_low_high "$EPS_CLIP_LOW" "$EPS_CLIP_HIGH" --actor.loss_agg_mode token-mean
  --actor.entropy_coef "$ENTROPY_COEF"
  "${KL_LOSS_ARGS[@]}"
  --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
  "${ESTIMATOR_ARGS[@]}"
)
# OPENRLHF_GEO_MATH_MODE=dapo: +1 / -1 rewards (App. C.2); the reward's `scores` stay 0/1 for dynamic filtering.
salt_math_run dapo
