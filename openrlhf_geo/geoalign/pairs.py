"""GeoAlign Eq. 3 and Eq. 4 (§4.1-4.2, App. C.1): within-prompt preference pairs and their distances, the
projector M_psi and its training with a temporary linear probe on the pairs' unit displacements (orientation loss)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from openrlhf_geo.geoalign.config import GeoAlignConfig
from openrlhf_geo.groups import group_index

# Within-prompt Gram distances that cancel below this fraction of ||hc_k||^2 + ||hc_l||^2 are recomputed directly.
CANCEL_TOL = 1e-2


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
    def reset_parameters(self, generator=None) -> None:
        """PyTorch's default nn.Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn on the CPU from `generator`."""
        for layer in self.layers:
            bound = 1 / math.sqrt(layer.in_features)
            for param in (layer.weight, layer.bias):
                param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))

    def forward(self, u) -> torch.Tensor:
        """M(u): (P, in_dim) -> (P, out_dim). The naive form; training uses the equal but cheaper `pair_forward`."""
        return self._tail(self.layers[0](u))

    def pair_forward(self, hidden, winner, loser, dist) -> torch.Tensor:
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


def preference_pairs(rewards, group_ids, max_per_side=0, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
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


def pair_distances(hidden, winner, loser, group_ids) -> torch.Tensor:
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


def orientation_loss(s_pos, s_neg) -> torch.Tensor:
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
def fit_projector(
    projector, hidden, winner, loser, dist, config, generator=None, *, val_mask=None
) -> tuple[torch.Tensor, int]:
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
