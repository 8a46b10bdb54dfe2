"""`openrlhf-geo study long-cot`: SALT in its regime on a task the model can learn, with long chains of thought.
Protocol, candidates, budget and decision rules: docs/studies/long-cot.md (committed before any comparison ran).

SALT (arXiv 2606.05800) is built for signed cancellation in long reasoning (§2.2-2.3, Fig. 2): its mixing coefficient
α_t = max(0, 1 − n_eff) (§3.2, Eq. 17, n_eff of Eq. 6 over the signed per-rollout updates) is nonzero only when the
backbone's n_eff < 1, and Table 10 (App. F.5) reports n_eff = 0.31 for GRPO. The demo's two-digit additions (~28
tokens) sit at n_eff 1.3-1.5. This study uses `long_cot`'s repeated-addition trace (116-269 tokens):

- phase 1: GRPO with `--salt.diagnostics` (SALT's geometry of GRPO's own advantages, no change to training) at each
  candidate length k in CANDIDATES, PHASE1_SEEDS; the rule (`decide`) picks the length that is learnable and in
  SALT's regime;
- phase 2, in the chosen length only: GRPO, GRPO + SALT and SALT with fixed α ∈ {0, 0.5, 1} (`--salt.variant
  fixed-alpha`, §4.3 Fig. 4(b)), PHASE2_SEEDS, paired by seed.

Every run is one `openrlhf-geo train` command (`long_cot.train_flags` + the condition's flags + seed and output),
run as a demo job (`recipe.run_one` under `run_all`'s progress bar) into <out>/runs/k<k>/<condition>/seed<S>/; a run
whose metrics.jsonl reaches the last step and whose stored command (study.json) is the planned one is skipped, so an
interrupted study resumes where it stopped. One SFT warm-up serves every length (`long_cot.prepare_sft`, cached in
<out>/sft). The end: <out>/summary.json (every number) and <out>/report.md.
"""

import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab import long_cot_task as long_cot
from openrlhf_geo.lab.studies.base import Study
from openrlhf_geo.local import kernels, rundir

CANDIDATES = (3, 5, 7)  # k: responses of ~116, ~193, ~269 tokens
PHASE1_SEEDS = (2025, 2026, 2027)
PHASE2_SEEDS = (2025, 2026, 2027, 2028, 2029)
STEPS, EVAL_STEPS = 30, 15  # RL steps per run; held-out evaluation at steps 0, 15, 30
ROLLOUT = {"batch_size": 8, "group": 8}  # 64 rollouts per step = one SALT partition; G = 8 as SALT Table 4
ACC_RANGE = (0.2, 0.8)  # learnable: held-out accuracy at step 0 in this range ...
WINDOW = 0.2  # ... and SALT's regime: the backbone's n_eff < 1 over the last 20 % of steps (Table 10's window)
LR = 3e-4  # the demo's RL learning rate (phase 1)
# Amendment (docs/studies/long-cot.md, "Amendment", committed after phase 1 and before these runs): when no length
# qualifies, phase 1 is repeated at k = 3 (the only length whose step-0 accuracy is in ACC_RANGE) with a 10x smaller
# learning rate, under the same rule; phase 2 then runs at the length and learning rate it chooses
AMENDMENT = {"candidates": (3,), "lr": 3e-5}
# Amendment 2 (committed after phase 1b, before these runs): descriptive GRPO runs at the other lengths with phase 1b's
# learning rate, for n_eff against response length where RL does not collapse; they cannot be chosen (their step-0
# accuracy is below ACC_RANGE) and change no decision
DESCRIPTIVE = {"candidates": (5, 7), "lr": 3e-5}
QUICK = {"steps": 2, "eval_steps": 2, "sft_steps": 30, "seeds": (2025,), "candidates": (3,)}

