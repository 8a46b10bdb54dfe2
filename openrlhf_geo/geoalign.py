"""GeoAlign: geometric rollout curation (arXiv 2606.26917).

Pipeline per rollout batch (N rollouts, hidden states (N, d), rewards (N,), prompt ids (N,)):
pairs (Eq. 3) -> online projector on unit displacements (Eq. 4) -> prototype (Eq. 5) -> deviation (Eq. 6)
-> GDI per rollout (Eq. 7) -> KDE anomaly rule (§4.4, Algorithm 1 line 24) -> rectification plan (Best-Random, Eq. 8).

`curate` runs the whole pipeline and returns `(CurationPlan, stats)`; each step is also a public function of
tensors so tests and experiments can check it against a brute-force computation. Randomness (projector and
probe initialisation, the validation split, pair mini-batches, tie-breaks, replacement draws) comes from one CPU
`torch.Generator`. "The reference code" below is the authors' released implementation linked from §1 of the paper;
the paper's Table 6 (hyperparameters) survives only as a caption, so no value attributed to it can be checked.
"""

import copy
import math
import numbers
import time
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F
from scipy import optimize
from scipy.stats import gaussian_kde, mannwhitneyu
from torch import nn

from openrlhf_geo.config_flags import setting
from openrlhf_geo.groups import group_index
from openrlhf_geo.registry import register_curation
from openrlhf_geo.stages import CurationPlan, stream

PRESETS = {
    # alpha: §5.1 "Implementation" (0.05 on Math, 0.12 on HH-RLHF; App. C.2 sensitivity);
    # val_acc: App. C.1 early stop "once validation accuracy surpasses ... 95% for Math and 85% for HH-RLHF".
    "math": {"alpha": 0.05, "val_acc": 0.95},
    "rlhf": {"alpha": 0.12, "val_acc": 0.85},
}
RULES = ("pointwise", "threshold")
MODES = ("replace", "zero", "drop", "amplify")
GDI_KINDS = ("cumulative", "mean")
PROTOTYPES = ("margin", "plain")
# field metadata of the settings of --geoalign.projector.<field>; every other field is --geoalign.<field>
PROJECTOR = {"group": "projector"}
SKIP_REASONS = ("no_pairs", "few_scores", "degenerate")  # stats["skipped_reason"] when curation did not run

