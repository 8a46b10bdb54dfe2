"""SALT: subspace-adaptive reweighting of group-relative advantages (arXiv 2606.05800 §3.1, Eq. 12-18, App. F.3).

`salt_advantages(a, F)` maps the group-normalized advantages a (m,) of m responses with proxy gradient features
F (m, D) to a' = P_k a + α_t P_k^⊥ [a]₊: the update restricted to the k_t dominant directions of the response
geometry, plus, when the signed coefficients cancel (n_eff < 1), a push of the positive advantages into the
residual subspace. `VARIANTS` holds the App. F.3 ablations and nulls as data; `SaltConfig` the validated --salt.*
settings of a run. Stateless: the Gram on the features' device (diagnostics.gram), the solve in float64 on the CPU.
"""

import math
import numbers
import time
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import scipy.linalg
import scipy.linalg.blas
import scipy.sparse.linalg
import torch

from openrlhf_geo import GeoWarning, diagnostics, sketch_gram
from openrlhf_geo.config_flags import setting
from openrlhf_geo.features import DEFAULT_DIM
from openrlhf_geo.features import METHODS as FEATURE_METHODS

PROJECTORS = ("top-k", "random", "none")
ALPHA_RULES = ("n_eff", "fixed", "pr", "entropy")
ASSIGNMENTS = ("none", "permute", "matched-random-subspace")
# k_t rules (_subspace_dim): "paper" is SALT Eq. 14; "code" the authors' released code (Chang-pw/SALT at 94ac08e,
# built on verl): verl/verl/trainer/gradient/advantage_decomposition.py, AdvantageDecomposer.compute_adaptive_k.
K_RULES = ("paper", "code")
CODE_K_MAX = 64  # the code's k_max (DecompositionConfig, actor.yaml advantage_decomposition.k_max)
# The code's rho as it ships in verl/verl/trainer/config/actor/actor.yaml and its README; DecompositionConfig's own
# default and dp_actor.py's fallback for a missing key are 0.5.
CODE_RHO = 1.0
# PR is a float64 ratio of sums over K, exact to ~m·u: within this relative distance of n + ½ it is taken as the tie
# n + ½ (which the inputs' exact PR may well be), so the rule's tie convention, not PR's last bit, sets k_t
TIE_RTOL = 1e-12


@dataclass(frozen=True)
class Variant:
    """How one App. F.3 row forms a' from a, P_k and α_t; every default is full SALT (Eq. 18).

    projector    "top-k": P_k on the top-k_t eigenvectors of K (Eq. 13-15); "random": on a uniformly random
                 k_t-dimensional subspace of R^m (F.3.1 rand-proj, "a random orthonormal basis Ṽ_k ∈ R^{m×k_t}");
                 "none": no decomposition, P_k = I in the main channel and P_k^⊥ = I in the exploration channel
                 (F.3.1 no-proj: a' = a + α_t [a]₊)
    alpha_rule   "n_eff": Eq. 17; "fixed": a constant α ∈ [0, 1] (F.3.1 fixed-α); "pr": clip(PR_total/(m − 1), 0, 1)
                 (F.3.1 PR-α); "entropy": clip((H_t − H_min)/(H_max − H_min), 0, 1) (F.3.1 Entropy-α, entropy_alpha)
    main         the main channel P_k a is in a' (F.3.1 only-exp: no)
    explore      the exploration channel α_t P_k^⊥ [a]₊ is in a' (F.3.1 only-main: no)
    positive     the exploration channel takes [a]₊ (F.3.1 no-Positive: a, "allowing signed residuals")
    assign       F.3.2 matched-coefficient nulls, applied to the a'_SALT the fields above give: "none"; "permute"
                 (Permuted-SALT); "matched-random-subspace" (Matched-RandSubspace, see salt_advantages)
    """

    projector: str = "top-k"
    alpha_rule: str = "n_eff"
    main: bool = True
    explore: bool = True
    positive: bool = True
    assign: str = "none"

    def __post_init__(self):
        for name, value, allowed in (
            ("projector", self.projector, PROJECTORS),
            ("alpha_rule", self.alpha_rule, ALPHA_RULES),
            ("assign", self.assign, ASSIGNMENTS),
        ):
            if value not in allowed:
                raise ValueError(f"Variant.{name} must be one of {', '.join(allowed)} (got {value!r})")

    @property
    def needs_entropy(self) -> bool:
        """The caller must pass α_t from the run's policy entropy (entropy_alpha)."""
        return self.alpha_rule == "entropy"


