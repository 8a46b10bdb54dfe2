#!/usr/bin/env bash
# The README's test command: set-up on a fresh CPU machine, lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh test
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -n 2 -p no:cacheprovider "$@"