# A pair whose hidden states differ by less than this fraction of their norm (~10 float32 ulps) has no direction.
SAME_TOL = 1e-6
# Within-prompt Gram distances that cancel below this fraction of ||hc_k||^2 + ||hc_l||^2 are recomputed directly.
CANCEL_TOL = 1e-2
# GDI scores spread over less than this (in GDI units: a pair's deviation lies in [0, 2]) or this fraction of their
# magnitude are float32 noise of directions that agree: curate skips them, no density to threshold.
SCORE_TOL = 1e-5
# Scores (any units) spread over at most this many float64 ulps of their magnitude have lost the spread to rounding.
SPREAD_ULPS = 64
KDE_GRID = 2048  # grid points between the smallest and largest GDI score for the threshold rule's crossing


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class GeoAlignConfig:
    """All GeoAlign knobs, validated on construction (ValueError naming the flag); frozen, so `dataclasses.replace`
    (which validates again) is the way to change one. `GeoAlignConfig.preset("math" | "rlhf", **overrides)` gives
    the paper's per-task values; the field defaults are the "math" preset."""

    FLAG_PREFIX = "geoalign"

    alpha: float = setting(  # §4.4 (a fraction in (0, 1))
        0.05, "flag rollouts whose GDI density < alpha * peak on the high tail"
    )
    rule: str = setting(  # see kde_flags
        "pointwise",
        "anomaly rule: pointwise = the paper's (§4.4: GDI right of the mode and its own density < alpha * peak) or "
        "threshold = the released code's (every score past the first crossing right of the mode)",
        choices=RULES,
    )
    mode: str = setting(
        "replace",
        "rectification: replace (Best-Random, Eq. 8), zero, drop (App. C.5) or amplify (Anomaly-Amplify, §5.4)",
        choices=MODES,
    )
    gdi: str = setting(
        "cumulative", "GDI aggregation: cumulative (Eq. 7) or mean (§5.4's ablation)", choices=GDI_KINDS
    )
    prototype: str = setting(
        "margin", "margin-weighted prototype (Eq. 5) or plain mean (the reference code)", choices=PROTOTYPES
    )
    # Opt-in gates from the reference code, not in the paper (None or 0 = off; the reference code uses 0.2 and 100):
    max_flag_frac: float | None = setting(
        None,
        "opt-in cap on the flagged fraction of the scored rollouts, highest GDI first (not in the paper; the "
        "reference code uses 0.2)",
        type=float,
    )
    min_scores: int | None = setting(
        None,
        "opt-in: fewer GDI scores -> flag nothing (not in the paper; the reference code uses 100)",
        type=int,
    )
    max_pairs_per_side: int = setting(  # §4.5
        0, "per prompt pair only the top-m winners with the bottom-m losers; 0 = all pairs"
    )
    # Projector M_psi and its temporary linear probe, trained on every call (§4.2 "Implementation", App. C.1).
    # The paper gives "3-layer MLP with ReLU", 50 steps, cosine LR from 1e-3; the widths are ours (Table 6 is lost).
    hidden_sizes: tuple = setting(
        (512, 512), "hidden widths of the projector MLP", metadata=PROJECTOR, type=int, nargs="+"
    )
    out_dim: int = setting(128, "projector output width", metadata=PROJECTOR)
    steps: int = setting(50, "projector Adam steps per batch", metadata=PROJECTOR)
    lr: float = setting(1e-3, "projector peak LR, cosine decay", metadata=PROJECTOR)
    pair_batch: int = setting(  # epoch-wise shuffled
        1024,
        "pairs per projector step (the released code's 1024); 0 = every pair of the batch",
        metadata=PROJECTOR,
    )
    val_acc: float = setting(  # App. C.1: stop once validation accuracy "surpasses" this (>=, as the reference code)
        0.95, "early-stop validation accuracy", metadata=PROJECTOR
    )
    val_frac: float = setting(  # reference code: 10 % of pairs
        0.1, "fraction of the paired prompts held out for validation", metadata=PROJECTOR
    )
    warm_start: bool = setting(  # Algorithm 1 initialises M_psi once (line 1)
        True,
        "re-initialise the projector every step instead of keeping it",
        metadata=PROJECTOR,
        flag="no_warm_start",
        action="store_const",
        const=False,
    )
    device: str = setting("cpu", "device of the projector", type=str)

    def __post_init__(self):
        if isinstance(self.hidden_sizes, list):
            object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        fraction = "a number in (0, 1)"
        checks = (
            ("alpha", _is_real(self.alpha) and 0 < self.alpha < 1, fraction),
            ("rule", self.rule in RULES, f"one of {RULES}"),
            ("mode", self.mode in MODES, f"one of {MODES}"),
            ("gdi", self.gdi in GDI_KINDS, f"one of {GDI_KINDS}"),
            ("prototype", self.prototype in PROTOTYPES, f"one of {PROTOTYPES}"),
            (
                "max_flag_frac",
                self.max_flag_frac is None or (_is_real(self.max_flag_frac) and 0 <= self.max_flag_frac <= 1),
                "a number in (0, 1], or 0 / None for no cap",
            ),
            (
                "min_scores",
                self.min_scores is None or (_is_int(self.min_scores) and self.min_scores >= 0),
                "an integer >= 0 (0 / None: no minimum)",
            ),
            (
                "max_pairs_per_side",
                _is_int(self.max_pairs_per_side) and self.max_pairs_per_side >= 0,
                "an integer >= 0",
            ),
            (
                "hidden_sizes",
                isinstance(self.hidden_sizes, tuple) and all(_is_int(w) and w >= 1 for w in self.hidden_sizes),
                "a tuple of integer widths >= 1",
            ),
            ("out_dim", _is_int(self.out_dim) and self.out_dim >= 1, "an integer >= 1"),
            ("steps", _is_int(self.steps) and self.steps >= 1, "an integer >= 1"),
            ("lr", _is_real(self.lr) and 0 < self.lr < math.inf, "a finite number > 0"),
            ("pair_batch", _is_int(self.pair_batch) and self.pair_batch >= 0, "an integer >= 0 (0: all pairs)"),
            ("val_acc", _is_real(self.val_acc) and 0 < self.val_acc <= 1, "a number in (0, 1]"),
            ("val_frac", _is_real(self.val_frac) and 0 < self.val_frac < 1, fraction),
            ("warm_start", isinstance(self.warm_start, bool), "True or False"),
            ("device", isinstance(self.device, str), "a torch device string such as cpu or cuda:0"),
        )
        groups = {f.name: f.metadata.get("group") for f in fields(self)}
        for name, ok, requirement in checks:
            if not ok:
                flag = ".".join(part for part in ("--geoalign", groups[name], name) if part)
                raise ValueError(f"{flag} must be {requirement} (got {getattr(self, name)!r})")
        try:
            torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"--geoalign.device must be a torch device string (got {self.device!r})") from error

    @classmethod
    def preset(cls, name, **overrides):
        """The "math" or "rlhf" preset (PRESETS, §5.1 and App. C.1) with `overrides` applied and validated."""
        if name not in PRESETS:
            raise ValueError(f"unknown GeoAlign preset {name!r}; choose one of {sorted(PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown GeoAlign config field {unknown[0]!r}")
        return replace(cls(**PRESETS[name]), **overrides)


class Projector(nn.Module):
    """GeoAlign §4.2 projector M_psi, a ReLU MLP in_dim -> *config.hidden_sizes -> config.out_dim (3 layers default).

    Pass the same instance to every `curate` call to warm-start it (config.warm_start); its `state_dict` saves and
    loads like any module's. Created on config.device, initialised from `generator` (a CPU generator; None = global).
    """

    def __init__(self, in_dim, config=None, generator=None):
        super().__init__()
        config = config or GeoAlignConfig()
        widths = (in_dim, *config.hidden_sizes, config.out_dim)
        self.layers = nn.ModuleList(nn.Linear(a, b, device=config.device) for a, b in zip(widths[:-1], widths[1:]))
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator=None):
        """PyTorch's default nn.Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn on the CPU from `generator`."""
        for layer in self.layers:
            bound = 1 / math.sqrt(layer.in_features)
            for param in (layer.weight, layer.bias):
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))

    def forward(self, u):
        """M(u): (P, in_dim) -> (P, out_dim). The naive form; training uses the equal but cheaper `pair_forward`."""
        return self._tail(self.layers[0](u))

    def pair_forward(self, hidden, winner, loser, dist):
        """Both orientations (M(u_p), M(-u_p)) stacked as (2, P, out_dim), for u_p = (h_w - h_l) / dist_p.

        Pair-factored first layer: W1 u_p = (Z_w - Z_l) / dist_p with Z = hidden W1^T computed once per rollout
        (N*d*w1 multiply-adds instead of 2P*d*w1), shared by both orientations (+-W1 u_p + b1).
        hidden (N, in_dim); winner, loser (P,) long row indices into hidden; dist (P,) = ||h_w - h_l|| > 0.
        """
        first = self.layers[0]
        z = hidden @ first.weight.T
        # index_select, not z[winner]: its backward is a parallel index_add (advanced indexing's is much slower on CPU)
        x = (z.index_select(0, winner) - z.index_select(0, loser)) / dist[:, None].to(z.dtype)
        return self._tail(torch.stack((x, -x)) + first.bias)

    def _tail(self, a):
        """Everything after the first linear map: ReLU, then the remaining linear layers (ReLU between them)."""
        for layer in self.layers[1:]:
            a = layer(torch.relu(a))
        return a


