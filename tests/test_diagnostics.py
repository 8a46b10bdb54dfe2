"""SALT diagnostics (Eq. 4-7, 38-53, 58-61, App. B) against brute-force numpy float64 on explicit vectors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import rankdata

from openrlhf_geo import diagnostics as dg


@st.composite
def vectors(draw, min_m=1, max_m=16, max_d=24):
    """(coeffs (m,), features (m, D)) as float64 numpy: Gaussian, low-rank, duplicated or zero rows, wide scales."""
    m = draw(st.integers(min_m, max_m))
    D = draw(st.integers(1, max_d))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["gaussian", "low-rank", "duplicates", "zero-rows", "shared"]))
    F = rng.standard_normal((m, D)) * 10.0 ** rng.uniform(-2, 2, (m, 1))
    if kind == "low-rank":
        F = rng.standard_normal((m, min(2, D))) @ rng.standard_normal((min(2, D), D))
    elif kind == "duplicates":
        F = F[rng.integers(0, max(1, m // 2), m)]
    elif kind == "zero-rows":
        F[rng.random(m) < 0.3] = 0.0
    elif kind == "shared":  # a common direction: positive and negative cosines both occur
        F = 0.5 * F / np.linalg.norm(F, axis=1, keepdims=True).clip(1e-300) + rng.standard_normal(D)
    c = rng.standard_normal(m) * (rng.random(m) < 0.8)
    return c, F


def brute_gram(F):
    return F @ F.T / F.shape[0]


def top_basis(K, k):
    return np.linalg.eigh(K)[1][:, ::-1][:, :k].copy()


def brute_positive_alignment(F):
    rows = [f for f in F if np.linalg.norm(f) > 0]
    n = len(rows)
    pairs = [
        max(rows[i] @ rows[j] / np.linalg.norm(rows[i]) / np.linalg.norm(rows[j]), 0.0)
        for i in range(n)
        for j in range(i + 1, n)
    ]
    return 2 / (n * (n - 1)) * sum(pairs) if pairs else 0.0  # Eq. 7 over the nonzero rows


def brute_n_eff(u):
    """Eq. 6/49 on explicit update vectors u (n, D) (0/0 := 0)."""
    den = sum(x @ x for x in u)
    total = u.sum(0)
    return total @ total / den if den > 0 else 0.0


# ---- Gram, PR, n_eff ----


def test_gram_is_feature_inner_products_over_m():
    F = np.random.default_rng(0).standard_normal((5, 7))
    K = dg.gram(torch.tensor(F, dtype=torch.float32))
    expected = np.array([[F[i] @ F[j] / 5 for j in range(5)] for i in range(5)])
    assert K.dtype == torch.float64
    torch.testing.assert_close(K, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert torch.equal(K, K.T)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e20, 1e30])
def test_gram_of_tiny_or_huge_float32_features_neither_underflows_nor_overflows(scale):
    F = np.random.default_rng(1).standard_normal((6, 9))
    F32 = torch.tensor(F * scale, dtype=torch.float32)
    K = dg.gram(F32)
    expected = brute_gram(F32.double().numpy())
    assert torch.isfinite(K).all() and float(K.diagonal().min()) > 0
    torch.testing.assert_close(K, torch.tensor(expected), rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_gram_beyond_float64_raises_naming_the_features():
    with pytest.raises(ValueError, match="features: the Gram F Fᵀ/m overflows float64"):
        dg.gram(torch.full((2, 3), 1e200, dtype=torch.float64))


@settings(max_examples=40)
@given(st.floats(1e-300, 1e300))
def test_unit_scale_is_a_power_of_two_just_below_the_peak(peak):
    s = dg.unit_scale(torch.tensor([0.0, -peak, peak / 3], dtype=torch.float64))
    assert math.frexp(s)[0] == 0.5  # a power of two
    assert s <= peak < 2 * s
    assert dg.unit_scale(torch.zeros(3)) == 1.0


@settings(max_examples=40)
@given(vectors(), st.sampled_from([1e-150, 1.0, 1e150]))
def test_participation_ratio_is_eigenvalue_ratio_within_one_and_rank(data, scale):
    _, F = data
    K = brute_gram(F)
    pr = dg.participation_ratio(torch.tensor(K) * scale)
    lam = np.clip(np.linalg.eigvalsh(K), 0, None)  # Eq. 43 clamps
    if lam.sum() == 0:
        assert pr == 0.0
        return
    assert pr == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-9)
    assert 1 - 1e-9 <= pr <= np.linalg.matrix_rank(F) + 1e-9


@settings(max_examples=40)
@given(vectors())
def test_effective_sample_size_gram_form_equals_explicit_vector_form(data):
    c, F = data
    brute = brute_n_eff(c[:, None] * F)  # Eq. 6 with u_i = c_i g_i
    by_vectors = dg.effective_sample_size_vectors(torch.tensor(c), torch.tensor(F))
    by_gram = dg.effective_sample_size(torch.tensor(c), dg.gram(torch.tensor(F)), eps=0.0)
    assert by_vectors == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert by_gram == pytest.approx(brute, rel=1e-9, abs=1e-9)


def test_effective_sample_size_is_one_for_orthogonal_and_zero_for_cancelling_gradients():
    c = torch.tensor([1.0, -2.0, 0.5])
    assert dg.effective_sample_size_vectors(c, torch.eye(3)) == pytest.approx(1.0)
    same = torch.ones(3, 4)
    assert dg.effective_sample_size_vectors(torch.tensor([1.0, -1.5, 0.5]), same) == pytest.approx(0.0, abs=1e-15)
    assert dg.effective_sample_size(torch.tensor([1.0, -1.5, 0.5]), dg.gram(same), eps=0.0) == 0.0


def test_effective_sample_size_epsilon_is_eq_60s():
    K = dg.gram(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    c = torch.zeros(4)
    assert dg.effective_sample_size(c, K) == 0.0  # 0 / (0 + ε)
    assert dg.effective_sample_size(c, K, eps=0.0) == 0.0  # 0/0 := 0
    num = float(K.sum())  # 1ᵀK1
    assert dg.effective_sample_size(torch.ones(4), K, eps=0.5) == pytest.approx(num / (float(K.trace()) + 0.5))


# ---- Eq. 7 ----


@settings(max_examples=40)
@given(vectors())
def test_positive_alignment_is_the_mean_positive_cosine_over_pairs(data):
    _, F = data
    expected = brute_positive_alignment(F)
    assert dg.positive_alignment(torch.tensor(F)) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_positive_alignment_counts_opposed_gradients_as_zero():
    g = torch.tensor([[1.0, 2.0, -1.0]])
    assert dg.positive_alignment(g.repeat(5, 1)) == pytest.approx(1.0)
    assert dg.positive_alignment(torch.cat([g, -g])) == 0.0  # [cos]₊ = [−1]₊
    assert dg.positive_alignment(torch.cat([g, g, -g])) == pytest.approx(1 / 3)  # pairs: +1, 0, 0
    assert dg.positive_alignment(torch.cat([g, torch.zeros(3, 3)])) == 0.0  # one nonzero row: no pair


# ---- Eq. 58-61 ----


@settings(max_examples=40)
@given(vectors(min_m=2), st.integers(0, 1000), st.sampled_from([0.0, 1e-8, 0.3]))
def test_update_diagnostics_match_explicit_update_vectors(data, seed, eps):
    c, F = data
    m = len(c)
    rng = np.random.default_rng(seed)
    new = c + rng.standard_normal(m) * rng.random()
    K = brute_gram(F)
    t = torch.tensor

    def g_hat(x):
        return F.T @ x / m  # Eq. 58

    if np.linalg.norm(c) + eps > 0:
        expected = np.linalg.norm(new - c) / (np.linalg.norm(c) + eps)
        assert dg.coefficient_change(t(c), t(new), eps) == pytest.approx(expected)
    norm_old = np.linalg.norm(g_hat(c))
    if norm_old + eps > 1e-6 * np.linalg.norm(F) * np.linalg.norm(c) / m:
        expected = np.linalg.norm(g_hat(new) - g_hat(c)) / (norm_old + eps)
        assert dg.update_change(t(c), t(new), t(K), eps) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    k = int(rng.integers(0, m + 1))
    lam = np.linalg.eigvalsh(K)[::-1]
    if k in (0, m) or lam[k - 1] - lam[k] > 1e-6 * max(lam[0], 1e-300):  # P_k unique
        B = top_basis(K, k)
        residual = (np.eye(m) - B @ B.T) @ new
        expected = np.linalg.norm(F.T @ residual / m)  # Eq. 61: ‖(1/m) S P⊥ c‖
        got = dg.residual_strength(t(new), t(K), t(B))
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9 * np.linalg.norm(F) * np.linalg.norm(new))
        # the same P_k given by its complement
        complement = np.linalg.eigh(K)[1][:, : m - k]
        assert dg.residual_strength(t(new), t(K), t(complement), is_top=False) == pytest.approx(
            got, rel=1e-6, abs=1e-9 * np.linalg.norm(F) * np.linalg.norm(new)
        )


def test_update_diagnostics_define_zero_over_zero():
    K = torch.ones(2, 2)
    zero = torch.zeros(2)
    assert dg.coefficient_change(zero, zero, eps=0.0) == 0.0
    assert dg.coefficient_change(zero, torch.ones(2), eps=0.0) == math.inf
    assert dg.coefficient_change(zero, torch.ones(2)) == pytest.approx(math.sqrt(2) / 1e-8)
    in_null_space = torch.tensor([1.0, -1.0])  # aᵀKa = 0: the old update is zero
    assert dg.update_change(in_null_space, in_null_space, K, eps=0.0) == 0.0
    assert dg.update_change(in_null_space, torch.tensor([1.0, 0.0]), K, eps=0.0) == math.inf
    assert dg.residual_strength(in_null_space, K, torch.zeros(2, 0)) == 0.0
    assert dg.residual_strength(torch.tensor([1.0, 0.0]), K, torch.zeros(2, 0)) == pytest.approx(math.sqrt(1 / 2))


# ---- App. D.1 and App. B per group ----


def ratio(num, den):
    return num / den if den > 0 else 0.0  # 0/0 := 0


def brute_group_geometry(c, F, groups, eps):
    """Eq. 38-53 and App. B on explicit vectors: u_i = Â_i g_i, ū_b, s̄_q, δ_q,i."""
    m = len(c)
    labels = np.unique(groups)
    per = {k: [] for k in ("r_in", "pr_in", "e_tot", "e_sh", "e_delta", "rho", "g", "b")}
    n_eff_in = []  # Eq. 50 of the groups with some u_i ≠ 0 (Eq. 51 leaves the 0/0 of the others out)
    means = []
    for label in labels:
        idx = np.flatnonzero(groups == label)
        S, A, G = F[idx], c[idx], len(idx)
        per["r_in"].append(brute_positive_alignment(S))
        lam = np.clip(np.linalg.eigvalsh(S @ S.T / G), 0, None)  # Eq. 45: K_in = G_bᵀG_b / G
        per["pr_in"].append(lam.sum() ** 2 / (lam**2).sum() if lam.sum() > 0 else 0.0)
        u = A[:, None] * S
        total = u.sum(0)
        if sum(x @ x for x in u) > 0:
            n_eff_in.append(total @ total / m / (sum(x @ x for x in u) / m + eps))  # Eq. 60 units of K
        means.append(total / G)  # Eq. 52
        s_bar = S.mean(0)
        e_tot = sum(s @ s for s in S)
        e_sh = G * s_bar @ s_bar
        e_delta = sum((s - s_bar) @ (s - s_bar) for s in S)
        per["e_tot"].append(e_tot)
        per["e_sh"].append(e_sh)
        per["e_delta"].append(e_delta)
        per["rho"].append(ratio(e_delta, e_tot))
        per["g"].append(np.linalg.norm(total / G))
        per["b"].append(np.sqrt(e_delta / G))
    means = np.array(means)
    total = means.sum(0)
    den = sum(x @ x for x in means) / m
    keys = {"rho": "rho_delta", "g": "g_norm", "b": "b_delta"}
    out = {keys.get(k, k): float(np.mean(v)) for k, v in per.items()}
    lam = np.clip(np.linalg.eigvalsh(brute_gram(F)), 0, None)
    out.update(
        groups=len(labels),
        n_eff_group=float(np.mean(n_eff_in)) if n_eff_in else math.nan,
        n_eff_group_left_out=len(labels) - len(n_eff_in),
        r_total=brute_positive_alignment(F),
        pr_total=lam.sum() ** 2 / (lam**2).sum() if lam.sum() > 0 else 0.0,
        n_eff_means=ratio(total @ total / m, den + eps),
    )
    return out


@settings(max_examples=40)
@given(vectors(min_m=2), st.integers(1, 4), st.integers(0, 1000), st.sampled_from([0.0, 1e-8]), st.booleans())
def test_group_geometry_matches_explicit_vectors(data, n_groups, seed, eps, pass_gram):
    c, F = data
    groups = np.random.default_rng(seed).integers(0, n_groups, len(c)) * 7 - 3  # arbitrary integer labels
    x = dg.gram(torch.tensor(F)) if pass_gram else torch.tensor(F)
    got = dg.group_geometry(torch.tensor(c), x, torch.tensor(groups), eps, is_gram=pass_gram)
    expected = brute_group_geometry(c, F, groups, eps)
    assert got.keys() == expected.keys()
    scale = np.abs(F).max() ** 2 * (1 + np.abs(c).max()) ** 2 * len(c)
    for key, value in expected.items():
        tol = 1e-9 * math.sqrt(scale) if key in ("g_norm", "b_delta") else 1e-9 * scale
        if key.startswith("n_eff"):  # a rounding-level numerator is a zero update (_energy); ε-scale denominators
            tol = 1e-6
        assert got[key] == pytest.approx(value, rel=1e-6, abs=tol, nan_ok=True), key


def test_group_geometry_realized_norm_obeys_the_residual_bound_of_eq_11():
    """‖g_q‖ ≤ (1/G) ‖Â_q‖ √E_δ(q) when Σ_i Â_q,i = 0 (Eq. 10-11), and E_tot = E_sh + E_δ."""
    rng = np.random.default_rng(0)
    F = rng.standard_normal((6, 5)) + rng.standard_normal(5)
    a = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    stats = dg.group_geometry(torch.tensor(a), torch.tensor(F), torch.zeros(6, dtype=torch.long))
    assert stats["e_tot"] == pytest.approx(stats["e_sh"] + stats["e_delta"])
    assert stats["g_norm"] <= np.linalg.norm(a) / 6 * math.sqrt(stats["e_delta"]) + 1e-12


def test_group_geometry_of_identical_rollouts_has_no_residual():
    F = torch.tensor([[1.0, 2.0]] * 4 + [[0.0, 3.0]] * 4)
    a = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    stats = dg.group_geometry(a, F, torch.tensor([0] * 4 + [1] * 4))
    assert stats["e_delta"] == stats["rho_delta"] == stats["b_delta"] == stats["g_norm"] == 0.0
    assert (stats["r_in"], stats["pr_in"], stats["groups"]) == (pytest.approx(1.0), pytest.approx(1.0), 2.0)
    assert stats["n_eff_group"] == stats["n_eff_means"] == 0.0


def brute_n_eff_in_mean(c, F, groups):
    """Eq. 49-51 on explicit u_i = Â_i g_i: the mean of Eq. 49 over the groups with some u_i ≠ 0, and how many have
    none (NaN mean when none has)."""
    values, left_out = [], 0
    for label in np.unique(groups):
        u = c[groups == label, None] * F[groups == label]
        if not (u != 0).any():
            left_out += 1
            continue
        values.append(brute_n_eff(u))
    return (float(np.mean(values)) if values else math.nan), left_out


def test_n_eff_group_leaves_out_tied_groups():
    """A tied group (Â = 0: every u_i = 0) makes Eq. 49 0/0; it has no terms to cancel and is not averaged as 0."""
    rng = np.random.default_rng(7)
    F = rng.standard_normal((12, 5)) + rng.standard_normal(5)  # a shared direction: some cancellation
    c = np.array([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.5, -0.5, -1.5])
    groups = np.repeat([0, 1, 2], 4)
    expected, left_out = brute_n_eff_in_mean(c, F, groups)
    assert left_out == 1
    got = dg.group_geometry(torch.tensor(c), torch.tensor(F), torch.tensor(groups), eps=0.0)
    assert got["n_eff_group"] == pytest.approx(expected, rel=1e-12)
    assert got["n_eff_group_left_out"] == 1.0
    tied = dg.group_geometry(torch.zeros(12), torch.tensor(F), torch.tensor(groups))
    assert math.isnan(tied["n_eff_group"]) and tied["n_eff_group_left_out"] == 3.0  # the mean of no group


@settings(max_examples=40)
@given(vectors(min_m=2), st.integers(1, 4), st.integers(0, 1000), st.integers(1, 6))
def test_adding_a_tied_group_never_changes_n_eff_group(data, n_groups, seed, size):
    c, F = data
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, n_groups, len(c))
    F_tied = rng.standard_normal((size, F.shape[1])) * 10.0 ** rng.uniform(-2, 2)
    before = dg.group_geometry(torch.tensor(c), torch.tensor(F), torch.tensor(groups), eps=0.0)
    after = dg.group_geometry(
        torch.tensor(np.concatenate([c, np.zeros(size)])),
        torch.tensor(np.concatenate([F, F_tied])),
        torch.tensor(np.concatenate([groups, np.full(size, n_groups)])),
        eps=0.0,
    )
    assert after["n_eff_group"] == pytest.approx(before["n_eff_group"], rel=1e-9, abs=1e-6, nan_ok=True)
    assert after["n_eff_group_left_out"] == before["n_eff_group_left_out"] + 1


# ---- weight statistics ----


def brute_weight_stats(a, new, K, k, lengths):
    """numpy float64 reading of salt_weight_stats: eigenvectors, ranks and shares computed directly."""
    top_vecs = top_basis(K, k)
    diag_p = np.array([sum(top_vecs[i, j] ** 2 for j in range(k)) for i in range(len(a))])

    def spearman(x, y):
        return np.corrcoef(rankdata(x), rankdata(y))[0, 1]

    order = sorted(range(len(a)), key=lambda i: -K[i, i])[:k]
    moving = [i for i in range(len(a)) if a[i] != 0]
    return {
        "pk_rho_norm": spearman(diag_p, np.diag(K)),
        "pk_rho_inv_len": spearman(diag_p, 1 / lengths),
        "topnorm_share": sum(new[i] ** 2 for i in order) / sum(x**2 for x in new),
        "kept": sum(x**2 for x in new) / sum(x**2 for x in a),
        "sign_flip": sum(np.sign(new[i]) != np.sign(a[i]) for i in moving) / len(moving),
    }


@settings(max_examples=60)
@given(st.integers(3, 12), st.integers(0, 2**31 - 1), st.data())
def test_salt_weight_stats_match_a_numpy_reading(m, seed, data):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((m, 2 * m)) * rng.uniform(0.2, 3.0, size=(m, 1))  # distinct norms
    K = features @ features.T / m
    a = rng.standard_normal(m)
    a[rng.random(m) < 0.2] = 0.0
    a[0] = 1.0  # at least one nonzero advantage
    new = a + rng.standard_normal(m)
    k = data.draw(st.integers(1, m - 1))
    lengths = rng.integers(1, 40, size=m).astype(float)
    expected = brute_weight_stats(a, new, K, k, lengths)
    t = torch.tensor
    top = dg.salt_weight_stats(t(a), t(new), t(K), t(top_basis(K, k)), True, t(lengths))
    complement = np.linalg.eigh(K)[1][:, : m - k]
    bottom = dg.salt_weight_stats(t(a), t(new), t(K), t(complement), False, t(lengths))
    for got in (top, bottom):
        for key, value in expected.items():
            if key == "pk_rho_inv_len" and np.ptp(lengths) == 0:
                assert math.isnan(got[key])
            else:
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_diagonal_gram_puts_all_of_p_k_a_on_the_largest_norm_rollouts():
    """Near-orthogonal features (diagonal K): the top-k eigenvectors are the k largest-norm coordinates, so P_k a is a
    restricted to those rollouts; diag(P_k) ranks with the norms."""
    norms = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0], dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5], dtype=torch.float64)
    top = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # the 3 largest norms
    basis = torch.eye(5, dtype=torch.float64)[:, [0, 2, 4]]
    stats = dg.salt_weight_stats(a, top * a, torch.diag(norms), basis, True, torch.tensor([4, 20, 8, 16, 12]))
    assert stats["topnorm_share"] == pytest.approx(1.0)
    assert stats["kept"] == pytest.approx((1 + 0.25 + 0.25) / (1 + 1 + 0.25 + 4 + 0.25))
    assert stats["sign_flip"] == pytest.approx(2 / 5)  # the two dropped advantages become 0
    # diag(P_k) = [1, 0, 1, 0, 1]: ranks [4, 1.5, 4, 1.5, 4] against the norms' [5, 1, 4, 2, 3] (and 1/T's, the same)
    assert stats["pk_rho_norm"] == pytest.approx(7.5 / math.sqrt(7.5 * 10))
    assert stats["pk_rho_inv_len"] == pytest.approx(7.5 / math.sqrt(7.5 * 10))


def test_a_repeated_rollouts_copies_are_ties_in_the_rank_statistics_whatever_the_rounding():
    """A replaced slot repeats its source rollout: diag(P_k) and ‖φ_i‖² of the copies are equal but for rounding,
    which must not order them (the fork's ranks and the local engine round differently): ranks of ties averaged."""
    rng = np.random.default_rng(4)
    features = rng.standard_normal((6, 12))
    features = features[[0, 1, 1, 2, 3, 3, 3, 4, 5]]  # rollouts 1 and 3 fill 2 and 3 slots
    K = features @ features.T / 9
    basis = np.linalg.eigh(K)[1][:, -3:]
    a, lengths = rng.standard_normal(9), rng.integers(1, 40, size=9).astype(float)
    t = torch.tensor
    exact = dg.salt_weight_stats(t(a), t(a), t(K), t(basis), True, t(lengths))
    diag_p = (basis**2).sum(1)
    expected = np.corrcoef(rankdata(np.round(diag_p, 9)), rankdata(np.round(np.diag(K), 9)))[0, 1]
    assert exact["pk_rho_norm"] == pytest.approx(expected, rel=1e-12)
    for sign in (1, -1):  # copies apart by rounding, either way round
        noise = sign * 1e-15 * np.arange(9)
        rounded = dg.salt_weight_stats(t(a), t(a), t(K + np.diag(noise)), t(basis + noise[:, None]), True, t(lengths))
        for key in ("pk_rho_norm", "pk_rho_inv_len"):
            assert rounded[key] == exact[key], key


def test_salt_weight_stats_without_geometry_are_nan_or_zero():
    a = torch.tensor([1.0, -1.0, 0.0])
    stats = dg.salt_weight_stats(a, a, torch.zeros(3, 3), torch.zeros(3, 0), True, torch.ones(3))  # k = 0
    assert math.isnan(stats["pk_rho_norm"]) and stats["topnorm_share"] == 0.0 and stats["kept"] == 1.0


# ---- bad input ----


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: dg.participation_ratio(torch.tensor([[1.0, float("nan")], [0.0, 1.0]])), "gram"),
        (lambda: dg.effective_sample_size(torch.tensor([float("inf"), 1.0]), torch.eye(2)), "coeffs"),
        (lambda: dg.effective_sample_size(torch.ones(3), torch.eye(2)), "gram"),
        (lambda: dg.effective_sample_size_vectors(torch.ones(3), torch.ones(2, 4)), "vectors"),
        (lambda: dg.gram(torch.ones(3)), "features"),
        (lambda: dg.positive_alignment(torch.zeros(0, 3)), "features"),
        (lambda: dg.group_geometry(torch.ones(2), torch.eye(2), torch.tensor([0.5, 1.0])), "group_ids"),
        (lambda: dg.group_geometry(torch.ones(8), torch.eye(8), ["a"] * 8, is_gram=True), "group_ids"),
        (lambda: dg.group_geometry(torch.ones(2), torch.ones(3, 4), [[0], [1]]), "group_ids"),
        (lambda: dg.group_geometry(torch.ones(2), torch.ones(3, 4), torch.tensor([0, 1])), "features"),
        (lambda: dg.group_geometry(torch.ones(2), torch.eye(3), torch.tensor([0, 1]), is_gram=True), "gram"),
        (lambda: dg.residual_strength(torch.ones(2), torch.eye(2), torch.ones(3, 1)), "basis"),
        (lambda: dg.update_change(torch.ones(2), torch.ones(3), torch.eye(2)), "new"),
        (lambda: dg.update_change(torch.ones(2), torch.ones(2), torch.eye(2), eps=-1.0), "eps"),
        (lambda: dg.coefficient_change(torch.ones(2), torch.ones(2), eps=float("nan")), "eps"),
        (lambda: dg.effective_sample_size(torch.ones(2), torch.eye(2), eps=-1.0), "eps"),
        (lambda: dg.salt_weight_stats(torch.ones(2), torch.ones(2), torch.eye(2), torch.eye(2), True, torch.ones(3)),
         "lengths"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_finite_inputs_whose_sum_overflows_are_not_mistaken_for_inf():
    # the fast finiteness check (one sum) overflows here; the exact check must accept the input
    huge = torch.tensor([1e308, 1e308], dtype=torch.float64)
    assert dg.coefficient_change(huge, huge) == 0.0
