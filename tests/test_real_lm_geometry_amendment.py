"""The real-lm-geometry protocol's amendment (docs/studies/real-lm-geometry.md, "Amendment", items 2-4): the CI over
prompts, SALT beside its random-subspace nulls, and the indicator-family shares, each against an independent numpy
float64 computation."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.jsonl import nan_json
from openrlhf_geo.lab import word_task
from openrlhf_geo.lab.studies import real_lm_geometry as study


def _numpy_n_eff(c, K):
    """Eq. 6 on a Gram, numpy float64: cᵀKc / Σ_i c_i² K_ii (NaN for 0/0)."""
    den = float((c * c) @ np.diagonal(K))
    return float(c @ K @ c) / den if den > 0 else math.nan


def _orthonormal(x):
    q, r = np.linalg.qr(x)
    return q[:, np.abs(np.diagonal(r)) > 1e-10]


# ---------------------------------------------------------------- item 2: the CI over prompts


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**16))
def test_weighted_n_eff_is_eq6_on_the_rows_each_prompt_brings(prompts, G, seed):
    rng = np.random.default_rng(seed)
    m = prompts * G
    F = rng.standard_normal((m, 7)) + rng.standard_normal(7)  # a shared component: the terms can cancel
    K = F @ F.T
    a = rng.standard_normal(m) * (rng.uniform(size=m) < 0.7)
    weights = rng.integers(0, 4, size=(5, prompts))
    got = study.weighted_n_eff(a, K, weights, G)
    for r, w in enumerate(weights):
        blocks = [np.arange(p * G, (p + 1) * G) for p in range(prompts) for _ in range(w[p])]
        rows = np.concatenate([np.zeros(0, dtype=int), *blocks])
        want = _numpy_n_eff(a[rows], K[np.ix_(rows, rows)])  # the duplicated rows, brute force
        if math.isnan(want):
            assert math.isnan(got[r])
        else:
            assert got[r] == pytest.approx(want, rel=1e-10, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 5), st.integers(0, 2**16))
def test_weighted_n_eff_with_copies_apart_pairs_a_copy_only_with_itself(prompts, G, seed):
    """copies="apart": each copy of a drawn prompt is paired with itself, not with the other copies, and the
    cross-prompt pairs are scaled by B/(B-1); brute force on the duplicated rows with those pairs masked."""
    rng = np.random.default_rng(seed)
    m = prompts * G
    F = rng.standard_normal((m, 7)) + rng.standard_normal(7)
    K = F @ F.T
    a = rng.standard_normal(m)
    weights = rng.integers(0, 4, size=(5, prompts))
    got = study.weighted_n_eff(a, K, weights, G, copies="apart")
    for r, w in enumerate(weights):
        rows = np.concatenate([np.zeros(0, dtype=int), *[np.arange(p * G, (p + 1) * G) for p in range(prompts)
                                                          for _ in range(w[p])]])  # fmt: skip
        draw = np.concatenate([np.zeros(0, dtype=int), *[np.full(G, d) for d in range(int(w.sum()))]])
        prompt = rows // G
        same_prompt, same_draw = prompt[:, None] == prompt[None, :], draw[:, None] == draw[None, :]
        pair = np.where(same_prompt, same_draw, prompts / (prompts - 1))
        num = float((a[rows, None] * K[np.ix_(rows, rows)] * a[None, rows] * pair).sum())
        den = float((a[rows] ** 2 * np.diagonal(K)[rows]).sum())
        if den == 0:
            assert math.isnan(got[r])
        else:
            assert got[r] == pytest.approx(num / den, rel=1e-10, abs=1e-12)


def test_the_copies_apart_numerator_is_unbiased_over_resamples_and_the_paired_one_is_not():
    """Over multinomial resamples of B prompts (E[w_p] = 1, E[w_p^2] = 2 - 1/B, E[w_p w_q] = 1 - 1/B), the numerator
    with the copies apart has the batch's own numerator as its mean; paired, it is off by (1 - 1/B) Σ_p own_p -
    (1/B) Σ_(p≠q) cross_pq (own_p: prompt p's block, a duplicated prompt's self-pairs)."""
    rng = np.random.default_rng(4)
    B, G = 8, 4
    F = rng.standard_normal((B * G, 6)) + 2 * rng.standard_normal(6)
    a = rng.standard_normal(B * G)
    K = F @ F.T
    blocks = (a[:, None] * K * a[None, :]).reshape(B, G, B, G).sum((1, 3))
    own, cross = np.trace(blocks), blocks.sum() - np.trace(blocks)
    W = rng.multinomial(B, np.full(B, 1 / B), size=100000)
    den = W @ (a * a * np.diagonal(K)).reshape(B, G).sum(1)
    num = {c: study.weighted_n_eff(a, K, W, G, copies=c) * den for c in ("apart", "paired")}
    scale = abs(own) + abs(cross)
    assert num["apart"].mean() == pytest.approx(blocks.sum(), abs=0.02 * scale)
    assert num["paired"].mean() == pytest.approx(blocks.sum() + (1 - 1 / B) * own - cross / B, abs=0.02 * scale)


def test_weighted_n_eff_of_unit_weights_is_the_batch_n_eff():
    from openrlhf_geo import diagnostics

    rng = np.random.default_rng(1)
    F, a = rng.standard_normal((12, 5)), rng.standard_normal(12)
    got = study.weighted_n_eff(a, F @ F.T, np.ones((1, 3)), 4)[0]
    assert got == pytest.approx(diagnostics.effective_sample_size(a, F @ F.T, eps=0.0), rel=1e-12)


@pytest.mark.parametrize("G", [4, 8, 16])
def test_batches_that_share_prompts_share_one_resampling_draw(G):
    batches = study.replicates(64, 16, G, 256)
    prompts = [np.unique(rows // 16) for rows in batches]
    weights = study.prompt_weights(prompts, 2000)
    B = 256 // G
    for i, (p, w) in enumerate(zip(prompts, weights)):
        assert w.shape == (2000, B) and (w.sum(1) == B).all()  # B prompts drawn with replacement
        for q, v in zip(prompts[i + 1 :], weights[i + 1 :]):
            assert np.array_equal(w, v) == np.array_equal(p, q)  # the same draw iff the same prompt set
    assert len({tuple(p) for p in prompts}) == {4: 1, 8: 2, 16: 4}[G]
    # the generator is seeded 20261204 and fills replicates row by row: the first 200 are the same for any count
    again = study.prompt_weights(prompts, 200)
    assert all(np.array_equal(w[:200], v) for w, v in zip(weights, again))
    assert not np.array_equal(study.prompt_weights(prompts, 200, seed=1)[0], again[0])


def test_a_replicate_is_the_mean_over_its_batches_with_signal_and_the_ci_its_percentiles():
    values = np.array([[1.0, 3.0], [np.nan, 2.0], [np.nan, np.nan]])
    means = study.replicate_means(values)
    assert means[:2].tolist() == [2.0, 2.0] and math.isnan(means[2])
    ci = study.percentile_ci(0.5, np.r_[np.arange(1000.0), np.nan])
    assert ci == {"mean": 0.5, "low": np.percentile(np.arange(1000.0), 2.5),
                  "high": np.percentile(np.arange(1000.0), 97.5), "n": 1000}  # fmt: skip
    assert study.regime({**study.percentile_ci(1.2, [1.1, 1.3]), "replicates": 2}).startswith("outside")
    assert study.regime(study.percentile_ci(1.2, [1.1])).startswith("no verdict")


# ---------------------------------------------------------------- item 3: SALT beside random subspaces


def _cancelling_batch(seed, m=24, dim=40):
    """Features with a shared direction and zero-sum group advantages: n_eff < 1, so α_t > 0."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(m, dim, generator=g, dtype=torch.float64) * 0.4 + torch.randn(
        dim, generator=g, dtype=torch.float64
    )
    rewards = (torch.rand(m, generator=g) < 0.5).double()
    from openrlhf_geo.estimators import group_norm

    a = group_norm(rewards, torch.arange(m) // 4)
    return a, features


def _numpy_random_subspace(a, F, draw):
    """Amendment item 3's plain random subspace, numpy float64: k_t by Eq. 5/14, α_t by Eq. 17, a' = P_R a + α_t (I −
    P_R)[a]₊ with P_R the projector on the span of the (m, k_t) Gaussian `draw(k)`."""
    a, F = a.numpy(), F.numpy()
    m = len(a)
    K = F @ F.T / m
    pr = np.trace(K) ** 2 / (K**2).sum()
    k = min(max(int(np.floor(pr + 0.5)), 1), m)
    alpha = max(0.0, 1.0 - _numpy_n_eff(a, K))
    Q, _ = np.linalg.qr(draw(k).numpy())
    P = Q @ Q.T
    positive = np.maximum(a, 0)
    return P @ a + alpha * (positive - P @ positive), alpha


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16))
def test_the_plain_random_subspace_is_eq18_with_a_random_projector(seed):
    from openrlhf_geo.salt import salt_advantages

    a, F = _cancelling_batch(seed)
    new, _ = salt_advantages(a, F, study.NULLS["random"], generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    want, alpha = _numpy_random_subspace(a, F, lambda k: torch.randn(len(a), k, generator=g, dtype=torch.float64))
    np.testing.assert_allclose(new.numpy(), want, rtol=1e-9, atol=1e-10)


def test_the_nulls_are_the_means_of_their_draws_and_share_the_subspaces():
    a, F = _cancelling_batch(5)
    got = study.null_subspaces(a, F, seed=11, draws=6)
    g = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(6):
        new, alpha = _numpy_random_subspace(a, F, lambda k: torch.randn(len(a), k, generator=g, dtype=torch.float64))
        an = a.numpy()
        K = F.numpy() @ F.numpy().T / len(an)
        moving = an != 0
        flips = float(np.mean(np.sign(new[moving]) != np.sign(an[moving])))
        norm = np.linalg.norm(an)
        rows.append((np.linalg.norm(new) / norm, flips, _numpy_n_eff(new, K), np.linalg.norm(new - an) / norm))
    assert alpha > 0  # the exploration channel is open: the test sees both terms of Eq. 18
    want = np.mean(rows, axis=0)
    for key, value in zip(("norm_ratio", "sign_flip", "n_eff_salt", "D_a"), want):
        assert got[f"random_{key}"] == pytest.approx(value, rel=1e-6, abs=1e-9)
    # matched-rand-subspace keeps SALT's values (a permutation of a'_SALT): the same norm as SALT's a'
    from openrlhf_geo.salt import salt_advantages

    full, stats = salt_advantages(a, F)
    assert got["matched_norm_ratio"] == pytest.approx(float(full.norm() / a.norm()), rel=1e-9)
    assert got["matched_D_a"] != pytest.approx(stats["D_a"])  # reassigned: not SALT's own coefficients


def test_salt_metrics_sign_flips_and_norm_ratio_are_diagnostics_weight_stats():
    from openrlhf_geo import diagnostics
    from openrlhf_geo.salt import salt_advantages

    a, F = _cancelling_batch(2)
    new, stats, geo = salt_advantages(a, F, return_basis=True)
    got = study.salt_metrics(a, new, stats)
    weights = diagnostics.salt_weight_stats(a, new, geo.gram, geo.basis, geo.is_top, torch.ones(len(a)))
    assert got["sign_flip"] == weights["sign_flip"]
    assert got["norm_ratio"] == pytest.approx(math.sqrt(weights["kept"]), rel=1e-12)
    tied = study.salt_metrics(torch.zeros(4), torch.zeros(4), stats)
    assert math.isnan(tied["sign_flip"]) and math.isnan(tied["norm_ratio"])


def test_the_gap_replicates_take_one_subspace_draw_per_replicate():
    from openrlhf_geo.salt import salt_advantages

    a, F = _cancelling_batch(7)
    ones = np.ones((3, 6), dtype=int)  # no resampling: replicate r is the batch itself with subspace draw r
    gaps = study.subspace_gap_replicates([(a, F, 4)], [ones], [13])
    full = float(salt_advantages(a, F)[0].norm() / a.norm())
    g = torch.Generator().manual_seed(13)
    for r in range(3):
        rand = float(salt_advantages(a, F, "rand-proj", generator=g)[0].norm() / a.norm())
        assert gaps["norm_ratio"][r] == pytest.approx(full - rand, rel=1e-9)
    tied = study.subspace_gap_replicates([(torch.zeros(24, dtype=torch.float64), F, 4)], [ones], [13])
    assert np.isnan(tied["D_a"]).all()  # no batch with signal: no replicate value


def test_the_centred_interval_is_the_percentile_one_moved_by_the_replicates_mean_shift():
    replicates = np.array([0.3, 0.5, np.nan, 0.4, 0.9, 0.2, 0.6])
    plain, centred = study.percentile_ci(0.1, replicates), study.percentile_ci(0.1, replicates, centred=True)
    finite = replicates[np.isfinite(replicates)]
    assert centred["shift"] == pytest.approx(finite.mean() - 0.1, rel=1e-12)
    assert not plain["low"] <= 0.1 <= plain["high"] and centred["low"] <= 0.1 <= centred["high"]
    for bound in ("low", "high"):
        assert centred[bound] == pytest.approx(plain[bound] - centred["shift"], rel=1e-12)
    assert (centred["mean"], centred["n"]) == (plain["mean"], plain["n"]) == (0.1, 6)
    alone = study.percentile_ci(0.1, [0.3, np.nan], centred=True)
    assert all(math.isnan(alone[k]) for k in ("low", "high", "shift")) and alone["n"] == 1


# ---------------------------------------------------------------- item 4: the indicator families


def _family_case(seed, prompts=6, G=4, classes=3, rank=5):
    rng = np.random.default_rng(seed)
    m = prompts * G
    F = rng.standard_normal((m, rank)) @ rng.standard_normal((rank, 30)) + 0.2 * rng.standard_normal((m, 30))
    labels = rng.integers(0, classes, prompts)
    return F @ F.T, labels, G


def _brute_share(K, labels, G, k):
    m = K.shape[0]
    Z = (np.repeat(labels, G)[:, None] == np.unique(labels)[None, :]).astype(float)  # (m, classes) indicators
    Q = _orthonormal(Z)
    _, vecs = np.linalg.eigh(K)
    U = vecs[:, m - k :]
    return float(np.linalg.norm(Q.T @ U) ** 2 / k), float(np.trace(Q.T @ K @ Q) / np.trace(K))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 23))