GRPO = ("--advantage_estimator", "group_norm", "--salt.diagnostics", "--salt.features", "exact")
SALT = ("--advantage_estimator", "salt", "--salt.features", "exact")
PHASE2 = {
    "grpo": GRPO,
    "salt": SALT,
    **{f"salt_fixed{a}": (*SALT, "--salt.variant", "fixed-alpha", "--salt.alpha", a) for a in ("0", "0.5", "1")},
}
# SALT Table 10's columns (App. F.5) as the engine logs them, plus the run's basics
TABLE10 = ("salt/n_eff_in", "salt/n_eff_out", "salt/D_a", "salt/D_g", "salt/U_perp_gain", "salt/alpha",
           "salt/sign_flip", "salt/pr", "salt/k", "response_length", "accuracy")  # fmt: skip
PAPER = {"grpo": {"n_eff": 0.31}, "grpo_salt": {"n_eff": 0.80, "D_a": 0.24, "D_g": 0.16, "U_perp_gain": 1.47}}

# ---------------------------------------------------------------- plan


def cell(k, lr=LR):
    """The name of a length and learning rate: k<k>, or k<k>_lr<lr> for another learning rate than LR."""
    return f"k{k}" if lr == LR else f"k{k}_lr{lr:g}"


def job(out, k, condition, seed, steps, eval_steps, lr=LR):
    """One run: {"argv", "out", "tags", "k", "lr", "cell", "condition", "seed"} (recipe.run_one's job plus
    bookkeeping)."""
    run = Path(out) / "runs" / cell(k, lr) / condition / f"seed{seed}"
    argv = [
        *long_cot.train_flags(out, k, steps, eval_steps, ROLLOUT["batch_size"], ROLLOUT["group"], lr),
        *PHASE2[condition],
        "--train.seed", str(seed), "--reward.noise.seed", str(seed),
        "--ckpt.output_dir", str(run),
    ]  # fmt: skip
    return {"argv": argv, "out": str(run), "tags": {"method": f"{cell(k, lr)}_{condition}", "seed": seed}, "k": k,
            "lr": lr, "cell": cell(k, lr), "condition": condition, "seed": seed}  # fmt: skip


def phase1_jobs(out, candidates, seeds, steps, eval_steps, lr=LR):
    return [job(out, k, "grpo", s, steps, eval_steps, lr) for k in candidates for s in seeds]


PHASE2_ORDER = (("grpo", "salt"), ("salt_fixed0", "salt_fixed1"), ("salt_fixed0.5",))  # the order they run in


def phase2_jobs(out, k, seeds, steps, eval_steps, lr=LR):
    """GRPO and SALT seed by seed first, then fixed α 0 and 1, then 0.5: a study stopped early has its main
    comparison first."""
    return [job(out, k, c, s, steps, eval_steps, lr) for block in PHASE2_ORDER for s in seeds for c in block]


def finished(j, steps):
    """Whether run `j` is complete: its stored command is the job's and metrics.jsonl reaches `steps`."""
    try:
        if json.loads((Path(j["out"]) / "study.json").read_text())["argv"] != j["argv"]:
            return False
        lines = (Path(j["out"]) / "metrics.jsonl").read_text().splitlines()
        return bool(lines) and json.loads(lines[-1]).get("step") == steps
    except (OSError, ValueError, KeyError):
        return False


def run_jobs(jobs, workers, steps):
    """Run the jobs not finished yet (`recipe.run_all`, one progress bar) -> {out: error} of the runs that failed."""
    pending = [j for j in jobs if not finished(j, steps)]
    for j in pending:  # the command a finished run is recognised by; an old run's logs go
        run = Path(j["out"])
        run.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "gdi.jsonl"):
            (run / name).unlink(missing_ok=True)
        (run / "study.json").write_text(json.dumps({"argv": j["argv"]}) + "\n")
    print(f"{len(jobs)} runs, {len(jobs) - len(pending)} finished before, {len(pending)} to go")
    if not pending:
        return {}
    RAN.add(id(jobs))
    try:
        recipe.run_all(pending, workers, steps)
    except recipe.RunsFailed as failed:
        return {j["out"]: f"{type(e).__name__}: {e}" for j, e in failed.failures}
    return {}


RAN = set()  # the job lists `run_jobs` ran something of in this process (for the wall times a resumed study keeps)


# ---------------------------------------------------------------- per-run numbers


