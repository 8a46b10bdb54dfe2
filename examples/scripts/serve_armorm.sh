#!/usr/bin/env bash
# Serve ArmoRM (RLHFlow/ArmoRM-Llama3-8B-v0.1) scores over HTTP for `--reward.remote_url`, on its own GPU.
#
# What        `openrlhf-geo serve-rm`: ArmoRM scored as its model card does (remote code, `.score`), concurrent
#             requests merged into batches; speaks upstream OpenRLHF's remote-RM protocol (POST /get_reward,
#             GET /health). The alternative to train_hh_rl.sh's default of loading ArmoRM inside every vLLM engine.
# Hardware    one GPU with >= 24 GB that the training Ray cluster does not schedule on: a separate machine, or a
#             GPU kept out of Ray (e.g. `CUDA_VISIBLE_DEVICES=0,...,6 ray start --head --num-gpus 7` and RM_GPU=7;
#             the training job then has 7 GPUs: set GPUS_PER_NODE and the batch sizes to match).
# Wall time   serves until stopped (Ctrl-C); loading takes 1-3 min.
# Model       RLHFlow/ArmoRM-Llama3-8B-v0.1 (or a local copy: ARMORM=/path)
#
# Usage       RM_TOKEN=secret bash examples/scripts/serve_armorm.sh        # then, for training:
#             RM_URL=http://:secret@THIS_HOST:5000/get_reward bash examples/scripts/train_hh_rl.sh
# Edit        the variables below (or set them in the environment). The server listens on all interfaces here
#             (the CLI's default is 127.0.0.1) and requires the bearer token RM_TOKEN (upstream's client sends it
#             from the URL's password); RM_ALLOW_UNAUTHENTICATED=1 serves without one. Keep the port inside the
#             cluster's network either way.
set -euo pipefail

ARMORM=${ARMORM:-RLHFlow/ArmoRM-Llama3-8B-v0.1}
RM_GPU=${RM_GPU:-0}
RM_PORT=${RM_PORT:-5000}
RM_TOKEN=${RM_TOKEN:-}  # required, since the server listens on every interface ...
RM_ALLOW_UNAUTHENTICATED=${RM_ALLOW_UNAUTHENTICATED:-0}  # ... unless 1: no token, on a network you trust
BATCH_SIZE=16       # sequences per forward
MAX_LENGTH=4096     # tokens kept per conversation (HH prompts + 512-token responses fit)

AUTH_ARGS=()
if [ -z "$RM_TOKEN" ]; then
  if [ "$RM_ALLOW_UNAUTHENTICATED" != 1 ]; then
    echo "serve_armorm.sh: set RM_TOKEN (the server listens on every interface), or RM_ALLOW_UNAUTHENTICATED=1" >&2
    exit 1
  fi
  AUTH_ARGS=(--allow-unauthenticated)
fi

echo "serving $ARMORM on GPU $RM_GPU at http://$(hostname):$RM_PORT/get_reward"
# the token travels in the environment, not on the command line (visible to every user in `ps`)
CUDA_VISIBLE_DEVICES="$RM_GPU" OPENRLHF_GEO_RM_AUTH_TOKEN="$RM_TOKEN" exec openrlhf-geo serve-rm \
  --model "$ARMORM" --host 0.0.0.0 --port "$RM_PORT" --device cuda --dtype bf16 \
  --batch-size "$BATCH_SIZE" --max-length "$MAX_LENGTH" "${AUTH_ARGS[@]}"
