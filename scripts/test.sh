#!/usr/bin/env bash
# The README's test command: set-up on a fresh CPU machine, lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh test
. .venv/bin/activate
ruff check .
ruff format --check .
# Two xdist workers share the CI machine's two cores: one BLAS/OpenMP thread each (oversubscribed BLAS threads made
# small eigensolves 40-250x slower on a shared 2-core machine).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# loadgroup: tests/test_smoke_cpu.py (about 8 min, one module fixture) stays on one worker while the other runs the rest.
python -m pytest -n 2 --dist loadgroup -p no:cacheprovider "$@"
