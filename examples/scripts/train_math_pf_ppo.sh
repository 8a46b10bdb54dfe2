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
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb
#             logging (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
PF_PPO_MODE=${PF_PPO_MODE:-br} # br: best-vs-random | bw: best-vs-worst
NOISE_RATE=${NOISE_RATE:-0}    # 0 | 0.05 | 0.1: fraction of each prompt's rollouts whose 0/1 reward is flipped
MODEL_SIZE=${MODEL_SIZE:-1.7B} # 1.7B | 4B
SEED=${SEED:-42}

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Recipe, as train_math_geoalign.sh. Paper: 16 rollouts, eval every 10 steps at T 1.0. Table 6 is not in the text:
# every other value is unchecked (see the header).
DATASET=dapo_math_17k
SAMPLES_PER_PROMPT=16
EVAL_STEPS=10
EVAL_TEMPERATURE=1.0
PROMPTS_PER_STEP=128 # unchecked
TRAIN_BATCH=1024     # unchecked: samples per optimizer step, 2 optimizer steps per rollout step
LR=1e-6              # unchecked
KL_COEF=1e-3         # unchecked: k3 estimator, as a loss term
EPS_CLIP=0.2         # unchecked
TEMPERATURE=1.0      # unchecked (rollout)
MAX_PROMPT_LEN=1024  # unchecked
MAX_NEW_TOKENS=8192  # unchecked
NUM_EPISODES=1       # unchecked

case "$MODEL_SIZE" in
  1.7B) MODEL=Qwen/Qwen3-1.7B ZERO_STAGE=2 ;;
  4B) MODEL=Qwen/Qwen3-4B ZERO_STAGE=3 ;;
  *) echo "MODEL_SIZE must be 1.7B or 4B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac
case "$PF_PPO_MODE" in
  br | bw) METHOD="grpo-pf-ppo-$PF_PPO_MODE"
     BASELINE_ARGS=(--baseline.curation "pf_ppo_$PF_PPO_MODE" --baseline.pf_ppo_keep_count) ;;
  *) echo "PF_PPO_MODE must be br or bw (got '$PF_PPO_MODE')" >&2 && exit 2 ;;
esac
case "$NOISE_RATE" in
  0) NOISE_ARGS=() ;;
  0.05 | 0.1)
    NOISE_ARGS=(--reward.noise.type flip --reward.noise.rate "$NOISE_RATE" --reward.noise.seed "$SEED")
    METHOD="${METHOD}_flip${NOISE_RATE}" ;;
  *) echo "NOISE_RATE must be 0, 0.05 or 0.1 (got '$NOISE_RATE')" >&2 && exit 2 ;;
esac

# Prompts rendered by this model's chat template with thinking off (see "Thinking" in the header).
PROMPT_DIR="$DATA_DIR/$(basename "$MODEL")_no-thinking"
if [[ ! -f "$PROMPT_DIR/$DATASET.jsonl" || ! -f "$PROMPT_DIR/geoalign_eval.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$PROMPT_DIR" --render-with "$MODEL" \
    --chat-template-kwargs '{"enable_thinking": false}' "$DATASET" geoalign_eval
fi

SETTING="qwen3-${MODEL_SIZE}_${DATASET}"
RUN_DIR="$SAVE_ROOT/$SETTING/$METHOD/seed$SEED"
RUN_NAME="${SETTING}_${METHOD}_seed${SEED}"
VLLM_TP=1
WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.group "${SETTING}_${METHOD}" --logger.wandb.run_name "$RUN_NAME")
fi
# Job level: working_dir + env_vars only. The fork's ray.init adds py_modules and upstream's env vars;
# Ray rejects a field or env var set at both levels. OPENRLHF_GEO_MATH_MODE=grpo: rewards 1 / 0 (App. B.3).
RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_MATH_MODE": "grpo"}}' "$REPO_DIR")

ENGINE_ARGS=(
  --actor.num_nodes "$NUM_NODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
  --ref.num_nodes "$NUM_NODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
  --vllm.num_engines $((NUM_NODES * GPUS_PER_NODE / VLLM_TP)) --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization 0.6 --vllm.sync_backend nccl --vllm.enforce_eager
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
  --ds.zero_stage "$ZERO_STAGE" --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --ds.packing_samples --train.dynamic_batch_enable
  --train.max_tokens_per_gpu 16384 --rollout.max_tokens_per_gpu 32768
)
DATA_ARGS=(
  --actor.model_name_or_path "$MODEL"
  --data.prompt_dataset "$PROMPT_DIR/$DATASET.jsonl" --data.input_key prompt_text --data.label_key answer
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
  --eval.dataset "$PROMPT_DIR/geoalign_eval.jsonl" --eval.steps "$EVAL_STEPS"
  --eval.temperature "$EVAL_TEMPERATURE" --eval.n_samples_per_prompt 1
)
ALGO_ARGS=(
  --rollout.batch_size "$PROMPTS_PER_STEP" --rollout.n_samples_per_prompt "$SAMPLES_PER_PROMPT"
  --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 8 --train.micro_batch_size 1
  --train.num_episodes "$NUM_EPISODES" --train.max_epochs 1 --train.seed "$SEED"
  --rollout.temperature "$TEMPERATURE"
  --actor.adam.lr "$LR" --actor.lr_scheduler constant_with_warmup --actor.lr_warmup_ratio 0.03
  --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean
  --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
  --algo.advantage.estimator group_norm
  "${BASELINE_ARGS[@]}" "${NOISE_ARGS[@]}"
)
LOG_ARGS=(
  --ckpt.output_dir "$RUN_DIR/final" --ckpt.path "$RUN_DIR/ckpt" --ckpt.save_hf
  --ckpt.save_steps 20 --ckpt.max_num 3 --ckpt.load_enable
  --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard" "${WANDB_ARGS[@]}"
)

echo "submitting $RUN_NAME to $RAY_ADDRESS (outputs in $RUN_DIR)"
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf_geo.cli train-ppo-ray \
  "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}"
