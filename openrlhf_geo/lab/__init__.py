"""The experiments on the local engine: the embedded demo and the studies, with their tasks.

recipe        the demo's recipe the studies share: data, SFT warm-up (cached), common and method flags, the run pool
demo          `openrlhf-geo demo`: SFT once, then GRPO, +SALT, +GeoAlign under 10 % flipped rewards, and a report
demo_report   summary.json, report.md and plots of a demo run
task          the demo's task: two-digit addition in \\boxed{}, a `tokenizers` character tokenizer, a tiny Qwen2, SFT
long_cot_task the chained-addition task of the long-CoT study; word_task: the real LM's word-problem task
study         `openrlhf-geo study NAME`; studies/: one module per study (`studies.MODULES`), the runner
"""
