"""salt-ablations: SALT's App. F.3 ablations in the demo's setting: the demo's GRPO and SALT, SALT's App. F.3.1
ablations, the fixed-α sweep and the F.3.2 matched nulls (protocol: docs/studies/salt-ablations.md)."""

import math

from openrlhf_geo.lab import recipe
from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import FINAL, GRPO_DIAG, SALT, describe, figure, fmt, mean_of, save, window

ABLATIONS = ("only-main", "only-exp", "no-pos", "no-proj", "rand-proj", "pr-alpha", "entropy-alpha", "permuted",
             "matched-rand-subspace")  # fmt: skip
FIXED_ALPHAS = ("0", "0.25", "0.5", "0.75", "1")  # SALT §4.3, Fig. 4(b)
COLUMNS = ("acc", "recovered", "D_a", "sign_flip", "kept", "n_eff_out", "alpha", "alpha_positive", "pr")


def design():
    conditions = [Condition("grpo", GRPO_DIAG, facts={"salt": False}), Condition("salt", SALT, facts={"salt": True})]
    conditions += [Condition(f"salt_{v}", (*SALT, "--salt.variant", v), facts={"salt": True}) for v in ABLATIONS]
    conditions += [
        Condition(f"salt_fixed{a}", (*SALT, "--salt.variant", "fixed-alpha", "--salt.alpha", a), facts={"salt": True})
        for a in FIXED_ALPHAS
    ]
    comparisons = [("salt", "grpo")]
    comparisons += [(c.name, base) for c in conditions[2:] for base in ("grpo", "salt")]
    # the demo's seeds 0-4: grpo and salt repeat the demo's own runs, a check that the setting is the demo's
    return Design("salt-ablations", "SALT component ablations in the demo's setting", tuple(conditions),
                  tuple(comparisons), (0, 1, 2, 3, 4), recipe.FULL["steps"], recipe.FULL["eval_steps"],
                  quick=("grpo", "salt_no-proj"))  # fmt: skip


def section(design, runs, table):
    """Per SALT condition the final accuracy and the share of SALT's loss against GRPO it recovers,
    (acc_variant − acc_salt) / (acc_grpo − acc_salt), with its geometry and the share of its steps with α_t > 0."""
    from openrlhf_geo.lab.demo_report import pooled

    grpo, salt = mean_of(table, "grpo", FINAL), mean_of(table, "salt", FINAL)
    loss = grpo - salt
    with_salt = {c.name for c in design.conditions if c.facts["salt"]}
    rows = {}
    for condition in table:
        if condition in with_salt:
            acc = mean_of(table, condition, FINAL)
            geometry = ("salt/D_a", "salt/sign_flip", "salt/kept", "salt/n_eff_out", "salt/alpha", "salt/pr")
            rows[condition] = {
                "acc": acc,
                "recovered": (acc - salt) / loss if loss else math.nan,
                **{k.split("/")[-1]: mean_of(table, condition, window(k)) for k in geometry},
                "alpha_positive": describe(pooled(runs, [condition], "salt/alpha") > 0)["mean"],
            }
    return {"grpo_acc": grpo, "salt_acc": salt, "salt_loss": loss, "variants": rows}


def render(section):
    accuracies = f"GRPO {fmt(section['grpo_acc'])}, SALT {fmt(section['salt_acc'])}"
    return [
        "",
        f"## Which component costs SALT its accuracy ({accuracies})",
        "",
        "recovered = (acc_variant − acc_SALT) / (acc_GRPO − acc_SALT): 1 = as good as GRPO, 0 = as SALT.",
        "",
        "| variant | acc | recovered | D_a | sign flips | kept ‖a‖² | n_eff(a') | α_t | steps with α_t > 0 | PR |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {name} | " + " | ".join(fmt(v[k]) for k in COLUMNS) + " |" for name, v in section["variants"].items()),
    ]


def plot(section, table, out):
    """Final accuracy per SALT variant (mean ± sd over seeds), GRPO's as a line."""
    plt, fig, ax = figure(size=(9, 4))
    names = list(section["variants"])
    means = [table[n][FINAL]["mean"] for n in names]
    sds = [table[n][FINAL]["sd"] for n in names]
    ax.bar(range(len(names)), means, yerr=sds, capsize=3)
    ax.axhline(section["grpo_acc"], color="black", linestyle="--", label="GRPO")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set(ylabel="held-out accuracy (last step)")
    ax.legend(fontsize=8)
    return [save(plt, fig, out, "ablations_accuracy.png")]


class SaltAblations(ConditionStudy):
    name, section = "salt-ablations", "ablations"

    def design(self):
        return design()

    def summarize(self, result):
        return section(result.design, result.runs, result.table)

    def render(self, section):
        return render(section)

    def plots(self, summary, result):
        return plot(summary[self.section], summary["table"], result.out)


STUDY = SaltAblations()
