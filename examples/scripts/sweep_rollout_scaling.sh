#!/usr/bin/env bash
# Rollout-scaling sweep: GRPO vs GRPO + SALT for G in {2, 4, ..., 256} rollouts per prompt at a FIXED rollout
# budget (prompts per step x G = BUDGET), DeepSeek-R1-Distill-Qwen-1.5B on MATH train (SALT, arXiv 2606.05800).
#
# Reproduces  the rollout-scaling question SALT raises (do more rollouts per prompt help under group
#             normalization, at equal cost?): every run makes STEPS rollout steps of BUDGET rollouts each (the same
#             total rollouts, optimizer steps and LR schedule for every G), from a pool of POOL prompts; small G
#             revisits the pool over several episodes, large G uses its first BUDGET * STEPS / G prompts once.
# Recipe      NOT verified against SALT Table 4 (not available when this script was written): the GRPO recipe of
#             train_math_grpo.sh with responses capped at 4096 tokens (8192 there) to keep 16 runs affordable;
#             SALT with the fork's defaults. Check them against the paper before quoting results as its.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); the runs are submitted one after another
#             (each `ray job submit` waits for its job).
# Wall time   rough estimate from token counts, not measured: ~2-3 min per rollout step on one node, 64 steps
#             = 2-3 h per run, 16 runs = 1.5-2 days. Run subsets with G_LIST / METHODS, or several clusters.
# Model       deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
# Data        MATH train (DigitalLearningGmbH/MATH-lighteval), AIME 2024 for in-training eval; written to DATA_DIR
#             by prepare_math_data.py on first use.
#
# Usage       bash examples/scripts/sweep_rollout_scaling.sh
#             G_LIST="8 64" METHODS=salt SEED=1 bash examples/scripts/sweep_rollout_scaling.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb
#             logging (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
G_LIST=${G_LIST:-2 4 8 16 32 64 128 256} # rollouts per prompt
METHODS=${METHODS:-grpo salt}
SEED=${SEED:-42}

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Fixed budget: every run = STEPS rollout steps x BUDGET rollouts (BUDGET, STEPS, POOL: powers of two)
BUDGET=2048     # rollouts per rollout step = prompts per step x G
STEPS=64        # rollout steps per run
POOL=4096       # distinct prompts available (the first POOL of MATH train; it has 7500)
TRAIN_BATCH=1024 # rollouts per optimizer step: 2 optimizer steps per rollout step

# GRPO recipe (NOT verified against SALT Table 4; see the header)
MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
DATASET=math_train
LR=1e-6
KL_COEF=1e-3 # k3 estimator, as a loss term
EPS_CLIP=0.2
TEMPERATURE=0.6
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=4096
EVAL_STEPS=16

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24
fi

VLLM_TP=1
# Job level: working_dir + env_vars only. The fork's ray.init adds py_modules and upstream's env vars;
# Ray rejects a field or env var set at both levels.
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

FAILED=()
for G in $G_LIST; do
  PROMPTS=$((BUDGET / G))
  VISITS=$((BUDGET * STEPS / G)) # prompt visits per run
  if ((G < 2 || PROMPTS * G != BUDGET || (VISITS > POOL && VISITS % POOL != 0))); then
    echo "G=$G does not split BUDGET=$BUDGET x STEPS=$STEPS over POOL=$POOL evenly (use powers of two >= 2)" >&2
    exit 2
  fi
  if ((VISITS > POOL)); then
    MAX_SAMPLES=$POOL EPISODES=$((VISITS / POOL))
  else
    MAX_SAMPLES=$VISITS EPISODES=1
  fi
  for METHOD in $METHODS; do
    case "$METHOD" in
      grpo) ESTIMATOR_ARGS=(--algo.advantage.estimator group_norm) ;;
      salt) ESTIMATOR_ARGS=(
          --algo.advantage.estimator salt --salt.base group_norm
          --salt.variant full --salt.features sketch --salt.dim 4096
        ) ;;
      *) echo "METHODS may hold grpo and salt (got '$METHOD')" >&2 && exit 2 ;;
    esac
    RUN_NAME="r1-distill-qwen-1.5B_${DATASET}_budget${BUDGET}_G${G}_${METHOD}_seed${SEED}"
    SAVE_PATH="$SAVE_ROOT/rollout-scaling/$RUN_NAME"
    WANDB_ARGS=()
    if [[ -n "${WANDB_API_KEY:-}" ]]; then
      WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
        --logger.wandb.group "rollout-scaling_budget${BUDGET}" --logger.wandb.run_name "$RUN_NAME")
    fi
    RUN_ARGS=(
      --actor.model_name_or_path "$MODEL"
      --data.prompt_dataset "$DATA_DIR/$DATASET.jsonl" --data.input_key prompt --data.label_key answer
      --data.apply_chat_template --data.max_samples "$MAX_SAMPLES"
      --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
      --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
      --eval.dataset "$DATA_DIR/aime24.jsonl" --eval.steps "$EVAL_STEPS"
      --eval.temperature 0.6 --eval.n_samples_per_prompt 4
      --rollout.batch_size "$PROMPTS" --rollout.n_samples_per_prompt "$G"
      --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 8 --train.micro_batch_size 1
      --train.num_episodes "$EPISODES" --train.max_epochs 1 --train.seed "$SEED"
      --rollout.temperature "$TEMPERATURE"
      --actor.adam.lr "$LR" --actor.lr_scheduler constant_with_warmup --actor.lr_warmup_ratio 0.03
      --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean
      --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
      "${ESTIMATOR_ARGS[@]}"
      --ckpt.output_dir "$SAVE_PATH/final" --ckpt.path "$SAVE_PATH/ckpt" --ckpt.save_hf
      --ckpt.save_steps 32 --ckpt.max_num 2 --ckpt.load_enable
      --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE_PATH/tensorboard" "${WANDB_ARGS[@]}"
    )
    echo "submitting $RUN_NAME: $PROMPTS prompts x G=$G per step, $EPISODES episode(s) over $MAX_SAMPLES prompts"
    # A failed run (e.g. out of memory at one G) is reported at the end; the sweep goes on.
    ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
      -- python3 -m openrlhf_geo.cli train-ppo-ray "${ENGINE_ARGS[@]}" "${RUN_ARGS[@]}" || FAILED+=("$RUN_NAME")
  done
done
if ((${#FAILED[@]})); then
  printf 'failed runs:\n' >&2 && printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
