"""`openrlhf-geo study NAME`: the CPU studies, most a declarative list of conditions (protocols: docs/studies/).

    salt-scaling      SALT rollout scaling at a fixed rollout budget (SALT arXiv 2606.05800 §4.4, Fig. 4(c, d),
                      Fig. 9, App. F.4-F.5, Table 10), GRPO and DAPO backbones, each ± SALT
    regime            what moves the backbone's n_eff below 1 and D_a toward Table 10's on CPU-sized models
    learnable-regime  a task of intermediate difficulty where GRPO learns and its n_eff is below 1 (GRPO runs only)
    salt-ablations    SALT's App. F.3 ablations, fixed-α sweep and matched nulls under the demo's setting
    geoalign-failure  GeoAlign under a systematically misspecified reward next to random flips (GeoAlign arXiv
                      2606.26917 §5.3), against noisy GRPO and the four baselines of its App. B.5
    salt-proxy        SALT Table 1 / App. E: the LM-head proxy against full per-sample gradients and nulls at
                      checkpoints of the demo's GRPO run; its own runner (RUNNERS: openrlhf_geo.local.proxy_study)

A condition is one `openrlhf-geo train` configuration: the demo's common flags (`demo.common_flags`) in one
`Setting` (SFT warm-up + data, `demo.prepare_data` / `demo.warm_up`, cached in <out>/settings/<setting>/), rollout
flags and method flags. Each runs once per seed as a demo job (`demo.run_one` under `demo.run_all`'s progress bar)
into <out>/runs/<condition>/seed<k>/ (metrics.jsonl, gdi.jsonl). A run whose metrics.jsonl reaches the final step
and whose stored command (study.json) is the planned one is skipped, so an interrupted study resumes where it
stopped. The end: <out>/summary.json (every number) and <out>/report.md, from the planned runs read as
`eval.report.load_runs` reads them (`scan_runs` + `final_scalars`), paired seed by seed with `eval.report.compare`.
"""

import importlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from openrlhf_geo.eval.report import final_name
from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.local import demo

FINAL = "final/eval/accuracy"  # held-out accuracy at the last step (the demo's headline number)
TABLE10 = ("last-frac", 0.2)  # SALT Table 10 averages the last 20 % of checkpoints
SEEDS = (2025, 2026, 2027, 2028, 2029)
QUICK = {"steps": 2, "eval_steps": 2, "sft_max_steps": 30, "workers": 1}  # plus one seed and the study's quick subset

# SALT Table 10 (App. F.5; DeepSeek-R1-Distill-Qwen-7B / MATH-TRAIN, last 20 % of checkpoints, 5 seeds): mean, sd
PAPER_TABLE10 = {
    "grpo": {"n_eff": (0.31, 0.05), "acc": 66.9},
    "grpo_salt": {"D_a": (0.24, 0.04), "D_g": (0.16, 0.03), "n_eff": (0.80, 0.04), "U_perp_gain": 1.47, "acc": 69.7},
    "dapo": {"n_eff": (0.82, 0.03), "acc": 65.8},
    "dapo_salt": {"D_a": (0.17, 0.03), "D_g": (0.11, 0.02), "n_eff": (1.00, 0.03), "U_perp_gain": 1.24, "acc": 68.2},
}
GEOMETRY = ("salt/pr", "salt/k", "salt/n_eff_in", "salt/n_eff_out", "salt/alpha", "salt/D_a", "salt/D_g",
            "salt/U_perp_gain", "salt/sign_flip", "salt/kept", "clip_frac", "response_length", "accuracy")  # fmt: skip
GEO = ("geo/val_acc", "geo/cos_gt_0.8", "geo/flag_frac", "geo/precision", "geo/recall", "geo/auroc")

# ---------------------------------------------------------------- what the studies run


@dataclass(frozen=True)
class Setting:
    """An SFT warm-up and its data: the demo's (`demo.SFT`, two-digit carry additions) with some SFT keys changed.

    `sft` overrides keys of demo.SFT; `max_operand` > 99 makes the additions three-digit (it joins the SFT cache key).
    """

    name: str
    sft: dict = field(default_factory=dict)
    max_operand: int = 99
    sft_scale: int = 1  # SFT steps in multiples of the demo's (demo.FULL["sft_max_steps"], QUICK's with --quick)
    cost: tuple = (1.0, 1.0)  # (RL, SFT step) time relative to the demo's model, for the estimate (`run_seconds`)

    def sft_config(self):
        extra = {"max_operand": self.max_operand} if self.max_operand != 99 else {}
        return {**demo.SFT, **self.sft, **extra}


# One-factor-at-a-time departures from the demo. cost: measured 1-thread ratios to the demo's 2 x 64 model (SFT step
# of 128 sequences: 2.4x for width 128, 1.5x for depth 4; sampling 128 rollouts: 1.6x, 1.4x), RL taken in between.
SETTINGS = {
    "demo": Setting("demo"),
    "three_digit": Setting("three_digit", max_operand=999, cost=(1.1, 1.0)),
    "all_strategies": Setting("all_strategies", {"strategies": ["tens", "split_b", "split_a", "digits"]}),
    "width128": Setting("width128", {"hidden_size": 128}, cost=(2.0, 2.4)),
    "depth4": Setting("depth4", {"num_layers": 4}, cost=(1.5, 1.5)),
    # learnable-regime's candidates (docs/studies/learnable-regime.md); their RL cost 1.1 is three_digit's, assumed
    "operands199": Setting("operands199", max_operand=199, cost=(1.1, 1.0)),
    "operands499": Setting("operands499", max_operand=499, cost=(1.1, 1.0)),
    "no_shortcut": Setting("no_shortcut", {"shortcut_rate": 0.0}),
    "three_digit_sft4x": Setting("three_digit_sft4x", max_operand=999, sft_scale=4, cost=(1.1, 1.0)),
}


