"""SALT Eq. 4-18, the App. F.3 variants and nulls, and the F.5 stats against a brute-force numpy float64 reference."""

import dataclasses
import math

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from openrlhf_geo import diagnostics
from openrlhf_geo.features import DEFAULT_DIM
from openrlhf_geo.salt import (
    LANCZOS_MAX_FRACTION,
    VARIANTS,
    InnerProducts,
    SaltConfig,
    Variant,
    _top_eigenspace,
    entropy_alpha,
    salt_advantages,
)

ALPHA, ENTROPY_ALPHA = 0.37, 0.25
STAT_KEYS = {
    *("pr", "k", "alpha", "n_eff_in", "n_eff_out", "gap", "main_norm", "exp_norm", "D_a", "D_g", "U_perp"),
    *("U_perp_gain", "m", "solve_ms"),
}
NULLS = ("permuted", "matched-rand-subspace")


def randomised(spec):
    """Whether a variant's a' depends on the generator's draws."""
    return spec.projector == "random" or spec.assign != "none"


def kwargs_for(variant, seed=0):
    kw = {"generator": torch.Generator().manual_seed(seed)}
    if variant == "fixed-alpha":
        kw["alpha"] = ALPHA
    if variant == "entropy-alpha":
        kw["entropy"] = ENTROPY_ALPHA
    return kw


def random_basis(m, k, gen):
    """The documented draw: the span of a torch.randn(m, k) Gaussian (none for k = m: the whole space)."""
    if k == m:
        return np.eye(m)
    return torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64)).Q.numpy()


def reference(a, F, variant, seed=0, eps=1e-8):
    """The paper's formulas written out: explicit m×m projectors, explicit update vectors ĝ(c) = Fᵀc / m."""
    m = len(a)
    K = F @ F.T / m
    Q = np.linalg.eigh(K)[1][:, ::-1]
    pr = np.trace(K) ** 2 / np.sum(K * K)  # Eq. 5
    k = int(min(max(np.floor(pr + 0.5), 1), m))  # Eq. 14
    P = Q[:, :k] @ Q[:, :k].T  # Eq. 15
    I = np.eye(m)
    u = a[:, None] * F  # u_i = a_i g_i
    n_eff6 = np.sum(u.sum(0) ** 2) / np.sum(u**2) if np.sum(u**2) > 0 else 0.0  # Eq. 6
    alpha = {
        "fixed": ALPHA,
        "pr": min(pr / (m - 1), 1.0),
        "entropy": ENTROPY_ALPHA,
        "n_eff": max(0.0, 1 - n_eff6),  # Eq. 17
    }[VARIANTS[variant].alpha_rule]
    pos = np.maximum(a, 0)
    gen = torch.Generator().manual_seed(seed)
    salt_formula = P @ a + alpha * (I - P) @ pos  # Eq. 18
    if variant == "only-main":
        new = P @ a
    elif variant == "only-exp":
        new = alpha * (I - P) @ pos
    elif variant == "no-pos":
        new = P @ a + alpha * (I - P) @ a
    elif variant == "no-proj":
        new = a + alpha * pos
    elif variant == "rand-proj":
        V = random_basis(m, k, gen)
        new = V @ V.T @ a + alpha * (I - V @ V.T) @ pos
    elif variant == "permuted":
        new = salt_formula[torch.randperm(m, generator=gen).numpy()]
    elif variant == "matched-rand-subspace":
        V = random_basis(m, k, gen)
        score = (I - V @ V.T) @ pos
        ties = torch.randperm(m, generator=gen).numpy()
        ranked = sorted(range(m), key=lambda j: (-score[ties[j]], j))  # by score, ties in the drawn order
        new = np.empty(m)
        new[ties[ranked]] = np.sort(salt_formula)[::-1]
    else:
        new = salt_formula

    def g_hat(c):
        return F.T @ c / m  # Eq. 58

    def U(c):
        return np.linalg.norm(F.T @ ((I - P) @ c) / m)  # Eq. 61

    def n_eff60(c):
        return c @ K @ c / (np.sum(c**2 * np.diag(K)) + eps)  # Eq. 60

    stats = {
        "pr": pr,
        "k": k,
        "alpha": alpha,
        "n_eff_in": n_eff60(a),
        "n_eff_out": n_eff60(new),
        "D_a": np.linalg.norm(new - a) / (np.linalg.norm(a) + eps),  # Eq. 59
        "D_g": np.linalg.norm(g_hat(new) - g_hat(a)) / (np.linalg.norm(g_hat(a)) + eps),  # Eq. 59
        "U_perp": U(new),
        "U_perp_gain": U(new) / U(a) if U(a) > 1e-6 * np.linalg.norm(F) * np.linalg.norm(a) / m else None,
    }
    return new, stats


def relative_gaps(F):
    """Relative eigengap at the SALT boundary k and the smallest relative spacing of K's spectrum."""
    K = F @ F.T / len(F)
    lam = np.clip(np.linalg.eigvalsh(K)[::-1], 0, None)
    k = int(min(max(np.floor(lam.sum() ** 2 / (lam**2).sum() + 0.5), 1), len(F)))
    boundary = 1.0 if k == len(F) else (lam[k - 1] - lam[k]) / lam[0]
    return boundary, np.min(-np.diff(lam)) / lam[0] if len(F) > 1 else 1.0


