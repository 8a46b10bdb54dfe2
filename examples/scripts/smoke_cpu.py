"""The fork end to end on a CPU-only machine: `openrlhf-geo train-ppo-ray --fork.device cpu` through upstream's real
Ray actors, one vLLM CPU engine and DeepSpeed (CPU accelerator, gloo), on a tiny Qwen2 built from a config.

    python examples/scripts/smoke_cpu.py OUT_DIR [--model tiny|smollm2] [--conditions a,b,...]

`--model smollm2` runs the same checks on the real pretrained LM (SMOLLM2_CONDITIONS below).

It checks the wiring (flags -> actor forward -> experience maker -> loss -> logged metrics -> weight sync ->
checkpoint/resume), not learning. Each run is its own session: `train-ppo-ray` starts a local Ray head on
127.0.0.1 (the CPU overlay declares GPU slots so upstream's placement groups schedule) and stops it when it exits;
this script then checks that nothing of the session is left, and stops what is (its own handle), also on failure or
Ctrl-C. The HH condition runs upstream's SFT (`deepspeed --module openrlhf.cli.train_sft`) and serves a stand-in
ArmoRM with `openrlhf-geo serve-rm` on 127.0.0.1.

Writes OUT_DIR/summary.json: per condition the steps completed, the last step's logged metrics (upstream's train/*,
the fork's salt/*, geo/*, noise/*), the checks below and the wall time. Exit 0 only if every condition passed.
Per run, OUT_DIR/<run>/ holds train.log, tensorboard/, final/ (the trained model) and dump/step<N>.pt (what the
geometry pipeline received and returned each step, OPENRLHF_GEO_DUMP_DIR). OUT_DIR belongs to the smoke command that
first wrote it (OUT_DIR/command.json, `rundir.claim_output`): a directory of other files, another command's output
or a busy one is one line, before anything in it changes.

Checks per run: exit code; the required metrics finite at every step, no metric infinite; the policy's weights
changed; vLLM's log-probs of the sampled tokens equal the actor's at every step after the first (the weight sync
worked); no process left behind.

At the shape users run (`multirank`: 2 policy ranks, 2 reference ranks, 2 vLLM engines), also `check_ranks`: each
optimizer step trained on exactly one SALT partition across the ranks, every epoch on every partition; the ranks'
weights identical after every step; each engine's log-probs equal to the actor's at every step. `two_node_job` runs
the same on two Ray nodes started with `ray start` (127.0.0.1), as `ray job submit` jobs through lib/common.sh's
`submit_train`: the second node's workers import the fork's copy shipped by py_modules (and are refused without it),
a job checkpointed every step, its resume stopped mid-step by the Jobs API's stop (what `ray job stop` calls), and
the resume to the end. Upstream's asynchronous trainer (`async_salt_geoalign`, `partial_rollout_salt_geoalign`) gets
`check_ranks` at one rank: its optimizer steps are SALT partitions too; its later rollouts come from a policy one
update behind the actor, so vLLM's log-probs are compared with the actor's at the first step only (`stale`).

The recipe conditions (`recipe_*`) run the flag sets of examples/scripts' recipes, scaled down only in size and on
the smoke's task (SIZE_FLAGS, TASK_FLAGS): lib/common.sh's engine (colocated, DeepSpeed's sleep, ZeRO-3, packed
samples, gradient checkpointing), the math recipes of SALT and GeoAlign and of their baselines (Clip-Cov, KL-Cov, the
entropy bonus; PF-PPO, Seed-GRPO), and HH-RLHF's SFT then RL; each names the flags a CPU cannot honour and why
(`dropped`, `sft_dropped`).
"""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 16
# Per rollout step: 8 prompts x 4 samples = 32 = one optimizer step; 16 prompts = 2 steps per episode.
COMMON = [
    "--fork.device", "cpu",
    "--data.input_key", "input", "--data.label_key", "label",
    "--data.max_samples", str(PROMPTS), "--data.max_len", "96", "--rollout.max_new_tokens", "16",
    "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
    "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
    "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1", "--vllm.gpu_memory_utilization", "0.1",
    "--vllm.enforce_eager", "--vllm.sync_backend", "gloo",
    "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "eager",
    "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "4", "--rollout.micro_batch_size", "8",
    "--train.batch_size", "32", "--train.micro_batch_size", "8", "--train.max_epochs", "1",
    "--actor.adam.lr", "5e-3", "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
    "--algo.kl.init_coef", "0", "--actor.loss_agg_mode", "seq-mean-token-mean",
]  # fmt: skip
# vLLM's log-probs of the sampled tokens come back with the rollouts (train/vllm_kl; the weight-sync check)
SYNC = ["--algo.advantage.is_correction_level", "token"]
GEOALIGN = ["--geoalign.enable", "--geoalign.min_scores", "8", "--geoalign.projector.steps", "5"]
FLIPS = ["--reward.noise.type", "flip", "--reward.noise.rate", "0.2"]
# Metrics every step must log with a finite value. Others may be NaN where the pipeline defines them as undefined
# that step (geo/precision with nothing flagged, geo/kde_threshold of the pointwise rule, ...); none may be ±inf.
SALT = ["salt/pr", "salt/k", "salt/n_eff_in", "salt/alpha"]
GEO = ["geo/pairs", "geo/flag_frac", "geo/gdi_p50"]
NOISE = ["noise/corrupted"]
RESUMED = ["--advantage_estimator", "salt", "--salt.variant", "entropy-alpha", *GEOALIGN, *FLIPS]
# Reward models are checked by a sequence-classification model over HTTP; prompts in HH's format.
MULTIRANK = [
    "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--vllm.num_engines", "2",
    "--advantage_estimator", "salt", *GEOALIGN, *FLIPS,
    "--algo.kl.use_loss", "--algo.kl.init_coef", "0.001", "--algo.kl.estimator", "k3",
    "--train.batch_size", "16", "--train.micro_batch_size", "4", "--train.max_epochs", "2",
]  # fmt: skip
HH = ["--advantage_estimator", "group_norm", "--geoalign.enable", "--geoalign.preset", "rlhf", "--geoalign.min_scores",
      "8", "--geoalign.projector.steps", "5", "--reward.noise.type", "swap", "--reward.noise.rate", "0.2"]  # fmt: skip
KL_LOSS = ["--algo.kl.use_loss", "--algo.kl.init_coef", "0.001", "--algo.kl.estimator", "k3"]
# What a recipe condition scales down: these flags take the smoke's values (sizes: ranks, engines, memory, batches,
# steps); the task's take the smoke's model, prompts, reward and folders (train_command). Every other flag of the
# recipe keeps its own value (tests/test_smoke_cpu.py checks it against the recipe as its script submits it).
SIZE_FLAGS = (
    "--actor.num_nodes", "--actor.num_gpus_per_node", "--ref.num_nodes", "--ref.num_gpus_per_node",
    "--vllm.num_engines", "--vllm.gpu_memory_utilization", "--rollout.batch_size", "--rollout.n_samples_per_prompt",
    "--train.batch_size", "--train.num_episodes", "--eval.steps", "--eval.n_samples_per_prompt", "--ckpt.save_steps",
)  # fmt: skip
TASK_FLAGS = (
    "--actor.model_name_or_path", "--data.prompt_dataset", "--data.input_key", "--data.label_key", "--data.max_len",
    "--rollout.max_new_tokens", "--reward.remote_url", "--eval.dataset", "--ckpt.output_dir", "--ckpt.path",
    "--logger.tensorboard_dir",
)  # fmt: skip
# The recipes as their scripts submit them (lib/common.sh's salt_math_run, geoalign_math_run; train_hh_rl.sh): the
# engine at ZeRO-2 (the 1.5B / 1.7B models' stage), the math recipes' with token-budgeted micro-batches, evaluation
# during training (every step here), checkpoints with HF weights (log_args; every step here). "{assets}" is the
# smoke's assets folder.
ENGINE_ZERO2 = ["--train.colocate_all", "--ds.enable_sleep", "--ds.zero_stage", "2",
                "--actor.gradient_checkpointing_enable", "--ds.packing_samples"]  # fmt: skip
MATH_ENGINE = [
    *ENGINE_ZERO2,
    "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "16384", "--rollout.max_tokens_per_gpu", "32768",
]  # fmt: skip
MATH_CKPT = ["--ckpt.save_hf", "--ckpt.save_steps", "1", "--ckpt.max_num", "3", "--ckpt.load_enable",
             "--logger.logging_steps", "1"]  # fmt: skip
