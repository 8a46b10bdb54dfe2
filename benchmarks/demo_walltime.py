"""Per-step cost of the local engine for the demo's four methods, side by side, measured in one run.

    python benchmarks/demo_walltime.py [--model runs/demo/sft] [--steps 8] [--threads 1] [--repeats 2]
        [--kernels native pinned]

Prints, per kernel set and method, the median wall time of a step and of its phases (rollout incl. reward, old-policy
forward with features, GeoAlign curation, SALT solve, update), the ratio to GRPO and the process CPU time per step,
then each method's step-time ratio pinned / native and the same ratio for an SFT warm-up step (`task.sft`, the demo's
batch). Kernel sets: `native`, this CPU's own picks (ATen's best capability, MKL's and OpenBLAS's auto-detected
paths), and `pinned`, `local.kernels.PINNED`, what `openrlhf-geo demo` and `study` run with. The picks are made once
per process, so each set runs in its own process; the processes alternate (--repeats of each), so that load changes
on a shared machine hit both sets alike. Uses the demo's SFT model when it exists (realistic response lengths), else
a random-initialised one (responses run to max length). Median over steps after one warm-up step per method, methods
stepped round-robin; wall times on a shared machine vary, ratios less so.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from openrlhf_geo.lab.demo import METHODS
from openrlhf_geo.lab.recipe import METHOD_FLAGS, ROLLOUT_FLAGS, SFT
from openrlhf_geo.lab.task import addition_problems, build_model, build_tokenizer, sft, sft_rows
from openrlhf_geo.local import kernels
from openrlhf_geo.local.engine import Trainer
from openrlhf_geo.local.flags import parse_args
from openrlhf_geo.local.reward import make_reward_fn

KEYS = ("time/step_s", "time/rollout_s", "time/forward_s", "geo/time_s", "salt/solve_ms", "time/update_s")


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(opts):
    """In this process (one kernel set): {method: {key: median}} and {"sft_s": median SFT step seconds}."""
    torch.set_num_threads(opts.threads)
    rows = addition_problems(512, seed=0, carry_only=True)  # the demo's task
    reward_fn = make_reward_fn("math_verify")
    source = opts.model if Path(opts.model, "config.json").exists() else None
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
    results = {
        m: {
            **{k: statistics.median(t.get(k, 0.0) or 0.0 for t in timings[m]) for k in KEYS},
            "cpu_s": statistics.median(cpu[m]),
        }
        for m in METHODS
    }
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, SFT["hidden_size"], SFT["num_layers"])
    data = sft_rows(rows, 2, 0, SFT["strategies"], SFT["shortcut_rate"])
    sft_times = []
    for _ in range(opts.steps + 1):  # the first call warms up
        start = time.perf_counter()
        sft(model, tokenizer, data, 2, SFT["batch_size"], SFT["lr"])
        sft_times.append((time.perf_counter() - start) / 2)
    return {"methods": results, "sft_s": statistics.median(sft_times[1:]), "aten": kernels.active()["aten"]}


def child_env(kernel_set):
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINNED}
    return {**env, **kernels.PINNED} if kernel_set == "pinned" else env


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/demo/sft")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="processes per kernel set, alternating")
    p.add_argument("--kernels", nargs="+", choices=("native", "pinned"), default=["native", "pinned"])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measurement, JSON on stdout
    opts = p.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(measure(opts)))
        return
    source = opts.model if Path(opts.model, "config.json").exists() else None
    print(f"model: {source or 'random init (no SFT found at ' + opts.model + ')'}; threads {opts.threads}")
    argv = [sys.executable, __file__, "--child", "--model", opts.model, "--steps", str(opts.steps)]
    argv += ["--threads", str(opts.threads)]
    runs = {k: [] for k in opts.kernels}
    for _ in range(opts.repeats):
        for kernel_set in opts.kernels:
            out = subprocess.run(argv, env=child_env(kernel_set), capture_output=True, text=True, check=True).stdout
            runs[kernel_set].append(json.loads(out.split("RESULT ", 1)[1]))
    results = {}  # kernel set -> method -> key -> median over the repeats
    for kernel_set, repeats in runs.items():
        results[kernel_set] = {
            m: {k: statistics.median(r["methods"][m][k] for r in repeats) for k in (*KEYS, "cpu_s")} for m in METHODS
        }
    columns = ("step s", "x GRPO", "rollout", "forward", "geoalign", "salt ms", "update", "CPU s")
    print(f"{'kernels':>8} {'method':>15} " + " ".join(f"{c:>8}" for c in columns))
    for kernel_set, by_method in results.items():
        base = by_method["grpo"]["time/step_s"]
        label = f"{kernel_set}:{runs[kernel_set][0]['aten']}"
        for method, r in by_method.items():
            print(
                f"{label:>8} {method:>15} {r['time/step_s']:8.3f} {r['time/step_s'] / base:8.2f} "
                f"{r['time/rollout_s']:8.3f} {r['time/forward_s']:8.3f} {r['geo/time_s']:8.3f} "
                f"{r['salt/solve_ms']:8.2f} {r['time/update_s']:8.3f} {r['cpu_s']:8.3f}"
            )
        total = sum(r["cpu_s"] for r in by_method.values())
        print(f"{kernel_set}: CPU seconds for one step of each method: {total:.2f} (x steps x seeds = the RL budget)")
    if len(results) == 2:
        step = {m: results["pinned"][m]["time/step_s"] / results["native"][m]["time/step_s"] for m in METHODS}
        print("step time pinned / native: " + ", ".join(f"{m} {r:.2f}x" for m, r in step.items()))
        sft_s = {k: statistics.median(r["sft_s"] for r in repeats) for k, repeats in runs.items()}
        print(f"SFT step: native {sft_s['native']:.3f} s, pinned {sft_s['pinned']:.3f} s, pinned / native "
              f"{sft_s['pinned'] / sft_s['native']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
