"""The demo's report: one summary dict holding every number shown (summary.json), report.md rendered from it, plots.

Reads `<root>/<method>/seed<k>/` (metrics.jsonl; gdi.jsonl of GeoAlign runs: per step the rollouts' GDI, corruption,
rewards, prompt ids) with `eval.report.load_runs`. Methods are those found there, the compared pairs the caller's."""

import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np

from openrlhf_geo.eval.report import compare, curve_correlation, load_runs, plot_curve
from openrlhf_geo.geoalign import detection_auroc
from openrlhf_geo.jsonl import read_jsonl, strict_json

FINAL = "eval/accuracy"  # its value at the last step of each run is the scalar `final/eval/accuracy`
# curves averaged over RL steps 1..T per seed, scalars `mean/<key>` (geo/auroc: pooled, in the detection section)
STEP_MEANS = (
    "accuracy", "reward", "response_length", "distinct_responses",
    "salt/pr", "salt/k", "salt/alpha", "salt/n_eff_in", "salt/n_eff_out", "salt/D_a", "salt/D_g", "salt/U_perp",
    "salt/U_perp_gain", "salt/kept", "salt/sign_flip", "salt/topnorm_share", "salt/pk_rho_norm",
    "salt/pk_rho_inv_len",
    "geo/val_acc", "geo/cos_gt_0.8", "geo/flag_frac", "geo/precision", "geo/recall",
)  # fmt: skip
COMPARED = (f"final/{FINAL}", "mean/accuracy", "mean/salt/pr", "mean/salt/n_eff_out")  # between paired methods
PLOTS = ("eval/accuracy", "accuracy", "salt/pr", "salt/n_eff_in", "salt/n_eff_out", "salt/alpha", "geo/auroc")
TASK_COUNTS = ("task/rollouts", "task/wrong", "task/shortcut", "task/wrong_shortcut")  # `task.shortcut_stats`
STEP_EDGES = (0, 5, 10, 20, 40)  # the detection table's ranges of RL steps: (0, 5], (5, 10], ... up to the last


def curve(run, key, lo=1, hi=math.inf):
    """The finite values of a run's curve `key` at steps lo <= step <= hi (empty when not logged)."""
    steps, values = run.curves.get(key, (np.zeros(0), np.zeros(0)))
    return values[(steps >= lo) & (steps <= hi) & np.isfinite(values)]


def pooled(runs, methods, key, lo=1, hi=math.inf):
    """A curve's values at steps lo..hi over every seed of `methods`, concatenated."""
    return np.concatenate([np.zeros(0)] + [curve(r, key, lo, hi) for m in methods for r in runs.get(m, {}).values()])


def per_seed(seeds, scalar):
    """{seed: run.scalars[scalar]} over the runs {seed: Run} that have it."""
    return {seed: run.scalars[scalar] for seed, run in seeds.items() if scalar in run.scalars}


def _mean(values):
    return float(np.mean(values)) if len(values) else math.nan


def error_composition(runs, methods, lo=1, hi=math.inf):
    """Pool the `task/*` counts of `methods` over steps lo..hi -> {"rollouts": n, "wrong": share of the rollouts that
    are wrong, "shortcut": share that follow the shortcut, "wrong_shortcut": share of the wrong ones that follow it};
    NaN shares when there is nothing to pool."""
    n, wrong, shortcut, wrong_shortcut = (float(pooled(runs, methods, k, lo, hi).sum()) for k in TASK_COUNTS)

    def share(x, y):
        return x / y if y > 0 else math.nan

    return {"rollouts": n, "wrong": share(wrong, n), "shortcut": share(shortcut, n),
            "wrong_shortcut": share(wrong_shortcut, wrong)}  # fmt: skip


def gdi_and_labels(records):
    """GDI (NaN for a rollout without pairs) and corruption labels of every rollout in the records, concatenated."""
    gdi = np.concatenate([np.zeros(0)] + [np.asarray(r["gdi"], dtype=float) for r in records])
    bad = np.concatenate([np.zeros(0, bool)] + [np.asarray(r["corrupted"], dtype=bool) for r in records])
    return gdi, bad


def pooled_auroc(records):
    """AUROC of GDI (GeoAlign Eq. 7) for the corrupted rollouts, pooled over records (scored rollouts only)
    -> (auroc, n+, n-)."""
    gdi, bad = gdi_and_labels(records)
    return detection_auroc(gdi, bad, np.isfinite(gdi))