# SALT Table 4's shared block (salt_math_recipe): the chat template, 2 optimizer steps per rollout step here
SALT_TABLE4 = [
    "--data.apply_chat_template", "--eval.dataset", "{assets}/prompts.jsonl", "--eval.steps", "1",
    "--eval.temperature", "0.6", "--eval.n_samples_per_prompt", "2",
    "--train.batch_size", "16", "--train.micro_batch_size", "1", "--train.num_episodes", "1",
    "--train.max_epochs", "1", "--train.seed", "2025", "--rollout.temperature", "0.6",
    "--actor.adam.lr", "1e-6", "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", *KL_LOSS,
]  # fmt: skip
SALT_ESTIMATOR = ["--algo.advantage.estimator", "salt", "--salt.base", "group_norm", "--salt.variant", "full"]
# train_math_grpo.sh SALT=1
RECIPE_MATH_SALT = [
    *MATH_ENGINE, *SALT_TABLE4, "--actor.eps_clip", "0.2", "--actor.loss_agg_mode", "seq-mean-token-mean",
    "--actor.entropy_coef", "0", *SALT_ESTIMATOR, *MATH_CKPT,
]  # fmt: skip
# train_math_dapo.sh SALT=1: DAPO's clip, token-mean loss and dynamic filtering, with SALT
RECIPE_MATH_DAPO_SALT = [
    *MATH_ENGINE, *SALT_TABLE4, "--actor.eps_clip_low_high", "0.2", "0.28", "--actor.loss_agg_mode", "token-mean",
    "--actor.entropy_coef", "0", "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1",
    *SALT_ESTIMATOR, *MATH_CKPT,
]  # fmt: skip
# The GRPO of SALT's baselines (salt_math_recipe's GRPO_BASELINE_ARGS): GRPO's advantages, SALT's geometry logged
SALT_GRPO_BASELINE = [*MATH_ENGINE, *SALT_TABLE4, "--actor.loss_agg_mode", "seq-mean-token-mean",
                      "--algo.advantage.estimator", "group_norm", "--salt.diagnostics"]  # fmt: skip
# train_math_clip_cov.sh, train_math_kl_cov.sh: SALT Table 4's Clip-Cov and KL-Cov blocks (at least one token per
# micro-batch is covariance-clipped or penalised, so the 512 tokens of a step exercise the branch)
RECIPE_MATH_CLIP_COV = [
    *SALT_GRPO_BASELINE, "--actor.eps_clip_low_high", "1", "1", "--actor.entropy_coef", "0",
    "--baseline.policy_loss", "clip_cov", "--baseline.clip_cov_ratio", "2e-4", "--baseline.clip_cov_lb", "1.0",
    "--baseline.clip_cov_ub", "5.0", *MATH_CKPT,
]  # fmt: skip
RECIPE_MATH_KL_COV = [
    *SALT_GRPO_BASELINE, "--actor.eps_clip_low_high", "0.2", "0.2", "--actor.entropy_coef", "0",
    "--baseline.policy_loss", "kl_cov", "--baseline.kl_cov_ratio", "2e-3", "--baseline.kl_cov_coef", "1", *MATH_CKPT,
]  # fmt: skip
# train_math_entropy_bonus.sh: GRPO plus the entropy bonus (upstream's --actor.entropy_coef)
RECIPE_MATH_ENTROPY_BONUS = [*SALT_GRPO_BASELINE, "--actor.eps_clip", "0.2", "--actor.entropy_coef", "0.001",
                             *MATH_CKPT]  # fmt: skip
# GeoAlign's math recipe (geoalign_math_recipe, grpo_args), 2 optimizer steps per rollout step as there
GEOALIGN_MATH = [
    *MATH_ENGINE, "--eval.dataset", "{assets}/prompts.jsonl", "--eval.steps", "1", "--eval.temperature", "1.0",
    "--eval.n_samples_per_prompt", "1",
    "--train.batch_size", "16", "--train.micro_batch_size", "1", "--train.num_episodes", "1",
    "--train.max_epochs", "1", "--train.seed", "42", "--rollout.temperature", "1.0",
    "--actor.adam.lr", "1e-6", "--actor.lr_scheduler", "constant_with_warmup", "--actor.lr_warmup_ratio", "0.03",
    "--actor.eps_clip", "0.2", "--actor.loss_agg_mode", "seq-mean-token-mean",
    "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", "1e-3",
    "--algo.advantage.estimator", "group_norm",
]  # fmt: skip
# train_math_geoalign.sh GEOALIGN=1 NOISE_RATE=0.1: GeoAlign under flipped rewards; the online projector trains 5
# steps here
RECIPE_MATH_GEOALIGN = [
    *GEOALIGN_MATH, "--geoalign.enable", "--geoalign.preset", "math", "--geoalign.alpha", "0.05",
    "--reward.noise.type", "flip", "--reward.noise.rate", "0.1", "--reward.noise.seed", "42", *MATH_CKPT,
    "--geoalign.projector.steps", "5",
]  # fmt: skip
# train_math_pf_ppo.sh PF_PPO_MODE=bw NOISE_RATE=0.1: best-vs-worst PF-PPO under flipped rewards (best-vs-random runs
# in condition pf_ppo_br), its best and worst rollouts refilling the 4 slots of a prompt
RECIPE_MATH_PF_PPO_BW = [
    *GEOALIGN_MATH, "--baseline.curation", "pf_ppo_bw", "--baseline.pf_ppo_keep_count", "--reward.noise.type", "flip",
    "--reward.noise.rate", "0.1", "--reward.noise.seed", "42", *MATH_CKPT,
]  # fmt: skip
# train_math_seed_grpo.sh: Seed-GRPO's semantic-entropy scaling (the tiny model writes no \boxed{} answer: each
# response is its own cluster, so every prompt's advantages are scaled by 1 - alpha)
RECIPE_MATH_SEED_GRPO = [*GEOALIGN_MATH, "--baseline.seed_grpo_alpha", "0.5", *MATH_CKPT]
# train_hh_rl.sh GEOALIGN=1 NOISE_RATE=0.1 RM_URL=...: GeoAlign's HH-RLHF recipe from the SFT model, rewards swapped
# to the group's extremes, the reward model over HTTP (serve-rm on the stand-in ArmoRM); 2 optimizer steps per
# rollout step as there; the online projector trains 5 steps here
RECIPE_HH_GEOALIGN = [
    *ENGINE_ZERO2, "--eval.dataset", "{assets}/hh_prompts.jsonl", "--eval.steps", "1", "--eval.temperature", "1.0",
    "--eval.n_samples_per_prompt", "1",
    "--train.batch_size", "16", "--rollout.micro_batch_size", "16", "--train.micro_batch_size", "4",
    "--train.num_episodes", "1", "--train.max_epochs", "1", "--train.seed", "42", "--rollout.temperature", "1.0",
    "--actor.adam.lr", "5e-7", "--actor.lr_scheduler", "constant_with_warmup", "--actor.lr_warmup_ratio", "0.03",
    "--actor.eps_clip", "0.2", "--actor.loss_agg_mode", "seq-mean-token-mean",
    "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", "0.01",
    "--algo.advantage.estimator", "group_norm", "--geoalign.enable", "--geoalign.preset", "rlhf",
    "--geoalign.alpha", "0.12", "--reward.noise.type", "swap", "--reward.noise.rate", "0.1",
    "--reward.noise.seed", "42", *MATH_CKPT, "--geoalign.projector.steps", "5",
]  # fmt: skip
# lib/common.sh's engine_args, the engine of every recipe in examples/scripts: actor, reference and vLLM colocated
# and sleeping in turn, ZeRO-3, packed samples, gradient checkpointing (at one rank each: size only). What a CPU
# cannot honour is left out, named with the reason ("dropped"); every other flag stays on.
ENGINE = ["--train.colocate_all", "--ds.enable_sleep", "--ds.zero_stage", "3", "--ds.packing_samples",
          "--actor.gradient_checkpointing_enable"]  # fmt: skip
ENGINE_DROPPED = {
    "--vllm.enable_sleep": "needs CUDA: vLLM's CPU platform refuses sleep mode when the engine starts (ModelConfig: "
    "'Sleep mode is not supported on current platform.'; it lives in CUDA's cumem allocator); DeepSpeed's side, "
    "--ds.enable_sleep, runs",
    "--vllm.sync_backend nccl": "needs CUDA: colocated (--train.colocate_all), upstream syncs the weights by CUDA IPC "
    "(reduce_tensor of a CUDA tensor, get_physical_gpu_id); the gloo broadcast of COMMON runs instead",
}
# Upstream's SFT (`deepspeed --module openrlhf.cli.train_sft`, one CPU rank) before the HH conditions' RL, on the
# smoke's HH pairs (sft() passes the model, data and folders: SFT_TASK_FLAGS). SFT: a few steps at a learning rate
# that moves the tiny model onto the pairs' phrasings.
SFT = [
    "--data.input_template", "{}", "--data.max_len", "64", "--train.batch_size", "16", "--train.micro_batch_size", "8",
    "--train.max_epochs", "1", "--adam.lr", "1e-3", "--ds.zero_stage", "2", "--ds.param_dtype", "bf16",
    "--ds.attn_implementation", "eager", "--ckpt.save_steps", "-1",
]  # fmt: skip
# train_hh_sft.sh's flags: its batch of 128 is 16 here (8 optimizer steps over the 128 pairs); packed samples with
# eager attention (the CPU overlay keeps it, as for train-ppo-ray)
RECIPE_HH_SFT = [
    "--model.gradient_checkpointing_enable", "--data.input_template", "{}", "--data.max_len", "2048",
    "--train.batch_size", "16", "--train.micro_batch_size", "4", "--train.max_epochs", "1", "--adam.lr", "1e-5",
    "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "eager", "--ds.packing_samples",
    "--ckpt.save_steps", "-1", "--logger.logging_steps", "1",
]  # fmt: skip
SFT_SIZE_FLAGS = ("--train.batch_size",)
SFT_TASK_FLAGS = ("--model.model_name_or_path", "--data.dataset", "--data.input_key", "--data.output_key",
                  "--ckpt.output_dir", "--ckpt.path", "--logger.tensorboard_dir")  # fmt: skip
SFT_DROPPED = {
    "--ds.attn_implementation flash_attention_2": "needs CUDA: flash-attn's kernels; eager attention keeps packed "
    "samples apart by their position ids",
}

