#!/usr/bin/env bash
# Rollout-scaling sweep (SALT, arXiv 2606.05800, §4.4, Fig. 4(c)/(d)): GRPO, DAPO and both + SALT for G in
# {2, 4, ..., 256} rollouts per prompt at a FIXED rollout budget, DeepSeek-R1-Distill-Qwen-1.5B on MATH-TRAIN.
#
# Reproduces  "when G increases from 2 to 256, GRPO and DAPO exhibit diminishing returns, whereas SALT yields
#             consistent gains" (§4.4): every run makes STEPS rollout steps of BUDGET trained rollouts (prompts per
#             step x G = BUDGET), with the same optimizer steps and LR schedule for every G, from a pool of POOL
#             prompts (small G revisits the pool over several episodes; large G uses its first BUDGET * STEPS / G
#             prompts once). Each run logs PR and n_eff (Fig. 4(d); baselines via --salt.diagnostics) and, with
#             EVAL=1, gets the ACC / Pass@8 evaluation of train_math_grpo.sh.
# Recipe      SALT Table 4 for everything but the group size (see train_math_grpo.sh / train_math_dapo.sh for the
#             flag mapping): T 0.6, LR 1e-6 constant, KL loss 0.001 (k3), entropy 0, 1024 + 8192 tokens, mini-batch
#             32 prompts x 8 = 256 samples (--train.batch_size 256, held fixed in samples for every G: 2 optimizer
#             steps per rollout step); DAPO adds clip 0.2/0.28, token-level loss, dynamic filtering, +-1 rewards.
# Open        The text gives no budget, step count, model or dataset for Fig. 4(c). Chosen: BUDGET=512 rollouts per
#             step (Table 4's 64 prompts x 8), STEPS=128, POOL=4096 prompts of MATH-TRAIN (powers of two, so every
#             G splits them evenly), the 1.5B model and MATH-TRAIN of Table 8's ablations (same section).
# Differs     DAPO: dynamic filtering replaces all-correct / all-wrong groups with new prompts, so a DAPO run consumes
#             the pool faster than STEPS x BUDGET / G prompts and ends after fewer than STEPS steps (0.11.2 has no
#             step cap; the episodes end when the prompts do); the trained rollouts per step stay BUDGET. The
#             generation-batch caveats of train_math_dapo.sh apply.
# Hardware    NUM_NODES x 8 GPUs with 80 GB (H100/H200/A100-80G); the runs are submitted one after another (each
#             `ray job submit` waits for its job).
# Wall time   rough estimate, not measured: 128 steps of 512 rollouts is ~55 % of a MATH-TRAIN run of
#             train_math_grpo.sh (Table 11: 7-8 h on 8 x H20), so ~4-5 h per run plus ~1-2 h of eval, 32 runs
#             ~1 week on one node. Run subsets with G_LIST / METHODS, or several clusters.
# Model       deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
# Data        MATH-TRAIN (DigitalLearningGmbH/MATH-lighteval), AIME24 + AIME25 for validation; written to DATA_DIR
#             by prepare_math_data.py on first use.
# Outputs     SAVE_ROOT/rollout-scaling/r1-distill-qwen-1.5B_math_train_G<G>/<method>/seed<k>/: compare methods at
#             one G with `openrlhf-geo report SAVE_ROOT/rollout-scaling/r1-distill-qwen-1.5B_math_train_G<G>
#             --baseline grpo`.
#
# Usage       bash examples/scripts/sweep_rollout_scaling.sh
#             G_LIST="8 64" METHODS="grpo grpo-salt" SEED=2026 bash examples/scripts/sweep_rollout_scaling.sh
# Edit        the switches and paths below (or set them in the environment), the recipe block for other
#             hyperparameters. Needs a running Ray cluster with `pip install "openrlhf-geo[openrlhf]"` on every
#             node; DATA_DIR and SAVE_ROOT must be on a filesystem every node sees. WANDB_API_KEY set -> wandb
#             logging (the key travels in the job's command line); TensorBoard logs are always written.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Switches
G_LIST=${G_LIST:-2 4 8 16 32 64 128 256} # rollouts per prompt
METHODS=${METHODS:-grpo grpo-salt dapo dapo-salt}
SEED=${SEED:-2025} # the paper's seeds: 2025 2026 2027 2028 2029
EVAL=${EVAL:-1}    # 1: evaluate each final model

# Cluster and paths
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}

# Fixed budget: every run = STEPS rollout steps x BUDGET rollouts (BUDGET, STEPS, POOL: powers of two)
BUDGET=512       # rollouts per rollout step = prompts per step x G (Table 4: 64 prompts x 8)
STEPS=128        # rollout steps per run
POOL=4096        # distinct prompts available (the first POOL of MATH-TRAIN; it has 7500)
TRAIN_BATCH=256  # samples per optimizer step (Table 4's mini-batch, 32 prompts x 8)

# Table 4 recipe
MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
DATASET=math_train
LR=1e-6
KL_COEF=0.001
ENTROPY_COEF=0
TEMPERATURE=0.6
MAX_PROMPT_LEN=1024
MAX_NEW_TOKENS=8192
EVAL_STEPS=10
EVAL_SAMPLES=8

