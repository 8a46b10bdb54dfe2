#!/usr/bin/env bash
# Refreshes requirements/lock/ (the versions and hashes scripts/setup_cpu.sh installs): builds a throwaway
# environment with the newest versions the requirement files allow (`OPENRLHF_GEO_UNLOCKED=1`), then records what
# pip resolves for each set-up mode there (scripts/lock.py). Review `git diff requirements/lock`, rerun the tests and
# the demo, and commit the lock with the numbers it gives (docs/usage.md, "Locked versions").
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# a copy of the working tree (uncommitted requirement edits included), without its environment and runs
tar -c --exclude=./.venv --exclude=./runs --exclude=./.git . | tar -x -C "$work"
OPENRLHF_GEO_UNLOCKED=1 bash "$work/scripts/setup_cpu.sh" test
"$work/.venv/bin/python" scripts/lock.py requirements/lock
