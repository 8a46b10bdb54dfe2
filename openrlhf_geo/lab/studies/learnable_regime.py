"""learnable-regime: a task of intermediate difficulty where GRPO learns and its n_eff is below 1. GRPO (+ SALT's
diagnostics, nothing of SALT applied) in each candidate setting and the demo's; the candidate salt-scaling reruns
in is chosen on these runs alone (protocol: docs/studies/learnable-regime.md)."""

import math

import numpy as np

from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import FINAL, GRPO_DIAG, LEARNABLE, SEEDS, fmt, fmt_ci, mean_of, window

LEARNABLE_MIN_ACC = 0.25  # the rule: GRPO's final held-out accuracy at least this, and above step 0's


def design():
    conditions = [Condition(f"{name}_grpo", GRPO_DIAG, name) for name in ("demo", *LEARNABLE)]
    comparisons = [(f"{name}_grpo", "demo_grpo") for name in LEARNABLE]
    shown = (FINAL, "last20%/salt/n_eff_in", "last20%/salt/pr", "last20%/response_length")
    return Design("learnable-regime", "A learnable task in SALT's regime", tuple(conditions), tuple(comparisons),
                  SEEDS, 50, 25, quick=("demo_grpo", "operands199_grpo"), shown=shown)  # fmt: skip


def section(runs, table):
    """Per setting GRPO's backbone n_eff, α_t, PR (last 20 %), its held-out accuracy at step 0 (the SFT model) and at
    the end, and the paired gain RL made; the candidate chosen by the protocol's rule (the learnable one with the
    smallest backbone n_eff) and whether its n_eff is below 1 (the condition for a salt-scaling rerun)."""
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
            "n_eff": mean_of(table, condition, window("salt/n_eff_in")),
            "alpha": mean_of(table, condition, window("salt/alpha")),
            "pr": mean_of(table, condition, window("salt/pr")),
            "response_length": mean_of(table, condition, window("response_length")),
            "acc_step0": float(np.mean(start)) if start else math.nan,
            "acc": mean_of(table, condition, FINAL),
            "rl_gain": gain,
            "learnable": bool(mean_of(table, condition, FINAL) >= LEARNABLE_MIN_ACC and gain["low"] > 0),
        }
    eligible = [k for k in LEARNABLE if k in rows and rows[k]["learnable"] and math.isfinite(rows[k]["n_eff"])]
    chosen = min(eligible, key=lambda k: rows[k]["n_eff"]) if eligible else None
    return {"settings": rows, "chosen": chosen, "run_salt_scaling": chosen is not None and rows[chosen]["n_eff"] < 1}


def render(section):
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
            f"| {name} | {fmt(v['n_eff'])} | {fmt(v['alpha'])} | {fmt(v['pr'], 1)} | {fmt(v['response_length'], 1)} | "
            f"{fmt(v['acc_step0'])} | {fmt(v['acc'])} | {fmt_ci(v['rl_gain'])} | {'yes' if v['learnable'] else 'no'} |"
            for name, v in section["settings"].items()
        ),
        "",
        verdict,
    ]


class LearnableRegime(ConditionStudy):
    name, section = "learnable-regime", "learnable"

    def design(self):
        return design()

    def summarize(self, result):
        return section(result.runs, result.table)

    def render(self, section):
        return render(section)


STUDY = LearnableRegime()
