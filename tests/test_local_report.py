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
