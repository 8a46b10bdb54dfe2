"""The runner of condition studies: plan (conditions x seeds -> `openrlhf-geo train` argv), the time estimate, the
settings' SFT warm-ups, the runs (`recipe.run_all`; a finished run is skipped, so a study resumes where it stopped),
and the end: summary.json, report.md and plots, from the tables every condition study has plus its own section
(`ConditionStudy.summarize`, `render`, `plots`).

Each run is a demo job (`recipe.run_one`) into <out>/runs/<condition>/seed<k>/ (metrics.jsonl, gdi.jsonl); a run
whose metrics.jsonl reaches the final step and whose stored command (study.json) is the planned one counts as
finished. The planned runs are read as `eval.report.load_runs` reads them (`scan_runs` + `final_scalars`), paired
seed by seed with `eval.report.compare`.
"""

import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab import recipe
from openrlhf_geo.lab.studies.common import BUDGET, FINAL, SETTINGS, TABLE10_WINDOW, describe, fmt, fmt_ci, window
from openrlhf_geo.lab.studies.design import Result
from openrlhf_geo.lab.studies.registry import REGISTRY
from openrlhf_geo.local import kernels

# a --quick smoke run: these steps and SFT steps, one worker, one seed and the study's `quick` conditions
QUICK_STUDY = {"steps": 2, "eval_steps": 2, "sft_max_steps": 30, "workers": 1}

# ---------------------------------------------------------------- plan, time estimate, runs


def rollout_flags(changes):
    """recipe.ROLLOUT_FLAGS with the values of `changes` ({flag: value}) replaced, unknown flags appended."""
    flags = list(recipe.ROLLOUT_FLAGS)
    for flag, value in changes.items():
        if flag in flags:
            flags[flags.index(flag) + 1] = str(value)
        else:
            flags += [flag, str(value)]
    return flags


def setting_dir(out, setting):
    return Path(out) / "settings" / setting


def plan(design, out, seeds=None, quick=False):
    """The runs of `design` -> jobs {"argv", "out", "tags", "condition", "setting", "seed"} (recipe.run_one's job plus
    bookkeeping), condition by condition, seed by seed. Each argv is a complete `openrlhf-geo train` command line."""
    preset = QUICK_STUDY if quick else {"steps": design.steps, "eval_steps": design.eval_steps}
    seeds = list(seeds if seeds is not None else design.seeds[:1] if quick else design.seeds)
    conditions = [c for c in design.conditions if not quick or c.name in design.quick]
    jobs = []
    for c in conditions:
        common = recipe.common_flags(
            setting_dir(out, c.setting), preset["steps"], preset["eval_steps"], rollout_flags(c.rollout)
        )
        for s in seeds:
            run = Path(out) / "runs" / c.name / f"seed{s}"
            argv = [*common, *c.flags, "--train.seed", str(s), "--reward.noise.seed", str(s),
                    "--ckpt.output_dir", str(run)]  # fmt: skip
            jobs.append({"argv": argv, "out": str(run), "tags": {"method": c.name, "seed": s},
                         "condition": c.name, "setting": c.setting, "seed": s})  # fmt: skip
    return jobs


# The estimate's unit costs, from the demo's measured speed: its RL phase, 12 runs of 60 steps (128 rollouts each) with
# an evaluation (256 prompts x 2 samples) every 10 steps, took 261 s on 2 cores with 2 workers, i.e. 43.5 s per run
# = 60 steps x STEP_S + 7 evaluations x EVAL_S + LOAD_S; its SFT warm-up took SFT_S. DAPO's dynamic sampling
# regenerates filtered prompts (at most 4 rounds): DAPO_COST is an assumption, as is PAR's M = 1 reference per prompt.
STEP_S, EVAL_S, LOAD_S, SFT_S = 0.6, 0.8, 1.0, 91.0
DAPO_COST, PAR_COST, GEOALIGN_COST = 1.5, 1.1, 1.1


def run_seconds(job):
    """Estimated seconds of one run on one worker (see STEP_S)."""
    argv = job["argv"]

    def value(flag):  # the value after the flag's last occurrence, the one argparse keeps
        return float(argv[len(argv) - argv[::-1].index(flag)])

    steps, eval_steps = value("--train.steps"), value("--eval.steps")
    rollouts = value("--rollout.batch_size") * value("--rollout.n_samples_per_prompt")
    method = DAPO_COST if "--algo.dynamic_filtering_enable" in argv else 1.0
    method *= PAR_COST if "--baseline.par_references" in argv else 1.0
    method *= GEOALIGN_COST if "--geoalign.enable" in argv else 1.0
    evals = math.ceil(steps / eval_steps) + 1
    return (steps * STEP_S * rollouts / BUDGET * method + evals * EVAL_S) * SETTINGS[job["setting"]].cost[0] + LOAD_S


