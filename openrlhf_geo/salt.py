"""SALT: subspace-adaptive reweighting of group-relative advantages (arXiv 2606.05800, Eq. 12-18, App. F.3).

`salt_advantages(a, F)` maps the group-normalized advantages a (m,) of m responses with proxy gradient features
F (m, D) to a' = P_k a + α_t P_k^⊥ [a]₊: the update restricted to the k dominant directions of the response
geometry, plus, when the signed coefficients cancel (n_eff < 1), a push of the positive advantages into the
residual subspace. Stateless: the Gram on the features' device (diagnostics.gram), the solve in float64 on the CPU;
the engines log `stats` as `salt/<key>`.
"""

import time
import warnings

import numpy as np
import scipy.linalg
import scipy.linalg.blas
import scipy.sparse.linalg
import torch

from openrlhf_geo import diagnostics, sketch_gram

# App. F.3 ablations; "full" is the method.
VARIANTS = (
    "full",
    "only-main",
    "only-exp",
    "no-pos",
    "no-proj",
    "rand-proj",
    "fixed-alpha",
    "pr-alpha",
    "entropy-alpha",
    "permuted",
    "matched-rand-subspace",
)
# Gram estimators: "raw" K̂ = F Fᵀ/m (SALT Eq. 12); "shrink" the noise-aware estimate for Kronecker-sketched features
# (sketch_gram: debiased PR, SURE-thresholded K̃ for the eigenspace). Never "shrink" exact features: no sketch noise.
GRAMS = ("raw", "shrink")

# Top-k eigensolver: Lanczos (ARPACK) for the top k+1 eigenpairs when k+1 <= m/8, else LAPACK MRRR on the smaller
# side of the spectrum. Measured crossover (one core, CPU ms, lanczos vs dense): m=512 k=64: 17 vs 28, k=128: 56 vs
# 42; m=1024 k=128: 152 vs 174, k=192: 299 vs 182; m=4096 k=384: 6018 vs 9475.
LANCZOS_MAX_FRACTION = 1 / 8


def _subspace_dim(pr: float, m: int) -> int:
    """SALT Eq. 13/14: k_t = clip(round_half_up(PR), 1, m)."""
    return min(max(int(np.floor(pr + 0.5)), 1), m)


def _top_eigenspace(K: torch.Tensor, k: int, method: str | None = None) -> tuple[torch.Tensor, bool, float]:
    """SALT Eq. 14: the span of the top-k eigenvectors of K (m, m) as (basis (m, r), is_top, gap).

    P_k = B Bᵀ when is_top, else B spans the complement and P_k = I − B Bᵀ (k = m: r = 0, P_k = I).
    gap = (λ_k − λ_{k+1}) / λ_k with λ_{m+1} := 0: how well K determines P_k (ties at the boundary make it 0).
    method: "lanczos" (ARPACK, top k+1), "dense-top" (LAPACK, top k+1), "dense-bottom" (LAPACK, bottom m−k+1);
    default: lanczos when k+1 <= m/8, else the dense solve of the smaller side.
    """
    m = K.shape[0]
    if k == m:
        return K.new_zeros(m, 0), False, 1.0
    if method is None:
        method = "lanczos" if k + 1 <= LANCZOS_MAX_FRACTION * m else "dense-top" if 2 * k <= m else "dense-bottom"
    if method == "lanczos":
        # dsymv on the F-ordered view of the symmetric K reads one triangle: half of dgemv's memory traffic.
        K_f = K.numpy().T
        matvec = scipy.sparse.linalg.LinearOperator(
            (m, m), matvec=lambda x: scipy.linalg.blas.dsymv(1.0, K_f, x.ravel()), dtype=np.float64
        )
        # Fixed start vector: the same K gives the same basis (ARPACK's default start is random).
        start = np.random.default_rng(0).standard_normal(m)
        try:
            lam, vecs = scipy.sparse.linalg.eigsh(matvec, k + 1, which="LA", v0=start)
        except scipy.sparse.linalg.ArpackNoConvergence:
            warnings.warn(
                f"SALT: ARPACK did not converge (m={m}, k={k}); using dense eigh", RuntimeWarning, stacklevel=3
            )
            return _top_eigenspace(K, k, "dense-top" if 2 * k <= m else "dense-bottom")
        order = np.argsort(lam)[::-1]
        lam, vecs, is_top = lam[order], vecs[:, order], True
        lam_k, lam_next, basis = lam[k - 1], lam[k], vecs[:, :k]
    elif method == "dense-top":
        lam, vecs = scipy.linalg.eigh(K.numpy(), subset_by_index=[m - k - 1, m - 1], check_finite=False)
        lam_k, lam_next, basis, is_top = lam[1], lam[0], vecs[:, 1:], True
    elif method == "dense-bottom":
        lam, vecs = scipy.linalg.eigh(K.numpy(), subset_by_index=[0, m - k], check_finite=False)
        lam_k, lam_next, basis, is_top = lam[-1], lam[-2], vecs[:, :-1], False
    else:
        raise ValueError(f"unknown eigensolver method {method!r}; choose lanczos, dense-top or dense-bottom")
    lam_k, lam_next = max(float(lam_k), 0.0), max(float(lam_next), 0.0)
    gap = (lam_k - lam_next) / lam_k if lam_k > 0 else 0.0
    return torch.from_numpy(np.ascontiguousarray(basis)), is_top, gap