def grpo(r, group=4):
    """Eq. 2 within consecutive groups (population std, +1e-6)."""
    r = np.asarray(r, dtype=float).reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


@st.composite
def batches(draw, max_m=20, max_d=32):
    """(a (m,), F (m, D)) float64 numpy: GRPO-normalized or Gaussian advantages; grouped, low-rank or Gaussian F."""
    m = draw(st.integers(2, max_m))
    D = draw(st.integers(1, max_d))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    structure = draw(st.sampled_from(["gaussian", "grouped", "low-rank"]))
    F = rng.standard_normal((m, D))
    if structure == "grouped":  # rollouts of one prompt share a direction
        prompt = rng.integers(0, max(1, m // 4), m)
        F = 2.0 * rng.standard_normal((m, D))[prompt] + F
    elif structure == "low-rank":
        F = rng.standard_normal((m, 3)) @ rng.standard_normal((3, D)) + 0.05 * F
    F *= 10.0 ** rng.uniform(-1, 1, (m, 1))
    if draw(st.booleans()) and m % 4 == 0:
        a = grpo(rng.integers(0, 2, m))
    else:
        a = rng.standard_normal(m)
    assume(np.linalg.norm(a) > 1e-3)
    return a, F


def run(a, F, variant="full", seed=0, **kw):
    out, stats = salt_advantages(torch.tensor(a), torch.tensor(F), variant, **{**kwargs_for(variant, seed), **kw})
    return out.numpy(), stats


# ---- the method, its variants and stats against the reference ----


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=12)
@given(data=batches(), seed=st.integers(0, 1000))
def test_every_variant_matches_brute_force(variant, data, seed):
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)  # P_k unique
    out, stats = run(a, F, variant, seed)
    expected, ref = reference(a, F, variant, seed)
    scale = np.linalg.norm(a)
    np.testing.assert_allclose(out, expected, rtol=1e-7, atol=1e-8 * scale)
    assert stats.keys() == STAT_KEYS
    assert all(type(v) is float for v in stats.values())
    for key, value in ref.items():
        if value is not None:
            assert stats[key] == pytest.approx(value, rel=1e-6, abs=1e-8 * max(1.0, scale)), key


@pytest.mark.parametrize("variant", NULLS)
@settings(max_examples=30)
@given(data=batches(), seed=st.integers(0, 1000))
def test_matched_nulls_reassign_exactly_the_salt_values_under_salt_alpha(variant, data, seed):
    a, F = data
    full, full_stats = run(a, F)
    out, stats = run(a, F, variant, seed)
    assert np.array_equal(np.sort(out), np.sort(full))  # same marginal, norm and positive mass: a permutation
    assert stats["alpha"] == full_stats["alpha"]
    assert (stats["main_norm"], stats["exp_norm"]) == (full_stats["main_norm"], full_stats["exp_norm"])


def test_matched_random_subspace_ranks_samples_by_their_random_residual_of_the_positive_part():
    """One draw followed by hand: the largest residual score of [a]₊ under the random subspace gets max a'_SALT."""
    rng = np.random.default_rng(4)
    F = rng.standard_normal((12, 3)) @ rng.standard_normal((3, 20)) + 0.2 * rng.standard_normal((12, 20))
    a = grpo([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0])
    full, stats = run(a, F)
    out, _ = run(a, F, "matched-rand-subspace", seed=9)
    gen = torch.Generator().manual_seed(9)
    V = random_basis(12, int(stats["k"]), gen)
    score = np.maximum(a, 0) - V @ (V.T @ np.maximum(a, 0))
    assert out[np.argmax(score)] == full.max() and out[np.argmin(score)] == full.min()
    assert np.all(np.diff(out[np.argsort(-score)]) <= 0)  # the values fall as the score falls


def test_pr_alpha_is_pr_over_m_minus_one_clipped():
    """App. F.3.1: α_t = clip(PR_total / (m − 1), 0, 1): 1 for isotropic features (PR = m), 1/(m − 1) for rank 1."""
    a = grpo([1, 0, 0, 1, 0, 1, 1, 1])
    _, iso = run(a, isotropic_features(8, 0), "pr-alpha")
    rank_one = np.outer(np.random.default_rng(0).uniform(1, 2, 8), np.ones(5))
    _, low = run(a, rank_one, "pr-alpha")
    assert (iso["pr"], iso["alpha"]) == (pytest.approx(8.0), 1.0)
    assert low["alpha"] == pytest.approx(1 / 7)


def test_full_salt_on_a_larger_low_rank_batch_takes_the_lanczos_path_and_matches_brute_force():
    rng = np.random.default_rng(3)
    m = 256
    F = rng.standard_normal((m, 6)) @ rng.standard_normal((6, 64)) + 0.1 * rng.standard_normal((m, 64))
    a = rng.standard_normal(m)
    out, stats = run(a, F)
    assert stats["k"] + 1 <= LANCZOS_MAX_FRACTION * m
    np.testing.assert_allclose(out, reference(a, F, "full")[0], rtol=1e-7, atol=1e-9)