def pair_count_auroc(records):
    """AUROC for the corrupted rollouts of a reward-only score: the number of rollouts of the same prompt with a
    different reward (= the rollout's pairs under GeoAlign Eq. 3), on the rollouts that have a GDI -> (auroc, n+, n-).

    Cumulative GDI (Eq. 7) sums one deviation per pair, so this is the part of GDI that needs no hidden states.
    """
    count = [np.zeros(0)]
    for r in records:
        rewards, groups = np.asarray(r["rewards"], dtype=float), np.asarray(r["group_ids"])
        count.append(((groups[:, None] == groups[None, :]) & (rewards[:, None] != rewards[None, :])).sum(1))
    gdi, bad = gdi_and_labels(records)
    return detection_auroc(np.concatenate(count), bad, np.isfinite(gdi))


def gdi_records(root, method):
    """The GDI records of a method's runs (gdi.jsonl), those with corruption labels."""
    paths = sorted((Path(root) / method).glob("*/gdi.jsonl"))
    return [r for path in paths for _, r in read_jsonl(path) if r.get("corrupted") is not None]


def detection(runs, root, method, last):
    """GeoAlign's detection of the corrupted rollouts in one method's runs: pooled and per-step AUROCs, the
    reward-only baseline, why curation stopped early, and the same by range of RL steps."""
    records = gdi_records(root, method)
    auroc, n_pos, n_neg = pooled_auroc(records)
    per_step = pooled(runs, [method], "geo/auroc")
    lowest = float(per_step.min()) if per_step.size else math.nan
    rows = [r for path in sorted((Path(root) / method).glob("*/metrics.jsonl")) for _, r in read_jsonl(path)]
    curated = [r for r in rows if r.get("step", 0) >= 1 and "geo/skipped_reason" in r]
    edges = [e for e in STEP_EDGES if e < last] + [last]
    parts = {(lo + 1, hi): [r for r in records if lo < r["step"] <= hi] for lo, hi in zip(edges[:-1], edges[1:])}
    return {
        "gdi_auroc": auroc,
        "corrupted_scored": n_pos,
        "clean_scored": n_neg,
        "corrupted": int(sum(sum(map(bool, r["corrupted"])) for r in records)),
        "pair_count_auroc": pair_count_auroc(records)[0],
        "per_step_auroc": {"mean": _mean(per_step), "min": lowest, "steps": int(per_step.size)},
        "curated_steps": len(curated),
        "skipped": dict(Counter(r["geo/skipped_reason"] for r in curated if r["geo/skipped_reason"])),
        "by_steps": {
            f"{lo}-{hi}": {
                "gdi_auroc": pooled_auroc(part)[0],
                "pair_count_auroc": pair_count_auroc(part)[0],
                "val_acc": _mean(pooled(runs, [method], "geo/val_acc", lo, hi)),
                "shortcut": error_composition(runs, [method], lo, hi)["shortcut"],
            }
            for (lo, hi), part in parts.items()
        },
    }


def summarize(root, comparisons, setup, order=()):
    """Every number of the demo's report, from its run directory -> dict.

    comparisons: (method, baseline) pairs, compared paired by seed on the COMPARED scalars both log
    (mean paired difference, 95% percentile-bootstrap CI of the per-seed differences: SALT App. H, via
    `eval.report.compare`); setup: the demo's configuration, kept as "setup"; order: methods listed first.
    """
    runs, _ = load_runs(root, final_keys=(FINAL,))
    missing = sorted({m for pair in comparisons for m in pair} - set(runs))
    if missing:
        raise ValueError(f"comparisons name methods without runs under {root}: {missing} (found {sorted(runs)})")
    for seeds in runs.values():
        for run in seeds.values():
            run.scalars.update({f"mean/{k}": _mean(curve(run, k)) for k in STEP_MEANS if curve(run, k).size})
    methods = [m for m in order if m in runs] + sorted(set(runs) - set(order))
    last = max(int(steps.max()) for seeds in runs.values() for r in seeds.values() for steps, _ in r.curves.values())
    finals = {m: per_seed(runs[m], f"final/{FINAL}") for m in methods}
    alpha = {m: pooled(runs, [m], "salt/alpha") for m in methods}
    spans = ((1, 1), (last, last), (1, last))  # the error composition at the first and last step, and over all
    return {
        "setup": setup,
        "methods": methods,
        "last_step": last,
        "final_accuracy": {m: {"per_seed": f, "mean": _mean(list(f.values()))} for m, f in finals.items()},
        "comparisons": [
            {"baseline": baseline, **row}
            for method, baseline in comparisons
            for row in compare({method: runs[method], baseline: runs[baseline]}, baseline)
            if row["metric"] in COMPARED
        ],
        "step_means": {
            m: {k: _mean(list(v.values())) for k in STEP_MEANS if (v := per_seed(runs[m], f"mean/{k}"))}
            for m in methods
        },
        "alpha_positive_steps": {m: [int((a > 0).sum()), int(a.size)] for m, a in alpha.items() if a.size},
        # SALT App. B, Fig. 5: the realized update norm ‖g_q‖ against the residual-energy bound B_δ over a run (the
        # paper correlates per-group values; the engines log each step's mean over its groups)
        "update_norm_vs_bound": {
            m: c for m in methods if (c := curve_correlation(runs[m], "salt/g_norm", "salt/b_delta"))["n"]
        },
        "errors": {m: {f"{lo}-{hi}": error_composition(runs, [m], lo, hi) for lo, hi in spans} for m in methods},
        "detection": {m: detection(runs, root, m, last) for m in methods if gdi_records(root, m)},
    }