def test_the_family_share_is_the_projection_of_the_top_eigenvectors_on_the_indicator_span(seed, k):
    K, labels, G = _family_case(seed)
    lam, vecs = np.linalg.eigh(K)
    want_share, want_trace = _brute_share(K, labels, G, k)
    for basis, is_top in ((vecs[:, -k:], True), (vecs[:, :-k], False)):  # U itself, or its complement
        got = study.family_shares(basis, is_top, k, K, labels[None, :], G)
        assert got["share"][0] == pytest.approx(want_share, abs=1e-9)
        assert got["trace_share"][0] == pytest.approx(want_trace, abs=1e-12)
        assert 0 - 1e-12 <= got["share"][0] <= 1 + 1e-12


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 6))
def test_the_share_is_one_when_u_lies_in_the_span(seed, k):
    rng = np.random.default_rng(seed)
    prompts, G = 6, 4
    labels = rng.permutation(np.arange(prompts) % 6)  # 6 classes: dim span 6 >= k
    Z = (np.repeat(labels, G)[:, None] == np.arange(6)[None, :]).astype(float)
    U = _orthonormal(Z) @ _orthonormal(rng.standard_normal((6, k)))  # k orthonormal vectors inside the span
    K = U @ np.diag(np.arange(k, 0, -1.0)) @ U.T
    got = study.family_shares(U, True, k, K, labels[None, :], G)
    assert got["share"][0] == pytest.approx(1.0, abs=1e-12) and got["trace_share"][0] == pytest.approx(1.0)


