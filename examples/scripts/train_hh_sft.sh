#!/usr/bin/env bash
# HH-RLHF step 1 of 2: SFT of Qwen3-1.7B-Base / Qwen3-4B-Base on HH-RLHF's chosen responses with upstream
# openrlhf.cli.train_sft (GeoAlign, arXiv 2606.26917, App. B.1, B.3). Step 2: train_hh_rl.sh starts from this model.
#
# Reproduces  the SFT stage of GeoAlign's RLHF pipeline ("the base Qwen3 models (1.7B-Base and 4B-Base) undergo
#             supervised fine-tuning on the HH-RLHF dataset", App. B.3) on the SFT part of HH-RLHF: 144,716
#             samples in the paper, disjoint from the 17,226 RL prompts (App. B.1). prepare_hh_data.py draws the
#             17,226 RL prompts first and keeps the SFT rows whose prompt is not among them (HH-RLHF's train split
#             has 160,800 rows, so the SFT set comes out somewhat smaller than 144,716; the counts are printed).
#             The policy learns HH's dialogue format ("\n\nHuman: ...\n\nAssistant: ..."), which train_hh_rl.sh
#             keeps as the RL prompt format ("we use the conversation from the dataset directly as the input
#             prompt", App. B.3) and which the ArmoRM reward parses back into chat turns. No chat template is
#             applied, so Qwen3's thinking mode (enable_thinking, App. B.3) does not arise.
# Recipe      NOT in the text (Table 6 survives only as its caption), so these cannot be checked: one epoch, LR 1e-5,
#             128 sequences per step, 2048 tokens, packed.
# Hardware    one node, GPUS_PER_NODE GPUs (8 x 80 GB by default), launched with DeepSpeed as upstream's
#             train_sft.sh does: run it ON the GPU node (not through `ray job submit`).
# Wall time   the paper (App. B.3, 8 x A100): SFT + RL 12-13 h for 1.7B, 16-17 h for 4B; not measured here.
# Models      Qwen/Qwen3-1.7B-Base | Qwen/Qwen3-4B-Base -> $SFT_RUN/final (SFT_RUN default:
#             $SAVE_ROOT/qwen3-<size>-base_hh_sft), the default policy of train_hh_rl.sh for the same MODEL_SIZE
# Data        Anthropic/hh-rlhf (train split), split by prepare_hh_data.py into DATA_DIR/hh/ on first use
#
# Usage       bash examples/scripts/train_hh_sft.sh && bash examples/scripts/train_hh_rl.sh
#             MODEL_SIZE=4B bash examples/scripts/train_hh_sft.sh
# Edit        the variables below (or set them in the environment). DATA_DIR and SFT_RUN must be on a filesystem
#             every Ray node of step 2 sees. WANDB_API_KEY set -> wandb logging; TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Switches, paths and hardware
MODEL_SIZE=${MODEL_SIZE:-1.7B} # 1.7B | 4B
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

case "$MODEL_SIZE" in
  1.7B | 4B) BASE_MODEL="Qwen/Qwen3-$MODEL_SIZE-Base" ;;
  *) echo "MODEL_SIZE must be 1.7B or 4B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac
SFT_RUN=${SFT_RUN:-$SAVE_ROOT/qwen3-${MODEL_SIZE,,}-base_hh_sft}

# Recipe (NOT in the text; see the header)
LR=1e-5
BATCH=128
MAX_LEN=2048
EPOCHS=1

HH_DIR="$DATA_DIR/hh"
if [[ ! -f "$HH_DIR/hh_sft.jsonl" || ! -f "$HH_DIR/hh_rl.jsonl" || ! -f "$HH_DIR/hh_test.jsonl" ]]; then
  python3 "$SCRIPT_DIR/prepare_hh_data.py" --out "$HH_DIR"
fi

WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.run_name "$(basename "$SFT_RUN")")
fi

SFT_ARGS=(
  --model.model_name_or_path "$BASE_MODEL" --model.gradient_checkpointing_enable
  # The prompt already ends with "\n\nAssistant:"; '{}' keeps it verbatim (upstream's default template would
  # wrap it in "User: ...\nAssistant: ").
  --data.dataset "$HH_DIR/hh_sft.jsonl" --data.input_key prompt --data.output_key chosen --data.input_template '{}'
  --data.max_len "$MAX_LEN"
  --train.batch_size "$BATCH" --train.micro_batch_size 4 --train.max_epochs "$EPOCHS"
  --adam.lr "$LR"
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2 --ds.packing_samples
  --ckpt.output_dir "$SFT_RUN/final" --ckpt.path "$SFT_RUN/ckpt" --ckpt.save_steps -1
  --logger.logging_steps 1 --logger.tensorboard_dir "$SFT_RUN/tensorboard" "${WANDB_ARGS[@]}"
)

echo "SFT of $BASE_MODEL on $HH_DIR/hh_sft.jsonl -> $SFT_RUN/final"
deepspeed --num_gpus "$GPUS_PER_NODE" --module openrlhf.cli.train_sft "${SFT_ARGS[@]}"
