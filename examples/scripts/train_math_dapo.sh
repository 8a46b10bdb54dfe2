#!/usr/bin/env bash
# DAPO vs DAPO + SALT on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8 (SALT, arXiv 2606.05800).
#
# Reproduces  SALT's DAPO rows of Table 2 (§4.1): 2 epochs on DAPO-MATH or MATH-TRAIN, math-verify reward +1 correct
#             / -1 otherwise without overlong shaping (App. C.2), clip-higher, token-level loss and dynamic sampling
#             (Eq. 69). SALT=1 reweights the group-normalized advantages with SALT and changes nothing else; SALT=0
#             logs the same SALT geometry without touching the advantages. Then (EVAL=1) `openrlhf-geo eval`: ACC
#             (= Pass@1) and Pass@8 from 8 samples at T = 0.6 on AIME24, AIME25, GSM8K, MATH-500, GPQA-Diamond
#             (§4.1, App. D.2). The paper averages seeds 2025-2029 (App. H): run once per SEED.
# Recipe      SALT Table 4 (App. C.1), on OpenRLHF 0.11.2 (VeRL batch sizes count PROMPTS; 0.11.2's
#             --rollout.batch_size counts prompts, --train.batch_size SAMPLES):
#               Rollout samples per prompt 8 ....... --rollout.n_samples_per_prompt 8
#               Rollout temperature 0.6 ............ --rollout.temperature 0.6 (top-p 1, not in the table)
#               Learning rate 1e-6 ................. --actor.adam.lr 1e-6
#               Validation temperature 0.6 ......... --eval.temperature 0.6 and `eval --temperature 0.6`, 8 samples
#               Entropy coefficient 0 .............. --actor.entropy_coef 0 (no entropy loss; entropy is logged)
#               KL loss coefficient 0.001 .......... --algo.kl.use_loss --algo.kl.init_coef 0.001: Table 4 lists it
#                                                     for all runs and the DAPO block does not override it (Eq. 69,
#                                                     DAPO's own objective, has no KL term: KL_COEF=0 for that)
#               Prompt length 1024 ................. --data.max_len 9216 (prompt + response); no prompt cap
#               Response length 8192 ............... --rollout.max_new_tokens 8192
#               Train batch size 64 (prompts) ...... --rollout.batch_size 64 (groups kept after filtering)
#               Mini-batch size 32 (prompts) ....... --train.batch_size 256 (= 32 x 8 samples): 2 optimizer steps
#                                                     per rollout step; SALT's Gram is per mini-batch (default)
#               Training epochs 2 .................. --train.num_episodes 2 (1 PPO epoch per batch)
#               Filter groups enable True .......... --algo.dynamic_filtering_enable --algo.dynamic_filtering_range
#                                                     0 1: a group is kept iff 0 < mean 0/1 score < 1 (Eq. 69)
#               Clip ratio low 0.2 / high 0.28 ..... --actor.eps_clip_low_high 0.2 0.28
#             and token-level loss (Eq. 69) ........ --actor.loss_agg_mode token-mean
# Differs     "Generation batch size 128": VeRL samples 128 prompts at a time and keeps 64 surviving groups, dropping
#             the surplus; 0.11.2 samples --rollout.batch_size 64 prompts and replaces each filtered-out prompt by
#             one new prompt until 64 groups survive (a larger --rollout.vllm_generate_batch_size needs
#             --train.async_enable, i.e. off-policy async training). The trained batch is the same; 0.11.2 uses
#             fewer prompts per step, so an epoch has more steps than VeRL's.
#             "Max numbers of generation batches 10": no such cap in 0.11.2: it refills until 64 groups survive or
#             the epoch's prompts run out (VeRL stops with an error after 10 x 128 prompts).
#             The in-training eval logs the mean REWARD: eval_*_pass1 = 2 x accuracy - 1 with +-1 rewards (the
#             `openrlhf-geo eval` step reports accuracy).
# Open        Not in the text; VeRL's defaults: KL estimator k3 (low_var_kl), constant LR without warmup, in-training
#             validation every EVAL_STEPS=10 steps on AIME24 + AIME25. OpenRLHF's defaults: AdamW betas (0.9, 0.95),
#             no weight decay, gradient clip 1.0. No prompt-length cap in 0.11.2 (MATH/DAPO prompts are far shorter).
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper's Table 11 (8 x H20, VeRL), not measured here: 1.5B DAPO 7:17 h (MATH-TRAIN) / 16:01 h
#             (DAPO-MATH), + SALT 8:05 / 17:58; 7B DAPO 24:31 / 62:23, + SALT 25:58 / 66:04. Eval: 1-4 h on one GPU
#             (rough estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        DAPO-MATH (BytedTsinghua-SIA/DAPO-Math-17k, deduplicated, its "Answer:" instruction replaced by the
#             boxed-answer one) or MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval), AIME24 + AIME25 for validation;
#             written to DATA_DIR by prepare_math_data.py on first use. Eval benchmarks: DATA_DIR/benchmarks/ if
#             present, else the hub (GPQA-Diamond is gated: accept its terms and log in on the eval node).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/<method>/seed<k>/ (final/, ckpt/, tensorboard/, eval
#             summary.json); `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_<dataset> --baseline dapo`.
#
# Usage       bash examples/scripts/train_math_dapo.sh                        # DAPO, 1.5B, DAPO-MATH, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SALT=1 SEED=$s bash examples/scripts/train_math_dapo.sh; done
#             SALT=1 MODEL_SIZE=7B DATASET=math_train bash examples/scripts/train_math_dapo.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb
#             logging (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
SALT=${SALT:-0}                   # 1: --algo.advantage.estimator salt (group_norm reweighted by SALT)
MODEL_SIZE=${MODEL_SIZE:-1.5B}    # 1.5B | 7B
DATASET=${DATASET:-dapo_math_17k} # dapo_math_17k | math_train
SEED=${SEED:-2025}                # the paper's seeds: 2025 2026 2027 2028 2029
EVAL=${EVAL:-1}                   # 1: evaluate the final model after training

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# DAPO recipe: SALT Table 4 (see the header for the mapping)
SAMPLES_PER_PROMPT=8
PROMPTS_PER_STEP=64 # "Train batch size 64": groups kept after dynamic filtering
TRAIN_BATCH=256     # "Mini-Batch Size 32" prompts x 8 samples
LR=1e-6
KL_COEF=0.001
ENTROPY_COEF=0
EPS_CLIP_LOW=0.2
EPS_CLIP_HIGH=0.28
TEMPERATURE=0.6
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=8192
NUM_EPISODES=2 # "Training epochs 2"
EVAL_STEPS=10
EVAL_SAMPLES=8

