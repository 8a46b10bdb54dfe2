#!/usr/bin/env bash
# GRPO + PF-PPO rollout filtration (best-vs-random / best-vs-worst): math RLVR on Qwen3-1.7B / 4B, DAPO-Math-17k,
# optional reward flips; a GeoAlign baseline (GeoAlign, arXiv 2606.26917, §5.1, App. B.5; PF-PPO: Zhang et al.,
# arXiv 2409.06957).
#
# Reproduces  the PF-PPO BR / BW rows of GeoAlign's math comparison (Table 1, per benchmark Tables 13-14) and,
#             with NOISE_RATE=0.05 | 0.1, of its reward-flip comparison (Table 3): per prompt, train on the
#             best-rewarded rollout and one partner, a uniformly drawn other one (PF_PPO_MODE=br) or the worst
#             (bw); reward ties are broken at random (--baseline.curation pf_ppo_br | pf_ppo_bw).
# Fork        OpenRLHF's fixed groups cannot drop rollouts, so --baseline.pf_ppo_keep_count refills the 16 slots:
#             the best fills 8 and the partner 8. For an even G the group mean and std, hence GRPO's advantages,
#             are the pair's, and under per-sequence loss averaging the loss is the pair's times a constant per
#             prompt (Adam is invariant to it, up to gradient clipping and its epsilon). Dropping PF-PPO runs on
#             the local engine (`openrlhf-geo train --baseline.curation pf_ppo_br`).
# Recipe      As train_math_geoalign.sh (GeoAlign §5.1, App. B.1-B.4): Qwen3-1.7B / 4B instruction-tuned with
#             thinking off, DAPO-Math-17k, GRPO, 16 rollouts, 1/0 math-verify reward, in-training eval every 10 steps
#             at T = 1.0 on the six benchmarks. NOT in the text (Table 6, "key hyperparameters for SFT and RL",
#             survives only as its caption), so unchecked, as there: LR 1e-6 (3 % warmup), 128 prompts per step,
#             1024 samples per optimizer step, KL loss 1e-3 (k3), clip 0.2, per-sequence loss averaging, rollout
#             temperature 1.0, 8192 new tokens, one pass over the data. App. B.5 gives no setting of the baseline
#             itself. PF-PPO's own method text is not in GeoAlign; the filtration follows its App. B.5.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper:
#             one node of 8 x A100-80G.
# Wall time   not in the paper for the baselines; about GRPO's (GeoAlign App. B.3, Trinity-RFT on 8 x A100:
#             20-22 h for 1.7B, 36-40 h for 4B) plus a sort of each prompt's rewards; not measured here.
# Models      Qwen/Qwen3-1.7B | Qwen/Qwen3-4B
# Data        DAPO-Math-17k and the eval suite, rendered for MODEL with thinking off into
#             DATA_DIR/<model>_no-thinking/ by prepare_math_data.py on first use (as train_math_geoalign.sh).
# Outputs     SAVE_ROOT/qwen3-<size>_dapo_math_17k/grpo-pf-ppo-<mode>/seed<k>/ (final/, ckpt/, tensorboard/), beside
#             train_math_geoalign.sh's GRPO and GeoAlign runs.
#
# Usage       bash examples/scripts/train_math_pf_ppo.sh                        # best-vs-random, 1.7B, clean
#             PF_PPO_MODE=bw NOISE_RATE=0.1 bash examples/scripts/train_math_pf_ppo.sh
#             PF_PPO_MODE=bw MODEL_SIZE=4B bash examples/scripts/train_math_pf_ppo.sh
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
PF_PPO_MODE=${PF_PPO_MODE:-br} # br: best-vs-random | bw: best-vs-worst

# Recipe, as train_math_geoalign.sh (geoalign_math_recipe)
geoalign_math_recipe

case "$PF_PPO_MODE" in
  br | bw) METHOD="grpo-pf-ppo-$PF_PPO_MODE"
     METHOD_ARGS=(--baseline.curation "pf_ppo_$PF_PPO_MODE" --baseline.pf_ppo_keep_count) ;;
  *) die "PF_PPO_MODE must be br or bw (got '$PF_PPO_MODE')" ;;
esac
geoalign_math_run