# App. F.3.1 component ablations and mixing rules, App. F.3.2 matched nulls; "full" is the method.
VARIANTS = {
    "full": Variant(),
    "only-main": Variant(explore=False),
    "only-exp": Variant(main=False),
    "no-pos": Variant(positive=False),
    "no-proj": Variant(projector="none"),
    "rand-proj": Variant(projector="random"),
    "fixed-alpha": Variant(alpha_rule="fixed"),
    "pr-alpha": Variant(alpha_rule="pr"),
    "entropy-alpha": Variant(alpha_rule="entropy"),
    "permuted": Variant(assign="permute"),
    "matched-rand-subspace": Variant(assign="matched-random-subspace"),
}
# Gram estimators: "raw" K̂ = F Fᵀ/m (SALT Eq. 4); "shrink" the noise-aware estimate for Kronecker-sketched features
# (sketch_gram: debiased PR, SURE-thresholded K̃ for the eigenspace). Only for `kronecker` features: its noise estimate
# splits their k×k cells, which exact and TensorSketch (`sketch`) features do not have.
GRAMS = ("raw", "shrink")


def _check_alpha(variant: str, alpha, name: str) -> None:
    """The fixed α of F.3.1 ("a constant α ∈ [0, 1]"): required by, and only with, a "fixed" alpha rule."""
    fixed = VARIANTS[variant].alpha_rule == "fixed"
    if fixed != (alpha is not None):
        raise ValueError(
            f"{name} is required by, and only used with, variant fixed-alpha (variant {variant!r}, {name} {alpha!r})"
        )
    # ignore: typeshed's int.__le__ takes no numbers.Real, and Real declares no reflected __ge__ (a stub limitation)
    if alpha is not None and not (isinstance(alpha, numbers.Real) and not isinstance(alpha, bool) and 0 <= alpha <= 1):  # type: ignore[operator]
        raise ValueError(f"{name} must be a number in [0, 1] (got {alpha!r})")


def _check_k_rule(k_rule, rho, prefix: str) -> None:
    """A k_t rule of K_RULES, and ρ only with the code's rule, in the code's range (DecompositionConfig asserts
    0 < rho <= 2). prefix: "--salt." for the flags, "" for salt_advantages' arguments."""
    if k_rule not in K_RULES:
        raise ValueError(f"{prefix}k_rule must be one of {', '.join(K_RULES)} (got {k_rule!r})")
    if rho is None:
        return
    if k_rule != "code":
        raise ValueError(f"{prefix}rho only applies with {prefix}k_rule code (got {prefix}k_rule {k_rule})")
    # ignore: typeshed's int.__lt__ takes no numbers.Real, and Real declares no reflected __gt__ (a stub limitation)
    if not (isinstance(rho, numbers.Real) and not isinstance(rho, bool) and 0 < rho <= 2):  # type: ignore[operator]
        raise ValueError(f"{prefix}rho must be a number in (0, 2], the released code's range (got {rho!r})")


