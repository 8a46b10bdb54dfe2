"""The demo's report: PNG plots and report.md from the runs' metric rows. States numbers, claims nothing else.

Input: metric rows (dicts) tagged with "method" and "seed", one per step (the runs' metrics.jsonl), and GDI
records {"method", "seed", "step", "gdi": [...], "corrupted": [...]} per curated step.
"""

import math
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from openrlhf_geo.eval.metrics import paired_gain
from openrlhf_geo.geoalign import detection_auroc

LABELS = {
    "grpo": "GRPO",
    "salt": "GRPO+SALT",
    "grpo_noise": "GRPO, 10% flipped rewards",
    "geoalign_noise": "GRPO+GeoAlign, 10% flipped rewards",
}


def series(rows, method, key):
    """{seed: (steps (n,), values (n,))} of a metric for one method, skipping rows without a finite value."""
    out = defaultdict(lambda: ([], []))
    for row in rows:
        value = row.get(key)
        if row.get("method") == method and isinstance(value, (int, float)) and math.isfinite(value):
            out[row["seed"]][0].append(row["step"])
            out[row["seed"]][1].append(value)
    return {seed: (np.array(s), np.array(v, dtype=float)) for seed, (s, v) in sorted(out.items())}


def per_seed_mean(rows, method, key, first_step=1):
    """{seed: mean of the metric over steps >= first_step}."""
    return {
        seed: float(v[s >= first_step].mean())
        for seed, (s, v) in series(rows, method, key).items()
        if (s >= first_step).any()
    }


def final_value(rows, method, key):
    """{seed: the metric at the last step that has it}."""
    return {seed: float(v[np.argmax(s)]) for seed, (s, v) in series(rows, method, key).items()}


def paired_difference(a, b, confidence=0.95):
    """Mean of a[seed] - b[seed] over common seeds with its bootstrap CI -> (mean, low, high, n seeds).

    `openrlhf_geo.eval.metrics.paired_gain` (SALT App. H: percentile bootstrap of the per-seed differences); one
    seed gives NaN bounds.
    """
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return math.nan, math.nan, math.nan, 0
    gain = paired_gain([a[s] for s in seeds], [b[s] for s in seeds], confidence=confidence)
    return gain["gain"], gain["low"], gain["high"], gain["n"]


def pooled_auroc(records):
    """AUROC of GDI as a score for corrupted rollouts, pooled over records (scored rollouts) -> (auroc, n+, n-)."""
    gdi = np.concatenate([np.asarray(r["gdi"], dtype=float) for r in records]) if records else np.zeros(0)
    bad = np.concatenate([np.asarray(r["corrupted"], dtype=bool) for r in records]) if records else np.zeros(0, bool)
    return detection_auroc(gdi, bad, np.isfinite(gdi))


def pair_count_auroc(records):
    """AUROC for the corrupted rollouts of a score that uses rewards only: the number of rollouts of the same prompt
    with a different reward (= the rollout's pairs under GeoAlign Eq. 3), on the rollouts that have a GDI.

    Cumulative GDI (Eq. 7) sums one deviation per pair, so a rollout with many pairs scores high whatever the hidden
    states say; GDI beats this baseline only by the geometry. Records need "rewards" and "group_ids" (else skipped).
    -> (auroc, n+, n-).
    """
    counts, gdis, bads = [], [], []
    for r in records:
        if r.get("rewards") is None or r.get("group_ids") is None:
            continue
        rewards, groups = np.asarray(r["rewards"], dtype=float), np.asarray(r["group_ids"])
        same_prompt = groups[:, None] == groups[None, :]
        counts.append((same_prompt & (rewards[:, None] != rewards[None, :])).sum(1))
        gdis.append(np.asarray(r["gdi"], dtype=float))
        bads.append(np.asarray(r["corrupted"], dtype=bool))
    if not counts:
        return math.nan, 0, 0
    count, gdi, bad = np.concatenate(counts), np.concatenate(gdis), np.concatenate(bads)
    return detection_auroc(count, bad, np.isfinite(gdi))


