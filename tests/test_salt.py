"""SALT Eq. 12-18 and the App. F.3 variants against a brute-force numpy float64 reference, plus invariants."""

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from openrlhf_geo import diagnostics
from openrlhf_geo.salt import LANCZOS_MAX_FRACTION, VARIANTS, _top_eigenspace, salt_advantages

ALPHA, ENTROPY = 0.37, 0.25
STAT_KEYS = {
    *("pr", "k", "n_eff", "alpha", "n_eff_out", "gap", "main_norm", "exp_norm", "D_a", "D_g", "U_perp", "m"),
    "solve_ms",
}
PROJECTOR_VARIANTS = ("full", "only-main", "no-pos", "fixed-alpha", "pr-alpha", "entropy-alpha", "permuted")


def kwargs_for(variant, seed=0):
    kw = {"generator": torch.Generator().manual_seed(seed)}
    if variant == "fixed-alpha":
        kw["alpha"] = ALPHA
    if variant == "entropy-alpha":
        kw["entropy"] = ENTROPY
    return kw


def reference(a, F, variant, seed=0, eps=1e-8):
    """Brute force: full np.linalg.eigh, explicit m×m projector matrices; random draws per the documented protocol."""
    m = len(a)
    K = F @ F.T / m
    lam, Q = np.linalg.eigh(K)
    Q = Q[:, ::-1]
    pr = np.trace(K) ** 2 / np.sum(K * K)
    k = int(min(max(np.floor(pr + 0.5), 1), m))
    gen = torch.Generator().manual_seed(seed)
    K_used, basis = K, Q[:, :k]
    if variant == "permuted":
        perm = torch.randperm(m, generator=gen).numpy()
        K_used = K[np.ix_(perm, perm)]
        basis = np.linalg.eigh(K_used)[1][:, ::-1][:, :k]
    elif variant == "rand-proj":
        basis = np.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64).numpy())[0]
    elif variant == "matched-rand-subspace":
        basis = Q[:, torch.randperm(m, generator=gen)[:k].numpy()]
    P = basis @ basis.T
    P_perp = np.eye(m) - P
    n_eff = a @ K_used @ a / (np.sum(a**2 * np.diag(K_used)) + eps)
    alpha = {"fixed-alpha": ALPHA, "pr-alpha": max(0.0, 1 - pr / m), "entropy-alpha": 1 - ENTROPY}.get(
        variant, max(0.0, 1 - n_eff)
    )
    pos = np.maximum(a, 0)
    main, explore = {
        "no-proj": (a, pos),
        "no-pos": (P @ a, P_perp @ a),
        "only-main": (P @ a, 0 * a),
        "only-exp": (0 * a, P_perp @ pos),
    }.get(variant, (P @ a, P_perp @ pos))
    new = main + alpha * explore
    r = (np.eye(m) - Q[:, :k] @ Q[:, :k].T) @ new  # residual w.r.t. the true top-k eigenspace

    def energy_ratio(x, y):  # None when y's update is (near) zero: that convention is tested on exact cases
        den = y @ K @ y
        return None if den <= 1e-9 * (y @ y) * np.trace(K) else max(x @ K @ x, 0.0) / den

    stats = {
        "pr": pr,
        "k": k,
        "n_eff": n_eff,
        "alpha": alpha,
        "n_eff_out": new @ K @ new / (np.sum(new**2 * np.diag(K)) + eps),
        "main_norm": np.linalg.norm(main),
        "exp_norm": np.linalg.norm(alpha * explore),
        "D_a": np.linalg.norm(new - a) / np.linalg.norm(a),
        "D_g": None if energy_ratio(new - a, a) is None else np.sqrt(energy_ratio(new - a, a)),
        "U_perp": energy_ratio(r, new),
    }
    return new, stats


def relative_gaps(F):
    """Relative eigengap at the SALT boundary k and the smallest relative spacing of K's spectrum."""
    K = F @ F.T / len(F)
    lam = np.clip(np.linalg.eigvalsh(K)[::-1], 0, None)
    k = int(min(max(np.floor(lam.sum() ** 2 / (lam**2).sum() + 0.5), 1), len(F)))
    boundary = 1.0 if k == len(F) else (lam[k - 1] - lam[k]) / lam[0]
    return boundary, np.min(-np.diff(lam)) / lam[0] if len(F) > 1 else 1.0