@dataclass(frozen=True)
class Regime:
    """Where salt-scaling runs: a setting plus rollout-flag changes (`varies_g`: the change is G, which it sweeps)."""

    setting: str = "demo"
    rollout: dict = field(default_factory=dict)
    varies_g: bool = False


BUDGET = 128  # rollouts per step (the demo's 8 prompts x G = 16), fixed while G varies
LEARNABLE = ("operands199", "operands499", "no_shortcut", "three_digit_sft4x")  # learnable-regime's candidates
REGIMES = {
    "demo": Regime(),
    "g4": Regime(rollout={"--rollout.batch_size": 32, "--rollout.n_samples_per_prompt": 4}, varies_g=True),
    "g64": Regime(rollout={"--rollout.batch_size": 2, "--rollout.n_samples_per_prompt": 64}, varies_g=True),
    "t06": Regime(rollout={"--rollout.temperature": 0.6}),  # SALT Table 4's rollout temperature
    "t13": Regime(rollout={"--rollout.temperature": 1.3}),
    "three_digit": Regime("three_digit"),
    "all_strategies": Regime("all_strategies"),
    "width128": Regime("width128"),
    "depth4": Regime("depth4"),
    **{name: Regime(name) for name in LEARNABLE},
}
ONE_FACTOR = ("demo", "g4", "g64", "t06", "t13", "three_digit", "all_strategies", "width128", "depth4")  # regime's


@dataclass(frozen=True)
class Condition:
    """One configuration: method `flags` on the demo's common flags in `setting`, with `rollout` changes."""

    name: str
    flags: tuple
    setting: str = "demo"
    rollout: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    conditions: tuple
    comparisons: tuple  # (condition, baseline) pairs, compared paired by seed
    seeds: tuple
    steps: int
    eval_steps: int
    quick: tuple  # the conditions a --quick smoke run takes
    metrics: tuple = GEOMETRY  # curves summarised over the last 20 % of steps (Table 10's window)
    # the paired differences report.md shows (summary.json holds them for every scalar)
    shown: tuple = (FINAL, "last20%/accuracy", "last20%/salt/pr", "last20%/salt/n_eff_out", "last20%/salt/D_a")


GRPO_DIAG = tuple(demo.METHOD_FLAGS["grpo"])  # GRPO logging SALT's geometry of its own advantages (exact features)
SALT = tuple(demo.METHOD_FLAGS["salt"])
# DAPO as SALT Table 4 runs it: ±1 rewards, dynamic filtering of all-equal groups, clip-higher (0.2, 0.28)
DAPO = ("--reward.pm1", "--algo.dynamic_filtering_enable", "--actor.eps_clip_low_high", "0.2", "0.28")
GEOALIGN = tuple(demo.METHOD_FLAGS["geoalign_noise"][len(demo.NOISE) :])  # the demo's GeoAlign without its noise
# GeoAlign App. B.5's baselines with values fixed in advance (none is given there): PF-PPO best-vs-random as described
# (the pair kept, the rest dropped), PAR with M = 1 reference (Fu et al. find it sufficient), PODS keeping 8 of 16,
# Seed-GRPO alpha 0.5 (examples/scripts/train_math_seed_grpo.sh's default)
BASELINES = {
    "pf_ppo": ("--baseline.curation", "pf_ppo_br"),
    "par": ("--baseline.par_references", "1"),
    "pods": ("--baseline.curation", "pods", "--baseline.pods_m", "8"),
    "seed_grpo": ("--baseline.seed_grpo_alpha", "0.5"),
}
NOISES = {
    "mis20": ("--reward.noise.type", "misspecified", "--reward.noise.rate", "0.2"),
    "flip05": ("--reward.noise.type", "flip", "--reward.noise.rate", "0.05"),
    "flip10": ("--reward.noise.type", "flip", "--reward.noise.rate", "0.1"),
}
ABLATIONS = ("only-main", "only-exp", "no-pos", "no-proj", "rand-proj", "pr-alpha", "entropy-alpha", "permuted",
             "matched-rand-subspace")  # fmt: skip
FIXED_ALPHAS = ("0", "0.25", "0.5", "0.75", "1")  # SALT §4.3, Fig. 4(b)


