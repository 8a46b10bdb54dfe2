#!/usr/bin/env bash
# Smoke test of the fork on ONE GPU, end to end through Ray + vLLM + DeepSpeed: a tiny random Qwen2 built from a
# config (no download), 2 PPO steps with SALT + GeoAlign + 20 % reward-label flips, actor and vLLM colocated.
# It checks the wiring (flags -> actor forward -> experience maker -> loss -> logged metrics -> checkpoint), not
# learning: the model is random and the reward is a coin-flip-like function of the response text.
#
# Needs one CUDA GPU and the GPU install: pip install "openrlhf-geo[openrlhf]" (openrlhf[vllm]==0.11.2).
# Run it from the repository root (or anywhere without an `openrlhf/` folder in the working directory):
#   bash examples/scripts/smoke_salt_geoalign_1gpu.sh [OUT_DIR]
set -euo pipefail
OUT=$(realpath -m "${1:-runs/smoke_salt_geoalign_1gpu}")
mkdir -p "$OUT"

python -m openrlhf_geo.cli fork verify

# Tiny model + tokenizer (tokenizers library), 16 arithmetic prompts, a reward function file for --reward.remote_url:
# the CPU smoke's assets (examples/scripts/smoke_cpu.py).
python "$(dirname "$0")/smoke_cpu.py" --assets-only "$OUT"

# 16 prompts x 4 samples, 32 per optimizer step => 2 steps; checkpoint at step 2 (carries the GeoAlign projector).
python -m openrlhf_geo.cli train-ppo-ray \
  --actor.model_name_or_path "$OUT/assets/model" \
  --data.prompt_dataset "$OUT/assets/prompts.jsonl" --data.input_key input --data.label_key label \
  --data.max_samples 16 --data.max_len 64 --rollout.max_new_tokens 16 \
  --reward.remote_url "$OUT/assets/reward_func.py" \
  --actor.num_nodes 1 --actor.num_gpus_per_node 1 --ref.num_nodes 1 --ref.num_gpus_per_node 1 \
  --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.3 \
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep \
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation sdpa \
  --rollout.batch_size 8 --rollout.n_samples_per_prompt 4 --rollout.micro_batch_size 4 \
  --train.batch_size 32 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1 \
  --actor.adam.lr 1e-5 --algo.kl.init_coef 0 --actor.loss_agg_mode seq-mean-token-mean \
  --advantage_estimator salt \
  --geoalign.enable --geoalign.min_scores 8 --geoalign.projector.steps 10 \
  --reward.noise.type flip --reward.noise.rate 0.2 \
  --logger.tensorboard_dir "$OUT/tensorboard" \
  --ckpt.output_dir "$OUT/final" --ckpt.path "$OUT/checkpoints" --ckpt.save_steps 2

# The fork's metrics reached TensorBoard through upstream's status/info path, at both steps.
python - "$OUT/tensorboard" <<'PY'
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

runs = [p.parent for p in Path(sys.argv[1]).rglob("events.out.tfevents.*")]
assert runs, f"no TensorBoard events under {sys.argv[1]}"
tags = set()
for run in runs:
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags |= {t for t in acc.Tags()["scalars"] if len(acc.Scalars(t)) >= 2}
want = ["salt/pr", "salt/k", "salt/n_eff_in", "salt/n_eff_out", "salt/alpha", "salt/D_a", "salt/D_g", "salt/U_perp",
        "salt/U_perp_gain", "salt/out_of_regime", "geo/pairs", "geo/flag_frac", "geo/val_acc", "geo/gdi_p50",
        "geo/gdi_p95",
        "geo/cos_gt_0.8", "geo/precision", "geo/recall", "geo/auroc", "noise/corrupted"]
missing = [w for w in want if f"train/{w}" not in tags]
assert not missing, f"metrics missing from TensorBoard: {missing}"
print("smoke test passed: 2 steps, SALT + GeoAlign + reward noise metrics logged")
PY
