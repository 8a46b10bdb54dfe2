"""`openrlhf-geo demo`: tiny SFT -> RL on CPU, GRPO vs GRPO+SALT vs GRPO+GeoAlign, with a report and plots.

1. Data: two-digit additions that need a carry in the ones column (train / held-out jsonl in <out>/data).
2. SFT warm-up of a tiny Qwen2 (cached in <out>/sft; the package ships it, `recipe.SHIPPED_SFT`, and
   --sft-from-scratch trains it here) on randomly drawn solutions: half of them worked solutions
   that carry correctly (`task.worked_solution`, "digits" strategy with random operand order and connectives, so
   that sampled correct responses differ, as an LLM's do), half the flawed "quick" procedure that drops the carry
   (`task.shortcut_solution`), which is wrong on every prompt of this task. RL thus starts near 50 % accuracy with
   wrong answers that mostly share one recognisable cause, the regime GeoAlign's premise is about (the report says
   what the errors are made of; this is a property of the synthetic task, not a claim about LLMs).
3. Four methods x --seeds seeds, same prompts per step and the same budget, each one `openrlhf-geo train` run:
   grpo, salt (exact LM-head features), grpo_noise and geoalign_noise (10 % flipped binary rewards).
4. The runs' logs in <out>/runs/<method>/seed<k>/ (metrics.jsonl, gdi.jsonl), and from them <out>/summary.json
   (every number of the report), <out>/report.md and PNG plots (`openrlhf_geo.lab.demo_report`).

<out> belongs to the demo configuration that first wrote it (`rundir.claim_output`, shared with the studies):
running it again reruns it there; another configuration, a study or a directory of other files is refused.
"""

import os
import shlex
import shutil
import sys
import time

import torch

from openrlhf_geo.lab import recipe
from openrlhf_geo.local import kernels
from openrlhf_geo.local.rundir import OutputClaimed, claim_output

METHODS = tuple(recipe.METHOD_FLAGS)
# (method, baseline) pairs the report compares, paired by seed: each method against GRPO, and GeoAlign against
# GRPO under the same reward noise
COMPARISONS = (("salt", "grpo"), ("grpo_noise", "grpo"), ("geoalign_noise", "grpo"), ("geoalign_noise", "grpo_noise"))
# the demo's size: the studies' recipe (recipe.FULL) cut to 20 RL steps, so that it fits in 10 min on a slow 2-core VM
# (docs/results.md has the protocol, and the numbers of --steps 60); the quick run stays in-process (imports dominate)
DEFAULT = {**recipe.FULL, "steps": 20}
QUICK = {"seeds": 1, "steps": 4, "eval_steps": 4, "sft_max_steps": 30, "workers": 1}


def build_parser():
    from openrlhf_geo.local.flags import FlagParser

    p = FlagParser(prog="openrlhf-geo demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke check: 1 seed, a few steps, short SFT (<= 60 s)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per method (default 5; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 20; --quick 4)")
    p.add_argument("--out", default=None, help="output directory (default runs/demo, runs/demo-quick with --quick)")
    p.add_argument(
        "--sft-target",
        type=float,
        default=None,
        help="stop SFT early once the held-out accuracy reaches this (default: the whole SFT schedule)",
    )
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-up steps (default 600; --quick 30)")
    p.add_argument(
        "--sft-from-scratch",
        action="store_true",
        help="train the SFT warm-up here (3-4 min) instead of copying the package's (the same bytes where the "
        "pinned CPU kernels run)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="runs in parallel processes, one CPU thread each (default 2; --quick 1)",
    )
    return p


def demo_command(args, seeds, steps):
    """The demo's identity for `claim_output`: the options its outputs depend on, resolved."""
    command = ["openrlhf-geo demo", *(["--quick"] if args.quick else []), f"--seeds {seeds} --steps {steps}"]
    command += [f"--sft-target {args.sft_target:g}"] if args.sft_target is not None else []
    return " ".join(command + ([f"--sft-steps {args.sft_steps}"] if args.sft_steps is not None else []))


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        preset = QUICK if args.quick else DEFAULT
        seeds = range(args.seeds if args.seeds is not None else preset["seeds"])
        steps = args.steps if args.steps is not None else preset["steps"]
        workers = args.workers if args.workers is not None else min(preset["workers"], os.cpu_count() or 1)
        if args.sft_steps is not None:
            preset = {**preset, "sft_max_steps": args.sft_steps}
        checks = (("--seeds", len(seeds)), ("--steps", steps), ("--workers", workers))
        for flag, value in (*checks, ("--sft-steps", preset["sft_max_steps"])):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1 (got {value})")
        if args.sft_target is not None and not 0 < args.sft_target <= 1:
            raise ValueError(f"--sft-target must be an accuracy in (0, 1] (got {args.sft_target})")
    except ValueError as error:
        print(f"openrlhf-geo demo: error: {error}", file=sys.stderr)
        return 2
    try:
        path = args.out or ("runs/demo-quick" if args.quick else "runs/demo")  # a smoke run never takes the demo's
        with claim_output(path, demo_command(args, len(seeds), steps)) as out:
            return run(args, out, preset, seeds, steps, workers)
    except OutputClaimed as error:
        print(f"openrlhf-geo demo: error: {error}", file=sys.stderr)
        return 2


def run(args, out, preset, seeds, steps, workers):
    """The demo in its claimed `out` (`main` checked the options) -> exit status."""
    from openrlhf_geo.lab import demo_report

    eval_steps = min(preset["eval_steps"], steps)
    start = time.perf_counter()
    torch.set_num_threads(1)  # a 0.13M-parameter model gains nothing from more; extra threads only contend
    used = kernels.check("openrlhf-geo demo")

    train, held_out = recipe.prepare_data(out)
    sft_info = recipe.warm_up(
        out, train, held_out, args.sft_target, preset["sft_max_steps"], shipped=not args.sft_from_scratch
    )

    common = recipe.common_flags(out, steps, eval_steps)
    jobs = [
        {
            "argv": [*common, *recipe.METHOD_FLAGS[m], "--train.seed", str(s), "--reward.noise.seed", str(s),
                     "--ckpt.output_dir", str(out / "runs" / m / f"seed{s}")],
            "out": str(out / "runs" / m / f"seed{s}"),
            "tags": {"method": m, "seed": s},
        }
        for s in seeds
        for m in METHODS
    ]  # fmt: skip
    # the report reads every run under <out>/runs: runs of an earlier demo there (other seeds or methods) would join it
    shutil.rmtree(out / "runs", ignore_errors=True)
    rl_start = time.perf_counter()
    recipe.run_all(jobs, workers, steps)
    rl_wall = time.perf_counter() - rl_start

    setup = {
        "quick": args.quick,
        "task": f"two-digit additions `a+b=` that need a carry in the ones column; {len(train)} training and "
        f"{len(held_out)} held-out prompts; reward: math-verify verdict of the last `\\boxed{{}}` (1/0).",
        "steps": steps,
        "seeds": list(seeds),
        "sft": sft_info,
        "n_train": len(train),
        "n_eval": len(held_out),
        "eval_samples": recipe.EVAL_SAMPLES,
        "wall_s": rl_wall,
        "kernels": used,
        "environment": kernels.environment(),
        "common": "openrlhf-geo train " + shlex.join(common) + " --train.seed S --reward.noise.seed S",
        "commands": {m: shlex.join(recipe.METHOD_FLAGS[m]) for m in METHODS},
    }
    demo_report.write_report(out, out / "runs", COMPARISONS, setup, METHODS)
    print(f"demo finished in {time.perf_counter() - start:.0f} s: {out / 'report.md'}")
    return 0