def salt_scaling(regime="demo"):
    """salt-scaling: G in {2, ..., 64} at BUDGET rollouts per step (B = BUDGET / G), GRPO and DAPO, each ± SALT."""
    if regime not in REGIMES:
        raise ValueError(f"--regime must be one of {', '.join(REGIMES)} (got {regime!r})")
    if REGIMES[regime].varies_g:
        raise ValueError(f"--regime {regime} changes G, which salt-scaling sweeps; choose a regime that does not")
    r = REGIMES[regime]
    conditions, comparisons = [], []
    for g in (2, 4, 8, 16, 32, 64):
        rollout = {**r.rollout, "--rollout.batch_size": BUDGET // g, "--rollout.n_samples_per_prompt": g}
        for backbone, extra in (("grpo", ()), ("dapo", DAPO)):
            base, salt = f"g{g:02d}_{backbone}", f"g{g:02d}_{backbone}_salt"
            conditions += [Condition(base, (*GRPO_DIAG, *extra), r.setting, rollout),
                           Condition(salt, (*SALT, *extra), r.setting, rollout)]  # fmt: skip
            comparisons.append((salt, base))
    title = "SALT rollout scaling" + ("" if regime == "demo" else f" (regime {regime})")
    return Study("salt-scaling", title, tuple(conditions), tuple(comparisons), SEEDS, 50, 25,
                 quick=("g04_grpo", "g04_grpo_salt"))  # fmt: skip


def regime_study():
    """regime: one change at a time from the demo, each with GRPO (+ SALT's diagnostics) and GRPO + SALT."""
    conditions, comparisons = [], []
    for name in ONE_FACTOR:
        r = REGIMES[name]
        conditions += [Condition(f"{name}_grpo", GRPO_DIAG, r.setting, r.rollout),
                       Condition(f"{name}_salt", SALT, r.setting, r.rollout)]  # fmt: skip
        comparisons.append((f"{name}_salt", f"{name}_grpo"))
        if name != "demo":  # the change's effect; paired by seed number only (nothing else is shared across settings)
            comparisons += [(f"{name}_grpo", "demo_grpo"), (f"{name}_salt", "demo_salt")]
    shown = (FINAL, "last20%/salt/n_eff_in", "last20%/salt/D_a", "last20%/salt/pr", "last20%/response_length")
    return Study("regime", "Where SALT's regime is on CPU", tuple(conditions), tuple(comparisons), SEEDS, 50, 25,
                 quick=("demo_grpo", "demo_salt"), shown=shown)  # fmt: skip


def learnable_regime():
    """learnable-regime: GRPO (+ SALT's diagnostics, nothing of SALT applied) in each candidate setting and the demo's;
    the candidate salt-scaling reruns in is chosen on these runs alone (`learnable_section`)."""
    conditions = [Condition(f"{name}_grpo", GRPO_DIAG, name) for name in ("demo", *LEARNABLE)]
    comparisons = [(f"{name}_grpo", "demo_grpo") for name in LEARNABLE]
    shown = (FINAL, "last20%/salt/n_eff_in", "last20%/salt/pr", "last20%/response_length")
    return Study("learnable-regime", "A learnable task in SALT's regime", tuple(conditions), tuple(comparisons), SEEDS,
                 50, 25, quick=("demo_grpo", "operands199_grpo"), shown=shown)  # fmt: skip


def salt_ablations():
    """salt-ablations: the demo's GRPO and SALT, SALT's App. F.3.1 ablations, the fixed-α sweep and the F.3.2 nulls."""
    conditions = [Condition("grpo", GRPO_DIAG), Condition("salt", SALT)]
    conditions += [Condition(f"salt_{v}", (*SALT, "--salt.variant", v)) for v in ABLATIONS]
    conditions += [
        Condition(f"salt_fixed{a}", (*SALT, "--salt.variant", "fixed-alpha", "--salt.alpha", a)) for a in FIXED_ALPHAS
    ]
    comparisons = [("salt", "grpo")]
    comparisons += [(c.name, base) for c in conditions[2:] for base in ("grpo", "salt")]
    # the demo's seeds 0-4: grpo and salt repeat the demo's own runs, a check that the setting is the demo's
    return Study("salt-ablations", "SALT component ablations in the demo's setting", tuple(conditions),
                 tuple(comparisons), (0, 1, 2, 3, 4), demo.FULL["steps"], demo.FULL["eval_steps"],
                 quick=("grpo", "salt_no-proj"))  # fmt: skip


def geoalign_failure():
    """geoalign-failure: a misspecified verifier (pays the shortcut's answer on 20 % of prompts) and 5 % / 10 %
    random flips, each with GRPO, GeoAlign and the four baselines; clean GRPO for reference."""
    conditions, comparisons = [Condition("grpo_clean", ())], []
    for noise, flags in NOISES.items():
        methods = {"grpo": (), "geoalign": GEOALIGN, **BASELINES}
        conditions += [Condition(f"{m}_{noise}", (*flags, *extra)) for m, extra in methods.items()]
        comparisons.append((f"grpo_{noise}", "grpo_clean"))
        comparisons += [(f"{m}_{noise}", f"grpo_{noise}") for m in methods if m != "grpo"]
        comparisons += [(f"geoalign_{noise}", f"{b}_{noise}") for b in BASELINES]
    return Study("geoalign-failure", "GeoAlign under a misspecified reward", tuple(conditions), tuple(comparisons),
                 SEEDS, demo.FULL["steps"], demo.FULL["eval_steps"], quick=("grpo_mis20", "geoalign_mis20"),
                 metrics=("accuracy", "response_length", "noise/corrupted", *GEO),
                 shown=(FINAL, "last20%/accuracy", "last20%/geo/flag_frac"))  # fmt: skip


STUDIES = {
    "salt-scaling": salt_scaling,
    "regime": regime_study,
    "learnable-regime": learnable_regime,
    "salt-ablations": salt_ablations,
    "geoalign-failure": geoalign_failure,
}
# studies that are not lists of train conditions: name -> module whose main(args) runs it with the options parsed here
RUNNERS = {"salt-proxy": "openrlhf_geo.local.proxy_study"}

# ---------------------------------------------------------------- plan, time estimate, runs


def rollout_flags(changes):
    """demo.ROLLOUT_FLAGS with the values of `changes` ({flag: value}) replaced, unknown flags appended."""
    flags = list(demo.ROLLOUT_FLAGS)
    for flag, value in changes.items():
        if flag in flags:
            flags[flags.index(flag) + 1] = str(value)
        else:
            flags += [flag, str(value)]
    return flags


def setting_dir(out, setting):
    return Path(out) / "settings" / setting


def plan(study, out, seeds=None, quick=False):
    """The runs of `study` -> jobs {"argv", "out", "tags", "condition", "setting", "seed"} (demo.run_one's job plus
    bookkeeping), condition by condition, seed by seed. Each argv is a complete `openrlhf-geo train` command line."""
    preset = QUICK if quick else {"steps": study.steps, "eval_steps": study.eval_steps}
    seeds = list(seeds if seeds is not None else study.seeds[:1] if quick else study.seeds)
    conditions = [c for c in study.conditions if not quick or c.name in study.quick]
    jobs = []
    for c in conditions:
        common = demo.common_flags(
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


def estimate_seconds(jobs, workers, sft_max_steps=demo.FULL["sft_max_steps"]):
    """Estimated wall seconds: the settings' SFT warm-ups one after another, then the runs spread over the workers."""
    settings = dict.fromkeys(job["setting"] for job in jobs)
    scale = sft_max_steps / demo.FULL["sft_max_steps"]
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
    """Data and SFT warm-up (cached) of every setting the jobs use -> {setting: demo.warm_up's info}."""
    infos = {}
    for name in dict.fromkeys(job["setting"] for job in jobs):
        setting, where = SETTINGS[name], setting_dir(out, name)
        train, held_out = demo.prepare_data(where, setting.max_operand)
        print(f"setting {name}: SFT warm-up in {where / 'sft'}")
        steps = sft_max_steps * setting.sft_scale
        infos[name] = demo.warm_up(where, train, held_out, None, steps, sft_config=setting.sft_config())
    return infos


# ---------------------------------------------------------------- summary and report


def load_planned(out, jobs, metrics):
    """The planned runs as {condition: {seed: Run}} (eval.report.scan_runs, restricted to the plan), each with the
    scalar FINAL (eval.report.final_scalars) and `last20%/<key>` (`t10`) for each key of `metrics` it logs: its mean
    over the last 20 % of the steps, SALT Table 10's window, without the steps where the key is undefined."""
    from openrlhf_geo.eval.report import final_scalars, scan_runs

    if not jobs:  # every planned run stopped (`summarize`)
        return {}, [t10(k) for k in metrics], []
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
    final_scalars(runs, logged, TABLE10, sources, skip_undefined=True)
    return runs, [t10(k) for k in metrics], notes


def t10(key):
    return final_name(key, TABLE10)


def describe(values):
    values = np.asarray(values, dtype=float)
    return {
        "mean": float(values.mean()) if values.size else math.nan,
        "sd": float(values.std(ddof=1)) if values.size > 1 else math.nan,
        "n": int(values.size),
    }


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


def cell(table, condition, scalar):
    return table.get(condition, {}).get(scalar, {}).get("mean", math.nan)


def scaling_section(table, rows):
    """salt-scaling by G: Table 10's columns per backbone ± SALT, SALT's paired gain, the trends over G (Spearman)."""
    gs = sorted({int(c[1:3]) for c in table if c[0] == "g"})
    by_g = {}
    for g in gs:
        for backbone in ("grpo", "dapo"):
            base, salt = f"g{g:02d}_{backbone}", f"g{g:02d}_{backbone}_salt"
            gain = next(
                (r for r in rows if r["method"] == salt and r["baseline"] == base and r["metric"] == FINAL), None
            )
            by_g[f"{g}/{backbone}"] = {
                "G": g,
                "backbone": backbone,
                "acc": cell(table, base, FINAL),
                "acc_salt": cell(table, salt, FINAL),
                "gain": None if gain is None else {k: gain[k] for k in ("gain", "low", "high", "n")},
                "pr": cell(table, base, t10("salt/pr")),
                "pr_salt": cell(table, salt, t10("salt/pr")),
                "n_eff": cell(table, base, t10("salt/n_eff_in")),  # Table 10's backbone n_eff: that of a
                "n_eff_salt": cell(table, salt, t10("salt/n_eff_out")),  # and SALT's: that of a'
                "alpha": cell(table, salt, t10("salt/alpha")),
                "D_a": cell(table, salt, t10("salt/D_a")),
                "D_g": cell(table, salt, t10("salt/D_g")),
                "U_perp_gain": cell(table, salt, t10("salt/U_perp_gain")),
                "sign_flip": cell(table, salt, t10("salt/sign_flip")),
                "kept": cell(table, salt, t10("salt/kept")),
            }
    trends = {}
    for backbone in ("grpo", "dapo"):
        points = [v for v in by_g.values() if v["backbone"] == backbone]
        for key in ("acc", "gain", "pr", "n_eff", "n_eff_salt", "alpha"):
            xs = [p["G"] for p in points]
            ys = [(p[key] or {}).get("gain", math.nan) if key == "gain" else p[key] for p in points]
            ok = [i for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
            rho = stats.spearmanr([xs[i] for i in ok], [ys[i] for i in ok]).statistic if len(ok) >= 3 else math.nan
            trends[f"{backbone}/{key}"] = float(rho)
    return {"by_g": by_g, "spearman_vs_G": trends, "paper_table10": PAPER_TABLE10}


def regime_section(table):
    """regime: condition -> backbone n_eff, α_t, D_a, accuracies; the distance to SALT Table 10's GRPO signature
    (z-scores with its sds: n_eff 0.31 ± 0.05 of the backbone, D_a 0.24 ± 0.04 of SALT) and the closest condition
    that salt-scaling can run in (not a change of G)."""
    n_eff_paper, d_a_paper = PAPER_TABLE10["grpo"]["n_eff"], PAPER_TABLE10["grpo_salt"]["D_a"]
    rows = {}
    for name in REGIMES:
        base, salt = f"{name}_grpo", f"{name}_salt"
        if base not in table or salt not in table:
            continue
        n_eff, d_a = cell(table, base, t10("salt/n_eff_in")), cell(table, salt, t10("salt/D_a"))
        rows[name] = {
            "n_eff": n_eff,
            "alpha": cell(table, base, t10("salt/alpha")),
            "alpha_salt": cell(table, salt, t10("salt/alpha")),
            "D_a": d_a,
            "pr": cell(table, base, t10("salt/pr")),
            "sign_flip": cell(table, salt, t10("salt/sign_flip")),
            "response_length": cell(table, base, t10("response_length")),
            "acc": cell(table, base, FINAL),
            "acc_salt": cell(table, salt, FINAL),
            "distance": math.hypot((n_eff - n_eff_paper[0]) / n_eff_paper[1], (d_a - d_a_paper[0]) / d_a_paper[1]),
        }
    eligible = {k: v for k, v in rows.items() if not REGIMES[k].varies_g and math.isfinite(v["distance"])}
    closest = min(eligible, key=lambda k: eligible[k]["distance"]) if eligible else None
    return {"conditions": rows, "closest": closest}


LEARNABLE_MIN_ACC = 0.25  # learnable-regime's rule: GRPO's final held-out accuracy at least this, and above step 0's


def learnable_section(runs, table):
    """learnable-regime: per setting GRPO's backbone n_eff, α_t, PR (last 20 %), its held-out accuracy at step 0 (the
    SFT model) and at the end, and the paired gain RL made; the candidate chosen by the protocol's rule (the learnable
    one with the smallest backbone n_eff) and whether its n_eff is below 1 (the condition for a salt-scaling rerun)."""
    from openrlhf_geo.eval.metrics import paired_gain

    rows = {}
    for name in ("demo", *LEARNABLE):
        condition = f"{name}_grpo"
        if condition not in runs:
            continue
        start, end = [], []  # held-out accuracy at step 0 (the SFT model) and at the end, per seed that has both
        for run in runs[condition].values():
            at, values = run.curves.get("eval/accuracy", (np.array([]), np.array([])))
            if FINAL in run.scalars and np.any(at == 0):
                start.append(float(values[at == 0][0]))
                end.append(run.scalars[FINAL])
        gain = paired_gain(end, start)
        rows[name] = {
            "n_eff": cell(table, condition, t10("salt/n_eff_in")),
            "alpha": cell(table, condition, t10("salt/alpha")),
            "pr": cell(table, condition, t10("salt/pr")),
            "response_length": cell(table, condition, t10("response_length")),
            "acc_step0": float(np.mean(start)) if start else math.nan,
            "acc": cell(table, condition, FINAL),
            "rl_gain": gain,
            "learnable": bool(cell(table, condition, FINAL) >= LEARNABLE_MIN_ACC and gain["low"] > 0),
        }
    eligible = [k for k in LEARNABLE if k in rows and rows[k]["learnable"] and math.isfinite(rows[k]["n_eff"])]
    chosen = min(eligible, key=lambda k: rows[k]["n_eff"]) if eligible else None
    return {"settings": rows, "chosen": chosen, "run_salt_scaling": chosen is not None and rows[chosen]["n_eff"] < 1}


def ablation_section(runs, table):
    """salt-ablations: per SALT variant the final accuracy and the share of SALT's loss against GRPO it recovers,
    (acc_variant − acc_salt) / (acc_grpo − acc_salt), with its geometry and the share of its steps with α_t > 0."""
    from openrlhf_geo.local.report import pooled

    grpo, salt = cell(table, "grpo", FINAL), cell(table, "salt", FINAL)
    loss = grpo - salt
    rows = {}
    for condition in table:
        if condition.startswith("salt"):
            acc = cell(table, condition, FINAL)
            geometry = ("salt/D_a", "salt/sign_flip", "salt/kept", "salt/n_eff_out", "salt/alpha", "salt/pr")
            rows[condition] = {
                "acc": acc,
                "recovered": (acc - salt) / loss if loss else math.nan,
                **{k.split("/")[-1]: cell(table, condition, t10(k)) for k in geometry},
                "alpha_positive": describe(pooled(runs, [condition], "salt/alpha") > 0)["mean"],
            }
    return {"grpo_acc": grpo, "salt_acc": salt, "salt_loss": loss, "variants": rows}


def geoalign_section(runs, out, steps):
    """geoalign-failure: GeoAlign's detection per noise (local.report.detection: GDI AUROC vs the reward-only pair
    count, by range of steps; projector validation accuracy), its step means of cos_gt_0.8, flag share, precision,
    recall, and each noise's measured corruption share."""
    from openrlhf_geo.local import report

    detection = {}
    for condition in runs:
        if condition.startswith("geoalign_") and report.gdi_records(Path(out) / "runs", condition):
            detection[condition] = report.detection(runs, Path(out) / "runs", condition, steps)
            means = {key: describe(report.pooled(runs, [condition], key))["mean"] for key in GEO}
            val_acc = report.pooled(runs, [condition], "geo/val_acc")  # App. C.1 reports its median
            means["geo/val_acc median"] = float(np.median(val_acc)) if val_acc.size else math.nan
            detection[condition]["step_means"] = means
    # the share of rollouts whose reward the noise changed, over all steps and seeds (the three noises' strengths)
    corrupted = {
        c: describe(report.pooled(runs, [c], "noise/corrupted"))["mean"] for c in runs if c.startswith("grpo_")
    }
    return {"detection": detection, "corrupted_share": corrupted}


def summarize(study, out, jobs, setup, stopped=None):
    """Every number of the study's report -> dict (strict JSON once passed through `strict_json`).

    `stopped`: {run directory: error} of runs that raised (e.g. DAPO's dynamic filtering finding no informative
    prompt, docs/studies/salt-scaling.md). A condition with a stopped run leaves the tables and comparisons and is
    reported as stopped, as that protocol fixes: per seed, the step that failed and the error."""
    stopped = stopped or {}
    out_of = {job["condition"] for job in jobs if job["out"] in stopped}
    runs, scalars, notes = load_planned(out, [job for job in jobs if job["condition"] not in out_of], study.metrics)
    table = condition_table(runs, scalars)
    rows = paired(runs, study.comparisons, scalars)
    summary = {"study": study.name, "title": study.title, "setup": setup, "notes": notes, "shown": study.shown}
    summary.update(table=table, comparisons=rows, stopped=stopped_runs(jobs, out_of, stopped))
    last = [int(s.max()) for seeds in runs.values() for r in seeds.values() for s, _ in r.curves.values()]
    steps = max(last, default=0)  # every condition stopped: no curves
    if study.name == "salt-scaling":
        summary["scaling"] = scaling_section(table, rows)
    elif study.name == "regime":
        summary["regime"] = regime_section(table)
    elif study.name == "learnable-regime":
        summary["learnable"] = learnable_section(runs, table)
    elif study.name == "salt-ablations":
        summary["ablations"] = ablation_section(runs, table)
    else:
        summary["geoalign"] = geoalign_section(runs, out, steps)
    return summary, runs


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


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row):
    if row is None:
        return "n/a"
    if row["n"] < 2 or row["low"] is None or not math.isfinite(row["low"]):
        return f"{row['gain']:+.3f} ({row['n']} seed, no CI)"
    return f"{row['gain']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


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
            f"- SFT `{name}`: {info['steps']} steps, held-out accuracy {_f(info['accuracy'])}, {info['params']:,} "
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
            + " | ".join("" if v is None else f"{_f(v['mean'])} ± {_f(v['sd'])}" for v in values)
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
            f"| {r['method']} | {r['baseline']} | {r['metric']} | {_ci(r)} |"
            for r in summary["comparisons"]
            if r["metric"] in summary["shown"]
        ),
    ]
    if "scaling" in summary:
        lines += _render_scaling(summary["scaling"])
    if "regime" in summary:
        lines += _render_regime(summary["regime"])
    if "learnable" in summary:
        lines += _render_learnable(summary["learnable"])
    if "ablations" in summary:
        lines += _render_ablations(summary["ablations"])
    if "geoalign" in summary:
        lines += _render_geoalign(summary["geoalign"])
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


