"""salt-scaling: SALT rollout scaling at a fixed rollout budget (SALT arXiv 2606.05800 §4.4, Fig. 4(c, d), Fig. 9,
App. F.4-F.5, Table 10): G in {2, ..., 64} at BUDGET rollouts per step, GRPO and DAPO backbones, each ± SALT
(protocol: docs/studies/salt-scaling.md)."""

import math

import numpy as np
from scipy import stats

from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import (
    BUDGET,
    FINAL,
    GRPO_DIAG,
    PAPER_TABLE10,
    REGIMES,
    SALT,
    SEEDS,
    figure,
    fmt,
    fmt_ci,
    mean_of,
    save,
    window,
)

GS = (2, 4, 8, 16, 32, 64)
BACKBONES = ("grpo", "dapo")
# DAPO as SALT Table 4 runs it: ±1 rewards, dynamic filtering of all-equal groups, clip-higher (0.2, 0.28)
DAPO = ("--reward.pm1", "--algo.dynamic_filtering_enable", "--actor.eps_clip_low_high", "0.2", "0.28")
COLUMNS = ("pr", "pr_salt", "n_eff", "n_eff_salt", "alpha", "D_a", "D_g", "U_perp_gain", "sign_flip", "kept")


def design(regime="demo"):
    """Each G at BUDGET rollouts per step (B = BUDGET / G), GRPO and DAPO, each ± SALT, in `regime`."""
    if regime not in REGIMES:
        raise ValueError(f"--regime must be one of {', '.join(REGIMES)} (got {regime!r})")
    if REGIMES[regime].varies_g:
        raise ValueError(f"--regime {regime} changes G, which salt-scaling sweeps; choose a regime that does not")
    r = REGIMES[regime]
    conditions, comparisons = [], []
    for g in GS:
        rollout = {**r.rollout, "--rollout.batch_size": BUDGET // g, "--rollout.n_samples_per_prompt": g}
        for backbone, extra in (("grpo", ()), ("dapo", DAPO)):
            base, salt = f"g{g:02d}_{backbone}", f"g{g:02d}_{backbone}_salt"
            facts = {"G": g, "backbone": backbone}
            conditions += [Condition(base, (*GRPO_DIAG, *extra), r.setting, rollout, {**facts, "salt": False}),
                           Condition(salt, (*SALT, *extra), r.setting, rollout, {**facts, "salt": True})]  # fmt: skip
            comparisons.append((salt, base))
    title = "SALT rollout scaling" + ("" if regime == "demo" else f" (regime {regime})")
    return Design("salt-scaling", title, tuple(conditions), tuple(comparisons), SEEDS, 50, 25,
                  quick=("g04_grpo", "g04_grpo_salt"))  # fmt: skip


def names(design):
    """{(G, backbone, with SALT): condition name}."""
    return {(c.facts["G"], c.facts["backbone"], c.facts["salt"]): c.name for c in design.conditions}


def section(design, table, rows):
    """By G: Table 10's columns per backbone ± SALT, SALT's paired gain, the trends over G (Spearman)."""
    name = names(design)
    gs = sorted({c.facts["G"] for c in design.conditions if c.name in table})
    by_g = {}
    for g in gs:
        for backbone in BACKBONES:
            base, salt = name[g, backbone, False], name[g, backbone, True]
            gain = next(
                (r for r in rows if r["method"] == salt and r["baseline"] == base and r["metric"] == FINAL), None
            )
            by_g[f"{g}/{backbone}"] = {
                "G": g,
                "backbone": backbone,
                "acc": mean_of(table, base, FINAL),
                "acc_salt": mean_of(table, salt, FINAL),
                "gain": None if gain is None else {k: gain[k] for k in ("gain", "low", "high", "n")},
                "pr": mean_of(table, base, window("salt/pr")),
                "pr_salt": mean_of(table, salt, window("salt/pr")),
                "n_eff": mean_of(table, base, window("salt/n_eff_in")),  # Table 10's backbone n_eff: that of a
                "n_eff_salt": mean_of(table, salt, window("salt/n_eff_out")),  # and SALT's: that of a'
                "alpha": mean_of(table, salt, window("salt/alpha")),
                "D_a": mean_of(table, salt, window("salt/D_a")),
                "D_g": mean_of(table, salt, window("salt/D_g")),
                "U_perp_gain": mean_of(table, salt, window("salt/U_perp_gain")),
                "sign_flip": mean_of(table, salt, window("salt/sign_flip")),
                "kept": mean_of(table, salt, window("salt/kept")),
            }
    trends = {}
    for backbone in BACKBONES:
        points = [v for v in by_g.values() if v["backbone"] == backbone]
        for key in ("acc", "gain", "pr", "n_eff", "n_eff_salt", "alpha"):
            xs = [p["G"] for p in points]
            ys = [(p[key] or {}).get("gain", math.nan) if key == "gain" else p[key] for p in points]
            ok = [i for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
            rho = stats.spearmanr([xs[i] for i in ok], [ys[i] for i in ok]).statistic if len(ok) >= 3 else math.nan
            trends[f"{backbone}/{key}"] = float(rho)
    return {"by_g": by_g, "spearman_vs_G": trends, "paper_table10": PAPER_TABLE10}


def render(section):
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
            f"| {v['G']} | {v['backbone']} | {fmt(v['acc'])} | {fmt(v['acc_salt'])} | {fmt_ci(v['gain'])} | "
            + " | ".join(fmt(v[k]) for k in COLUMNS)
            + " |"
        )
    trends = ", ".join(f"{k} {fmt(v, 2)}" for k, v in section["spearman_vs_G"].items())
    return [
        *lines,
        "",
        f"SALT Table 10 (DeepSeek-R1-Distill-Qwen-7B / MATH-TRAIN, 5 seeds, last 20 % of checkpoints): {paper}.",
        "",
        f"Spearman correlation with G over the G values: {trends}.",
    ]


def plot_scaling(section, out):
    """SALT Fig. 4(c) (accuracy vs G) and Fig. 4(d) (PR and n_eff vs G) -> file names."""
    points = list(section["by_g"].values())
    plt, fig_c, ax = figure()
    _, fig_d, (ax_pr, ax_n) = figure(1, 2, size=(10, 4))
    for backbone in BACKBONES:
        mine = [p for p in points if p["backbone"] == backbone]
        for suffix, label in (("", backbone.upper()), ("_salt", f"{backbone.upper()}+SALT")):
            for axis, key in ((ax, "acc"), (ax_pr, "pr"), (ax_n, "n_eff")):
                axis.plot([p["G"] for p in mine], [p[key + suffix] for p in mine], marker="o", label=label)
    for axis, label in ((ax, "held-out accuracy (last step)"), (ax_pr, "PR (last 20 %)"), (ax_n, "n_eff (last 20 %)")):
        axis.set(xscale="log", xlabel=f"G ({BUDGET} rollouts per step)", ylabel=label)
        axis.set_xticks(sorted({p["G"] for p in points}), [str(g) for g in sorted({p["G"] for p in points})])
        axis.legend(fontsize=8)
    return [save(plt, fig_c, out, "fig4c_accuracy_vs_G.png"), save(plt, fig_d, out, "fig4d_pr_neff_vs_G.png")]


def plot_alpha(design, runs, out):
    """SALT Fig. 9: α_t and the clip fraction over the steps, one line per G (SALT runs, mean over seeds)."""
    files = []
    for backbone in BACKBONES:
        plt, fig, (ax_a, ax_c) = figure(1, 2, size=(10, 4))
        mine = [c for c in design.conditions if c.name in runs and c.facts["backbone"] == backbone and c.facts["salt"]]
        for condition in sorted(mine, key=lambda c: c.facts["G"]):
            for axis, key in ((ax_a, "salt/alpha"), (ax_c, "clip_frac")):
                curves = [r.curves[key] for r in runs[condition.name].values() if key in r.curves]
                if curves and all(len(s) == len(curves[0][0]) for s, _ in curves):
                    mean = np.nanmean([v for _, v in curves], 0)
                    axis.plot(curves[0][0], mean, label=f"G = {condition.facts['G']}")
        ax_a.set(xlabel="step", ylabel="α_t (mean over seeds)", title=f"{backbone.upper()}+SALT")
        ax_c.set(xlabel="step", ylabel="clip fraction", yscale="symlog", title=f"{backbone.upper()}+SALT")
        ax_a.legend(fontsize=8)
        files.append(save(plt, fig, out, f"fig9_alpha_{backbone}.png"))
    return files


class SaltScaling(ConditionStudy):
    name, section, options = "salt-scaling", "scaling", ("regime",)

    def design(self, regime="demo"):
        return design(regime)

    def summarize(self, result):
        return section(result.design, result.table, result.comparisons)

    def render(self, section):
        return render(section)

    def plots(self, summary, result):
        return plot_scaling(summary[self.section], result.out) + plot_alpha(result.design, result.runs, result.out)

    def curve_groups(self, result):
        by_g = {g: [c.name for c in result.design.conditions if c.facts["G"] == g] for g in GS}
        return {f"_G{g}": [c for c in conditions if c in result.runs] for g, conditions in by_g.items()}


STUDY = SaltScaling()
