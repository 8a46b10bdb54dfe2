"""`openrlhf-geo study real-lm-rl`: RL on a real pretrained LM as far as a CPU budget allows: GRPO vs GRPO + SALT, and
GRPO vs GRPO + GeoAlign under 10 % flipped rewards, on SmolLM2-135M-Instruct (a 4-bit quantization of the release)
and the word-problem task, with SALT's and GeoAlign's geometry logged every step. Protocol:
docs/studies/real-lm-rl.md.

One `openrlhf-geo train` run per condition (the local engine, full fine-tuning, one seed: descriptive, no CI), in this
process one after another, each resumable from its checkpoint; then a per-step table, the held-out accuracy at the
first and last step, and the measured cost per step with what a comparison with CIs would need.
"""

import json
import math
import sys
import time
from pathlib import Path

from openrlhf_geo.jsonl import read_jsonl, strict_json
from openrlhf_geo.lab import word_task
from openrlhf_geo.lab.studies import real_lm
from openrlhf_geo.lab.studies.base import Study

FLIPS = ["--reward.noise.type", "flip", "--reward.noise.rate", "0.1"]  # GeoAlign Table 3's 10 %
CONDITIONS = {
    "grpo": ["--advantage_estimator", "group_norm", "--salt.diagnostics"],
    "salt": ["--advantage_estimator", "salt"],
    "grpo_flip": ["--advantage_estimator", "group_norm", *FLIPS],
    "geoalign_flip": ["--advantage_estimator", "group_norm", *FLIPS, "--geoalign.enable"],
}
COMPARISONS = (("salt", "grpo"), ("geoalign_flip", "grpo_flip"))
# the protocol's amendment (before any run): 3 steps of 4 prompts x 8, up to 96 new tokens, 16 held-out problems x 2
FULL = {"steps": 3, "prompts": 4, "samples": 8, "max_new_tokens": 96, "train_problems": 256, "eval_problems": 16,
        "eval_samples": 2}  # fmt: skip
QUICK = {"steps": 1, "prompts": 2, "samples": 4, "max_new_tokens": 16, "train_problems": 8, "eval_problems": 2,
         "eval_samples": 1}  # fmt: skip
LR = 1e-5  # SALT Table 4's 1e-6 is for 1.5B-7B models over hundreds of steps; fixed here before any run
TRAIN_SEED, EVAL_SEED = 1, 2  # word_task.word_problems seeds (the geometry studies' problems use PROBLEM_SEED)
STEP_S = 250.0  # one step at FULL sizes, eval and checkpoints included: 253 s measured on an idle 2-core VM
SHOWN = ("accuracy", "salt/n_eff_in", "salt/pr", "salt/k", "salt/alpha", "salt/n_eff_out", "salt/D_a",
         "geo/val_acc", "geo/cos_gt_0.8", "geo/auroc", "geo/precision", "geo/recall", "geo/flag_frac",
         "response_length")  # fmt: skip


def write_data(out, sizes, tokenizer):
    """<out>/data/train.jsonl and eval.jsonl: word problems in the chat template, disjoint."""
    from openrlhf_geo.lab.task import write_jsonl

    train = word_task.word_problems(sizes["train_problems"], TRAIN_SEED)
    held = word_task.word_problems(sizes["eval_problems"], EVAL_SEED, exclude={q for q, _ in train})
    data = Path(out) / "data"
    write_jsonl(data / "train.jsonl", word_task.dataset_rows(tokenizer, train))
    write_jsonl(data / "eval.jsonl", word_task.dataset_rows(tokenizer, held))
    return data


def train_argv(model, data, run, sizes, condition, seed=0):
    return [
        "--actor.model_name_or_path", str(model),
        "--data.prompt_dataset", str(data / "train.jsonl"), "--eval.dataset", str(data / "eval.jsonl"),
        "--eval.steps", str(sizes["steps"]), "--eval.n_samples_per_prompt", str(sizes["eval_samples"]),
        "--rollout.batch_size", str(sizes["prompts"]), "--rollout.n_samples_per_prompt", str(sizes["samples"]),
        "--rollout.max_new_tokens", str(sizes["max_new_tokens"]), "--rollout.temperature", str(word_task.TEMPERATURE),
        "--rollout.micro_batch_size", "8", "--train.micro_batch_size", "8",
        "--actor.adam.lr", str(LR), "--train.steps", str(sizes["steps"]),
        "--train.device", "cpu", "--train.threads", "2", "--train.seed", str(seed), "--reward.noise.seed", str(seed),
        "--ckpt.output_dir", str(run), "--ckpt.save_steps", "2",
        *CONDITIONS[condition],
    ]  # fmt: skip