@settings(max_examples=30)
@given(data=batches())
def test_returned_basis_spans_the_top_k_eigenvectors_salt_projected_on(data):
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)
    out, stats, (B, is_top, gram) = salt_advantages(torch.tensor(a), torch.tensor(F), return_basis=True)
    m, k = len(a), int(stats["k"])
    np.testing.assert_allclose(gram.numpy(), F @ F.T / m, rtol=1e-10, atol=1e-12)  # the Gram, in F's own units
    assert B.dtype == torch.float64 and B.shape[0] == m and B.shape[1] == (k if is_top else m - k)
    P = B.numpy() @ B.numpy().T
    P = P if is_top else np.eye(m) - P
    Q = np.linalg.eigh(F @ F.T / m)[1][:, ::-1][:, :k]
    np.testing.assert_allclose(P, Q @ Q.T, atol=1e-8)
    # the stats' U_⊥ is Eq. 61 on that basis
    K = diagnostics.gram(torch.tensor(F))
    assert stats["U_perp"] == pytest.approx(diagnostics.residual_strength(out, K, B, is_top), rel=1e-9, abs=1e-12)


# ---- the variant table, entropy-α, the config ----


def test_variant_table_holds_the_paper_rows():
    assert list(VARIANTS) == [
        *("full", "only-main", "only-exp", "no-pos", "no-proj", "rand-proj", "fixed-alpha", "pr-alpha"),
        *("entropy-alpha", "permuted", "matched-rand-subspace"),
    ]
    spec = {name: dataclasses.astuple(v) for name, v in VARIANTS.items()}
    #            projector  alpha_rule  main   explore positive assign
    assert spec["full"] == ("top-k", "n_eff", True, True, True, "none")
    assert spec["only-main"] == ("top-k", "n_eff", True, False, True, "none")
    assert spec["only-exp"] == ("top-k", "n_eff", False, True, True, "none")
    assert spec["no-pos"] == ("top-k", "n_eff", True, True, False, "none")
    assert spec["no-proj"] == ("none", "n_eff", True, True, True, "none")
    assert spec["rand-proj"] == ("random", "n_eff", True, True, True, "none")
    assert spec["fixed-alpha"] == ("top-k", "fixed", True, True, True, "none")
    assert spec["pr-alpha"] == ("top-k", "pr", True, True, True, "none")
    assert spec["entropy-alpha"] == ("top-k", "entropy", True, True, True, "none")
    assert spec["permuted"] == ("top-k", "n_eff", True, True, True, "permute")
    assert spec["matched-rand-subspace"] == ("top-k", "n_eff", True, True, True, "matched-random-subspace")
    assert [n for n, v in VARIANTS.items() if v.needs_entropy] == ["entropy-alpha"]
    assert [n for n, v in VARIANTS.items() if randomised(v)] == ["rand-proj", "permuted", "matched-rand-subspace"]
    with pytest.raises(ValueError, match="Variant.projector must be one of"):
        Variant(projector="pca")


def test_salt_branches_on_the_variant_fields_not_on_names(monkeypatch):
    """A new table row works without code: no projection and no exploration channel is the identity."""
    monkeypatch.setitem(VARIANTS, "identity", Variant(projector="none", explore=False))
    rng = np.random.default_rng(0)
    a, F = rng.standard_normal(10), rng.standard_normal((10, 4))
    out, stats = run(a, F, "identity")
    np.testing.assert_array_equal(out, a)
    assert stats["D_a"] == 0.0 and stats["U_perp_gain"] == 1.0


@settings(max_examples=60)
@given(
    h=st.floats(-10, 10),
    low=st.floats(-10, 10),
    width=st.floats(0, 10),
)
def test_entropy_alpha_is_the_clipped_normalized_entropy(h, low, width):
    high = low + width
    got = entropy_alpha(h, low, high)
    if high > low:
        assert got == pytest.approx(min(max((h - low) / (high - low), 0.0), 1.0))
    else:  # one entropy seen: the clip decides off it, 0 at it (0/0)
        assert got == (1.0 if h > high else 0.0)
    assert 0.0 <= got <= 1.0


@pytest.mark.parametrize(
    "args, match", [((1.0, 2.0, 1.0), "h_max must be >= h_min"), ((math.nan, 0.0, 1.0), "h_t must be a finite")]
)
def test_entropy_alpha_rejects_bad_extremes(args, match):
    with pytest.raises(ValueError, match=match):
        entropy_alpha(*args)


def test_entropy_alpha_variant_takes_the_callers_alpha():
    rng = np.random.default_rng(1)
    a, F = rng.standard_normal(12), rng.standard_normal((12, 3)) @ rng.standard_normal((3, 9))
    out, stats = run(a, F, "entropy-alpha", entropy=entropy_alpha(2.0, 1.0, 5.0))
    fixed, _ = run(a, F, "fixed-alpha", alpha=0.25)
    assert stats["alpha"] == 0.25
    np.testing.assert_array_equal(out, fixed)


