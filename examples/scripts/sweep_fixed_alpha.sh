#!/usr/bin/env bash
# Fixed-alpha sweep (SALT, arXiv 2606.05800, §4.3, Fig. 4(b), App. F.3.1): GRPO + SALT with the mixing coefficient
# held at alpha in {0, 0.25, 0.5, 0.75, 1} instead of SALT's adaptive alpha_t, DeepSeek-R1-Distill-Qwen-1.5B on
# MATH-TRAIN, then the ACC / Pass@8 evaluation.
#
# Reproduces  the fixed-alpha control a' = P_k a + alpha P_k^perp [a]_+ (App. F.3.1, "fixed-alpha"; Table 8's
#             "+ Fixed-alpha_t" row) swept over the values of Fig. 4(b), which plots accuracy against n_eff: every
#             run logs PR and n_eff. The adaptive reference is `SALT=1 bash examples/scripts/train_math_grpo.sh`
#             (its alpha_t is logged as salt/alpha), the baseline `bash examples/scripts/train_math_grpo.sh`: both
#             write next to these runs, so `openrlhf-geo report` compares all of them.
# Recipe      SALT Table 4 with GRPO, exactly as train_math_grpo.sh (see its header for the flag mapping): 8 rollouts
#             at T 0.6, LR 1e-6, KL loss 0.001, entropy 0, 1024 + 8192 tokens, 64 prompts per step, mini-batch 32
#             prompts (--train.batch_size 256), 2 epochs; only --salt.variant fixed-alpha --salt.alpha A differ
#             from SALT=1 there.
# Open        Fig. 4(b) names neither model nor dataset; Table 8 (the same ablations) uses the 1.5B model on
#             MATH-TRAIN, chosen here. Seeds as in App. H (2025-2029), one per invocation.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); the runs are submitted one after another (each
#             `ray job submit` waits for its job).
# Wall time   the paper's Table 11 gives 7:58 h for 1.5B + SALT on MATH-TRAIN (8 x H20, VeRL), not measured here;
#             5 runs + eval ~2 days on one node.
# Model       deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
# Data        MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval), AIME24 + AIME25 for validation; written to DATA_DIR
#             by prepare_math_data.py on first use. Eval benchmarks: DATA_DIR/benchmarks/ if present, else the hub.
# Outputs     SAVE_ROOT/r1-distill-qwen-1.5B_math_train/grpo-salt-alpha<A>/seed<k>/ (final/, ckpt/, tensorboard/,
#             eval summary.json); `openrlhf-geo report SAVE_ROOT/r1-distill-qwen-1.5B_math_train --baseline grpo`.
#
# Usage       bash examples/scripts/sweep_fixed_alpha.sh
#             ALPHAS="0.25 0.75" SEED=2026 bash examples/scripts/sweep_fixed_alpha.sh
# Edit        the switches and paths below (or set them in the environment). Needs a running Ray cluster with
#             `pip install "openrlhf-geo[openrlhf]"` on every node; DATA_DIR and SAVE_ROOT must be on a filesystem
#             every node sees. WANDB_API_KEY set -> wandb logging (the key travels in the job's command line);
#             TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
ALPHAS=${ALPHAS:-0 0.25 0.5 0.75 1} # Fig. 4(b)
SEED=${SEED:-2025}                  # the paper's seeds: 2025 2026 2027 2028 2029
EVAL=${EVAL:-1}                     # 1: evaluate each final model

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# GRPO recipe: SALT Table 4 (as train_math_grpo.sh)
MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
DATASET=math_train
SAMPLES_PER_PROMPT=8
PROMPTS_PER_STEP=64
TRAIN_BATCH=256
LR=1e-6
KL_COEF=0.001
ENTROPY_COEF=0
EPS_CLIP=0.2
TEMPERATURE=0.6
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=8192
NUM_EPISODES=2
EVAL_STEPS=10
EVAL_SAMPLES=8

case "$EVAL" in
  0 | 1) ;;
  *) echo "EVAL must be 0 or 1 (got '$EVAL')" >&2 && exit 2 ;;
esac
for ALPHA in $ALPHAS; do
  if ! [[ "$ALPHA" =~ ^(0|1|0?\.[0-9]+|1\.0*)$ ]]; then
    echo "ALPHAS must hold numbers in [0, 1] (got '$ALPHA')" >&2 && exit 2
  fi
