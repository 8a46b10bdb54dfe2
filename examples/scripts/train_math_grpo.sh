#!/usr/bin/env bash
# GRPO vs GRPO + SALT on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8 (SALT, arXiv 2606.05800).
#
# Reproduces  SALT's GRPO rows of Table 2 (§4.1): 2 epochs on MATH-TRAIN or DAPO-MATH, math-verify reward 1 correct /
#             0 otherwise with the "Please reason step by step, ..." system prompt (App. C.2), per-sequence loss
#             averaging (Eq. 3). SALT=1 reweights the group-normalized advantages with SALT and changes nothing else;
#             SALT=0 logs the same SALT geometry (PR, n_eff; Fig. 3) without touching the advantages. Then
#             (EVAL=1) `openrlhf-geo eval` on the final model: ACC (= Pass@1) and Pass@8 from 8 samples at T = 0.6
#             on AIME24, AIME25, GSM8K, MATH-500 and GPQA-Diamond (§4.1, App. D.2). The paper's numbers average
#             seeds 2025-2029 (App. H): run the script once per SEED.
# Recipe      SALT Table 4 (App. C.1), on OpenRLHF 0.11.2. The authors ran VeRL, whose batch sizes count PROMPTS;
#             0.11.2's --rollout.batch_size counts prompts and --train.batch_size counts SAMPLES (responses):
#               Rollout samples per prompt 8 ....... --rollout.n_samples_per_prompt 8
#               Rollout temperature 0.6 ............ --rollout.temperature 0.6 (top-p 1, not in the table)
#               Learning rate 1e-6 ................. --actor.adam.lr 1e-6
#               Validation temperature 0.6 ......... --eval.temperature 0.6 and `eval --temperature 0.6`, 8 samples
#                                                     ("the same sampling configuration for validation", §4.1)
#               Entropy coefficient 0 .............. --actor.entropy_coef 0 (no entropy loss; entropy is logged)
#               KL loss coefficient 0.001 .......... --algo.kl.use_loss --algo.kl.init_coef 0.001
#               Prompt length 1024 ................. --data.max_len 9216 (prompt + response); no prompt cap
#               Response length 8192 ............... --rollout.max_new_tokens 8192
#               Train batch size 64 (prompts) ...... --rollout.batch_size 64
#               Mini-batch size 32 (prompts) ....... --train.batch_size 256 (= 32 x 8 samples): 2 optimizer steps
#                                                     per rollout step; SALT's Gram is per mini-batch (App. D.1,
#                                                     G.1), the default of --salt.group_prompts
#               Training epochs 2 .................. --train.num_episodes 2 (passes over the prompts; 1 PPO
#                                                     epoch per batch, --train.max_epochs 1)
# Open        Not in the text; chosen as the authors' framework (VeRL) does by default: clip 0.2 (Table 4 gives
#             clip ratios only for DAPO), KL estimator k3 (VeRL's low_var_kl), constant LR without warmup, in-training
#             validation every EVAL_STEPS=10 steps on AIME24 + AIME25. OpenRLHF's defaults: AdamW betas
#             (0.9, 0.95), no weight decay, gradient clip 1.0. Prompt length: 0.11.2 has no prompt-length cap (VeRL
#             enforces its 1024); MATH and DAPO-Math prompts are far shorter. Loss averaging follows
#             Eq. 3 (per sequence, then over the batch); VeRL's default would be a token mean.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper's Table 11 (8 x H20, VeRL), not measured here: 1.5B GRPO 7:21 h (MATH-TRAIN) / 15:41 h
#             (DAPO-MATH), + SALT 7:58 / 17:08; 7B GRPO 24:07 / 61:26, + SALT 26:22 / 66:08. Eval: 1-4 h on one GPU
#             (estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval, 7500) or DAPO-MATH (BytedTsinghua-SIA/DAPO-Math-17k,
#             deduplicated, its "Answer:" instruction replaced by the boxed-answer one), AIME24 + AIME25 for
#             validation; written to DATA_DIR by prepare_math_data.py on first use. The eval benchmarks come from
#             DATA_DIR/benchmarks/<name>.jsonl if present, else the hub (GPQA-Diamond is gated: accept its terms and
#             `huggingface-cli login` on the eval node).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/<method>/seed<k>/: final/ (HF model), ckpt/, tensorboard/,
#             summary.json + <benchmark>.jsonl (eval); then `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_
#             <dataset> --baseline grpo` compares the methods over seeds.
#
# Usage       bash examples/scripts/train_math_grpo.sh                          # GRPO, 1.5B, MATH-TRAIN, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SALT=1 SEED=$s bash examples/scripts/train_math_grpo.sh; done
#             SALT=1 MODEL_SIZE=7B DATASET=dapo_math_17k bash examples/scripts/train_math_grpo.sh
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
SALT=${SALT:-0} # 1: --algo.advantage.estimator salt (group_norm reweighted by SALT)

# GRPO recipe: SALT Table 4 (see the header for the mapping); its shared block is salt_math_recipe's
salt_math_recipe
ENTROPY_COEF=0
EPS_CLIP=0.2

case "$SALT" in
  0) METHOD=grpo ESTIMATOR_ARGS=("${DIAGNOSTICS_ESTIMATOR_ARGS[@]}") ;;
  1) METHOD=grpo-salt ESTIMATOR_ARGS=("${SALT_ESTIMATOR_ARGS[@]}") ;;
  *) die "SALT must be 0 or 1 (got '$SALT')" ;;
esac
METHOD_ARGS=(
  --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean --actor.entropy_coef "$ENTROPY_COEF"
  "${KL_LOSS_ARGS[@]}" "${ESTIMATOR_ARGS[@]}"
)
salt_math_run grpo # OPENRLHF_GEO_MATH_MODE=grpo: rewards 1 / 0 (App. C.2)
