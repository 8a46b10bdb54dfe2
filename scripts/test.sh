#!/usr/bin/env bash
# The README's test command: set-up on a fresh CPU machine, lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh test
. .venv/bin/activate
ruff check .
ruff format --check .
mypy  # the core's types (pyproject.toml [tool.mypy])
# Two xdist workers share the CI machine's two cores: one BLAS/OpenMP thread each (oversubscribed BLAS threads made
# small eigensolves 40-250x slower on a shared 2-core machine).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# loadfile: a test file's tests share one worker, so tests/test_smoke_cpu.py's smoke (a module fixture, ~4 min) runs
# once while the other worker takes the other files (xdist 3.8's loadgroup did not group module-level marks here).
python -m pytest -n 2 --dist loadfile -p no:cacheprovider "$@"
