"""SALT diagnostics (arXiv 2606.05800 §2.2, App. B, D.1, F.5): geometry of coefficient vectors under a gradient Gram.

Notation: m responses with (proxy) gradients g_i, the rows of F (m, D); Gram K = F Fᵀ / m (m, m) (Eq. 4/42);
coefficients c (m,), e.g. the advantages weighting each response in the update Σ_i c_i g_i.

Pure functions: tensors (or array-likes) of any float dtype and device in, float64 inside, python floats out.
NaN/inf inputs and wrong shapes raise ValueError naming the argument. Ratios whose numerator and denominator are
both 0 are defined as 0 unless a function states otherwise; x/0 := inf for x > 0.
"""

import math

import torch

from openrlhf_geo.groups import group_index


def _checked(x, name: str, shape: str) -> torch.Tensor:
    """`x` as a finite tensor of the documented `shape`: "(m,)", "(m, D)" or "(m, m)"."""
    x = torch.as_tensor(x).detach()
    if x.ndim != (1 if shape == "(m,)" else 2):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty (m = 0)")
    # One reduction, not a bool mask (an order of magnitude cheaper at m = 4096), in x's precision (at least float32;
    # a float64 sum of float32 features took 14× as long): NaN/inf make the sum non-finite; an overflowing sum of
    # finite entries falls through to the exact check.
    if not torch.isfinite(x.sum(dtype=torch.promote_types(x.dtype, torch.float32))) and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")
    return x


def _float64(x, name: str, shape: str) -> torch.Tensor:
    """`x` as a finite float64 tensor of the documented `shape`."""
    return _checked(x, name, shape).to(torch.float64)


def _coeffs_gram(coeffs, gram, name: str = "coeffs") -> tuple[torch.Tensor, torch.Tensor]:
    c = _float64(coeffs, name, "(m,)")
    K = _float64(gram, "gram", "(m, m)").to(c.device)
    if K.shape != (c.numel(), c.numel()):
        raise ValueError(f"gram must have shape (m, m) = {(c.numel(),) * 2} for {name} (m,), got {tuple(K.shape)}")
    return c, K


def _ratio(num: float, den: float) -> float:
    """num / den with 0/0 := 0 and x/0 := inf (x > 0)."""
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _energy(x: torch.Tensor, K: torch.Tensor) -> float:
    """xᵀKx (= m ‖Σ_i x_i g_i‖² / m²); within rounding of 0 (≤ 4·m·u·‖x‖²·tr K) or below it, 0: a zero update."""
    energy = float(x @ K @ x)
    noise = 4 * K.shape[0] * torch.finfo(torch.float64).eps * float(x @ x) * float(K.diagonal().abs().sum())
    return energy if energy > noise else 0.0


def _group_index(group_ids, m: int) -> tuple[torch.Tensor, int]:
    """Group index (m,) in 0..B-1 (groups in sorted-id order) and the number of groups B."""
    try:
        ids = torch.as_tensor(group_ids)
    except (TypeError, ValueError, RuntimeError):  # e.g. strings, or ragged lists: no tensor to check
        ids = None
    if ids is None or ids.shape != (m,) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if ids is not None else f"{str(group_ids)[:60]} (not integers)"
        raise ValueError(f"group_ids must be an integer tensor of shape (m,) = ({m},), got {got}")
    return group_index(ids)


def unit_scale(x) -> float:
    """A power of two s with s ≤ max|x| < 2s (1 when x = 0): x / s is exact, with entries in (−2, 2).

    Dividing by s before squaring keeps F Fᵀ inside the floating-point range whatever the scale of F; s itself is
    representable in x's dtype because s ≤ max|x|.
    """
    x = torch.as_tensor(x).detach()
    if not x.numel():
        return 1.0
    low, high = torch.aminmax(x)  # no |x| copy: at m = 1024, D = 102400 that copy cost 0.2 s
    peak = max(-float(low), float(high))
    return math.ldexp(1.0, math.frexp(peak)[1] - 1) if peak > 0 else 1.0


