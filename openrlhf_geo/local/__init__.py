"""Single-process engine (CPU or one GPU) and the embedded demo.

task     the demo's task: two-digit addition in \\boxed{}, a `tokenizers` character tokenizer, a tiny Qwen2,
         SFT warm-up
engine   Trainer: rollout -> reward -> old-policy forward (log-probs, SALT features, hidden states) -> the
         geometry pipeline (noise, GeoAlign, SALT) around group advantages -> clipped surrogate (+ KL) -> AdamW
train    `openrlhf-geo train`: the engine on a jsonl dataset with the fork's flags
rundir   the run directory: lock, refusal to overwrite, crash-safe checkpoints, resume-time flag checks
tracking TensorBoard / wandb loggers with upstream's train/<key>, eval/<key> names
demo     `openrlhf-geo demo`: SFT once, then GRPO, +SALT, +GeoAlign under 10 % flipped rewards, and a report
report   summary.json, report.md and plots of a demo run
"""
