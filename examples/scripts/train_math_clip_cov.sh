#!/usr/bin/env bash
# GRPO + Clip-Cov on DeepSeek-R1-Distill-Qwen-1.5B / -7B, then Pass@1 / Pass@8: one of SALT's entropy-control
# baselines (SALT, arXiv 2606.05800, §4.2, App. I, Table 4; Clip-Cov: Cui et al., arXiv 2505.22617).
#
# Reproduces  the Clip-Cov arm of SALT §4.2 / Fig. 3: train_math_grpo.sh's GRPO recipe with PPO's per-token
#             surrogate replaced by Clip-Cov (--baseline.policy_loss clip_cov): of the tokens whose centred
#             log-prob x advantage covariance lies in [1, 5], a random 0.02 % lose their gradient; the rest keep
#             GRPO's clipped surrogate.
#             SALT's geometry (PR, n_eff) is logged as for the GRPO baseline (--salt.diagnostics; Fig. 3 plots it
#             for these baselines); the advantages are GRPO's. Then (EVAL=1) `openrlhf-geo eval` on the final
#             model: ACC (= Pass@1) and Pass@8 from 8 samples at T = 0.6 on AIME24, AIME25, GSM8K, MATH-500 and
#             GPQA-Diamond (§4.1, App. D.2). Run once per SEED (2025-2029, App. H).
# Recipe      SALT Table 4 (App. C.1): the shared block exactly as train_math_grpo.sh (its header maps each value
#             to its flag: 8 rollouts at T = 0.6, LR 1e-6, KL loss 0.001, 64 prompts per step, mini-batch 32
#             prompts = 256 samples, 2 epochs, 8192 new tokens, per-sequence loss averaging per Eq. 3), plus
#             its Clip-Covariance block:
#               Clip covariance ratio 0.0002 ....... --baseline.clip_cov_ratio 2e-4
#               Clip covariance lb 1.0, ub 5.0 ..... --baseline.clip_cov_lb 1.0 --baseline.clip_cov_ub 5.0
#               Clip ratio (Low) 1, (High) 1 ....... --actor.eps_clip_low_high 1 1 (the ratio is clipped to [0, 2])
# Open        As train_math_grpo.sh: KL estimator k3, constant LR, in-training validation every 10 steps on
#             AIME24 + AIME25, OpenRLHF's optimizer defaults.
#             Clip-Cov's covariance, candidates and token draw are per micro-batch (one call of the loss: up to
#             16,384 tokens with --train.dynamic_batch_enable), at least one token, as in the authors' released
#             loss (the paper's text does not say); the draw is seeded by --train.seed + the DeepSpeed rank.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); actor, reference and vLLM colocated. The paper
#             used one node of 8 x H20.
# Wall time   the paper gives none for the baselines; only the per-token loss changes (no extra forward),
#             so about GRPO's (SALT Table 11, 8 x H20: 1.5B 7:21 h on MATH-TRAIN / 15:41 h on DAPO-MATH, 7B
#             24:07 / 61:26); not measured here. Eval: 1-4 h on one GPU (estimate).
# Models      deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B | deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
# Data        MATH-TRAIN or DAPO-MATH, AIME24 + AIME25 for validation, written to DATA_DIR by prepare_math_data.py on
#             first use (as train_math_grpo.sh).
# Outputs     SAVE_ROOT/r1-distill-qwen-<size>_<dataset>/grpo-clip-cov/seed<k>/ with final/ (HF model), ckpt/,
#             tensorboard/, summary.json and <benchmark>.jsonl (eval), beside train_math_grpo.sh's runs, so
#             `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-<size>_<dataset> --baseline grpo` compares them with
#             GRPO and SALT.
#
# Usage       bash examples/scripts/train_math_clip_cov.sh     # 1.5B, MATH-TRAIN, seed 2025
#             for s in 2025 2026 2027 2028 2029; do SEED=$s bash examples/scripts/train_math_clip_cov.sh; done
#             MODEL_SIZE=7B DATASET=dapo_math_17k bash examples/scripts/train_math_clip_cov.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster (`ray start --head` on the head node, `ray start
#             --address=HEAD:6379` on the others) with `pip install "openrlhf-geo[openrlhf]"` on every node;
#             DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb logging
#             (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
MODEL_SIZE=${MODEL_SIZE:-1.5B} # 1.5B | 7B
DATASET=${DATASET:-math_train} # math_train | dapo_math_17k
SEED=${SEED:-2025}             # the paper's seeds: 2025 2026 2027 2028 2029
EVAL=${EVAL:-1}                # 1: evaluate the final model after training

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# GRPO recipe: SALT Table 4's shared block (as train_math_grpo.sh)
SAMPLES_PER_PROMPT=8
PROMPTS_PER_STEP=64 # "Train batch size 64"
TRAIN_BATCH=256     # "Mini-Batch Size 32" prompts x 8 samples
LR=1e-6
KL_COEF=0.001
TEMPERATURE=0.6
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=8192
NUM_EPISODES=2 # "Training epochs 2"
EVAL_STEPS=10
EVAL_SAMPLES=8

# Clip-Cov: SALT Table 4's Clip-Covariance block
CLIP_COV_RATIO=2e-4
CLIP_COV_LB=1.0
CLIP_COV_UB=5.0
EPS_CLIP_LOW=1  # "Clip ratio (Low) 1"
EPS_CLIP_HIGH=1 # "Clip ratio (High) 1"
ENTROPY_COEF=0 # shared block: no entropy loss; entropy is logged

case "$MODEL_SIZE" in
  1.5B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B ZERO_STAGE=2 ;;
  7B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B ZERO_STAGE=3 ;;
  *) echo "MODEL_SIZE must be 1.5B or 7B (got '$MODEL_SIZE')" >&2 && exit 2 ;;
esac
case "$DATASET" in
  math_train | dapo_math_17k) ;;
  *) echo "DATASET must be math_train or dapo_math_17k (got '$DATASET')" >&2 && exit 2 ;;
esac
case "$EVAL" in
  0 | 1) ;;
  *) echo "EVAL must be 0 or 1 (got '$EVAL')" >&2 && exit 2 ;;
esac

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" || ! -f "$DATA_DIR/aime25.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24 aime25
fi

METHOD=grpo-clip-cov
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
# Ray rejects a field or env var set at both levels. OPENRLHF_GEO_MATH_MODE=grpo: rewards 1 / 0 (App. C.2).
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
  --actor.loss_agg_mode seq-mean-token-mean
  --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
  --algo.advantage.estimator group_norm --salt.diagnostics
  --actor.eps_clip_low_high "$EPS_CLIP_LOW" "$EPS_CLIP_HIGH" --actor.entropy_coef "$ENTROPY_COEF"
  --baseline.policy_loss clip_cov --baseline.clip_cov_ratio "$CLIP_COV_RATIO"
  --baseline.clip_cov_lb "$CLIP_COV_LB" --baseline.clip_cov_ub "$CLIP_COV_UB"
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