def test_on_a_random_gram_the_share_is_at_chance():
    rng = np.random.default_rng(0)
    prompts, G, k = 8, 4, 5
    labels = np.arange(prompts) % 2  # dim span 2 of m = 32: chance 1 / 16
    shares = []
    for _ in range(400):
        X = rng.standard_normal((prompts * G, prompts * G))
        _, vecs = np.linalg.eigh(X @ X.T)  # rotation-invariant: U is a uniformly random k-dimensional subspace
        shares.append(study.family_shares(vecs[:, -k:], True, k, X @ X.T, labels[None, :], G)["share"][0])
    se = np.std(shares) / math.sqrt(len(shares))
    assert abs(np.mean(shares) - 2 / 32) < 4 * se


def test_family_records_set_chance_and_permuted_nulls_the_prompts_null_a_random_grouping_of_rollouts():
    K, labels, G = _family_case(3)
    _, vecs = np.linalg.eigh(K)
    U = vecs[:, -4:]
    families = {"prompt": np.arange(6), "name": labels}
    out = study.family_records(U, True, 4, K, families, G, seed=0, permutations=50)
    assert out["prompt_chance"] == 6 / 24 and out["name_chance"] == len(np.unique(labels)) / 24

    def brute(U, row_labels):  # ‖Q_Zᵀ U‖² / k with Q_Z from a QR of the rollouts' indicator matrix (float64)
        Z = (row_labels[:, None] == np.unique(row_labels)[None, :]).astype(np.float64)
        Q, _ = np.linalg.qr(Z)
        return float(((Q.T @ U) ** 2).sum()) / U.shape[1]

    rows = np.repeat(np.arange(6), G)
    rng = np.random.default_rng(0)
    # the prompt family's null (drawn first): the rollouts regrouped at random into groups of G
    prompt_null = [brute(U, rows[np.argsort(rng.permutation(24))]) for _ in range(50)]
    assert out["prompt_share"] == pytest.approx(brute(U, rows))
    assert out["prompt_share_perm_max"] == pytest.approx(max(prompt_null))
    assert out["prompt_share_perm_mean"] == pytest.approx(np.mean(prompt_null))
    assert out["prompt_share_perm_min"] < out["prompt_share_perm_max"]  # not degenerate
    permuted = [study.family_shares(U, True, 4, K, rng.permutation(labels)[None, :], G)["share"][0]
                for _ in range(50)]  # fmt: skip
    assert out["name_share_perm_max"] == pytest.approx(max(permuted))
    assert out["name_share_perm_mean"] == pytest.approx(np.mean(permuted))


