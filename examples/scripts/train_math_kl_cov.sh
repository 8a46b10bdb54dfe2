#!/usr/bin/env bash
# GRPO + KL-Cov on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8: one of SALT's entropy-control
# baselines (SALT, arXiv 2606.05800, §4.2, App. I, Table 4; KL-Cov: Cui et al., arXiv 2505.22617).
#
# Reproduces  the KL-Cov arm of SALT §4.2 / Fig. 3: train_math_grpo.sh's GRPO recipe with PPO's per-token
#             surrogate replaced by KL-Cov (--baseline.policy_loss kl_cov): the unclipped ratio term -A r, plus
#             the KL penalty |log r| on the 0.2 % of tokens with the largest centred log-prob x advantage
#             covariance.
#             SALT's geometry (PR, n_eff) is logged as for the GRPO baseline (--salt.diagnostics; Fig. 3 plots it
#             for these baselines); the advantages are GRPO's. Then (EVAL=1) `openrlhf-geo eval` on the final
#             model: ACC (= Pass@1) and Pass@8 from 8 samples at T = 0.6 on AIME24, AIME25, GSM8K, MATH-500 and
#             GPQA-Diamond (§4.1, App. D.2). Run once per SEED (2025-2029, App. H).
# Recipe      SALT Table 4 (App. C.1): the shared block exactly as train_math_grpo.sh (its header maps each value
#             to its flag: 8 rollouts at T = 0.6, LR 1e-6, KL loss 0.001, 64 prompts per step, mini-batch 32
#             prompts = 256 samples, 2 epochs, 8192 new tokens, per-sequence loss averaging per Eq. 3), plus
#             its KL-Covariance block:
#               KL covariance ratio 0.002 .......... --baseline.kl_cov_ratio 2e-3
#               PPO KL coefficient 1 ............... --baseline.kl_cov_coef 1
#               Clip ratio (Low) 0.2, (High) 0.2 ... --actor.eps_clip_low_high 0.2 0.2 (no effect: KL-Cov has no
#                                                     ratio clip; set as the table says)
#               Training epochs 2 .................. --train.num_episodes 2 (as in the shared block)
# Open        As train_math_grpo.sh: KL estimator k3, constant LR, in-training validation every 10 steps on
#             AIME24 + AIME25, OpenRLHF's optimizer defaults.
#             KL-Cov's covariance and top-k are per micro-batch (one call of the loss: up to 16,384 tokens with
#             --train.dynamic_batch_enable), at least one token, with |log r| as the per-token KL estimate, as in
#             the authors' released loss (the paper's text does not say).
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper gives none for the baselines; only the per-token loss changes (no extra forward),
#             so about GRPO's (SALT Table 11, 8 x H20: 1.5B 7:21 h on MATH-TRAIN / 15:41 h on DAPO-MATH, 7B
#             24:07 / 61:26); not measured here. Eval: 1-4 h on one GPU (estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        MATH-TRAIN or DAPO-MATH, AIME24 + AIME25 for validation, written to DATA_DIR by prepare_math_data.py on
#             first use (as train_math_grpo.sh).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/grpo-kl-cov/seed<k>/ with final/ (HF model), ckpt/,
#             tensorboard/, summary.json and <benchmark>.jsonl (eval), beside train_math_grpo.sh's runs, so
#             `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_<dataset> --baseline grpo` compares them with
#             GRPO and SALT.
#
# Usage       bash examples/scripts/train_math_kl_cov.sh       # 1.5B, MATH-TRAIN, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SEED=$s bash examples/scripts/train_math_kl_cov.sh; done
#             MODEL_SIZE=7B DATASET=dapo_math_17k bash examples/scripts/train_math_kl_cov.sh
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

# KL-Cov: SALT Table 4's KL-Covariance block
KL_COV_RATIO=2e-3
KL_COV_COEF=1  # "PPO KL coefficient 1"
EPS_CLIP=0.2   # "Clip ratio (Low) 0.2 / (High) 0.2"
ENTROPY_COEF=0 # shared block: no entropy loss; entropy is logged

METHOD=grpo-kl-cov
METHOD_ARGS=(
  "${GRPO_BASELINE_ARGS[@]}"
  --actor.eps_clip_low_high "$EPS_CLIP" "$EPS_CLIP" --actor.entropy_coef "$ENTROPY_COEF"
  --baseline.policy_loss kl_cov --baseline.kl_cov_ratio "$KL_COV_RATIO" --baseline.kl_cov_coef "$KL_COV_COEF"
)
salt_math_run grpo # rewards 1 / 0 (App. C.2)
