"""GeoAlign: geometric rollout curation (arXiv 2606.26917).

Pipeline per rollout batch (N rollouts, hidden states (N, d), rewards (N,), prompt ids (N,)):
pairs (Eq. 3) -> online projector on unit displacements (Eq. 4) -> prototype (Eq. 5) -> deviation (Eq. 6)
-> GDI per rollout (Eq. 7) -> KDE threshold on the high tail -> rectification plan (Best-Random, Eq. 8).

`curate` runs the whole pipeline and returns `(CurationPlan, stats)`; each step is also a public function of
tensors so tests and experiments can check it against a brute-force computation. Randomness (projector and
probe initialisation, the validation split, tie-breaks, replacement draws) comes from one CPU `torch.Generator`.
"""

import math
import time
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F
from scipy import optimize
from scipy.stats import gaussian_kde, mannwhitneyu
from torch import nn

PRESETS = {
    # GeoAlign §4: binary verified rewards (math) vs a learned reward model (RLHF).
    "math": {"alpha": 0.05, "val_acc": 0.95},
    "rlhf": {"alpha": 0.12, "val_acc": 0.85},
}
MODES = ("replace", "zero", "drop", "amplify")
GDI_KINDS = ("cumulative", "mean")
PROTOTYPES = ("margin", "plain")

# A pair whose hidden states differ by less than this fraction of their norm (~10 float32 ulps) has no direction.
SAME_TOL = 1e-6
# Within-prompt Gram distances that cancel below this fraction of ||hc_k||^2 + ||hc_l||^2 are recomputed directly.
CANCEL_TOL = 1e-2
# GDI scores spread over less than this fraction of their magnitude are float32 noise: no density to threshold.
SCORE_TOL = 1e-5
KDE_GRID = 2048  # grid points between the smallest and largest GDI score for the density mode and tail crossing


@dataclass
class GeoAlignConfig:
    """All GeoAlign knobs; `GeoAlignConfig.preset("math" | "rlhf", **overrides)` gives the paper's defaults."""

    alpha: float = 0.05  # KDE density threshold factor: flag where density < alpha * peak, right of the mode
    mode: str = "replace"  # replace (Best-Random, Eq. 8) | zero (weight 0) | drop | amplify (Anomaly-Amplify)
    gdi: str = "cumulative"  # cumulative (Eq. 7) | mean
    prototype: str = "margin"  # margin-weighted (Eq. 5) | plain mean
    max_flag_frac: float = 0.2  # cap on the flagged fraction of the batch
    min_scores: int = 100  # fewer GDI scores than this -> flag nothing
    max_pairs_per_side: int = 0  # >0: per prompt only the top-m winners x bottom-m losers form pairs
    # projector M_psi (3-layer ReLU MLP by default) + a temporary linear probe, trained per step
    hidden_sizes: tuple = (512, 512)
    out_dim: int = 128
    steps: int = 50
    lr: float = 1e-3
    val_acc: float = 0.95  # early stop once validation accuracy >= this
    val_frac: float = 0.2  # fraction of prompts held out for validation
    warm_start: bool = True  # keep the projector across steps
    device: str = "cpu"

    @classmethod
    def preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown GeoAlign preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(cls(**PRESETS[name]), **overrides)


