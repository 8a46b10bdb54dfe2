"""The demo report: AUROCs against brute-force pair counting, error counts pooled by hand, and the whole summary of a
synthetic run directory against hand-computed numbers; report.md renders from summary.json alone."""

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.eval.report import Run
from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab import demo_report as report


def brute_auroc(pos, neg):
    """P(score of a positive > score of a negative) + 1/2 P(tie), by enumerating every pair."""
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


records_strategy = st.lists(
    st.tuples(
        st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=6),  # one prompt's rewards
        st.lists(st.booleans(), min_size=6, max_size=6),  # corrupted
        st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=6, max_size=6),  # GDI (None = no pairs)
    ),
    min_size=1,
    max_size=4,
)


def as_records(groups):
    """One record per step as gdi.jsonl holds it (None for a missing GDI); a second prompt of one rollout per step."""
    records = []
    for step, (rewards, corrupted, gdi) in enumerate(groups):
        n = len(rewards)
        records.append(
            {
                "step": step,
                "rewards": rewards + [1.0 - rewards[0]],  # the second prompt's single rollout: never paired
                "group_ids": [0] * n + [1],
                "corrupted": corrupted[:n] + [True],
                "gdi": [None if g is None else float(g) for g in gdi[:n]] + [None],
            }
        )
    return records


@settings(max_examples=150)
@given(records_strategy)
def test_pair_count_auroc_matches_brute_force_over_scored_rollouts(groups):
    records = as_records(groups)
    pos, neg = [], []
    for r in records:
        for reward, group, bad, gdi in zip(r["rewards"], r["group_ids"], r["corrupted"], r["gdi"]):
            if gdi is None:
                continue
            pairs = sum(1 for rj, gj in zip(r["rewards"], r["group_ids"]) if gj == group and rj != reward)
            (pos if bad else neg).append(pairs)
    auroc, n_pos, n_neg = report.pair_count_auroc(records)
    assert (n_pos, n_neg) == (len(pos), len(neg))
    if pos and neg:
        assert auroc == pytest.approx(brute_auroc(pos, neg))
    else:
        assert math.isnan(auroc)


@settings(max_examples=150)
@given(records_strategy)
def test_pooled_auroc_matches_brute_force_over_scored_rollouts(groups):
    records = as_records(groups)
    scored = [(g, bad) for r in records for g, bad in zip(r["gdi"], r["corrupted"]) if g is not None]
    pos, neg = [g for g, bad in scored if bad], [g for g, bad in scored if not bad]
    auroc, n_pos, n_neg = report.pooled_auroc(records)
    assert (n_pos, n_neg) == (len(pos), len(neg))
    if pos and neg:
        assert auroc == pytest.approx(brute_auroc(pos, neg))
    else:
        assert math.isnan(auroc)


@st.composite
def step_counts(draw):
    """`task.shortcut_stats` counts of one step: consistent (wrong_shortcut <= wrong, shortcut <= rollouts)."""
    n = draw(st.integers(0, 16))
    wrong, shortcut = draw(st.integers(0, n)), draw(st.integers(0, n))
    return n, wrong, shortcut, draw(st.integers(max(0, wrong + shortcut - n), min(wrong, shortcut)))


@settings(max_examples=100)
@given(
    st.dictionaries(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 2), st.integers(1, 4)), step_counts()),
    st.sampled_from([(["a"], 1, math.inf), (["a", "b"], 1, 1), (["b"], 2, 4), (["a", "b"], 3, 3)]),
)
def test_error_composition_pools_counts_over_methods_seeds_and_steps(counts, selection):
    runs = {}
    for (method, seed, step), values in sorted(counts.items()):
        run = runs.setdefault(method, {}).setdefault(seed, Run())
        for key, value in zip(report.TASK_COUNTS, values):
            steps, old = run.curves.get(key, (np.zeros(0), np.zeros(0)))
            run.curves[key] = (np.append(steps, step), np.append(old, float(value)))
    methods, lo, hi = selection
    picked = [v for (m, _, t), v in counts.items() if m in methods and lo <= t <= hi]
    n, wrong, shortcut, wrong_shortcut = (sum(v[i] for v in picked) for i in range(4))
    got = report.error_composition(runs, methods, lo, hi)
    assert got["rollouts"] == n
    assert got["wrong"] == pytest.approx(wrong / n if n else math.nan, nan_ok=True)
    assert got["shortcut"] == pytest.approx(shortcut / n if n else math.nan, nan_ok=True)
    assert got["wrong_shortcut"] == pytest.approx(wrong_shortcut / wrong if wrong else math.nan, nan_ok=True)