def gram(features) -> torch.Tensor:
    """SALT Eq. 4/42: K = F Fᵀ / m for features F (m, D); returns (m, m) float64 (exactly symmetric) on F's device.

    The product runs in F's precision, at least float32 (float64 features stay float64): it dominates SALT's cost
    at large m (m = 4096, D = 4096: 3.4 s in float32 vs 9.0 s in float64 on 2 cores), and float32 rounding (~1e-6
    relative) is far below the sketch's noise. F is divided by `unit_scale(F)` before the product and K multiplied
    back in float64, so finite features never overflow (float32 1e20) or underflow (float32 1e-30) in the squares.
    When max |F| lies in [2⁻⁴⁰, 2⁴⁰] F is used as it is (the copy took 0.2 s at m = 1024, D = 102400): no sum of
    squares can overflow, products of entries near the peak stay normal floats, and only products far below
    float32's resolution of K's largest entries can round differently (as subnormals) than after the power-of-two
    scale. `salt.salt_advantages` scales F itself first, so SALT's numbers do not depend on this.
    Raises ValueError when K itself lies beyond float64's range.
    """
    F = _checked(features, "features", "(m, D)")
    F = F.to(torch.promote_types(F.dtype, torch.float32))
    scale = unit_scale(F)
    if 2.0**-40 <= scale <= 2.0**40:
        scale = 1.0
    if scale != 1.0:
        F = F / scale
    K = (F @ F.T / F.shape[0]).to(torch.float64)
    K = (K + K.T) / 2 * scale * scale
    if not torch.isfinite(K).all():
        raise ValueError(f"features: the Gram F Fᵀ/m overflows float64 (max |F| ≈ {scale:.3g}); rescale the features")
    return K


def participation_ratio(gram) -> float:
    """SALT Eq. 5/43: PR = (Σλ)² / Σλ² = tr(K)² / ‖K‖_F² (no eigendecomposition); 0 for K = 0.

    For PSD K ≠ 0, 1 ≤ PR ≤ rank K: the number of directions that carry the energy. Eq. 43 clamps rounding-negative
    eigenvalues to 0 first; for a Gram they are O(u·λ_1), so the two agree to rounding. Scale-free (K → cK).
    """
    K = _float64(gram, "gram", "(m, m)")
    if K.shape[0] != K.shape[1]:
        raise ValueError(f"gram must be square (m, m), got {tuple(K.shape)}")
    K = K / unit_scale(K)  # tr² and ‖K‖² would overflow for |K| ≳ 1e154
    return _ratio(float(torch.trace(K)) ** 2, float(torch.linalg.vector_norm(K)) ** 2)


def effective_sample_size(coeffs, gram, eps: float = 1e-8) -> float:
    """SALT Eq. 60 (Gram form of Eq. 6/49): n_eff(c) = cᵀKc / (Σ_i c_i² K_ii + ε); 0 when c = 0 and ε = 0.

    n_eff = 1 for orthogonal gradients, ≈ 0 when the signed coefficients cancel. ε is absolute (in units of K);
    eps = 0 gives Eq. 6 exactly. A numerator within rounding of 0 (see _energy) counts as 0.
    """
    c, K = _coeffs_gram(coeffs, gram)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    return _ratio(_energy(c, K), float(c.square() @ K.diagonal()) + eps)


def effective_sample_size_vectors(coeffs, vectors) -> float:
    """SALT Eq. 6 / Eq. 49: n_eff = ‖Σ_i c_i g_i‖² / Σ_i c_i² ‖g_i‖² on explicit vectors g_i, the rows of (m, D).

    0 when every c_i g_i = 0. Equals `effective_sample_size(c, gram(vectors), eps=0)`.
    """
    c = _float64(coeffs, "coeffs", "(m,)")
    G = _float64(vectors, "vectors", "(m, D)").to(c.device)
    if G.shape[0] != c.numel():
        raise ValueError(f"vectors must have {c.numel()} rows, one per coefficient, got {G.shape[0]}")
    update = c @ G
    return _ratio(float(update @ update), float(c.square() @ G.square().sum(1)))


def _positive_alignment(K: torch.Tensor) -> float:
    """Eq. 7/38 on a Gram: mean [K_ij / √(K_ii K_jj)]₊ over pairs i < j of rows with K_ii > 0; 0 without a pair."""
    nonzero = K.diagonal() > 0
    K = K[nonzero][:, nonzero]
    n = K.shape[0]
    if n < 2:
        return 0.0
    inv = K.diagonal().rsqrt()
    positive = (K * inv[:, None] * inv[None, :]).clamp(0.0, 1.0)
    # the matrix is symmetric: the i < j mean is the off-diagonal mean
    return float((positive.sum() - positive.diagonal().sum()) / (n * (n - 1)))


