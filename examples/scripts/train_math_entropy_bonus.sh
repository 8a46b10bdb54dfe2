#!/usr/bin/env bash
# GRPO + entropy bonus on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8: one of SALT's
# entropy-control baselines (SALT, arXiv 2606.05800, §4.2, App. I Eq. 70-71, Table 4).
#
# Reproduces  the entropy-bonus arm of SALT §4.2 / Fig. 3 and App. F.4: train_math_grpo.sh's GRPO recipe plus
#             lambda_ENT x the token entropy of the T = 0.6 policy in the objective (Eq. 70-71, upstream's
#             --actor.entropy_coef); the loss is GRPO's.
#             SALT's geometry (PR, n_eff) is logged as for the GRPO baseline (--salt.diagnostics; Fig. 3 plots it
#             for these baselines); the advantages are GRPO's. Then (EVAL=1) `openrlhf-geo eval` on the final
#             model: ACC (= Pass@1) and Pass@8 from 8 samples at T = 0.6 on AIME24, AIME25, GSM8K, MATH-500 and
#             GPQA-Diamond (§4.1, App. D.2). Run once per SEED (2025-2029, App. H).
# Recipe      SALT Table 4 (App. C.1): the shared block exactly as train_math_grpo.sh (its header maps each value
#             to its flag: 8 rollouts at T = 0.6, LR 1e-6, KL loss 0.001, 64 prompts per step, mini-batch 32
#             prompts = 256 samples, 2 epochs, 8192 new tokens, per-sequence loss averaging per Eq. 3), plus
#               lambda_ENT (Eq. 71) ................ --actor.entropy_coef ENTROPY_COEF: NOT in the text (Table 4's
#                                                     "Entropy coefficient 0" is the non-bonus setting); 0.001
#                                                     here, unchecked
# Open        As train_math_grpo.sh: KL estimator k3, constant LR, in-training validation every 10 steps on
#             AIME24 + AIME25, OpenRLHF's optimizer defaults.
#             Aggregation: 0.11.2 averages the entropy over all response tokens of the optimizer step (a token
#             mean); Eq. 71 averages per response, then over responses. The two agree when the responses have the
#             same length. The local engine (`openrlhf-geo train --actor.entropy_coef`) follows Eq. 71 under
#             --actor.loss_agg_mode seq-mean-token-mean. GRPO clip 0.2, as train_math_grpo.sh.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper gives none for the baselines; the entropy comes from the training forward's logits,
#             so about GRPO's (SALT Table 11, 8 x H20: 1.5B 7:21 h on MATH-TRAIN / 15:41 h on DAPO-MATH, 7B
#             24:07 / 61:26); not measured here. Eval: 1-4 h on one GPU (estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        MATH-TRAIN or DAPO-MATH, AIME24 + AIME25 for validation, written to DATA_DIR by prepare_math_data.py on
#             first use (as train_math_grpo.sh).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/grpo-entropy<coef>/seed<k>/ with final/ (HF model), ckpt/,
#             tensorboard/, summary.json and <benchmark>.jsonl (eval), beside train_math_grpo.sh's runs, so
#             `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_<dataset> --baseline grpo` compares them with
#             GRPO and SALT.
#
# Usage       bash examples/scripts/train_math_entropy_bonus.sh # 1.5B, MATH-TRAIN, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SEED=$s bash examples/scripts/train_math_entropy_bonus.sh; done
#             MODEL_SIZE=7B DATASET=dapo_math_17k bash examples/scripts/train_math_entropy_bonus.sh
#             ENTROPY_COEF=0.005 bash examples/scripts/train_math_entropy_bonus.sh    # another lambda_ENT
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

# Switches (and MODEL_SIZE, DATASET, SEED, EVAL: salt_math_recipe in lib/common.sh)
ENTROPY_COEF=${ENTROPY_COEF:-0.001} # lambda_ENT > 0 (not in the text, see the header)

# GRPO recipe: SALT Table 4's shared block (as train_math_grpo.sh)
salt_math_recipe
EPS_CLIP=0.2 # not in the text (as train_math_grpo.sh)

check_eval_switch
if ! awk -v x="$ENTROPY_COEF" 'BEGIN { exit !(x ~ /^[0-9]*[.]?[0-9]+([eE][-+]?[0-9]+)?$/ && x + 0 > 0) }'; then
  die "ENTROPY_COEF must be a number > 0 (got '$ENTROPY_COEF')"
fi

METHOD="grpo-entropy${ENTROPY_COEF}"
METHOD_ARGS=("${GRPO_BASELINE_ARGS[@]}" --actor.eps_clip "$EPS_CLIP" --actor.entropy_coef "$ENTROPY_COEF")
salt_math_run grpo # rewards 1 / 0 (App. C.2)
