"""SALT diagnostics (arXiv 2606.05800 §2.2, App. B, D, F.5): geometry of a coefficient vector under a gradient Gram.

Notation: m responses with (proxy) gradients g_i, the rows of F (m, D); Gram K = F Fᵀ / m (m, m); coefficients
c (m,), e.g. the advantages weighting each response in the update Σ_i c_i g_i. Eigenvalues λ_1 ≥ … ≥ λ_m of K.

Pure functions: tensors (or array-likes) of any float dtype and device in, float64 inside, python floats (per-group
values: float64 tensors) out. NaN/inf inputs and wrong shapes raise ValueError naming the argument. Ratios whose
numerator and denominator are both 0 are defined as 0 (stated per function).
"""

import torch


def _checked(x, name: str, shape: str) -> torch.Tensor:
    """`x` as a finite tensor of the documented `shape`: "(m,)", "(m, D)" or "(m, m)"."""
    x = torch.as_tensor(x).detach()
    if x.ndim != (1 if shape == "(m,)" else 2):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty (m = 0)")
    # One reduction, not a bool mask (an order of magnitude cheaper at m = 4096): NaN/inf make the sum non-finite; an
    # overflowing sum of finite entries falls through to the exact check.
    if not torch.isfinite(x.sum(dtype=torch.float64)) and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")
    return x


def _float64(x, name: str, shape: str) -> torch.Tensor:
    """`x` as a finite float64 tensor of the documented `shape`."""
    return _checked(x, name, shape).to(torch.float64)


def _coeffs_gram(coeffs, gram) -> tuple[torch.Tensor, torch.Tensor]:
    c = _float64(coeffs, "coeffs", "(m,)")
    K = _float64(gram, "gram", "(m, m)").to(c.device)
    if K.shape != (c.numel(), c.numel()):
        raise ValueError(f"gram must have shape (m, m) = {(c.numel(),) * 2} for coeffs (m,), got {tuple(K.shape)}")
    return c, K


def _ratio(num: float, den: float) -> float:
    """num / den with 0/0 := 0 and x/0 := inf (x > 0)."""
    if den > 0:
        return num / den
    return 0.0 if num == 0 else float("inf")


def _energy(x: torch.Tensor, K: torch.Tensor) -> float:
    """xᵀKx (= ‖Σ_i x_i g_i‖² / m); within rounding of 0 (≤ 4·m·u·‖x‖²·tr K) it is 0: a numerically zero update."""
    energy = float(x @ K @ x)
    noise = 4 * K.shape[0] * torch.finfo(torch.float64).eps * float(x @ x) * float(K.diagonal().abs().sum())
    return energy if energy > noise else 0.0


def _group_index(group_ids, m: int) -> tuple[torch.Tensor, int]:
    """Group index (m,) in 0..G-1 (groups in sorted-id order) and the number of groups G."""
    ids = torch.as_tensor(group_ids)
    if ids.shape != (m,) or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"group_ids must be an integer tensor of shape (m,) = ({m},), got {ids.dtype} {tuple(ids.shape)}"
        )
    _, index = torch.unique(ids, return_inverse=True)
    return index, int(index.max()) + 1