def _fmt(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _diff(row):
    if row["n"] < 2 or row["low"] is None or not math.isfinite(row["low"]):
        return f"{row['gain']:+.3f} ({row['n']} seed, no CI)"
    return f"{row['gain']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def render(summary):
    """report.md from a `summarize` dict (or its `strict_json` form: both render the same)."""
    setup, methods, last = summary["setup"], summary["methods"], summary["last_step"]
    sft, config = setup["sft"], setup["sft"].get("config", {})
    lines = [
        "# openrlhf-geo demo report" + (" (`--quick` smoke run)" if setup.get("quick") else ""),
        "",
        "## Setup",
        "",
        f"- Task: {setup['task']}",
        f"- SFT warm-up: {config.get('per_prompt')} demonstrations per training prompt, a share "
        f"{config.get('shortcut_rate')} of them the carry-dropping shortcut, the rest worked solutions (strategies "
        f"{config.get('strategies')}); {sft['steps']} steps ({sft['wall_s']:.0f} s), held-out accuracy "
        f"{_fmt(sft['accuracy'])}. Model: Qwen2-style, {sft['params']:,} parameters."
        + (
            " The package's copy of this warm-up (the same bytes as training it, key "
            f"{sft['key']}; the time is its training's; `--sft-from-scratch` retrains it)."
            if sft.get("source") == "shipped"
            else ""
        ),
        f"- RL: {setup['steps']} steps per run, seeds {list(setup['seeds'])}, same prompts per step for every method "
        f"of a seed; all runs took {setup['wall_s']:.0f} s. Each run is one `openrlhf-geo train` command:",
        "",
        "```",
        setup["common"],
        *(f"{m:>15}: {setup['commands'][m]}" for m in methods if m in setup["commands"]),
        "```",
        "",
        f"## Final held-out accuracy ({FINAL} at the last step: {setup['n_eval']} prompts x "
        f"{setup['eval_samples']} samples, T = 1)",
        "",
        "| method | mean over seeds | per seed |",
        "|---|---|---|",
        *(
            f"| {m} | {_fmt(f['mean'])} | {', '.join(_fmt(v) for v in f['per_seed'].values())} |"
            for m, f in summary["final_accuracy"].items()
        ),
        "",
        "## Paired differences",
        "",
        "Method minus baseline per seed, mean over the common seeds with a 95% percentile-bootstrap CI (SALT App. H). "
        f"`final/` is the value at the last step, `mean/` the mean over RL steps 1-{last} of each seed.",
        "",
        "| method | baseline | metric | method mean | baseline mean | difference [95% CI] | seeds |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['method']} | {r['baseline']} | {r['metric']} | {_fmt(r['method_mean'])} | "
            f"{_fmt(r['baseline_mean'])} | {_diff(r)} | {r['n']} |"
            for r in summary["comparisons"]
        ),
        "",
        f"## Means over RL steps 1-{last} (mean over seeds)",
        "",
        "| metric | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    means = summary["step_means"]
    for key in STEP_MEANS:
        if any(key in means[m] for m in methods):
            lines.append(f"| {key} | " + " | ".join(_fmt(means[m].get(key)) for m in methods) + " |")
    alpha = summary["alpha_positive_steps"]
    lines += ["", *(f"- {m}: alpha_t > 0 on {a} of {n} steps." for m, (a, n) in alpha.items())]
    lines += [
        f"- {m}: update norm ‖g_q‖ vs residual bound B_δ over {c['n']} steps: Pearson {_fmt(c['pearson'], 2)}, "
        f"Spearman {_fmt(c['spearman'], 2)} (SALT App. B, Fig. 5: 0.56 / 0.52 over per-group values)."
        for m, c in summary["update_norm_vs_bound"].items()
    ]
    errors = [(m, span, e) for m, spans in summary["errors"].items() for span, e in spans.items() if e["rollouts"]]
    if errors:
        lines += [
            "",
            "## Wrong rollouts and the carry-dropping shortcut (`task/*` counts, seeds pooled)",
            "",
            "| method | RL steps | rollouts | wrong | following the shortcut | wrong ones following it |",
            "|---|---|---|---|---|---|",
            *(
                f"| {m} | {span} | {e['rollouts']:.0f} | {_fmt(e['wrong'], 2)} | {_fmt(e['shortcut'], 2)} | "
                f"{_fmt(e['wrong_shortcut'], 2)} |"
                for m, span, e in errors
            ),
        ]
    for method, d in summary["detection"].items():
        step = d["per_step_auroc"]
        skipped = ", ".join(f"{why} {n}" for why, n in sorted(d["skipped"].items())) or "none"
        lines += [
            "",
            f"## GeoAlign detection of corrupted rollouts ({method})",
            "",
            f"- GDI (GeoAlign Eq. 7) AUROC, pooled over steps and seeds: {_fmt(d['gdi_auroc'])} "
            f"({d['corrupted_scored']} corrupted vs {d['clean_scored']} clean scored rollouts; "
            f"{d['corrupted'] - d['corrupted_scored']} of the {d['corrupted']} corrupted rollouts have no GDI).",
            f"- Reward-only baseline (number of pairs a rollout is in, Eq. 3) on the same rollouts: AUROC "
            f"{_fmt(d['pair_count_auroc'])}.",
            f"- Per-step AUROC: mean {_fmt(step['mean'])}, min {_fmt(step['min'])} over {step['steps']} steps.",
            f"- Steps where curation stopped early, by reason: {skipped} (of {d['curated_steps']} steps).",
            "",
            "| steps | GDI AUROC | reward-only AUROC | projector val. accuracy | shortcut share |",
            "|---|---|---|---|---|",
            *(
                f"| {span} | {_fmt(p['gdi_auroc'])} | {_fmt(p['pair_count_auroc'])} | {_fmt(p['val_acc'])} | "
                f"{_fmt(p['shortcut'], 2)} |"
                for span, p in d["by_steps"].items()
            ),
        ]
    plots = summary.get("plots", [])
    lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)] if plots else []
    return "\n".join(lines) + "\n"