def error_composition(rows, methods, step=None):
    """Pool the runs' `task/*` counts (`task.shortcut_stats`) over the rows of `methods` at RL step `step` (None: every
    step >= 1) -> {"rollouts": n, "wrong": share of rollouts that are wrong, "shortcut": share that follow the
    shortcut, "wrong_shortcut": share of the wrong rollouts that follow it}; NaN shares when there is nothing to pool.
    """
    keys = ("task/rollouts", "task/wrong", "task/shortcut", "task/wrong_shortcut")
    picked = [
        r
        for r in rows
        if r.get("method") in methods
        and r.get("step", 0) >= 1
        and (step is None or r["step"] == step)
        and all(isinstance(r.get(k), (int, float)) for k in keys)
    ]
    n, wrong, shortcut, wrong_shortcut = (sum(r[k] for r in picked) for k in keys)

    def share(x, y):
        return x / y if y > 0 else math.nan

    return {
        "rollouts": n,
        "wrong": share(wrong, n),
        "shortcut": share(shortcut, n),
        "wrong_shortcut": share(wrong_shortcut, wrong),
    }


def _band(ax, rows, method, key, label=None, color=None):
    """Mean over seeds (line) and min-max over seeds (band) of a metric vs step."""
    runs = series(rows, method, key)
    if not runs:
        return
    steps = sorted(set().union(*(set(s.tolist()) for s, _ in runs.values())))
    table = np.full((len(runs), len(steps)), np.nan)
    for i, (s, v) in enumerate(runs.values()):
        table[i, np.searchsorted(steps, s)] = v
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0)
    (line,) = ax.plot(
        steps, mean, label=label or LABELS.get(method, method), color=color, marker="." if len(steps) < 30 else None
    )
    if len(runs) > 1:
        ax.fill_between(steps, low, high, alpha=0.2, color=line.get_color())