def _project(x: torch.Tensor, basis: torch.Tensor, is_top: bool) -> torch.Tensor:
    """P_k x (m,) for P_k = B Bᵀ (is_top) or I − B Bᵀ (B spans the complement)."""
    inside = basis @ (basis.T @ x)
    return inside if is_top else x - inside


def _alpha_rule(variant: str, n_eff: float, pr: float, m: int, alpha, entropy) -> float:
    """SALT Eq. 17: α_t = max(0, 1 − n_eff), unless an App. F.3 variant replaces the rule (our reading)."""
    if variant == "fixed-alpha":
        return float(alpha)
    if variant == "pr-alpha":
        return max(0.0, 1.0 - pr / m)
    if variant == "entropy-alpha":
        return min(max(1.0 - float(entropy), 0.0), 1.0)
    return max(0.0, 1.0 - n_eff)


def _checked(advantages, features, variant, alpha, entropy, eps, gram, sketch_shape) -> torch.Tensor:
    """Validate the arguments; return the advantages a (m,) as a float64 CPU tensor."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown SALT variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    if gram not in GRAMS:
        raise ValueError(f"unknown SALT gram estimator {gram!r}; valid: {', '.join(GRAMS)}")
    if sketch_shape is not None and gram != "shrink":
        raise ValueError(f"sketch_shape is only used with gram='shrink' (gram={gram!r})")
    for name, x, ndim, shape in (("advantages", advantages, 1, "(m,)"), ("features", features, 2, "(m, D)")):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point torch.Tensor of shape {shape}, got {type(x).__name__}"
                + (f" of {x.dtype}" if isinstance(x, torch.Tensor) else "")
            )
        if x.ndim != ndim:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if not torch.isfinite(x.sum(dtype=torch.float64)) and not torch.isfinite(x).all():  # see diagnostics._float64
            raise ValueError(f"{name} contains NaN or inf; SALT needs finite inputs")
    if advantages.numel() == 0:
        raise ValueError("advantages is empty (m = 0); SALT needs m >= 1 responses")
    if features.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"features must have one row per advantage: got {features.shape[0]} rows for "
            f"{advantages.shape[0]} advantages"
        )
    if (variant == "fixed-alpha") != (alpha is not None):
        raise ValueError(
            f"alpha is required by, and only used with, variant='fixed-alpha' (variant={variant!r}, alpha={alpha!r})"
        )
    if alpha is not None and not (np.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0 (got {alpha})")
    if (variant == "entropy-alpha") != (entropy is not None):
        raise ValueError(
            f"entropy is required by, and only used with, variant='entropy-alpha' "
            f"(variant={variant!r}, entropy={entropy!r})"
        )
    if entropy is not None and not 0 <= float(entropy) <= 1:
        raise ValueError(f"entropy must be the normalized mean token entropy in [0, 1] (got {float(entropy)})")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0 (got {eps})")
    return advantages.detach().to(device="cpu", dtype=torch.float64)


@torch.no_grad()
def salt_advantages(
    advantages: torch.Tensor,
    features: torch.Tensor,
    variant: str = "full",
    alpha: float | None = None,
    generator: torch.Generator | None = None,
    *,
    entropy: float | None = None,
    eps: float = 1e-8,
    gram: str = "raw",
    sketch_shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, dict]:
    """SALT coefficients a' (m,) from advantages a (m,) and features F (m, D); returns (a', stats).

    SALT Eq. 12    K = F Fᵀ / m                                       (diagnostics.gram)
    SALT Eq. 5/13  PR = tr(K)² / ‖K‖_F²                                 (diagnostics.participation_ratio)
    SALT Eq. 13/14 k_t = clip(round_half_up(PR), 1, m)                  (_subspace_dim)
    SALT Eq. 14    P_k = projector onto the top-k eigenvectors of K     (_top_eigenspace)
    SALT Eq. 15    a_main = P_k a
    SALT Eq. 16    a_exp = P_k^⊥ [a]₊
    SALT Eq. 17    n_eff = aᵀKa / (Σ_i a_i² K_ii + ε), α_t = max(0, 1 − n_eff)   (diagnostics.effective_sample_size)
    SALT Eq. 18    a' = a_main + α_t a_exp

    variant (App. F.3, our reading; "full" is the method above):
        only-main     a' = P_k a
        only-exp      a' = α_t P_k^⊥ [a]₊
        no-pos        a' = P_k a + α_t P_k^⊥ a                       (no positive part)
        no-proj       a' = a + α_t [a]₊                              (no projector at all)
        rand-proj     P_k spans k Haar-random directions of R^m: QR of torch.randn(m, k, generator)
        matched-rand-subspace  P_k spans k eigenvectors of K drawn uniformly (torch.randperm(m, generator)[:k]
                      indexes them in descending-eigenvalue order): same dimension, not the dominant ones
        fixed-alpha   α_t = `alpha` (required, >= 0)
        pr-alpha      α_t = max(0, 1 − PR / m)
        entropy-alpha α_t = clip(1 − `entropy`, 0, 1); `entropy` (required) is the caller's normalized mean token
                      entropy in [0, 1]
        permuted      full SALT on K[π][:, π], π = torch.randperm(m, generator): geometry decoupled from a
    gram (how K is estimated from F):
        raw           K = F Fᵀ / m for everything above
        shrink        F holds Kronecker-sketch rows (features.lm_head_features, method="sketch") in row-major
                      sketch_shape (k1, k2) layout (default k1 = k2 = √D): PR is the noise-debiased
                      sketch_gram.participation_ratio, P_k comes from the SURE-thresholded K̃ (sketch_gram.shrink),
                      and n_eff, D_g, U_perp use the unbiased K̂ = F Fᵀ/m; stats gain gram_threshold, gram_kept,
                      gram_noise. Not for exact features (they carry no sketch noise).
    Randomised variants draw from `generator` (a CPU torch.Generator; None: torch's global RNG) and are deterministic
    under a fixed one; the others ignore it.

    stats (python floats): pr, k, n_eff and alpha (the α_t rule of the variant, reported even when its channel is
    zero or unused), n_eff_out (Eq. 60 for the returned a' on K: whether SALT reduced cancellation), gap
    (relative eigengap (λ_k − λ_{k+1}) / λ_k of K at the boundary, λ_{m+1} := 0), main_norm and exp_norm (norms
    of the two channels as applied in a'), D_a, D_g, U_perp (diagnostics Eq. 59-61 against the true K and its
    top-k eigenspace, for every variant), m, solve_ms (wall time from K to a': PR, eigensolver,
    projections and α; not the Gram, checks or diagnostics). For `permuted`, n_eff is that of the permuted Gram.

    Degenerate inputs: m = 1 or F = 0 (tr K = 0, no geometry) ⇒ a' = a for every variant, with pr = PR(K)
    (0 when F = 0), k = m·[F ≠ 0], n_eff and alpha by their formulas, main_norm = ‖a‖, gap = 1 (m = 1) or 0
    (F = 0) and the rest 0. All-zero advantages ⇒ a' = 0 = a with alpha reported (1 by Eq. 17). Identical rows of F
    ⇒ rank-1 K, k = 1 (no special case). NaN/inf, wrong shapes or misused arguments ⇒ ValueError naming them.
    P_k is unique only when gap > 0; at a tie the eigensolver picks one of the top-k subspaces. ε is absolute (in
    units of K): a' is invariant to F → cF except through ε. Output: the dtype and device of `advantages`.
    """
    a = _checked(advantages, features, variant, alpha, entropy, eps, gram, sketch_shape)
    m = a.numel()
    # K: the unbiased Gram for quadratic forms; K_geom: what P_k is taken from. On the features' device (a GPU makes
    # it ~free), solved on the CPU.
    if gram == "raw":
        K = diagnostics.gram(features).cpu()
        K_geom, gram_stats = K, {}
    else:
        K, noise = (x.cpu() for x in sketch_gram.gram_and_noise(features, sketch_shape))
        K_geom, gram_stats = sketch_gram.shrink(K, noise)
    start = time.perf_counter()
    pr = diagnostics.participation_ratio(K) if gram == "raw" else sketch_gram.participation_ratio(K, noise)

    if m == 1 or pr == 0.0:  # no relative geometry: identity
        n_eff = diagnostics.effective_sample_size(a, K, eps)
        stats = {"pr": pr, "k": float(m if pr > 0 else 0), "n_eff": n_eff, "n_eff_out": n_eff}
        stats["alpha"] = _alpha_rule(variant, n_eff, pr, m, alpha, entropy)
        stats.update(gap=1.0 if pr > 0 else 0.0, main_norm=float(a.norm()), exp_norm=0.0, D_a=0.0, D_g=0.0)
        stats.update(U_perp=0.0, m=float(m), solve_ms=1e3 * (time.perf_counter() - start), **gram_stats)
        return advantages.detach().clone(), stats

    k = _subspace_dim(pr, m)
    basis, is_top, gap = _top_eigenspace(K_geom, k)
    K_used, used_basis, used_top = K, basis, is_top
    if variant == "permuted":
        perm = torch.randperm(m, generator=generator)
        K_used = K[perm][:, perm]
        used_basis = basis[perm]  # the eigenvectors of K[π][:, π] are those of K with rows permuted
    elif variant == "rand-proj":
        used_basis, used_top = torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64)).Q, True
    elif variant == "matched-rand-subspace":
        _, vecs = torch.linalg.eigh(K_geom)
        pick = torch.randperm(m, generator=generator)[:k]
        used_basis, used_top = vecs.flip(1)[:, pick], True

    n_eff = diagnostics.effective_sample_size(a, K_used, eps)
    alpha_t = _alpha_rule(variant, n_eff, pr, m, alpha, entropy)
    if variant == "no-proj":
        main, explore = a, a.clamp_min(0)
    elif variant == "no-pos":
        main = _project(a, used_basis, used_top)
        explore = a - main
    else:
        main = _project(a, used_basis, used_top)  # Eq. 15
        positive = a.clamp_min(0)
        explore = positive - _project(positive, used_basis, used_top)  # Eq. 16
    if variant == "only-main":
        explore = torch.zeros_like(a)
    elif variant == "only-exp":
        main = torch.zeros_like(a)
    explore = alpha_t * explore
    new = main + explore  # Eq. 18
    solve_ms = 1e3 * (time.perf_counter() - start)

    residual = new - _project(new, basis, is_top)  # P_k^⊥ a' for U_⊥ (= diagnostics.residual_share)
    stats = {
        "pr": pr,
        "k": float(k),
        "n_eff": n_eff,
        "alpha": alpha_t,
        "n_eff_out": diagnostics.effective_sample_size(new, K, eps),
        "gap": gap,
        "main_norm": float(main.norm()),
        "exp_norm": float(explore.norm()),
        "D_a": diagnostics.coefficient_change(a, new),
        "D_g": diagnostics.update_change(a, new, K),
        "U_perp": min(diagnostics.energy_ratio(residual, new, K), 1.0),  # ≤ 1 exactly; rounding can exceed it
        "m": float(m),
        "solve_ms": solve_ms,
        **gram_stats,
    }
    return new.to(device=advantages.device, dtype=advantages.dtype), stats
