"""GeoAlign Eq. 5-7 and §4.4: the reward-margin-weighted prototype (Eq. 5), each pair's deviation (Eq. 6), each
rollout's GDI (Eq. 7), the KDE anomaly rule (§4.4, Algorithm 1 line 24) and the AUROC of a score as a detector."""

import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy import optimize
from scipy.stats import gaussian_kde, mannwhitneyu

# Scores (any units) spread over at most this many float64 ulps of their magnitude have lost the spread to rounding.
SPREAD_ULPS = 64
KDE_GRID = 2048  # grid points between the smallest and largest GDI score for the threshold rule's crossing


def prototype(v, margins, kind="margin") -> tuple[torch.Tensor, float]:
    """GeoAlign Eq. 5: v_proto = normalize(sum_p (r_k - r_l) v_p) -> (v_proto (o,), resultant length in [0, 1]).

    v (P, o) unit pair directions, margins (P,) = r_k - r_l > 0 (finite; ValueError otherwise); kind "plain" uses
    equal weights (the reference code). The resultant length ||sum_p m_p v_p|| / sum_p m_p measures the consensus
    (1 = all directions agree). Both are invariant to a common positive scale of the margins, which Eq. 5's
    normalization cancels: the weights are divided by their peak, so neither the weighted sum of margins near the
    float limit overflows nor the squared norm of tiny ones underflows.
    """
    if kind == "margin":
        weights = margins.to(v)
        if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise ValueError("margins must be finite and >= 0 (reward differences r_k - r_l of the pairs)")
        weights = weights / weights.max() if len(weights) and weights.max() > 0 else weights
    else:
        weights = torch.ones(len(v), dtype=v.dtype, device=v.device)
    centroid = weights @ v
    return F.normalize(centroid, dim=0), (centroid.norm() / weights.sum()).item()


def deviation(v, v_proto) -> torch.Tensor:
    """GeoAlign Eq. 6: s_p = 1 - cos(v_p, v_proto) for unit v (P, o) and v_proto (o,) -> (P,) in [0, 2]."""
    return 1 - v @ v_proto


def gdi(dev, winner, loser, n, kind="cumulative") -> torch.Tensor:
    """GeoAlign Eq. 7: GDI_i = sum of s_p over the pairs containing rollout i (as winner or loser) -> (n,).

    dev (P,) deviations, winner/loser (P,) long; kind "mean" divides by the rollout's pair count (§5.4's
    normalized ablation). Rollouts without a pair have no score: NaN.
    """
    index = torch.cat((winner, loser)).to(dev.device)
    total = torch.zeros(n, dtype=dev.dtype, device=dev.device).index_add_(0, index, torch.cat((dev, dev)))
    count = torch.bincount(index, minlength=n).to(dev.dtype)
    score = total / count if kind == "mean" else total
    return torch.where(count > 0, score, torch.nan)


def _kde(scores):
    """(f̂, z, center, half): scipy's Gaussian KDE (Scott's bandwidth) of the standardized scores
    z = (scores - center) / half in [-1, 1] (center the midrange, half half the range), or None when the scores
    are degenerate (fewer than two, spread over at most SPREAD_ULPS ulps of their magnitude, or a singular
    covariance): no density to compare against.

    Both rules compare densities with alpha times the peak, which an affine map of the scores leaves unchanged
    (Scott's bandwidth scales with the scores), so the KDE works on z: finite scores near the float64 limit would
    overflow scipy's covariance, and any scale gives the same flags. midrange and half range are computed from
    halves, which cannot overflow.
    """
    if len(scores) < 2 or np.ptp(scores) <= SPREAD_ULPS * np.finfo(np.float64).eps * float(np.abs(scores).max()):
        return None
    low, high = float(scores.min()), float(scores.max())
    center, half = low / 2 + high / 2, high / 2 - low / 2
    z = (scores - center) / half
    try:
        return gaussian_kde(z, bw_method="scott"), z, center, half
    except np.linalg.LinAlgError:
        return None