def test_salt_config_defaults_and_entropy_flag():
    config = SaltConfig()
    assert (config.variant, config.features, config.dim, config.seed, config.gram) == (
        "full",
        "sketch",
        DEFAULT_DIM,
        0,
        "raw",
    )
    assert (config.group_prompts, config.alpha, config.apply) == (None, None, True)
    assert not config.needs_entropy and SaltConfig(variant="entropy-alpha").needs_entropy
    assert SaltConfig(variant="fixed-alpha", alpha=0.0).alpha == 0.0
    assert SaltConfig(features="exact", group_prompts=0, apply=False).group_prompts == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dim = 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"variant": "salt"}, r"--salt.variant must be one of full, only-main, .* \(got 'salt'\)"),
        ({"features": "full"}, r"--salt.features must be one of sketch, kronecker, exact"),
        ({"dim": 1000}, r"--salt.dim must be a perfect square >= 16 \(got 1000\)"),
        ({"dim": 9}, r"--salt.dim must be a perfect square >= 16 \(got 9\)"),
        ({"dim": 16.0}, r"--salt.dim must be a perfect square >= 16"),
        ({"seed": -1}, r"--salt.seed must be an integer >= 0"),
        ({"gram": "exact"}, r"--salt.gram must be one of raw, shrink"),
        ({"gram": "shrink", "features": "exact"}, r"--salt.gram shrink needs --salt.features kronecker"),
        ({"gram": "shrink"}, r"--salt.gram shrink needs --salt.features kronecker .*got --salt.features sketch"),
        ({"group_prompts": -1}, r"--salt.group_prompts must be an integer >= 0"),
        ({"variant": "fixed-alpha"}, r"--salt.alpha is required by, and only used with, variant fixed-alpha"),
        ({"alpha": 0.5}, r"--salt.alpha is required by, and only used with"),
        ({"variant": "fixed-alpha", "alpha": 1.5}, r"--salt.alpha must be a number in \[0, 1\] \(got 1.5\)"),
        ({"variant": "fixed-alpha", "alpha": -0.1}, r"--salt.alpha must be a number in \[0, 1\]"),
        ({"variant": "fixed-alpha", "alpha": math.nan}, r"--salt.alpha must be a number in \[0, 1\]"),
        ({"apply": "yes"}, r"--salt.apply must be True or False"),
    ],
)
def test_salt_config_rejects_bad_flags_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SaltConfig(**kwargs)


# ---- eigensolver ----


@settings(max_examples=45)
@given(
    m=st.integers(3, 80),
    k_frac=st.floats(0, 1),
    method=st.sampled_from(["lanczos", "dense-top", "dense-bottom"]),
    gap=st.floats(0.02, 0.5),
    seed=st.integers(0, 10**6),
)
def test_eigensolvers_return_the_symmetric_idempotent_top_k_projector(m, k_frac, method, gap, seed):
    rng = np.random.default_rng(seed)
    k = 1 + int(k_frac * (m - 3 if method == "lanczos" else m - 2))  # ARPACK needs k + 1 < m
    lam = np.sort(rng.exponential(size=m))[::-1]
    lam[k:] *= (1 - gap) * lam[k - 1] / lam[k]  # relative gap `gap` at the boundary
    Q = np.linalg.qr(rng.standard_normal((m, m)))[0]
    K = (Q * lam) @ Q.T
    basis, is_top, gap = _top_eigenspace(torch.tensor((K + K.T) / 2), k, method)
    B = basis.numpy()
    P = B @ B.T if is_top else np.eye(m) - B @ B.T
    np.testing.assert_allclose(P, P.T, atol=1e-12)
    np.testing.assert_allclose(P @ P, P, atol=1e-10)
    np.testing.assert_allclose(P, Q[:, :k] @ Q[:, :k].T, atol=1e-8)
    assert gap == pytest.approx((lam[k - 1] - lam[k]) / lam[k - 1], rel=1e-8)


def test_lanczos_finds_every_copy_of_a_repeated_top_eigenvalue():
    # 16 prompts x 8 identical rollouts, orthogonal prompts: K has eigenvalue 8/m sixteen times, PR = 16.
    m, prompts = 128, 16
    F = np.zeros((m, prompts))
    F[np.arange(m), np.arange(m) % prompts] = 1.0
    basis, is_top, _ = _top_eigenspace(diagnostics.gram(torch.tensor(F)), prompts, "lanczos")
    indicators = F / np.sqrt(8)
    np.testing.assert_allclose(basis.numpy() @ basis.numpy().T, indicators @ indicators.T, atol=1e-10)
    assert is_top