def last_step(run):
    rows = [r for _, r in read_jsonl(Path(run) / "metrics.jsonl")] if (Path(run) / "metrics.jsonl").exists() else []
    return max((r.get("step", 0) for r in rows), default=0)


def run_condition(argv, run, steps):
    """`openrlhf-geo train ARGV` in this process, unless its metrics already reach `steps` for this command.
    ValueError: a run that had to stop (as `openrlhf-geo train` reports it); Ctrl-C reaches the study's command,
    which says how to resume (`training.train`, not the train command's `main`, which would print its own line)."""
    from openrlhf_geo.local.flags import parse_args
    from openrlhf_geo.local.rundir import CHECKPOINT
    from openrlhf_geo.local.training import train

    marker = Path(run).with_suffix(".json")  # beside the run: its directory is the train command's
    same = marker.exists() and json.loads(marker.read_text()).get("argv") == argv
    if same and last_step(run) >= steps:
        return 0.0
    resume = same and (Path(run) / CHECKPOINT).exists()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"argv": argv}) + "\n")
    start = time.perf_counter()
    train(parse_args([*argv, "--ckpt.load_enable" if resume else "--ckpt.overwrite"]))
    return time.perf_counter() - start


def summarize(metrics, sizes, seconds, setup) -> dict:
    """metrics: {condition: its run's metrics.jsonl}."""
    runs = {}
    for name in CONDITIONS:
        rows = [r for _, r in read_jsonl(metrics[name])]
        train_rows = [r for r in rows if r.get("step", 0) >= 1]
        evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
        runs[name] = {
            "per_step": {int(r["step"]): {k: r.get(k) for k in SHOWN} for r in train_rows},
            "eval": evals,
            "seconds": seconds.get(name),
        }
    timed = [runs[n]["seconds"] / sizes["steps"] for n in runs if runs[n]["seconds"]]
    per_step = sum(timed) / len(timed) if timed else math.nan
    # a 5-seed comparison of one pair at 60 steps (the studies' length, recipe.FULL) on this machine
    need = 2 * 5 * 60 * per_step
    return {"study": "real-lm-rl", "setup": setup, "runs": runs, "comparisons": [list(c) for c in COMPARISONS],
            "seconds_per_step": per_step, "comparison_estimate_s": need}  # fmt: skip


def _f(x, digits=3):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def render(summary) -> str:
    setup = summary["setup"]
    seed = f" ({setup['seed']})" if "seed" in setup else ""  # recorded since the seed became --seeds
    lines = [
        f"# RL on a real pretrained LM (`openrlhf-geo study real-lm-rl`): descriptive, one seed{seed} per condition",
        "",
        f"Model: {setup['model']}: a 4-bit quantization of the release, not the release. Local engine, full "
        f"fine-tuning, AdamW lr {setup['lr']}, {setup['steps']} steps of {setup['prompts']} prompts x "
        f"{setup['samples']} rollouts (one optimizer step each; SALT's partition m = "
        f"{setup['prompts'] * setup['samples']}), T = {setup['temperature']}, up to {setup['max_new_tokens']} new "
        "tokens. Protocol: docs/studies/real-lm-rl.md.",
        f"- **One seed per condition: no confidence interval; differences between conditions are not evidence.** "
        f"Measured cost: {summary['seconds_per_step']:.0f} s per step on this machine (wall time "
        f"{setup['wall_s'] / 60:.1f} min); a 5-seed, 60-step comparison of one pair would take about "
        f"{summary['comparison_estimate_s'] / 3600:.1f} h here.",
        "",
        "Held-out accuracy (T = 0.6, " + f"{setup['eval_problems']} problems x {setup['eval_samples']}):",
        "",
        "| condition | step 0 | last step |",
        "|---|---|---|",
    ]
    for name, run in summary["runs"].items():
        evals = run["eval"]
        first, last = (evals.get(min(evals)) if evals else None), (evals.get(max(evals)) if evals else None)
        lines.append(f"| {name} | {_f(first)} | {_f(last)} |")
    for name, run in summary["runs"].items():
        lines += ["", f"## {name}: `{' '.join(CONDITIONS[name])}`", "", "| step | " + " | ".join(SHOWN) + " |",
                  "|---|" + "---|" * len(SHOWN)]  # fmt: skip
        for step, row in run["per_step"].items():
            lines.append(f"| {step} | " + " | ".join(_f(row.get(k)) for k in SHOWN) + " |")
    return "\n".join(lines) + "\n"