SCALING_COLUMNS = ("pr", "pr_salt", "n_eff", "n_eff_salt", "alpha", "D_a", "D_g", "U_perp_gain", "sign_flip", "kept")
REGIME_COLUMNS = ("n_eff", "alpha", "alpha_salt", "D_a", "pr", "sign_flip", "response_length", "acc", "acc_salt",
                  "distance")  # fmt: skip
ABLATION_COLUMNS = ("acc", "recovered", "D_a", "sign_flip", "kept", "n_eff_out", "alpha", "alpha_positive", "pr")


def _render_scaling(section):
    paper = "; ".join(
        f"{name}: "
        + ", ".join(f"{k} {v[0]} ± {v[1]}" if isinstance(v, list | tuple) else f"{k} {v}" for k, v in row.items())
        for name, row in section["paper_table10"].items()
    )
    lines = [
        "",
        "## By G (SALT Table 10's columns over the last 20 % of steps; accuracy: held-out, last step)",
        "",
        "| G | backbone | acc | acc +SALT | SALT − backbone [95 % CI] | PR | PR +SALT | n_eff | n_eff +SALT | α_t "
        "| D_a | D_g | U⊥ gain | sign flips | kept ‖a‖² |",
        "|---|" + "---|" * 14,
    ]
    for v in section["by_g"].values():
        lines.append(
            f"| {v['G']} | {v['backbone']} | {_f(v['acc'])} | {_f(v['acc_salt'])} | {_ci(v['gain'])} | "
            + " | ".join(_f(v[k]) for k in SCALING_COLUMNS)
            + " |"
        )
    trends = ", ".join(f"{k} {_f(v, 2)}" for k, v in section["spearman_vs_G"].items())
    return [
        *lines,
        "",
        f"SALT Table 10 (DeepSeek-R1-Distill-Qwen-7B / MATH-TRAIN, 5 seeds, last 20 % of checkpoints): {paper}.",
        "",
        f"Spearman correlation with G over the G values: {trends}.",
    ]