def read_run(path, steps):
    """A run's numbers: held-out accuracy at step 0 and at the last step (`acc0`, `acc_final`), their mean over the
    evaluations (`acc_mean`), and the mean of each TABLE10 key over the last WINDOW of the steps (steps > (1 −
    WINDOW)·steps, SALT Table 10's window), leaving out the steps where the key is undefined: NaN or absent, and for
    SALT's geometry (salt/*) the steps whose groups are all tied (`signal/tied_groups` = 1: every advantage is 0 and
    the engine logs n_eff = 0/0 := 0, α_t = 1, which would read as cancellation)."""
    rows = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    first = (1 - WINDOW) * steps
    out = {
        "acc0": evals.get(0, math.nan),
        "acc_final": evals.get(steps, math.nan),
        "acc_mean": float(np.mean([v for s, v in evals.items() if s > 0])) if len(evals) > 1 else math.nan,
    }
    for key in TABLE10:
        values = [
            r[key] for r in rows
            if r.get("step", 0) > first and isinstance(r.get(key), (int, float))
            and not (key.startswith("salt/") and r.get("signal/tied_groups", 0) >= 1)
        ]  # fmt: skip
        values = [v for v in values if math.isfinite(v)]
        out[key] = float(np.mean(values)) if values else math.nan
    # descriptive, over every step with an untied group (not the rule's window): n_eff and how often α_t > 0
    defined = [
        r for r in rows if isinstance(r.get("salt/n_eff_in"), (int, float)) and r.get("signal/tied_groups", 0) < 1
    ]
    out["n_eff_all"] = float(np.mean([r["salt/n_eff_in"] for r in defined])) if defined else math.nan
    out["alpha_pos_share"] = float(np.mean([r["salt/n_eff_in"] < 1 for r in defined])) if defined else math.nan
    out["defined_steps"] = len(defined)
    return out


