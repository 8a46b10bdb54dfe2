# shellcheck shell=bash disable=SC2034 # the variables are the sourcing scripts'
# What the Ray launch scripts in examples/scripts/ share: cluster and paths, the job's runtime env, the engine
# (colocated actor + reference + vLLM), logging and checkpoint flags, the submission, and the two math recipes (SALT
# Table 4, train_math_grpo.sh's header maps it; GeoAlign's, train_math_geoalign.sh's header). Sourced, never run:
#
#   set -euo pipefail
#   SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
#   source "$SCRIPT_DIR/lib/common.sh"
#
# A new baseline in SALT's recipe (train_math_kl_cov.sh is one):   salt_math_recipe; METHOD=...;
#   METHOD_ARGS=("${GRPO_BASELINE_ARGS[@]}" --baseline.my_flag ...); salt_math_run grpo
# A new baseline in GeoAlign's math recipe (train_math_seed_grpo.sh):   geoalign_math_recipe; METHOD=...;
#   METHOD_ARGS=(--baseline.my_flag ...); geoalign_math_run
# The functions set global variables (bash has no other return value); each says which.

REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd) # the job's working_dir: the entrypoint and reward file come from here

# Cluster and paths (set them in the environment)
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
NUM_NODES=${NUM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DATA_DIR=${DATA_DIR:-$HOME/openrlhf-geo/data}
SAVE_ROOT=${SAVE_ROOT:-$HOME/openrlhf-geo/runs}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf-geo}
VLLM_TP=1

# With the engine's flags: token-budgeted micro-batches (the math recipes' long responses).
DYNAMIC_BATCH_ARGS=(--train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 --rollout.max_tokens_per_gpu 32768)
# SALT's advantages (group_norm reweighted by SALT), or GRPO's with SALT's geometry logged (PR, n_eff; SALT Fig. 3).
SALT_ESTIMATOR_ARGS=(--algo.advantage.estimator salt --salt.base group_norm --salt.variant full)
DIAGNOSTICS_ESTIMATOR_ARGS=(--algo.advantage.estimator group_norm --salt.diagnostics)

# die MESSAGE: a bad switch; exits 2 before anything is submitted.
die() {
  echo "$*" >&2 && exit 2
}

check_eval_switch() {
  case "$EVAL" in
    0 | 1) ;;
    *) die "EVAL must be 0 or 1 (got '$EVAL')" ;;
  esac
}

# reward_noise_args flip|swap -> NOISE_ARGS; NOISE_RATE (0 | 0.05 | 0.1) of each prompt's rollouts get corrupted
# rewards, and METHOD gets the suffix _<type><rate>.
reward_noise_args() {
  case "$NOISE_RATE" in
    0) NOISE_ARGS=() ;;
    0.05 | 0.1)
      NOISE_ARGS=(--reward.noise.type "$1" --reward.noise.rate "$NOISE_RATE" --reward.noise.seed "$SEED")
      METHOD="${METHOD}_$1${NOISE_RATE}" ;;
    *) die "NOISE_RATE must be 0, 0.05 or 0.1 (got '$NOISE_RATE')" ;;
  esac
}

# prepare_math_data: DATA_DIR/{DATASET,aime24,aime25}.jsonl, written by prepare_math_data.py if one is missing.
prepare_math_data() {
  if [[ ! -f "$DATA_DIR/$DATASET.jsonl" || ! -f "$DATA_DIR/aime24.jsonl" || ! -f "$DATA_DIR/aime25.jsonl" ]]; then
    PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
      python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$DATA_DIR" "$DATASET" aime24 aime25
  fi
}

# Job level: working_dir + env_vars only. The fork's ray.init adds py_modules and upstream's env vars;
# Ray rejects a field or env var set at both levels.
# math_runtime_env grpo|dapo -> RUNTIME_ENV. OPENRLHF_GEO_MATH_MODE: grpo rewards 1 / 0, dapo +1 / -1 (SALT App. C.2;
# the reward's `scores` stay 0/1 for dynamic filtering); GeoAlign's 1.0 / 0.0 (App. B.3) is grpo.
math_runtime_env() {
  RUNTIME_ENV=$(printf '{"working_dir": "%s", "env_vars": {"OPENRLHF_GEO_MATH_MODE": "%s"}}' "$REPO_DIR" "$1")
}