def plot_accuracy(rows, methods, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in methods:
        _band(axes[0], rows, method, "accuracy")
        _band(axes[1], rows, method, "eval/accuracy")
    axes[0].set(title="rollout accuracy (true verdicts, before noise)", xlabel="step", ylabel="accuracy")
    axes[1].set(title="held-out accuracy", xlabel="step", ylabel="accuracy")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_geometry(rows, path):
    """PR of the rollout Gram and n_eff of the applied coefficients vs step, GRPO vs SALT."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in ("grpo", "salt"):
        _band(axes[0], rows, method, "salt/pr")
        _band(axes[1], rows, method, "salt/n_eff_out")
    _band(axes[1], rows, "salt", "salt/n_eff", label="GRPO coefficients in the SALT run (SALT's input)")
    axes[0].set(title="participation ratio PR of the feature Gram", xlabel="step", ylabel="PR")
    axes[1].set(title="n_eff of the applied coefficients", xlabel="step", ylabel="n_eff")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_alpha(rows, path):
    fig, ax = plt.subplots(figsize=(6, 4))
    _band(ax, rows, "salt", "salt/alpha", label="alpha_t = max(0, 1 - n_eff)")
    ax.set(title="SALT exploration weight alpha_t", xlabel="step", ylabel="alpha_t")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gdi(records, rows, path):
    """GDI distribution of corrupted vs clean rollouts (pooled) and the per-step AUROC."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    gdi = np.concatenate([np.asarray(r["gdi"], dtype=float) for r in records]) if records else np.zeros(0)
    bad = np.concatenate([np.asarray(r["corrupted"], dtype=bool) for r in records]) if records else np.zeros(0, bool)
    scored = np.isfinite(gdi)
    if scored.any():
        bins = np.linspace(gdi[scored].min(), gdi[scored].max(), 40)
        for mask, label in ((~bad, "clean"), (bad, "corrupted (flipped reward)")):
            if (scored & mask).any():
                axes[0].hist(
                    gdi[scored & mask],
                    bins=bins,
                    density=True,
                    alpha=0.55,
                    label=f"{label}, n={int((scored & mask).sum())}",
                )
        axes[0].legend(fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "no scored rollouts\n(curation skipped every step)", ha="center", va="center")
    axes[0].set(title="GDI of rollouts (all GeoAlign steps and seeds)", xlabel="GDI (Eq. 7)", ylabel="density")
    _band(axes[1], rows, "geoalign_noise", "geo/auroc", label="AUROC of GDI for corrupted rollouts")
    axes[1].axhline(0.5, color="grey", lw=0.8, ls="--")
    axes[1].set(title="per-step AUROC", xlabel="step", ylabel="AUROC", ylim=(0, 1))
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x, digits=3):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _diff_cell(mean, low, high, n):
    if n == 0:
        return "n/a"
    if n == 1:
        return f"{mean:+.3f} (1 seed, no CI)"
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def write_report(path, rows, records, methods, context):
    """report.md: setup, final accuracy vs GRPO (paired by seed, bootstrap 95% CI), SALT geometry, GeoAlign detection.

    context: dict with "commands" {method: argv string}, "sft" {...}, "steps", "seeds", "wall_s", "quick".
    """
    steps, seeds = context["steps"], context["seeds"]
    lines = ["# openrlhf-geo demo report", ""]
    if context.get("quick"):
        lines += [
            "**Quick smoke run** (`--quick`): too few steps and seeds for the numbers below to mean anything.",
            "",
        ]
    sft = context["sft"]
    sft_config = sft.get("config", {})
    rate = sft_config.get("shortcut_rate", 0.0)
    strategies = ", ".join(f'"{x}"' for x in sft_config.get("strategies", ["tens", "split_b", "split_a", "digits"]))
    stop = "stopped at the target" if sft.get("target") is not None else "cosine-decayed learning rate"
    lines += [
        "## Setup",
        "",
        f"- Task: two-digit additions `a+b=` that need a carry in the ones column; SFT demonstrations: "
        f"{1 - rate:.0%} worked solutions that carry correctly (strategies {strategies}; random operand order and "
        f'connectives) and {rate:.0%} the flawed "quick" procedure that adds the digits and drops the carry '
        "(wrong on every prompt of this task), all ending in `\\boxed{}`; reward = math-verify verdict of the last "
        f"box (1/0); {context['n_train']} training prompts, {context['n_eval']} held-out prompts.",
        *_error_lines(rows, methods, rate, steps),
        f"- Model: Qwen2-style, {sft['params']:,} parameters, built from a config; character tokenizer built with "
        "`tokenizers`.",
        f"- SFT warm-up: {sft['steps']} steps ({sft['wall_s']:.0f} s, {stop}), held-out accuracy "
        f"{sft['accuracy']:.3f}.",
        f"- RL: {steps} steps per run, seeds {list(seeds)}, same prompts per step for every method of a seed. "
        f"Wall time of all runs: {context['wall_s']:.0f} s.",
        f"- Rollouts: distinct responses per prompt / G, mean over steps, runs and seeds: "
        f"{_fmt(_mean_over(rows, methods, 'distinct_responses'))}; mean response length "
        f"{_fmt(_mean_over(rows, methods, 'response_length'), 1)} tokens.",
        "",
        "Each run is one `openrlhf-geo train` command (shared flags, then the method's):",
        "",
        "```",
        context["common"],
    ]
    lines += [f"{method:>15}: {context['commands'][method]}" for method in methods]
    lines += ["```", ""]

    lines += ["## Final held-out accuracy", ""]
    lines += [
        f"Held-out accuracy ({context['n_eval']} prompts x {context['eval_samples']} samples, T = 1) at the last "
        "step per seed; "
        f"differences paired by seed with a 95% percentile-bootstrap CI over the {len(seeds)} per-seed differences "
        "(few seeds give coarse intervals).",
        "",
    ]
    lines += [
        "| method | final accuracy (mean over seeds) | per seed | vs GRPO | vs GRPO with the same noise |",
        "|---|---|---|---|---|",
    ]
    finals = {m: final_value(rows, m, "eval/accuracy") for m in methods}
    for method in methods:
        acc = finals[method]
        mean = float(np.mean(list(acc.values()))) if acc else math.nan
        vs = _diff_cell(*paired_difference(acc, finals["grpo"])) if method != "grpo" else "-"
        vs_noise = _diff_cell(*paired_difference(acc, finals["grpo_noise"])) if method == "geoalign_noise" else "-"
        per = ", ".join(_fmt(acc[s]) for s in sorted(acc))
        lines.append(f"| {LABELS.get(method, method)} | {_fmt(mean)} | {per} | {vs} | {vs_noise} |")
    lines.append("")

    lines += ["## SALT geometry (GRPO vs GRPO+SALT, same exact LM-head features)", ""]
    pr = {m: per_seed_mean(rows, m, "salt/pr") for m in ("grpo", "salt")}
    neff = {m: per_seed_mean(rows, m, "salt/n_eff_out") for m in ("grpo", "salt")}
    alpha = per_seed_mean(rows, "salt", "salt/alpha")
    neff_in = per_seed_mean(rows, "salt", "salt/n_eff")
    k = per_seed_mean(rows, "salt", "salt/k")
    for name, table in (("PR of the feature Gram", pr), ("n_eff of the applied coefficients", neff)):
        g, s = table["grpo"], table["salt"]
        d = paired_difference(s, g)
        lines.append(
            f"- {name}, mean over steps 1-{steps}: SALT {_fmt(np.mean(list(s.values())) if s else math.nan)} vs GRPO "
            f"{_fmt(np.mean(list(g.values())) if g else math.nan)}; paired difference {_diff_cell(*d)}."
        )
    steps_higher = _fraction_higher(rows, "salt/n_eff_out")
    lines.append(f"- Steps where SALT's n_eff exceeds GRPO's at the same step and seed: {steps_higher}.")
    alpha_steps = [r["salt/alpha"] for r in rows if r.get("method") == "salt" and r.get("salt/alpha") is not None]
    lines.append(
        f"- In the SALT runs: n_eff of the incoming GRPO coefficients {_fmt(_mean(neff_in))}, "
        f"k_t {_fmt(_mean(k), 1)} of m = {_fmt(_mean_over(rows, ['salt'], 'salt/m'), 0)}, alpha_t "
        f"{_fmt(_mean(alpha))} (alpha_t = max(0, 1 - n_eff) > 0 on {sum(a > 0 for a in alpha_steps)} of "
        f"{len(alpha_steps)} steps)."
    )
    lines += _salt_weight_line(rows)
    lines.append("")

    lines += ["## GeoAlign detection of flipped rewards", ""]
    auroc, n_pos, n_neg = pooled_auroc(records)
    per_step = series(rows, "geoalign_noise", "geo/auroc")
    values = np.concatenate([v for _, v in per_step.values()]) if per_step else np.zeros(0)
    skipped = sum(
        1
        for r in rows
        if r.get("method") == "geoalign_noise"
        and r.get("step", 0) > 0
        and any(r.get(f"geo/skip_{why}") for why in ("no_pairs", "one_prompt", "few_scores", "degenerate"))
    )
    total = sum(1 for r in rows if r.get("method") == "geoalign_noise" and r.get("step", 0) > 0)
    n_corrupted = sum(sum(bool(c) for c in r["corrupted"] or []) for r in records)
    count_auroc, _, _ = pair_count_auroc(records)
    lines += [
        f"- GDI AUROC for the corrupted rollouts, pooled over all GeoAlign steps and seeds: {_fmt(auroc)} "
        f"({n_pos} corrupted vs {n_neg} clean scored rollouts; {n_corrupted - n_pos} of the {n_corrupted} corrupted "
        "rollouts had no pair with a direction and hence no GDI).",
        f"- Reward-only baseline on the same rollouts: AUROC {_fmt(count_auroc)} for the number of pairs a rollout "
        "is in (cumulative GDI sums one deviation per pair, so this part needs no hidden states); GDI minus "
        f"baseline: {_fmt(auroc - count_auroc)}.",
        f"- Per-step AUROC: mean {_fmt(values.mean() if len(values) else math.nan)}, min "
        f"{_fmt(values.min() if len(values) else math.nan)} over {len(values)} steps.",
        f"- Flagging: precision {_fmt(_mean(per_seed_mean(rows, 'geoalign_noise', 'geo/precision')))}, recall "
        f"{_fmt(_mean(per_seed_mean(rows, 'geoalign_noise', 'geo/recall')))}, flagged fraction "
        f"{_fmt(_mean(per_seed_mean(rows, 'geoalign_noise', 'geo/flag_frac')))} (means over steps and seeds); "
        f"projector validation accuracy {_fmt(_mean(per_seed_mean(rows, 'geoalign_noise', 'geo/proj_val_acc')))}.",
        f"- Steps where curation stopped early (too few pairs/scores, degenerate geometry): {skipped} of {total}.",
        *_phase_table(records, rows, steps),
        "",
    ]
    lines += _targets(rows, records, steps, alpha_steps, auroc, count_auroc, finals, len(seeds))
    lines += [
        "## Plots",
        "",
        "![accuracy](accuracy_vs_step.png)",
        "![geometry](pr_neff_vs_step.png)",
        "![alpha](alpha_vs_step.png)",
        "![gdi](gdi_corrupted_vs_clean.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def _error_lines(rows, methods, rate, steps):
    """What the task's errors are made of, from the runs' task/* counts (none logged: no lines)."""
    first, everything = error_composition(rows, methods, 1), error_composition(rows, methods)
    if not everything["rollouts"]:
        return []
    drop = ", ".join(
        f"{LABELS.get(m, m)} {_fmt(error_composition(rows, [m], 1)['shortcut'], 2)} -> "
        f"{_fmt(error_composition(rows, [m], steps)['shortcut'], 2)}"
        for m in methods
    )
    return [
        f"- What the errors are made of: at RL step 1 (the SFT policy, all runs) {_fmt(first['wrong'], 2)} of the "
        f"rollouts are wrong and {_fmt(first['wrong_shortcut'], 2)} of the wrong ones follow the carry-dropping "
        f"shortcut that {rate:.0%} of the SFT demonstrations use; over all RL steps and runs "
        f"{_fmt(everything['wrong_shortcut'], 2)} of the {everything['wrong'] * everything['rollouts']:,.0f} wrong "
        "rollouts follow it, the rest are slips in the carrying procedure or malformed responses. The task is built "
        "this way so that wrong answers share a recognisable cause (GeoAlign's premise); it is not a claim about "
        "the errors of LLMs.",
        f"- Share of rollouts that follow the shortcut, step 1 -> step {steps} (mean over seeds): {drop}.",
    ]


def _phase_table(records, rows, steps):
    """GDI vs the reward-only baseline by range of RL steps (the projector's signal changes as the errors do)."""
    edges = [e for e in (0, 5, 10, 20, 40) if e < steps] + [steps]
    out = [
        "",
        "By range of RL steps (pooled over seeds; the shortcut share is that of the GeoAlign runs' rollouts):",
        "",
        "| steps | GDI AUROC | reward-only AUROC | GDI minus baseline | projector val. accuracy | shortcut share |",
        "|---|---|---|---|---|---|",
    ]
    for lo, hi in zip(edges[:-1], edges[1:]):
        part = [r for r in records if lo < r["step"] <= hi]
        gdi, count = pooled_auroc(part)[0], pair_count_auroc(part)[0]
        picked = [r for r in rows if r.get("method") == "geoalign_noise" and lo < r.get("step", 0) <= hi]
        val = [r["geo/proj_val_acc"] for r in picked if isinstance(r.get("geo/proj_val_acc"), (int, float))]
        shortcut = sum(r.get("task/shortcut", 0) for r in picked) / max(
            sum(r.get("task/rollouts", 0) for r in picked), 1
        )
        shown = _fmt(shortcut, 2) if any("task/rollouts" in r for r in picked) else "n/a"
        out.append(
            f"| {lo + 1}-{hi} | {_fmt(gdi)} | {_fmt(count)} | {_fmt(gdi - count)} | "
            f"{_fmt(float(np.mean(val)) if val else math.nan)} | {shown} |"
        )
    return out


def _salt_weight_line(rows):
    """Where SALT's coefficients put their weight (the engine's salt_weight_stats), as one line; none if not logged."""
    salt_rows = [r for r in rows if r.get("method") == "salt" and r.get("step", 0) >= 1]
    if not any(isinstance(r.get("salt/pk_rho_norm"), (int, float)) for r in salt_rows):
        return []

    def mean(key):
        return _mean_over(rows, ["salt"], key)

    even = [r["salt/k"] / r["salt/m"] for r in salt_rows if r.get("salt/k") and r.get("salt/m")]
    return [
        f"- Where SALT's coefficients a' put their weight (SALT runs, means over steps): diag(P_k) has Spearman rho "
        f"{_fmt(mean('salt/pk_rho_norm'), 2)} with the feature norms ||phi_i||^2 and "
        f"{_fmt(mean('salt/pk_rho_inv_len'), 2)} with 1/T_i; the k_t rollouts with the largest ||phi_i|| hold "
        f"{_fmt(mean('salt/topnorm_share'), 2)} of ||a'||^2 ({_fmt(float(np.mean(even)) if even else math.nan, 2)} "
        f"if spread evenly); a' keeps {_fmt(mean('salt/kept'), 2)} of ||a||^2 and does not keep the sign of "
        f"{_fmt(mean('salt/sign_flip'), 2)} of the nonzero GRPO advantages."
    ]


def _targets(rows, records, steps, alpha_steps, auroc, count_auroc, finals, n_seeds):
    """The issue-5 acceptance checks, each stated as met / not met with the numbers above it."""
    neff_grpo = _mean(per_seed_mean(rows, "grpo", "salt/n_eff"))
    val_acc = _mean(per_seed_mean(rows, "geoalign_noise", "geo/proj_val_acc"))

    def verdict(ok):
        return "n/a" if ok is None else "met" if ok else "**not met**"

    def compare(a, b):
        return None if not (math.isfinite(a) and math.isfinite(b)) else a > b

    def higher(key, digits):  # SALT vs GRPO on the mean over steps and seeds, with the paired-by-seed difference
        salt, grpo = _mean(per_seed_mean(rows, "salt", key)), _mean(per_seed_mean(rows, "grpo", key))
        diff = paired_difference(per_seed_mean(rows, "salt", key), per_seed_mean(rows, "grpo", key))
        text = verdict(compare(salt, grpo))
        if text == "met" and diff[3] > 1 and diff[1] <= 0:
            text = "met on the means; the paired CI includes 0"
        return f"{text} ({_fmt(salt, digits)} vs {_fmt(grpo, digits)}, paired difference {_diff_cell(*diff)})"

    lines = ["## Acceptance targets (issue 5)", ""]
    lines.append(
        f"- SALT's mean n_eff higher than GRPO's: {higher('salt/n_eff_out', 3)}; "
        f"mean PR higher: {higher('salt/pr', 2)}."
    )
    if alpha_steps and not any(a > 0 for a in alpha_steps):
        lines.append(
            f"  SALT's exploration channel never acted (alpha_t = 0 on every step): GRPO's n_eff here is "
            f"{_fmt(neff_grpo)} >= 1, so SALT reduced to P_k a."
        )
    ok = None if not math.isfinite(auroc) else auroc >= 0.8
    lines.append(f"- GDI AUROC >= 0.8 for the corrupted rollouts: {verdict(ok)} ({_fmt(auroc)}).")
    if math.isfinite(auroc) and math.isfinite(count_auroc) and auroc - count_auroc < 0.05:
        lead = "  Most likely reason" if not ok else "  But the hidden states add little"
        lines.append(
            f"{lead}: GDI is within 0.05 of the reward-only pair-count score ({_fmt(count_auroc)}) "
            f"and the projector's mean validation accuracy is {_fmt(val_acc)}: where the wrong answers do not share "
            "a cause (see the table by range of steps), the last-token hidden states carry little correctness "
            "direction for the projector to find."
        )
    accuracy_ok = n_seeds >= 3 and all(len(finals[m]) >= 3 for m in finals)
    lines.append(
        f"- Final accuracy vs GRPO with CIs over >= 3 seeds: {verdict(accuracy_ok)} ({n_seeds} seeds, table above)."
    )
    return [*lines, ""]


def _mean_over(rows, methods, key):
    """Mean of a metric over every step row (step >= 1) of the given methods; NaN when absent."""
    values = [
        r[key]
        for r in rows
        if r.get("method") in methods and r.get("step", 0) >= 1 and isinstance(r.get(key), (int, float))
    ]
    return float(np.mean(values)) if values else math.nan


def _mean(per_seed):
    return float(np.mean(list(per_seed.values()))) if per_seed else math.nan


def _fraction_higher(rows, key):
    salt = {(r["seed"], r["step"]): r.get(key) for r in rows if r.get("method") == "salt"}
    grpo = {(r["seed"], r["step"]): r.get(key) for r in rows if r.get("method") == "grpo"}
    pairs = [(salt[k], grpo[k]) for k in salt.keys() & grpo.keys() if salt[k] is not None and grpo[k] is not None]
    if not pairs:
        return "n/a"
    higher = sum(s > g for s, g in pairs)
    return f"{higher} of {len(pairs)}"
