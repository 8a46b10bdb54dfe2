#!/usr/bin/env bash
# Seed-GRPO (semantic-entropy-scaled GRPO advantages): math RLVR on Qwen3-1.7B / 4B, DAPO-Math-17k, optional
# reward flips; a GeoAlign baseline (GeoAlign, arXiv 2606.26917, §5.1, App. B.5; Seed-GRPO: Chen et al.,
# arXiv 2505.12346).
#
# Reproduces  the Seed-GRPO rows of GeoAlign's math comparison (Table 1, per benchmark Tables 13-14) and, with
#             NOISE_RATE=0.05 | 0.1, of its reward-flip comparison (Table 3): each prompt's GRPO advantages are
#             scaled by 1 - alpha x SE / log G, SE the semantic entropy of its 16 responses clustered by final
#             \boxed{} answer (math-verify equivalence), so prompts whose answers disagree update more
#             conservatively (--baseline.seed_grpo_alpha). The answer checks run in a math-verify worker pool
#             with the reward's timeout (OPENRLHF_GEO_MATH_TIMEOUT / _WORKERS).
# Recipe      As train_math_geoalign.sh (GeoAlign §5.1, App. B.1-B.4): Qwen3-1.7B / 4B instruction-tuned with
#             thinking off, DAPO-Math-17k, GRPO, 16 rollouts, 1/0 math-verify reward, in-training eval every 10 steps
#             at T = 1.0 on the six benchmarks. NOT in the text (Table 6, "key hyperparameters for SFT and RL",
#             survives only as its caption), so unchecked, as there: LR 1e-6 (3 % warmup), 128 prompts per step,
#             1024 samples per optimizer step, KL loss 1e-3 (k3), clip 0.2, per-sequence loss averaging, rollout
#             temperature 1.0, 8192 new tokens, one pass over the data. App. B.5 gives no setting of the baseline
#             itself: Seed-GRPO's alpha (SEED_GRPO_ALPHA=0.5 here) and its modulation, linear 1 - x here
#             (the other forms are not implemented); SE uses cluster shares, not sequence probabilities.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper:
#             one node of 8 x A100-80G.
# Wall time   not in the paper for the baselines; about GRPO's (GeoAlign App. B.3, Trinity-RFT on 8 x A100:
#             20-22 h for 1.7B, 36-40 h for 4B) plus the answer checks
#             (one per ordered pair of a prompt's distinct answers); not measured here.
# Models      Qwen/Qwen3-1.7B | Qwen/Qwen3-4B
# Data        DAPO-Math-17k and the eval suite, rendered for MODEL with thinking off into
#             DATA_DIR/<model>_no-thinking/ by prepare_math_data.py on first use (as train_math_geoalign.sh).
# Outputs     SAVE_ROOT/qwen3-<size>_dapo_math_17k/grpo-seed-grpo<alpha>/seed<k>/ (final/, ckpt/, tensorboard/), beside
#             train_math_geoalign.sh's GRPO and GeoAlign runs.
#
# Usage       bash examples/scripts/train_math_seed_grpo.sh                     # 1.7B, clean rewards
#             NOISE_RATE=0.05 bash examples/scripts/train_math_seed_grpo.sh
#             SEED_GRPO_ALPHA=1.0 MODEL_SIZE=4B bash examples/scripts/train_math_seed_grpo.sh
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
SEED_GRPO_ALPHA=${SEED_GRPO_ALPHA:-0.5} # in [0, 1]: NOT in the text (see the header)

# Recipe, as train_math_geoalign.sh (geoalign_math_recipe)
geoalign_math_recipe

if ! awk -v a="$SEED_GRPO_ALPHA" 'BEGIN { exit !(a ~ /^[0-9]*[.]?[0-9]+$/ && a + 0 <= 1) }'; then
  die "SEED_GRPO_ALPHA must be a number in [0, 1] (got '$SEED_GRPO_ALPHA')"
fi
METHOD="grpo-seed-grpo$SEED_GRPO_ALPHA"
METHOD_ARGS=(--baseline.seed_grpo_alpha "$SEED_GRPO_ALPHA")
geoalign_math_run