# engine_args ZERO_STAGE VLLM_MEMORY [FLAG...] -> ENGINE_ARGS: actor, reference and vLLM colocated on NUM_NODES x
# GPUS_PER_NODE, sleeping in turn; the FLAGs are appended.
engine_args() {
  ENGINE_ARGS=(
    --actor.num_nodes "$NUM_NODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
    --ref.num_nodes "$NUM_NODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
    --vllm.num_engines $((NUM_NODES * GPUS_PER_NODE / VLLM_TP)) --vllm.tensor_parallel_size "$VLLM_TP"
    --vllm.gpu_memory_utilization "$2" --vllm.sync_backend nccl --vllm.enforce_eager
    --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
    --ds.zero_stage "$1" --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
    --ds.packing_samples "${@:3}"
  )
}

# schedule_args -> SCHEDULE_ARGS: batch sizes, episodes, seed, rollout temperature, learning rate, from
# PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, TRAIN_BATCH, ROLLOUT_MICRO_BATCH, TRAIN_MICRO_BATCH, NUM_EPISODES, SEED,
# TEMPERATURE, LR, LR_SCHEDULER, LR_WARMUP_RATIO.
schedule_args() {
  SCHEDULE_ARGS=(
    --rollout.batch_size "$PROMPTS_PER_STEP" --rollout.n_samples_per_prompt "$SAMPLES_PER_PROMPT"
    --train.batch_size "$TRAIN_BATCH" --rollout.micro_batch_size "$ROLLOUT_MICRO_BATCH"
    --train.micro_batch_size "$TRAIN_MICRO_BATCH"
    --train.num_episodes "$NUM_EPISODES" --train.max_epochs 1 --train.seed "$SEED"
    --rollout.temperature "$TEMPERATURE"
    --actor.adam.lr "$LR" --actor.lr_scheduler "$LR_SCHEDULER" --actor.lr_warmup_ratio "$LR_WARMUP_RATIO"
  )
}

# kl_loss_args -> KL_LOSS_ARGS: the KL penalty as a loss term (k3 estimator), coefficient KL_COEF.
kl_loss_args() {
  KL_LOSS_ARGS=(--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF")
}

# grpo_args -> GRPO_ARGS: GeoAlign's GRPO (App. B.4): clip EPS_CLIP, per-sequence loss averaging, the KL loss
# (kl_loss_args), group-normalized advantages.
grpo_args() {
  kl_loss_args
  GRPO_ARGS=(
    --actor.eps_clip "$EPS_CLIP" --actor.loss_agg_mode seq-mean-token-mean
    "${KL_LOSS_ARGS[@]}" --algo.advantage.estimator group_norm
  )
}

# run_names SETTING [RUNS_DIR] -> SETTING, RUN_DIR (RUNS_DIR/METHOD/seedSEED; RUNS_DIR defaults to
# SAVE_ROOT/SETTING), RUN_NAME.
run_names() {
  SETTING=$1
  RUN_DIR="${2:-$SAVE_ROOT/$SETTING}/$METHOD/seed$SEED"
  RUN_NAME="${SETTING}_${METHOD}_seed${SEED}"
}

# wandb_args GROUP -> WANDB_ARGS: wandb logging of RUN_NAME in GROUP when WANDB_API_KEY is set (the key travels in
# the job's command line); none otherwise.
wandb_args() {
  WANDB_ARGS=()
  if [[ -n "${WANDB_API_KEY:-}" ]]; then
    WANDB_ARGS=(--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project "$WANDB_PROJECT"
      --logger.wandb.group "$1" --logger.wandb.run_name "$RUN_NAME")
  fi
}

# log_args SAVE_STEPS MAX_NUM -> LOG_ARGS: the final HF model in RUN_DIR/final, resumable checkpoints in RUN_DIR/ckpt,
# TensorBoard in RUN_DIR/tensorboard, then WANDB_ARGS.
log_args() {
  LOG_ARGS=(
    --ckpt.output_dir "$RUN_DIR/final" --ckpt.path "$RUN_DIR/ckpt" --ckpt.save_hf
    --ckpt.save_steps "$1" --ckpt.max_num "$2" --ckpt.load_enable
    --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard" "${WANDB_ARGS[@]}"
  )
}

# submit_train FLAG...: a train-ppo-ray job with RUNTIME_ENV; waits for it, fails if it fails.
submit_train() {
  ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" \
    -- python3 -m openrlhf_geo.cli train-ppo-ray "$@"
}

# submit_eval FLAG...: an `openrlhf-geo eval` job, one GPU reserved for its entrypoint.
submit_eval() {
  ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" --entrypoint-num-gpus=1 \
    -- python3 -m openrlhf_geo.cli eval "$@"
}

# sweep_run FLAG...: a sweep's run: trains with FLAGs, then (EVAL=1) evaluates EVAL_ARGS; a failed job is added to
# FAILED (reported at the end by report_failures) and the sweep goes on.
sweep_run() {
  if submit_train "$@"; then
    if [[ "$EVAL" == 1 ]]; then
      submit_eval "${EVAL_ARGS[@]}" || FAILED+=("$RUN_NAME (eval)")
    fi
  else
    FAILED+=("$RUN_NAME")
  fi
}

# report_failures: the sweeps' FAILED runs on stderr, then exit 1; nothing if none failed.
report_failures() {
  if ((${#FAILED[@]})); then
    printf 'failed runs:\n' >&2 && printf '  %s\n' "${FAILED[@]}" >&2
    exit 1
  fi
}

# ── SALT's math recipe (arXiv 2606.05800 Table 4, App. C; train_math_grpo.sh's header maps it to flags) ──

# salt_table4: the values of Table 4's shared block (batch sizes: 0.11.2 counts rollout prompts and train samples).
# Not the clip ratio and the entropy coefficient, which the methods' blocks set.
salt_table4() {
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
  ROLLOUT_MICRO_BATCH=8
  TRAIN_MICRO_BATCH=1
  LR_SCHEDULER=constant
  LR_WARMUP_RATIO=0
  kl_loss_args
}

# salt_math_recipe: Table 4's shared block and the switches of the train_math_* SALT scripts, checked; sets MODEL,
# ZERO_STAGE, KL_LOSS_ARGS and GRPO_BASELINE_ARGS (GRPO's loss averaging, KL and advantages, with SALT's geometry
# logged: what a loss-level baseline keeps of GRPO).
salt_math_recipe() {
  MODEL_SIZE=${MODEL_SIZE:-1.5B} # 1.5B | 7B
  DATASET=${DATASET:-math_train} # math_train | dapo_math_17k
  SEED=${SEED:-2025}             # the paper's seeds: 2025 2026 2027 2028 2029
  EVAL=${EVAL:-1}                # 1: evaluate the final model after training
  salt_table4
  case "$MODEL_SIZE" in
    1.5B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B ZERO_STAGE=2 ;;
    7B) MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B ZERO_STAGE=3 ;;
    *) die "MODEL_SIZE must be 1.5B or 7B (got '$MODEL_SIZE')" ;;
  esac
  case "$DATASET" in
    math_train | dapo_math_17k) ;;
    *) die "DATASET must be math_train or dapo_math_17k (got '$DATASET')" ;;
  esac
  GRPO_BASELINE_ARGS=(--actor.loss_agg_mode seq-mean-token-mean "${KL_LOSS_ARGS[@]}" "${DIAGNOSTICS_ESTIMATOR_ARGS[@]}")
}

