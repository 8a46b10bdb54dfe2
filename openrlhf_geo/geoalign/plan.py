"""GeoAlign Eq. 8 and the whole batch (Algorithm 1): Best-Random probabilities and rectification (Eq. 8, App. C.5,
§5.4), `curate` (Eq. 3-8 on one rollout batch, §4.5's identity cases), GeoAlignState (the warm-started projector
and random stream across steps) and the registration as the pipeline's "geoalign" curation."""

import copy
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from openrlhf_geo.geoalign.config import MODES, GeoAlignConfig
from openrlhf_geo.geoalign.pairs import (
    Projector,
    _compact,
    _group_slots,
    _orientation_acc,
    _pow2_scale,
    fit_projector,
    orientation_loss,
    pair_distances,
    preference_pairs,
)
from openrlhf_geo.geoalign.scores import detection_auroc, deviation, gdi, kde_flags, prototype
from openrlhf_geo.groups import group_index, tied_groups
from openrlhf_geo.registry import register_curation
from openrlhf_geo.stages import CurationPlan, stream

SKIP_REASONS = ("no_pairs", "few_scores", "degenerate")  # stats["skipped_reason"] when curation did not run

# A pair whose hidden states differ by less than this fraction of their norm (~10 float32 ulps) has no direction.
SAME_TOL = 1e-6
# GDI scores spread over less than this (in GDI units: a pair's deviation lies in [0, 2]) or this fraction of their
# magnitude are float32 noise of directions that agree: curate skips them, no density to threshold.
SCORE_TOL = 1e-5


def best_random_probs(rewards, stable) -> torch.Tensor:
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


def rectify(flagged, rewards, group_ids, mode="replace", generator=None, usable=None) -> CurationPlan:
    """GeoAlign §4.4 rectification: flags -> CurationPlan; "stable" = not flagged (scored or not) and usable. A
    prompt without a stable rollout is left unchanged (Eq. 8 needs one; the paper does not treat this case).
    flagged, rewards, group_ids (N,); usable (N,) bool, None = all: a rollout that is not usable (no action token:
    `curate`) is never a Best-Random donor, nor an amplify target; its own slot keeps it.

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
    usable = torch.ones(n, dtype=torch.bool) if usable is None else usable.detach().cpu().bool()
    stable = valid & ~plan.flagged[member] & usable[member]
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


def _check_inputs(hidden, rewards, group_ids, config, generator, projector, corrupted, actions):
    """Validate curate's arguments -> (rewards, group_ids, corrupted, acted (N,) bool: rollouts with an action
    token) as tensors. Lists are accepted; prompt ids may also be strings (mapped to integers, order kept)."""
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
    return rewards, group_ids, corrupted, _acted(actions, n)


def _acted(actions, n) -> torch.Tensor:
    """curate's `actions` (N,) action-token counts (None: all have some) -> (N,) bool: rollouts with a token."""
    if actions is None:
        return torch.ones(n, dtype=torch.bool)
    actions = torch.as_tensor(np.asarray(actions) if not isinstance(actions, torch.Tensor) else actions).cpu()
    if tuple(actions.shape) != (n,):
        raise ValueError(f"actions must have shape ({n},) to match hidden (N, d), got {tuple(actions.shape)}")
    if actions.is_floating_point() or actions.is_complex() or bool((actions < 0).any()):
        raise ValueError("actions must hold each rollout's action-token count (integers >= 0)")
    return actions > 0


def _blank_stats():
    """curate's stats before any step ran (counts 0, measurements NaN, not skipped), in logging order."""
    counts = (
        *("pairs", "pairs_identical", "prompts_paired", "n_scored", "n_candidates", "n_flagged", "proj_steps"),
        *("zero_action_rollouts", "zero_variance_groups_after"),
    )
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