# name -> flags, metrics every step must log finite, and how the run is set up:
#   after: a run whose checkpoint this one resumes (same --ckpt.path, --ckpt.load_enable, one more episode)
#   fails: the run must fail with this text in its last stderr line (a one-line error)
#   cause: ... and its log must hold this text (what an actor raised)
#   hh:    SFT first (its model is the actor), prompts in HH format, reward from serve-rm
#   sft:   the SFT's flags (default SFT); sft_recipe, sft_dropped: as recipe and dropped, for train_hh_sft.sh
#   ranks: data-parallel policy ranks: prompts labelled with ids, the multi-rank checks (check_ranks)
#   cluster: on two Ray nodes, as `ray job submit` jobs (run_cluster_condition)
#   recipe: the examples/scripts recipe (or lib/common.sh function) whose flag set it runs, scaled down in size
#   dropped: flag -> why a CPU cannot honour it (left out of the run; the summary lists them)
#   stale: the rollouts after the first step come from a policy behind the actor (asynchronous training): vLLM's
#          log-probs are compared with the actor's at the first step only, the others recorded (sync_gap)
CONDITIONS = {
    "grpo_diagnostics": {"flags": ["--advantage_estimator", "group_norm", "--salt.diagnostics"], "finite": SALT},
    # SALT Table 4's KL loss (a reference-model actor too) and its two optimizer steps per rollout step: each one
    # trains on one SALT partition of 4 prompts (openrlhf_geo.fork.hooks.rank_batches)
    "salt": {
        "flags": ["--advantage_estimator", "salt", "--algo.kl.use_loss", "--algo.kl.init_coef", "0.001",
                  "--algo.kl.estimator", "k3", "--train.batch_size", "16"],
        "finite": [*SALT, "salt/n_eff_out", "salt/U_perp_gain", "kl"],
    },
    "geoalign_flip": {"flags": ["--advantage_estimator", "group_norm", *GEOALIGN, *FLIPS], "finite": [*GEO, *NOISE]},
    # SALT (entropy-alpha: the entropy range is state) + GeoAlign + noise, checkpointed at step 2 ...
    "salt_geoalign_flip": {"flags": [*RESUMED, "--ckpt.save_steps", "2"], "finite": [*SALT, *GEO, *NOISE]},
    # ... resumed in a new process to step 4
    "resume": {"flags": RESUMED, "finite": [*SALT, *GEO, *NOISE], "after": "salt_geoalign_flip"},
    # ... and refused when a geometry flag changed
    "resume_changed_flags": {
        "flags": [*RESUMED, "--salt.dim", "1024"],
        "after": "salt_geoalign_flip",
        "fails": "written with other flags: --salt.dim",
    },
    # clip_cov_ratio 0.2: enough of 32 x 16 tokens are covariance-clipped to exercise the branch. Clip-Cov replaces
    # the surrogate that applies vLLM's IS correction, so this run has no vLLM log-probs (no sync check).
    "clip_cov": {
        "flags": ["--advantage_estimator", "group_norm", "--baseline.policy_loss", "clip_cov",
                  "--baseline.clip_cov_ratio", "0.2"],
        "sync": False,
    },
    "pf_ppo_br": {
        "flags": ["--advantage_estimator", "group_norm", "--baseline.curation", "pf_ppo_br",
                  "--baseline.pf_ppo_keep_count"],
    },
    "dapo_salt": {
        "flags": ["--advantage_estimator", "salt", "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range",
                  "0", "1", "--actor.eps_clip_low_high", "0.2", "0.28", "--actor.loss_agg_mode", "token-mean"],
        "finite": SALT,
    },
    # DAPO's dynamic filtering before GeoAlign's curation, under flipped rewards: a replacement can tie a group that
    # the filter kept (geo/zero_variance_groups_after counts them); alpha 0.5 so that GeoAlign flags and replaces
    # rollouts in 2 steps of the tiny model
    "dapo_geoalign_flip": {
        "flags": ["--advantage_estimator", "salt", "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range",
                  "0", "1", "--actor.eps_clip_low_high", "0.2", "0.28", "--actor.loss_agg_mode", "token-mean",
                  *GEOALIGN, "--geoalign.alpha", "0.5", *FLIPS],
        "finite": [*SALT, *GEO, *NOISE, "geo/zero_variance_groups_after"],
    },
    # upstream's multi-turn agent (examples/agents/two_turns.py): two turns per rollout with the environment's tokens
    # between and after them, the reward on the last; SALT's features sum over both turns' tokens, GeoAlign reads the
    # last action token's hidden state; check_run counts each rollout's action spans in the dumps ("turns")
    "agent_salt_geoalign": {
        "flags": ["--train.agent_func_path", str(REPO / "examples/agents/two_turns.py"), "--advantage_estimator",
                  "salt", *GEOALIGN, *FLIPS],
        "finite": [*SALT, *GEO, *NOISE],
        "turns": 2,
    },
    # GSPO's sequence-level ratio on SALT's advantages (one value per sequence, as GSPO's own), GeoAlign under flips
    "gspo_salt_geoalign": {
        "flags": ["--advantage_estimator", "salt", "--actor.policy_loss_type", "gspo", *GEOALIGN, *FLIPS],
        "finite": [*SALT, *GEO, *NOISE],
    },
    # LoRA (upstream's peft adapters on every linear layer but the LM head, which stays frozen): SALT's Eq. 19
    # features from the adapted forward's logits and LM-head input, GeoAlign under flips; the adapters are saved
    # (weight_change merges them), the sync sends merged weights under the base model's names
    "lora_salt_geoalign": {
        "flags": ["--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--advantage_estimator", "salt", *GEOALIGN,
                  *FLIPS],
        "finite": [*SALT, *GEO, *NOISE],
    },
    # upstream's asynchronous trainer: a generator actor samples the next rollout batch while the trainer trains on
    # this one, so from step 2 on the rollouts come from the policy one update behind ("stale": vLLM's log-probs are
    # compared with the actor's at step 1 only). Each rollout step is 2 SALT partitions of 4 prompts; check_ranks (at
    # one rank) checks that each optimizer step trained on exactly one of them, as in the synchronous trainer
    "async_salt_geoalign": {
        "flags": ["--advantage_estimator", "salt", "--train.async_enable", "--train.batch_size", "16", *GEOALIGN,
                  *FLIPS],
        "finite": [*SALT, *GEO, *NOISE], "ranks": 1, "stale": True,
    },
    # ... with partial rollouts: no lock around generation, vLLM paused (requests kept) for each weight sync, so a
    # response may be sampled under two policies; SALT's features and GeoAlign's hidden states still come from the
    # actor's forward at the weights the step trains
    "partial_rollout_salt_geoalign": {
        "flags": ["--advantage_estimator", "salt", "--train.async_enable", "--train.partial_rollout_enable",
                  "--train.batch_size", "16", *GEOALIGN, *FLIPS],
        "finite": [*SALT, *GEO, *NOISE], "ranks": 1, "stale": True,
    },
    # the random stand-in reward model's scores differ little within a group (sd ~2e-3): a step may have no strict
    # pair, so GeoAlign's GDI is not required every step here; the swap noise still gives every step a signal
    "hh_sft_rm_geoalign": {"flags": HH, "finite": ["geo/pairs", *NOISE], "hh": True},
    # the shape users run: 2 policy ranks (ZeRO-2 over gloo), 2 reference ranks (the KL loss), 2 vLLM engines;
    # each rollout step = 2 SALT partitions of 4 prompts x 4, each rank's optimizer step 2 micro-batches of 4, 2 epochs
    "multirank": {"flags": MULTIRANK, "finite": [*SALT, *GEO, *NOISE], "ranks": 2},
    # the same on two Ray nodes (`ray start`), submitted as users submit it (`submit_train` of lib/common.sh):
    # checkpointed every step; then resumed as a second job stopped mid-step (`ray job stop`), then as a third
    "two_node_job": {"flags": [*MULTIRANK, "--ckpt.save_steps", "1"], "finite": [*SALT, *GEO, *NOISE], "ranks": 2,
                     "cluster": True},
    # the recipes' engine (lib/common.sh's engine_args) with SALT, GeoAlign under flipped rewards and the KL loss
    "recipe_engine": {"flags": [*ENGINE, "--advantage_estimator", "salt", *GEOALIGN, *FLIPS, *KL_LOSS],
                      "finite": [*SALT, *GEO, *NOISE], "recipe": "engine_args", "dropped": ENGINE_DROPPED},
    "recipe_math_salt": {"flags": RECIPE_MATH_SALT, "finite": [*SALT, "salt/n_eff_out", "kl"],
                         "recipe": "train_math_grpo.sh SALT=1", "dropped": ENGINE_DROPPED},
    "recipe_math_geoalign": {"flags": RECIPE_MATH_GEOALIGN, "finite": [*GEO, *NOISE, "kl"],
                             "recipe": "train_math_geoalign.sh GEOALIGN=1 NOISE_RATE=0.1", "dropped": ENGINE_DROPPED},
    "recipe_math_dapo_salt": {"flags": RECIPE_MATH_DAPO_SALT, "finite": SALT, "recipe": "train_math_dapo.sh SALT=1",
                              "dropped": ENGINE_DROPPED},
    # Clip-Cov and KL-Cov replace the surrogate that applies vLLM's IS correction: no vLLM log-probs (no sync check)
    "recipe_math_clip_cov": {"flags": RECIPE_MATH_CLIP_COV, "finite": [*SALT, "kl", "ppo_clip_ratio"],
                             "sync": False, "recipe": "train_math_clip_cov.sh", "dropped": ENGINE_DROPPED},
    "recipe_math_kl_cov": {"flags": RECIPE_MATH_KL_COV, "finite": [*SALT, "kl", "ppo_clip_ratio"],
                           "sync": False, "recipe": "train_math_kl_cov.sh", "dropped": ENGINE_DROPPED},
    "recipe_math_entropy_bonus": {"flags": RECIPE_MATH_ENTROPY_BONUS, "finite": [*SALT, "kl", "entropy_loss"],
                                  "recipe": "train_math_entropy_bonus.sh", "dropped": ENGINE_DROPPED},
    "recipe_math_pf_ppo_bw": {"flags": RECIPE_MATH_PF_PPO_BW,
                              "finite": [*NOISE, "kl", "baseline/pf_ppo/filtered_frac"],
                              "recipe": "train_math_pf_ppo.sh PF_PPO_MODE=bw NOISE_RATE=0.1",
                              "dropped": ENGINE_DROPPED},
    "recipe_math_seed_grpo": {"flags": RECIPE_MATH_SEED_GRPO, "finite": ["kl", "baseline/seed_grpo/scale_mean"],
                              "recipe": "train_math_seed_grpo.sh", "dropped": ENGINE_DROPPED},
    # SFT with train_hh_sft.sh's flags, then RL with train_hh_rl.sh's; the stand-in reward model's scores differ
    # little within a group (hh_sft_rm_geoalign), so GeoAlign's GDI is not required every step
    "recipe_hh_geoalign": {"flags": RECIPE_HH_GEOALIGN, "finite": ["geo/pairs", *NOISE, "kl"], "hh": True,
                           "recipe": "train_hh_rl.sh GEOALIGN=1 NOISE_RATE=0.1 RM_URL=http://127.0.0.1:5000/get_reward",
                           "dropped": ENGINE_DROPPED, "sft": RECIPE_HH_SFT, "sft_recipe": "train_hh_sft.sh",
                           "sft_dropped": SFT_DROPPED},
    # what vLLM's CPU build does with an engine of tensor parallelism 2: upstream starts it on vLLM's Ray executor,
    # which the CPU platform refuses (it has no Ray device key); the nearest run is multirank's 2 engines of TP 1
    "vllm_tp2": {"flags": ["--advantage_estimator", "salt", "--vllm.tensor_parallel_size", "2"],
                 "fails": "Ray actor RolloutRayActor",
                 "cause": "ValueError: current platform cpu does not support ray."},
}  # fmt: skip
# One run's limit: a hung run fails its condition instead of the whole smoke (a tiny-model condition takes 1.5-3 min
# on an idle 2-core VM, the SmolLM2 one 40 min; some VMs are 2-3x slower)
RUN_TIMEOUT_S = int(os.environ.get("SMOKE_CPU_RUN_TIMEOUT_S", "900"))
SMOLLM2_RUN_TIMEOUT_S = 8 * RUN_TIMEOUT_S
SYNC_TOLERANCE = 0.1  # max |vLLM - actor| log-prob of a sampled token after a sync (both bf16; measured < 0.03)