def test_the_family_reading():
    verdict = study.family_verdict
    assert verdict([0.5, 0.6], [0.4, 0.5], [0.1, 0.1]) == "set by the family"
    assert verdict([0.5, 0.6], [0.4, 0.7], [0.1, 0.1]).startswith("not set by the family (1 of 2")
    assert verdict([0.5, 0.6], [0.5, 0.6], [0.1, 0.1]).startswith("not set")  # equal to the max is not above it
    assert verdict([0.5, 0.6], [0.5, 0.6], [0.5, 0.6]).startswith("no permutation null")
    assert verdict([0.5, math.nan], [0.4, 0.4], [0.1, 0.1]).startswith("no reading")


def test_problem_labels_recover_each_problems_name_and_item():
    for q, _ in word_task.word_problems(64, 20261201):
        i, j = study.problem_labels(q)
        assert word_task.NAMES[i] in q and f" {word_task.ITEMS[j]}." in q
    with pytest.raises(ValueError, match="not a word_task problem"):
        study.problem_labels("Tom has 3 dragons. Tom gets 2 more dragons. How many dragons does Tom have now?")


# ---------------------------------------------------------------- the analysis end to end (synthetic collection)


def _synthetic(T, prompts=4, samples=8, caps=(16, 32), seed=0):
    rng = np.random.default_rng(seed)
    n = prompts * samples
    geometry, rewards = {}, {}
    lengths = torch.as_tensor(rng.integers(5, 40, n))
    for cap in caps:
        F = rng.standard_normal((n, 4)) @ rng.standard_normal((4, 50)) + 0.3 * rng.standard_normal((n, 50))
        geometry[cap] = {"gram": torch.as_tensor(F @ F.T), "lengths": lengths.clamp(max=cap)}
        rewards[cap] = torch.as_tensor((rng.uniform(size=n) < 0.4).astype(np.float32))
    return {"collection": {"temperature": T, "prompts": prompts, "samples": samples},
            "questions": [q for q, _ in word_task.word_problems(prompts, 20261201)], "geometry": geometry,
            "rewards": rewards, "response_ids": [[5] * int(x) + [2] for x in lengths], "eos": 2}  # fmt: skip


