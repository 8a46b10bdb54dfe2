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
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb
#             logging (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
GEOALIGN=${GEOALIGN:-0}        # 1: --geoalign.enable --geoalign.preset math
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

# Recipe. From the paper: 16 rollouts, alpha 0.05, eval every 10 steps at T 1.0. Table 6 is not in the text:
# every other value is unchecked (see the header).
DATASET=dapo_math_17k
SAMPLES_PER_PROMPT=16
GEOALIGN_ALPHA=0.05
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
case "$GEOALIGN" in
  0) METHOD=grpo GEOALIGN_ARGS=() ;;
  1) METHOD=grpo-geoalign
     GEOALIGN_ARGS=(--geoalign.enable --geoalign.preset math --geoalign.alpha "$GEOALIGN_ALPHA") ;;
  *) echo "GEOALIGN must be 0 or 1 (got '$GEOALIGN')" >&2 && exit 2 ;;
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
  "${GEOALIGN_ARGS[@]}" "${NOISE_ARGS[@]}"
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