done

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" || ! -f "$DATA_DIR/aime25.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24 aime25
fi

SETTING="r1-distill-qwen-1.5B_${DATASET}"
VLLM_TP=1
# Job level: working_dir + env_vars only (the fork's ray.init adds the rest). Rewards 1 / 0 (App. C.2).
RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_MATH_MODE": "grpo"}}' "$REPO_DIR")
ENGINE_ARGS=(
  --actor.num_nodes "$NUM_NODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
  --ref.num_nodes "$NUM_NODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
  --vllm.num_engines $((NUM_NODES * GPUS_PER_NODE / VLLM_TP)) --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization 0.6 --vllm.sync_backend nccl --vllm.enforce_eager
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
  --ds.zero_stage 2 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --ds.packing_samples --train.dynamic_batch_enable
  --train.max_tokens_per_gpu 16384 --rollout.max_tokens_per_gpu 32768
)
RECIPE_ARGS=(
  --actor.model_name_or_path "$MODEL"
  --data.prompt_dataset "$DATA_DIR/$DATASET.jsonl" --data.input_key prompt --data.label_key answer
  --data.apply_chat_template
  --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
  --eval.dataset "$DATA_DIR/aime24.jsonl,$DATA_DIR/aime25.jsonl" --eval.steps "$EVAL_STEPS"
  --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt "$EVAL_SAMPLES"
  --rollout.batch_size "$PROMPTS_PER_STEP" --rollout.n_samples_per_prompt "$SAMPLES_PER_PROMPT"
  --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 8 --train.micro_batch_size 1
  --train.num_episodes "$NUM_EPISODES" --train.max_epochs 1 --train.seed "$SEED"
  --rollout.temperature "$TEMPERATURE"
  --actor.adam.lr "$LR" --actor.lr_scheduler constant --actor.lr_warmup_ratio 0
  --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean --actor.entropy_coef "$ENTROPY_COEF"
  --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
  --algo.advantage.estimator salt --salt.base group_norm
)

FAILED=()
for ALPHA in $ALPHAS; do
  METHOD="grpo-salt-alpha$ALPHA"
  RUN_DIR="$SAVE_ROOT/$SETTING/$METHOD/seed$SEED"
  RUN_NAME="${SETTING}_${METHOD}_seed${SEED}"
  WANDB_ARGS=()
  if [[ -n "${WANDB_API_KEY:-}" ]]; then
    WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
      --logger.wandb.group "${SETTING}_${METHOD}" --logger.wandb.run_name "$RUN_NAME")
  fi
  RUN_ARGS=(
    --salt.variant fixed-alpha --salt.alpha "$ALPHA"
    --ckpt.output_dir "$RUN_DIR/final" --ckpt.path "$RUN_DIR/ckpt" --ckpt.save_hf
    --ckpt.save_steps 20 --ckpt.max_num 3 --ckpt.load_enable
    --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard" "${WANDB_ARGS[@]}"
  )
  EVAL_ARGS=(
    --model "$RUN_DIR/final" --benchmarks aime24,aime25,gsm8k,math500,gpqa_diamond
    --n "$EVAL_SAMPLES" --k 1 "$EVAL_SAMPLES" --temperature "$TEMPERATURE" --top-p 1.0
    --max-new-tokens "$MAX_NEW_TOKENS" --seed "$SEED" --backend vllm
    --data-dir "$DATA_DIR/benchmarks" --from-hub --output-dir "$RUN_DIR"
  )
  echo "submitting $RUN_NAME (outputs in $RUN_DIR)"
  # A failed run is reported at the end; the sweep goes on.
  if ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
    -- python3 -m openrlhf_geo.cli train-ppo-ray "${ENGINE_ARGS[@]}" "${RECIPE_ARGS[@]}" "${RUN_ARGS[@]}"; then
    if [[ "$EVAL" == 1 ]]; then
      ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" --entrypoint-num-gpus=1 \
        -- python3 -m openrlhf_geo.cli eval "${EVAL_ARGS[@]}" || FAILED+=("$RUN_NAME (eval)")
    fi
  else
    FAILED+=("$RUN_NAME")
  fi
done
if ((${#FAILED[@]})); then
  printf 'failed runs:\n' >&2 && printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