def run(args, out, workers):
    from transformers import AutoTokenizer

    sizes = QUICK if args.quick else FULL
    model = real_lm.model_dir()
    estimate = len(CONDITIONS) * sizes["steps"] * (STEP_S if not args.quick else 30.0)
    print(f"study real-lm-rl: {len(CONDITIONS)} runs x {sizes['steps']} steps (one seed each: descriptive); about "
          f"{estimate / 60:.0f} min (docs/studies/real-lm-rl.md)")  # fmt: skip
    start = time.perf_counter()
    data = write_data(out, sizes, AutoTokenizer.from_pretrained(model))
    seconds, seed = {}, args.seeds[0]
    for name in CONDITIONS:
        run_dir = Path(out) / "runs" / name
        print(f"real-lm-rl: {name}")
        argv = train_argv(model, data, run_dir, sizes, name, seed)
        try:
            seconds[name] = run_condition(argv, run_dir, sizes["steps"])
        except ValueError as error:
            print(f"openrlhf-geo study: real-lm-rl: run {name} ({run_dir}) stopped: {error}", file=sys.stderr)
            return 1
    setup = {"model": real_lm.MODEL_NAME, "lr": LR, "temperature": word_task.TEMPERATURE, "seed": seed, **sizes,
             "wall_s": time.perf_counter() - start, "estimate_s": estimate}  # fmt: skip
    metrics = {name: Path(out) / "runs" / name / "metrics.jsonl" for name in CONDITIONS}
    summary = strict_json(summarize(metrics, sizes, seconds, setup))
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(summary))
    print(f"study real-lm-rl finished: {Path(out) / 'report.md'}")
    return 0


def resummarize(directory) -> int:
    """DIR's summary.json and report.md re-derived by the current code from each run's metrics (a study's --out:
    runs/<condition>/metrics.jsonl; a copy of its results: <condition>.metrics.jsonl), with the setup and the runs'
    seconds the run recorded in its summary.json."""
    with real_lm.rewriting(directory) as directory:
        old = real_lm.read_result(directory, "summary.json")
        metrics = {}
        for name in CONDITIONS:
            inside, copy = directory / "runs" / name / "metrics.jsonl", directory / f"{name}.metrics.jsonl"
            metrics[name] = inside if inside.exists() or not copy.exists() else copy
        try:
            seconds = {name: run["seconds"] for name, run in old["runs"].items()}
            summary = strict_json(summarize(metrics, old["setup"], seconds, old["setup"]))
            report = render(summary)  # both derived before either is written
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"--resummarize {directory}: its summary.json is not a real-lm-rl summary "
                             f"({type(error).__name__}: {error})") from None  # fmt: skip
        except ValueError as error:  # read_jsonl's one line naming the file
            raise ValueError(f"--resummarize {directory}: {error}") from None
        (directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (directory / "report.md").write_text(report)
    print(f"study real-lm-rl: re-derived {directory / 'summary.json'} and {directory / 'report.md'} from the runs' "
          "metrics")  # fmt: skip
    return 0


class RealLmRl(Study):
    name = "real-lm-rl"
    options = ("resummarize",)
    seed = 0  # --train.seed and --reward.noise.seed of every run

    def run(self, args, out, workers):
        return run(args, out, workers)

    def resummarize(self, directory):
        return resummarize(directory)


STUDY = RealLmRl()