def curate(
    hidden, rewards, group_ids, config, generator=None, *, projector=None, corrupted=None, actions=None
) -> tuple[CurationPlan, dict]:
    """GeoAlign on one rollout batch (Algorithm 1, function GeoAlign) -> (CurationPlan, stats: dict).

    hidden (N, d) last-response-token final hidden states (any float dtype and magnitude; computed in float32 on
    config.device after an exact power-of-two rescale), rewards (N,), group_ids (N,) prompt ids (integers, or a
    list of strings), corrupted (N,) optional bool mask of known-corrupted rollouts (adds precision, recall,
    auroc), actions (N,) optional action-token counts per rollout (None: every rollout has some). `projector`: a
    `Projector` trained in place (kept weights when config.warm_start, re-initialised otherwise; moved to
    config.device in float32); None trains a fresh one. The linear probe is fresh every call. Deterministic under a
    fixed CPU `generator`.

    A rollout with no action token (actions 0: an empty response, a prompt that filled the context window, an agent
    turn without an action span) has no last response token, so no hidden state of §4 (the engines pass a zero
    row) and no update direction: it forms no Eq. 3 pair, trains no projector (Eq. 4), adds nothing to the
    prototype (Eq. 5), gets no GDI (Eq. 7) and so is never flagged, and is never an Eq. 8 Best-Random donor (it
    would copy an empty response over an anomalous one); its own slot keeps it. Counted in zero_action_rollouts.

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
      skipped_reason, time_s; zero_action_rollouts (rollouts with actions 0, left out as above),
      zero_variance_groups_after (prompts whose rewards differed and whose kept slots all hold one reward after
      rectification: a group-normalized estimator gives each of them zero advantages; DAPO's dynamic filtering ran
      before the curation, docs/usage.md); with `corrupted`: precision, recall, auroc (of GDI among scored rollouts;
      recall over every corrupted rollout).
    """
    start = time.perf_counter()
    rewards, group_ids, corrupted, acted = _check_inputs(
        hidden, rewards, group_ids, config, generator, projector, corrupted, actions
    )
    n, stats = hidden.shape[0], _blank_stats()
    scores, flagged = torch.full((n,), math.nan, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)
    rows = torch.nonzero(acted)[:, 0]  # rollouts with a direction: the others keep NaN scores and no flag
    scores[rows], flagged[rows], skipped = _detect(
        hidden[rows], rewards[rows], group_ids[rows], config, generator, projector, stats
    )
    # Eq. 8: rectify the flagged rollouts (Best-Random replacement under the default mode) with usable donors only
    plan = rectify(flagged, rewards, group_ids, config.mode, generator, usable=acted)
    plan.score = scores.to(device=plan.score.device, dtype=plan.score.dtype)
    stats.update(_outcome_stats(flagged, scores, corrupted, skipped))
    stats["zero_action_rollouts"] = float(n - len(rows))
    stats["zero_variance_groups_after"] = _tied_by_plan(rewards, group_ids, plan)
    stats["time_s"] = time.perf_counter() - start
    return plan, stats


def _tied_by_plan(rewards, group_ids, plan) -> float:
    """Prompts whose rewards (N,) differ but whose kept slots all hold one reward under `plan` (Best-Random can
    copy the one stable reward over the others)."""
    group, n_groups = group_index(group_ids)
    r, keep = rewards.detach().cpu().double(), plan.keep.cpu()
    before = tied_groups(r, group, n_groups)
    after = tied_groups(r[plan.source.cpu()][keep], group[keep], n_groups)  # a prompt with no kept slot: not tied
    return float((after & ~before).sum())


def _detect(hidden, rewards, group_ids, config, generator, projector, stats):
    """Eq. 3-7 and §4.4 on validated inputs -> (GDI scores (N,) float64, NaN where none; flags (N,) bool; the skip
    reason, "" when the rule ran); fills `stats` (see curate)."""
    n = hidden.shape[0]
    scores, flagged = torch.full((n,), math.nan, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)

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
        return scores, flagged, "no_pairs"  # §4.5: no pair, identity

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
        return scores, flagged, skipped

    # §4.4: the KDE tail flag (high tail, own density < alpha * peak), then the opt-in cap
    flags, stats["kde_mode"], stats["kde_threshold"] = kde_flags(scores[index].numpy(), config.alpha, config.rule)
    if math.isnan(stats["kde_mode"]):
        return scores, flagged, "degenerate"
    candidates = index[torch.from_numpy(flags)]
    stats["n_candidates"] = float(len(candidates))
    flagged[_cap_flags(candidates, scores, len(index), config.max_flag_frac)] = True
    return scores, flagged, ""


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
        actions=batch.actions,
    )