def _group_slots(group):
    """(n_groups, G_max) long: each prompt's rollout indices, ascending, -1 padded; group (N,) in [0, n_groups)."""
    sizes = torch.bincount(group)
    order = torch.sort(group, stable=True).indices
    starts = torch.cumsum(sizes, 0) - sizes
    slots = torch.full((sizes.numel(), int(sizes.max())), -1, dtype=torch.long, device=group.device)
    slots[group[order], torch.arange(group.numel(), device=group.device) - starts[group[order]]] = order
    return slots


def preference_pairs(rewards, group_ids, max_per_side=0, generator=None):
    """GeoAlign Eq. 3: every (k, l) of the same prompt with r_k > r_l -> (winner (P,), loser (P,)) long, on the CPU.

    rewards (N,), group_ids (N,) any integers. Tied or single-rollout prompts give no pair (§4.5). max_per_side
    m > 0 keeps only the top-m winners x bottom-m losers of each prompt (§4.5 "Complexity"; ties in the ranking
    broken uniformly at random with `generator`). Pairs come ordered by prompt id, then winner position, then
    loser position.
    """
    if rewards.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    group, _ = group_index(group_ids)
    slots = _group_slots(group)
    valid = slots >= 0
    r = torch.where(valid, rewards.detach().cpu().double()[slots.clamp(min=0)], torch.nan)
    better = r[:, :, None] > r[:, None, :]  # [g, i, j] = r_i > r_j; NaN padding compares False
    if max_per_side > 0:
        key = torch.rand(rewards.numel(), generator=generator, dtype=torch.float64)[slots.clamp(min=0)]
        tied_before = (r[:, :, None] == r[:, None, :]) & (key[:, None, :] < key[:, :, None])  # [g, i, j]: j ties i
        rank_desc = better.sum(1) + tied_before.sum(2)  # rollouts ranked above i (0 = best)
        rank_asc = better.sum(2) + tied_before.sum(2)  # rollouts ranked below i (0 = worst)
        better &= (rank_desc < max_per_side)[:, :, None] & (rank_asc < max_per_side)[:, None, :]
    g, a, b = better.nonzero(as_tuple=True)
    return slots[g, a], slots[g, b]


def _pow2_scale(x):
    """A power of two s with max |s x| in [0.5, 1) (1 for an all-zero or empty x): scaling by it is exact, and
    keeps squared norms and first-layer products of float32 values far from overflow and underflow."""
    peak = float(x.detach().abs().max()) if x.numel() else 0.0
    return 2.0 ** -math.frexp(peak)[1] if peak > 0 else 1.0


def pair_distances(hidden, winner, loser, group_ids):
    """||h_w - h_l|| per pair (P,) float64, from the within-prompt Gram of prompt-centred hidden states.

    hidden (N, d), winner/loser (P,) pairs of the same prompt, group_ids (N,). The Gram is taken of hidden scaled
    by a power of two (exact), so |h| up to the dtype's limit cannot overflow when squared. Centring removes the
    large common component of LLM hidden states; a squared distance that still cancels (below CANCEL_TOL of
    ||hc_w||^2 + ||hc_l||^2) is recomputed directly from the float64 difference.
    """
    if winner.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    device = hidden.device
    rows, inverse = torch.unique(torch.cat((winner, loser)), return_inverse=True)
    w, l = inverse.chunk(2)
    h = hidden[rows.to(device)]
    scale = _pow2_scale(h)
    h = h * scale
    group, _ = group_index(group_ids.cpu()[rows])
    slots = _group_slots(group)
    valid = slots >= 0
    column = torch.empty_like(group)
    column[slots[valid]] = torch.nonzero(valid)[:, 1]
    sizes = torch.bincount(group).to(device=device, dtype=h.dtype)
    mean = torch.zeros(len(sizes), h.shape[1], dtype=h.dtype, device=device).index_add_(0, group.to(device), h)
    centred = torch.zeros(*slots.shape, h.shape[1], dtype=h.dtype, device=device)
    centred[valid.to(device)] = h[slots[valid].to(device)] - (mean / sizes[:, None])[group[slots[valid]].to(device)]
    gram = (centred @ centred.transpose(1, 2)).cpu().double()  # (n_groups, G, G)
    g = group[w]
    ww, ll, wl = gram[g, column[w], column[w]], gram[g, column[l], column[l]], gram[g, column[w], column[l]]
    d2 = ww + ll - 2 * wl
    unsafe = d2 <= CANCEL_TOL * (ww + ll)
    if unsafe.any():
        pick_w, pick_l = w[unsafe].to(device), l[unsafe].to(device)
        d2[unsafe] = (h[pick_w].double() - h[pick_l].double()).pow(2).sum(1).cpu()
    return d2.sqrt() / scale


