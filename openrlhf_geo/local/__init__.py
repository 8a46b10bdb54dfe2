"""Single-process engine (CPU or one GPU) and the embedded demo.

task     the demo's task: two-digit addition in \\boxed{}, a `tokenizers` character tokenizer, a tiny Qwen2
engine   Trainer: rollout -> reward -> (noise) -> old-policy forward (log-probs, SALT features, hidden states)
         -> (GeoAlign) -> group advantages -> (SALT) -> clipped surrogate (+ KL) -> AdamW; SFT warm-up
train    `openrlhf-geo train`: the engine on a jsonl dataset with the fork's flags; checkpoint / resume
demo     `openrlhf-geo demo`: SFT once, then GRPO, +SALT, +GeoAlign under 10 % flipped rewards, and a report
report   plots and report.md of a demo run
"""