@dataclass(frozen=True)
class SaltConfig:
    """The --salt.* settings of a run, validated here on construction (each error names its flag).

    variant        a key of VARIANTS
    features       Eq. 19's LM-head gradient as "sketch" (TensorSketch, `dim` columns; features.lm_head_features),
                   "kronecker" (the k×k Kronecker sketch, the default before the TensorSketch) or "exact"
    dim            sketch dimension D, a perfect square >= 16 (kronecker: k·k); default features.DEFAULT_DIM
    seed           seed of the fixed sketch hashes / projections, >= 0
    gram           "raw" (K = F Fᵀ/m, Eq. 4) or "shrink" (noise-aware, sketch_gram; only with kronecker features)
    group_prompts  prompts per SALT partition: None = the optimizer mini-batch's prompts (§3.1: "the current
                   mini-batch", m = BG; resolved by the engine), 0 = the whole rollout batch, n > 0 = n prompts
    alpha          the fixed α of variant fixed-alpha, in [0, 1] (required by it and only allowed with it)
    apply          False: --salt.diagnostics, the geometry is computed and logged and the advantages stay unchanged
    shuffle_minibatches  True: optimizer mini-batches mix prompts as upstream draws them, so an optimizer step no
                   longer trains on exactly one partition's rollouts (salt_stage.minibatch_partitions)
    k_rule         "paper" (SALT Eq. 14, the default: the paper is the specification) or "code" (the released code's
                   rule, see _subspace_dim)
    rho            the code rule's PR scale ρ in (0, 2]; only with k_rule "code" (None: CODE_RHO)
    """

    FLAG_PREFIX = "salt"

    variant: str = setting("full", "full SALT or an App. F.3 ablation", choices=lambda: VARIANTS)
    features: str = setting(
        "sketch",
        "LM-head-gradient proxy (SALT Eq. 19): sketch = TensorSketch of the V*d gradient into --salt.dim columns, "
        "O(V) per token, exact when V*d <= D; kronecker = the k*k Kronecker sketch (the default before, with "
        "--salt.dim 4096; noisier at the same D); exact = the V*d gradient itself (tiny models)",
        choices=FEATURE_METHODS,
    )
    dim: int = setting(
        DEFAULT_DIM,
        "sketch dimension D, a perfect square >= 16 (kronecker: k*k): the sketch's Gram cosines carry noise of sd "
        "~1/sqrt(D), its Gram costs O(m^2 D); see benchmarks/README.md",
    )
    seed: int = setting(0, "seed of the fixed sketch hashes / projections")
    gram: str = setting(
        "raw",
        "Gram estimate: raw F F^T/m (SALT Eq. 12) or shrink = noise-aware for --salt.features kronecker (debiased "
        "PR, SURE-thresholded off-diagonal; see benchmarks/README.md for when it helps)",
        choices=GRAMS,
    )
    group_prompts: int | None = setting(
        None,
        "prompts per SALT partition of the rollout batch (SALT's m = B*G); unset: the optimizer mini-batch's prompts "
        "(--train.batch_size / --rollout.n_samples_per_prompt, SALT §3.1 / Table 4); 0 = the whole batch",
        type=int,
    )
    alpha: float | None = setting(None, "fixed alpha_t in [0, 1], only with --salt.variant fixed-alpha", type=float)
    apply: bool = True  # False: --salt.diagnostics (a switch of options.add_args: diagnostics or SALT, not both)
    shuffle_minibatches: bool = setting(
        False,
        "optimizer mini-batches mix prompts as upstream draws them; off: each optimizer step trains on exactly the "
        "rollouts of one SALT partition (SALT §3.1's mini-batch)",
    )
    k_rule: str = setting(
        "paper",
        "dominant-subspace dimension k_t: paper = SALT Eq. 14, clip(round(PR), 1, m); code = the authors' released "
        "code, clip(round(rho*PR), 1, min(64, m-1)) (docs/usage.md)",
        choices=K_RULES,
    )
    rho: float | None = setting(
        None,
        f"the PR scale rho of --salt.k_rule code, in (0, 2]; unset: {CODE_RHO} (the released actor.yaml's; its "
        "dataclass default is 0.5)",
        type=float,
    )

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"--salt.variant must be one of {', '.join(VARIANTS)} (got {self.variant!r})")
        if self.features not in FEATURE_METHODS:
            raise ValueError(f"--salt.features must be one of {', '.join(FEATURE_METHODS)} (got {self.features!r})")
        if not _is_int(self.dim) or self.dim < 16 or math.isqrt(self.dim) ** 2 != self.dim:
            raise ValueError(f"--salt.dim must be a perfect square >= 16 (got {self.dim!r})")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"--salt.seed must be an integer >= 0 (got {self.seed!r})")
        if self.gram not in GRAMS:
            raise ValueError(f"--salt.gram must be one of {', '.join(GRAMS)} (got {self.gram!r})")
        if self.gram == "shrink" and self.features != "kronecker":
            raise ValueError(
                "--salt.gram shrink needs --salt.features kronecker (its noise estimate is the Kronecker sketch's; "
                f"got --salt.features {self.features})"
            )
        if self.group_prompts is not None and (not _is_int(self.group_prompts) or self.group_prompts < 0):
            raise ValueError(
                "--salt.group_prompts must be an integer >= 0 (0: the whole rollout batch; unset: the optimizer "
                f"mini-batch's prompts) (got {self.group_prompts!r})"
            )
        _check_alpha(self.variant, self.alpha, "--salt.alpha")
        if not isinstance(self.apply, bool):
            raise ValueError(f"--salt.apply must be True or False (got {self.apply!r})")
        if not isinstance(self.shuffle_minibatches, bool):
            raise ValueError(f"--salt.shuffle_minibatches must be True or False (got {self.shuffle_minibatches!r})")
        _check_k_rule(self.k_rule, self.rho, "--salt.")

    @property
    def needs_entropy(self) -> bool:
        """The engine must track the policy entropy and pass entropy_alpha(H_t, H_min, H_max) (VARIANTS table)."""
        return VARIANTS[self.variant].needs_entropy


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def entropy_alpha(h_t: float, h_min: float, h_max: float) -> float:
    """SALT App. F.3.1 Entropy-α: α_t = clip((H_t − H_min) / (H_max − H_min), 0, 1).

    H_t: the policy entropy at step t; H_min, H_max: its extremes "computed over the same training run" (the caller
    keeps them, and defines H_t). The text leaves H_max = H_min open (the first step under running extremes): the
    clip settles it for H_t above (1) or below (0) the single value, and at H_t = H_min = H_max (0/0) α_t = 0, the
    rule's value at H_t = H_min: the main channel only until the run has seen an entropy range to place H_t in.
    Raises ValueError for non-finite arguments or H_max < H_min.
    """
    values = {"h_t": h_t, "h_min": h_min, "h_max": h_max}
    for name, value in values.items():
        if not (isinstance(value, numbers.Real) and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number (got {value!r})")
    if h_max < h_min:
        raise ValueError(f"h_max must be >= h_min (got h_min={h_min}, h_max={h_max})")
    if h_max == h_min:
        return 1.0 if h_t > h_max else 0.0
    return min(max((h_t - h_min) / (h_max - h_min), 0.0), 1.0)


# Top-k eigensolver: Lanczos (ARPACK) for the top k+1 eigenpairs when k+1 <= m/8, else LAPACK MRRR on the smaller
# side of the spectrum. Measured crossover (one core, CPU ms, lanczos vs dense): m=512 k=64: 17 vs 28, k=128: 56 vs
# 42; m=1024 k=128: 152 vs 174, k=192: 299 vs 182; m=4096 k=384: 6018 vs 9475.
LANCZOS_MAX_FRACTION = 1 / 8


class SaltSolverWarning(GeoWarning, RuntimeWarning):
    """The top-k eigensolver fell back to another method (the result is the same eigenspace, slower)."""


def _subspace_dim(pr: float, m: int, k_rule: str = "paper", rho: float | None = None) -> int:
    """k_t from PR for m responses, by `k_rule`.

    "paper": SALT Eq. 14, k_t = clip(⌊PR⌉, 1, m); the text's ⌊·⌉ (nearest integer) leaves ties open: half up.
    A tie is a (ρ·)PR within TIE_RTOL (relative) of n + ½: the computed PR of inputs whose exact PR is a tie lands an
    ulp either side of it, and each rule's convention decides, not that ulp.
    App. G.1 restates it as clip(⌊PR_total⌋, 0, BG) (floor, lower bound 0); Eq. 14 and Algorithm 1 (nearest
    integer, lower bound 1) define the method, G.1 only its cost, so Eq. 14 is followed.
    "code": the authors' released code (Chang-pw/SALT, verl/verl/trainer/gradient/advantage_decomposition.py,
    AdvantageDecomposer.compute_adaptive_k): k_t = max(k_min, min(round(ρ·PR), k_max, B − 1)) with k_min = 1,
    k_max = CODE_K_MAX, B = m and Python's round (ties to even); ρ = rho, None: CODE_RHO. Below m it always
    leaves a residual (exploration) channel; at m = 1 it gives 1, as the code does.
    """
    x = (CODE_RHO if rho is None else rho) * pr if k_rule == "code" else pr
    n = math.floor(x)
    if abs(x - (n + 0.5)) <= TIE_RTOL * x:
        nearest = n + 1 if k_rule == "paper" or n % 2 else n  # half up; the code's round(): half to even
    else:
        nearest = math.floor(x + 0.5)
    if k_rule == "code":
        return max(1, min(nearest, CODE_K_MAX, m - 1))
    return min(max(nearest, 1), m)


def _top_eigenspace(
    K: torch.Tensor, k: int, method: str | None = None, eig: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, bool, float]:
    """SALT Eq. 13/15: the span of the top-k eigenvectors of K (m, m) as (basis (m, r), is_top, gap).

    P_k = B Bᵀ when is_top, else B spans the complement and P_k = I − B Bᵀ (k = m: r = 0, P_k = I).
    gap = (λ_k − λ_{k+1}) / λ_k with λ_{m+1} := 0: how well K determines P_k (ties at the boundary make it 0).
    method: "lanczos" (ARPACK, top k+1), "dense-top" (LAPACK, top k+1), "dense-bottom" (LAPACK, bottom m−k+1);
    default: lanczos when k+1 <= m/8, else the dense solve of the smaller side. eig: K's full eigendecomposition
    (ascending, float64 CPU), already formed: the basis is read from it, on the side the dense solve would take.
    """
    m = K.shape[0]
    if k == m:
        return K.new_zeros(m, 0), False, 1.0
    if eig is not None:
        lam, vecs = eig
        is_top = 2 * k <= m
        basis = vecs[:, m - k :] if is_top else vecs[:, : m - k]
        lam_k, lam_next = max(float(lam[m - k]), 0.0), max(float(lam[m - k - 1]), 0.0)
        return basis, is_top, (lam_k - lam_next) / lam_k if lam_k > 0 else 0.0
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
                f"SALT: ARPACK did not converge (m={m}, k={k}); using dense eigh", SaltSolverWarning, stacklevel=3
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


def _random_subspace(m: int, k: int, generator) -> tuple[torch.Tensor, bool]:
    """A uniformly distributed k-dimensional subspace of R^m as (basis, is_top): the span of an m×k Gaussian
    (rotation-invariant, so its span is uniform whatever QR's sign convention); k = m is R^m itself, with no draw."""
    if k == m:
        return torch.zeros(m, 0, dtype=torch.float64), False
    return torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64)).Q, True


