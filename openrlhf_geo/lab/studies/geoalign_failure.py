"""geoalign-failure: GeoAlign under a systematically misspecified reward next to random flips (GeoAlign arXiv
2606.26917 §5.3): a verifier that pays the shortcut's answer on 20 % of prompts and 5 % / 10 % random flips, each
with GRPO, GeoAlign and the four baselines of its App. B.5; clean GRPO for reference (protocol:
docs/studies/geoalign-failure.md)."""

import math
from pathlib import Path

import numpy as np

from openrlhf_geo.lab import recipe
from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import FINAL, SEEDS, describe, fmt

GEOALIGN = tuple(recipe.METHOD_FLAGS["geoalign_noise"][len(recipe.NOISE) :])  # the demo's GeoAlign without its noise
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
GEOALIGN_METRICS = ("geo/val_acc", "geo/cos_gt_0.8", "geo/flag_frac", "geo/precision", "geo/recall", "geo/auroc")


def design():
    conditions = [Condition("grpo_clean", (), facts={"method": "grpo", "noise": None})]
    comparisons = []
    for noise, flags in NOISES.items():
        methods = {"grpo": (), "geoalign": GEOALIGN, **BASELINES}
        conditions += [
            Condition(f"{m}_{noise}", (*flags, *extra), facts={"method": m, "noise": noise})
            for m, extra in methods.items()
        ]
        comparisons.append((f"grpo_{noise}", "grpo_clean"))
        comparisons += [(f"{m}_{noise}", f"grpo_{noise}") for m in methods if m != "grpo"]
        comparisons += [(f"geoalign_{noise}", f"{b}_{noise}") for b in BASELINES]
    return Design("geoalign-failure", "GeoAlign under a misspecified reward", tuple(conditions), tuple(comparisons),
                  SEEDS, recipe.FULL["steps"], recipe.FULL["eval_steps"], quick=("grpo_mis20", "geoalign_mis20"),
                  metrics=("accuracy", "response_length", "noise/corrupted", *GEOALIGN_METRICS),
                  shown=(FINAL, "last20%/accuracy", "last20%/geo/flag_frac"))  # fmt: skip


def section(design, runs, out, steps):
    """GeoAlign's detection per noise (demo_report.detection: GDI AUROC vs the reward-only pair count, by range of
    steps; projector validation accuracy), its step means of cos_gt_0.8, flag share, precision, recall, and each
    noise's measured corruption share (GRPO's runs)."""
    from openrlhf_geo.lab import demo_report as report

    method = {c.name: c.facts["method"] for c in design.conditions}
    detection = {}
    for condition in runs:
        if method[condition] == "geoalign" and report.gdi_records(Path(out) / "runs", condition):
            detection[condition] = report.detection(runs, Path(out) / "runs", condition, steps)
            means = {key: describe(report.pooled(runs, [condition], key))["mean"] for key in GEOALIGN_METRICS}
            val_acc = report.pooled(runs, [condition], "geo/val_acc")  # App. C.1 reports its median
            means["geo/val_acc median"] = float(np.median(val_acc)) if val_acc.size else math.nan
            detection[condition]["step_means"] = means
    # the share of rollouts whose reward the noise changed, over all steps and seeds (the three noises' strengths)
    corrupted = {c: describe(report.pooled(runs, [c], "noise/corrupted"))["mean"] for c in runs if method[c] == "grpo"}
    return {"detection": detection, "corrupted_share": corrupted}


def render(section):
    shares = ", ".join(f"{c} {fmt(v)}" for c, v in section["corrupted_share"].items())
    lines = ["", f"Share of rollouts whose reward the noise changed (all steps, GRPO runs): {shares}."]
    for condition, d in section["detection"].items():
        lines += [
            "",
            f"## GeoAlign detection ({condition})",
            "",
            f"- GDI AUROC pooled {fmt(d['gdi_auroc'])} vs reward-only pair count {fmt(d['pair_count_auroc'])} "
            f"({d['corrupted_scored']} corrupted vs {d['clean_scored']} clean scored rollouts; "
            f"{d['corrupted'] - d['corrupted_scored']} corrupted ones without a GDI).",
            "- Step means: " + ", ".join(f"{k} {fmt(v)}" for k, v in d["step_means"].items()),
            "",
            "| steps | GDI AUROC | reward-only AUROC | projector val. accuracy | shortcut share |",
            "|---|---|---|---|---|",
            *(
                f"| {span} | {fmt(p['gdi_auroc'])} | {fmt(p['pair_count_auroc'])} | {fmt(p['val_acc'])} | "
                f"{fmt(p['shortcut'], 2)} |"
                for span, p in d["by_steps"].items()
            ),
        ]
    return lines


class GeoalignFailure(ConditionStudy):
    name, section = "geoalign-failure", "geoalign"

    def design(self):
        return design()

    def summarize(self, result):
        return section(result.design, result.runs, result.out, result.steps)

    def render(self, section):
        return render(section)

    def curve_groups(self, result):
        """One plot per noise, clean GRPO in each."""
        clean = [c.name for c in result.design.conditions if c.facts["noise"] is None]
        return {
            f"_{noise}": [*clean, *(c.name for c in result.design.conditions if c.facts["noise"] == noise)]
            for noise in NOISES
        }


STUDY = GeoalignFailure()