def _tail_start(kde, z, alpha):
    """kde_tail_threshold on standardized scores z (see _kde) -> (threshold, mode) in z's units."""
    grid = np.linspace(z.min(), z.max(), KDE_GRID)  # a Gaussian KDE's mode lies inside the data range
    density = kde(grid)
    top = int(np.argmax(density))
    lo, hi = grid[max(top - 1, 0)], grid[min(top + 1, KDE_GRID - 1)]
    mode = optimize.minimize_scalar(lambda x: -kde(x)[0], bounds=(lo, hi), method="bounded").x
    mode = mode if kde(mode)[0] >= density[top] else grid[top]
    level = alpha * kde(mode)[0]
    below = np.nonzero((grid > mode) & (density < level))[0]
    if not len(below):
        return math.inf, float(mode)
    i = below[0]
    # density >= level at `left` (the previous grid point, or the mode itself) and < level at grid[i]
    left = max(grid[i - 1], mode)
    return float(optimize.brentq(lambda x: kde(x)[0] - level, left, grid[i])), float(mode)


def kde_tail_threshold(scores, alpha) -> tuple[float, float]:
    """The threshold rule's tail start: the first point right of the density mode where f̂ < alpha * f̂(mode).

    scores (n,) float64 (any finite scale: the KDE works on standardized scores, see _kde); f̂ = scipy
    `gaussian_kde` (Scott's bandwidth). Returns (threshold, mode) in the scores' units: threshold = inf when the
    density stays >= alpha * peak up to the largest score (no tail to flag), NaN when degenerate. The reference code
    takes the crossing on a 200-point grid and, without one, falls back to mean + 2 sd; here the crossing is refined
    by root finding on a KDE_GRID grid, and no crossing flags nothing.
    """
    fit = _kde(scores)
    if fit is None:
        return math.nan, math.nan
    kde, z, center, half = fit
    threshold, mode = _tail_start(kde, z, alpha)
    return center + half * threshold, center + half * mode


def kde_flags(scores, alpha, rule="pointwise") -> tuple[np.ndarray, float, float]:
    """GeoAlign §4.4 anomaly rule on one batch's GDI scores (n,) float64 -> (flags (n,) bool, mode, threshold).

    f̂ = scipy `gaussian_kde` of the scores, Scott's bandwidth (the paper says "KDE"; kernel and bandwidth are not
    given). Degenerate scores (see _kde): nothing flagged, mode = threshold = NaN.
    pointwise  the paper: score i is flagged iff it lies in the high-deviation tail and
               f̂(GDI_i) < alpha * max_{s in S} f̂(s), the peak taken over the observed scores S (§4.4; Algorithm 1
               line 24, which omits the tail condition). The text does not define the tail further; we take
               "right of the mode", mode = the observed score of peak density. threshold = NaN.
    threshold  the reference code's rule: flag every score >= kde_tail_threshold (the first point right of the
               mode where the density drops below alpha * peak). Why a user would want it: it reproduces the
               released implementation, and it treats everything beyond the first density collapse as anomalous,
               so a dense secondary cluster of high-GDI rollouts (many rollouts sharing one conflicting direction,
               e.g. a systematic reward-model artifact) is flagged as a whole, where the pointwise rule keeps every
               member whose local density exceeds alpha * peak.
    """
    fit = _kde(scores)
    if fit is None:
        return np.zeros(len(scores), dtype=bool), math.nan, math.nan
    kde, z, center, half = fit  # flags are decided on the standardized scores z, the same at any scale
    if rule == "threshold":
        threshold, mode = _tail_start(kde, z, alpha)
        return z >= threshold, center + half * mode, center + half * threshold
    density = kde(z)
    top = int(np.argmax(density))
    return (z > z[top]) & (density < alpha * density.max()), float(scores[top]), math.nan


def detection_auroc(score, bad, scored) -> tuple[float, int, int]:
    """AUROC of `score` for the `bad` items among the `scored` ones (arrays of one length) -> (auroc, n+, n-).

    Mann-Whitney U / (n+ n-): P(a bad item outscores a clean one) + 1/2 P(tie); NaN without both classes.
    """
    score, bad, scored = np.asarray(score, dtype=float), np.asarray(bad, dtype=bool), np.asarray(scored, dtype=bool)
    pos, neg = score[scored & bad], score[scored & ~bad]
    if not len(pos) or not len(neg):
        return math.nan, len(pos), len(neg)
    return float(mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg))), len(pos), len(neg)
