#!/usr/bin/env bash
# GRPO + Clip-Cov on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8: one of SALT's entropy-control
# baselines (SALT, arXiv 2606.05800, §4.2, App. I, Table 4; Clip-Cov: Cui et al., arXiv 2505.22617).
#
# Reproduces  the Clip-Cov arm of SALT §4.2 / Fig. 3: train_math_grpo.sh's GRPO recipe with PPO's per-token
#             surrogate replaced by Clip-Cov (--baseline.policy_loss clip_cov): of the tokens whose centred
#             log-prob x advantage covariance lies in [1, 5], a random 0.02 % lose their gradient; the rest keep
#             GRPO's clipped surrogate.
#             SALT's geometry (PR, n_eff) is logged as for the GRPO baseline (--salt.diagnostics; Fig. 3 plots it
#             for these baselines); the advantages are GRPO's. Then (EVAL=1) `openrlhf-geo eval` on the final
#             model: ACC (= Pass@1) and Pass@8 from 8 samples at T = 0.6 on AIME24, AIME25, GSM8K, MATH-500 and
#             GPQA-Diamond (§4.1, App. D.2). Run once per SEED (2025-2029, App. H).
# Recipe      SALT Table 4 (App. C.1): the shared block exactly as train_math_grpo.sh (its header maps each value
#             to its flag: 8 rollouts at T = 0.6, LR 1e-6, KL loss 0.001, 64 prompts per step, mini-batch 32
#             prompts = 256 samples, 2 epochs, 8192 new tokens, per-sequence loss averaging per Eq. 3), plus
#             its Clip-Covariance block:
#               Clip covariance ratio 0.0002 ....... --baseline.clip_cov_ratio 2e-4
#               Clip covariance lb 1.0, ub 5.0 ..... --baseline.clip_cov_lb 1.0 --baseline.clip_cov_ub 5.0
#               Clip ratio (Low) 1, (High) 1 ....... --actor.eps_clip_low_high 1 1 (the ratio is clipped to [0, 2])
# Open        As train_math_grpo.sh: KL estimator k3, constant LR, in-training validation every 10 steps on
#             AIME24 + AIME25, OpenRLHF's optimizer defaults.
#             Clip-Cov's covariance, candidates and token draw are per micro-batch (one call of the loss: up to
#             16,384 tokens with --train.dynamic_batch_enable), at least one token, as in the authors' released
#             loss (the paper's text does not say); the draw is seeded by --train.seed + the DeepSpeed rank.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper gives none for the baselines; only the per-token loss changes (no extra forward),
#             so about GRPO's (SALT Table 11, 8 x H20: 1.5B 7:21 h on MATH-TRAIN / 15:41 h on DAPO-MATH, 7B
#             24:07 / 61:26); not measured here. Eval: 1-4 h on one GPU (estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        MATH-TRAIN or DAPO-MATH, AIME24 + AIME25 for validation, written to DATA_DIR by prepare_math_data.py on
#             first use (as train_math_grpo.sh).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/grpo-clip-cov/seed<k>/ with final/ (HF model), ckpt/,
#             tensorboard/, summary.json and <benchmark>.jsonl (eval), beside train_math_grpo.sh's runs, so
#             `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_<dataset> --baseline grpo` compares them with
#             GRPO and SALT.
#
# Usage       bash examples/scripts/train_math_clip_cov.sh     # 1.5B, MATH-TRAIN, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SEED=$s bash examples/scripts/train_math_clip_cov.sh; done
#             MODEL_SIZE=7B DATASET=dapo_math_17k bash examples/scripts/train_math_clip_cov.sh
# Edit        the switches below, the cluster and paths in lib/common.sh (or set them in the environment), the recipe
#             blocks here and in lib/common.sh for other hyperparameters. Needs a running Ray cluster (`ray start
#             --head` on the head node, `ray start --address=HEAD:6379` on the others) with `pip install
#             "openrlhf-geo[openrlhf]"` on every node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees.
#             WANDB_API_KEY set -> wandb logging (the key travels in the job's command line); TensorBoard logs are
#             always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$SCRIPT_DIR/lib/common.sh"

# Switches: MODEL_SIZE, DATASET, SEED, EVAL (salt_math_recipe in lib/common.sh)
# GRPO recipe: SALT Table 4's shared block (as train_math_grpo.sh)
salt_math_recipe

# Clip-Cov: SALT Table 4's Clip-Covariance block
CLIP_COV_RATIO=2e-4
CLIP_COV_LB=1.0
CLIP_COV_UB=5.0
EPS_CLIP_LOW=1  # "Clip ratio (Low) 1"
EPS_CLIP_HIGH=1 # "Clip ratio (High) 1"
ENTROPY_COEF=0  # shared block: no entropy loss; entropy is logged

METHOD=grpo-clip-cov
METHOD_ARGS=(
  "${GRPO_BASELINE_ARGS[@]}"
  --actor.eps_clip_low_high "$EPS_CLIP_LOW" "$EPS_CLIP_HIGH" --actor.entropy_coef "$ENTROPY_COEF"
  --baseline.policy_loss clip_cov --baseline.clip_cov_ratio "$CLIP_COV_RATIO"
  --baseline.clip_cov_lb "$CLIP_COV_LB" --baseline.clip_cov_ub "$CLIP_COV_UB"
)
salt_math_run grpo # rewards 1 / 0 (App. C.2)