def test_arpack_failure_falls_back_to_dense_with_a_warning(monkeypatch):
    def no_convergence(*args, **kwargs):
        raise scipy.sparse.linalg.ArpackNoConvergence("no convergence", np.zeros(0), np.zeros((0, 0)))

    monkeypatch.setattr(scipy.sparse.linalg, "eigsh", no_convergence)
    rng = np.random.default_rng(0)
    F = rng.standard_normal((200, 3)) @ rng.standard_normal((3, 20))
    a = rng.standard_normal(200)
    with pytest.warns(RuntimeWarning, match="ARPACK"):
        out, _ = run(a, F)
    np.testing.assert_allclose(out, reference(a, F, "full")[0], rtol=1e-7, atol=1e-9)


# ---- invariants and numeric edges ----


def isotropic_features(m, seed, D=None):
    """Orthogonal rows of equal norm: K = c I, PR = m, so k = m and P_k = I."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((D or m + 3, m)))[0]
    return Q.T * 10.0 ** rng.uniform(-2, 2)


@settings(max_examples=30)
@given(m=st.integers(2, 24), seed=st.integers(0, 10**6), variant=st.sampled_from(list(VARIANTS)))
def test_full_subspace_and_zero_alpha_leave_the_projector_variants_at_the_advantages(m, seed, variant):
    a = np.random.default_rng(seed + 1).standard_normal(m)
    F = isotropic_features(m, seed)
    out, stats = run(a, F, "fixed-alpha", alpha=0.0)
    np.testing.assert_allclose(out, a, rtol=1e-12, atol=1e-12)
    assert stats["exp_norm"] == 0.0
    # k = m leaves no residual subspace: a' = a wherever P_k projects (the nulls then permute a)
    spec = VARIANTS[variant]
    out, stats = run(a, F, variant, seed)
    assert stats["k"] == m and stats["U_perp"] == 0.0 and stats["U_perp_gain"] == 1.0
    if spec.projector != "none" and spec.main and spec.assign == "none":
        np.testing.assert_allclose(out, a, rtol=1e-12, atol=1e-12)
    if spec.assign != "none":
        np.testing.assert_allclose(np.sort(out), np.sort(a), rtol=1e-12, atol=1e-12)


@settings(max_examples=60)
@given(
    m=st.integers(1, 16),
    D=st.integers(1, 16),
    seed=st.integers(0, 10**6),
    variant=st.sampled_from(list(VARIANTS)),
    duplicate=st.booleans(),
    zero_frac=st.floats(0, 1),
    log_scale=st.floats(-40, 40),
)
def test_outputs_and_stats_are_finite_on_arbitrary_inputs(m, D, seed, variant, duplicate, zero_frac, log_scale):
    rng = np.random.default_rng(seed)
    F = rng.standard_normal((m, D)) * 10.0 ** rng.uniform(-3, 3, (m, 1)) * 10.0**log_scale
    F[rng.random(m) < zero_frac] = 0.0
    if duplicate:
        F = F[rng.integers(0, max(1, m // 2), m)]
    a = rng.standard_normal(m) * (rng.random(m) > zero_frac) * 10.0 ** rng.uniform(-3, 3)
    out, stats = run(a, F, variant, seed)
    assert np.isfinite(out).all()
    assert all(np.isfinite(v) or k == "U_perp_gain" for k, v in stats.items())  # gain = inf when U_⊥(a) = 0 < U_⊥(a')
    assert 0.0 <= stats["alpha"] <= 1.0 and stats["U_perp_gain"] >= 0.0


@settings(max_examples=40)
@given(data=batches(), seed=st.integers(0, 10**6))
def test_full_salt_is_permutation_equivariant(data, seed):
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)  # P_k unique
    perm = np.random.default_rng(seed).permutation(len(a))
    out, stats = run(a, F)
    out_perm, stats_perm = run(a[perm], F[perm])
    np.testing.assert_allclose(out_perm, out[perm], rtol=1e-7, atol=1e-9 * np.linalg.norm(a))
    # (not U_perp_gain: it jumps between 1 and inf where U_⊥(a) sits at the rounding floor of a zero update)
    for key in ("pr", "k", "n_eff_in", "n_eff_out", "alpha", "D_a", "D_g", "U_perp"):
        assert stats_perm[key] == pytest.approx(stats[key], rel=1e-7, abs=1e-9), key


@settings(max_examples=40)
@given(data=batches(), log2_c=st.integers(-900, 900), variant=st.sampled_from(list(VARIANTS)))
def test_salt_is_invariant_to_feature_scale_down_to_the_float64_extremes(data, log2_c, variant):
    """F → cF (c a power of two, so F·c is exact): the same a', k, α_t; U_⊥ scales by c, D_g without ε is fixed."""
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)
    c = 2.0**log2_c
    out, stats = run(a, F, variant, eps=0.0)
    out_scaled, stats_scaled = run(a, F * c, variant, eps=0.0)
    np.testing.assert_allclose(out_scaled, out, rtol=1e-9, atol=1e-12 * np.linalg.norm(a))
    assert stats_scaled["k"] == stats["k"]
    for key in ("alpha", "pr", "n_eff_in", "n_eff_out", "D_a", "D_g", "U_perp_gain"):
        assert stats_scaled[key] == pytest.approx(stats[key], rel=1e-9, abs=1e-12), key
    assert stats_scaled["U_perp"] == pytest.approx(c * stats["U_perp"], rel=1e-9, abs=1e-12 * c)