def paired(values, baseline):
    """Mean paired difference of per-seed `values` − `baseline` ({seed: x}) over their common seeds with a 95 %
    percentile-bootstrap CI (scipy.stats.bootstrap, `eval.metrics.paired_gain`, SALT App. H)."""
    from openrlhf_geo.eval.metrics import paired_gain

    seeds = sorted(s for s in set(values) & set(baseline) if math.isfinite(values[s]) and math.isfinite(baseline[s]))
    if not seeds:
        return {"gain": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    return paired_gain([values[s] for s in seeds], [baseline[s] for s in seeds])


def describe(values):
    xs = [v for v in values if math.isfinite(v)]
    sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else math.nan
    return {"mean": float(np.mean(xs)) if xs else math.nan, "sd": sd, "n": len(xs)}


# ---------------------------------------------------------------- the rules (docs/studies/long-cot.md)


def decide(phase1):
    """Apply the protocol's rule to phase 1's per-length summaries {k: {"acc0", "gain", "n_eff"}} -> {"learnable":
    [k], "in_regime": [k], "chosen": k | None}. Learnable: mean step-0 accuracy in ACC_RANGE and RL's gain CI above 0;
    in SALT's regime: mean backbone n_eff over the window below 1; chosen: among the lengths that are both, the one
    with the smallest n_eff."""
    learnable = [
        k for k, r in phase1.items()
        if ACC_RANGE[0] <= r["acc0"]["mean"] <= ACC_RANGE[1] and r["gain"]["low"] > 0
    ]  # fmt: skip
    in_regime = [k for k, r in phase1.items() if r["n_eff"]["mean"] < 1]
    both = [k for k in learnable if k in in_regime]
    chosen = min(both, key=lambda k: phase1[k]["n_eff"]["mean"]) if both else None
    return {"learnable": learnable, "in_regime": in_regime, "chosen": chosen}


def summarize_phase1(runs):
    """{k: {seed: read_run}} -> {k: {"acc0", "acc_final", "gain" (paired CI of final − step 0), "n_eff", "alpha",
    "pr", "response_length", "per_seed"}}."""
    table = {}
    for k, seeds in runs.items():
        acc0 = {s: r["acc0"] for s, r in seeds.items()}
        final = {s: r["acc_final"] for s, r in seeds.items()}
        table[k] = {
            "acc0": describe(acc0.values()),
            "acc_final": describe(final.values()),
            "gain": paired(final, acc0),
            "n_eff": describe(r["salt/n_eff_in"] for r in seeds.values()),
            "alpha": describe(r["salt/alpha"] for r in seeds.values()),
            "pr": describe(r["salt/pr"] for r in seeds.values()),
            "n_eff_all": describe(r["n_eff_all"] for r in seeds.values()),
            "alpha_pos_share": describe(r["alpha_pos_share"] for r in seeds.values()),
            "defined_steps": describe(r["defined_steps"] for r in seeds.values()),
            "response_length": describe(r["response_length"] for r in seeds.values()),
            "per_seed": seeds,
        }
    return table


def summarize_phase2(runs):
    """{condition: {seed: read_run}} -> {"table": {condition: {metric: describe}}, "vs_grpo" / "vs_salt":
    {condition: {metric: paired}}} with metric in acc_final, acc_mean and TABLE10."""
    metrics = ("acc_final", "acc_mean", *TABLE10)
    table = {c: {m: describe(r[m] for r in seeds.values()) for m in metrics} for c, seeds in runs.items()}

    def against(base):
        if base not in runs:
            return {}
        return {
            c: {m: paired({s: r[m] for s, r in seeds.items()}, {s: r[m] for s, r in runs[base].items()})
                for m in metrics}
            for c, seeds in runs.items() if c != base
        }  # fmt: skip

    return {"table": table, "vs_grpo": against("grpo"), "vs_salt": against("salt")}


def verdict(row):
    """win / loss / no difference detected, from a paired CI of SALT − GRPO final accuracy."""
    low, high = _num(row["low"]), _num(row["high"])
    if not math.isfinite(low):
        return "undecided (fewer than 2 seeds)"
    return "win" if low > 0 else "loss" if high < 0 else "no difference detected"


# ---------------------------------------------------------------- report


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _num(x):
    """summary.json writes NaN as null (`strict_json`): read it back as NaN."""
    return math.nan if x is None else x


def _ci(row, digits=3):
    gain, low, high = (_num(row[key]) for key in ("gain", "low", "high"))
    if not math.isfinite(gain):
        return "n/a"
    return f"{gain:+.{digits}f} [{_f(low, digits) if not math.isfinite(low) else f'{low:+.{digits}f}'}, " + (
        f"{_f(high, digits) if not math.isfinite(high) else f'{high:+.{digits}f}'}]")  # fmt: skip


def _md(d):
    return f"{_f(d['mean'])} ± {_f(d['sd'])}"


def phase1_lines(title, p1, rule):
    lines = [
        f"## {title}",
        "",
        "| length | response length | acc step 0 | acc final | RL gain [95 % CI] | backbone n_eff (last 20 %) | α_t |"
        " PR | n_eff, all untied steps | steps with n_eff < 1 | untied steps | learnable | in regime |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in p1.items():
        lines.append(
            f"| {k} | {_f(r['response_length']['mean'], 1)} | {_md(r['acc0'])} | {_md(r['acc_final'])} | "
            f"{_ci(r['gain'])} | {_md(r['n_eff'])} | {_f(r['alpha']['mean'])} | {_f(r['pr']['mean'], 2)} | "
            f"{_md(r['n_eff_all'])} | {_f(r['alpha_pos_share']['mean'], 2)} | {_f(r['defined_steps']['mean'], 1)} | "
            f"{'yes' if k in rule['learnable'] else 'no'} | {'yes' if k in rule['in_regime'] else 'no'} |"
        )
    chosen = rule["chosen"] if rule["chosen"] is not None else "none"
    lines += ["", f"Rule: learnable {rule['learnable']}, in SALT's regime {rule['in_regime']}, chosen: {chosen}.", ""]
    return lines


def render(summary):
    s = summary["setup"]
    lines = [
        "# long-cot: SALT in its regime on a learnable long chain-of-thought task (docs/studies/long-cot.md)",
        "",
        f"SFT warm-up: {s['sft']['params']} parameters, {s['sft']['steps']} steps, {_f(s['sft']['sft_s'], 0)} s; "
        f"held-out accuracy after it per k: {s['sft']['accuracy']}; shortcut share: {s['sft']['shortcut']}.",
        f"Runs: {s['steps']} RL steps, B = {ROLLOUT['batch_size']} prompts x G = {ROLLOUT['group']}, workers "
        f"{s['workers']}; wall time phase 1 {_f(s.get('phase1_s', math.nan), 0)} s, phase 1b "
        f"{_f(s.get('phase1b_s', math.nan), 0)} s, descriptive {_f(s.get('phase1c_s', math.nan), 0)} s, phase 2 "
        f"{_f(s.get('phase2_s', math.nan), 0)} s, total {_f(s['wall_s'], 0)} s with the SFT "
        f"warm-up's {_f(s.get('sft_wall_s', math.nan), 0)} s (each phase as measured when its runs ran; a resumed "
        f"study keeps those). Kernels: {s['kernels']}.",
        "",
    ]
    lines += phase1_lines("Phase 1: GRPO with SALT's diagnostics, per length", summary["phase1"], summary["decision"])
    if summary.get("phase1b"):
        lines += phase1_lines(
            "Phase 1b (amendment): GRPO with SALT's diagnostics, lr 3e-5", summary["phase1b"], summary["decision1b"]
        )
    if summary.get("descriptive"):
        title = "Descriptive runs (amendment 2; not candidates): GRPO with SALT's diagnostics, lr 3e-5"
        lines += phase1_lines(title, summary["descriptive"], decide(summary["descriptive"]))
    p2 = summary.get("phase2")
    if p2:
        lines += [
            f"## Phase 2 (k = {summary['phase2_k']}): Table 10's columns over the last 20 % of steps, mean ± sd over "
            "seeds",
            "",
            "| condition | acc final | acc mean of evals | n_eff in | n_eff out | D_a | D_g | U⊥ gain | α_t |"
            " sign flip | PR | response length |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c, t in p2["table"].items():
            lines.append(
                f"| {c} | {_md(t['acc_final'])} | {_md(t['acc_mean'])} | {_md(t['salt/n_eff_in'])} | "
                f"{_md(t['salt/n_eff_out'])} | {_md(t['salt/D_a'])} | {_md(t['salt/D_g'])} | "
                f"{_md(t['salt/U_perp_gain'])} | {_md(t['salt/alpha'])} | {_md(t['salt/sign_flip'])} | "
                f"{_f(t['salt/pr']['mean'], 2)} | {_f(t['response_length']['mean'], 1)} |"
            )
        lines += ["", "Paired by seed, 95 % percentile-bootstrap CIs:", "",
                  "| condition | vs | final accuracy | accuracy, mean of evals | n_eff out | verdict (final) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for base in ("grpo", "salt"):
            for c, row in p2[f"vs_{base}"].items():
                lines.append(
                    f"| {c} | {base} | {_ci(row['acc_final'])} | {_ci(row['acc_mean'])} | "
                    f"{_ci(row['salt/n_eff_out'])} | {verdict(row['acc_final'])} |"
                )
        lines.append("")
    if summary.get("not_finished"):
        lines += ["Planned runs that did not finish (not in the tables):"]
        lines += [*[f"- {r}" for r in summary["not_finished"]], ""]
    if summary.get("stopped"):
        lines += ["Runs stopped by an error (left out):", *[f"- {k}: {v}" for k, v in summary["stopped"].items()], ""]
    lines += ["Commands: `openrlhf-geo train` + the length's common flags + the condition's flags + `--train.seed S "
              "--reward.noise.seed S --ckpt.output_dir DIR`:", ""]  # fmt: skip
    lines += [f"- {name}: `{cmd}`" for name, cmd in s["commands"].items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the study


def load(jobs, steps, stopped):
    runs = {}
    for j in jobs:
        if j["out"] in stopped or not finished(j, steps):
            continue
        runs.setdefault(j["cell"], {}).setdefault(j["condition"], {})[j["seed"]] = read_run(j["out"], steps)
    return runs


def command(j, common=False):
    """The run's train flags without seed and output (`common`: without the condition's flags too)."""
    argv = j["argv"]
    end = argv.index("--train.seed") - (len(PHASE2[j["condition"]]) if common else 0)
    return shlex.join(argv[:end])


def run(args, out, workers, execute=True):
    """The study in its claimed `out` -> exit status. `execute` False: only the summary and report of the runs that
    finished (a study stopped before its end is reported so, every finished run included)."""
    torch.set_num_threads(1)
    used = kernels.check("openrlhf-geo study")
    quick = args.quick
    steps, eval_steps = (QUICK["steps"], QUICK["eval_steps"]) if quick else (STEPS, EVAL_STEPS)
    candidates = QUICK["candidates"] if quick else CANDIDATES
    seeds1 = tuple(args.seeds) if args.seeds else QUICK["seeds"] if quick else PHASE1_SEEDS
    seeds2 = tuple(args.seeds) if args.seeds else QUICK["seeds"] if quick else PHASE2_SEEDS
    recipe = long_cot.SftRecipe(steps=QUICK["sft_steps"]) if quick else long_cot.SftRecipe()
    start = time.perf_counter()
    print(f"study long-cot: SFT warm-up, then phase 1 (GRPO, k in {list(candidates)}, seeds {list(seeds1)}), then "
          f"phase 2 in the chosen k (5 conditions, seeds {list(seeds2)}) (docs/studies/long-cot.md)")  # fmt: skip
    sft = long_cot.prepare_sft(out, recipe, eval_ks=candidates)
    for k in candidates:
        long_cot.prepare_data(out, k)
    sft_s = time.perf_counter() - start
    stopped = {}

    def run_phase(jobs):
        """Run `jobs` (when executing) -> (their runs as `load` reads them, the phase's wall seconds)."""
        t = time.perf_counter()
        stopped.update(run_jobs(jobs, workers, steps) if execute else {})
        return load(jobs, steps, stopped), time.perf_counter() - t

    jobs1 = phase1_jobs(out, candidates, seeds1, steps, eval_steps)
    runs1, phase1_s = run_phase(jobs1)
    phase1 = summarize_phase1({c: conditions["grpo"] for c, conditions in runs1.items()})
    decision = decide(phase1)
    chosen = {j["cell"]: (j["k"], j["lr"]) for j in jobs1}.get(decision["chosen"])
    phase1b, decision1b, jobs1b, phase1b_s = None, None, [], 0.0
    if chosen is None and not quick:  # the amendment
        print(f"phase 1 chose no length: the amendment's phase 1b (k in {list(AMENDMENT['candidates'])}, lr "
              f"{AMENDMENT['lr']:g})")  # fmt: skip
        jobs1b = phase1_jobs(out, AMENDMENT["candidates"], seeds1, steps, eval_steps, AMENDMENT["lr"])
        runs1b, phase1b_s = run_phase(jobs1b)
        phase1b = summarize_phase1({c: conditions["grpo"] for c, conditions in runs1b.items()})
        decision1b = decide(phase1b)
        chosen = {j["cell"]: (j["k"], j["lr"]) for j in jobs1b}.get(decision1b["chosen"])
    phase1c, jobs1c, phase1c_s = None, [], 0.0
    if chosen is None and not quick:  # amendment 2: descriptive only
        print(f"descriptive runs (amendment 2): k in {list(DESCRIPTIVE['candidates'])}, lr {DESCRIPTIVE['lr']:g}")
        jobs1c = phase1_jobs(out, DESCRIPTIVE["candidates"], seeds1, steps, eval_steps, DESCRIPTIVE["lr"])
        runs1c, phase1c_s = run_phase(jobs1c)
        phase1c = summarize_phase1({c: conditions["grpo"] for c, conditions in runs1c.items()})
    if quick and chosen is None:  # the smoke run goes through phase 2 whatever phase 1 gave
        decision["chosen_for_smoke"] = cell(candidates[0])
        chosen = (candidates[0], LR)
    phase2, phase2_s, jobs2, cell2 = None, 0.0, [], None
    if chosen is not None:
        cell2 = cell(*chosen)
        print(f"phase 2 in {cell2}")
        jobs2 = phase2_jobs(out, *chosen[:1], seeds2, steps, eval_steps, chosen[1])
        runs2, phase2_s = run_phase(jobs2)
        phase2 = summarize_phase2(runs2.get(cell2, {}))
    commands = {f"{j['cell']} common": command(j, common=True) for j in [*jobs1, *jobs1b, *jobs1c, *jobs2]}
    commands.update({c: shlex.join(flags) for c, flags in PHASE2.items()})
    summary = {
        "study": "long-cot",
        "setup": {
            "quick": quick,
            "steps": steps,
            "eval_steps": eval_steps,
            "candidates": list(candidates),
            "seeds_phase1": list(seeds1),
            "seeds_phase2": list(seeds2),
            "workers": workers,
            "kernels": used,
            "environment": kernels.environment(),
            "sft": {k: v for k, v in sft.items() if k != "recipe"},
            "recipe": sft.get("recipe"),
            "sft_wall_s": sft_s,
            "phase1_s": phase1_s,
            "phase1b_s": phase1b_s,
            "phase1c_s": phase1c_s,
            "phase2_s": phase2_s,
            "wall_s": time.perf_counter() - start,
            "commands": commands,
        },  # fmt: skip
        "phase1": phase1,
        "decision": decision,
        "phase1b": phase1b,
        "decision1b": decision1b,
        "descriptive": phase1c,
        "phase2": phase2,
        "phase2_k": cell2,
        "stopped": stopped,
        "not_finished": [
            j["out"] for j in [*jobs1, *jobs1b, *jobs1c, *jobs2] if j["out"] not in stopped and not finished(j, steps)
        ],
    }
    # a phase that had nothing left to run keeps the wall time an earlier invocation measured for it
    try:
        before = json.loads(Path(out, "summary.json").read_text())["setup"]
    except (OSError, ValueError, KeyError):
        before = {}
    for key, ran in (("phase1_s", jobs1), ("phase1b_s", jobs1b), ("phase1c_s", jobs1c), ("phase2_s", jobs2)):
        if id(ran) not in RAN and before.get(key):
            summary["setup"][key] = before[key]
    summary["setup"]["sft_wall_s"] = sft.get("wall_s", sft_s)  # the warm-up's own measured time (it is cached)
    total = ("sft_wall_s", "phase1_s", "phase1b_s", "phase1c_s", "phase2_s")
    summary["setup"]["wall_s"] = sum(summary["setup"][key] or 0.0 for key in total)
    Path(out, "summary.json").write_text(json.dumps(strict_json(summary), indent=1) + "\n")
    Path(out, "report.md").write_text(render(json.loads(Path(out, "summary.json").read_text())))
    print(f"study long-cot finished: {Path(out) / 'report.md'}")
    return 1 if stopped else 0


class LongCot(Study):
    """Two phases, the second's length chosen by the first's rule: not a fixed list of conditions."""

    name = "long-cot"

    def run(self, args, out, workers):
        return run(args, out, workers)


STUDY = LongCot()


if __name__ == "__main__":  # before registration: `python -m openrlhf_geo.lab.studies.long_cot OUT [--quick]`
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--sft-only", action="store_true", help="only the (cached) SFT warm-up and the data")
    parser.add_argument("--report-only", action="store_true", help="summary and report of the finished runs")
    cli = parser.parse_args()
    with rundir.claim_output(cli.out, "openrlhf-geo study long-cot" + (" --quick" if cli.quick else "")) as claimed:
        if cli.sft_only:
            torch.set_num_threads(1)
            recipe = long_cot.SftRecipe(steps=QUICK["sft_steps"]) if cli.quick else long_cot.SftRecipe()
            candidates = QUICK["candidates"] if cli.quick else CANDIDATES
            print(long_cot.prepare_sft(claimed, recipe, eval_ks=candidates))
            sys.exit(0)
        sys.exit(run(cli, claimed, cli.workers, execute=not cli.report_only))