def _gram(F: torch.Tensor, gram: str, sketch_shape):
    """SALT Eq. 4 (K_total of Eq. 13): (K, K_geom, noise, gram stats) on the CPU, formed on F's device.

    K: the unbiased Gram F Fᵀ / m, for α_t and the stats; K_geom: the Gram P_k is taken from (K itself under
    "raw"; sketch_gram.shrink's K̃ under "shrink", with its per-entry noise variance and gram_* stats).
    """
    if gram == "raw":
        K = diagnostics.gram(F).cpu()
        return K, K, None, {}
    K, noise = (x.cpu() for x in sketch_gram.gram_and_noise(F, sketch_shape))
    K_geom, gram_stats = sketch_gram.shrink(K, noise)
    return K, K_geom, noise, gram_stats


def _participation_ratio(K: torch.Tensor, noise: torch.Tensor | None) -> float:
    """SALT Eq. 5: PR_total = tr(K)² / ‖K‖_F² (noise-debiased by sketch_gram under gram="shrink")."""
    return diagnostics.participation_ratio(K) if noise is None else sketch_gram.participation_ratio(K, noise)


def _alpha_t(spec: Variant, a: torch.Tensor, K: torch.Tensor, pr: float, alpha, entropy) -> float:
    """SALT Eq. 17: α_t = max(0, 1 − n_eff), n_eff by Eq. 6; or the variant's App. F.3.1 rule (Variant.alpha_rule)."""
    if spec.alpha_rule == "fixed":
        return float(alpha)
    if spec.alpha_rule == "entropy":
        return float(entropy)  # the caller's entropy_alpha(H_t, H_min, H_max)
    if spec.alpha_rule == "pr":
        m = a.numel()
        return min(pr / (m - 1), 1.0) if m > 1 else float(pr > 0)  # PR ≥ 0; m = 1: the clip of PR/0
    # Eq. 17 takes n_eff of Eq. 6, which has no ε: scale-free (F → cF), 0/0 := 0 (no update at all: α_t = 1).
    return max(0.0, 1.0 - diagnostics.effective_sample_size(a, K, eps=0.0))


