#!/usr/bin/env bash
# The README's main command: set-up on a fresh CPU machine, then the embedded demo (arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
. .venv/bin/activate
openrlhf-geo demo "$@"