@settings(max_examples=30)
@given(data=batches(), log2_c=st.integers(-400, 400), variant=st.sampled_from(list(VARIANTS)))
def test_inner_products_give_what_the_features_give(data, log2_c, variant):
    """InnerProducts(F Fᵀ) in place of F: the same K = G/m, so the same a', k_t, α_t and stats in F's units (U_⊥),
    at any scale of F (G's scale² is split into a power of two F never had to reach)."""
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)
    F = F * 2.0**log2_c
    a = torch.tensor(a)
    out, stats, geometry = salt_advantages(a, torch.tensor(F), variant, return_basis=True, **kwargs_for(variant))
    given_g = InnerProducts(torch.tensor(F @ F.T))
    out_g, stats_g, geometry_g = salt_advantages(a, given_g, variant, return_basis=True, **kwargs_for(variant))
    torch.testing.assert_close(out_g, out, rtol=1e-7, atol=1e-9 * float(a.norm()))
    assert stats_g["k"] == stats["k"]
    for key in STAT_KEYS - {"solve_ms"}:
        assert stats_g[key] == pytest.approx(stats[key], rel=1e-7, abs=1e-9 * max(abs(stats[key]), 1e-300)), key
    torch.testing.assert_close(geometry_g.gram, geometry.gram, rtol=1e-9, atol=0)


@settings(max_examples=30)
@given(data=batches(), variant=st.sampled_from(list(VARIANTS)))
def test_inner_products_with_their_eigendecomposition_give_what_the_features_give(data, variant):
    """InnerProducts(G, eigh(G)), the eigensolve formed where G is (the fork's ranks): the same a', k_t and stats as
    the features, whichever side (top k_t or the complement) the basis is read from."""
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)
    a, G = torch.tensor(a), torch.tensor(F @ F.T)
    out, stats, geometry = salt_advantages(a, torch.tensor(F), variant, return_basis=True, **kwargs_for(variant))
    given = InnerProducts(G, torch.linalg.eigh(G))
    out_g, stats_g, geometry_g = salt_advantages(a, given, variant, return_basis=True, **kwargs_for(variant))
    torch.testing.assert_close(out_g, out, rtol=1e-7, atol=1e-9 * float(a.norm()))
    assert stats_g["k"] == stats["k"] and geometry_g.is_top == (2 * stats["k"] <= len(a) or stats["k"] == len(a))
    # U⊥ of a' in P_k's complement is rounding here, and its gain a ratio of two such
    residual = 1e-12 * float(a.norm()) * float(np.linalg.norm(F))
    for key in STAT_KEYS - {"solve_ms", "U_perp_gain"}:
        tolerance = residual if key == "U_perp" else 1e-9 * max(abs(stats[key]), 1e-300)
        assert stats_g[key] == pytest.approx(stats[key], rel=1e-7, abs=tolerance), key
    P = geometry.basis @ geometry.basis.T  # the same projector P_k, from either side
    P_g = geometry_g.basis @ geometry_g.basis.T
    eye = torch.eye(len(a), dtype=torch.float64)
    torch.testing.assert_close(
        P_g if geometry_g.is_top else eye - P_g, P if geometry.is_top else eye - P, atol=1e-7, rtol=0
    )


def test_inner_products_that_cannot_stand_for_features_raise_naming_them():
    a, F = torch.tensor(grpo([1, 0, 0, 1, 1, 0, 1, 1])), torch.randn(8, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="InnerProducts need gram='raw'"):
        salt_advantages(a, InnerProducts(F @ F.T), gram="shrink")
    with pytest.raises(ValueError, match=r"one row per advantage.*InnerProducts \(8, 5\)"):
        salt_advantages(a, InnerProducts(F))
    with pytest.raises(ValueError, match=r"features must have shape \(m, m\)"):
        salt_advantages(a, InnerProducts(torch.ones(8, dtype=torch.float64)))
    with pytest.raises(ValueError, match="features contains NaN"):
        salt_advantages(a, InnerProducts(torch.full((8, 8), math.nan, dtype=torch.float64)))
    lam, vecs = torch.linalg.eigh(F @ F.T)
    with pytest.raises(ValueError, match=r"InnerProducts.eigh must be G's finite eigenvalues \(8,\)"):
        salt_advantages(a, InnerProducts(F @ F.T, (lam[:7], vecs)))


@pytest.mark.parametrize("c", [1e-30, 1e-20, 1e20, 1e30])
def test_tiny_and_huge_float32_features_give_the_unit_scale_coefficients(c):
    """float32 squares underflow below ~1e-23 and overflow above ~1e19: the solve must not see them."""
    rng = np.random.default_rng(2)
    shared = rng.standard_normal(12)  # rollouts share a direction: zero-sum advantages cancel, α_t > 0
    F = (shared + rng.standard_normal((16, 3)) @ rng.standard_normal((3, 12))).astype(np.float32)
    a = torch.tensor(grpo(rng.integers(0, 2, 16)))
    out, stats = salt_advantages(a, torch.tensor(F))
    out_c, stats_c = salt_advantages(a, torch.tensor(F) * c)
    assert stats["alpha"] > 0.05  # the exploration channel is on, so a lost ε-scale α would show
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    assert stats_c["alpha"] == pytest.approx(stats["alpha"], rel=1e-5)
    assert stats_c["U_perp"] == pytest.approx(c * stats["U_perp"], rel=1e-4)