def _channels(spec: Variant, a: torch.Tensor, basis: torch.Tensor, is_top: bool, k: int, generator):
    """SALT Eq. 16: (a_main, a_exp) = (P_k a, P_k^⊥ [a]₊), with the variant's projector and exploration input."""
    source = a.clamp_min(0) if spec.positive else a
    if spec.projector == "none":  # no-proj: P_k = I in the main channel, P_k^⊥ = I in the exploration channel
        return a, source
    used = (basis, is_top) if spec.projector == "top-k" else _random_subspace(a.numel(), k, generator)
    return _project(a, *used), source - _project(source, *used)


def _reassign(spec: Variant, new: torch.Tensor, a: torch.Tensor, k: int, generator) -> torch.Tensor:
    """SALT App. F.3.2 matched nulls: a'_SALT's values reassigned to samples (see salt_advantages)."""
    m = new.numel()
    if spec.assign == "permute":
        return new[torch.randperm(m, generator=generator)]
    if spec.assign != "matched-random-subspace":
        return new
    random_basis, random_top = _random_subspace(m, k, generator)
    positive = a.clamp_min(0)
    score = positive - _project(positive, random_basis, random_top)
    ties = torch.randperm(m, generator=generator)
    order = ties[torch.argsort(score[ties], descending=True, stable=True)]
    matched = torch.empty_like(new)
    matched[order] = torch.sort(new, descending=True).values
    return matched