def estimate_seconds(jobs, workers, sft_max_steps=recipe.FULL["sft_max_steps"]):
    """Estimated wall seconds: the settings' SFT warm-ups one after another, then the runs spread over the workers."""
    settings = dict.fromkeys(job["setting"] for job in jobs)
    scale = sft_max_steps / recipe.FULL["sft_max_steps"]
    sft = sum(SFT_S * scale * SETTINGS[s].sft_scale * SETTINGS[s].cost[1] for s in settings)
    return sft + sum(run_seconds(job) for job in jobs) / workers


def last_step(run):
    """The step of the last row of <run>/metrics.jsonl; None without a readable one (missing, empty, torn)."""
    try:
        lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1]).get("step") if lines else None
    except (OSError, ValueError):
        return None


def finished(job, steps):
    """Whether the run of `job` is complete: its stored command is the job's and metrics.jsonl reaches `steps`."""
    try:
        if json.loads((Path(job["out"]) / "study.json").read_text())["argv"] != job["argv"]:
            return False
    except (OSError, ValueError, KeyError):
        return False
    return last_step(job["out"]) == steps


def prepare_settings(out, jobs, sft_max_steps):
    """Data and SFT warm-up (cached) of every setting the jobs use -> {setting: recipe.warm_up's info}."""
    infos = {}
    for name in dict.fromkeys(job["setting"] for job in jobs):
        setting, where = SETTINGS[name], setting_dir(out, name)
        train, held_out = recipe.prepare_data(where, setting.max_operand)
        print(f"setting {name}: SFT warm-up in {where / 'sft'}")
        steps = sft_max_steps * setting.sft_scale
        infos[name] = recipe.warm_up(where, train, held_out, None, steps, sft_config=setting.sft_config())
    return infos


# ---------------------------------------------------------------- summary and report


def load_planned(out, jobs, metrics):
    """The planned runs as {condition: {seed: Run}} (eval.report.scan_runs, restricted to the plan), each with the
    scalar FINAL (eval.report.final_scalars) and `last20%/<key>` (`t10`) for each key of `metrics` it logs: its mean
    over the last 20 % of the steps, SALT Table 10's window, without the steps where the key is undefined."""
    from openrlhf_geo.eval.report import final_scalars, scan_runs

    if not jobs:  # every planned run stopped (`summarize`)
        return {}, [window(k) for k in metrics], []
    found, sources, notes = scan_runs(Path(out) / "runs")
    runs = {}
    for job in jobs:
        run = found.get(job["condition"], {}).get(job["seed"])
        if run is None:
            raise ValueError(f"{job['out']}: no metrics.jsonl; the run did not finish")
        runs.setdefault(job["condition"], {})[job["seed"]] = run
    final_scalars(runs, ["eval/accuracy"], ("last", 1), sources)
    logged = [key for key in metrics if any(key in r.curves for seeds in runs.values() for r in seeds.values())]
    # SALT's geometry is NaN on a step whose groups are all tied (a run near 100 % accuracy has some): left out
    final_scalars(runs, logged, TABLE10_WINDOW, sources, skip_undefined=True)
    return runs, [window(k) for k in metrics], notes


def condition_table(runs, scalars):
    """{condition: {scalar: {"mean", "sd", "n", "per_seed"}}} over the seeds of each condition."""
    table = {}
    for condition, seeds in runs.items():
        row = {}
        for scalar in (FINAL, *scalars):
            per = {
                s: r.scalars[scalar]
                for s, r in sorted(seeds.items())
                if math.isfinite(r.scalars.get(scalar, math.nan))
            }
            if per:
                row[scalar] = {**describe(list(per.values())), "per_seed": per}
        table[condition] = row
    return table


def paired(runs, comparisons, scalars):
    """eval.report.compare rows of each (condition, baseline) pair on FINAL and the window scalars, over the seeds
    where both have the scalar (a window without a finite value, or U_perp_gain = inf, leaves a seed out)."""
    from openrlhf_geo.eval.report import Run, compare

    wanted = (FINAL, *scalars)

    def finite(run):
        return Run(scalars={k: v for k, v in run.scalars.items() if k in wanted and math.isfinite(v)})

    rows = []
    for condition, baseline in comparisons:
        if condition in runs and baseline in runs:
            pair = {c: {s: finite(r) for s, r in runs[c].items()} for c in (condition, baseline)}
            rows += [{**row, "baseline": baseline} for row in compare(pair, baseline)]
    return rows