def _render_regime(section):
    lines = [
        "",
        "## Conditions -> SALT's regime (backbone n_eff and α_t from GRPO's diagnostics, D_a from GRPO + SALT)",
        "",
        "| condition | n_eff | α_t | α_t (SALT run) | D_a | PR | sign flips | response length | acc GRPO | acc SALT | "
        "distance to Table 10 |",
        "|---|" + "---|" * 10,
        *(
            f"| {name} | " + " | ".join(_f(v[k]) for k in REGIME_COLUMNS) + " |"
            for name, v in section["conditions"].items()
        ),
        "",
        f"Closest condition salt-scaling can run in: `{section['closest']}` "
        f"(`openrlhf-geo study salt-scaling --regime {section['closest']}`).",
    ]
    return lines


def _render_learnable(section):
    chosen = section["chosen"]
    if chosen is None:
        verdict = "No candidate is learnable by the rule; salt-scaling is not rerun."
    elif section["run_salt_scaling"]:
        verdict = (f"Chosen: `{chosen}`, backbone n_eff below 1: rerun salt-scaling there "
                   f"(`openrlhf-geo study salt-scaling --regime {chosen}`).")  # fmt: skip
    else:
        verdict = f"Chosen: `{chosen}`, but its backbone n_eff is not below 1: salt-scaling is not rerun."
    return [
        "",
        f"## Settings (GRPO; learnable = final accuracy ≥ {LEARNABLE_MIN_ACC} and RL's gain over step 0 has a CI > 0)",
        "",
        "| setting | n_eff | α_t | PR | response length | acc step 0 | acc final | RL gain [95 % CI] | learnable |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {_f(v['n_eff'])} | {_f(v['alpha'])} | {_f(v['pr'], 1)} | {_f(v['response_length'], 1)} | "
            f"{_f(v['acc_step0'])} | {_f(v['acc'])} | {_ci(v['rl_gain'])} | {'yes' if v['learnable'] else 'no'} |"
            for name, v in section["settings"].items()
        ),
        "",
        verdict,
    ]