def positive_alignment(features) -> float:
    """SALT Eq. 7/38: r = 2/(m(m−1)) Σ_{i<j} [cos(g_i, g_j)]₊ for the rows g_i of features (m, D).

    r → 1: the gradients share a direction, so signed zero-sum (GRPO) coefficients cancel in Σ_i c_i g_i. The text
    leaves cos undefined for a zero gradient: pairs run over the nonzero rows (m counts those); with fewer than two
    there is no pair and r = 0.
    """
    return _positive_alignment(gram(features))


def coefficient_change(old, new, eps: float = 1e-8) -> float:
    """SALT Eq. 59: D_a = ‖a' − a‖₂ / (‖a‖₂ + ε), the relative change of the coefficients (0/0 := 0 when ε = 0)."""
    a = _float64(old, "old", "(m,)")
    b = _float64(new, "new", "(m,)").to(a.device)
    if b.shape != a.shape:
        raise ValueError(f"new must have the shape of old {tuple(a.shape)}, got {tuple(b.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    return _ratio(float(torch.linalg.vector_norm(b - a)), float(torch.linalg.vector_norm(a)) + eps)


def update_change(old, new, gram, eps: float = 1e-8) -> float:
    """SALT Eq. 58-59: D_g = ‖ĝ(a') − ĝ(a)‖₂ / (‖ĝ(a)‖₂ + ε) with ‖ĝ(c)‖₂ = √(cᵀKc / m).

    The relative change of the update (1/m) Σ_i c_i g_i. ε is absolute (in units of ‖ĝ‖); with ε = 0 a zero old
    update (aᵀKa within rounding of 0) gives 0 if the new one is zero too, else inf.
    """
    a, K = _coeffs_gram(old, gram, "old")
    b = _float64(new, "new", "(m,)").to(a.device)
    if b.shape != a.shape:
        raise ValueError(f"new must have the shape of old {tuple(a.shape)}, got {tuple(b.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    m = a.numel()
    return _ratio(math.sqrt(_energy(b - a, K) / m), math.sqrt(_energy(a, K) / m) + eps)


def _basis(basis, m: int) -> torch.Tensor:
    B = _float64(basis, "basis", "(m, r)")
    if B.shape[0] != m:
        raise ValueError(f"basis must have shape (m, r) with m = {m}, got {tuple(B.shape)}")
    return B


def residual_strength(coeffs, gram, basis, is_top: bool = True) -> float:
    """SALT Eq. 61: U_⊥(c) = ‖(1/m) S P_k^⊥ c‖₂ = √((1/m) (P_k^⊥c)ᵀ K (P_k^⊥c)), the residual-channel strength.

    basis B (m, r) orthonormal: P_k = B Bᵀ when is_top, else B spans the complement and P_k = I − B Bᵀ (SALT's
    `salt_advantages(..., return_basis=True)` returns this pair). 0 for a residual within rounding of a zero update.
    """
    c, K = _coeffs_gram(coeffs, gram)
    B = _basis(basis, c.numel()).to(c.device)
    inside = B @ (B.T @ c)
    perp = c - inside if is_top else inside
    return math.sqrt(_energy(perp, K) / c.numel())


def salt_weight_stats(advantages, new, gram, basis, is_top: bool, lengths) -> dict:
    """Where SALT's coefficients put their weight (a diagnostic of the geometry, not in the paper) -> dict of floats.

    advantages a (m,), new a' (m,) (the applied coefficients), gram K (m, m) of the features (‖φ_i‖² = m·K_ii),
    (basis, is_top) the top-k_t eigenbasis SALT used for P_k (see residual_strength; k = r if is_top else m − r),
    lengths T (m,) response tokens.
      pk_rho_norm     Spearman correlation of diag(P_k) with ‖φ_i‖² (NaN when either is constant; values within 1e-9
                      of the largest count as ties, so that rounding does not order a repeated rollout's copies)
      pk_rho_inv_len  Spearman correlation of diag(P_k) with 1/T_i (T clamped >= 1)
      topnorm_share   share of ‖a'‖² on the k rollouts with the largest ‖φ_i‖² (k/m when spread evenly; NaN for a' = 0)
      kept            ‖a'‖² / ‖a‖² (NaN for a = 0)
      sign_flip       fraction of the rollouts with a_i ≠ 0 whose a'_i does not have the sign of a_i (NaN for a = 0)
    """
    from scipy.stats import spearmanr

    a, K = _coeffs_gram(advantages, gram, "advantages")
    b = _float64(new, "new", "(m,)").to(a.device)
    T = _float64(lengths, "lengths", "(m,)").to(a.device)
    m = a.numel()
    if b.shape != a.shape or T.shape != a.shape:
        raise ValueError(f"new and lengths must have the shape of advantages {tuple(a.shape)}")
    B = _basis(basis, m).to(a.device)
    row_energy = B.square().sum(1)  # diag(B Bᵀ)
    diag_p, k = (row_energy, B.shape[1]) if is_top else (1.0 - row_energy, m - B.shape[1])
    norms, inv_len = K.diagonal(), 1.0 / T.clamp(min=1)

    def ties(v):  # values within 1e-9 of the largest are tied: a repeated rollout's differ only by rounding
        step = 1e-9 * float(v.abs().max())
        return torch.round(v / step) if step > 0 else v

    def rho(x, y):
        if float(x.max() - x.min()) <= 1e-12 * float(x.abs().max()) or float(y.max() - y.min()) == 0.0:
            return math.nan
        return float(spearmanr(ties(x).cpu().numpy(), ties(y).cpu().numpy()).statistic)

    top = torch.argsort(norms, descending=True, stable=True)[:k]
    energy = float(b.square().sum())
    moving = a != 0
    any_moving = bool(moving.any())
    return {
        "pk_rho_norm": rho(diag_p, norms),
        "pk_rho_inv_len": rho(diag_p, inv_len),
        "topnorm_share": float(b[top].square().sum()) / energy if energy > 0 else math.nan,
        "kept": energy / float(a.square().sum()) if any_moving else math.nan,
        "sign_flip": float((torch.sign(b[moving]) != torch.sign(a[moving])).double().mean())
        if any_moving
        else math.nan,
    }


def group_geometry(advantages, features_or_gram, group_ids, eps: float = 1e-8, *, is_gram: bool = False) -> dict:
    """SALT App. D.1 (Eq. 38-53) and App. B per prompt group, from the advantages and the features' Gram.

    advantages Â (m,); features F (m, D), or with is_gram=True the Gram K = F Fᵀ/m of exactly these m rows
    (diagnostics.gram: an (m, m) argument cannot tell the two apart by shape); group_ids (m,) integer prompt ids.
    Group b holds G_b rows (sizes may differ: Eq. 52 uses 1/G_b). Keys (python floats; "mean" = the unweighted
    mean over the B groups, as Eq. 40/46/51 average; App. B's quantities are per group and averaged the same way):
      groups       B
      r_in         r_in,mean (Eq. 39-40): mean over groups of Eq. 38 on the group's rows (0 for < 2 nonzero rows)
      r_total      r_total (Eq. 41) over all m rows
      pr_in        PR_in,mean (Eq. 44-46): mean over groups of PR of the group's Gram block (0 for a zero block)
      pr_total     PR_total (Eq. 47-48)
      n_eff_group  n_eff,in,mean (Eq. 50-51): mean of n_eff({Â_i g_i}_{i∈b}) (Gram form of Eq. 60) over the groups
                   that carry signal, i.e. with Σ_{i∈b} ‖Â_i g_i‖² = m Σ_{i∈b} Â_i² K_ii > 0; NaN when none does.
                   A group whose u_i = Â_i g_i are all 0 (tied rewards: Â = 0) makes Eq. 49 0/0, which the paper
                   leaves open; such a group adds no term to the update, so it has nothing to cancel, and counting
                   it as 0 would report the share of mixed groups, not cancellation. It is left out of the mean.
      n_eff_group_left_out  how many groups were left out of n_eff_group (B when none carries signal)
      n_eff_means  n_eff^out (Eq. 52-53): n_eff of the group means ū_b = (1/G_b) Σ_{i∈b} Â_i g_i, i.e.
                   wᵀKw / (Σ_b w_bᵀ K_bb w_b + ε) with w_i = Â_i / G_b (a group without signal has ū_b = 0 and
                   adds 0 to both sums, so it drops out by itself; 0 when no group carries signal)
      e_tot        App. B E_tot(q) = Σ_i ‖s_i‖²   (mean over groups; s_i = g_i, the unnormalised features)
      e_sh         App. B E_sh(q) = G ‖s̄_q‖²
      e_delta      App. B E_δ(q) = Σ_i ‖s_i − s̄_q‖² = tr(K_q) − 1ᵀK_q1 / G (0 within rounding, ≤ 4·G·u·E_tot)
      rho_delta    App. B ρ_δ(q) = E_δ / E_tot (0 for a zero group)
      g_norm       App. B ‖g_q‖₂ = ‖(1/G) Σ_i Â_i s_i‖₂ = √(Â_qᵀ K_q Â_q) / G   (K_q = S_qᵀ S_q = m · K_bb)
      b_delta      App. B B_δ(q) = √(E_δ / G)
    r_in, pr_in and rho_delta depend on the features alone, not on Â: a tied group's values are defined, and they
    average over all B groups as Eq. 40/46 state (their 0 conventions concern zero features or single-row groups).
    e_tot ... b_delta are energies and norms, not ratios: a tied group's g_norm = 0 is its actual (zero) update.
    ε (Eq. 60) is absolute in units of K; Eq. 49 itself has none (eps = 0 gives it).
    NOT SALT's own `n_eff_in` / `n_eff_out` stats, which are n_eff of a and a' over the whole partition (Eq. 60).
    """
    c = _float64(advantages, "advantages", "(m,)")
    m = c.numel()
    index, n_groups = _group_index(group_ids, m)  # before the features: a bad group_ids is named, not torch's error
    if is_gram:
        c, K = _coeffs_gram(c, features_or_gram, "advantages")
    else:
        F = _checked(features_or_gram, "features", "(m, D)")
        if F.shape[0] != m:
            raise ValueError(f"features must have one row per advantage ({m}), got {F.shape[0]}")
        K = gram(F).to(c.device)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    index = index.to(c.device)
    sizes = torch.bincount(index, minlength=n_groups).to(torch.float64)
    per_group: dict[str, list[float]] = {
        key: [] for key in ("r_in", "pr_in", "e_tot", "e_sh", "e_delta", "rho_delta", "g_norm", "b_delta")
    }
    n_eff_in = []  # Eq. 50 of the groups with signal only
    for b in range(n_groups):
        rows = torch.nonzero(index == b)[:, 0]
        block, coeffs, size = K[rows][:, rows], c[rows], rows.numel()
        per_group["r_in"].append(_positive_alignment(block))
        per_group["pr_in"].append(participation_ratio(block))
        if float(coeffs.square() @ block.diagonal()) > 0:
            n_eff_in.append(effective_sample_size(coeffs, block, eps))
        K_q = m * block  # S_qᵀ S_q: App. B's energies are in units of the features, not of K
        e_tot, e_sh = float(K_q.trace()), float(K_q.sum()) / size
        e_delta = e_tot - e_sh  # a sum of squares: within rounding of 0 (as _energy) it is 0
        e_delta = e_delta if e_delta > 4 * size * torch.finfo(torch.float64).eps * e_tot else 0.0
        per_group["e_tot"].append(e_tot)
        per_group["e_sh"].append(e_sh)
        per_group["e_delta"].append(e_delta)
        per_group["rho_delta"].append(_ratio(e_delta, e_tot))
        per_group["g_norm"].append(math.sqrt(_energy(coeffs, K_q)) / size)
        per_group["b_delta"].append(math.sqrt(e_delta / size))
    w = c / sizes[index]
    same = index[:, None] == index[None, :]
    within = float(w @ (K * same) @ w)
    stats = {key: sum(values) / n_groups for key, values in per_group.items()}
    stats.update(
        groups=float(n_groups),
        n_eff_group=sum(n_eff_in) / len(n_eff_in) if n_eff_in else math.nan,
        n_eff_group_left_out=float(n_groups - len(n_eff_in)),
        r_total=_positive_alignment(K),
        pr_total=participation_ratio(K),
        n_eff_means=_ratio(_energy(w, K), max(within, 0.0) + eps),
    )
    return stats