@dataclass
class CurationPlan:
    """What the engine trains on after curation. Slot i of the batch gets the content of rollout `source[i]`.

    source  (N,) long   rollout whose content (tokens, reward, log-probs, ...) fills slot i; i itself if kept
    weight  (N,) float  loss weight of slot i: 0 for flagged slots under `zero` and `drop`, else 1
    keep    (N,) bool   False for slots removed by `drop` (they also leave the group statistics), else True
    flagged (N,) bool   rollouts detected as anomalous (a prompt with no stable rollout is left unchanged)
    gdi     (N,) float  each rollout's GDI (Eq. 7), NaN for rollouts without a pair or when curation stopped early
    All five live on the device of `rewards`.
    """

    source: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    flagged: torch.Tensor
    gdi: torch.Tensor

    @classmethod
    def identity(cls, n, device=None):
        """The plan that changes nothing (every rollout fills its own slot with weight 1)."""
        return cls(
            source=torch.arange(n, device=device),
            weight=torch.ones(n, device=device),
            keep=torch.ones(n, dtype=torch.bool, device=device),
            flagged=torch.zeros(n, dtype=torch.bool, device=device),
            gdi=torch.full((n,), math.nan, device=device),
        )

    def to(self, device):
        """The same plan with every tensor on `device`."""
        return CurationPlan(*(getattr(self, f.name).to(device) for f in fields(self)))

    def multiplicity(self):
        """(N,) long: how many kept slots each original rollout fills (0 = replaced or dropped, 2+ = copied)."""
        return torch.bincount(self.source[self.keep], minlength=self.source.numel())

    def apply(self, x):
        """The kept slots' content, in slot order: `x[source[keep]]` for a tensor (rows) or a sequence (items)."""
        index = self.source[self.keep]
        if isinstance(x, torch.Tensor):
            return x[index.to(x.device)]
        return [x[i] for i in index.tolist()]


class Projector(nn.Module):
    """GeoAlign projector M_psi: ReLU MLP in_dim -> *config.hidden_sizes -> config.out_dim (3 linear layers default).

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

    rewards (N,), group_ids (N,) any integers. Tied or single-rollout prompts give no pair. max_per_side m > 0
    keeps only the top-m winners x bottom-m losers of each prompt (ties in the ranking broken uniformly at random
    with `generator`). Pairs come ordered by prompt id, then winner position, then loser position.
    """
    if rewards.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
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


def pair_distances(hidden, winner, loser, group_ids):
    """||h_w - h_l|| per pair (P,) float64, from the within-prompt Gram of prompt-centred hidden states.

    hidden (N, d), winner/loser (P,) pairs of the same prompt, group_ids (N,). Centring removes the large common
    component of LLM hidden states; a squared distance that still cancels (below CANCEL_TOL of
    ||hc_w||^2 + ||hc_l||^2) is recomputed directly from the float64 difference.
    """
    if winner.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    device = hidden.device
    rows, inverse = torch.unique(torch.cat((winner, loser)), return_inverse=True)
    w, l = inverse.chunk(2)
    h = hidden[rows.to(device)]
    _, group = torch.unique(group_ids.cpu()[rows], return_inverse=True)
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
    return d2.sqrt()


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


