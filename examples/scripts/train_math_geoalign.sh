#!/usr/bin/env bash
# GRPO vs GRPO + GeoAlign: math RLVR on Qwen3-1.7B / Qwen3-4B (thinking off), DAPO-Math-17k, optional reward flips
# (GeoAlign, arXiv 2606.26917, §5, App. B).
#
# Reproduces  GeoAlign's math setting (§5.1, App. B.1-B.3): GRPO on the instruction-tuned Qwen3 models with 16
#             rollouts per prompt, math-verify reward 1.0 if the \boxed{} answer matches, else 0.0, the system prompt
#             "Please reason step by step, and put your final answer within \boxed{}." and enable_thinking=False
#             in training and evaluation (App. B.3); GeoAlign's math preset (alpha 0.05, §5.1); NOISE_RATE=0.05 |
#             0.1 flips the 0/1 reward of that fraction of each prompt's rollouts (§5.3, Table 3; the paper runs
#             these on Qwen3-1.7B), where GeoAlign also logs detection precision / recall / AUROC against the
#             flips. GEOALIGN=1 adds the curation and changes nothing else.
# Evaluation  in training, as the paper reports it (§5.1, App. B.2): every EVAL_STEPS=10 steps at T = 1.0 on AIME24
#             and AIME25 (avg@8), AMC23 (avg@4), MATH500, Minerva and OlympiadBench (one sample each), logged as
#             eval_<benchmark>_pass1; the paper's score of a run is the mean of the last five evaluations (per
#             benchmark, then averaged). 0.11.2 has one sample count for all eval sets, so the eval file repeats
#             each AIME problem 8 times and each AMC23 problem 4 times and samples once per row.
# Thinking    0.11.2 renders prompts with apply_chat_template(chat, tokenize=False, add_generation_prompt=True) and
#             has no flag for template arguments. prepare_math_data.py --render-with MODEL --chat-template-kwargs
#             '{"enable_thinking": false}' renders them once with the model's own template; the job reads that text
#             (--data.input_key prompt_text, no --data.apply_chat_template) for training and evaluation alike.
#             `openrlhf-geo eval` has no chat-template-argument flag either, so it is not run here: it would
#             evaluate with thinking on.
# Recipe      From the text: Qwen3-1.7B / 4B (instruction-tuned), DAPO-Math-17k, GRPO (App. B.4), 16 rollouts,
#             alpha 0.05, 1/0 math-verify reward, thinking off, eval protocol above. NOT in the text (Table 6, "key
#             hyperparameters for SFT and RL", survives only as its caption), so these cannot be checked: LR 1e-6
#             (constant after 3 % warmup), 128 prompts per step, 1024 samples per optimizer step (2 per rollout
#             step), KL loss 1e-3 (k3; Eq. 10 shows no KL term), clip 0.2, per-sequence loss averaging, rollout
#             temperature 1.0, 8192 new tokens, one pass over the data. Trinity-RFT with FSDP there, OpenRLHF +
#             DeepSpeed here. Prompts are shuffled (0.11.2 has no flag for App. B.5's sequential order).
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated; the GeoAlign
#             projector trains on the CPU of OpenRLHF's trainer actor. The paper: one node of 8 x A100-80G.
# Wall time   the paper (App. B.3, Trinity-RFT on 8 x A100): 20-22 h for 1.7B, 36-40 h for 4B; not measured here.
# Models      Qwen/Qwen3-1.7B | Qwen/Qwen3-4B
# Data        DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k, deduplicated: 17,398 problems per App. B.1, boxed-answer
#             instruction) and the eval suite, rendered for MODEL into DATA_DIR/<model>_no-thinking/ by
#             prepare_math_data.py on first use.
#
# Usage       bash examples/scripts/train_math_geoalign.sh                        # GRPO, 1.7B, clean rewards
#             GEOALIGN=1 NOISE_RATE=0.05 bash examples/scripts/train_math_geoalign.sh
#             GEOALIGN=1 MODEL_SIZE=4B bash examples/scripts/train_math_geoalign.sh
# Edit        the switches below, the cluster and paths in lib/common.sh (or set them in the environment), the recipe
#             blocks here and in lib/common.sh for other hyperparameters. Needs a running Ray cluster with `pip install
#             "openrlhf-geo[openrlhf]"` on every node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees.
#             WANDB_API_KEY set -> wandb logging (the key travels in the job's command line); TensorBoard logs are
#             always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$SCRIPT_DIR/lib/common.sh"

# Switches (and NOISE_RATE, MODEL_SIZE, SEED: geoalign_math_recipe in lib/common.sh)
GEOALIGN=${GEOALIGN:-0} # 1: --geoalign.enable --geoalign.preset math

# Recipe: geoalign_math_recipe. From the paper: 16 rollouts, alpha 0.05, eval every 10 steps at T 1.0. Table 6 is
# not in the text: every other value is unchecked (see the header).
geoalign_math_recipe
GEOALIGN_ALPHA=0.05

case "$GEOALIGN" in
  0) METHOD=grpo METHOD_ARGS=() ;;
  1) METHOD=grpo-geoalign
     METHOD_ARGS=(--geoalign.enable --geoalign.preset math --geoalign.alpha "$GEOALIGN_ALPHA") ;;
  *) die "GEOALIGN must be 0 or 1 (got '$GEOALIGN')" ;;
esac
geoalign_math_run