def _eigh_desc(K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of symmetric K in descending order, eigenvalues clamped ≥ 0 (K is PSD up to rounding)."""
    lam, vecs = torch.linalg.eigh(K)
    return lam.flip(0).clamp_min(0), vecs.flip(1)


def gram(features) -> torch.Tensor:
    """SALT Eq. 12: K = F Fᵀ / m for features F (m, D); returns (m, m) float64 (exactly symmetric) on F's device.

    The product runs in F's precision, at least float32 (float64 features stay float64): it dominates SALT's cost
    at large m (m = 4096, D = 4096: 3.4 s in float32 vs 9.0 s in float64 on 2 cores), and float32 rounding (~1e-6
    relative) is far below the sketch's noise. Everything downstream (PR, eigensolver, n_eff) is float64.
    """
    F = _checked(features, "features", "(m, D)")
    F = F.to(torch.promote_types(F.dtype, torch.float32))
    K = (F @ F.T / F.shape[0]).to(torch.float64)
    return (K + K.T) / 2


def participation_ratio(gram) -> float:
    """SALT Eq. 5: PR = tr(K)² / ‖K‖_F² (= (Σλ)² / Σλ² for symmetric K, no eigendecomposition); 0 for K = 0.

    For PSD K ≠ 0, 1 ≤ PR ≤ rank K: the number of directions that carry the energy.
    """
    K = _float64(gram, "gram", "(m, m)")
    if K.shape[0] != K.shape[1]:
        raise ValueError(f"gram must be square (m, m), got {tuple(K.shape)}")
    return _ratio(float(torch.trace(K)) ** 2, float(torch.linalg.vector_norm(K)) ** 2)


def effective_sample_size(coeffs, gram, eps: float = 1e-8) -> float:
    """SALT Eq. 60 (Gram form): n_eff = cᵀKc / (Σ_i c_i² K_ii + ε); 0 when c = 0 and ε = 0.

    n_eff = 1 for orthogonal gradients, ≈ 0 when the signed coefficients cancel. ε is absolute (in units of K).
    """
    c, K = _coeffs_gram(coeffs, gram)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    return _ratio(float(c @ K @ c), float(c.square() @ K.diagonal()) + eps)


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


def effective_sample_size_within(coeffs, gram, group_ids, eps: float = 1e-8) -> tuple[torch.Tensor, dict]:
    """SALT Eq. 39-53 (our reading): n_eff inside each group, pooled within groups, on the batch, and cross-group.

    Returns (per_group (G,) float64, stats) with groups in sorted-id order and
        per_group[g]      c_gᵀ K_gg c_g / (Σ_{i∈g} c_i² K_ii + ε)
        n_eff_within      Σ_g c_gᵀ K_gg c_g / (Σ_i c_i² K_ii + ε)        (pooled within-group energy)
        n_eff_batch       cᵀKc / (Σ_i c_i² K_ii + ε)                     (= effective_sample_size)
        n_eff_cross       n_eff_batch − n_eff_within: the cross-group energy Σ_{g≠h} c_gᵀ K_gh c_h over the same
                          denominator; < 0 when groups cancel each other.
    A group whose energy and denominator are both 0 (ε = 0) gets 0.
    """
    c, K = _coeffs_gram(coeffs, gram)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps})")
    index, n_groups = _group_index(group_ids, c.numel())
    index = index.to(c.device)
    same = index[:, None] == index[None, :]
    energy_within = torch.zeros(n_groups, dtype=torch.float64, device=c.device)
    energy_within.index_add_(0, index, c * ((K * same) @ c))
    diag = torch.zeros_like(energy_within).index_add_(0, index, c.square() * K.diagonal())
    per_group = torch.where(diag + eps > 0, energy_within / (diag + eps), torch.zeros_like(diag))
    den = float(diag.sum()) + eps
    within = _ratio(float(energy_within.sum()), den)
    batch = _ratio(float(c @ K @ c), den)
    return per_group, {"n_eff_within": within, "n_eff_batch": batch, "n_eff_cross": batch - within}


def participation_ratio_within(gram, group_ids) -> tuple[torch.Tensor, dict]:
    """SALT Eq. 39-53 (our reading): PR (Eq. 5) of each group's Gram block K_gg, their mean, and PR of the batch.

    Returns (per_group (G,) float64, {"pr_within": mean over groups, "pr_batch": PR(K)}); a zero block has PR 0.
    """
    K = _float64(gram, "gram", "(m, m)")
    if K.shape[0] != K.shape[1]:
        raise ValueError(f"gram must be square (m, m), got {tuple(K.shape)}")
    index, n_groups = _group_index(group_ids, K.shape[0])
    index = index.to(K.device)
    same = index[:, None] == index[None, :]
    trace = torch.zeros(n_groups, dtype=torch.float64, device=K.device).index_add_(0, index, K.diagonal())
    frob2 = torch.zeros_like(trace).index_add_(0, index, (K * same).square().sum(1))
    per_group = torch.where(frob2 > 0, trace.square() / frob2, torch.zeros_like(trace))
    return per_group, {"pr_within": float(per_group.mean()), "pr_batch": participation_ratio(K)}


def positive_alignment(features) -> float:
    """SALT Eq. 7 (our reading): r = mean over pairs i ≠ j of cos(g_i, g_j), g_i the rows of (m, D).

    r → 1: the gradients are aligned, so signed zero-sum (GRPO) coefficients cancel in Σ_i c_i g_i. Pairs run over
    the nonzero rows (a zero gradient has no direction); with fewer than two nonzero rows there is no pair: r = 0.
    """
    F = _float64(features, "features", "(m, D)")
    norms = torch.linalg.vector_norm(F, dim=1)
    units = F[norms > 0] / norms[norms > 0, None]
    n = units.shape[0]
    if n < 2:
        return 0.0
    total = units.sum(0)
    # Σ_{i≠j} u_i·u_j = ‖Σ_i u_i‖² − n: O(mD) instead of the O(m²D) pairwise loop.
    return float((total @ total - n) / (n * (n - 1)))


def residual_energy(coeffs, gram, delta: float) -> dict:
    """SALT App. B (our reading): residual-energy ratio ρ_δ(c) and its bounds outside the top-k_δ eigenspace of K.

    k_δ = smallest k with Σ_{j≤k} λ_j ≥ (1 − δ) tr K; P⊥ projects onto the complement of the top-k_δ eigenvectors;
        rho         ρ_δ = cᵀP⊥KP⊥c / cᵀKc                 (share of update energy in the residual subspace)
        bound       B_δ = λ_{k_δ+1} ‖P⊥c‖² / cᵀKc          (ρ_δ ≤ B_δ: P⊥KP⊥ ⪯ λ_{k_δ+1} P⊥)
        tail_bound  δ · tr K · ‖P⊥c‖² / cᵀKc               (B_δ ≤ tail_bound: λ_{k_δ+1} ≤ Σ_{j>k_δ} λ_j ≤ δ tr K)
        k           k_δ (0 for K = 0)
    A zero update (cᵀKc = 0) has no energy to split: all three ratios are 0. Cost: one dense eigendecomposition.
    """
    c, K = _coeffs_gram(coeffs, gram)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1) (got {delta})")
    lam, vecs = _eigh_desc(K)
    total = float(lam.sum())
    if total == 0:
        return {"rho": 0.0, "bound": 0.0, "tail_bound": 0.0, "k": 0.0}
    k = int(torch.searchsorted(lam.cumsum(0), (1 - delta) * total)) + 1
    k = min(k, lam.numel())  # rounding can leave the last partial sum a hair below (1 − δ) tr K
    top = vecs[:, :k]
    c_perp = c - top @ (top.T @ c)
    energy = _energy(c, K)
    if energy == 0:
        return {"rho": 0.0, "bound": 0.0, "tail_bound": 0.0, "k": float(k)}
    lam_next = float(lam[k]) if k < lam.numel() else 0.0
    perp2 = float(c_perp @ c_perp)
    return {
        "rho": _energy(c_perp, K) / energy,
        "bound": lam_next * perp2 / energy,
        "tail_bound": delta * total * perp2 / energy,
        "k": float(k),
    }


def energy_ratio(part, whole, gram) -> float:
    """partᵀK part / wholeᵀK whole for coefficient vectors (m,): the energy of one update relative to another.

    Energies within rounding of zero count as 0 (a numerically zero update); 0/0 := 0 and x/0 := inf.
    """
    x, K = _coeffs_gram(part, gram)
    y = _float64(whole, "whole", "(m,)").to(x.device)
    if y.shape != x.shape:
        raise ValueError(f"whole must have the shape of part {tuple(x.shape)}, got {tuple(y.shape)}")
    return _ratio(_energy(x, K), _energy(y, K))


def coefficient_change(old, new) -> float:
    """SALT Eq. 59-61 (our reading), D_a = ‖a' − a‖₂ / ‖a‖₂: relative change of the coefficients (0/0 := 0)."""
    a = _float64(old, "old", "(m,)")
    b = _float64(new, "new", "(m,)").to(a.device)
    if b.shape != a.shape:
        raise ValueError(f"new must have the shape of old {tuple(a.shape)}, got {tuple(b.shape)}")
    return _ratio(float(torch.linalg.vector_norm(b - a)), float(torch.linalg.vector_norm(a)))


def update_change(old, new, gram) -> float:
    """SALT Eq. 59-61 (our reading), D_g = sqrt((a'−a)ᵀK(a'−a) / aᵀKa): relative change of the update Σ_i a_i g_i.

    0/0 := 0; a zero old update (aᵀKa = 0, see energy_ratio) with a nonzero new one gives inf.
    """
    a, K = _coeffs_gram(old, gram)
    b = _float64(new, "new", "(m,)").to(a.device)
    if b.shape != a.shape:
        raise ValueError(f"new must have the shape of old {tuple(a.shape)}, got {tuple(b.shape)}")
    return _ratio(_energy(b - a, K), _energy(a, K)) ** 0.5


def residual_share(coeffs, gram, k: int) -> float:
    """SALT Eq. 59-61 (our reading), U_⊥ = a'ᵀP_k^⊥KP_k^⊥a' / a'ᵀKa': the update energy outside the top-k eigenspace.

    In [0, 1] because P_k commutes with K; 0 for a zero update (a'ᵀKa' = 0, see energy_ratio). Cost: one dense
    eigendecomposition.
    """
    c, K = _coeffs_gram(coeffs, gram)
    if not 0 <= k <= c.numel():
        raise ValueError(f"k must be in [0, m] = [0, {c.numel()}] (got {k})")
    _, vecs = _eigh_desc(K)
    top = vecs[:, :k]
    c_perp = c - top @ (top.T @ c)
    return min(_ratio(_energy(c_perp, K), _energy(c, K)), 1.0)  # ≤ 1 exactly; rounding can exceed it by an ulp
