"""Noise-aware sketch Gram: the ANOVA noise variance, SURE soft-thresholding, debiased PR and SALT's gram option.

References are independent float64 numpy computations (explicit two-way tables, explicit sub-sketches, brute-force
SURE sums) and Monte Carlo over sketch seeds of the real Rademacher projections.
"""

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import diagnostics, sketch_gram
from openrlhf_geo.features import kronecker_projections
from openrlhf_geo.salt import VARIANTS, salt_advantages

GRAM_KEYS = {"gram_threshold", "gram_kept", "gram_noise"}


def anova_reference(phi: np.ndarray, k1: int, k2: int):
    """Textbook two-way ANOVA per pair on the explicit table Y_ab = (D/m) φ_i[a,b] φ_j[a,b] -> (K (m, m), V (m, m))."""
    m, D = phi.shape
    cells = phi.reshape(m, k1, k2)
    K, V = np.empty((m, m)), np.empty((m, m))
    for i in range(m):
        for j in range(m):
            Y = D / m * cells[i] * cells[j]
            grand, row, col = Y.mean(), Y.mean(1), Y.mean(0)
            ms_a = k2 * np.sum((row - grand) ** 2) / (k1 - 1)
            ms_b = k1 * np.sum((col - grand) ** 2) / (k2 - 1)
            ms_e = np.sum((Y - row[:, None] - col[None, :] + grand) ** 2) / ((k1 - 1) * (k2 - 1))
            K[i, j], V[i, j] = grand, (ms_a + ms_b - ms_e) / (k1 * k2)
    return K, V