def registered(name):
    """The registered condition study `name` (ValueError naming the registered ones otherwise)."""
    study = REGISTRY.get(name)
    if not hasattr(study, "design"):  # a condition study (`base.ConditionStudy`), not one with its own runner
        known = ", ".join(n for n, s in REGISTRY.items() if hasattr(s, "design"))
        raise ValueError(f"no condition study {name!r} is registered (registered: {known})")
    return study


def summarize(design, out, jobs, setup, stopped=None):
    """Every number of the study's report -> (dict, the `Result` it was computed from); the dict is strict JSON
    once passed through `strict_json`.

    `stopped`: {run directory: error} of runs that raised (e.g. DAPO's dynamic filtering finding no informative
    prompt, docs/studies/salt-scaling.md). A condition with a stopped run leaves the tables and comparisons and is
    reported as stopped, as that protocol fixes: per seed, the step that failed and the error."""
    stopped = stopped or {}
    out_of = {job["condition"] for job in jobs if job["out"] in stopped}
    runs, scalars, notes = load_planned(out, [job for job in jobs if job["condition"] not in out_of], design.metrics)
    table = condition_table(runs, scalars)
    rows = paired(runs, design.comparisons, scalars)
    summary = {"study": design.name, "title": design.title, "setup": setup, "notes": notes, "shown": design.shown}
    summary.update(table=table, comparisons=rows, stopped=stopped_runs(jobs, out_of, stopped))
    last = [int(s.max()) for seeds in runs.values() for r in seeds.values() for s, _ in r.curves.values()]
    steps = max(last, default=0)  # every condition stopped: no curves
    study = registered(design.name)
    result = Result(design, Path(out), runs, table, rows, steps)
    summary[study.section] = study.summarize(result)
    return summary, result


def stopped_runs(jobs, conditions, stopped):
    """{condition: {seed: {"step", "error"}}} for the `conditions` with a stopped run: the step each stopped run
    failed at (one after the last step in its metrics.jsonl) and its error; a finished seed is {"step": None}."""
    result = {}
    for job in jobs:
        if job["condition"] in conditions:
            entry = {"step": None, "error": None}
            if job["out"] in stopped:
                entry = {"step": (last_step(job["out"]) or 0) + 1, "error": stopped[job["out"]]}
            result.setdefault(job["condition"], {})[job["seed"]] = entry
    return result


def render(summary):
    """report.md from a summary (its strict-JSON form renders the same)."""
    setup = summary["setup"]
    lines = [
        f"# openrlhf-geo study {summary['study']}: {summary['title']}" + (" (`--quick`)" if setup["quick"] else ""),
        "",
        f"Protocol: docs/studies/{summary['study']}.md. Seeds {setup['seeds']}; {setup['steps']} RL steps per run; "
        f"{setup['runs']} runs ({setup['skipped']} reused from an earlier invocation); RL wall time "
        f"{setup['wall_s']:.0f} s (estimated {setup['estimate_s']:.0f} s in all, SFT included).",
        "",
        "Each run: `openrlhf-geo train` with the common flags of its setting, then the condition's flags, then "
        "`--train.seed S --reward.noise.seed S --ckpt.output_dir <out>/runs/<condition>/seed<S>`:",
        "",
        "```",
        *(f"{name}: {command}" for name, command in setup["commands"].items()),
        "```",
        "",
        *(
            f"- SFT `{name}`: {info['steps']} steps, held-out accuracy {fmt(info['accuracy'])}, {info['params']:,} "
            f"parameters."
            for name, info in setup["sft"].items()
        ),
        "",
        "## Conditions (mean ± sd over seeds; `last20%/`: mean over the last 20 % of RL steps, SALT Table 10's)",
        "",
    ]
    columns = [FINAL, *dict.fromkeys(k for row in summary["table"].values() for k in row if k != FINAL)]
    lines += ["| condition | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for condition, row in summary["table"].items():
        values = [row.get(k) for k in columns]
        lines.append(
            f"| {condition} | "
            + " | ".join("" if v is None else f"{fmt(v['mean'])} ± {fmt(v['sd'])}" for v in values)
            + " |"
        )
    lines += [
        "",
        "## Paired differences (condition − baseline per seed; 95 % percentile-bootstrap CI, SALT App. H; "
        "summary.json has them for every metric of the table above)",
        "",
        "| condition | baseline | metric | difference [95 % CI] |",
        "|---|---|---|---|",
        *(
            f"| {r['method']} | {r['baseline']} | {r['metric']} | {fmt_ci(r)} |"
            for r in summary["comparisons"]
            if r["metric"] in summary["shown"]
        ),
    ]
    study = registered(summary["study"])
    lines += study.render(summary[study.section])
    if summary.get("stopped"):
        lines += ["", "## Stopped runs (their conditions are left out of the tables and comparisons above)", ""]
        for condition, seeds in summary["stopped"].items():
            at = ", ".join(f"seed {s}: " + (f"stopped at step {e['step']}" if e["step"] else "finished")
                           for s, e in seeds.items())  # fmt: skip
            errors = sorted({e["error"] for e in seeds.values() if e["error"]})
            lines.append(f"- `{condition}`: {at}. " + " / ".join(errors))
    lines += [w for note in summary["notes"] for w in ("", f"> warning: {note}")]
    plots = summary.get("plots", [])
    lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)] if plots else []
    return "\n".join(lines) + "\n"