@torch.enable_grad()  # trains even when the caller runs under no_grad (OpenRLHF's experience maker does)
def fit_projector(projector, hidden, winner, loser, dist, config, generator=None, *, val_mask=None):
    """Train M_psi and a fresh linear probe w with the orientation loss (Eq. 4) -> (probe (out_dim,), steps).

    hidden (N, d) in the projector's dtype and device; winner, loser (P,) long; dist (P,) = ||h_w - h_l|| > 0.
    val_mask (P,) bool marks held-out pairs (whole prompts): after each step training stops once their accuracy
    reaches config.val_acc; None trains config.steps steps. Full-batch Adam, cosine LR decay from config.lr.
    """
    device = hidden.device
    if val_mask is None:
        val_mask = torch.zeros(winner.numel(), dtype=torch.bool)
    train, val = _compact(hidden, winner, loser, dist, ~val_mask), _compact(hidden, winner, loser, dist, val_mask)
    bound = 1 / math.sqrt(config.out_dim)
    init = torch.empty(config.out_dim).uniform_(-bound, bound, generator=generator)
    probe = init.to(device=device, dtype=hidden.dtype).requires_grad_()
    optimizer = torch.optim.Adam([*projector.parameters(), probe], lr=config.lr, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.steps)
    steps = 0
    while steps < config.steps:
        s_pos, s_neg = projector.pair_forward(*train) @ probe
        loss = orientation_loss(s_pos, s_neg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        steps += 1
        if val[1].numel():
            with torch.no_grad():
                if _orientation_acc(*(projector.pair_forward(*val) @ probe)) >= config.val_acc:
                    break
    return probe.detach(), steps


def _compact(hidden, winner, loser, dist, mask):
    """The masked pairs as pair_forward arguments over only the rollouts they use (Z is computed for those alone)."""
    rows, inverse = torch.unique(torch.cat((winner[mask], loser[mask])), return_inverse=True)
    w, l = inverse.to(hidden.device).chunk(2)
    return hidden[rows.to(hidden.device)], w, l, dist[mask].to(device=hidden.device, dtype=hidden.dtype)


def prototype(v, margins, kind="margin"):
    """GeoAlign Eq. 5: v_proto = normalize(sum_p (r_k - r_l) v_p) -> (v_proto (o,), resultant length in [0, 1]).

    v (P, o) unit pair directions, margins (P,) = r_k - r_l > 0; kind "plain" uses equal weights (the reference
    code). The resultant length ||sum_p m_p v_p|| / sum_p m_p measures the consensus (1 = all directions agree).
    """
    weights = margins.to(v) if kind == "margin" else torch.ones(len(v), dtype=v.dtype, device=v.device)
    centroid = weights @ v
    return F.normalize(centroid, dim=0), (centroid.norm() / weights.sum()).item()


def deviation(v, v_proto):
    """GeoAlign Eq. 6: s_p = 1 - cos(v_p, v_proto) for unit v (P, o) and v_proto (o,) -> (P,) in [0, 2]."""
    return 1 - v @ v_proto


def gdi(dev, winner, loser, n, kind="cumulative"):
    """GeoAlign Eq. 7: GDI_i = sum of s_p over the pairs containing rollout i (as winner or loser) -> (n,).

    dev (P,) deviations, winner/loser (P,) long; kind "mean" divides by the rollout's pair count. Rollouts without
    a pair have no score: NaN.
    """
    index = torch.cat((winner, loser)).to(dev.device)
    total = torch.zeros(n, dtype=dev.dtype, device=dev.device).index_add_(0, index, torch.cat((dev, dev)))
    count = torch.bincount(index, minlength=n).to(dev.dtype)
    score = total / count if kind == "mean" else total
    return torch.where(count > 0, score, torch.nan)


def kde_tail_threshold(scores, alpha):
    """Start of the high tail of the GDI density: the first point right of the mode where density < alpha * peak.

    scores (n,) float64; density = scipy `gaussian_kde` (Scott's bandwidth). Returns (threshold, mode):
    threshold = inf when the density stays >= alpha * peak up to the largest score (no tail to flag), NaN when
    the scores are degenerate (all equal to float32 precision, or a singular KDE covariance).
    """
    if np.ptp(scores) <= SCORE_TOL * max(1.0, float(np.abs(scores).max())):
        return math.nan, math.nan
    try:
        kde = gaussian_kde(scores)
    except np.linalg.LinAlgError:
        return math.nan, math.nan
    grid = np.linspace(scores.min(), scores.max(), KDE_GRID)  # a Gaussian KDE's mode lies inside the data range
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
    """Turn flags into a CurationPlan; "stable" = not flagged (scored or not). A prompt whose rollouts are all
    flagged is left unchanged. flagged, rewards, group_ids (N,).

    replace  each flagged slot gets a stable rollout of its prompt drawn by Best-Random (Eq. 8), independently
    zero     flagged slots get weight 0
    drop     flagged slots get keep False (and weight 0)
    amplify  Anomaly-Amplify ablation: the j-th flagged rollout of a prompt (index order) also overwrites the j-th
             stable slot in a uniformly random order, while stable slots last
    replace, zero and amplify keep every prompt's slot count.
    """
    if mode not in MODES:
        raise ValueError(f"unknown GeoAlign mode {mode!r}; choose one of {MODES}")
    n = rewards.numel()
    plan = CurationPlan.identity(n)
    plan.flagged = flagged.detach().cpu().bool()
    if n == 0 or not plan.flagged.any():
        return plan.to(rewards.device)
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
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
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape (N, d), got {tuple(hidden.shape)}")
    n = hidden.shape[0]
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
    for name, value, choices in (
        ("mode", config.mode, MODES),
        ("gdi", config.gdi, GDI_KINDS),
        ("prototype", config.prototype, PROTOTYPES),
    ):
        if value not in choices:
            raise ValueError(f"config.{name} must be one of {choices} (got {value!r})")
    checks = (
        ("alpha", 0 < config.alpha < 1, "in (0, 1)"),
        ("max_flag_frac", 0 < config.max_flag_frac <= 1, "in (0, 1]"),
        ("min_scores", config.min_scores >= 2, ">= 2 (a KDE needs two scores)"),
        ("max_pairs_per_side", config.max_pairs_per_side >= 0, ">= 0"),
        ("steps", config.steps >= 1, ">= 1"),
        ("lr", config.lr > 0, "> 0"),
        ("val_acc", 0 < config.val_acc <= 1, "in (0, 1]"),
        ("val_frac", 0 < config.val_frac < 1, "in (0, 1)"),
    )
    for name, ok, rule in checks:
        if not ok:
            raise ValueError(f"config.{name} must be {rule} (got {getattr(config, name)})")


def curate(hidden, rewards, group_ids, config, generator=None, *, projector=None, corrupted=None):
    """GeoAlign on one rollout batch -> (CurationPlan, stats: dict[str, float]).

    hidden (N, d) last-response-token final hidden states (any float dtype; computed in float32 on config.device),
    rewards (N,), group_ids (N,) prompt ids (any integers), corrupted (N,) optional bool mask of known-corrupted
    rollouts (adds precision, recall, auroc). `projector`: a `Projector` trained in place (kept weights when
    config.warm_start, re-initialised otherwise; moved to config.device in float32); None trains a fresh one.
    The linear probe is fresh every call. Deterministic under a fixed CPU `generator`.

    Identity plan, with the stats key saying why, when: no pair (tied prompts, identical hidden states;
    skip_no_pairs), fewer than two prompts with pairs (no prompt-level validation split, no cross-prompt
    consensus; skip_one_prompt), fewer than config.min_scores scored rollouts (skip_few_scores), or degenerate
    geometry (all GDI scores equal / singular KDE, or projected directions that cancel exactly; skip_degenerate).

    stats: pairs, pairs_identical (dropped: no direction), prompts_paired, n_scored, n_flagged, flag_frac,
    proj_steps, proj_loss, proj_train_acc, proj_val_acc (accuracy over both orientations, after training),
    consensus (resultant length of Eq. 5), cos_mean, cos_gt_0.8, gdi_p50, gdi_p95, kde_threshold (inf: no sparse
    tail), skip_* (1.0 = the reason for an identity plan), time_s; with `corrupted`: precision, recall, auroc.
    Values that were not computed are NaN.
    """
    start = time.perf_counter()
    _check_inputs(hidden, rewards, group_ids, config, generator, projector, corrupted)
    n = hidden.shape[0]
    device = torch.device(config.device)
    stats = dict.fromkeys(("pairs", "pairs_identical", "prompts_paired", "n_scored", "n_flagged", "proj_steps"), 0.0)
    stats.update(dict.fromkeys(("proj_loss", "proj_train_acc", "proj_val_acc", "consensus", "cos_mean"), math.nan))
    stats.update(dict.fromkeys(("cos_gt_0.8", "gdi_p50", "gdi_p95", "kde_threshold"), math.nan))
    stats.update(dict.fromkeys(("skip_no_pairs", "skip_one_prompt", "skip_few_scores", "skip_degenerate"), 0.0))
    scores = torch.full((n,), math.nan, dtype=torch.float64)
    flagged = torch.zeros(n, dtype=torch.bool)

    def finish():
        plan = rectify(flagged, rewards, group_ids, config.mode, generator)
        plan.gdi = scores.to(device=plan.gdi.device, dtype=plan.gdi.dtype)
        stats["n_flagged"] = float(flagged.sum())
        stats["flag_frac"] = float(flagged.sum()) / max(n, 1)
        if corrupted is not None:
            bad = corrupted.detach().cpu().bool()
            hits = float((flagged & bad).sum())
            stats["precision"] = hits / float(flagged.sum()) if flagged.any() else math.nan
            stats["recall"] = hits / float(bad.sum()) if bad.any() else math.nan
            stats["auroc"] = detection_auroc(scores.numpy(), bad.numpy(), ~torch.isnan(scores).numpy())[0]
        stats["time_s"] = time.perf_counter() - start
        return plan, stats

    # Eq. 3 pairs, minus those without a direction (numerically identical hidden states)
    r = rewards.detach().cpu().double()
    h = hidden.detach().to(device=device, dtype=torch.float32)
    winner, loser = preference_pairs(r, group_ids, config.max_pairs_per_side, generator)
    dist = pair_distances(h, winner, loser, group_ids)
    norms = h.double().norm(dim=1).cpu()
    same = dist <= SAME_TOL * torch.maximum(norms[winner], norms[loser])
    winner, loser, dist = winner[~same], loser[~same], dist[~same]
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
    paired_prompts = torch.unique(group[winner])
    counts = torch.bincount(torch.cat((winner, loser)), minlength=n)
    stats.update(
        pairs=float(len(winner)), pairs_identical=float(same.sum()), prompts_paired=float(len(paired_prompts))
    )
    stats["n_scored"] = float((counts > 0).sum())
    if not len(winner):
        stats["skip_no_pairs"] = 1.0
        return finish()
    if len(paired_prompts) < 2:
        stats["skip_one_prompt"] = 1.0
        return finish()
    if stats["n_scored"] < config.min_scores:
        stats["skip_few_scores"] = 1.0
        return finish()

    # Eq. 4: projector + temporary probe; validation split by prompt (at least one prompt on each side)
    n_val = min(len(paired_prompts) - 1, max(1, round(config.val_frac * len(paired_prompts))))
    val_prompts = paired_prompts[torch.randperm(len(paired_prompts), generator=generator)[:n_val]]
    val_mask = torch.isin(group[winner], val_prompts)
    if projector is None:
        projector = Projector(h.shape[1], config, generator)
    else:
        projector.to(device=device, dtype=torch.float32)
        if not config.warm_start:
            projector.reset_parameters(generator)
    probe, steps = fit_projector(projector, h, winner, loser, dist, config, generator, val_mask=val_mask)
    stats["proj_steps"] = float(steps)
    with torch.no_grad():
        out = projector.pair_forward(*_compact(h, winner, loser, dist, torch.ones_like(val_mask)))
        s_pos, s_neg = (out @ probe).cpu()
    train = ~val_mask
    stats["proj_loss"] = orientation_loss(s_pos[train], s_neg[train]).item()
    stats["proj_train_acc"] = _orientation_acc(s_pos[train], s_neg[train])
    stats["proj_val_acc"] = _orientation_acc(s_pos[val_mask], s_neg[val_mask])

    # Eq. 5-7: prototype, deviations, GDI
    v = F.normalize(out[0].double().cpu(), dim=1)
    v_proto, stats["consensus"] = prototype(v, r[winner] - r[loser], config.prototype)
    dev = deviation(v, v_proto)
    stats["cos_mean"] = (1 - dev).mean().item()
    stats["cos_gt_0.8"] = (1 - dev > 0.8).double().mean().item()
    scores = gdi(dev, winner, loser, n, config.gdi)
    scored = ~torch.isnan(scores)
    stats["gdi_p50"], stats["gdi_p95"] = np.quantile(scores[scored].numpy(), (0.5, 0.95)).tolist()
    if stats["consensus"] < SAME_TOL:
        stats["skip_degenerate"] = 1.0
        return finish()

    # KDE on the batch's GDI scores: flag the high tail, at most max_flag_frac of the batch (highest GDI first)
    threshold, _ = kde_tail_threshold(scores[scored].numpy(), config.alpha)
    stats["kde_threshold"] = threshold
    if math.isnan(threshold):
        stats["skip_degenerate"] = 1.0
        return finish()
    candidates = torch.nonzero(scored & (scores >= threshold))[:, 0]
    cap = math.floor(config.max_flag_frac * n + 1e-9)  # 0.29 * 100 is 28.999...
    keep = torch.sort(scores[candidates], descending=True, stable=True).indices[:cap]
    flagged[candidates[keep]] = True
    return finish()