def sketched(G: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """φ_i = vec(S_e G_i S_hᵀ) (m, dim) float64 with the project's Rademacher projections (row-major (k, k))."""
    s_e, s_h = kronecker_projections(G.shape[1], G.shape[2], dim, seed)
    return (s_e.double() @ G @ s_h.double().T).reshape(G.shape[0], -1)


def structured_gradients(m=4, V=10, d=6, seed=0) -> torch.Tensor:
    """Small exact gradients (m, V, d) with both easy and hard pairs: a correlated pair and a rank-1 matrix."""
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(m, V, d, generator=gen, dtype=torch.float64)
    G[1] = G[0] + 0.5 * torch.randn(V, d, generator=gen, dtype=torch.float64)
    G[m - 1] = torch.outer(
        torch.randn(V, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)
    )
    return G


@settings(max_examples=30)
@given(
    m=st.integers(1, 5),
    k1=st.integers(2, 5),
    k2=st.integers(2, 5),
    seed=st.integers(0, 10_000),
    rank_one=st.booleans(),
)
def test_noise_variance_equals_the_textbook_two_way_anova(m, k1, k2, seed, rank_one):
    rng = np.random.default_rng(seed)
    phi = rng.standard_normal((m, k1 * k2))
    if rank_one:  # all rows share one direction: some variance components vanish
        phi = rng.standard_normal((m, 1)) * phi[:1]
    K, V = sketch_gram.gram_and_noise(torch.tensor(phi), (k1, k2))
    K_ref, V_ref = anova_reference(phi, k1, k2)
    torch.testing.assert_close(K, torch.tensor(K_ref), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(V, torch.tensor(V_ref), rtol=1e-8, atol=1e-10 * float(np.abs(K_ref).max()) ** 2)
    assert torch.equal(K, K.T) and torch.equal(V, V.T)
    torch.testing.assert_close(K, diagnostics.gram(torch.tensor(phi)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-30, 1e20])
def test_tiny_or_huge_float32_sketches_keep_their_gram_and_noise(scale):
    """Φ Φᵀ and (Φ∘Φ)(Φ∘Φ)ᵀ of float32 1e-30 (1e20) features would underflow (overflow) in float32."""
    phi = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    K, V = sketch_gram.gram_and_noise(phi)
    K_scaled, V_scaled = sketch_gram.gram_and_noise(phi * scale)
    torch.testing.assert_close(K_scaled, K * scale**2, rtol=1e-5, atol=1e-6 * float(K.abs().max()) * scale**2)
    torch.testing.assert_close(V_scaled, V * scale**4, rtol=1e-4, atol=1e-5 * float(V.abs().max()) * scale**4)


def test_row_chunks_do_not_change_the_estimate():
    phi = torch.randn(37, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    K, V = sketch_gram.gram_and_noise(phi)
    with mock.patch.object(sketch_gram, "CHUNK_ELEMENTS", 37 * 5):  # 5-row chunks, a ragged last one
        K_chunked, V_chunked = sketch_gram.gram_and_noise(phi)
    torch.testing.assert_close(K_chunked, K, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(V_chunked, V, rtol=1e-10, atol=1e-14)


def test_noise_variance_is_unbiased_over_sketch_seeds():
    """E V̂_ij = Var K̂_ij = E (K̂_ij − K_ij)² (K̂ is unbiased for the exact K), over 2,000 draws of (S_e, S_h)."""
    G = structured_gradients()
    m, n = G.shape[0], 2000
    K_exact = diagnostics.gram(G.reshape(m, -1))
    err2, var_hat, one_way, frob_raw, frob_debiased = [], [], [], [], []
    for seed in range(n):
        phi = sketched(G, 16, seed)
        K, V = sketch_gram.gram_and_noise(phi)
        err2.append((K - K_exact).square())
        var_hat.append(V)
        # negative control: rows of S_e as if they were independent replicates (ignores the shared S_h)
        rows = torch.einsum("iab,jab->ija", phi.reshape(m, 4, 4), phi.reshape(m, 4, 4)) * 4 / m
        one_way.append(rows.var(-1) / 4)
        frob_raw.append(float(K.square().sum()))
        frob_debiased.append(float((K.square() - V).sum()))
    err2, var_hat, one_way = torch.stack(err2), torch.stack(var_hat), torch.stack(one_way)
    iu = torch.triu_indices(m, m)

    def z_scores(estimate):
        diff = (estimate - err2)[:, iu[0], iu[1]]
        return diff.mean(0) / (diff.std(0) / math.sqrt(n))

    assert z_scores(var_hat).abs().max() < 4, z_scores(var_hat)
    assert z_scores(one_way).abs().max() > 6  # the test can tell a biased estimator
    # E‖K̂‖_F² = ‖K‖_F² + Σ Var K̂_ij: the debiased Frobenius norm (participation_ratio's denominator) is unbiased
    target = float(K_exact.square().sum())
    for values, unbiased in ((frob_debiased, True), (frob_raw, False)):
        z = (np.mean(values) - target) / (np.std(values) / math.sqrt(n))
        assert (abs(z) < 4) == unbiased, z


def test_sub_sketches_are_contiguous_slices_whose_grams_average_to_the_full_gram():
    G = structured_gradients(m=5, V=12, d=9, seed=1)
    k, dim, (p, q) = 8, 64, (2, 4)
    s_e, s_h = (s.double() for s in kronecker_projections(12, 9, dim, seed=3))
    phi = sketched(G, dim, 3)
    full = diagnostics.gram(phi)
    sub_grams = []
    for P in range(p):
        for Q in range(q):
            rows, cols = slice(P * k // p, (P + 1) * k // p), slice(Q * k // q, (Q + 1) * k // q)
            # an independent sketch in its own right: S_e and S_h restricted to blocks of rows, rescaled
            sub = math.sqrt(p * q) * (s_e[rows] @ G @ s_h[cols].T).reshape(5, -1)
            torch.testing.assert_close(sub, math.sqrt(p * q) * phi.reshape(5, k, k)[:, rows, cols].reshape(5, -1))
            sub_grams.append(diagnostics.gram(sub))
    torch.testing.assert_close(torch.stack(sub_grams).mean(0), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sketch_gram.gram_and_noise(phi)[0], full, rtol=1e-12, atol=1e-12)


def shrink_inputs(m, seed, structured):
    gen = torch.Generator().manual_seed(seed)
    if structured:  # a few strong directions that stand above the sketch noise
        base = torch.randn(m, 3, generator=gen, dtype=torch.float64) @ torch.randn(3, 64, generator=gen).double()
        phi = base + 0.3 * torch.randn(m, 64, generator=gen, dtype=torch.float64)
    else:
        phi = torch.randn(m, 64, generator=gen, dtype=torch.float64)
    return sketch_gram.gram_and_noise(phi)


@settings(max_examples=30)
@given(m=st.integers(1, 12), seed=st.integers(0, 10_000), structured=st.booleans(), log2_c=st.integers(-4, 4))
def test_shrink_moves_off_diagonal_entries_toward_zero_and_is_equivariant(m, seed, structured, log2_c):
    K, V = shrink_inputs(m, seed, structured)
    out, stats = sketch_gram.shrink(K, V)
    assert torch.equal(out, out.T)
    assert torch.equal(out.diagonal(), K.diagonal())
    assert bool((out.abs() <= K.abs()).all()) and bool((out * K >= 0).all())  # toward 0, never across it
    assert torch.equal(out[V <= 0], K[V <= 0])  # no measurable noise: untouched
    assert 0 <= stats["gram_kept"] <= 1 and stats["gram_threshold"] >= 0 and stats["gram_noise"] >= 0
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(seed))
    out_perm, stats_perm = sketch_gram.shrink(K[perm][:, perm], V[perm][:, perm])
    torch.testing.assert_close(out_perm, out[perm][:, perm], rtol=1e-12, atol=0)
    c = 2.0**log2_c  # a power of two scales exactly: the same SURE minimizer
    out_scaled, stats_scaled = sketch_gram.shrink(c * c * K, c**4 * V)
    assert torch.equal(out_scaled, c * c * out) and stats_scaled == stats


@settings(max_examples=20)
@given(m=st.integers(2, 10), seed=st.integers(0, 10_000), structured=st.booleans())
def test_sure_risk_equals_the_bruteforce_sum_and_shrink_takes_its_minimizer(m, seed, structured):
    K, V = shrink_inputs(m, seed, structured)
    thresholds = np.linspace(0, 4, 41)
    k, v = K.numpy(), V.numpy()
    brute = np.zeros_like(thresholds)
    for i in range(m):
        for j in range(m):
            if i != j and v[i, j] > 0:
                z2 = k[i, j] ** 2 / v[i, j]
                brute += v[i, j] * np.where(np.sqrt(z2) <= thresholds, z2 - 1, 1 + thresholds**2)
    risk = sketch_gram.sure_risk(K, V, torch.tensor(thresholds))
    torch.testing.assert_close(risk, torch.tensor(brute), rtol=1e-9, atol=1e-12 * float(np.abs(k).max()) ** 2)
    grid = torch.linspace(0, math.sqrt(2 * math.log(max(m * (m - 1) / 2, 2.0))), sketch_gram.SURE_GRID_POINTS)
    out, stats = sketch_gram.shrink(K, V)
    t = stats["gram_threshold"]
    assert t == pytest.approx(float(grid[int(torch.argmin(sketch_gram.sure_risk(K, V, grid.double())))]))
    noisy = (v > 0) & ~np.eye(m, dtype=bool)
    expected = np.where(noisy, np.sign(k) * np.maximum(np.abs(k) - t * np.sqrt(np.where(noisy, v, 0)), 0), k)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-15)
    kept = np.count_nonzero(expected[noisy]) / max(np.count_nonzero(noisy), 1)
    assert stats["gram_kept"] == pytest.approx(kept if noisy.any() else 1.0)


def test_sure_is_unbiased_for_the_soft_threshold_risk_under_gaussian_noise():
    """Monte Carlo: mean SURE(t) = mean Σ_{i≠j} (η_t(K̂_ij) − K_ij)² for K̂ = K + N(0, V) (symmetric noise)."""
    gen = torch.Generator().manual_seed(0)
    m, n = 12, 3000
    K = torch.zeros(m, m, dtype=torch.float64)
    K[:6, :6] = 1.5  # a block of real structure, the rest pure noise
    K.fill_diagonal_(4.0)
    V = 0.5 + torch.rand(m, m, generator=gen, dtype=torch.float64)
    V = (V + V.T) / 2
    thresholds = torch.tensor([0.0, 0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    off = ~torch.eye(m, dtype=torch.bool)
    sure, loss = [], []
    for _ in range(n):
        noise = torch.randn(m, m, generator=gen, dtype=torch.float64).triu(1)
        K_hat = K + (noise + noise.T) * V.sqrt()
        sure.append(sketch_gram.sure_risk(K_hat, V, thresholds))
        cut = thresholds[:, None, None] * V.sqrt()
        shrunk = torch.sign(K_hat) * (K_hat.abs() - cut).clamp_min(0)
        loss.append(((shrunk - K).square() * off).sum((1, 2)))
    diff = torch.stack(sure) - torch.stack(loss)
    z = diff.mean(0) / (diff.std(0) / math.sqrt(n))
    assert z.abs().max() < 4, z


def test_debiased_pr_equals_the_formula_and_stays_in_range():
    rng = np.random.default_rng(0)
    phi = rng.standard_normal((6, 16)) + 2 * rng.standard_normal((1, 16))
    K, V = (x.numpy() for x in sketch_gram.gram_and_noise(torch.tensor(phi)))
    off = ~np.eye(6, dtype=bool)
    denominator = np.sum(np.diag(K) ** 2 - np.diag(V)) + max(np.sum((K**2 - V)[off]), 0)
    expected = min(max(np.trace(K) ** 2 / denominator, 1), 6)
    assert sketch_gram.participation_ratio(K, V) == pytest.approx(expected, rel=1e-12)
    # pure sketch noise around orthogonal rows: the raw PR is biased low, the debiased one is not below it
    noise_only = torch.tensor(np.eye(6, 16) + 0.3 * rng.standard_normal((6, 16)))
    K, V = sketch_gram.gram_and_noise(noise_only)
    assert 1 <= diagnostics.participation_ratio(K) <= sketch_gram.participation_ratio(K, V) <= 6
    assert sketch_gram.participation_ratio(torch.zeros(3, 3), torch.zeros(3, 3)) == 0.0
    assert sketch_gram.participation_ratio(torch.ones(1, 1), torch.ones(1, 1)) == 1.0


def test_degenerate_features_have_the_identity_behaviour():
    K, V = sketch_gram.gram_and_noise(torch.zeros(3, 16))
    assert not K.any() and not V.any()
    out, stats = sketch_gram.shrink(K, V)
    assert not out.any() and stats == {"gram_threshold": 0.0, "gram_kept": 1.0, "gram_noise": 0.0}
    K, V = sketch_gram.gram_and_noise(torch.randn(1, 16, dtype=torch.float64))
    assert K.shape == V.shape == (1, 1) and torch.equal(sketch_gram.shrink(K, V)[0], K)


@pytest.mark.parametrize(
    "features, shape, match",
    [
        (torch.randn(3, 20), None, "D = 20 columns, not a perfect square: pass sketch_shape"),
        (torch.randn(3, 20), (4, 4), r"sketch_shape \(4, 4\) does not match the D = 20"),
        (torch.randn(3, 16), (1, 16), "too small to split into independent sub-sketches"),
        (torch.randn(3, 16), "4x4", "sketch_shape must be a pair of ints"),
        (torch.randn(16), None, r"features must be a floating-point \(m, D\) tensor"),
        (torch.full((2, 16), float("nan")), None, "features contains NaN or inf"),
        (torch.zeros(0, 16), None, r"features is empty \(m = 0\)"),
    ],
)
def test_invalid_features_or_shape_raise_naming_the_argument(features, shape, match):
    with pytest.raises(ValueError, match=match):
        sketch_gram.gram_and_noise(features, shape)


def test_shrink_rejects_mismatched_noise_variance():
    with pytest.raises(ValueError, match="noise_var must have the shape of gram"):
        sketch_gram.shrink(torch.eye(3), torch.eye(2))


# ---- salt_advantages(gram=...) ----


def grpo_advantages(m, seed):
    r = torch.randint(0, 2, (m // 4, 4), generator=torch.Generator().manual_seed(seed)).double()
    std = r.std(1, keepdim=True)
    return torch.where(std > 0, (r - r.mean(1, keepdim=True)) / (std + 1e-6), 0.0).reshape(-1)


def test_raw_gram_is_the_default_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    a, F = grpo_advantages(16, 0), torch.randn(16, 64, generator=gen)
    out, stats = salt_advantages(a, F)
    out_raw, stats_raw = salt_advantages(a, F, gram="raw")
    assert torch.equal(out, out_raw)
    assert stats.keys() == stats_raw.keys() and not GRAM_KEYS & stats.keys()
    assert all(stats[key] == stats_raw[key] for key in stats if key != "solve_ms")


def test_shrink_approaches_raw_as_the_sketch_noise_vanishes():
    """Sketches of one exact geometry at growing D: the noise share falls and a' (shrink) → a' (raw)."""
    gen = torch.Generator().manual_seed(0)
    m, V, d = 16, 48, 32
    basis = torch.randn(3, V, d, generator=gen, dtype=torch.float64)
    G = torch.einsum("mr,rvd->mvd", torch.randn(m, 3, generator=gen, dtype=torch.float64), basis)
    G += 0.3 * torch.randn(m, V, d, generator=gen, dtype=torch.float64)
    a = grpo_advantages(m, 1)
    gaps, noise = [], []
    for dim in (64, 1024, 65536):
        F = sketched(G, dim, seed=0)
        out_raw, _ = salt_advantages(a, F)
        out, stats = salt_advantages(a, F, gram="shrink")
        assert stats.keys() >= GRAM_KEYS
        gaps.append(1 - float(out @ out_raw / (out.norm() * out_raw.norm())))
        noise.append(stats["gram_noise"])
    assert noise[0] > noise[1] > noise[2] and noise[2] < 0.01
    assert gaps[2] < 1e-3, gaps


def test_shrink_without_sketch_noise_equals_raw():
    """Cells that all agree (φ_i[a, b] = c_i s_ab, |s_ab| = 1) carry zero noise: V̂ = 0, K̃ = K̂, the same a'."""
    gen = torch.Generator().manual_seed(2)
    signs = torch.randint(0, 2, (64,), generator=gen).double() * 2 - 1
    F = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -1.0, 2.5, 0.75], dtype=torch.float64)[:, None] * signs
    a = grpo_advantages(8, 3)
    K, V = sketch_gram.gram_and_noise(F)
    torch.testing.assert_close(V, torch.zeros_like(V), rtol=0, atol=1e-12 * float(K.abs().max()) ** 2)
    out, stats = salt_advantages(a, F, gram="shrink")
    out_raw, stats_raw = salt_advantages(a, F)
    torch.testing.assert_close(out, out_raw, rtol=1e-9, atol=1e-12)
    assert stats["pr"] == pytest.approx(stats_raw["pr"], rel=1e-9)


@settings(max_examples=20)
@given(variant=st.sampled_from(list(VARIANTS)), m=st.integers(1, 24), seed=st.integers(0, 10_000))
def test_every_variant_runs_on_the_shrunk_gram_with_finite_outputs(variant, m, seed):
    gen = torch.Generator().manual_seed(seed)
    F = torch.randn(m, 3, generator=gen) @ torch.randn(3, 64, generator=gen) + torch.randn(m, 64, generator=gen)
    a = torch.randn(m, generator=gen, dtype=torch.float64)
    kwargs = {"alpha": 0.5} if variant == "fixed-alpha" else {"entropy": 0.3} if variant == "entropy-alpha" else {}
    out, stats = salt_advantages(a, F, variant, generator=gen, gram="shrink", **kwargs)
    assert out.shape == a.shape and bool(torch.isfinite(out).all())
    assert all(math.isfinite(v) for key, v in stats.items() if key != "U_perp_gain") and stats.keys() >= GRAM_KEYS
    assert 1 <= stats["pr"] <= m and 1 <= stats["k"] <= m
    if m == 1:
        assert torch.equal(out, a)


def test_shrink_returns_the_basis_of_the_shrunk_gram():
    gen = torch.Generator().manual_seed(5)
    F = torch.randn(24, 2, generator=gen) @ torch.randn(2, 64, generator=gen) + torch.randn(24, 64, generator=gen)
    a = grpo_advantages(24, 5)
    out, stats, (B, is_top, _) = salt_advantages(a, F, gram="shrink", return_basis=True)
    shrunk, _ = sketch_gram.shrink(*sketch_gram.gram_and_noise(F))
    k = int(stats["k"])
    Q = torch.linalg.eigh(shrunk).eigenvectors.flip(1)[:, :k]
    P = B @ B.T if is_top else torch.eye(24, dtype=torch.float64) - B @ B.T
    torch.testing.assert_close(P, Q @ Q.T, rtol=0, atol=1e-8)


def test_shrink_on_zero_features_is_the_identity():
    a = grpo_advantages(8, 0)
    out, stats = salt_advantages(a, torch.zeros(8, 16), gram="shrink")
    assert torch.equal(out, a) and stats["pr"] == 0.0 and stats["k"] == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gram": "exact"}, "unknown SALT gram estimator 'exact'; valid: raw, shrink"),
        ({"sketch_shape": (4, 4)}, r"sketch_shape is only used with gram='shrink'"),
        ({"gram": "shrink"}, "pass sketch_shape=\\(k1, k2\\)"),  # D = 32 is not a square
    ],
)
def test_gram_option_misuse_raises_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        salt_advantages(grpo_advantages(8, 0), torch.randn(8, 32), **kwargs)


def test_explicit_sketch_shape_allows_a_rectangular_sketch():
    gen = torch.Generator().manual_seed(0)
    out, stats = salt_advantages(grpo_advantages(8, 0), torch.randn(8, 32, generator=gen), gram="shrink",
                                 sketch_shape=(4, 8))  # fmt: skip
    assert bool(torch.isfinite(out).all()) and stats.keys() >= GRAM_KEYS