# ---------------------------------------------------------------- the summary of a synthetic run directory

SEEDS, LAST = (0, 1, 2), 6
FINALS = {
    "base": [0.5, 0.6, 0.7],
    "geom": [0.6, 0.6, 0.9],
    "noisy": [0.4, 0.5, 0.6],
    "curated": [0.45, 0.5, 0.65],
}
ALPHA = [0.0, 0.5, 0.0, 0.2, 0.0, 0.0]  # geom's salt/alpha at steps 1..6: > 0 on 2 steps per seed
# gdi.jsonl of "curated": (seed, step, rewards, group ids, GDI, corrupted)
RECORDS = [
    (0, 1, [1, 1, 0, 0, 1], [0, 0, 0, 0, 1], [3.0, None, 1.0, 2.0, None], [True, False, False, True, True]),
    (0, 6, [1, 0, 0], [0, 0, 0], [0.5, 4.0, 2.5], [False, True, False]),
    (1, 2, [0, 1, 1, 1], [2, 2, 2, 2], [5.0, 1.0, 1.0, 0.0], [True, False, False, False]),
]
G_NORM = [0.5, 0.4, 0.45, 0.2, 0.3, 0.1]  # App. B's update norm and residual bound of the "geom" runs
B_DELTA = [1.0, 0.9, 0.7, 0.8, 0.4, 0.3]
SKIPPED = {(0, 2): "few_scores", (2, 3): "few_scores", (2, 4): "no_pairs"}


def step_row(method, seed, step):
    """The metrics.jsonl row of one RL step, as the engines log it (None for NaN)."""
    row = {"method": method, "seed": seed, "step": step, "reward": 0.5}
    if method in ("base", "geom"):
        row["salt/pr"] = 10.0 + seed + step if method == "base" else 8.0 + step
        row["salt/n_eff_out"] = 1.0 if method == "base" else 2.0
    if method == "geom":
        row["salt/alpha"] = ALPHA[step - 1]
        row["salt/g_norm"] = G_NORM[step - 1] + 0.1 * seed
        row["salt/b_delta"] = B_DELTA[step - 1] * (1 + seed)
    if method in ("noisy", "curated"):
        first = step == 1
        row.update({"task/rollouts": 10, "task/wrong": 6 if first else 2, "task/shortcut": 5 if first else 1,
                    "task/wrong_shortcut": 4 if first else 1})  # fmt: skip
    if method == "curated":
        row["geo/val_acc"] = 0.9 if step <= 5 else 0.5
        row["geo/skipped_reason"] = SKIPPED.get((seed, step), "")
        row["geo/auroc"] = {0: [0.6, 0.7, 0.8, 0.9, 1.0, 0.5][step - 1], 1: 0.4 if step == 1 else None}.get(seed)
    if step == LAST:
        row["eval/accuracy"] = FINALS[method][seed]
    return row