# salt_data_args [FLAG...] -> DATA_ARGS: MODEL on DATA_DIR/DATASET.jsonl (upstream applies the chat template), the
# math-verify reward, in-training validation on AIME24 + AIME25; the FLAGs go after --data.apply_chat_template.
# shellcheck disable=SC2120 # most callers pass no FLAG
salt_data_args() {
  DATA_ARGS=(
    --actor.model_name_or_path "$MODEL"
    --data.prompt_dataset "$DATA_DIR/$DATASET.jsonl" --data.input_key prompt --data.label_key answer
    --data.apply_chat_template "$@"
    --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
    --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
    --eval.dataset "$DATA_DIR/aime24.jsonl,$DATA_DIR/aime25.jsonl" --eval.steps "$EVAL_STEPS"
    --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt "$EVAL_SAMPLES"
  )
}

# salt_eval_args -> EVAL_ARGS. Evaluation (§4.1, App. D.2): 8 samples per problem at T = 0.6 with 8192 new tokens
# -> avg@8 = pass@1, pass@8, of RUN_DIR/final; the summary goes to RUN_DIR.
salt_eval_args() {
  # shellcheck disable=SC2054 # --benchmarks takes a comma-separated list
  EVAL_ARGS=(
    --model "$RUN_DIR/final" --benchmarks aime24,aime25,gsm8k,math500,gpqa_diamond
    --n "$EVAL_SAMPLES" --k 1 "$EVAL_SAMPLES" --temperature "$TEMPERATURE" --top-p 1.0
    --max-new-tokens "$MAX_NEW_TOKENS" --seed "$SEED" --backend vllm
    --data-dir "$DATA_DIR/benchmarks" --from-hub --output-dir "$RUN_DIR"
  )
}

