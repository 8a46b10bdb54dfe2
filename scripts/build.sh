#!/usr/bin/env bash
# Builds the release files, the sdist and the wheel, into dist/ (or DIR):
#   bash scripts/build.sh [DIR]
# As PyPA's `build` does, the wheel is built from the sdist, so the sdist is checked to hold what setup.py needs.
# Offline, with .venv's setuptools (scripts/setup_cpu.sh; the lock has no `build` package): no build isolation.
# From a clean state: DIR's earlier openrlhf_geo-* files are deleted first, and nothing is written in the checkout
# (egg-info, build/ and the unpacked sdist go to a temporary folder), so no stale build output reaches the files.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$root/dist}")
cd "$root"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then . .venv/bin/activate; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
rm -f "$out"/openrlhf_geo-*.tar.gz "$out"/openrlhf_geo-*.whl
python setup.py -q egg_info --egg-base "$tmp" sdist --dist-dir "$tmp/sdist" >/dev/null
sdist=$(echo "$tmp"/sdist/openrlhf_geo-*.tar.gz)
tar -xzf "$sdist" -C "$tmp"
pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$out" "$tmp/$(basename "$sdist" .tar.gz)"
cp "$sdist" "$out/"
ls -l "$out"/openrlhf_geo-*
