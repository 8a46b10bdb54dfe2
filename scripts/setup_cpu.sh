#!/usr/bin/env bash
# Creates ./.venv on a CPU-only machine and installs openrlhf-geo into it.
#   bash scripts/setup_cpu.sh          base install (what the demo needs)
#   bash scripts/setup_cpu.sh test     + test tools + openrlhf==0.11.2 (--no-deps) and its CPU-able deps
# torch is pinned to the CPU build first: an unpinned torch may resolve to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
if [ "${1:-}" = "test" ]; then
  pip install -q -e ".[test]"
  # The real upstream package for the fork's tests; vllm/flash-attn are CUDA-only and stay out (tests shim them).
  pip install -q --no-deps openrlhf==0.11.2
  pip install -q -r requirements/openrlhf-cpu.txt
else
  pip install -q -e .
fi