def test_stats_keep_the_units_of_the_features_with_absolute_epsilon():
    """Eq. 59-60's ε is absolute: at a feature scale where Σa²K_ii ≪ ε, n_eff (Eq. 60) → 0, while α_t (Eq. 17 on
    Eq. 6, no ε) and a' do not move."""
    rng = np.random.default_rng(6)
    F = rng.standard_normal((8, 5))
    a = rng.standard_normal(8)
    out, stats = run(a, F)
    out_tiny, tiny = run(a, F * 1e-9)
    np.testing.assert_allclose(out_tiny, out, rtol=1e-9)
    assert tiny["alpha"] == pytest.approx(stats["alpha"])
    assert tiny["n_eff_in"] < 1e-6 * stats["n_eff_in"]


# ---- degenerate inputs ----


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_zero_advantages_are_returned_unchanged_with_alpha_reported(variant):
    a = torch.zeros(12)
    F = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    out, stats = salt_advantages(a, F, variant, **kwargs_for(variant))
    assert torch.equal(out, a)
    expected_alpha = {"fixed": ALPHA, "entropy": ENTROPY_ALPHA, "pr": min(stats["pr"] / 11, 1.0)}.get(
        VARIANTS[variant].alpha_rule, 1.0
    )
    assert stats["n_eff_in"] == stats["n_eff_out"] == 0.0
    assert stats["alpha"] == pytest.approx(expected_alpha)
    assert stats["D_a"] == stats["D_g"] == stats["main_norm"] == stats["exp_norm"] == stats["U_perp"] == 0.0
    assert stats["U_perp_gain"] == 1.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_features_give_the_identity_with_documented_stats(variant):
    a = torch.tensor([1.0, -0.5, -0.5, 2.0])
    out, stats, (basis, is_top, _) = salt_advantages(
        a, torch.zeros(4, 3), variant, **kwargs_for(variant), return_basis=True
    )
    assert torch.equal(out, a)
    assert (stats["pr"], stats["k"], stats["n_eff_in"], stats["gap"]) == (0.0, 0.0, 0.0, 0.0)
    assert stats["main_norm"] == pytest.approx(float(a.norm()))
    assert stats["exp_norm"] == stats["D_a"] == stats["D_g"] == stats["U_perp"] == 0.0
    assert stats["U_perp_gain"] == 1.0
    assert basis.shape == (4, 0) and is_top  # P_k = 0: no geometry
    if VARIANTS[variant].alpha_rule == "n_eff":
        assert stats["alpha"] == 1.0  # Eq. 6: 0/0 := 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_single_response_is_returned_unchanged(variant):
    a = torch.tensor([0.7])
    out, stats, (basis, is_top, _) = salt_advantages(
        a, torch.tensor([[1.0, 2.0]]), variant, **kwargs_for(variant), return_basis=True
    )
    assert torch.equal(out, a)
    assert (stats["pr"], stats["k"], stats["m"], stats["gap"]) == (1.0, 1.0, 1.0, 1.0)
    assert basis.shape == (1, 0) and not is_top  # P_k = I


def test_identical_features_give_the_rank_one_closed_form():
    # K = (‖g‖²/m) 11ᵀ: PR = 1, k = 1, P_1 = 11ᵀ/m; GRPO advantages sum to 0, so n_eff = 0 and α = 1.
    rng = np.random.default_rng(0)
    g = rng.standard_normal(6)
    F = np.tile(g, (8, 1))
    a = grpo([1, 0, 0, 1, 1, 0, 0, 0], group=8)
    out, stats = run(a, F)
    pos = np.maximum(a, 0)
    expected = a.mean() + 1.0 * (pos - pos.mean())
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)
    assert (stats["pr"], stats["k"]) == (pytest.approx(1.0), 1.0)
    assert stats["alpha"] == 1.0
    # Σ a_i g_i = (Σ a_i) g = 0 and likewise for a' (its entries sum to Σ a_i = 0): both updates vanish
    assert stats["D_g"] == stats["U_perp"] == 0.0 and stats["U_perp_gain"] == 1.0
    np.testing.assert_allclose(out, reference(a, F, "full")[0], rtol=1e-10, atol=1e-12)