# salt_math_run grpo|dapo: after salt_math_recipe, with METHOD and METHOD_ARGS (the method's flags, after the
# schedule) set: checks EVAL, prepares the data, submits the training job, then (EVAL=1) the evaluation job.
salt_math_run() {
  check_eval_switch
  prepare_math_data
  run_names "r1-distill-qwen-${MODEL_SIZE}_${DATASET}"
  wandb_args "${SETTING}_${METHOD}"
  math_runtime_env "$1"
  engine_args "$ZERO_STAGE" 0.6 "${DYNAMIC_BATCH_ARGS[@]}"
  # shellcheck disable=SC2119
  salt_data_args
  schedule_args
  log_args 20 3
  salt_eval_args
  echo "submitting $RUN_NAME to $RAY_ADDRESS (outputs in $RUN_DIR)"
  submit_train "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${SCHEDULE_ARGS[@]}" "${METHOD_ARGS[@]}" "${LOG_ARGS[@]}"
  if [[ "$EVAL" == 1 ]]; then
    echo "evaluating $RUN_DIR/final"
    submit_eval "${EVAL_ARGS[@]}"
  fi
}

# ── GeoAlign's math recipe (arXiv 2606.26917 §5, App. B; train_math_geoalign.sh's header) ──

# geoalign_math_recipe: the recipe and the switches MODEL_SIZE, NOISE_RATE, SEED; checks MODEL_SIZE, sets MODEL,
# ZERO_STAGE and GRPO_ARGS. From the paper: 16 rollouts, eval every 10 steps at T 1.0. Table 6 is not in the text:
# every other value is unchecked.
geoalign_math_recipe() {
  NOISE_RATE=${NOISE_RATE:-0}    # 0 | 0.05 | 0.1: fraction of each prompt's rollouts whose 0/1 reward is flipped
  MODEL_SIZE=${MODEL_SIZE:-1.7B} # 1.7B | 4B
  SEED=${SEED:-42}
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
  ROLLOUT_MICRO_BATCH=8
  TRAIN_MICRO_BATCH=1
  LR_SCHEDULER=constant_with_warmup # unchecked
  LR_WARMUP_RATIO=0.03              # unchecked
  grpo_args
  case "$MODEL_SIZE" in
    1.7B) MODEL=Qwen/Qwen3-1.7B ZERO_STAGE=2 ;;
    4B) MODEL=Qwen/Qwen3-4B ZERO_STAGE=3 ;;
    *) die "MODEL_SIZE must be 1.7B or 4B (got '$MODEL_SIZE')" ;;
  esac
}

# geoalign_math_run: after geoalign_math_recipe, with METHOD and METHOD_ARGS (the method's flags, after GRPO's) set:
# checks NOISE_RATE, prepares the prompts, submits the training job (the eval is in training).
geoalign_math_run() {
  reward_noise_args flip
  # Prompts rendered by this model's chat template with thinking off (see "Thinking" in
  # train_math_geoalign.sh's header).
  PROMPT_DIR="$DATA_DIR/$(basename "$MODEL")_no-thinking"
  if [[ ! -f "$PROMPT_DIR/$DATASET.jsonl" || ! -f "$PROMPT_DIR/geoalign_eval.jsonl" ]]; then
    PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" \
      python3 "$SCRIPT_DIR/prepare_math_data.py" --out "$PROMPT_DIR" --render-with "$MODEL" \
      --chat-template-kwargs '{"enable_thinking": false}' "$DATASET" geoalign_eval
  fi
  run_names "qwen3-${MODEL_SIZE}_${DATASET}"
  wandb_args "${SETTING}_${METHOD}"
  math_runtime_env grpo # rewards 1 / 0 (App. B.3)
  engine_args "$ZERO_STAGE" 0.6 "${DYNAMIC_BATCH_ARGS[@]}"
  DATA_ARGS=(
    --actor.model_name_or_path "$MODEL"
    --data.prompt_dataset "$PROMPT_DIR/$DATASET.jsonl" --data.input_key prompt_text --data.label_key answer
    --data.max_len $((MAX_PROMPT_LEN + MAX_NEW_TOKENS)) --rollout.max_new_tokens "$MAX_NEW_TOKENS"
    --reward.remote_url openrlhf_geo/rewards/math_verify.py # relative to working_dir, on every node
    --eval.dataset "$PROMPT_DIR/geoalign_eval.jsonl" --eval.steps "$EVAL_STEPS"
    --eval.temperature "$EVAL_TEMPERATURE" --eval.n_samples_per_prompt 1
  )
  schedule_args
  log_args 20 3
  echo "submitting $RUN_NAME to $RAY_ADDRESS (outputs in $RUN_DIR)"
  submit_train "${ENGINE_ARGS[@]}" "${DATA_ARGS[@]}" "${SCHEDULE_ARGS[@]}" "${GRPO_ARGS[@]}" \
    "${METHOD_ARGS[@]}" "${NOISE_ARGS[@]}" "${LOG_ARGS[@]}"
}
