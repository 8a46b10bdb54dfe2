"""The demo report's numbers: AUROCs against brute-force pair counting, and targets stated from the numbers."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.local import report


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
    """One record per step; each step holds the generated prompts with their own group ids."""
    records = []
    for step, (rewards, corrupted, gdi) in enumerate(groups):
        n = len(rewards)
        records.append(
            {
                "step": step,
                "rewards": rewards + [1.0 - rewards[0]],  # a second prompt of one rollout: never paired
                "group_ids": [0] * n + [1],
                "corrupted": corrupted[:n] + [True],
                "gdi": [math.nan if g is None else float(g) for g in gdi[:n]] + [math.nan],
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
            if math.isnan(gdi):
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
    gdi = np.concatenate([r["gdi"] for r in records])
    bad = np.concatenate([r["corrupted"] for r in records])
    pos, neg = gdi[np.isfinite(gdi) & bad], gdi[np.isfinite(gdi) & ~bad]
    auroc, n_pos, n_neg = report.pooled_auroc(records)
    assert (n_pos, n_neg) == (len(pos), len(neg))
    if len(pos) and len(neg):
        assert auroc == pytest.approx(brute_auroc(pos, neg))
    else:
        assert math.isnan(auroc)


def test_pair_count_auroc_skips_records_without_rewards():
    assert math.isnan(report.pair_count_auroc([{"gdi": [1.0], "corrupted": [True]}])[0])


def _rows(method, seeds, steps, **metrics):
    return [
        {"method": method, "seed": s, "step": t, **{k: v(s, t) if callable(v) else v for k, v in metrics.items()}}
        for s in seeds
        for t in range(1, steps + 1)
    ]


def test_targets_state_met_and_not_met_from_the_numbers():
    seeds, steps = [0, 1, 2], 3
    rows = [
        *_rows("grpo", seeds, steps, **{"salt/pr": 10.0, "salt/n_eff_out": 1.2, "salt/n_eff": 1.2}),
        *_rows("salt", seeds, steps, **{"salt/pr": 9.0, "salt/n_eff_out": 4.0, "salt/alpha": 0.0}),
        *_rows("geoalign_noise", seeds, steps, **{"geo/proj_val_acc": 0.5}),
    ]
    finals = {m: {s: 0.5 for s in seeds} for m in ("grpo", "salt", "grpo_noise", "geoalign_noise")}
    alpha_steps = [0.0] * 9
    lines = "\n".join(report._targets(rows, [], steps, alpha_steps, 0.62, 0.60, finals, len(seeds)))
    assert "n_eff higher than GRPO's: met (4.000 vs 1.200, paired difference +2.800 [+2.800, +2.800])" in lines
    assert "PR higher: **not met** (9.00 vs 10.00, paired difference -1.000 [-1.000, -1.000])" in lines
    assert "alpha_t = 0 on every step" in lines and "1.200 >= 1" in lines
    assert "GDI AUROC >= 0.8 for the corrupted rollouts: **not met** (0.620)" in lines
    assert "pair-count score (0.600)" in lines and "validation accuracy is 0.500" in lines
    assert "over >= 3 seeds: met (3 seeds" in lines

    noisy = [{**r, "salt/pr": r["salt/pr"] + 2 * r["seed"] - 1.5} if r["method"] == "salt" else r for r in rows]
    lines = "\n".join(report._targets(noisy, [], steps, [0.1], 0.85, 0.6, finals, len(seeds)))
    assert "PR higher: **not met** (9.50 vs 10.00" in lines
    noisy = [{**r, "salt/pr": 10.5 + 2 * r["seed"] - 1.5} if r["method"] == "salt" else r for r in rows]
    lines = "\n".join(report._targets(noisy, [], steps, [0.1], 0.85, 0.6, finals, len(seeds)))
    assert "PR higher: met on the means; the paired CI includes 0 (11.00 vs 10.00" in lines
    assert "GDI AUROC >= 0.8 for the corrupted rollouts: met (0.850)" in lines
    assert "pair-count" not in lines and "every step" not in lines


@settings(max_examples=100)
@given(
    st.lists(
        st.tuples(st.sampled_from(["grpo", "salt"]), st.integers(1, 3), st.integers(0, 16), st.data()),
        min_size=1,
        max_size=12,
    )
)
def test_error_composition_pools_counts_over_the_selected_rows(entries):
    rows = []
    for method, step, n, data in entries:
        wrong = data.draw(st.integers(0, n))
        shortcut = data.draw(st.integers(0, n))
        wrong_shortcut = data.draw(st.integers(max(0, wrong + shortcut - n), min(wrong, shortcut)))
        rows.append({"method": method, "seed": 0, "step": step, "task/rollouts": n, "task/wrong": wrong,
                     "task/shortcut": shortcut, "task/wrong_shortcut": wrong_shortcut})  # fmt: skip
    rows.append({"method": "grpo", "seed": 0, "step": 0, "eval/accuracy": 0.5})  # an eval row: no counts
    for methods, step in ((["grpo"], None), (["grpo", "salt"], 1), (["salt"], 3)):
        picked = [r for r in rows if r["method"] in methods and r["step"] >= 1 and step in (None, r["step"])]
        n = sum(r["task/rollouts"] for r in picked)
        wrong = sum(r["task/wrong"] for r in picked)
        got = report.error_composition(rows, methods, step)
        assert got["rollouts"] == n
        for key, value in (
            ("wrong", wrong / n if n else math.nan),
            ("shortcut", sum(r["task/shortcut"] for r in picked) / n if n else math.nan),
            ("wrong_shortcut", sum(r["task/wrong_shortcut"] for r in picked) / wrong if wrong else math.nan),
        ):
            assert got[key] == pytest.approx(value, nan_ok=True), key


def test_error_and_salt_weight_lines_state_the_logged_numbers():
    rows = [
        *_rows("grpo", [0], 2, **{"task/rollouts": 10, "task/wrong": lambda s, t: 6 if t == 1 else 2,
                                  "task/shortcut": lambda s, t: 5 if t == 1 else 1, "task/wrong_shortcut": 2}),
        *_rows("salt", [0], 2, **{"task/rollouts": 10, "task/wrong": 4, "task/shortcut": 3,
                                  "task/wrong_shortcut": 3, "salt/pk_rho_norm": lambda s, t: 0.5 + 0.1 * t,
                                  "salt/pk_rho_inv_len": 0.2, "salt/topnorm_share": 0.3, "salt/kept": 0.25,
                                  "salt/sign_flip": 0.1, "salt/k": 16, "salt/m": 128}),
    ]  # fmt: skip
    lines = "\n".join(report._error_lines(rows, ["grpo", "salt"], 0.5, 2))
    # step 1: 10 of 20 rollouts wrong, 5 of those follow the shortcut; all steps: 16 wrong, 10 of them shortcut
    assert "step 1 (the SFT policy, all runs) 0.50 of the rollouts are wrong and 0.50 of the wrong ones" in lines
    assert "50% of the SFT demonstrations" in lines and "0.62 of the 16 wrong rollouts follow it" in lines
    assert "GRPO 0.50 -> 0.10, GRPO+SALT 0.30 -> 0.30" in lines
    line = "\n".join(report._salt_weight_line(rows))
    assert "Spearman rho 0.65 with the feature norms" in line and "0.20 with 1/T_i" in line
    assert "hold 0.30 of ||a'||^2 (0.12 if spread evenly)" in line
    assert "keeps 0.25 of ||a||^2" in line and "sign of 0.10 of the nonzero" in line
    assert report._error_lines([], ["grpo"], 0.5, 2) == [] and report._salt_weight_line([]) == []


def test_phase_table_splits_the_aurocs_and_projector_accuracy_by_range_of_steps():
    rng = np.random.default_rng(0)
    records = [
        {"step": t, "rewards": [1.0, 1.0, 0.0, 0.0] * 2, "group_ids": [0] * 4 + [1] * 4,
         "corrupted": list(rng.random(8) < 0.4), "gdi": list(rng.random(8))}
        for t in range(1, 13)
        for _ in range(2)
    ]  # fmt: skip
    early = {"geo/proj_val_acc": lambda s, t: 0.9 if t <= 5 else 0.5, "task/shortcut": lambda s, t: 4 * (t <= 5)}
    rows = _rows("geoalign_noise", [0], 12, **early, **{"task/rollouts": 8})
    table = report._phase_table(records, rows, 12)
    body = [line for line in table if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in body] == ["| 1-5", "| 6-10", "| 11-12"]
    for line, (lo, hi) in zip(body, [(0, 5), (5, 10), (10, 12)]):
        part = [r for r in records if lo < r["step"] <= hi]
        gdi, count = report.pooled_auroc(part)[0], report.pair_count_auroc(part)[0]
        cells = line.strip("| ").split(" | ")
        assert cells[1:4] == [f"{gdi:.3f}", f"{count:.3f}", f"{gdi - count:.3f}"]
        assert cells[4] == ("0.900" if hi <= 5 else "0.500") and cells[5] == ("0.50" if hi <= 5 else "0.00")
