"""regime: what moves the backbone's n_eff below 1 and D_a toward SALT Table 10's on CPU-sized models; one change at
a time from the demo, each with GRPO (+ SALT's diagnostics) and GRPO + SALT (protocol: docs/studies/regime.md)."""

import math

from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import (
    FINAL,
    GRPO_DIAG,
    PAPER_TABLE10,
    REGIMES,
    SALT,
    SEEDS,
    figure,
    fmt,
    mean_of,
    save,
    window,
)

ONE_FACTOR = ("demo", "g4", "g64", "t06", "t13", "three_digit", "all_strategies", "width128", "depth4")
COLUMNS = ("n_eff", "alpha", "alpha_salt", "D_a", "pr", "sign_flip", "response_length", "acc", "acc_salt", "distance")


def design():
    conditions, comparisons = [], []
    for name in ONE_FACTOR:
        r = REGIMES[name]
        conditions += [Condition(f"{name}_grpo", GRPO_DIAG, r.setting, r.rollout),
                       Condition(f"{name}_salt", SALT, r.setting, r.rollout)]  # fmt: skip
        comparisons.append((f"{name}_salt", f"{name}_grpo"))
        if name != "demo":  # the change's effect; paired by seed number only (nothing else is shared across settings)
            comparisons += [(f"{name}_grpo", "demo_grpo"), (f"{name}_salt", "demo_salt")]
    shown = (FINAL, "last20%/salt/n_eff_in", "last20%/salt/D_a", "last20%/salt/pr", "last20%/response_length")
    return Design("regime", "Where SALT's regime is on CPU", tuple(conditions), tuple(comparisons), SEEDS, 50, 25,
                  quick=("demo_grpo", "demo_salt"), shown=shown)  # fmt: skip


def section(table):
    """Regime -> backbone n_eff, α_t, D_a, accuracies; the distance to SALT Table 10's GRPO signature (z-scores with
    its sds: n_eff 0.31 ± 0.05 of the backbone, D_a 0.24 ± 0.04 of SALT) and the closest regime that salt-scaling
    can run in (not a change of G)."""
    n_eff_paper, d_a_paper = PAPER_TABLE10["grpo"]["n_eff"], PAPER_TABLE10["grpo_salt"]["D_a"]
    rows = {}
    for name in REGIMES:
        base, salt = f"{name}_grpo", f"{name}_salt"
        if base not in table or salt not in table:
            continue
        n_eff, d_a = mean_of(table, base, window("salt/n_eff_in")), mean_of(table, salt, window("salt/D_a"))
        rows[name] = {
            "n_eff": n_eff,
            "alpha": mean_of(table, base, window("salt/alpha")),
            "alpha_salt": mean_of(table, salt, window("salt/alpha")),
            "D_a": d_a,
            "pr": mean_of(table, base, window("salt/pr")),
            "sign_flip": mean_of(table, salt, window("salt/sign_flip")),
            "response_length": mean_of(table, base, window("response_length")),
            "acc": mean_of(table, base, FINAL),
            "acc_salt": mean_of(table, salt, FINAL),
            "distance": math.hypot((n_eff - n_eff_paper[0]) / n_eff_paper[1], (d_a - d_a_paper[0]) / d_a_paper[1]),
        }
    eligible = {k: v for k, v in rows.items() if not REGIMES[k].varies_g and math.isfinite(v["distance"])}
    closest = min(eligible, key=lambda k: eligible[k]["distance"]) if eligible else None
    return {"conditions": rows, "closest": closest}


def render(section):
    return [
        "",
        "## Conditions -> SALT's regime (backbone n_eff and α_t from GRPO's diagnostics, D_a from GRPO + SALT)",
        "",
        "| condition | n_eff | α_t | α_t (SALT run) | D_a | PR | sign flips | response length | acc GRPO | acc SALT | "
        "distance to Table 10 |",
        "|---|" + "---|" * 10,
        *(f"| {name} | " + " | ".join(fmt(v[k]) for k in COLUMNS) + " |" for name, v in section["conditions"].items()),
        "",
        f"Closest condition salt-scaling can run in: `{section['closest']}` "
        f"(`openrlhf-geo study salt-scaling --regime {section['closest']}`).",
    ]


def plot(section, out):
    """Each condition in the (backbone n_eff, D_a) plane next to SALT Table 10's GRPO point."""
    plt, fig, ax = figure()
    for name, v in section["conditions"].items():
        ax.scatter(v["n_eff"], v["D_a"])
        ax.annotate(name, (v["n_eff"], v["D_a"]), fontsize=7)
    (n, n_sd), (d, d_sd) = PAPER_TABLE10["grpo"]["n_eff"], PAPER_TABLE10["grpo_salt"]["D_a"]
    ax.errorbar([n], [d], xerr=[n_sd], yerr=[d_sd], color="black", marker="*", label="SALT Table 10 (GRPO)")
    ax.set(xlabel="backbone n_eff (last 20 %)", ylabel="D_a of GRPO + SALT (last 20 %)")
    ax.legend(fontsize=8)
    return [save(plt, fig, out, "regime_neff_vs_Da.png")]


class RegimeStudy(ConditionStudy):
    name, section = "regime", "regime"

    def design(self):
        return design()

    def summarize(self, result):
        return section(result.table)

    def render(self, section):
        return render(section)

    def plots(self, summary, result):
        return plot(summary[self.section], result.out)


STUDY = RegimeStudy()
