"""Evaluation statistics: unbiased pass@k (SALT Eq. 54), avg@n, and paired multi-seed gains (SALT App. H)."""

import math

import numpy as np
from scipy import stats as scipy_stats

CI_METHODS = ("percentile", "basic", "bca")


def pass_at_k(n, c, k):
    """SALT Eq. 54: pass@k = 1 − C(n−c, k) / C(n, k) for one problem with c correct out of n samples.

    Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i), which never forms the (huge) binomials. Eq. 54 as printed takes
    pass@k = 1 when c ≥ k; the probability its text defines ("a uniformly chosen subset of k samples contains at
    least one correct solution") is 1 exactly when n − c < k (no all-wrong k-subset), and C(n−c, k) = 0 there, so
    this follows the formula and its definition: with n = 8, c = 2, k = 2 the printed case would say 1, the
    definition gives 1 − C(6,2)/C(8,2) = 13/28.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"pass_at_k: {name} must be an integer (got {value!r})")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n (got c={c}, n={n})")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n samples (got k={k}, n={n})")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_correct, n, k):
    """pass@k averaged over problems; ``num_correct`` (P,) correct counts out of ``n`` samples each."""
    if len(num_correct) == 0:
        raise ValueError("mean_pass_at_k: no problems")
    return float(np.mean([pass_at_k(n, int(c), k) for c in num_correct]))


def avg_at_n(correct):
    """avg@n: accuracy averaged over the n samples of each problem, then over problems; ``correct`` (P, n) bool."""
    correct = np.asarray(correct, dtype=np.float64)
    if correct.ndim != 2 or correct.size == 0:
        raise ValueError(f"avg_at_n: correct must be a non-empty (problems, n) array (got shape {correct.shape})")
    return float(correct.mean())


def min_resamples(confidence):
    """The fewest bootstrap resamples whose interval at `confidence` is more than the range of the resamples: each
    (1 - confidence)/2 tail needs one resample of its own, so 2/(1 - confidence) of them (40 at 95 %; with one
    resample the interval has zero width)."""
    return math.ceil(round(2 / (1 - confidence), 9))


def check_bootstrap_flags(confidence, n_resamples):
    """ValueError naming --confidence or --n-resamples when the bootstrap CI they ask for is not one."""
    if not 0 < confidence < 1:
        raise ValueError(f"--confidence must be in (0, 1) (got {confidence})")
    if n_resamples < min_resamples(confidence):
        raise ValueError(
            f"--n-resamples must be >= {min_resamples(confidence)} at --confidence {confidence:g} (got "
            f"{n_resamples}): each {(1 - confidence) / 2:.3g} tail needs a resample of its own, or the interval is "
            "only the resamples' range"
        )


def paired_gain(method, baseline, confidence=0.95, n_resamples=9999, seed=0, ci_method="percentile"):
    """SALT App. H: mean paired gain of ``method`` over ``baseline`` across matched seeds, with a bootstrap CI.

    ``method``/``baseline`` (S,) per-seed values in the same seed order. The bootstrap resamples the S per-seed
    differences (scipy.stats.bootstrap). Returns ``{"gain", "low", "high", "n"}``; with fewer than two seeds the
    interval is undefined (NaN), and when every difference is equal it collapses to that value.
    """
    method, baseline = np.asarray(method, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if method.shape != baseline.shape or method.ndim != 1:
        raise ValueError(
            f"paired_gain: method and baseline must be matching 1-D arrays ({method.shape} vs {baseline.shape})"
        )
    if ci_method not in CI_METHODS:
        raise ValueError(f"paired_gain: ci_method must be one of {CI_METHODS} (got {ci_method!r})")
    if not 0 < confidence < 1:
        raise ValueError(f"paired_gain: confidence must be in (0, 1) (got {confidence})")
    diffs = method - baseline
    if not np.all(np.isfinite(diffs)):
        raise ValueError("paired_gain: values must be finite")
    gain = float(diffs.mean()) if diffs.size else math.nan
    if diffs.size < 2:
        return {"gain": gain, "low": math.nan, "high": math.nan, "n": int(diffs.size)}
    if np.all(diffs == diffs[0]):  # a degenerate bootstrap distribution (BCa would divide by zero)
        return {"gain": gain, "low": gain, "high": gain, "n": int(diffs.size)}
    result = scipy_stats.bootstrap(
        (diffs,),
        np.mean,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method=ci_method,
        random_state=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return {"gain": gain, "low": float(low), "high": float(high), "n": int(diffs.size)}