@st.composite
def batches(draw, max_m=20, max_d=32, full_rank=False):
    """(a (m,), F (m, D)) float64 numpy: GRPO-normalized or Gaussian advantages; grouped, low-rank or Gaussian F."""
    m = draw(st.integers(2, max_m))
    D = draw(st.integers(m, m + 8) if full_rank else st.integers(1, max_d))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    structure = draw(st.sampled_from(["gaussian", "grouped", "low-rank"]))
    F = rng.standard_normal((m, D))
    if structure == "grouped":  # rollouts of one prompt share a direction
        prompt = rng.integers(0, max(1, m // 4), m)
        F = 2.0 * rng.standard_normal((m, D))[prompt] + F
    elif structure == "low-rank" and not full_rank:
        F = rng.standard_normal((m, 3)) @ rng.standard_normal((3, D)) + 0.05 * F
    F *= 10.0 ** rng.uniform(-1, 1, (m, 1))
    if draw(st.booleans()):  # GRPO: binary rewards, normalized within groups of 4
        r = rng.integers(0, 2, m).astype(float)
        groups = np.arange(m) // 4
        mean = np.array([r[groups == g].mean() for g in groups])
        std = np.array([r[groups == g].std() for g in groups])
        a = (r - mean) / (std + 1e-6)
    else:
        a = rng.standard_normal(m)
    assume(np.linalg.norm(a) > 1e-3)
    return a, F


def run(a, F, variant="full", seed=0, **kw):
    out, stats = salt_advantages(torch.tensor(a), torch.tensor(F), variant, **{**kwargs_for(variant, seed), **kw})
    return out.numpy(), stats


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=12)
@given(data=st.data(), seed=st.integers(0, 1000))
def test_every_variant_matches_brute_force(variant, data, seed):
    a, F = data.draw(batches(full_rank=variant == "matched-rand-subspace"))
    boundary, spacing = relative_gaps(F)
    assume(boundary > 1e-4)
    if variant == "matched-rand-subspace":
        assume(spacing > 1e-6)  # eigenvectors unique up to sign, so a random pick names the same vectors
    out, stats = run(a, F, variant, seed)
    expected, ref = reference(a, F, variant, seed)
    scale = np.linalg.norm(a)
    np.testing.assert_allclose(out, expected, rtol=1e-7, atol=1e-8 * scale)
    assert stats.keys() == STAT_KEYS
    assert all(type(v) is float for v in stats.values())
    for key, value in ref.items():
        if value is not None:
            assert stats[key] == pytest.approx(value, rel=1e-6, abs=1e-8 * max(1.0, scale)), key


def test_full_salt_on_a_larger_low_rank_batch_takes_the_lanczos_path_and_matches_brute_force():
    rng = np.random.default_rng(3)
    m = 256
    F = rng.standard_normal((m, 6)) @ rng.standard_normal((6, 64)) + 0.1 * rng.standard_normal((m, 64))
    a = rng.standard_normal(m)
    out, stats = run(a, F)
    assert stats["k"] + 1 <= LANCZOS_MAX_FRACTION * m
    np.testing.assert_allclose(out, reference(a, F, "full")[0], rtol=1e-7, atol=1e-9)


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


def isotropic_features(m, seed, D=None):
    """Orthogonal rows of equal norm: K = c I, PR = m, so k = m and P_k = I."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((D or m + 3, m)))[0]
    return Q.T * 10.0 ** rng.uniform(-2, 2)


@settings(max_examples=30)
@given(m=st.integers(2, 24), seed=st.integers(0, 10**6))
def test_full_subspace_keeps_the_main_channel_equal_to_the_advantages(m, seed):
    a = np.random.default_rng(seed + 1).standard_normal(m)
    out, stats = run(a, isotropic_features(m, seed), "only-main")
    assert stats["k"] == m
    np.testing.assert_allclose(out, a, rtol=1e-12, atol=1e-12)
    assert stats["main_norm"] == pytest.approx(np.linalg.norm(a))


@settings(max_examples=30)
@given(m=st.integers(2, 24), seed=st.integers(0, 10**6), variant=st.sampled_from(PROJECTOR_VARIANTS))
def test_zero_alpha_and_full_subspace_return_the_advantages(m, seed, variant):
    a = np.random.default_rng(seed + 1).standard_normal(m)
    F = isotropic_features(m, seed)
    out, stats = run(a, F, "fixed-alpha", alpha=0.0)
    np.testing.assert_allclose(out, a, rtol=1e-12, atol=1e-12)
    assert stats["exp_norm"] == 0.0
    # k = m leaves no residual subspace, so every projector variant returns a whatever its α_t
    out, stats = run(a, F, variant)
    np.testing.assert_allclose(out, a, rtol=1e-12, atol=1e-12)
    assert stats["U_perp"] == 0.0


@settings(max_examples=60)
@given(
    m=st.integers(1, 16),
    D=st.integers(1, 16),
    seed=st.integers(0, 10**6),
    variant=st.sampled_from(VARIANTS),
    duplicate=st.booleans(),
    zero_frac=st.floats(0, 1),
    log_scale=st.floats(-6, 6),
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
    assert all(np.isfinite(v) or k == "D_g" for k, v in stats.items())  # D_g = inf when aᵀKa = 0 < a'ᵀKa'
    assert 0.0 <= stats["U_perp"] <= 1.0
    assert stats["alpha"] >= 0.0


@settings(max_examples=40)
@given(data=batches(), seed=st.integers(0, 10**6))
def test_full_salt_is_permutation_equivariant(data, seed):
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)  # P_k unique
    perm = np.random.default_rng(seed).permutation(len(a))
    out, stats = run(a, F)
    out_perm, stats_perm = run(a[perm], F[perm])
    np.testing.assert_allclose(out_perm, out[perm], rtol=1e-7, atol=1e-9 * np.linalg.norm(a))
    for key in ("pr", "k", "n_eff", "alpha", "D_a", "D_g", "U_perp"):
        assert stats_perm[key] == pytest.approx(stats[key], rel=1e-7, abs=1e-9), key


@settings(max_examples=40)
@given(data=batches(), log_c=st.floats(-3, 3), variant=st.sampled_from(VARIANTS))
def test_salt_is_invariant_to_feature_scale(data, log_c, variant):
    a, F = data
    assume(relative_gaps(F)[0] > 1e-4)
    out, stats = run(a, F, variant, eps=0.0)
    out_scaled, stats_scaled = run(a, F * 10.0**log_c, variant, eps=0.0)
    np.testing.assert_allclose(out_scaled, out, rtol=1e-7, atol=1e-9 * np.linalg.norm(a))
    assert stats_scaled["k"] == stats["k"]
    assert stats_scaled["alpha"] == pytest.approx(stats["alpha"], rel=1e-7, abs=1e-12)


def test_u_perp_stat_equals_the_diagnostic_on_the_dense_eigendecomposition():
    rng = np.random.default_rng(5)
    F = rng.standard_normal((40, 4)) @ rng.standard_normal((4, 30)) + 0.3 * rng.standard_normal((40, 30))
    a = rng.standard_normal(40)
    out, stats = run(a, F)
    K = diagnostics.gram(torch.tensor(F))
    assert stats["U_perp"] == pytest.approx(diagnostics.residual_share(torch.tensor(out), K, int(stats["k"])))
    assert stats["U_perp"] > 0  # the exploration channel lives in the residual subspace


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_zero_advantages_are_returned_unchanged_with_alpha_reported(variant):
    a = torch.zeros(12)
    F = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    out, stats = salt_advantages(a, F, variant, **kwargs_for(variant))
    assert torch.equal(out, a)
    expected_alpha = {"fixed-alpha": ALPHA, "entropy-alpha": 1 - ENTROPY}.get(variant, 1.0)
    if variant == "pr-alpha":
        expected_alpha = 1 - stats["pr"] / 12
    assert stats["n_eff"] == 0.0
    assert stats["alpha"] == pytest.approx(expected_alpha)
    assert stats["D_a"] == stats["D_g"] == stats["main_norm"] == stats["exp_norm"] == 0.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_features_give_the_identity_with_documented_stats(variant):
    a = torch.tensor([1.0, -0.5, -0.5, 2.0])
    out, stats = salt_advantages(a, torch.zeros(4, 3), variant, **kwargs_for(variant))
    assert torch.equal(out, a)
    assert (stats["pr"], stats["k"], stats["n_eff"], stats["gap"]) == (0.0, 0.0, 0.0, 0.0)
    assert stats["main_norm"] == pytest.approx(float(a.norm()))
    assert stats["exp_norm"] == stats["D_a"] == stats["D_g"] == stats["U_perp"] == 0.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_single_response_is_returned_unchanged(variant):
    a = torch.tensor([0.7])
    out, stats = salt_advantages(a, torch.tensor([[1.0, 2.0]]), variant, **kwargs_for(variant))
    assert torch.equal(out, a)
    assert (stats["pr"], stats["k"], stats["m"]) == (1.0, 1.0, 1.0)


def test_identical_features_give_the_rank_one_closed_form():
    # K = (‖g‖²/m) 11ᵀ: PR = 1, k = 1, P_1 = 11ᵀ/m; GRPO advantages sum to 0, so n_eff = 0 and α = 1.
    rng = np.random.default_rng(0)
    g = rng.standard_normal(6)
    F = np.tile(g, (8, 1))
    r = np.array([1, 0, 0, 1, 1, 0, 0, 0.0])
    a = (r - r.mean()) / (r.std() + 1e-6)
    out, stats = run(a, F)
    pos = np.maximum(a, 0)
    expected = a.mean() + 1.0 * (pos - pos.mean())
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)
    assert (stats["pr"], stats["k"]) == (pytest.approx(1.0), 1.0)
    assert stats["alpha"] == pytest.approx(1.0)
    # Σ a_i g_i = (Σ a_i) g = 0 and likewise for a' (its entries sum to Σ a_i = 0): both updates vanish, 0/0 := 0
    assert stats["D_g"] == stats["U_perp"] == 0.0
    np.testing.assert_allclose(out, reference(a, F, "full")[0], rtol=1e-10, atol=1e-12)


def test_exploration_of_a_cancelled_update_reports_infinite_update_change():
    # rows 2 and 3 share a gradient and carry opposite advantages: Σ a_i g_i = 0. PR ≈ 1.04, so k = 1 leaves g2's
    # direction in the residual subspace, where a_exp = P_1^⊥ [a]₊ = e2 has energy: a nonzero update from a zero one.
    F = np.array([[10.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    a = np.array([0.0, 1.0, -1.0])
    out, stats = run(a, F)
    assert (stats["k"], stats["n_eff"], stats["alpha"]) == (1.0, 0.0, 1.0)
    np.testing.assert_allclose(out, [0.0, 1.0, 0.0], atol=1e-12)
    assert stats["D_g"] == float("inf")
    assert stats["U_perp"] == pytest.approx(1.0)


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
        ({"variant": "fixed-alpha"}, "alpha is required"),
        ({"variant": "fixed-alpha", "alpha": -0.1}, "alpha must be"),
        ({"variant": "full", "alpha": 0.5}, "alpha is required by, and only used with"),
        ({"variant": "entropy-alpha"}, "entropy is required"),
        ({"variant": "entropy-alpha", "entropy": 1.5}, r"entropy must be .* in \[0, 1\]"),
        ({"variant": "full", "entropy": 0.5}, "entropy is required by, and only used with"),
        ({"eps": -1.0}, "eps must be"),
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
    a_before = a.detach().clone()
    out, _ = salt_advantages(a, F)
    assert out.dtype == torch.float32 and not out.requires_grad
    assert torch.equal(a.detach(), a_before)


@pytest.mark.parametrize("variant", ["rand-proj", "permuted", "matched-rand-subspace"])
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