def test_exploration_of_a_cancelled_update_has_infinite_residual_gain():
    # rows 2 and 3 share a gradient and carry opposite advantages: Σ a_i g_i = 0. PR ≈ 1.04, so k = 1 leaves g2's
    # direction in the residual subspace, where a_exp = P_1^⊥ [a]₊ = e2 has energy: a nonzero update from a zero one.
    F = np.array([[10.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    a = np.array([0.0, 1.0, -1.0])
    out, stats = run(a, F)
    assert (stats["k"], stats["n_eff_in"], stats["alpha"]) == (1.0, 0.0, 1.0)
    np.testing.assert_allclose(out, [0.0, 1.0, 0.0], atol=1e-12)
    assert stats["D_g"] == pytest.approx((1 / 3) / 1e-8)  # ‖ĝ(a)‖ = 0, ‖ĝ(a')‖ = ‖g2‖ / 3: D_g = ‖ĝ(a')‖ / ε
    assert stats["U_perp"] == pytest.approx(1 / 3)  # all of ĝ(a') is residual: P_1 = e1 e1ᵀ
    assert stats["U_perp_gain"] == math.inf


# ---- bad input, dtypes, determinism ----


@pytest.mark.parametrize("name", ["advantages", "features"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs_raise_naming_the_argument(name, bad):
    a, F = torch.randn(4), torch.randn(4, 3)
    (a if name == "advantages" else F).view(-1)[1] = bad
    with pytest.raises(ValueError, match=name):
        salt_advantages(a, F)


@pytest.mark.parametrize(
    "a, F, match",
    [
        (torch.randn(4, 1), torch.randn(4, 3), r"advantages must have shape \(m,\)"),
        (torch.randn(4), torch.randn(4), r"features must have shape \(m, D\)"),
        (torch.randn(4), torch.randn(5, 3), "one row per advantage"),
        (torch.randn(0), torch.randn(0, 3), "empty"),
        (torch.arange(4), torch.randn(4, 3), "advantages must be a floating-point"),
        (np.zeros(4), torch.randn(4, 3), "advantages must be a floating-point"),
    ],
)
def test_wrong_shapes_and_types_raise(a, F, match):
    with pytest.raises(ValueError, match=match):
        salt_advantages(a, F)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"variant": "salt"}, "valid variants: full, only-main"),
        ({"variant": "fixed-alpha"}, "alpha is required by, and only used with, variant fixed-alpha"),
        ({"variant": "fixed-alpha", "alpha": -0.1}, r"alpha must be a number in \[0, 1\]"),
        ({"variant": "fixed-alpha", "alpha": 1.01}, r"alpha must be a number in \[0, 1\]"),
        ({"variant": "full", "alpha": 0.5}, "alpha is required by, and only used with"),
        ({"variant": "entropy-alpha"}, "entropy is required"),
        ({"variant": "entropy-alpha", "entropy": 1.5}, r"entropy must be entropy_alpha.* in \[0, 1\]"),
        ({"variant": "full", "entropy": 0.5}, "entropy is required by, and only used with"),
        ({"eps": -1.0}, "eps must be"),
        ({"eps": math.inf}, "eps must be"),
    ],
)
def test_misused_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        salt_advantages(torch.randn(4), torch.randn(4, 3), **kwargs)


def test_bf16_inputs_give_bf16_outputs_equal_to_the_float64_solve_of_the_same_values():
    # The Gram of bf16/float32 features is formed in float32 (diagnostics.gram): stats agree to float32 rounding.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, generator=gen).to(torch.bfloat16)
    F = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    out, stats = salt_advantages(a, F)
    out64, stats64 = salt_advantages(a.double(), F.double())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, out64.to(torch.bfloat16))
    assert stats["alpha"] == pytest.approx(stats64["alpha"], rel=1e-6, abs=1e-9)


def test_output_keeps_the_advantage_dtype_and_leaves_inputs_untouched():
    a = torch.randn(10, requires_grad=True)
    F = torch.randn(10, 4, dtype=torch.float16)
    a_before, F_before = a.detach().clone(), F.clone()
    out, _ = salt_advantages(a, F * 1024)
    assert out.dtype == torch.float32 and not out.requires_grad
    assert torch.equal(a.detach(), a_before) and torch.equal(F, F_before)


@pytest.mark.parametrize("variant", [n for n, v in VARIANTS.items() if randomised(v)])
def test_randomised_variants_are_deterministic_under_a_fixed_generator(variant):
    gen = torch.Generator().manual_seed
    rng = np.random.default_rng(1)
    a = torch.tensor(rng.standard_normal(24))
    F = torch.tensor(rng.standard_normal((24, 10)) + rng.standard_normal(10))
    first, _ = salt_advantages(a, F, variant, generator=gen(7))
    again, _ = salt_advantages(a, F, variant, generator=gen(7))
    other, _ = salt_advantages(a, F, variant, generator=gen(8))
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


def test_deterministic_variants_draw_nothing():
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    for name, spec in VARIANTS.items():
        if not randomised(spec):
            salt_advantages(torch.randn(12), torch.randn(12, 4), name, **{**kwargs_for(name), "generator": gen})
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e20])
def test_returned_gram_is_in_the_features_own_units_at_any_scale(scale):
    F = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * scale
    a = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    _, _, (_, _, gram) = salt_advantages(a, F, return_basis=True)
    expected = (F @ F.T / 6).numpy()
    np.testing.assert_allclose(gram.numpy(), expected, rtol=1e-12, atol=0.0)
