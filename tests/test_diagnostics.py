"""SALT diagnostics (Eq. 5, 6/49, 7, 12, 39-53, 59-61, 60, App. B) against brute-force numpy float64."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import diagnostics as dg


@st.composite
def vectors(draw, min_m=1, max_m=16, max_d=24):
    """(coeffs (m,), features (m, D)) as float64 numpy: Gaussian, low-rank, duplicated or zero rows, wide scales."""
    m = draw(st.integers(min_m, max_m))
    D = draw(st.integers(1, max_d))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["gaussian", "low-rank", "duplicates", "zero-rows"]))
    F = rng.standard_normal((m, D)) * 10.0 ** rng.uniform(-2, 2, (m, 1))
    if kind == "low-rank":
        F = rng.standard_normal((m, min(2, D))) @ rng.standard_normal((min(2, D), D))
    elif kind == "duplicates":
        F = F[rng.integers(0, max(1, m // 2), m)]
    elif kind == "zero-rows":
        F[rng.random(m) < 0.3] = 0.0
    c = rng.standard_normal(m) * (rng.random(m) < 0.8)
    return c, F


def brute_gram(F):
    return F @ F.T / F.shape[0]


def brute_top_projector(K, k):
    lam, Q = np.linalg.eigh(K)
    Q = Q[:, ::-1][:, :k]
    return Q @ Q.T


def test_gram_is_feature_inner_products_over_m():
    F = np.random.default_rng(0).standard_normal((5, 7))
    K = dg.gram(torch.tensor(F, dtype=torch.float32))
    expected = np.array([[F[i] @ F[j] / 5 for j in range(5)] for i in range(5)])
    assert K.dtype == torch.float64
    torch.testing.assert_close(K, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert torch.equal(K, K.T)


@settings(max_examples=40)
@given(vectors())
def test_participation_ratio_is_eigenvalue_ratio_within_one_and_rank(data):
    _, F = data
    K = brute_gram(F)
    pr = dg.participation_ratio(torch.tensor(K))
    lam = np.clip(np.linalg.eigvalsh(K), 0, None)
    if lam.sum() == 0:
        assert pr == 0.0
        return
    assert pr == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-9)
    rank = np.linalg.matrix_rank(F)
    assert 1 - 1e-9 <= pr <= rank + 1e-9


@settings(max_examples=40)
@given(vectors())
def test_effective_sample_size_gram_form_equals_explicit_vector_form(data):
    c, F = data
    update = sum(c[i] * F[i] for i in range(len(c)))  # explicit Σ_i c_i g_i
    den = sum(c[i] ** 2 * F[i] @ F[i] for i in range(len(c)))
    brute = update @ update / den if den > 0 else 0.0
    by_vectors = dg.effective_sample_size_vectors(torch.tensor(c), torch.tensor(F))
    by_gram = dg.effective_sample_size(torch.tensor(c), dg.gram(torch.tensor(F)), eps=0.0)
    assert by_vectors == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert by_gram == pytest.approx(brute, rel=1e-9, abs=1e-12)


def test_effective_sample_size_is_one_for_orthogonal_and_zero_for_cancelling_gradients():
    c = torch.tensor([1.0, -2.0, 0.5])
    assert dg.effective_sample_size_vectors(c, torch.eye(3)) == pytest.approx(1.0)
    same = torch.ones(3, 4)
    assert dg.effective_sample_size_vectors(torch.tensor([1.0, -1.5, 0.5]), same) == pytest.approx(0.0, abs=1e-15)


def test_effective_sample_size_epsilon_guards_zero_coefficients():
    K = dg.gram(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    c = torch.zeros(4)
    assert dg.effective_sample_size(c, K) == 0.0  # 0 / (0 + ε)
    assert dg.effective_sample_size(c, K, eps=0.0) == 0.0  # 0/0 := 0
    num = float(K.sum())  # 1ᵀK1
    assert dg.effective_sample_size(torch.ones(4), K, eps=0.5) == pytest.approx(num / (float(K.trace()) + 0.5))


@settings(max_examples=30)
@given(vectors(min_m=2), st.integers(1, 4), st.integers(0, 1000))
def test_within_group_split_matches_group_blocks_and_adds_up_to_batch(data, n_groups, seed):
    c, F = data
    m = len(c)
    groups = np.random.default_rng(seed).integers(0, n_groups, m) * 7  # arbitrary integer labels
    K = brute_gram(F)
    eps = 1e-8
    per_group, stats = dg.effective_sample_size_within(torch.tensor(c), torch.tensor(K), torch.tensor(groups), eps)
    labels = np.unique(groups)
    assert per_group.shape == (len(labels),)
    num_within = 0.0
    for g, label in enumerate(labels):
        idx = np.flatnonzero(groups == label)
        Kg, cg = K[np.ix_(idx, idx)], c[idx]
        num_within += cg @ Kg @ cg
        expected = cg @ Kg @ cg / (np.sum(cg**2 * np.diag(Kg)) + eps)
        assert float(per_group[g]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    den = np.sum(c**2 * np.diag(K)) + eps
    assert stats["n_eff_within"] == pytest.approx(num_within / den, rel=1e-9, abs=1e-12)
    assert stats["n_eff_batch"] == pytest.approx(dg.effective_sample_size(torch.tensor(c), torch.tensor(K), eps))
    # cross-group part = Σ_{g≠h} c_gᵀ K_gh c_h over the same denominator
    cross = sum(c[i] * K[i, j] * c[j] for i, j in itertools.product(range(m), repeat=2) if groups[i] != groups[j])
    assert stats["n_eff_cross"] == pytest.approx(cross / den, rel=1e-7, abs=1e-9)


@settings(max_examples=25)
@given(vectors(min_m=2), st.integers(1, 4), st.integers(0, 1000))
def test_within_group_participation_ratio_is_pr_of_each_block(data, n_groups, seed):
    _, F = data
    groups = np.random.default_rng(seed).integers(0, n_groups, len(F))
    K = brute_gram(F)
    per_group, stats = dg.participation_ratio_within(torch.tensor(K), torch.tensor(groups))
    expected = []
    for label in np.unique(groups):
        idx = np.flatnonzero(groups == label)
        lam = np.clip(np.linalg.eigvalsh(K[np.ix_(idx, idx)]), 0, None)
        expected.append(lam.sum() ** 2 / (lam**2).sum() if lam.sum() > 0 else 0.0)
    np.testing.assert_allclose(per_group.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert stats["pr_within"] == pytest.approx(np.mean(expected))
    assert stats["pr_batch"] == pytest.approx(dg.participation_ratio(torch.tensor(K)))


@settings(max_examples=30)
@given(vectors())
def test_positive_alignment_is_mean_pairwise_cosine_of_nonzero_rows(data):
    _, F = data
    rows = [f for f in F if np.linalg.norm(f) > 0]
    cosines = [
        rows[i] @ rows[j] / np.linalg.norm(rows[i]) / np.linalg.norm(rows[j])
        for i in range(len(rows))
        for j in range(len(rows))
        if i != j
    ]
    expected = np.mean(cosines) if cosines else 0.0
    assert dg.positive_alignment(torch.tensor(F)) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_positive_alignment_is_one_for_identical_and_negative_for_opposed_gradients():
    g = torch.tensor([[1.0, 2.0, -1.0]])
    assert dg.positive_alignment(g.repeat(5, 1)) == pytest.approx(1.0)
    assert dg.positive_alignment(torch.cat([g, -g])) == pytest.approx(-1.0)
    assert dg.positive_alignment(torch.cat([g, torch.zeros(3, 3)])) == 0.0  # one nonzero row: no pair


@settings(max_examples=40)
@given(vectors(min_m=2), st.floats(0.01, 0.99))
def test_residual_energy_matches_explicit_projector_and_obeys_bound_chain(data, delta):
    c, F = data
    K = brute_gram(F)
    out = dg.residual_energy(torch.tensor(c), torch.tensor(K), delta)
    lam = np.clip(np.linalg.eigvalsh(K)[::-1], 0, None)
    energy = c @ K @ c
    if lam.sum() == 0 or energy <= 1e-12 * lam.sum() * (c @ c):
        return  # zero update: convention tested separately
    k = next(j for j in range(1, len(lam) + 1) if lam[:j].sum() >= (1 - delta) * lam.sum() * (1 - 1e-12))
    assert out["k"] == k
    P_perp = np.eye(len(c)) - brute_top_projector(K, k)
    c_perp = P_perp @ c
    lam_next = lam[k] if k < len(lam) else 0.0
    assert out["rho"] == pytest.approx(c_perp @ K @ c_perp / energy, rel=1e-6, abs=1e-9)
    assert out["bound"] == pytest.approx(lam_next * (c_perp @ c_perp) / energy, rel=1e-6, abs=1e-9)
    tol = 1e-9 * (1 + out["tail_bound"])
    assert out["rho"] <= out["bound"] + tol
    assert out["bound"] <= out["tail_bound"] + tol


def test_residual_energy_of_a_zero_update_is_zero():
    K = torch.ones(3, 3)  # rank 1: c = (1, -1, 0) is in its null space
    assert dg.residual_energy(torch.tensor([1.0, -1.0, 0.0]), K, 0.1) == {
        "rho": 0.0,
        "bound": 0.0,
        "tail_bound": 0.0,
        "k": 1.0,
    }
    assert dg.residual_energy(torch.ones(3), torch.zeros(3, 3), 0.1)["k"] == 0.0


@settings(max_examples=40)
@given(vectors(min_m=2), st.integers(0, 1000))
def test_update_diagnostics_match_brute_force_and_residual_share_is_a_fraction(data, seed):
    c, F = data
    rng = np.random.default_rng(seed)
    new = c + rng.standard_normal(len(c)) * rng.random()
    K = brute_gram(F)
    k = int(rng.integers(0, len(c) + 1))
    t = torch.tensor
    if np.linalg.norm(c) > 0:
        assert dg.coefficient_change(t(c), t(new)) == pytest.approx(np.linalg.norm(new - c) / np.linalg.norm(c))
    d = new - c
    if c @ K @ c > 1e-10 * np.trace(K) * (c @ c):
        expected = np.sqrt(max(d @ K @ d, 0) / (c @ K @ c))
        assert dg.update_change(t(c), t(new), t(K)) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    share = dg.residual_share(t(new), t(K), k)
    assert 0.0 <= share <= 1.0
    lam = np.linalg.eigvalsh(K)[::-1]
    gap_ok = k in (0, len(c)) or lam[k - 1] - lam[k] > 1e-6 * max(lam[0], 1e-300)
    if gap_ok and new @ K @ new > 1e-10 * max(np.trace(K), 1e-300) * (new @ new):
        r = (np.eye(len(c)) - brute_top_projector(K, k)) @ new
        assert share == pytest.approx(r @ K @ r / (new @ K @ new), rel=1e-6, abs=1e-9)


def test_update_diagnostics_define_zero_over_zero():
    K = torch.ones(2, 2)
    zero = torch.zeros(2)
    assert dg.coefficient_change(zero, zero) == 0.0
    assert dg.coefficient_change(zero, torch.ones(2)) == float("inf")
    in_null_space = torch.tensor([1.0, -1.0])  # aᵀKa = 0: the old update is zero
    assert dg.update_change(in_null_space, in_null_space, K) == 0.0
    assert dg.update_change(in_null_space, torch.tensor([1.0, 0.0]), K) == float("inf")
    assert dg.residual_share(in_null_space, K, 1) == 0.0
    assert dg.residual_share(torch.tensor([1.0, 0.0]), K, 0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: dg.participation_ratio(torch.tensor([[1.0, float("nan")], [0.0, 1.0]])), "gram"),
        (lambda: dg.effective_sample_size(torch.tensor([float("inf"), 1.0]), torch.eye(2)), "coeffs"),
        (lambda: dg.effective_sample_size(torch.ones(3), torch.eye(2)), "gram"),
        (lambda: dg.effective_sample_size_vectors(torch.ones(3), torch.ones(2, 4)), "vectors"),
        (lambda: dg.gram(torch.ones(3)), "features"),
        (lambda: dg.positive_alignment(torch.zeros(0, 3)), "features"),
        (lambda: dg.effective_sample_size_within(torch.ones(2), torch.eye(2), torch.tensor([0.5, 1.0])), "group_ids"),
        (lambda: dg.residual_energy(torch.ones(2), torch.eye(2), 1.0), "delta"),
        (lambda: dg.residual_share(torch.ones(2), torch.eye(2), 3), "k"),
        (lambda: dg.update_change(torch.ones(2), torch.ones(3), torch.eye(2)), "new"),
        (lambda: dg.effective_sample_size(torch.ones(2), torch.eye(2), eps=-1.0), "eps"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_finite_inputs_whose_sum_overflows_are_not_mistaken_for_inf():
    # the fast finiteness check (one sum) overflows here; the exact check must accept the input
    huge = torch.tensor([1e308, 1e308], dtype=torch.float64)
    assert dg.coefficient_change(huge, huge) == 0.0