def detection_auroc(score, bad, scored):
    """AUROC of `score` for the `bad` items among the `scored` ones (arrays of one length) -> (auroc, n+, n-).

    Mann-Whitney U / (n+ n-): P(a bad item outscores a clean one) + 1/2 P(tie); NaN without both classes.
    """
    score, bad, scored = np.asarray(score, dtype=float), np.asarray(bad, dtype=bool), np.asarray(scored, dtype=bool)
    pos, neg = score[scored & bad], score[scored & ~bad]
    if not len(pos) or not len(neg):
        return math.nan, len(pos), len(neg)
    return float(mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg))), len(pos), len(neg)


def orientation_loss(s_pos, s_neg):
    """GeoAlign Eq. 4: mean softplus(-w^T M(u)) + mean softplus(w^T M(-u)); s_pos, s_neg (P,) probe scores of +-u."""
    return F.softplus(-s_pos).mean() + F.softplus(s_neg).mean()


def _orientation_acc(s_pos, s_neg):
    """Fraction of the 2P oriented displacements the probe classifies right (w^T M(u) > 0, w^T M(-u) < 0)."""
    return 0.5 * ((s_pos > 0).double().mean() + (s_neg < 0).double().mean()).item()


def _minibatches(pairs, batch, steps, generator=None):
    """`steps` (index tensor into `pairs` (P,) long, ends an epoch) tuples: consecutive `batch`-sized chunks of a
    random permutation, reshuffled once every pair was used (epochs; an epoch's last chunk may be short), like
    the reference code's shuffled DataLoader. batch 0 or >= P: all pairs, in order, every step (each an epoch)."""
    if batch == 0 or batch >= len(pairs):
        return [(pairs, True)] * steps
    out, order = [], pairs[:0]
    for _ in range(steps):
        if not len(order):
            order = pairs[torch.randperm(len(pairs), generator=generator)]
        out.append((order[:batch], len(order) <= batch))
        order = order[batch:]
    return out