def write_report(design, out, jobs, setup, stopped=None):
    """summary.json, report.md and the plots of the planned runs -> the summary (`stopped`: as `summarize`'s)."""
    from openrlhf_geo.eval.report import plot_curve

    out = Path(out)
    study = registered(design.name)
    summary, result = summarize(design, out, jobs, setup, stopped)
    runs = result.runs
    plots = study.plots(summary, result)
    # accuracy curves in groups a plot can hold
    for suffix, conditions in study.curve_groups(result).items():
        conditions = [c for c in conditions if c in runs]
        if conditions:
            plots.append(f"eval_accuracy{suffix}.png")
            plot_curve({c: runs[c] for c in conditions}, "eval/accuracy", out / plots[-1])
    summary["plots"] = plots
    data = strict_json(summary)
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "report.md").write_text(render(data))
    return summary


def protocol_commands(design):
    """{condition: what its command adds to the common flags, as one string}: the setting (when not the demo's), the
    rollout flags whose demo values it replaces, then the method flags. The protocols list exactly these."""
    commands = {}
    for c in design.conditions:
        setting = [] if c.setting == "demo" else [f"[setting {c.setting}]"]
        changed = [str(x) for flag, value in c.rollout.items() for x in (flag, value)]
        commands[c.name] = " ".join([*setting, shlex.join([*changed, *c.flags]) or "(no flags)"])
    return commands


def common_command(out, steps, eval_steps):
    """The flags every run starts with, for setting SETTING (its SFT model and data under <out>/settings/SETTING)."""
    return shlex.join(recipe.common_flags(setting_dir(out, "SETTING"), steps, eval_steps))


def run(design, args, out, workers):
    """The conditions of `design` in the claimed `out` (`study.main` checked the options) -> exit status."""
    torch.set_num_threads(1)  # as the demo: the runs' workers take one thread each
    used = kernels.check("openrlhf-geo study")
    preset = QUICK_STUDY if args.quick else {"steps": design.steps, "eval_steps": design.eval_steps}
    steps, eval_steps = preset["steps"], preset["eval_steps"]
    sft_steps = QUICK_STUDY["sft_max_steps"] if args.quick else recipe.FULL["sft_max_steps"]
    jobs = plan(design, out, args.seeds, args.quick)
    pending = [job for job in jobs if not finished(job, steps)]
    estimate = estimate_seconds(jobs, workers, sft_steps)
    print(
        f"study {design.name}: {len(jobs)} runs, {len(pending)} to go; all of them take about {estimate / 60:.0f} min "
        f"on {workers} worker(s) (docs/studies/{design.name}.md)"
    )
    sft = prepare_settings(out, jobs, sft_steps)
    for job in pending:  # the command a finished run is recognised by (`finished`); an old run's logs go
        run = Path(job["out"])
        run.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "gdi.jsonl"):
            (run / name).unlink(missing_ok=True)
        (run / "study.json").write_text(json.dumps({"argv": job["argv"]}) + "\n")
    start, stopped = time.perf_counter(), {}
    try:
        if pending:
            recipe.run_all(pending, workers, steps)
    except recipe.RunsFailed as failed:  # the report lists them and leaves their conditions out (`summarize`)
        stopped = {job["out"]: f"{type(error).__name__}: {error}" for job, error in failed.failures}
        print(f"openrlhf-geo study: {len(stopped)} run(s) stopped by an error: {', '.join(stopped)}", file=sys.stderr)
    planned = {job["condition"] for job in jobs}
    setup = {
        "quick": args.quick,
        "seeds": sorted({job["seed"] for job in jobs}),
        "steps": steps,
        "runs": len(jobs),
        "skipped": len(jobs) - len(pending),
        "workers": workers,
        "wall_s": time.perf_counter() - start,
        "estimate_s": estimate,
        "kernels": used,
        "environment": kernels.environment(),
        "sft": sft,
        "commands": {
            "common": common_command(out, steps, eval_steps),
            **{c: command for c, command in protocol_commands(design).items() if c in planned},
        },
    }
    write_report(design, out, jobs, setup, stopped)
    print(f"study {design.name} finished: {out / 'report.md'}" + (f", {len(stopped)} runs stopped" if stopped else ""))
    return 1 if stopped else 0
