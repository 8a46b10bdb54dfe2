#!/usr/bin/env bash
# HH-RLHF step 1 of 2: SFT of Qwen3-1.7B-Base on HH-RLHF's chosen responses with upstream openrlhf.cli.train_sft
# (GeoAlign, arXiv 2606.26917, RLHF setting). Step 2: train_hh_rl.sh starts from this model.
#
# Reproduces  the SFT starting point of GeoAlign's HH-RLHF experiments: the policy learns HH's dialogue format
#             ("\n\nHuman: ...\n\nAssistant: ..."), which train_hh_rl.sh keeps as the RL prompt format and which
#             the ArmoRM reward parses back into chat turns.
# Recipe      NOT verified against the GeoAlign paper (not available when this script was written): one epoch over
#             the chosen responses, lr 1e-5, 128 sequences per step, 2048 tokens, packed.
# Hardware    one node, GPUS_PER_NODE GPUs (8 x 80 GB by default), launched with DeepSpeed as upstream's
#             train_sft.sh does: run it ON the GPU node (not through `ray job submit`).
# Wall time   rough estimate, not measured: 30-60 min on 8 x H100.
# Model       Qwen/Qwen3-1.7B-Base -> $SFT_RUN/final (SFT_RUN default: $SAVE_ROOT/qwen3-1.7b-base_hh_sft), the
#             default policy of train_hh_rl.sh
# Data        Dahoas/full-hh-rlhf (train split: prompt, chosen)
#
# Usage       bash examples/scripts/train_hh_sft.sh
# Edit        the variables below (or set them in the environment). SFT_RUN must be on a filesystem every Ray
#             node of step 2 sees. WANDB_API_KEY set -> wandb logging; TensorBoard logs are always written.
set -euo pipefail

# Paths and hardware
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
SFT_RUN=${SFT_RUN:-$SAVE_ROOT/qwen3-1.7b-base_hh_sft}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Recipe (NOT verified against the GeoAlign paper; see the header)
BASE_MODEL=Qwen/Qwen3-1.7B-Base
DATASET=Dahoas/full-hh-rlhf
LR=1e-5
BATCH=128
MAX_LEN=2048
EPOCHS=1

WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.run_name "$(basename "$SFT_RUN")")
fi

SFT_ARGS=(
  --model.model_name_or_path "$BASE_MODEL" --model.gradient_checkpointing_enable
  # The prompt already ends with "\n\nAssistant:"; '{}' keeps it verbatim (upstream's default template would
  # wrap it in "User: ...\nAssistant: ").
  --data.dataset "$DATASET" --data.input_key prompt --data.output_key chosen --data.input_template '{}'
  --data.max_len "$MAX_LEN"
  --train.batch_size "$BATCH" --train.micro_batch_size 4 --train.max_epochs "$EPOCHS"
  --adam.lr "$LR"
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2 --ds.packing_samples
  --ckpt.output_dir "$SFT_RUN/final" --ckpt.path "$SFT_RUN/ckpt" --ckpt.save_steps -1
  --logger.logging_steps 1 --logger.tensorboard_dir "$SFT_RUN/tensorboard" "${WANDB_ARGS[@]}"
)

echo "SFT of $BASE_MODEL on $DATASET -> $SFT_RUN/final"
deepspeed --num_gpus "$GPUS_PER_NODE" --module openrlhf.cli.train_sft "${SFT_ARGS[@]}"