# --model smollm2: the same fork on a real pretrained LM (SmolLM2-135M-Instruct, a 4-bit Q4_1 quantization of the
# release, dequantized; openrlhf_geo.real_lm), what users' Llama models bring and the tiny Qwen2 cannot: a Llama with
# tied embeddings through the actor -> vLLM weight sync, a 49k vocabulary in SALT's features, a real chat template.
# The real task: word problems in the model's chat template (openrlhf_geo.lab.word_task), math-verify's reward
# (openrlhf_geo/rewards/math_verify.py). These flags follow COMMON (argparse keeps the last value). Sized for a CPU
# without bf16 instructions: 4 prompts x 4 samples of at most 64 tokens per step, 2 steps (19 min per step on an AVX2
# 2-core VM, 16 of them DeepSpeed's bf16 update); 8 prompts x 4 of 128 tokens, with one thread per actor, took 3.6 min
# to sample and 4.3 min for the experience forward of one step, and its update did not fit.
SMOLLM2_FLAGS = [
    "--data.input_key", "prompt", "--data.label_key", "answer", "--data.max_samples", "8",
    "--data.max_len", "320", "--rollout.max_new_tokens", "64", "--rollout.temperature", "0.6",
    "--rollout.batch_size", "4", "--rollout.micro_batch_size", "4",
    "--train.batch_size", "16", "--train.micro_batch_size", "4", "--actor.adam.lr", "1e-5",
]  # fmt: skip
SMOLLM2_CONDITIONS = {
    # GRPO's loss with SALT's advantages and GeoAlign's curation under flipped rewards: every geometry path at once
    "smollm2_salt_geoalign_flip": {
        "flags": ["--advantage_estimator", "salt", *GEOALIGN, *FLIPS],
        "finite": [*SALT, "salt/n_eff_out", *GEO, *NOISE],
        # per rollout max |vLLM - actor| log-prob with the same weights (step 1): 0.27 mean, 0.49 max over 16
        # rollouts (vllm_kl -9e-5). At lr 1e-5 one update moves the log-probs less than that, so this check only
        # catches a sync that corrupts weights, not a stale engine: the tiny model's runs (lr 5e-3) test staleness.
        "sync_baseline": 1.5,
    },
}


# Binary and roughly balanced for a random model, so groups have spread (SALT, GeoAlign pairs, flips). It runs in the
# vLLM engine's actor: with OPENRLHF_GEO_DUMP_DIR set it records which engine (process, Ray node) scored which
# prompts (their labels), for the per-engine weight-sync check (check_ranks).
REWARD_FUNC = """import json
import os

import ray
import torch


def reward_func(queries, prompts, labels):
    r = torch.tensor([float(sum(map(ord, q[len(p):])) % 2) for q, p in zip(queries, prompts)])
    folder = os.environ.get("OPENRLHF_GEO_DUMP_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        record = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "labels": list(labels)}
        with open(os.path.join(folder, "rewards.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\\n")
    return {"rewards": r, "scores": r, "extra_logs": {}}
"""


# The prompt's text as it is (a recipe's --data.apply_chat_template; a text-only prompt's content is its string)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_assets(out: Path) -> None:
    """Tiny Qwen2 (head_dim 64: vLLM's CPU attention rejects 16), byte-level BPE tokenizer, math and HH prompts,
    a reward-function file, an HH SFT set and a stand-in ArmoRM."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    (out / "reward_func.py").write_text(REWARD_FUNC)  # also into assets built before it changed
    if (out / "done").is_file():
        (out / "model" / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # likewise
        return
    pairs = [(a % 10, (3 * a + 1) % 10) for a in range(PROMPTS * 2)]
    corpus = [f"Q: {a} + {b} = ? A: the answer is {a + b}" for a in range(10) for b in range(10)]
    corpus += [
        f"Human: what is {a} + {b}?\n\nAssistant: the answer is {a + b}, of course: that makes it!" for a, b in pairs
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out / "model")
    config = Qwen2Config(
        vocab_size=384,  # >= the tokenizer's entries
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=hf_tok.eos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out / "model")
    with open(out / "prompts.jsonl", "w") as f:
        for a, b in pairs[:PROMPTS]:
            f.write(json.dumps({"input": f"Q: {a} + {b} = ? A:", "label": str(a + b)}) + "\n")
    with open(out / "hh_prompts.jsonl", "w") as f:
        for a, b in pairs[:PROMPTS]:
            f.write(json.dumps({"input": f"Human: what is {a} + {b}?\n\nAssistant:", "label": ""}) + "\n")
    # several phrasings per answer: the SFT model keeps sampling different responses, so the reward model's scores
    # differ within a group (GeoAlign needs pairs; an SFT onto one phrasing collapsed the groups on some machines)
    phrasings = (" it is {}.", " the answer is {}.", " {}, of course.", " that makes {}!")
    with open(out / "hh_sft.jsonl", "w") as f:
        for a, b in pairs:
            for phrase in phrasings:
                row = {"prompt": f"Human: what is {a} + {b}?\n\nAssistant:", "chosen": phrase.format(a + b)}
                f.write(json.dumps(row) + "\n")
    spec = importlib.util.spec_from_file_location("armorm_standin", REPO / "tests/fixtures/armorm_standin/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(out / "armorm_standin")
    (out / "done").write_text("")


def build_smollm2_assets(out: Path) -> None:
    """A link to the converted SmolLM2 (converted once into the cache, as `openrlhf-geo model smollm2` does) and
    PROMPTS word problems rendered in its chat template, with their answers."""
    from transformers import AutoTokenizer

    from openrlhf_geo.lab import word_task
    from openrlhf_geo.lab.task import write_jsonl
    from openrlhf_geo.real_lm import convert

    if (out / "done").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    model = convert()
    problems = word_task.word_problems(PROMPTS, seed=1)
    write_jsonl(out / "prompts.jsonl", word_task.dataset_rows(AutoTokenizer.from_pretrained(model), problems))
    (out / "model").unlink(missing_ok=True)
    (out / "model").symlink_to(model)
    (out / "done").write_text("")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(command, log_path: Path, env, cwd: Path, timeout=RUN_TIMEOUT_S, grace=60) -> tuple[int, list[str]]:
    """Run `command` in a new session for at most `timeout` s; (exit code, what of the session was left running
    `grace` s after it exited, then stopped). A run past the limit is stopped and reported as exit code 124."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hung run fails its condition; the next conditions still run
            os.killpg(proc.pid, signal.SIGTERM)
            left = stop_session(proc.pid, grace=10)
            log.write(f"\nsmoke_cpu: stopped after {timeout} s (SMOKE_CPU_RUN_TIMEOUT_S)\n")
            return 124, left
        except BaseException:  # Ctrl-C or SIGTERM of this script: the run (its own session) is stopped now
            os.killpg(proc.pid, signal.SIGTERM)
            stop_session(proc.pid, grace=10)
            raise
    return code, stop_session(proc.pid, grace)