def plot_gdi(records, path):
    """Histogram of GDI for the corrupted and the clean scored rollouts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gdi, bad = gdi_and_labels(records)
    scored = np.isfinite(gdi)
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.linspace(gdi[scored].min(), gdi[scored].max(), 40) if scored.any() else 10
    for mask, label in ((scored & ~bad, "clean"), (scored & bad, "corrupted")):
        ax.hist(gdi[mask], bins=bins, density=mask.any(), alpha=0.55, label=f"{label}, n={int(mask.sum())}")
    ax.set(title="GDI of scored rollouts (all steps and seeds)", xlabel="GDI (GeoAlign Eq. 7)", ylabel="density")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out, root, comparisons, setup, order=()):
    """Plots, summary.json and report.md of the runs under `root`, written to `out` -> the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(root, comparisons, setup, order)
    runs, _ = load_runs(root)
    plots = []
    for key in PLOTS:
        if any(key in r.curves for seeds in runs.values() for r in seeds.values()):
            plots.append(re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".png")
            plot_curve(runs, key, out / plots[-1])
    for method in summary["detection"]:
        plots.append(f"gdi_{method}.png")
        plot_gdi(gdi_records(root, method), out / plots[-1])
    summary["plots"] = plots
    data = strict_json(summary)
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "report.md").write_text(render(data))
    return summary