def test_the_summary_and_report_carry_the_amendment_beside_the_first_analysis():
    setup = study.QUICK
    records, resampled = [], {}
    for T in (0.6, 1.0):
        data = _synthetic(T, seed=int(10 * T))
        records += study.analyse(data, setup)
        resampled.update(study.resample(data, setup, count=200, gap_count=20))
    summary = study.summarize(records, {**setup, "model": "m", "prompts": 4, "samples": 8, "generator": "hf",
                                        "seed": 0, "features": "f", "replicates": 2, "wall_s": 1.0,
                                        "estimate_s": 1.0, "seconds": {}, "temperatures": [0.6, 1.0],
                                        "amendment": {"seed": study.AMENDMENT_SEED, "prompt_replicates": 200,
                                                      "gap_replicates": 20, "null_draws": study.NULL_DRAWS,
                                                      "permutations": study.PERMUTATIONS}},
                              study.prompt_cis(records, setup, resampled))  # fmt: skip
    row = summary["table"]["T=0.6 cap=32 G=4"]
    assert row["regime"] == study.regime(row["n_eff_prompts"])
    assert row["regime_first_analysis"] == study.regime(row["n_eff"])
    assert row["n_eff_prompts"]["mean"] == pytest.approx(row["n_eff"]["mean"], rel=1e-6)
    assert set(row["gap_vs_random"]) == set(study.NULL_METRICS) and "gap_vs_random" not in summary["table"][
        "T=0.6 cap=16 G=4"]  # fmt: skip
    assert set(row["gap_vs_random_centred"]) == set(study.NULL_METRICS)
    for metric, ci in row["gap_vs_random_centred"].items():
        assert ci["mean"] == row["gap_vs_random"][metric]["mean"]
        assert ci["low"] == pytest.approx(row["gap_vs_random"][metric]["low"] - ci["shift"], rel=1e-12, abs=1e-15)
    assert set(summary["families"]) == {"T=0.6 G=4", "T=0.6 G=8", "T=1.0 G=4", "T=1.0 G=8"}
    # the prompt family's null regroups the rollouts, so it has a reading like the others
    assert not summary["families"]["T=0.6 G=4"]["prompt"]["verdict"].startswith("no permutation null")
    batch = next(r for r in records if r["cap"] == 32 and r["signal"])
    assert {"random_D_a", "matched_D_a", "name_share", "name_share_perm_max", "item_chance"} <= set(batch)
    report = study.render(summary)
    for text in ("first analysis (batch percentile)", "CI over prompts", "matched-rand-subspace", "set by the family",
                 "| 0.6 | 32 | 4 |", "The same replicates recentred on the point"):  # fmt: skip
        assert text in report