case "$EVAL" in
  0 | 1) ;;
  *) echo "EVAL must be 0 or 1 (got '$EVAL')" >&2 && exit 2 ;;
esac
for METHOD in $METHODS; do
  case "$METHOD" in
    grpo | grpo-salt | dapo | dapo-salt) ;;
    *) echo "METHODS may hold grpo, grpo-salt, dapo and dapo-salt (got '$METHOD')" >&2 && exit 2 ;;
  esac
done

if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" || ! -f "$DATA_DIR/aime25.jsonl" ]]; then
  PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24 aime25
fi

VLLM_TP=1
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
  SETTING="r1-distill-qwen-1.5B_${DATASET}_G${G}"
  for METHOD in $METHODS; do
    case "$METHOD" in
      grpo*) MATH_MODE=grpo ALGO_ARGS=(--actor.eps_clip 0.2 --actor.loss_agg_mode seq-mean-token-mean) ;;
      dapo*) MATH_MODE=dapo ALGO_ARGS=(
          --actor.eps_clip_low_high 0.2 0.28 --actor.loss_agg_mode token-mean
          --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
        ) ;;
    esac
    case "$METHOD" in
      *-salt) ESTIMATOR_ARGS=(--algo.advantage.estimator salt --salt.base group_norm --salt.variant full) ;;
      *) ESTIMATOR_ARGS=(--algo.advantage.estimator group_norm --salt.diagnostics) ;;
    esac
    RUN_DIR="$SAVE_ROOT/rollout-scaling/$SETTING/$METHOD/seed$SEED"
    RUN_NAME="${SETTING}_${METHOD}_seed${SEED}"
    WANDB_ARGS=()
    if [[ -n "${WANDB_API_KEY:-}" ]]; then
      WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
        --logger.wandb.group "rollout-scaling_budget${BUDGET}_${METHOD}" --logger.wandb.run_name "$RUN_NAME")
    fi
    # Job level: working_dir + env_vars only (the fork's ray.init adds the rest). Rewards 1/0 or +1/-1 (App. C.2).
    RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_MATH_MODE": "%s"}}' "$REPO_DIR" \
      "$MATH_MODE")
    RUN_ARGS=(
      --actor.model_name_or_path "$MODEL"
      --data.prompt_dataset "$DATA_DIR/$DATASET.jsonl" --data.input_key prompt --data.label_key answer
      --data.apply_chat_template --data.max_samples "$MAX_SAMPLES"
      --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
      --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
      --eval.dataset "$DATA_DIR/aime24.jsonl,$DATA_DIR/aime25.jsonl" --eval.steps "$EVAL_STEPS"
      --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt "$EVAL_SAMPLES"
      --rollout.batch_size "$PROMPTS" --rollout.n_samples_per_prompt "$G"
      --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size 8 --train.micro_batch_size 1
      --train.num_episodes "$EPISODES" --train.max_epochs 1 --train.seed "$SEED"
      --rollout.temperature "$TEMPERATURE"
      --actor.adam.lr "$LR" --actor.lr_scheduler constant --actor.lr_warmup_ratio 0
      --actor.entropy_coef "$ENTROPY_COEF"
      --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
      "${ALGO_ARGS[@]}" "${ESTIMATOR_ARGS[@]}"
      --ckpt.output_dir "$RUN_DIR/final" --ckpt.path "$RUN_DIR/ckpt" --ckpt.save_hf
      --ckpt.save_steps 32 --ckpt.max_num 2 --ckpt.load_enable
      --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard" "${WANDB_ARGS[@]}"
    )
    EVAL_ARGS=(
      --model "$RUN_DIR/final" --benchmarks aime24,aime25,gsm8k,math500,gpqa_diamond
      --n "$EVAL_SAMPLES" --k 1 "$EVAL_SAMPLES" --temperature "$TEMPERATURE" --top-p 1.0
      --max-new-tokens "$MAX_NEW_TOKENS" --seed "$SEED" --backend vllm
      --data-dir "$DATA_DIR/benchmarks" --from-hub --output-dir "$RUN_DIR"
    )
    echo "submitting $RUN_NAME: $PROMPTS prompts x G=$G per step, $EPISODES episode(s) over $MAX_SAMPLES prompts"
    # A failed run (e.g. out of memory at one G) is reported at the end; the sweep goes on.
    if ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
      -- python3 -m openrlhf_geo.cli train-ppo-ray "${ENGINE_ARGS[@]}" "${RUN_ARGS[@]}"; then
      if [[ "$EVAL" == 1 ]]; then
        ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" --entrypoint-num-gpus=1 \
          -- python3 -m openrlhf_geo.cli eval "${EVAL_ARGS[@]}" || FAILED+=("$RUN_NAME (eval)")
      fi
    else
      FAILED+=("$RUN_NAME")
    fi
  done
done
if ((${#FAILED[@]})); then
  printf 'failed runs:\n' >&2 && printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