def _render_ablations(section):
    return [
        "",
        f"## Which component costs SALT its accuracy (GRPO {_f(section['grpo_acc'])}, SALT {_f(section['salt_acc'])})",
        "",
        "recovered = (acc_variant − acc_SALT) / (acc_GRPO − acc_SALT): 1 = as good as GRPO, 0 = as SALT.",
        "",
        "| variant | acc | recovered | D_a | sign flips | kept ‖a‖² | n_eff(a') | α_t | steps with α_t > 0 | PR |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | " + " | ".join(_f(v[k]) for k in ABLATION_COLUMNS) + " |"
            for name, v in section["variants"].items()
        ),
    ]


def _render_geoalign(section):
    shares = ", ".join(f"{c} {_f(v)}" for c, v in section["corrupted_share"].items())
    lines = ["", f"Share of rollouts whose reward the noise changed (all steps, GRPO runs): {shares}."]
    for condition, d in section["detection"].items():
        lines += [
            "",
            f"## GeoAlign detection ({condition})",
            "",
            f"- GDI AUROC pooled {_f(d['gdi_auroc'])} vs reward-only pair count {_f(d['pair_count_auroc'])} "
            f"({d['corrupted_scored']} corrupted vs {d['clean_scored']} clean scored rollouts; "
            f"{d['corrupted'] - d['corrupted_scored']} corrupted ones without a GDI).",
            "- Step means: " + ", ".join(f"{k} {_f(v)}" for k, v in d["step_means"].items()),
            "",
            "| steps | GDI AUROC | reward-only AUROC | projector val. accuracy | shortcut share |",
            "|---|---|---|---|---|",
            *(
                f"| {span} | {_f(p['gdi_auroc'])} | {_f(p['pair_count_auroc'])} | {_f(p['val_acc'])} | "
                f"{_f(p['shortcut'], 2)} |"
                for span, p in d["by_steps"].items()
            ),
        ]
    return lines