def test_the_n_eff_null_permutes_the_advantages_within_each_group():
    """Amendment item 6 against a brute-force float64 loop: each draw permutes every group's values in place."""
    rng = np.random.default_rng(3)
    G, B = 4, 5
    F = rng.normal(size=(G * B, 9))
    K = F @ F.T
    a = rng.normal(size=G * B)
    out = study.n_eff_permutation_null(a, K, G, seed=11, draws=30)
    draws = np.random.default_rng(11).random((30, B, G))
    values = []
    for d in range(30):
        perm = np.concatenate([g * G + np.argsort(draws[d, g]) for g in range(B)])
        x = a[perm]
        assert sorted(x[:G]) == sorted(a[:G])  # a group's values stay in the group
        values.append(sum(x[i] * x[j] * K[i, j] for i in range(G * B) for j in range(G * B)) / sum(x**2 * np.diag(K)))
    assert out["n_eff_perm_mean"] == pytest.approx(np.mean(values))
    lo, hi = np.percentile(values, (2.5, 97.5))
    assert (out["n_eff_perm_lo"], out["n_eff_perm_hi"]) == (pytest.approx(lo), pytest.approx(hi))
    n_eff = float(a @ K @ a / (a**2 * np.diag(K)).sum())
    assert out["n_eff_vs_perm"] == (-1.0 if n_eff < lo else 1.0 if n_eff > hi else 0.0)