case "$MODEL_SIZE" in
  1.5B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B ZERO_STAGE=2 ;;
  7B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B ZERO_STAGE=3 ;;
  *) echo "MODEL_SIZE must be 1.5B or 7B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac
case "$DATASET" in
  math_train | dapo_math_17k) ;;
  *) echo "DATASET must be math_train or dapo_math_17k (got '$DATASET')" >&2 && exit 2 ;;
esac
case "$SALT" in
  0) METHOD=dapo ESTIMATOR_ARGS=(--algo.advantage.estimator group_norm --salt.diagnostics) ;;
  1) METHOD=dapo-salt ESTIMATOR_ARGS=(--algo.advantage.estimator salt --salt.base group_norm --salt.variant full) ;;
  *) echo "SALT must be 0 or 1 (got '$SALT')" >&2 && exit 2 ;;
esac
case "$EVAL" in
  0 | 1) ;;
  *) echo "EVAL must be 0 or 1 (got '$EVAL')" >&2 && exit 2 ;;
esac

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" || ! -f "$DATA_DIR/aime25.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24 aime25
fi

SETTING="r1-distill-qwen-${MODEL_SIZE}_${DATASET}"
RUN_DIR="$SAVE_ROOT/$SETTING/$METHOD/seed$SEED"
RUN_NAME="${SETTING}_${METHOD}_seed${SEED}"
VLLM_TP=1
WANDB_ARGS=()
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.group "${SETTING}_${METHOD}" --logger.wandb.run_name "$RUN_NAME")
fi
# Job level: working_dir + env_vars only. The fork's ray.init adds py_modules and upstream's env vars;
# Ray rejects a field or env var set at both levels.
# OPENRLHF_GEO_MATH_MODE=dapo: +1 / -1 rewards (App. C.2); the reward's `scores` stay 0/1 for dynamic filtering.
RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_MATH_MODE": "dapo"}}' "$REPO_DIR")

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
  --data.prompt_dataset "$DATA_DIR/$DATASET.jsonl" --data.input_key prompt --data.label_key answer
  --data.apply_chat_template
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
  --eval.dataset "$DATA_DIR/aime24.jsonl,$DATA_DIR/aime25.jsonl" --eval.steps "$EVAL_STEPS"
  --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt "$EVAL_SAMPLES"
)
ALGO_ARGS=(
  --rollout.batch_size "$PROMPTS_PER_STEP" --rollout.n_samples_per_prompt "$SAMPLES_PER_PROMPT"
  --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 8 --train.micro_batch_size 1
  --train.num_episodes "$NUM_EPISODES" --train.max_epochs 1 --train.seed "$SEED"
  --rollout.temperature "$TEMPERATURE"
  --actor.adam.lr "$LR" --actor.lr_scheduler constant --actor.lr_warmup_ratio 0
  --actor.eps_clip_low_high "$EPS_CLIP_LOW" "$EPS_CLIP_HIGH" --actor.loss_agg_mode token-mean
  --actor.entropy_coef "$ENTROPY_COEF"
  --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
  --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
  "${ESTIMATOR_ARGS[@]}"
)
LOG_ARGS=(
  --ckpt.output_dir "$RUN_DIR/final" --ckpt.path "$RUN_DIR/ckpt" --ckpt.save_hf
  --ckpt.save_steps 20 --ckpt.max_num 3 --ckpt.load_enable
  --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard" "${WANDB_ARGS[@]}"
)
# Evaluation (§4.1, App. D.2): 8 samples per problem at T = 0.6 with 8192 new tokens -> avg@8 = pass@1, pass@8.
EVAL_ARGS=(
  --model "$RUN_DIR/final" --benchmarks aime24,aime25,gsm8k,math500,gpqa_diamond
  --n "$EVAL_SAMPLES" --k 1 "$EVAL_SAMPLES" --temperature "$TEMPERATURE" --top-p 1.0
  --max-new-tokens "$MAX_NEW_TOKENS" --seed "$SEED" --backend vllm
  --data-dir "$DATA_DIR/benchmarks" --from-hub --output-dir "$RUN_DIR"
)

echo "submitting $RUN_NAME to $RAY_ADDRESS (outputs in $RUN_DIR)"
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf_geo.cli train-ppo-ray \
  "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}"
if [[ "$EVAL" == 1 ]]; then
  echo "evaluating $RUN_DIR/final"
  ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" --entrypoint-num-gpus=1 \
    -- python3 -m openrlhf_geo.cli eval "${EVAL_ARGS[@]}"
fi