def _checked(advantages, features, variant, alpha, entropy, eps, gram, sketch_shape, k_rule, rho) -> torch.Tensor:
    """Validate the arguments; return the advantages a (m,) as a float64 CPU tensor.

    variant, gram, alpha, entropy, eps, k_rule and rho are salt_advantages' own arguments, which callers pass without
    a SaltConfig (benchmarks/salt_nulls.py, lab studies, tests), so they are checked here; the α and k_t rules are
    the ones SaltConfig checks (_check_alpha, _check_k_rule)."""
    _check_k_rule(k_rule, rho, "")
    if variant not in VARIANTS:
        raise ValueError(f"unknown SALT variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    if gram not in GRAMS:
        raise ValueError(f"unknown SALT gram estimator {gram!r}; valid: {', '.join(GRAMS)}")
    if sketch_shape is not None and gram != "shrink":
        raise ValueError(f"sketch_shape is only used with gram='shrink' (gram={gram!r})")
    inner = isinstance(features, InnerProducts)
    if inner and gram != "raw":
        raise ValueError(f"features given as InnerProducts need gram='raw' (gram={gram!r} reads F's columns)")
    if inner and features.eigh is not None:
        lam, vecs = features.eigh
        m = features.matrix.shape[0]
        if tuple(lam.shape) != (m,) or tuple(vecs.shape) != (m, m) or not torch.isfinite(lam).all():
            raise ValueError(
                f"InnerProducts.eigh must be G's finite eigenvalues ({m},) and eigenvectors ({m}, {m}), got "
                f"{tuple(lam.shape)} and {tuple(vecs.shape)}"
            )
    features, label = (features.matrix, "(m, m)") if inner else (features, "(m, D)")
    for name, x, ndim, shape in (("advantages", advantages, 1, "(m,)"), ("features", features, 2, label)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point torch.Tensor of shape {shape}, got {type(x).__name__}"
                + (f" of {x.dtype}" if isinstance(x, torch.Tensor) else "")
            )
        if x.ndim != ndim:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        total = x.sum(dtype=torch.promote_types(x.dtype, torch.float32))  # see diagnostics._checked
        if not torch.isfinite(total) and not torch.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or inf; SALT needs finite inputs")
    if advantages.numel() == 0:
        raise ValueError("advantages is empty (m = 0); SALT needs m >= 1 responses")
    if features.shape[0] != advantages.shape[0] or (inner and features.shape[1] != features.shape[0]):
        raise ValueError(
            f"features must have one row per advantage: got {features.shape[0]} rows for "
            f"{advantages.shape[0]} advantages" + (f" (InnerProducts {tuple(features.shape)})" if inner else "")
        )
    _check_alpha(variant, alpha, "alpha")
    if VARIANTS[variant].needs_entropy != (entropy is not None):
        raise ValueError(
            f"entropy is required by, and only used with, variant entropy-alpha (variant={variant!r}, "
            f"entropy={entropy!r})"
        )
    # ignore: typeshed's int.__le__ takes no numbers.Real, and Real declares no reflected __ge__ (a stub limitation)
    if entropy is not None and not (isinstance(entropy, numbers.Real) and 0 <= entropy <= 1):  # type: ignore[operator]
        raise ValueError(f"entropy must be entropy_alpha(H_t, H_min, H_max), a number in [0, 1] (got {entropy!r})")
    # ignore: numbers.Real declares no __ge__, and typeshed's reflected int.__le__ takes no Real (a stub limitation)
    if not (isinstance(eps, numbers.Real) and math.isfinite(eps) and eps >= 0):  # type: ignore[operator]
        raise ValueError(f"eps must be a finite number >= 0 (got {eps!r})")
    return advantages.detach().to(device="cpu", dtype=torch.float64)


class InnerProducts(NamedTuple):
    """The features' inner products G = F Fᵀ (m, m), given to salt_advantages in place of F (m, D): all SALT needs
    of F under gram="raw" (K = G/m), for callers that form G where the features are (the fork's policy ranks) and
    never gather F in one place. eigh: G's eigenvalues (ascending) and eigenvectors (torch.linalg.eigh of G), formed
    there too, so that the O(m³) eigensolve of Eq. 13/15 does not run where G is sent."""

    matrix: torch.Tensor
    eigh: tuple[torch.Tensor, torch.Tensor] | None = None


class SaltGeometry(NamedTuple):
    """What `salt_advantages(..., return_basis=True)` hands back beside a' and its stats."""

    basis: torch.Tensor  # (m, r) float64: P_k = B Bᵀ when is_top, else I − B Bᵀ
    is_top: bool
    gram: torch.Tensor  # (m, m) float64 K = F Fᵀ / m (the unbiased K̂ under gram="shrink")


@torch.no_grad()
def salt_advantages(
    advantages: torch.Tensor,
    features: torch.Tensor | InnerProducts,
    variant: str = "full",
    alpha: float | None = None,
    generator: torch.Generator | None = None,
    *,
    entropy: float | None = None,
    eps: float = 1e-8,
    gram: str = "raw",
    sketch_shape: tuple[int, int] | None = None,
    return_basis: bool = False,
    k_rule: str = "paper",
    rho: float | None = None,
) -> tuple:
    """SALT coefficients a' (m,) from advantages a (m,) and features F (m, D) -> (a', stats) [+ basis].

    F may be given as InnerProducts(G), G = F Fᵀ (m, m) formed elsewhere (gram="raw" only): the same K = G/m, so
    the same a' and stats up to the rounding of G's product.

    One call is one SALT partition: §3.1 takes the m = BG responses of "the current mini-batch" (Eq. 12).

    SALT Eq. 12    a, the stacked group-normalized advantages          (_checked)
    SALT Eq. 4     K = F Fᵀ / m                                        (_gram: diagnostics.gram)
    SALT Eq. 5     PR = tr(K)² / ‖K‖_F²                                (_participation_ratio)
    SALT Eq. 14    k_t = clip(⌊PR⌉, 1, m), ⌊·⌉ rounding half up         (_subspace_dim; k_rule="code": the
                   released code's max(1, min(round(ρ·PR), 64, m − 1)), ρ = rho, default CODE_RHO)
    SALT Eq. 13/15 P_k = V_k V_kᵀ on the top-k_t eigenvectors of K     (_top_eigenspace)
    SALT Eq. 16    a_main = P_k a,  a_exp = P_k^⊥ [a]₊                  (_channels)
    SALT Eq. 17    α_t = max(0, 1 − n_eff), n_eff = aᵀKa / Σ_i a_i² K_ii (_alpha_t; Eq. 6 on u_i = a_i g_i: no ε;
                   0/0 := 0)
    SALT Eq. 18    a' = a_main + α_t a_exp                             (then App. F.3.2's nulls: _reassign)

    variant: a key of VARIANTS (its Variant fields drive every branch below). The F.3.1 rows follow the text's
    formulas; "All variants use the same k_t and α_t computation when applicable". The F.3.2 nulls keep the step's
    a and α_t, compute a'_SALT as above and reassign its values to samples:
        permute                  a'_i = a'_SALT[π(i)], π = torch.randperm(m, generator)
        matched-random-subspace  a random k_t-dimensional subspace P̃ (as rand-proj draws it); each sample's residual
                                 score s = P̃^⊥ [a]₊ (the exploration channel Eq. 16 would give with P̃ for P_k); the
                                 sorted values of a'_SALT go to the samples in score order, largest to largest (ties
                                 in a uniformly random order: torch.randperm(m, generator) after the subspace draw).
                                 The text says "the induced residual scores" without naming the vector: we score the
                                 residual of [a]₊, the only vector SALT sends through P_k^⊥; a score from the subspace
                                 alone (e.g. the leverage ‖P̃^⊥e_i‖²) would rank samples uniformly at random, i.e.
                                 Permuted-SALT again, which Table 9 reports separately.
    Both nulls return exactly a permutation of a'_SALT (same marginal, norm and positive mass).
    alpha: the fixed α ∈ [0, 1] of fixed-alpha (required by it, only allowed with it). entropy: α_t of entropy-alpha,
    already normalised by the caller with entropy_alpha(H_t, H_min, H_max) (required by it, only allowed with it).
    Randomised variants (projector "random", or an assign null) draw from `generator` (a CPU torch.Generator; None:
    torch's global RNG) and are deterministic under a fixed one; the others draw nothing.
    gram (how K is estimated from F):
        raw     K = F Fᵀ / m for everything above
        shrink  F holds Kronecker-sketch rows (features.lm_head_features, method="kronecker") in row-major
                sketch_shape (k1, k2) layout (default k1 = k2 = √D): PR is the noise-debiased
                sketch_gram.participation_ratio, P_k comes from the SURE-thresholded K̃ (sketch_gram.shrink), and α_t
                and the stats use the unbiased K̂ = F Fᵀ/m; stats gain gram_threshold, gram_kept, gram_noise.
                Not for exact features (they carry no sketch noise).

    stats (python floats), on the K above and its top-k_t eigenspace P_k for every variant (F.5: "computed from the
    same Gram statistics already used by SALT"):
        pr, k            PR and k_t
        alpha            α_t of the variant's rule (reported even where its channel is off)
        n_eff_in         n_eff(a) by Eq. 60 (with ε): the cancellation α_t reacts to (Eq. 17 uses it without ε)
        n_eff_out        n_eff(a') by Eq. 60: Table 9/10's n_eff column for the returned coefficients
        gap              (λ_k − λ_{k+1}) / λ_k of the Gram P_k comes from, λ_{m+1} := 0 (0: P_k not unique)
        main_norm, exp_norm   ‖a_main‖, ‖α_t a_exp‖ as applied (for the F.3.2 nulls: a'_SALT's channels)
        D_a, D_g         Eq. 59, with ε
        U_perp           U_⊥(a') = √((1/m) (P_k^⊥a')ᵀ K (P_k^⊥a')), Eq. 61
        U_perp_gain      U_⊥(a') / U_⊥(a) on the same K and P_k (Table 9/10's "U_⊥ Gain"; 0/0 := 1, x/0 := inf)
        m, solve_ms      m; wall time from K to a' (PR, eigensolver, α_t, channels), not the Gram, checks or stats
    return_basis: also return a SaltGeometry(basis, is_top, gram): B (m, r) float64 with is_top, the top-k_t
    eigenbasis SALT took P_k from (K̃'s under shrink; P_k = B Bᵀ if is_top else I − B Bᵀ), for every variant
    (rand-proj's random subspace is not returned), and the float64 Gram K of its quadratic forms (the unbiased K̂
    under shrink), in the units of F Fᵀ/m, so callers' diagnostics need not form it again.

    k_rule, rho: how k_t follows from PR: "paper" (Eq. 14, default) or "code" (the authors' released code, with ρ =
    rho in (0, 2], None: CODE_RHO; rho only with "code"); see _subspace_dim.
    eps: the ε of Eq. 59-60, for which the text gives no value (absolute, in the units of K and ‖ĝ‖).
    Scale: a', pr, k, alpha, gap, D_a and U_perp_gain are invariant to F → cF (Eq. 5, 6, 14-18 are scale-free; the
    solve runs on F / diagnostics.unit_scale(F), so no square overflows or underflows, e.g. float32 features of
    1e-30 or 1e20); U_perp scales by |c|, and n_eff_in/out and D_g change only through ε.
    Degenerate inputs: m = 1 or F = 0 (tr K = 0, no geometry) ⇒ a' = a for every variant, with k = m·[F ≠ 0],
    alpha by its rule, gap = 1 (m = 1) or 0 (F = 0), main_norm = ‖a‖, exp_norm = D_a = D_g = U_perp = 0,
    U_perp_gain = 1, and basis (m, 0) with is_top = (F = 0) (P_k = I, or 0 without geometry). All-zero advantages ⇒
    a' = 0 with α_t = 1 under Eq. 17 (n_eff = 0/0 := 0). Identical rows of F ⇒ rank-1 K, k = 1 (no special case).
    NaN/inf, wrong shapes or misused arguments ⇒ ValueError naming them. P_k is unique only when gap > 0; at a tie
    the eigensolver picks one of the top-k subspaces. Output: the dtype and device of `advantages`.
    """
    a = _checked(advantages, features, variant, alpha, entropy, eps, gram, sketch_shape, k_rule, rho)  # Eq. 12
    spec = VARIANTS[variant]
    m = a.numel()
    eig = None
    if isinstance(features, InnerProducts):  # K = G/m of F / scale: scale² a power of two <= max |G|
        scale = math.ldexp(1.0, (math.frexp(diagnostics.unit_scale(features.matrix))[1] - 1) // 2)
        G = features.matrix.detach().to(device="cpu", dtype=torch.float64) / (scale * scale * m)
        K = (G + G.T) / 2
        K_geom, noise, gram_stats = K, None, {}
        if features.eigh is not None:  # K = G / (scale²·m): the same eigenvectors
            lam, vecs = (x.detach().to(device="cpu", dtype=torch.float64) for x in features.eigh)
            eig = (lam / (scale * scale * m), vecs)
    else:
        scale = diagnostics.unit_scale(features)
        F = features.detach() / scale if scale != 1.0 else features.detach()
        K, K_geom, noise, gram_stats = _gram(F, gram, sketch_shape)  # Eq. 4 / 13
    start = time.perf_counter()
    pr = _participation_ratio(K, noise)  # Eq. 5
    alpha_t = _alpha_t(spec, a, K, pr, alpha, entropy)  # Eq. 17
    zero = torch.zeros_like(a)
    if m == 1 or pr == 0.0:  # no relative geometry: identity
        k = m if pr > 0 else 0
        basis, is_top, gap = torch.zeros(m, 0, dtype=torch.float64), pr == 0.0, 1.0 if pr > 0 else 0.0
        new, main, explore = a.clone(), a, zero
    else:
        k = _subspace_dim(pr, m, k_rule, rho)  # Eq. 14 (or the code's rule)
        basis, is_top, gap = _top_eigenspace(K_geom, k, eig=eig)  # Eq. 13/15
        a_main, a_exp = _channels(spec, a, basis, is_top, k, generator)  # Eq. 16
        main = a_main if spec.main else zero
        explore = alpha_t * a_exp if spec.explore else zero
        new = _reassign(spec, main + explore, a, k, generator)  # Eq. 18, then the F.3.2 nulls
    solve_ms = 1e3 * (time.perf_counter() - start)

    # Stats in the units of the given F: K = scale² · K(F / scale), so ‖ĝ‖ and U_⊥ scale by `scale`, n_eff's
    # denominator by scale². (Python floats: eps / scale / scale is inf or 0, never an error, at the extremes.)
    u_in = diagnostics.residual_strength(a, K, basis, is_top)
    u_out = diagnostics.residual_strength(new, K, basis, is_top)
    stats = {
        "pr": pr,
        "k": float(k),
        "alpha": alpha_t,
        "n_eff_in": diagnostics.effective_sample_size(a, K, eps / scale / scale),
        "n_eff_out": diagnostics.effective_sample_size(new, K, eps / scale / scale),
        "gap": gap,
        "main_norm": float(main.norm()),
        "exp_norm": float(explore.norm()),
        "D_a": diagnostics.coefficient_change(a, new, eps),
        "D_g": diagnostics.update_change(a, new, K, eps / scale),
        "U_perp": scale * u_out,
        "U_perp_gain": u_out / u_in if u_in > 0 else 1.0 if u_out == 0 else math.inf,
        "m": float(m),
        "solve_ms": solve_ms,
        **gram_stats,
    }
    out = new.to(device=advantages.device, dtype=advantages.dtype)
    if not return_basis:
        return out, stats
    return out, stats, SaltGeometry(basis, is_top, K * scale**2)  # a power-of-two scale: exact
