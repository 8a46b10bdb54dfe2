"""Per-step cost of the local engine for the demo's four methods, side by side, measured in one run.

    python benchmarks/demo_walltime.py [--model runs/demo/sft] [--steps 8] [--threads 1]

Prints, per method, the median wall time of a step and of its phases (rollout incl. reward, old-policy forward with
features, GeoAlign curation, SALT solve, update), the ratio to GRPO and the process CPU time per step. Uses the demo's
SFT model when it exists (realistic response lengths), else a random-initialised one (responses run to max length).
Median over steps after one warm-up step per method, methods stepped round-robin; wall times on a shared machine
vary, ratios less so.
"""

import argparse
import resource
import statistics
from pathlib import Path

import torch

from openrlhf_geo.local.demo import METHOD_FLAGS, METHODS, ROLLOUT_FLAGS
from openrlhf_geo.local.engine import Trainer
from openrlhf_geo.local.task import addition_problems, build_model, build_tokenizer
from openrlhf_geo.local.train import make_reward_fn, parse_args


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/demo/sft")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    rows = addition_problems(512, seed=0, carry_only=True)  # the demo's task
    reward_fn = make_reward_fn("math_verify")
    source = opts.model if Path(opts.model, "config.json").exists() else None
    print(f"model: {source or 'random init (no SFT found at ' + opts.model + ')'}; threads {opts.threads}")
    trainers = {}
    for method in METHODS:
        argv = ["--data.prompt_dataset", "unused", *ROLLOUT_FLAGS, *METHOD_FLAGS[method]]
        args = parse_args([*argv, "--actor.model_name_or_path", source or "unused"])
        tokenizer = build_tokenizer()
        if source:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(source)
        else:
            model = build_model(tokenizer)
        trainers[method] = Trainer(args, model, tokenizer, rows, reward_fn)
        trainers[method].step()  # warm-up
    # round-robin over methods so that load changes on a shared machine hit every method alike
    timings, cpu = {m: [] for m in METHODS}, {m: [] for m in METHODS}
    for _ in range(opts.steps):
        for method, trainer in trainers.items():
            c0 = cpu_seconds()
            timings[method].append(trainer.step())
            cpu[method].append(cpu_seconds() - c0)
    keys = ("time/step_s", "time/rollout_s", "time/forward_s", "geo/time_s", "salt/solve_ms", "time/update_s")
    results = {
        m: {
            **{k: statistics.median(t.get(k, 0.0) or 0.0 for t in timings[m]) for k in keys},
            "cpu_s": statistics.median(cpu[m]),
        }
        for m in METHODS
    }
    base = results["grpo"]["time/step_s"]
    columns = ("step s", "x GRPO", "rollout", "forward", "geoalign", "salt ms", "update", "CPU s")
    print(f"{'method':>15} " + " ".join(f"{c:>8}" for c in columns))
    for method, r in results.items():
        print(
            f"{method:>15} {r['time/step_s']:8.3f} {r['time/step_s'] / base:8.2f} {r['time/rollout_s']:8.3f} "
            f"{r['time/forward_s']:8.3f} {r['geo/time_s']:8.3f} {r['salt/solve_ms']:8.2f} {r['time/update_s']:8.3f} "
            f"{r['cpu_s']:8.3f}"
        )
    total = sum(r["cpu_s"] for r in results.values())
    print(f"CPU seconds for one step of each method: {total:.2f} (x steps x seeds = the demo's RL CPU budget)")


if __name__ == "__main__":
    main()