def write_runs(root):
    for method in FINALS:
        for seed in SEEDS:
            rows = [{"method": method, "seed": seed, "step": 0, "eval/accuracy": 0.1}]
            rows += [step_row(method, seed, t) for t in range(1, LAST + 1)]
            (root / method / f"seed{seed}").mkdir(parents=True)
            (root / method / f"seed{seed}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for seed, step, rewards, groups, gdi, corrupted in RECORDS:
        record = {"method": "curated", "seed": seed, "step": step, "gdi": gdi, "corrupted": corrupted,
                  "flagged": [False] * len(gdi), "rewards": rewards, "group_ids": groups}  # fmt: skip
        with (root / "curated" / f"seed{seed}" / "gdi.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
    (root / "aaa" / "seed0").mkdir(parents=True)  # a method outside the caller's order: listed after it
    (root / "aaa" / "seed0" / "metrics.jsonl").write_text('{"step": 6, "eval/accuracy": 0.3}\n')


SETUP = {
    "quick": False,
    "task": "toy additions.",
    "steps": LAST,
    "seeds": list(SEEDS),
    "sft": {"steps": 3, "wall_s": 1.0, "accuracy": 0.5, "params": 1234,
            "config": {"per_prompt": 8, "shortcut_rate": 0.5, "strategies": ["digits"]}},
    "n_eval": 8,
    "eval_samples": 2,
    "wall_s": 5.0,
    "common": "openrlhf-geo train --shared",
    "commands": {"base": "--base", "geom": "--geom", "noisy": "--noisy", "curated": "--curated"},
}  # fmt: skip
ORDER = ("base", "geom", "noisy", "curated")
COMPARISONS = (("geom", "base"), ("curated", "noisy"))


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_runs(root)
    return report.summarize(root, COMPARISONS, SETUP, ORDER)


def test_summary_lists_methods_finals_and_step_means(summary):
    assert summary["methods"] == ["base", "geom", "noisy", "curated", "aaa"]
    assert summary["last_step"] == LAST and summary["setup"] is SETUP
    for method, finals in FINALS.items():
        assert summary["final_accuracy"][method]["per_seed"] == dict(zip(SEEDS, finals))
        assert summary["final_accuracy"][method]["mean"] == pytest.approx(sum(finals) / 3)
    assert summary["final_accuracy"]["aaa"] == {"per_seed": {0: 0.3}, "mean": 0.3}
    means = summary["step_means"]
    # base: salt/pr = 10 + seed + step, mean over steps 1..6 = 13.5 + seed, over seeds 14.5; geom: 8 + 3.5
    assert means["base"] == pytest.approx({"reward": 0.5, "salt/pr": 14.5, "salt/n_eff_out": 1.0})
    assert means["geom"] == pytest.approx(
        {"reward": 0.5, "salt/pr": 11.5, "salt/n_eff_out": 2.0, "salt/alpha": 0.7 / 6}
    )
    assert means["curated"] == pytest.approx({"reward": 0.5, "geo/val_acc": 5 / 6})
    assert summary["alpha_positive_steps"] == {"geom": [6, 18]}


def test_summary_compares_the_given_pairs_by_seed_with_bootstrap_cis(summary):
    rows = {(r["method"], r["baseline"], r["metric"]): r for r in summary["comparisons"]}
    assert set(rows) == {
        ("geom", "base", "final/eval/accuracy"),
        ("geom", "base", "mean/salt/pr"),
        ("geom", "base", "mean/salt/n_eff_out"),
        ("curated", "noisy", "final/eval/accuracy"),
    }  # mean/reward is logged by all but not among report.COMPARED
    # with 3 seeds each resample is one of 27 equally likely ones; the lowest mean (every draw the smallest
    # difference) has probability 1/27 > 2.5%, so the 95% percentile interval is [min, max] of the differences
    for key, diffs in (
        (("geom", "base", "final/eval/accuracy"), [0.1, 0.0, 0.2]),
        (("geom", "base", "mean/salt/pr"), [-2.0, -3.0, -4.0]),  # 11.5 - (13.5 + seed)
        (("geom", "base", "mean/salt/n_eff_out"), [1.0, 1.0, 1.0]),  # equal differences: the interval collapses
        (("curated", "noisy", "final/eval/accuracy"), [0.05, 0.0, 0.05]),
    ):
        row = rows[key]
        assert row["seeds"] == list(SEEDS) and row["n"] == 3
        assert row["gain"] == pytest.approx(sum(diffs) / 3)
        assert (row["low"], row["high"]) == pytest.approx((min(diffs), max(diffs)))


def test_summary_pools_the_error_counts_per_method_and_span(summary):
    errors = summary["errors"]
    assert set(errors) == set(summary["methods"]) and set(errors["noisy"]) == {"1-1", "6-6", "1-6"}
    # 3 seeds x 10 rollouts per step; step 1: 6 wrong, 5 shortcut, 4 both; later steps: 2, 1, 1
    assert errors["curated"]["1-1"] == pytest.approx(
        {"rollouts": 30, "wrong": 18 / 30, "shortcut": 15 / 30, "wrong_shortcut": 12 / 18}
    )
    assert errors["noisy"]["6-6"] == pytest.approx(
        {"rollouts": 30, "wrong": 0.2, "shortcut": 0.1, "wrong_shortcut": 0.5}
    )
    assert errors["noisy"]["1-6"] == pytest.approx(
        {"rollouts": 180, "wrong": 48 / 180, "shortcut": 30 / 180, "wrong_shortcut": 27 / 48}
    )
    assert errors["base"]["1-6"]["rollouts"] == 0 and math.isnan(errors["base"]["1-6"]["wrong"])


def test_summary_detection_from_the_gdi_records_by_hand(summary):
    assert set(summary["detection"]) == {"curated"}
    d = summary["detection"]["curated"]
    # scored corrupted GDI [3, 2, 4, 5] vs clean [1, 0.5, 2.5, 1, 1, 0]: 23 of 24 pairs won (2 < 2.5 loses)
    assert d["gdi_auroc"] == pytest.approx(23 / 24)
    assert (d["corrupted_scored"], d["clean_scored"], d["corrupted"]) == (4, 6, 5)
    # pairs per scored rollout (same prompt, other reward): corrupted [2, 2, 1, 3], clean [2, 2, 1, 1, 1, 1]
    assert d["pair_count_auroc"] == pytest.approx(18 / 24)
    assert d["per_step_auroc"] == pytest.approx({"mean": 4.9 / 7, "min": 0.4, "steps": 7})
    assert d["curated_steps"] == 18 and d["skipped"] == {"few_scores": 2, "no_pairs": 1}
    assert list(d["by_steps"]) == ["1-5", "6-6"]
    # steps 1-5: corrupted GDI [3, 2, 5] vs clean [1, 1, 1, 0]; pairs [2, 2, 3] vs [2, 1, 1, 1]
    assert d["by_steps"]["1-5"] == pytest.approx({"gdi_auroc": 1.0, "pair_count_auroc": 11 / 12, "val_acc": 0.9,
                                                  "shortcut": 27 / 150})  # fmt: skip
    # step 6: corrupted GDI [4] vs clean [0.5, 2.5]; pairs [1] vs [2, 1]
    assert d["by_steps"]["6-6"] == pytest.approx(
        {"gdi_auroc": 1.0, "pair_count_auroc": 0.25, "val_acc": 0.5, "shortcut": 0.1}
    )


def test_summary_rejects_comparisons_naming_absent_methods(tmp_path):
    write_runs(tmp_path)
    with pytest.raises(ValueError, match=r"without runs under .*\['salt'\]"):
        report.summarize(tmp_path, [("salt", "base")], SETUP)


def test_report_renders_the_summary_numbers(summary):
    text = report.render(summary)
    assert text == report.render(strict_json(summary))  # the same from summary.json
    assert "| geom | 0.700 | 0.600, 0.600, 0.900 |" in text
    assert "| geom | base | final/eval/accuracy | 0.700 | 0.600 | +0.100 [+0.000, +0.200] | 3 |" in text
    assert "| salt/pr | 14.500 | 11.500 | n/a | n/a | n/a |" in text
    assert "- geom: alpha_t > 0 on 6 of 18 steps." in text
    assert "| curated | 1-1 | 30 | 0.60 | 0.50 | 0.67 |" in text and "| base | 1-1 |" not in text
    assert "AUROC, pooled over steps and seeds: 0.958 (4 corrupted vs 6 clean scored rollouts; 1 of the 5" in text
    assert "by reason: few_scores 2, no_pairs 1 (of 18 steps)" in text
    assert "| 6-6 | 1.000 | 0.250 | 0.500 | 0.10 |" in text
    assert "openrlhf-geo train --shared" in text and "           geom: --geom" in text
    assert not re.search(r"\bmet\b|likely|target", text)  # measurements only, no verdicts


def test_write_report_writes_strict_json_the_markdown_from_it_and_plots(tmp_path):
    root = tmp_path / "runs"
    write_runs(root)
    summary = report.write_report(tmp_path, root, COMPARISONS, SETUP, ORDER)
    data = json.loads((tmp_path / "summary.json").read_text(), parse_constant=pytest.fail)  # no NaN/Infinity
    assert data["final_accuracy"]["geom"]["per_seed"] == {"0": 0.6, "1": 0.6, "2": 0.9}
    assert data["errors"]["base"]["1-6"]["wrong"] is None
    assert (tmp_path / "report.md").read_text() == report.render(data)
    assert summary["plots"] == [
        "eval_accuracy.png", "salt_pr.png", "salt_n_eff_out.png", "salt_alpha.png", "geo_auroc.png", "gdi_curated.png"
    ]  # fmt: skip
    for name in summary["plots"]:
        assert (tmp_path / name).stat().st_size > 5_000
        assert f"![{name}]({name})" in report.render(data)


def test_summary_correlates_update_norm_with_the_residual_bound_over_steps_and_seeds(summary):
    """SALT App. B / Fig. 5: Pearson and Spearman of ‖g_q‖ with B_δ, here by hand over every seed's 6 steps."""
    from scipy.stats import rankdata

    x = np.array([g + 0.1 * seed for seed in SEEDS for g in G_NORM])
    y = np.array([b * (1 + seed) for seed in SEEDS for b in B_DELTA])
    got = summary["update_norm_vs_bound"]["geom"]
    assert got["n"] == 6 * len(SEEDS)
    assert got["pearson"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert got["spearman"] == pytest.approx(np.corrcoef(rankdata(x), rankdata(y))[0, 1])  # Pearson of mid-ranks
    assert set(summary["update_norm_vs_bound"]) == {"geom"}  # only methods that log both
    assert "Pearson " + f"{got['pearson']:.2f}" in report.render(summary)