def _figure(*shape, size=(6, 4)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(*shape, figsize=size)


def _save(plt, fig, out, name):
    fig.tight_layout()
    fig.savefig(Path(out) / name, dpi=100)
    plt.close(fig)
    return name


def plot_scaling(section, out):
    """SALT Fig. 4(c) (accuracy vs G) and Fig. 4(d) (PR and n_eff vs G) -> file names."""
    points = list(section["by_g"].values())
    plt, fig_c, ax = _figure()
    _, fig_d, (ax_pr, ax_n) = _figure(1, 2, size=(10, 4))
    for backbone in ("grpo", "dapo"):
        mine = [p for p in points if p["backbone"] == backbone]
        for suffix, label in (("", backbone.upper()), ("_salt", f"{backbone.upper()}+SALT")):
            for axis, key in ((ax, "acc"), (ax_pr, "pr"), (ax_n, "n_eff")):
                axis.plot([p["G"] for p in mine], [p[key + suffix] for p in mine], marker="o", label=label)
    for axis, label in ((ax, "held-out accuracy (last step)"), (ax_pr, "PR (last 20 %)"), (ax_n, "n_eff (last 20 %)")):
        axis.set(xscale="log", xlabel=f"G ({BUDGET} rollouts per step)", ylabel=label)
        axis.set_xticks(sorted({p["G"] for p in points}), [str(g) for g in sorted({p["G"] for p in points})])
        axis.legend(fontsize=8)
    return [_save(plt, fig_c, out, "fig4c_accuracy_vs_G.png"), _save(plt, fig_d, out, "fig4d_pr_neff_vs_G.png")]


def plot_alpha(runs, out):
    """SALT Fig. 9: α_t and the clip fraction over the steps, one line per G (SALT runs, mean over seeds)."""
    names = []
    for backbone in ("grpo", "dapo"):
        plt, fig, (ax_a, ax_c) = _figure(1, 2, size=(10, 4))
        for condition in sorted(c for c in runs if c.endswith(f"_{backbone}_salt")):
            for axis, key in ((ax_a, "salt/alpha"), (ax_c, "clip_frac")):
                curves = [r.curves[key] for r in runs[condition].values() if key in r.curves]
                if curves and all(len(s) == len(curves[0][0]) for s, _ in curves):
                    axis.plot(curves[0][0], np.nanmean([v for _, v in curves], 0), label=f"G = {int(condition[1:3])}")
        ax_a.set(xlabel="step", ylabel="α_t (mean over seeds)", title=f"{backbone.upper()}+SALT")
        ax_c.set(xlabel="step", ylabel="clip fraction", yscale="symlog", title=f"{backbone.upper()}+SALT")
        ax_a.legend(fontsize=8)
        names.append(_save(plt, fig, out, f"fig9_alpha_{backbone}.png"))
    return names


def plot_regime(section, out):
    """Each condition in the (backbone n_eff, D_a) plane next to SALT Table 10's GRPO point."""
    plt, fig, ax = _figure()
    for name, v in section["conditions"].items():
        ax.scatter(v["n_eff"], v["D_a"])
        ax.annotate(name, (v["n_eff"], v["D_a"]), fontsize=7)
    (n, n_sd), (d, d_sd) = PAPER_TABLE10["grpo"]["n_eff"], PAPER_TABLE10["grpo_salt"]["D_a"]
    ax.errorbar([n], [d], xerr=[n_sd], yerr=[d_sd], color="black", marker="*", label="SALT Table 10 (GRPO)")
    ax.set(xlabel="backbone n_eff (last 20 %)", ylabel="D_a of GRPO + SALT (last 20 %)")
    ax.legend(fontsize=8)
    return [_save(plt, fig, out, "regime_neff_vs_Da.png")]


def plot_ablations(section, table, out):
    """Final accuracy per SALT variant (mean ± sd over seeds), GRPO's as a line."""
    plt, fig, ax = _figure(size=(9, 4))
    names = list(section["variants"])
    means = [table[n][FINAL]["mean"] for n in names]
    sds = [table[n][FINAL]["sd"] for n in names]
    ax.bar(range(len(names)), means, yerr=sds, capsize=3)
    ax.axhline(section["grpo_acc"], color="black", linestyle="--", label="GRPO")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set(ylabel="held-out accuracy (last step)")
    ax.legend(fontsize=8)
    return [_save(plt, fig, out, "ablations_accuracy.png")]


def write_report(study, out, jobs, setup, stopped=None):
    """summary.json, report.md and the plots of the planned runs -> the summary (`stopped`: as `summarize`'s)."""
    from openrlhf_geo.eval.report import plot_curve

    out = Path(out)
    summary, runs = summarize(study, out, jobs, setup, stopped)
    plots = []
    if "scaling" in summary:
        plots += plot_scaling(summary["scaling"], out) + plot_alpha(runs, out)
    if "regime" in summary:
        plots += plot_regime(summary["regime"], out)
    if "ablations" in summary:
        plots += plot_ablations(summary["ablations"], summary["table"], out)
    # accuracy curves in groups a plot can hold: by G, by noise, all conditions of a small study
    groups = {"": list(runs)} if len(runs) <= 8 else {}
    if "scaling" in summary:
        groups = {f"_G{g}": [c for c in runs if c.startswith(f"g{g:02d}_")] for g in (2, 4, 8, 16, 32, 64)}
    if "geoalign" in summary:
        groups = {f"_{n}": ["grpo_clean", *(c for c in runs if c.endswith(n))] for n in NOISES}
    for suffix, conditions in groups.items():
        conditions = [c for c in conditions if c in runs]
        if conditions:
            plots.append(f"eval_accuracy{suffix}.png")
            plot_curve({c: runs[c] for c in conditions}, "eval/accuracy", out / plots[-1])
    summary["plots"] = plots
    data = strict_json(summary)
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "report.md").write_text(render(data))
    return summary