def stop_session(sid: int, grace: float = 60) -> list[str]:
    """Stop what is left of session `sid` (ours: started with start_new_session, so sid is the run's pid) after
    `grace` seconds; -> the command lines that were left. A session, not a process group: the fork has Ray put
    each worker in its own process group (RAY_process_group_cleanup_enabled), all of them in this session."""
    import psutil

    left = []
    deadline = time.time() + grace  # Ray's and vLLM's processes exit on their own, in seconds on an idle machine
    while time.time() < deadline:
        left = [p for p in psutil.process_iter(["cmdline"]) if _sid(p.pid) == sid]
        if not left:
            return []
        time.sleep(0.5)
    names = [" ".join(p.info["cmdline"] or []).strip()[:120] or f"pid {p.pid}" for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:  # gone in the meantime
            pass
    return names


def _sid(pid):
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def read_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every TensorBoard run under the folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in sorted(tensorboard_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def weight_change(before: Path, after: Path) -> float:
    """max |w_after - w_before| over the policy's parameters (HF safetensors folders). A LoRA run saves only its
    adapters (PEFT's adapter_model.safetensors): its weights are the base model's merged with them, W + scale·B·A,
    so the change is max |scale·B·A| over the adapted layers."""
    from safetensors.torch import load_file

    if (after / "adapter_model.safetensors").is_file():
        config = json.loads((after / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
        adapters = load_file(after / "adapter_model.safetensors")
        return max(
            float((scale * adapters[k.replace(".lora_A.", ".lora_B.")].float() @ a.float()).abs().max())
            for k, a in adapters.items()
            if ".lora_A." in k
        )
    a, b = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    return max(float((b[k].float() - a[k].float()).abs().max()) for k in a)


def sync_gaps(dump: Path) -> dict[int, float]:
    """step -> max |vLLM - actor| log-prob of the sampled tokens, from the run's dumps."""
    import torch

    gaps = {}
    for path in sorted(dump.glob("step*.pt")):
        record = torch.load(path, weights_only=False)
        if record.get("logprob_gap") is not None:
            gaps[int(path.stem[4:])] = float(record["logprob_gap"].max())
    return gaps


def check_turns(spec, dump: Path, result: dict) -> list[str]:
    """With spec's "turns" (a multi-turn agent's): every rollout of every dumped step has that many action spans
    (maximal runs of action tokens, the model's turns); their per step min and max go to result["action_spans"]."""
    if "turns" not in spec:
        return []
    import torch

    spans = [torch.load(p, weights_only=False)["spans"].tolist() for p in sorted(dump.glob("step*.pt"))]
    result["action_spans"] = [{"min": min(n), "max": max(n)} for n in spans]
    if not spans or any(n != [spec["turns"]] * len(n) for n in spans):
        return [f"rollouts without {spec['turns']} action spans each: {result['action_spans']} (in {dump})"]
    return []


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def flag_value(flags, flag):
    """The value argparse keeps for `flag` in `flags` (the last one given), None if absent."""
    found = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == flag]
    return found[-1] if found else None


def labelled_prompts(prompts: Path, run: Path) -> Path:
    """run/prompts.jsonl: the prompts, each labelled with its own id p00, p01, ... (the smoke's reward ignores labels):
    the multi-rank records name prompts by their labels (check_ranks)."""
    rows = read_jsonl(prompts)
    path = run / "prompts.jsonl"
    path.write_text("".join(json.dumps({**row, "label": f"p{i:02d}"}) + "\n" for i, row in enumerate(rows)))
    return path


def check_ranks(dump: Path, ranks: int, engines: int, stale=False) -> tuple[list[str], dict]:
    """The multi-rank checks on the records of one run with prompts labelled by id (OPENRLHF_GEO_DUMP_DIR: the
    experience maker's step<N>.pt, each policy rank's rank<r>.jsonl, the engines' rewards.jsonl):
    - at every rollout step, optimizer step i trained on exactly one SALT partition across the ranks (the ranks'
      rollouts together are all of that partition's, SALT's partitions being consecutive prompts in the experience
      maker's order), and each epoch visits every partition once;
    - after every optimizer step, every rank holds the same weights and DeepSpeed counted exactly one step;
    - every vLLM engine generated rollouts at every step, with log-probs of the sampled tokens equal to the actor's
      (max gap of its rollouts <= SYNC_TOLERANCE): after each weight sync, and at a fresh run's first step, where
      both load the initial weights (a resumed run syncs the checkpoint's weights before its first rollout); with
      `stale` (asynchronous training: later rollouts come from a policy behind the actor) at the first step only.
    -> (problems, numbers for the summary)."""
    from collections import Counter

    import torch

    dumps = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted(dump.glob("step*.pt"))}
    records = [read_jsonl(dump / f"rank{r}.jsonl") for r in range(ranks)]
    counts = [len(r) for r in records]
    per_step, rest = divmod(counts[0], max(len(dumps), 1))
    if not dumps or not per_step or rest or len(set(counts)) > 1:
        return [f"{len(dumps)} rollout steps dumped, optimizer steps recorded per rank {counts} (in {dump})"], {}
    problems = []
    for r, steps in enumerate([x["global_step"] for x in recs] for recs in records):
        if steps != list(range(steps[0], steps[0] + len(steps))):
            problems.append(f"rank {r}: DeepSpeed's global steps {steps}, not one per recorded optimizer step")
    order = {}  # rollout step -> the partition each optimizer step trained on
    for k, (t, step) in enumerate(sorted(dumps.items())):
        labels = step["labels"]
        size = step["advantage"]["inputs"]["partition_prompts"] * len(labels) // (int(step["group_ids"].max()) + 1)
        partitions = [Counter(labels[i : i + size]) for i in range(0, len(labels), size)]
        order[t] = []
        for i in range(per_step):
            done = [recs[k * per_step + i] for recs in records]
            together = sum((Counter(x["labels"]) for x in done), Counter())
            found = [p for p, partition in enumerate(partitions) if partition == together]
            order[t].append(found[0] if found else None)
            if not found:
                problems.append(f"rollout step {t}, optimizer step {i + 1}: the ranks trained on {dict(together)}, "
                                "not one SALT partition")  # fmt: skip
            if len({x["weights"] for x in done}) != 1:
                problems.append(f"rollout step {t}, optimizer step {i + 1}: the ranks' weights differ after it")
        for e in range(0, per_step, len(partitions)):
            epoch = order[t][e : e + len(partitions)]
            if None in epoch or sorted(epoch) != list(range(len(partitions))):
                problems.append(f"rollout step {t}: an epoch trained on partitions {epoch}")
    rewards = read_jsonl(dump / "rewards.jsonl")
    scored = {x["pid"] for x in rewards}
    if len(scored) != engines:
        problems.append(f"{len(scored)} vLLM engines scored rollouts, not {engines}")
    # the reward calls in the order they were made: a step's rollouts are all scored before the next step generates
    # (prompts recur across episodes), so the stream splits into the steps' rollouts in step order
    stream = [(label, x["pid"]) for x in rewards for label in x["labels"]]
    gaps = {}
    for t, step in sorted(dumps.items()):
        gap, labels = step["logprob_gap"], step["labels"]
        ours, stream = stream[: len(labels)], stream[len(labels) :]
        engine_of = {}  # prompt label -> the engines (processes) that scored its rollouts at this step
        for label, pid in ours:
            engine_of.setdefault(label, set()).add(pid)
        served = [engine_of.get(label, set()) for label in labels]
        if gap is None or Counter(label for label, _ in ours) != Counter(labels) or any(len(e) != 1 for e in served):
            problems.append(f"rollout step {t}: no vLLM log-probs, or its prompts not each scored by one engine")
            continue
        gaps[t] = {}
        for (pid,), g in zip(served, gap.tolist()):
            gaps[t][pid] = max(gaps[t].get(pid, 0.0), g)
        idle = sorted(scored - set(gaps[t]))
        if idle:
            problems.append(f"rollout step {t}: engines {idle} generated none of its rollouts")
        bad = {pid: g for pid, g in gaps[t].items() if not g <= SYNC_TOLERANCE and not (stale and t > min(dumps))}
        if bad:
            problems.append(f"rollout step {t}: engines' log-probs differ from the actor's: {bad}")
    numbers = {
        "optimizer_steps_per_rollout_step": per_step,
        "partition_order": order,
        "engine_gap": {t: {str(pid): round(g, 5) for pid, g in by.items()} for t, by in gaps.items()},
        "rank_nodes": [recs[0]["node"] for recs in records],
        "engine_nodes": {str(x["pid"]): x["node"] for x in rewards},
    }
    return problems, numbers


def check_run(name, spec, run: Path, code, left, assets: Path, model: Path) -> dict:
    scalars = read_scalars(run / "tensorboard") if (run / "tensorboard").is_dir() else {}
    steps = sorted({s for values in scalars.values() for s in values})
    problems = [f"left running after exit, stopped: {p}" for p in left]
    result = {"steps": len(steps), "first_step": steps[0] if steps else None}
    if "fails" in spec:
        # the fork's own line (a parse-time refusal: upstream's parser's); Ray may still print its workers' last log
        # lines after it
        own = ("openrlhf-geo: ", "train_ppo_ray.py: error: ")
        log = (run / "train.log").read_text()
        lines = [x for x in log.splitlines() if x.startswith(own)]
        result["error"] = lines[-1] if lines else ""
        said = spec["fails"] in result["error"] and spec.get("cause", "") in log
        if code in (0, 124) or len(lines) != 1 or not said:  # 124: it hung, stopped at the run's limit
            expected = f"a one-line error with {spec['fails']!r} (the log saying {spec.get('cause')!r})"
            problems.append(f"expected {expected}, got exit {code}: {result['error']}")
        return {"ok": not problems, "problems": problems, **result}
    if code == 124:
        problems.append(f"timed out, stopped (see {run / 'train.log'})")
    elif code != 0:
        problems.append(f"exit code {code} (see {run / 'train.log'})")
    if not steps:
        problems.append("no step logged")
    for key in spec.get("finite", []):
        values = scalars.get(f"train/{key}", {})
        bad = [s for s in steps if not math.isfinite(values.get(s, math.nan))]
        if bad:
            problems.append(f"train/{key} missing or not finite at steps {bad}")
    for tag, values in scalars.items():
        infinite = [s for s, v in values.items() if math.isinf(v)]
        if infinite:
            problems.append(f"{tag} is infinite at steps {infinite}")
    if any((run / "final" / f"{kind}.safetensors").is_file() for kind in ("model", "adapter_model")):
        result["weight_change"] = weight_change(model, run / "final")
        if not result["weight_change"] > 0:
            problems.append("the policy's weights did not change")
    elif code == 0:
        problems.append("no final model saved")
    result["sync_gap"] = sync_gaps(run / "dump")
    synced = {s: g for s, g in result["sync_gap"].items() if s > min(result["sync_gap"], default=0)}
    if code == 0 and not synced and spec.get("sync", True):
        problems.append("no step after a weight sync has vLLM log-probs to compare")
    tolerance = SYNC_TOLERANCE
    if "sync_baseline" in spec and result["sync_gap"]:
        # a real LM in bf16: vLLM's CPU kernels and the actor's eager forward already differ by more than
        # SYNC_TOLERANCE with the same weights (the first step, before any sync); a sync must not widen that gap
        tolerance = spec["sync_baseline"] * result["sync_gap"][min(result["sync_gap"])]
        result["sync_tolerance"] = tolerance
    # stale: the rollouts after the first step come from a policy behind the actor; the first step is compared
    compared = {s: g for s, g in result["sync_gap"].items() if s not in synced} if spec.get("stale") else synced
    bad_sync = {s: g for s, g in compared.items() if not g <= tolerance}
    if bad_sync:
        problems.append(f"vLLM's log-probs differ from the actor's after a weight sync: {bad_sync}")
    problems += check_turns(spec, run / "dump", result)
    if "ranks" in spec and code == 0:
        engines = int(flag_value([*COMMON, *spec["flags"]], "--vllm.num_engines"))
        more, result["ranks"] = check_ranks(run / "dump", spec["ranks"], engines, spec.get("stale", False))
        problems += more
    result["last_step"] = {t: v[max(v)] for t, v in scalars.items() if v and t.startswith("train/")}
    return {"ok": not problems, "problems": problems, **result}


def sft(assets: Path, run: Path, env, flags) -> tuple[int, list[str]]:
    """Upstream's SFT (DeepSpeed's launcher, one CPU rank) on the patched copy, with `flags`, on HH-format pairs."""
    root = subprocess.run(
        [sys.executable, "-m", "openrlhf_geo.cli", "fork", "path", "--device", "cpu"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    sft_env = dict(env, PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    command = [
        # this interpreter's launcher: `python smoke_cpu.py` without the venv's bin on PATH
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()),
        "--module", "openrlhf.cli.train_sft",
        "--model.model_name_or_path", str(assets / "model"), "--data.dataset", str(assets / "hh_sft.jsonl"),
        "--data.input_key", "prompt", "--data.output_key", "chosen", "--ckpt.output_dir", str(run / "sft"),
        "--ckpt.path", str(run / "sft_ckpt"), "--logger.tensorboard_dir", str(run / "sft_tensorboard"), *flags,
    ]  # fmt: skip
    return run_group(command, run / "sft.log", sft_env, run)


def serve_rm(assets: Path, run: Path, env):
    """`openrlhf-geo serve-rm` on the stand-in ArmoRM, 127.0.0.1, a free port: (process, URL)."""
    port = free_port()
    with open(run / "serve_rm.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "openrlhf_geo.cli", "serve-rm", "--model", str(assets / "armorm_standin"),
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "fp32"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    deadline = time.time() + 120
    while "serving" not in (run / "serve_rm.log").read_text():
        if proc.poll() is not None or time.time() > deadline:
            stop_session(proc.pid)
            raise RuntimeError(f"serve-rm did not start: {(run / 'serve_rm.log').read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}/get_reward"


def run_env(run: Path, model_name="tiny") -> dict:
    """The environment of one `train-ppo-ray` run of the smoke (also the fault-injection tests')."""
    env = dict(os.environ, OPENRLHF_GEO_DUMP_DIR=str(run / "dump"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("RAY_ADDRESS", None)  # each run starts (and stops) its own local head
    # vLLM's CPU kernels follow the machine's own ISA: an AVX2 cap left by the demo's kernel pinning (local.kernels)
    # makes its bf16 brgemm abort ("only supported ... when `amx` is supported")
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        env.pop(key, None)
    if model_name == "smollm2":  # the actors' torch on every core (Ray gives each 1 thread)
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return env


def train_command(run: Path, ckpt: Path, flags, model: Path, prompts: Path, reward: str, model_name="tiny", sync=True):
    """`openrlhf-geo train-ppo-ray` with the smoke's common flags, then `flags` (argparse keeps the last value)."""
    return [
        sys.executable, "-m", "openrlhf_geo.cli", "train-ppo-ray", *COMMON,
        *(SMOLLM2_FLAGS if model_name == "smollm2" else []),
        "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(prompts), "--reward.remote_url", reward,
        "--ckpt.output_dir", str(run / "final"), "--logger.tensorboard_dir", str(run / "tensorboard"),
        "--ckpt.path", str(ckpt), *flags, *(SYNC if sync else []),
    ]  # fmt: skip


def run_condition(name, spec, out: Path, assets: Path, model_name="tiny") -> dict:
    run = out / name
    run.mkdir(parents=True, exist_ok=True)
    env = run_env(run, model_name)
    start = time.time()
    model, prompts, reward, server, left = assets / "model", assets / "prompts.jsonl", None, None, []
    timeout = SMOLLM2_RUN_TIMEOUT_S if model_name == "smollm2" else RUN_TIMEOUT_S
    shutil.rmtree(run / "dump", ignore_errors=True)  # a rerun's records start empty (ranks' and engines' append)
    if "ranks" in spec:
        prompts = labelled_prompts(prompts, run)
    if model_name == "smollm2":  # the real task's reward
        reward = str(REPO / "openrlhf_geo/rewards/math_verify.py")
    try:
        if spec.get("hh"):
            sft_start = time.time()
            code, left = sft(assets, run, env, spec.get("sft", SFT))
            sft_s = round(time.time() - sft_start, 1)
            if code != 0:
                return {"ok": False, "problems": [f"SFT failed, exit {code} (see {run / 'sft.log'})"], "sft_s": sft_s}
            model, prompts = run / "sft", assets / "hh_prompts.jsonl"
            server, reward = serve_rm(assets, run, env)
        # a rerun of the smoke in its OUT_DIR replaces its runs (the fork refuses a used output folder otherwise)
        begin = ["--ckpt.load_enable", "--train.num_episodes", "2"] if "after" in spec else ["--ckpt.overwrite"]
        flags = [flag.replace("{assets}", str(assets)) for flag in spec["flags"]]
        command = train_command(
            run, out / spec.get("after", name) / "ckpt", [*begin, *flags], model, prompts,
            reward or str(assets / "reward_func.py"), model_name, spec.get("sync", True),
        )  # fmt: skip
        (run / "command.json").write_text(json.dumps(command, indent=1) + "\n")
        # the driver stops what its run started before it returns (fork.launch.RunProcesses)
        code, more = run_group(command, run / "train.log", env, run, timeout, grace=3)
        left += more
    finally:
        if server is not None:
            server.terminate()
            server.wait()
            left += stop_session(server.pid)
    result = check_run(name, spec, run, code, left, assets, model)
    for key in ("dropped", "sft_dropped"):
        if key in spec:
            result[key] = spec[key]
    if spec.get("hh"):
        result["sft_s"] = sft_s
    result["wall_s"] = round(time.time() - start, 1)
    return result


# ── two Ray nodes on 127.0.0.1, jobs submitted to them (the "cluster" conditions) ──

# Each node's own ports (two nodes on one machine would share Ray's defaults)
PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port")  # fmt: skip
GPU_SLOTS_PER_NODE = 3  # 2 engines + 2 policy + 2 reference ranks: the placement groups fill both nodes
# A job's processes on the cluster: its driver, its supervisor, its actors, vLLM's engine processes
JOB_PROCESSES = ("train-ppo-ray", "JobSupervisor", "_ray_internal_job_actor", "PolicyModelActor",
                 "ReferenceModelActor", "RolloutRayActor", "PPOTrainer", "VLLM::")  # fmt: skip
# lib/common.sh's submit_train (`ray job submit --runtime-env-json ... -- python3 -m openrlhf_geo.cli train-ppo-ray`)
SUBMIT = (
    'set -euo pipefail; SCRIPT_DIR=$1; shift; source "$SCRIPT_DIR/lib/common.sh"; RUNTIME_ENV=$SMOKE_RUNTIME_ENV; '
    'submit_train "$@"'
)
# A driver on the cluster: a task on the second node reports the openrlhf it imported, with the fork's runtime_env
# (`shipped`: py_modules + the start-up check), or with the start-up check alone (`bare`: no copy shipped)
NODE_PROBE = """
import json
import os
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from openrlhf_geo.fork import install

if sys.argv[1] == "shipped":
    install.activate(install.materialize(device="cpu"))
    runtime_env = install.worker_runtime_env()
else:
    runtime_env = {"worker_process_setup_hook": "openrlhf_geo.fork.install.check_worker"}
# the workers record their imports (check_worker) where the driver was told to; raylets started by `ray start` do
# not pass the driver's environment to them
runtime_env["env_vars"] = {"OPENRLHF_GEO_DUMP_DIR": os.environ["OPENRLHF_GEO_DUMP_DIR"]}
ray.init(runtime_env=runtime_env)
second = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" not in n["Resources"]][0]


@ray.remote(num_cpus=0)
def imported():
    import openrlhf
    node = ray.get_runtime_context().get_node_id()
    return [getattr(openrlhf, "__openrlhf_geo_fork__", None), openrlhf.__file__, node]


try:
    there = imported.options(scheduling_strategy=NodeAffinitySchedulingStrategy(second, soft=False))
    result = {"node": second, "imported": ray.get(there.remote(), timeout=120)}
except Exception as e:
    result = {"node": second, "error": f"{type(e).__name__}: {e}"}
print("PROBE " + json.dumps(result), flush=True)
"""


def wait_for_line(path: Path, text: str, proc, timeout) -> None:
    deadline = time.time() + timeout
    while text not in path.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{path.name}: no {text!r} (exit {proc.poll()}): {path.read_text()[-2000:]}")
        time.sleep(0.5)


class RayNodes:
    """A head and a second node on 127.0.0.1, started as users start a cluster (`ray start --head --block`, then
    `ray start --address ... --block`), each in its own session with its own temp dir, ports and worker ports,
    declaring GPU_SLOTS_PER_NODE GPU slots. Stopped by their own handles (SIGTERM to each session, then whatever of
    it is left after `grace`), also on failure; `left` lists what had to be killed."""

    def __init__(self, run: Path, env):
        self.run, self.env, self.procs, self.temps, self.left = run, env, [], [], []
        self.gcs, self.dashboard = free_port(), free_port()

    @property
    def job_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def jobs(self):
        """The Ray Jobs API client of this cluster (what `ray job status / logs / stop` call; the CLI's output is
        colored and its start-up takes seconds, longer than a tiny-model step)."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.job_address)

    def __enter__(self):
        roles = [
            ["--head", "--port", str(self.gcs), "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
             "--dashboard-port", str(self.dashboard), "--ray-client-server-port", str(free_port())],
            ["--address", f"127.0.0.1:{self.gcs}"],
        ]  # fmt: skip
        try:
            for i, role in enumerate(roles):
                # a short temp dir: Ray's socket paths must fit in 107 characters
                self.temps.append(tempfile.mkdtemp(prefix=f"smoke-ray{i + 1}-"))
                ports = [part for flag in PORT_FLAGS for part in (flag, str(free_port()))]
                command = [
                    str(Path(sys.executable).parent / "ray"), "start", "--block", *role, *ports,
                    "--node-ip-address", "127.0.0.1", "--temp-dir", self.temps[-1], "--disable-usage-stats",
                    "--num-cpus", "8", "--num-gpus", str(GPU_SLOTS_PER_NODE),
                    "--min-worker-port", str(21000 + 1000 * i), "--max-worker-port", str(21999 + 1000 * i),
                ]  # fmt: skip
                log = self.run / f"ray_node{i + 1}.log"
                with open(log, "w") as f:
                    self.procs.append(
                        subprocess.Popen(
                            command,
                            stdout=f,
                            stderr=subprocess.STDOUT,
                            env=self.env,
                            cwd=self.run,
                            start_new_session=True,
                        )  # fmt: skip
                    )
                wait_for_line(log, "Ray runtime started", self.procs[-1], 180)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self, grace=30) -> None:
        for proc in reversed(self.procs):  # the second node first
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.left += stop_session(proc.pid, grace)
        self.procs = []
        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)

    def job_processes(self) -> list[str]:
        """Command lines of the cluster's processes that belong to a job (JOB_PROCESSES)."""
        import psutil

        sessions = {proc.pid for proc in self.procs}
        found = []
        for p in psutil.process_iter(["cmdline"]):
            line = " ".join(p.info["cmdline"] or [])
            if _sid(p.pid) in sessions and any(marker in line for marker in JOB_PROCESSES):
                found.append(line[:120])
        return found


def node_probe(nodes: RayNodes, run: Path, kind: str) -> dict:
    """NODE_PROBE as a driver on the cluster (its workers record their imports in run/probe_<kind>) -> its result,
    with `workers`: check_workers' problems for the second node."""
    folder = run / f"probe_{kind}"
    env = dict(nodes.env, RAY_ADDRESS=f"127.0.0.1:{nodes.gcs}", OPENRLHF_GEO_DUMP_DIR=str(folder))
    code, left = run_group([sys.executable, "-c", NODE_PROBE, kind], run / f"probe_{kind}.log", env, run, 300)
    lines = [x for x in (run / f"probe_{kind}.log").read_text().splitlines() if x.startswith("PROBE ")]
    result = json.loads(lines[-1][len("PROBE ") :]) if lines else {"error": f"no result, exit {code}"}
    result["workers"] = check_workers(folder, result.get("node"))
    result["left"] = left
    return result


def check_workers(dump: Path, node) -> list[str]:
    """Problems with what the Ray workers on `node` imported (workers.jsonl, written by the fork's start-up check):
    none recorded, or one whose openrlhf is not the fork's copy shipped by py_modules."""
    from openrlhf_geo.fork.install import FORK_ID

    there = [w for w in read_jsonl(dump / "workers.jsonl") if w["node"] == node]
    if not there:
        return [f"no worker recorded its import on node {node}"]
    return [
        f"worker pid {w['pid']} on node {node} imported {w['openrlhf']} (fork id {w['fork_id']})"
        for w in there
        if w["fork_id"] != FORK_ID or "py_modules_files" not in w["openrlhf"]
    ]


def job_id(log: Path) -> str | None:
    found = re.findall(r"Job '(\S+)' submitted successfully", log.read_text())
    return found[-1] if found else None


def job_status(nodes: RayNodes, job: str | None) -> str | None:
    return nodes.jobs().get_job_status(job).value if job else None


def run_job(nodes: RayNodes, run: Path, ckpt: Path, flags, model: Path, prompts: Path, reward: str, stop_at=None):
    """One `train-ppo-ray` job on the cluster through lib/common.sh's submit_train, its outputs and records in `run`
    (OPENRLHF_GEO_DUMP_DIR in the job's env_vars, as a user's job passes its own). stop_at: stop it (the Jobs API's
    stop, what `ray job stop` calls) once that rollout step's experience is made (its dump written), mid-step.
    -> (job id, status, the submit CLI's exit code, seconds)."""
    run.mkdir(parents=True, exist_ok=True)
    start = time.time()
    runtime_env = {"working_dir": str(REPO), "env_vars": {"OPENRLHF_GEO_DUMP_DIR": str(run / "dump")}}
    env = dict(nodes.env, RAY_ADDRESS=nodes.job_address, SMOKE_RUNTIME_ENV=json.dumps(runtime_env))
    command = ["bash", "-c", SUBMIT, "submit_train", str(REPO / "examples/scripts"),
               *train_command(run, ckpt, flags, model, prompts, reward)[4:]]  # fmt: skip
    (run / "command.json").write_text(json.dumps(command, indent=1) + "\n")
    log = run / "submit.log"
    if stop_at is None:
        code, left = run_group(command, log, env, run)
        nodes.left += left
    else:
        with open(log, "w") as f:
            proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=run,
                                    start_new_session=True)  # fmt: skip
        try:
            step = run / "dump" / f"step{stop_at:04d}.pt"
            deadline = time.time() + RUN_TIMEOUT_S
            while not step.is_file() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.5)
            job = job_id(log)
            if job is not None:
                nodes.jobs().stop_job(job)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            nodes.left += stop_session(proc.pid, grace=10)
    job = job_id(log)
    return job, job_status(nodes, job), code, round(time.time() - start, 1)


def run_cluster_condition(name, spec, out: Path, assets: Path) -> dict:
    """The cluster condition: on two Ray nodes, (1) the second node's workers import the fork's copy shipped by
    py_modules, and the same check refuses them when it is not shipped; (2) a job with spec's flags, checkpointed
    every step (check_run and check_ranks, every worker on the second node the fork's, ranks on both nodes, its logs
    with salt/* and geo/*); (3) its resume as a second job, stopped mid-step by `ray job stop`: nothing of it left
    running, a checkpoint to resume; (4) the resume as a third job, from that checkpoint to the end."""
    from openrlhf_geo.fork.hooks import latest_tag
    from openrlhf_geo.fork.install import FORK_ID

    run = out / name
    shutil.rmtree(run, ignore_errors=True)  # a rerun starts over, its checkpoints included
    run.mkdir(parents=True)
    start = time.time()
    env = run_env(run)
    env.pop("OPENRLHF_GEO_DUMP_DIR")  # each job passes its own in its env_vars
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the job's python3
    env["RAY_process_group_cleanup_enabled"] = "true"  # set on the cluster (docs/architecture.md §3.2)
    env["PYTHONUNBUFFERED"] = "1"  # `ray start`'s and `ray job submit`'s lines reach their logs as printed
    model, reward, ckpt = assets / "model", str(assets / "reward_func.py"), run / "ckpt"
    prompts = labelled_prompts(assets / "prompts.jsonl", run)
    problems, result = [], {"jobs": {}}
    # 3 episodes of 2 steps: the stopped job starts at step 3, and a stop that lands late still leaves steps to resume
    resume, last = ["--ckpt.load_enable", "--train.num_episodes", "3"], 6
    with RayNodes(run, env) as nodes:
        shipped, bare = node_probe(nodes, run, "shipped"), node_probe(nodes, run, "bare")
        result["probe"] = {"shipped": shipped, "bare": bare}
        fork_id, path, node = shipped.get("imported") or [None, "", None]
        if fork_id != FORK_ID or "py_modules_files" not in path or node != shipped["node"] or shipped["workers"]:
            problems.append(f"a task on the second node, the fork's runtime_env: {shipped}")
        if "imported" in bare or not bare["workers"]:
            problems.append(f"a task on the second node, no copy shipped, was not refused: {bare}")
        second = shipped["node"]

        job, status, code, wall = run_job(nodes, run / "job1", ckpt, ["--ckpt.overwrite", *spec["flags"]], model,
                                          prompts, reward)  # fmt: skip
        first = check_run(name, spec, run / "job1", 0 if status == "SUCCEEDED" else 1, [], assets, model)
        logs = nodes.jobs().get_job_logs(job) if job else ""
        first["logged"] = {key: key in logs for key in ("salt/pr", "salt/alpha", "geo/pairs", "geo/flag_frac")}
        result["jobs"]["job1"] = {"id": job, "status": status, "exit": code, "wall_s": wall, **first}
        problems += [f"job 1: {p}" for p in first["problems"]]
        if status != "SUCCEEDED" or code != 0:
            problems.append(f"job 1: status {status}, `ray job submit` exit {code} (see {run / 'job1/submit.log'})")
        if not all(first["logged"].values()):
            problems.append(f"job 1: its logs lack metrics: {first['logged']}")
        problems += [f"job 1: {p}" for p in check_workers(run / "job1/dump", second)]
        placed = {
            *first.get("ranks", {}).get("rank_nodes", []),
            *first.get("ranks", {}).get("engine_nodes", {}).values(),
        }
        result["placement"] = first.get("ranks", {})
        if second not in placed or len(placed) != 2:
            problems.append(f"job 1: ranks and engines on nodes {sorted(placed, key=str)}, not on both")
        tag = latest_tag(ckpt / "_actor")
        if tag != "global_step2":
            problems.append(f"job 1: the checkpoint `latest` names {tag}, not global_step2")

        job, status, code, wall = run_job(nodes, run / "job2", ckpt, [*resume, *spec["flags"]], model, prompts,
                                          reward, stop_at=3)  # fmt: skip
        deadline, left = time.time() + 60, nodes.job_processes()
        while left and time.time() < deadline:
            time.sleep(1)
            left = nodes.job_processes()
        tag = latest_tag(ckpt / "_actor")
        result["jobs"]["job2"] = {"id": job, "status": status, "exit": code, "wall_s": wall, "left": left,
                                  "latest": tag}  # fmt: skip
        if status != "STOPPED":
            problems.append(f"job 2: status {status} after `ray job stop`, not STOPPED")
        if left:
            problems.append(f"job 2: left running 60 s after `ray job stop`: {left}")
        stopped_at = int(tag.removeprefix("global_step")) if tag else None
        if stopped_at not in range(2, last) or not (ckpt / "_actor" / tag).is_dir():
            problems.append(f"job 2: no checkpoint to resume after the stop (latest: {tag}; the run ends at {last})")

        job, status, code, wall = run_job(nodes, run / "job3", ckpt, [*resume, *spec["flags"]], model, prompts,
                                          reward)  # fmt: skip
        third = check_run(name, spec, run / "job3", 0 if status == "SUCCEEDED" else 1, [], assets, model)
        result["jobs"]["job3"] = {"id": job, "status": status, "exit": code, "wall_s": wall, **third}
        problems += [f"job 3: {p}" for p in third["problems"]]
        if status != "SUCCEEDED" or code != 0:
            problems.append(f"job 3: status {status}, `ray job submit` exit {code} (see {run / 'job3/submit.log'})")
        if third.get("first_step") != (stopped_at or 0) + 1 or latest_tag(ckpt / "_actor") != f"global_step{last}":
            problems.append(f"job 3: resumed at step {third.get('first_step')} (not after {tag}) or did not end at "
                            f"step {last} (latest: {latest_tag(ckpt / '_actor')})")  # fmt: skip
    problems += [f"left running after the cluster stopped, killed: {p}" for p in nodes.left]
    # the summary's shape of a run (test_smoke_cpu.py): the first job's
    keep = ("steps", "first_step", "weight_change", "sync_gap", "last_step", "ranks")
    summary = {key: result["jobs"]["job1"][key] for key in keep if key in result["jobs"].get("job1", {})}
    return {"ok": not problems, "problems": problems, **summary, **result, "wall_s": round(time.time() - start, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--model", choices=("tiny", "smollm2"), default="tiny",
        help="tiny: a 2-layer Qwen2 built from a config (the conditions below); smollm2: the real pretrained LM "
        f"(needs bash scripts/setup_cpu.sh real-lm), conditions {', '.join(SMOLLM2_CONDITIONS)}",
    )  # fmt: skip
    parser.add_argument("--conditions", help=f"comma-separated subset, run in order (tiny: {', '.join(CONDITIONS)})")
    parser.add_argument("--assets-only", action="store_true", help="write OUT/assets (model, data) and stop")
    args = parser.parse_args(argv)
    from openrlhf_geo.local.rundir import OutputClaimed, claim_output

    # OUT_DIR belongs to the smoke command that first wrote it (the demo's and the studies' protection): a rerun
    # proceeds there; a directory of other files, another command's or a busy one is one line, nothing changed
    command = "examples/scripts/smoke_cpu.py " + ("--assets-only" if args.assets_only else f"--model {args.model}")
    if args.assets_only:  # also the one-GPU smoke's assets (smoke_salt_geoalign_1gpu.sh)
        try:
            with claim_output(args.out.resolve(), command, "OUT_DIR") as out:
                build_assets(out / "assets")
        except OutputClaimed as e:
            print(f"smoke_cpu: {e}", file=sys.stderr)
            return 1
        return 0
    table = SMOLLM2_CONDITIONS if args.model == "smollm2" else CONDITIONS
    names = [c for c in (args.conditions or ",".join(table)).split(",") if c]
    unknown = [c for c in names if c not in table]
    if unknown:
        parser.error(f"unknown --conditions {unknown} for --model {args.model}; known: {', '.join(table)}")
    for name in names:
        after = table[name].get("after")
        if after and after not in names[: names.index(name)]:
            parser.error(f"condition {name} resumes {after}: list {after} before it")
    from openrlhf_geo.fork.install import ForkError
    from openrlhf_geo.fork.launch import check_cpu_engines

    # SIGTERM unwinds like Ctrl-C, so every run and server this script started is stopped by its own handle
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    try:
        check_cpu_engines()
    except ForkError as e:
        print(f"smoke_cpu: {e}", file=sys.stderr)
        return 1
    try:
        with claim_output(args.out.resolve(), command, "OUT_DIR") as out:
            if args.model == "smollm2":
                from openrlhf_geo.real_lm import AssetError

                assets = out / "assets_smollm2"
                try:
                    build_smollm2_assets(assets)
                except AssetError as e:
                    print(f"smoke_cpu: {e}", file=sys.stderr)
                    return 1
            else:
                assets = out / "assets"
                build_assets(assets)
            summary = {}
            for name in names:
                try:
                    if table[name].get("cluster"):
                        summary[name] = run_cluster_condition(name, table[name], out, assets)
                    else:
                        summary[name] = run_condition(name, table[name], out, assets, args.model)
                except Exception as e:  # the smoke's own failure: report it for this condition and go on
                    summary[name] = {"ok": False, "problems": [f"smoke_cpu.py: {type(e).__name__}: {e}"]}
                status = "ok" if summary[name]["ok"] else "FAILED: " + "; ".join(summary[name]["problems"])
                print(f"smoke_cpu {name}: {status} ({summary[name].get('wall_s')} s)", flush=True)
                (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    except OutputClaimed as e:
        print(f"smoke_cpu: {e}", file=sys.stderr)
        return 1
    failed = [n for n, s in summary.items() if not s["ok"]]
    print(f"smoke_cpu: {len(names) - len(failed)}/{len(names)} conditions passed; summary in {out / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