@torch.enable_grad()  # trains even when the caller runs under no_grad (OpenRLHF's experience maker does)
def fit_projector(projector, hidden, winner, loser, dist, config, generator=None, *, val_mask=None):
    """Train M_psi and a fresh linear probe w with the orientation loss (Eq. 4) -> (probe (out_dim,), steps).

    hidden (N, d) in the projector's dtype and device; winner, loser (P,) long; dist (P,) = ||h_w - h_l|| > 0.
    Paper (§4.2, App. C.1): config.steps steps of Adam with a cosine LR from config.lr on the current batch's pairs,
    halted once validation accuracy on held-out pairs reaches config.val_acc. Our choices: each step uses
    config.pair_batch of the training pairs (see _minibatches; the reference code's batch size, and what keeps a
    6144-pair step cheap); val_mask (P,) bool marks the held-out pairs, which never train; their accuracy over
    both orientations is checked after every epoch over the training pairs (every step when full-batch; the
    reference code also validates per epoch). val_mask None or all False: no early stop.
    """
    device = hidden.device
    if val_mask is None:
        val_mask = torch.zeros(winner.numel(), dtype=torch.bool)
    val = _compact(hidden, winner, loser, dist, val_mask)
    train_pairs = torch.nonzero(~val_mask)[:, 0]
    batches = _minibatches(train_pairs, config.pair_batch, config.steps, generator)
    full = _compact(hidden, winner, loser, dist, train_pairs) if batches[0][0] is train_pairs else None
    bound = 1 / math.sqrt(config.out_dim)
    init = torch.empty(config.out_dim).uniform_(-bound, bound, generator=generator)
    probe = init.to(device=device, dtype=hidden.dtype).requires_grad_()
    optimizer = torch.optim.Adam([*projector.parameters(), probe], lr=config.lr, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.steps)
    steps = 0
    for batch, epoch_end in batches:
        s_pos, s_neg = projector.pair_forward(*(full or _compact(hidden, winner, loser, dist, batch))) @ probe
        loss = orientation_loss(s_pos, s_neg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        steps += 1
        if epoch_end and val[1].numel():
            with torch.no_grad():
                if _orientation_acc(*(projector.pair_forward(*val) @ probe)) >= config.val_acc:
                    break
    return probe.detach(), steps


def _compact(hidden, winner, loser, dist, select):
    """The selected pairs (bool mask or index) as pair_forward arguments over only the rollouts they use (Z is
    computed for those alone)."""
    rows, inverse = torch.unique(torch.cat((winner[select], loser[select])), return_inverse=True)
    w, l = inverse.to(hidden.device).chunk(2)
    return hidden[rows.to(hidden.device)], w, l, dist[select].to(device=hidden.device, dtype=hidden.dtype)


def prototype(v, margins, kind="margin"):
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


def deviation(v, v_proto):
    """GeoAlign Eq. 6: s_p = 1 - cos(v_p, v_proto) for unit v (P, o) and v_proto (o,) -> (P,) in [0, 2]."""
    return 1 - v @ v_proto


def gdi(dev, winner, loser, n, kind="cumulative"):
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


def kde_tail_threshold(scores, alpha):
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


def kde_flags(scores, alpha, rule="pointwise"):
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


def best_random_probs(rewards, stable):
    """GeoAlign Eq. 8 per prompt: P(best stable rollout) = 1/2, the other S-1 stable ones share 1/2 (S = 1: all).

    rewards, stable (n, G) (one prompt per row; padding is simply not stable) -> (n, G) float64, 0 off the stable
    set, rows without a stable rollout all 0. When t rollouts tie for the best reward the best is drawn uniformly
    among them, so each tied one gets 1/(2t) + (t-1)/(2t(S-1)).
    """
    r = torch.where(stable, rewards.double(), -torch.inf)
    size = stable.sum(1, keepdim=True).double()
    best = stable & (r == r.max(1, keepdim=True).values)
    tied = best.sum(1, keepdim=True).double()
    others = (size - 1).clamp(min=1)  # S = 1 is handled below
    probs = torch.where(best, 0.5 / tied + 0.5 * (tied - 1) / (tied * others), 0.5 / others) * stable
    return torch.where(size == 1, stable.double(), probs)


def rectify(flagged, rewards, group_ids, mode="replace", generator=None):
    """GeoAlign §4.4 rectification: flags -> CurationPlan; "stable" = not flagged (scored or not). A prompt whose
    rollouts are all flagged is left unchanged (Eq. 8 needs a stable rollout; the paper does not treat this case).
    flagged, rewards, group_ids (N,).

    replace  each flagged slot gets a stable rollout of its prompt drawn by Best-Random (Eq. 8), independently
    zero     flagged slots get weight 0 (App. C.5 "Zero-weighting": their advantage contributes nothing)
    drop     flagged slots get keep False (and weight 0) (App. C.5 "Dropping")
    amplify  Anomaly-Amplify ablation (§5.4 "oversamples" the outliers without saying how; this scheme is ours):
             the j-th flagged rollout of a prompt (index order) also overwrites the j-th stable slot in a uniformly
             random order, while stable slots last
    replace, zero and amplify keep every prompt's slot count.
    """
    if mode not in MODES:
        raise ValueError(f"unknown GeoAlign mode {mode!r}; choose one of {MODES}")
    n = rewards.numel()
    plan = CurationPlan.identity(n)
    plan.flagged = flagged.detach().cpu().bool()
    if n == 0 or not plan.flagged.any():
        return plan.to(rewards.device)
    group, _ = group_index(group_ids)
    slots = _group_slots(group)  # (n_groups, G)
    valid, member = slots >= 0, slots.clamp(min=0)
    stable = valid & ~plan.flagged[member]
    bad = valid & plan.flagged[member] & stable.any(1, keepdim=True)  # flags that are acted on
    if mode in ("zero", "drop"):
        plan.weight[slots[bad]] = 0.0
        plan.keep[slots[bad]] = mode == "zero"
    elif mode == "replace" and bad.any():
        g, column = bad.nonzero(as_tuple=True)
        probs = best_random_probs(rewards.detach().cpu()[member], stable)
        pick = torch.multinomial(probs[g], 1, generator=generator)[:, 0]
        plan.source[slots[g, column]] = slots[g, pick]
    elif mode == "amplify":
        width = slots.shape[1]
        key = torch.rand(slots.shape, generator=generator)
        stable_order = torch.sort(torch.where(stable, key, 2.0), dim=1).indices  # stable slots first, shuffled
        columns = torch.arange(width).expand_as(slots)
        bad_order = torch.sort(torch.where(bad, columns, columns + width), dim=1).indices  # flagged first, in order
        pairs = torch.minimum(bad.sum(1), stable.sum(1))
        g, j = (columns < pairs[:, None]).nonzero(as_tuple=True)
        plan.source[slots[g, stable_order[g, j]]] = slots[g, bad_order[g, j]]
    return plan.to(rewards.device)


def _check_inputs(hidden, rewards, group_ids, config, generator, projector, corrupted):
    """Validate curate's arguments -> (rewards, group_ids, corrupted) as tensors. Lists are accepted; prompt ids
    may also be strings (mapped to integers, order kept)."""
    if not isinstance(config, GeoAlignConfig):
        raise ValueError(f"config must be a GeoAlignConfig (got {type(config).__name__})")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a tensor of shape (N, d), got {getattr(hidden, 'shape', type(hidden))}")
    n = hidden.shape[0]
    if isinstance(group_ids, (str, bytes)):
        raise ValueError(
            f"group_ids must hold one prompt id per rollout (a tensor or list), got the string {group_ids!r}"
        )
    if not isinstance(group_ids, torch.Tensor):
        ids = np.asarray(group_ids)
        ids = ids.astype(np.int64) if ids.size == 0 else ids
        if ids.dtype.kind not in "iuUS":
            raise ValueError(f"group_ids must be integer or string prompt ids, got values of dtype {ids.dtype}")
        group_ids = torch.from_numpy(np.unique(ids, return_inverse=True)[1].reshape(ids.shape))
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(np.asarray(rewards, dtype=np.float64))
    if corrupted is not None and not isinstance(corrupted, torch.Tensor):
        corrupted = torch.as_tensor(np.asarray(corrupted, dtype=bool))
    for name, value in (("rewards", rewards), ("group_ids", group_ids), ("corrupted", corrupted)):
        if value is not None and tuple(value.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match hidden (N, d), got {tuple(value.shape)}")
    if corrupted is not None and corrupted.dtype != torch.bool:
        raise ValueError(f"corrupted must be a bool mask, got dtype {corrupted.dtype}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating tensor, got dtype {hidden.dtype}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integer prompt ids, got dtype {group_ids.dtype}")
    if not torch.isfinite(rewards.double()).all():
        raise ValueError("rewards contain NaN or inf; GeoAlign needs finite rewards")
    if not torch.isfinite(hidden).all():
        raise ValueError("hidden contains NaN or inf; GeoAlign needs finite hidden states")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU torch.Generator (got device {generator.device})")
    if projector is not None and projector.layers[0].in_features != hidden.shape[1]:
        raise ValueError(
            f"projector expects hidden size {projector.layers[0].in_features}, got hidden (N, {hidden.shape[1]})"
        )
    return rewards, group_ids, corrupted


def _blank_stats():
    """curate's stats before any step ran (counts 0, measurements NaN, not skipped), in logging order."""
    counts = ("pairs", "pairs_identical", "prompts_paired", "n_scored", "n_candidates", "n_flagged", "proj_steps")
    measured = (
        *("proj_loss", "proj_train_acc", "val_acc", "consensus", "cos_mean", "cos_gt_0.8", "cos_gt_0.8_val"),
        *("gdi_p50", "gdi_p95", "kde_mode", "kde_threshold"),
    )
    skips = {f"skip_{why}": 0.0 for why in SKIP_REASONS}
    return {**dict.fromkeys(counts, 0.0), **dict.fromkeys(measured, math.nan), **skips, "skipped_reason": ""}


def _directed_pairs(h, r, group_ids, max_per_side, generator):
    """GeoAlign Eq. 3 pairs that have a unit displacement u_p (§4.1) -> (winner, loser, dist, n_identical): pairs
    whose hidden states are numerically identical (within SAME_TOL of their norm) have no direction and are dropped."""
    winner, loser = preference_pairs(r, group_ids, max_per_side, generator)
    dist = pair_distances(h, winner, loser, group_ids)
    norms = h.double().norm(dim=1).cpu()
    same = dist <= SAME_TOL * torch.maximum(norms[winner], norms[loser])
    return winner[~same], loser[~same], dist[~same], float(same.sum())


def _held_out_pairs(pair_prompt, paired_prompts, val_frac, generator):
    """App. C.1 validation split of Eq. 4's pairs -> (P,) bool: round(val_frac * prompts) whole prompts held out
    (at least one, leaving at least one to train); none when only one prompt has pairs."""
    if len(paired_prompts) < 2:
        return torch.zeros(len(pair_prompt), dtype=torch.bool)
    n_val = min(len(paired_prompts) - 1, max(1, round(val_frac * len(paired_prompts))))
    val_prompts = paired_prompts[torch.randperm(len(paired_prompts), generator=generator)[:n_val]]
    return torch.isin(pair_prompt, val_prompts)


def _ready_projector(projector, in_dim, config, generator):
    """Algorithm 1 line 1: a fresh M_psi, or the caller's on config.device in float32 (re-initialised unless
    config.warm_start)."""
    if projector is None:
        return Projector(in_dim, config, generator)
    projector.to(device=torch.device(config.device), dtype=torch.float32)
    if not config.warm_start:
        projector.reset_parameters(generator)
    return projector


def _online_projector(projector, h, winner, loser, dist, val_mask, config, generator):
    """GeoAlign Eq. 4 (§4.2): train M_psi and a temporary probe on the pairs' unit displacements, then project
    every pair -> (v (P, o) float64 = norm(M_psi(u_p)) on the CPU, the fit's stats)."""
    projector = _ready_projector(projector, h.shape[1], config, generator)
    probe, steps = fit_projector(projector, h, winner, loser, dist, config, generator, val_mask=val_mask)
    with torch.no_grad():
        out = projector.pair_forward(*_compact(h, winner, loser, dist, torch.ones_like(val_mask)))
        s_pos, s_neg = (out @ probe).cpu()
    train = ~val_mask
    fit = {"proj_steps": float(steps), "proj_loss": orientation_loss(s_pos[train], s_neg[train]).item()}
    fit["proj_train_acc"] = _orientation_acc(s_pos[train], s_neg[train])
    if val_mask.any():
        fit["val_acc"] = _orientation_acc(s_pos[val_mask], s_neg[val_mask])
    return F.normalize(out[0].double().cpu(), dim=1), fit


def _pair_margins(r, winner, loser):
    """GeoAlign Eq. 5 weights r_k - r_l (float64), or the halves' difference where it overflows (rewards beyond half
    the float64 limit): `prototype` is invariant to a common positive scale of the margins."""
    margins = r[winner] - r[loser]
    if not bool(torch.isfinite(margins).all()):
        margins = r[winner] / 2 - r[loser] / 2
    return margins


def _skip_reason(scored, consensus, min_scores):
    """Why the scored rollouts' GDI (n_scored,) cannot be thresholded (curate's few_scores / degenerate), else ""."""
    if min_scores and len(scored) < min_scores:
        return "few_scores"
    if consensus < SAME_TOL:
        return "degenerate"  # projected directions that cancel exactly: no prototype
    if float(scored.max() - scored.min()) <= SCORE_TOL * max(1.0, float(scored.abs().max())):
        return "degenerate"  # float32 noise of agreeing directions, not a distribution to threshold
    return ""


def _cap_flags(candidates, scores, n_scored, max_flag_frac):
    """The reference code's opt-in cap (not in the paper): at most max_flag_frac of the scored rollouts stay
    flagged, highest GDI first; None / 0 keeps every candidate."""
    if not max_flag_frac:
        return candidates
    cap = math.floor(max_flag_frac * n_scored + 1e-9)  # 0.29 * 100 is 28.999...
    return candidates[torch.sort(scores[candidates], descending=True, stable=True).indices[:cap]]


def _outcome_stats(flagged, scores, corrupted, skipped):
    """curate's closing stats: the skip markers, the flag counts and, with `corrupted`, the detection quality."""
    out = {"skipped_reason": skipped, f"skip_{skipped}": 1.0} if skipped else {}
    n_flagged = float(flagged.sum())
    out.update(n_flagged=n_flagged, flag_frac=n_flagged / max(len(flagged), 1))
    if corrupted is None:
        return out
    bad = corrupted.detach().cpu().bool()
    hits = float((flagged & bad).sum())
    out["precision"] = hits / n_flagged if flagged.any() else math.nan
    out["recall"] = hits / float(bad.sum()) if bad.any() else math.nan
    out["auroc"] = detection_auroc(scores.numpy(), bad.numpy(), ~torch.isnan(scores).numpy())[0]
    return out


def curate(hidden, rewards, group_ids, config, generator=None, *, projector=None, corrupted=None):
    """GeoAlign on one rollout batch (Algorithm 1, function GeoAlign) -> (CurationPlan, stats: dict).

    hidden (N, d) last-response-token final hidden states (any float dtype and magnitude; computed in float32 on
    config.device after an exact power-of-two rescale), rewards (N,), group_ids (N,) prompt ids (integers, or a
    list of strings), corrupted (N,) optional bool mask of known-corrupted rollouts (adds precision, recall,
    auroc). `projector`: a `Projector` trained in place (kept weights when config.warm_start, re-initialised
    otherwise; moved to config.device in float32); None trains a fresh one. The linear probe is fresh every call.
    Deterministic under a fixed CPU `generator`.

    The plan is the identity, stats["skipped_reason"] naming why (and skip_<reason> = 1.0), when:
      no_pairs    no within-prompt pair with a direction (tied prompts, identical hidden states, an empty batch):
                  the paper's only identity case (§4.5, Algorithm 1 lines 12-13)
      few_scores  fewer than config.min_scores scored rollouts (opt-in gate of the reference code)
      degenerate  projected directions that cancel exactly, or GDI scores without a density (all equal up to
                  float32 noise: spread <= SCORE_TOL)
    Otherwise skipped_reason is "" and config.rule flags rollouts (see kde_flags); with the opt-in cap
    config.max_flag_frac, at most that fraction of the scored rollouts stay flagged, highest GDI first (the
    reference code's cap; it truncates, curation still runs).

    Projector validation. The paper specifies training on the current batch's pairs and halting once validation
    accuracy on held-out pairs reaches config.val_acc (§4.2, §5.4, App. C.1); which pairs are held out is ours:
    round(config.val_frac * prompts with pairs) whole prompts (at least one, leaving at least one to train), so no
    rollout is on both sides (the reference code holds out 10 % of pairs, which share rollouts with training pairs).
    Held-out pairs never train but are scored like the others. With pairs in one prompt only, no prompt can be held
    out: the projector trains config.steps steps on every pair and val_acc is NaN.

    stats, floats except skipped_reason (engines log each as geo/<key>); NaN where not computed:
      pairs, pairs_identical (dropped: no direction), prompts_paired, n_scored (rollouts with a GDI),
      n_candidates (flagged by the rule, before the cap), n_flagged, flag_frac (n_flagged / N), proj_steps,
      proj_loss and proj_train_acc (training pairs, after training), val_acc (held-out pairs, after training;
      median > 97 % on Math and > 85 % on HH-RLHF in §5.4), consensus (resultant length of Eq. 5), cos_mean,
      cos_gt_0.8 (share of all pairs whose projected direction v_p has cosine > 0.8 with v_proto, unweighted;
      "nearly 90 %" in §5.4 / Fig. 6d), cos_gt_0.8_val (the same share over the held-out pairs only, which never
      trained the projector; NaN when none is held out), gdi_p50, gdi_p95, kde_mode (start of the high tail),
      kde_threshold (threshold rule only; inf: no sparse tail), skip_no_pairs, skip_few_scores, skip_degenerate,
      skipped_reason, time_s; with `corrupted`: precision, recall, auroc (of GDI among scored rollouts).
    """
    start = time.perf_counter()
    rewards, group_ids, corrupted = _check_inputs(hidden, rewards, group_ids, config, generator, projector, corrupted)
    n, stats = hidden.shape[0], _blank_stats()
    scores, flagged = torch.full((n,), math.nan, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)

    def finish(skipped=""):
        """Eq. 8: rectify the flagged rollouts (Best-Random replacement under the default mode), then the stats."""
        plan = rectify(flagged, rewards, group_ids, config.mode, generator)
        plan.score = scores.to(device=plan.score.device, dtype=plan.score.dtype)
        stats.update(_outcome_stats(flagged, scores, corrupted, skipped), time_s=time.perf_counter() - start)
        return plan, stats

    # Eq. 3: within-prompt preference pairs with a direction. Unit displacements are scale-free: an exact
    # power-of-two rescale keeps squared norms and Z = H W1^T of huge hidden states finite.
    r = rewards.detach().cpu().double()
    h = (hidden.detach() * _pow2_scale(hidden)).to(device=torch.device(config.device), dtype=torch.float32)
    winner, loser, dist, identical = _directed_pairs(h, r, group_ids, config.max_pairs_per_side, generator)
    group, _ = group_index(group_ids)
    paired_prompts = torch.unique(group[winner])
    stats.update(pairs=float(len(winner)), pairs_identical=identical, prompts_paired=float(len(paired_prompts)))
    stats["n_scored"] = float((torch.bincount(torch.cat((winner, loser)), minlength=n) > 0).sum())
    if not len(winner):
        return finish("no_pairs")  # §4.5: no pair, identity

    # Eq. 4: the online projector on unit displacements, validated on held-out prompts; v_p = norm(M_psi(u_p))
    val_mask = _held_out_pairs(group[winner], paired_prompts, config.val_frac, generator)
    v, fit = _online_projector(projector, h, winner, loser, dist, val_mask, config, generator)
    stats.update(fit)

    # Eq. 5-6: the reward-margin-weighted prototype, each pair's deviation s_p = 1 - cos(v_p, v_proto)
    v_proto, stats["consensus"] = prototype(v, _pair_margins(r, winner, loser), config.prototype)
    dev = deviation(v, v_proto)
    stats["cos_mean"], stats["cos_gt_0.8"] = (1 - dev).mean().item(), (1 - dev > 0.8).double().mean().item()
    if val_mask.any():
        stats["cos_gt_0.8_val"] = (1 - dev[val_mask] > 0.8).double().mean().item()

    # Eq. 7: each rollout's cumulative GDI (NaN without a pair)
    scores = gdi(dev, winner, loser, n, config.gdi)
    index = torch.nonzero(~torch.isnan(scores))[:, 0]
    stats["gdi_p50"], stats["gdi_p95"] = np.quantile(scores[index].numpy(), (0.5, 0.95)).tolist()
    if skipped := _skip_reason(scores[index], stats["consensus"], config.min_scores):
        return finish(skipped)

    # §4.4: the KDE tail flag (high tail, own density < alpha * peak), then the opt-in cap
    flags, stats["kde_mode"], stats["kde_threshold"] = kde_flags(scores[index].numpy(), config.alpha, config.rule)
    if math.isnan(stats["kde_mode"]):
        return finish("degenerate")
    candidates = index[torch.from_numpy(flags)]
    stats["n_candidates"] = float(len(candidates))
    flagged[_cap_flags(candidates, scores, len(index), config.max_flag_frac)] = True
    return finish()  # Eq. 8 (in finish): Best-Random replacement within each prompt, rollout counts kept


def _geoalign_fork(config):
    if config.mode == "drop":
        return (
            "--geoalign.mode drop changes per-prompt rollout counts, which OpenRLHF's fixed n_samples_per_prompt "
            "groups, micro-batches and DeepSpeed accumulation steps cannot take; in the fork use replace, amplify, "
            "or zero (removes a flagged rollout's gradient and keeps the batch shape)"
        )
    if config.device != "cpu":
        return (
            f"--geoalign.device {config.device}: the fork curates inside OpenRLHF's trainer actor, which Ray starts "
            "without a GPU; use cpu (the default)"
        )
    return None


class GeoAlignState:
    """What GeoAlign remembers across steps: its random stream (`generator`: projector initialisation and training
    order, pair subsampling, Best-Random donors) and the projector, created at the first batch (it needs the hidden
    size) and trained in place afterwards (warm start)."""

    def __init__(self, config: GeoAlignConfig, generator: torch.Generator):
        self.config, self.generator = config, generator
        self.projector: Projector | None = None

    def projector_for(self, in_dim: int) -> Projector:
        if self.projector is None:
            self.projector = Projector(in_dim, self.config, self.generator)
        elif self.projector.layers[0].in_features != in_dim:
            raise RuntimeError(f"hidden size changed from {self.projector.layers[0].in_features} to {in_dim}")
        return self.projector

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            # a copy: the live projector keeps training in place after the state is taken
            "projector": None if self.projector is None else copy.deepcopy(self.projector.state_dict()),
            "in_dim": None if self.projector is None else self.projector.layers[0].in_features,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["projector"] is not None:
            self.projector = Projector(state["in_dim"], self.config)
            self.projector.load_state_dict(state["projector"])
        # after building the projector: its init must not advance the restored stream
        self.generator.set_state(state["generator"])


@register_curation(
    "geoalign",
    state=lambda config, seed: GeoAlignState(config, stream(seed, "geoalign")),
    config="geoalign",
    metrics="geo",
    record="gdi",
    drops=lambda config: config.mode == "drop",
    fork=_geoalign_fork,
    needs_hidden=True,
)
def _curation(config, state, batch, rewards, hidden):
    """GeoAlign Eq. 3-8 as the pipeline's curation (registry.CURATIONS), with the run's warm-started projector."""
    return curate(
        hidden,
        rewards,
        batch.group_ids,
        config,
        state.generator,
        projector=state.projector_for(hidden.shape[1]),
        corrupted=batch.corrupted,
    )