# ---------------------------------------------------------------- command line


def protocol_commands(study):
    """{condition: what its command adds to the common flags, as one string}: the setting (when not the demo's), the
    rollout flags whose demo values it replaces, then the method flags. The protocols list exactly these."""
    commands = {}
    for c in study.conditions:
        setting = [] if c.setting == "demo" else [f"[setting {c.setting}]"]
        changed = [str(x) for flag, value in c.rollout.items() for x in (flag, value)]
        commands[c.name] = " ".join([*setting, shlex.join([*changed, *c.flags]) or "(no flags)"])
    return commands


def common_command(out, steps, eval_steps):
    """The flags every run starts with, for setting SETTING (its SFT model and data under <out>/settings/SETTING)."""
    return shlex.join(demo.common_flags(setting_dir(out, "SETTING"), steps, eval_steps))


def build_parser():
    from openrlhf_geo.local.train import FlagParser

    p = FlagParser(prog="openrlhf-geo study", description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=(*STUDIES, *RUNNERS), help="which study (protocol: docs/studies/NAME.md)")
    p.add_argument("--out", default=None, help="output directory (default runs/studies/NAME, NAME-quick with --quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the protocol's)")
    p.add_argument("--quick", action="store_true", help="smoke run: one seed, two conditions, 2 steps, short SFT")
    p.add_argument("--workers", type=int, default=None, help="runs in parallel processes (default 2; --quick 1)")
    p.add_argument("--regime", default=None, help="salt-scaling only: a regime or learnable-regime setting to run in")
    return p


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
    except ValueError as error:
        print(f"openrlhf-geo study: error: {error}", file=sys.stderr)
        return 2
    if args.name in RUNNERS:  # it checks the other options and claims --out itself
        return importlib.import_module(RUNNERS[args.name]).main(args)
    try:
        if args.regime is not None and args.name != "salt-scaling":
            raise ValueError(f"--regime only applies to salt-scaling (got study {args.name})")
        study = salt_scaling(args.regime or "demo") if args.name == "salt-scaling" else STUDIES[args.name]()
        workers = args.workers if args.workers is not None else 1 if args.quick else min(2, os.cpu_count() or 1)
        if workers < 1:
            raise ValueError(f"--workers must be >= 1 (got {workers})")
        if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
            raise ValueError(f"--seeds must be distinct (got {' '.join(map(str, args.seeds))})")
    except ValueError as error:
        print(f"openrlhf-geo study: error: {error}", file=sys.stderr)
        return 2
    # what the runs depend on (not --seeds: each run records its own command, `finished`)
    regime = f" --regime {args.regime}" if args.regime not in (None, "demo") else ""
    command = f"openrlhf-geo study {args.name}{regime}" + (" --quick" if args.quick else "")
    try:
        with demo.claim_output(
            args.out or f"runs/studies/{args.name}" + ("-quick" if args.quick else ""), command
        ) as out:
            return run(args, study, out, workers)
    except demo.OutputClaimed as error:
        print(f"openrlhf-geo study: error: {error}", file=sys.stderr)
        return 2


def run(args, study, out, workers):
    """The study in its claimed `out` (`main` checked the options) -> exit status."""
    torch.set_num_threads(1)  # as the demo: the runs' workers take one thread each
    used = demo.check_kernels("openrlhf-geo study")
    steps, eval_steps = (QUICK["steps"], QUICK["eval_steps"]) if args.quick else (study.steps, study.eval_steps)
    sft_steps = QUICK["sft_max_steps"] if args.quick else demo.FULL["sft_max_steps"]
    jobs = plan(study, out, args.seeds, args.quick)
    pending = [job for job in jobs if not finished(job, steps)]
    estimate = estimate_seconds(jobs, workers, sft_steps)
    print(
        f"study {study.name}: {len(jobs)} runs, {len(pending)} to go; all of them take about {estimate / 60:.0f} min "
        f"on {workers} worker(s) (docs/studies/{study.name}.md)"
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
            demo.run_all(pending, workers, steps)
    except demo.RunsFailed as failed:  # the report lists them and leaves their conditions out (`summarize`)
        stopped = {job["out"]: f"{type(error).__name__}: {error}" for job, error in failed.failures}
        print(f"openrlhf-geo study: {len(stopped)} run(s) stopped by an error: {', '.join(stopped)}", file=sys.stderr)
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
        "sft": sft,
        "commands": {
            "common": common_command(out, steps, eval_steps),
            **{
                c: command for c, command in protocol_commands(study).items() if any(j["condition"] == c for j in jobs)
            },
        },
    }
    write_report(study, out, jobs, setup, stopped)
    print(f"study {study.name} finished: {out / 'report.md'}" + (f", {len(stopped)} runs stopped" if stopped else ""))
    return 1 if stopped else 0