# ---------------------------------------------------------------- the committed results and the protocol's text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "studies" / "results" / "real-lm-geometry"


def _verdict_counts(results):
    """(batch percentile, registered CI, corrected CI): each (in, outside, not decided) over the 24 conditions, by
    the study's own interval and rule from the result directory's records.json and summary.json."""
    records = nan_json(json.loads((results / "records.json").read_text()))
    summary = nan_json(json.loads((results / "summary.json").read_text()))
    conditions = {}
    for rec in records:
        conditions.setdefault((rec["T"], rec["cap"], rec["G"]), []).append(rec)

    def counts(verdicts):
        verdicts = list(verdicts)
        return tuple(sum(v.startswith(word) for v in verdicts) for word in ("in SALT", "outside", "not decided"))

    return (counts(study.regime(study.interval([r["n_eff"] for r in rows])) for rows in conditions.values()),
            counts(study.regime(row["n_eff_prompts"]) for row in summary["table"].values()),
            counts(study.regime(row["n_eff_prompts_apart"]) for row in summary["table"].values()))  # fmt: skip


def test_the_protocols_verdict_counts_are_the_committed_analysis_recomputed():
    """The verdict counts the protocol states for the 2026-12-05 rerun and for the replication on committed rollouts
    are those its committed records.json and summary.json give by the study's own intervals and rules."""
    text = " ".join((ROOT / "docs" / "studies" / "real-lm-geometry.md").read_text().split())
    batches, registered, apart = _verdict_counts(RESULTS / "rerun-2026-12-05")
    assert (batches, registered, apart) == ((0, 18, 6), (0, 18, 6), (0, 16, 8))
    assert f"**Outside: {apart[1]} of 24 by the corrected prompt CI (post hoc), not decided {apart[2]}**" in text
    assert f"The registered CI reads {registered[1]} outside / {registered[2]} not decided" in text
    assert f"the batch percentile {batches[1]} / {batches[2]} as well" in text
    batches, registered, apart = _verdict_counts(RESULTS)
    assert (batches, registered, apart) == ((1, 20, 3), (0, 19, 5), (1, 12, 11))
    assert f"**In SALT's regime: {apart[0]} of 24**" in text
    assert f"**Outside: {apart[1]}** (2026-12-05: 16). **Not decided: {apart[2]}** (8)." in text
    stated = "The registered (biased) CI reads {} in / {} outside / {} not decided, the batch percentile {} / {} / {}"
    assert stated.format(*registered, *batches) in text
