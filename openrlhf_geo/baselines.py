"""The SALT (arXiv 2606.05800) and GeoAlign (arXiv 2606.26917) comparison baselines as pure tensor functions.

Every function returns ``(result, stats)``; ``stats`` maps metric names (``<baseline>/<metric>``) to floats.

SALT §4.2 / App. I, Table 4 (entropy-oriented controls of GRPO):
    entropy_bonus_loss      entropy regulariser, SALT Eq. 70-71
    clip_cov_policy_loss    Clip-Cov, Cui et al. (arXiv 2505.22617)
    kl_cov_policy_loss      KL-Cov, Cui et al. (arXiv 2505.22617)
GeoAlign §5.1 / App. B.5 (robust-RL baselines):
    pf_ppo_plan             PF-PPO Best-vs-Random / Best-vs-Worst filtration, Zhang et al. (arXiv 2409.06957)
    par_rewards             PAR, preference as reward, Fu et al. (arXiv 2502.18770)
    pods_plan               PODS max-variance down-sampling, Xu et al. (arXiv 2504.13818)
    seed_grpo_advantages    Seed-GRPO semantic-entropy advantage scaling, Chen et al. (arXiv 2505.12346)
    math_answer_clusters    semantic-equivalence classes for Seed-GRPO by math-verify equality of boxed answers

``BaselineConfig`` holds the --baseline.* flags (options.py). Each baseline is registered once (registry.py) with
the engines that run it: the curations PF-PPO / PODS (the pipeline's ``curate``), the policy losses (``policy_loss``,
the engines' dispatch) and the adjustments PAR (local engine only) and Seed-GRPO (the pipeline's ``adjust``). The
entropy bonus is the local engine's (the fork's is upstream's own --actor.entropy_coef term).

The two policy losses and the entropy bonus stay differentiable in their log-prob / entropy inputs (only their token
selection runs without gradient); every other function runs under ``torch.no_grad``. The rollout-selection
baselines (PF-PPO, PODS) return a ``stages.CurationPlan``, which an engine applies like GeoAlign's own plan.
Random choices come from a CPU ``torch.Generator``.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from openrlhf_geo import losses  # noqa: F401  (registers the default policy loss, ppo, first)
from openrlhf_geo.config_flags import setting
from openrlhf_geo.groups import group_index
from openrlhf_geo.registry import (
    ADJUSTMENTS,
    CURATIONS,
    POLICY_LOSSES,
    baseline_curations,
    register_adjustment,
    register_curation,
    register_policy_loss,
)
from openrlhf_geo.rewards.math_verify import extract_last_boxed, score_answer
from openrlhf_geo.stages import CurationPlan, Stream, stream

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
PF_PPO_MODES = ("best_random", "best_worst")
SE_ESTIMATORS = ("mc", "shannon")

# SALT Table 4; the covariance bounds are also Cui et al.'s released defaults (verl clip_cov_lb / clip_cov_ub).
CLIP_COV_RATIO, CLIP_COV_LB, CLIP_COV_UB, CLIP_COV_CLIP = 2e-4, 1.0, 5.0, 1.0
KL_COV_RATIO, KL_COV_COEF = 2e-3, 1.0


def _only_with(policy_loss):
    """Field metadata: the setting belongs to --baseline.policy_loss `policy_loss` (options.validate)."""
    return {"policy_loss": policy_loss}


@dataclass(frozen=True)
class BaselineConfig:
    """The --baseline.* settings of a run, validated here on construction (each error names its flag).

    policy_loss       ppo (the engine's own clipped surrogate), clip_cov or kl_cov (``policy_loss``)
    clip_cov_*        Clip-Cov's ratio and covariance bounds; kl_cov_*: KL-Cov's ratio and coefficient (SALT Table 4)
    curation          None, pf_ppo_br / pf_ppo_bw (``pf_ppo_plan``) or pods (``pods_plan``, needs pods_m)
    pf_ppo_keep_count PF-PPO keeps every prompt's G slots (``pf_ppo_plan(keep_count=True)``), no rollout dropped
    seed_grpo_alpha   None (off) or Seed-GRPO's alpha in [0, 1] (``seed_grpo_advantages``)
    par_references    0 (off) or PAR's M reference responses per prompt (``par_rewards``)
    """

    FLAG_PREFIX = "baseline"

    policy_loss: str = setting(
        "ppo",
        "per-token policy loss: ppo (the engine's own clipped surrogate), clip_cov or kl_cov (Cui et al., "
        "arXiv 2505.22617)",
        choices=lambda: POLICY_LOSSES,
    )
    clip_cov_ratio: float = setting(CLIP_COV_RATIO, "Clip-Cov token ratio", metadata=_only_with("clip_cov"))
    clip_cov_lb: float = setting(CLIP_COV_LB, "Clip-Cov covariance lower bound", metadata=_only_with("clip_cov"))
    clip_cov_ub: float = setting(CLIP_COV_UB, "Clip-Cov covariance upper bound", metadata=_only_with("clip_cov"))
    kl_cov_ratio: float = setting(KL_COV_RATIO, "KL-Cov token ratio", metadata=_only_with("kl_cov"))
    kl_cov_coef: float = setting(KL_COV_COEF, "KL-Cov KL coefficient", metadata=_only_with("kl_cov"))
    curation: str | None = setting(
        None,
        "rollout selection instead of GeoAlign: PF-PPO best-vs-random / best-vs-worst, or PODS max-variance",
        choices=baseline_curations,
    )
    pods_m: int | None = setting(
        None,
        "PODS: rollouts kept per prompt (required with --baseline.curation pods)",
        metadata={"curation": ("pods",)},
        type=int,
    )
    pf_ppo_keep_count: bool = setting(
        False,
        "PF-PPO: the best and its partner refill the filtered slots instead of dropping them (the fork needs it)",
        metadata={"curation": ("pf_ppo_br", "pf_ppo_bw")},
    )
    seed_grpo_alpha: float | None = setting(
        None,
        "Seed-GRPO (arXiv 2505.12346): scale each prompt's advantages by 1 - alpha * SE / log G",
        type=float,
    )
    par_references: int = setting(
        0, "PAR (arXiv 2502.18770): reference responses per prompt from the initial policy (local engine only)"
    )

    def __post_init__(self):
        POLICY_LOSSES[self.policy_loss]  # ValueError naming the registered losses
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"--baseline.{name} must be in (0, 1] (got {value!r})")
        if not (
            math.isfinite(self.clip_cov_lb)
            and math.isfinite(self.clip_cov_ub)
            and self.clip_cov_lb <= self.clip_cov_ub
        ):
            raise ValueError(
                "--baseline.clip_cov_lb must be <= --baseline.clip_cov_ub, both finite "
                f"(got {self.clip_cov_lb!r}, {self.clip_cov_ub!r})"
            )
        if not (math.isfinite(self.kl_cov_coef) and self.kl_cov_coef >= 0):
            raise ValueError(f"--baseline.kl_cov_coef must be a finite number >= 0 (got {self.kl_cov_coef!r})")
        if self.curation is not None and self.curation not in baseline_curations():
            choices = ", ".join(baseline_curations())
            raise ValueError(f"--baseline.curation must be one of {choices} (got {self.curation!r})")
        for f in fields(self):  # a curation's own settings: only with that curation
            owners = f.metadata.get("curation")
            if owners and getattr(self, f.name) != f.default and self.curation not in owners:
                raise ValueError(f"--baseline.{f.name} only applies with --baseline.curation {' or '.join(owners)}")
        message = None if self.curation is None else CURATIONS[self.curation].check(self)
        if message is not None:
            raise ValueError(message)
        if self.seed_grpo_alpha is not None and not (
            isinstance(self.seed_grpo_alpha, (int, float)) and 0 <= self.seed_grpo_alpha <= 1
        ):
            raise ValueError(f"--baseline.seed_grpo_alpha must be in [0, 1] (got {self.seed_grpo_alpha!r})")
        if not (isinstance(self.par_references, int) and self.par_references >= 0):
            raise ValueError(f"--baseline.par_references must be an integer >= 0 (got {self.par_references!r})")

    @property
    def drops_rollouts(self) -> bool:
        """True when the curation plan can drop rollouts (keep False): PODS, and PF-PPO without keep_count."""
        return self.curation is not None and CURATIONS[self.curation].drops(self)

    @property
    def in_pipeline(self) -> bool:
        """Whether a per-step pipeline baseline is on (a curation or an adjustment; the policy losses are the loss)."""
        adjustments = (entry for entry in ADJUSTMENTS.values() if entry.config == "baseline")
        return self.curation is not None or any(entry.enabled(self) for entry in adjustments)


def _aggregate(per_token, mask, mode, normalizer):
    """token-mean: masked sum / normalizer (default: valid tokens); seq-mean-token-mean: sum of each row's token mean
    over rows with a valid token / normalizer (default: those rows). Either is 0 with no valid token."""
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        total, count = (per_token * mask).sum(), mask.sum()
    else:
        tokens = mask.sum(1)
        total, count = ((per_token * mask).sum(1) / tokens.clamp(min=1)).sum(), (tokens > 0).sum()
    if normalizer is None:
        normalizer = count.clamp(min=1)
    return total / normalizer


def _check_tokens(mask, **tensors):
    """(N, T) float tensors of one shape and a bool/0-1 mask of that shape -> bool mask."""
    shape = tuple(mask.shape)
    if len(shape) != 2:
        raise ValueError(f"mask must have shape (N, T), got {shape}")
    for name, value in tensors.items():
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have the mask's shape {shape}, got {tuple(value.shape)}")
        if not value.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be bool or hold only 0 and 1")
    valid = mask.bool()
    for name, value in tensors.items():
        if not torch.isfinite(value.detach()[valid]).all():
            raise ValueError(f"{name} has NaN or inf on valid (mask=1) tokens")
    return valid


def _check_fraction(name, value):
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"{name} must be in (0, 1] (got {value!r})")


def _check_generator(generator):
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU torch.Generator (got device {generator.device})")


def _groups(group_ids, n):
    """Prompt groups as index tensors (rows of each prompt, ascending), in order of each prompt's first row."""
    if tuple(group_ids.shape) != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integer prompt ids, got dtype {group_ids.dtype}")
    inverse, _ = group_index(group_ids)
    order = torch.argsort(inverse, stable=True)
    groups = torch.split(order, torch.bincount(inverse).tolist())
    return sorted(groups, key=lambda rows: int(rows[0]))


def _check_rewards(rewards):
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards.double()).all():
        raise ValueError("rewards contain NaN or inf")


def entropy_bonus_loss(
    entropy, mask, coef, loss_agg_mode="seq-mean-token-mean", normalizer=None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Entropy bonus (SALT App. I, Eq. 70-71) as a loss term: ``-coef * aggregated token entropy`` -> (loss, stats).

    Eq. 71 adds ``lambda_ENT * E_q[1/G sum_i 1/|o_i| sum_t H(s_i,t)]`` to the GRPO objective, so a minimised loss gets
    its negative; the default aggregation is that seq-mean-token-mean, ``token-mean`` averages over all valid tokens.
    entropy (N, T) per-token policy entropy H (Eq. 70), differentiable; mask (N, T) bool or 0/1; coef lambda_ENT >= 0.
    normalizer: the divisor for a micro-batch's share of a larger mini-batch (default: this call's valid tokens for
    token-mean, valid rows for seq-mean-token-mean), as in the engines' loss aggregation.
    SALT Table 4's "Entropy coefficient 0" is its non-bonus default; it does not state lambda_ENT for the entropy-bonus
    runs, so no default is given here. No valid token: loss 0 (still connected to the graph).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES} (got {loss_agg_mode!r})")
    if not (isinstance(coef, (int, float)) and math.isfinite(coef) and coef >= 0):
        raise ValueError(f"coef (lambda_ENT) must be a finite number >= 0 (got {coef!r})")
    if normalizer is not None and not float(normalizer) > 0:
        raise ValueError(f"normalizer must be > 0 (got {normalizer!r})")
    valid = _check_tokens(mask, entropy=entropy)
    mean_entropy = _aggregate(entropy, valid, loss_agg_mode, normalizer)
    loss = -coef * mean_entropy
    return loss, {"entropy_bonus/entropy": float(mean_entropy.detach()), "entropy_bonus/loss": float(loss.detach())}


@torch.no_grad()
def token_covariance(log_probs, advantages, mask) -> torch.Tensor:
    """Per-token covariance term of Cui et al. (arXiv 2505.22617, Clip-Cov/KL-Cov): ``(log pi(y_i) - mean log pi) *
    (A(y_i) - mean A)``, means over the valid tokens of this call -> (N, T) float, 0 on masked tokens."""
    valid = mask.bool()
    if not valid.any():
        return torch.zeros_like(log_probs)
    centred_logp = log_probs - log_probs[valid].mean()
    centred_adv = advantages - advantages[valid].mean()
    return torch.where(valid, centred_logp * centred_adv, 0.0)


def clip_cov_policy_loss(
    log_probs,
    old_log_probs,
    advantages,
    mask,
    *,
    ratio=CLIP_COV_RATIO,
    cov_lb=CLIP_COV_LB,
    cov_ub=CLIP_COV_UB,
    clip_low=CLIP_COV_CLIP,
    clip_high=CLIP_COV_CLIP,
    generator=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al., arXiv 2505.22617, "Suppressing Tokens with High Covariances") -> (loss (N, T), stats).

    PPO's clipped surrogate ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` per token, r = exp(logp - old),
    except on ``max(1, floor(ratio * n_valid))`` tokens drawn uniformly without replacement (``generator``) from those
    whose covariance (``token_covariance``) lies in [cov_lb, cov_ub]: their loss is 0, i.e. their gradient is
    detached. Tokens the PPO clip already cuts off (zero gradient either way) are not candidates; the count has a
    floor of 1 and selection runs over the tokens of this call (a micro-batch): both as in the authors' released loss
    (verl ``clip_cov``), which this follows (the paper's text and equation numbers could not be retrieved here).
    Fewer candidates than the count: all candidates. Defaults: SALT Table 4 (ratio 2e-4,
    bounds 1 and 5, PPO clip ratios 1 / 1).
    log_probs (N, T) current policy (differentiable), old_log_probs and advantages (N, T), mask (N, T); the loss is 0
    on masked tokens; aggregate it like the plain PPO loss.
    """
    valid = _check_tokens(mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    _check_fraction("ratio (clip-cov ratio)", ratio)
    if not cov_lb <= cov_ub:
        raise ValueError(f"cov_lb must be <= cov_ub (got {cov_lb!r} > {cov_ub!r})")
    if not (0 <= clip_low <= 1 and clip_high >= 0):
        raise ValueError(f"clip_low must be in [0, 1] and clip_high >= 0 (got {clip_low!r}, {clip_high!r})")
    _check_generator(generator)
    prob_ratio = torch.exp(log_probs - old_log_probs)
    surrogate = -advantages * prob_ratio
    clipped = -advantages * prob_ratio.clamp(1 - clip_low, 1 + clip_high)
    with torch.no_grad():
        ppo_clipped = valid & (clipped > surrogate)
        cov = token_covariance(log_probs.detach(), advantages, valid)
        candidates = valid & ~ppo_clipped & (cov >= cov_lb) & (cov <= cov_ub)
        n_valid, pool = int(valid.sum()), candidates.flatten().nonzero()[:, 0]
        n_select = min(max(1, math.floor(ratio * n_valid)), len(pool))
        pick = pool[torch.randperm(len(pool), generator=generator)[:n_select].to(pool.device)]
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        selected[pick] = True
        selected = selected.view_as(valid)
    loss = torch.where(valid & ~selected, torch.maximum(surrogate, clipped), 0.0)
    denominator = max(n_valid, 1)
    stats = {
        "clip_cov/selected_frac": n_select / denominator,
        "clip_cov/candidate_frac": len(pool) / denominator,
        "clip_cov/ppo_clip_frac": float(ppo_clipped.sum()) / denominator,
        "clip_cov/ppo_kl": float((old_log_probs - log_probs).detach()[valid].sum()) / denominator,
    }
    return loss, stats


def kl_cov_policy_loss(
    log_probs, old_log_probs, advantages, mask, *, ratio=KL_COV_RATIO, kl_coef=KL_COV_COEF
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al., arXiv 2505.22617, "Suppressing Tokens with High Covariances") -> (loss (N, T), stats).

    Per token ``-A r`` (r = exp(logp - old), no ratio clipping), plus ``kl_coef * |logp - old|`` on the
    ``max(1, floor(ratio * n_valid))`` valid tokens of largest covariance (``token_covariance``) in this call.
    |logp - old| is the per-token KL estimate, the count's floor of 1 and the absent ratio clip follow the authors'
    released loss (verl ``kl_cov``; the paper's text was not retrievable here), on which SALT Table 4's clip ratios
    0.2 / 0.2 for KL-Cov have no effect.
    Defaults: SALT Table 4 (KL covariance ratio 2e-3, PPO KL coefficient 1). Ties in covariance: torch.topk's pick.
    log_probs (N, T) current policy (differentiable), old_log_probs and advantages (N, T), mask (N, T); the loss is 0
    on masked tokens.
    """
    valid = _check_tokens(mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    _check_fraction("ratio (KL covariance ratio)", ratio)
    if not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef (PPO KL coefficient) must be a finite number >= 0 (got {kl_coef!r})")
    log_ratio = log_probs - old_log_probs
    with torch.no_grad():
        n_valid = int(valid.sum())
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if n_valid:
            n_select = min(max(1, math.floor(ratio * n_valid)), n_valid)
            flat_valid = valid.flatten().nonzero()[:, 0]
            cov = token_covariance(log_probs.detach(), advantages, valid).flatten()[flat_valid]
            selected[flat_valid[torch.topk(cov, n_select).indices]] = True
        selected = selected.view_as(valid)
    loss = -advantages * torch.exp(log_ratio) + kl_coef * log_ratio.abs() * selected
    loss = torch.where(valid, loss, 0.0)
    denominator = max(n_valid, 1)
    stats = {
        "kl_cov/selected_frac": float(selected.sum()) / denominator,
        "kl_cov/ppo_kl_abs": float(log_ratio.detach().abs()[valid].sum()) / denominator,
    }
    return loss, stats


def policy_loss(
    config, log_probs, old_log_probs, advantages, mask, clip_low, clip_high, generator=None
) -> tuple[torch.Tensor, dict]:
    """--baseline.policy_loss <registered loss> -> (per-token loss (N, T), stats) with the config's settings; both
    engines aggregate it as they aggregate their PPO loss.

    clip_low / clip_high: the engine's PPO clip ratios (Clip-Cov clips with them; SALT Table 4 sets 1 / 1 for it).
    advantages (N,) per sequence or (N, T) per token.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(log_probs)
    advantages = advantages.to(log_probs.dtype)
    loss = POLICY_LOSSES[config.policy_loss].loss
    return loss(config, log_probs, old_log_probs, advantages, mask, clip_low, clip_high, generator)


def _clip_cov_fits(config, eps_low):
    if not eps_low <= 1:
        return f"--baseline.policy_loss clip_cov needs a low PPO clip ratio <= 1 (got {eps_low})"
    return None


@register_policy_loss("clip_cov", clip_frac="clip_cov/ppo_clip_frac", check=_clip_cov_fits)
def _clip_cov(config, log_probs, old_log_probs, advantages, mask, clip_low, clip_high, generator):
    return clip_cov_policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        ratio=config.clip_cov_ratio,
        cov_lb=config.clip_cov_lb,
        cov_ub=config.clip_cov_ub,
        clip_low=clip_low,
        clip_high=clip_high,
        generator=generator,
    )


@register_policy_loss("kl_cov")
def _kl_cov(config, log_probs, old_log_probs, advantages, mask, clip_low, clip_high, generator):
    return kl_cov_policy_loss(
        log_probs, old_log_probs, advantages, mask, ratio=config.kl_cov_ratio, kl_coef=config.kl_cov_coef
    )


def _best(rows, values, keys):
    """Row of the largest value, ties broken by the random keys (uniform among the tied)."""
    top = values == values.max()
    return int(rows[top][keys[top].argmax()])


@torch.no_grad()
def pf_ppo_plan(
    rewards, group_ids, mode="best_random", generator=None, *, keep_count=False
) -> tuple[CurationPlan, dict[str, float]]:
    """PF-PPO rollout filtration (Zhang et al., arXiv 2409.06957) -> (CurationPlan, stats).

    Per prompt PF-PPO trains on the best rollout plus one partner: ``best_random`` (BR) a uniformly drawn other
    rollout, ``best_worst`` (BW) the lowest-rewarded one (GeoAlign App. B.5; GeoAlign Eq. 8 is BR's draw written as
    probabilities, 1/2 for the best and 1/(2(G-1)) for each other). Reward ties are broken uniformly at random.
    PF-PPO's own method text could not be retrieved here; this follows GeoAlign's description of it.

    keep_count False (PF-PPO as described): the pair is kept, the other rollouts dropped (keep False, weight 0), so a
        prompt keeps 2 rollouts. keep_count True: the prompt keeps its G slots; the best fills ceil(G/2) of them and
        the partner floor(G/2) (each keeps its own slot, the others are overwritten in index order), so for even G the
        group mean and std, hence GRPO's advantages, equal those of the pair itself.
    A prompt with one rollout is left unchanged. ``flagged`` marks rollouts PF-PPO filters out; ``score`` is NaN.
    rewards (N,), group_ids (N,) integer prompt ids; plan tensors on the device of ``rewards``.
    """
    if mode not in PF_PPO_MODES:
        raise ValueError(f"mode must be one of {PF_PPO_MODES} (got {mode!r})")
    _check_rewards(rewards)
    _check_generator(generator)
    n = rewards.numel()
    r = rewards.detach().double().cpu()
    plan = CurationPlan.identity(n)
    keys = torch.rand(n, generator=generator, dtype=torch.float64)
    for rows in _groups(group_ids, n):
        if len(rows) < 2:
            continue
        best = _best(rows, r[rows], keys[rows])
        others = rows[rows != best]
        if mode == "best_worst":
            partner = _best(others, -r[others], keys[others])
        else:
            partner = int(others[torch.randint(len(others), (1,), generator=generator)])
        dropped = rows[(rows != best) & (rows != partner)]
        plan.flagged[dropped] = True
        if keep_count:
            extra_best = math.ceil(len(rows) / 2) - 1
            plan.source[dropped[:extra_best]] = best
            plan.source[dropped[extra_best:]] = partner
        else:
            plan.keep[dropped] = False
            plan.weight[dropped] = 0.0
    after = plan.apply(r)
    stats = {
        "pf_ppo/kept_frac": float(plan.keep.sum()) / max(n, 1),
        "pf_ppo/filtered_frac": float(plan.flagged.sum()) / max(n, 1),
        "pf_ppo/reward_mean_before": float(r.mean()) if n else math.nan,
        "pf_ppo/reward_mean_after": float(after.mean()) if len(after) else math.nan,
    }
    return plan.to(rewards.device), stats


def _fork_keeps_counts(config):
    """The fork refuses a plan that drops rollouts (its groups and accumulation steps have fixed sizes)."""
    if not config.drops_rollouts:
        return None
    return (
        f"--baseline.curation {config.curation} drops rollouts, which OpenRLHF's fixed n_samples_per_prompt groups, "
        "micro-batches and DeepSpeed accumulation steps cannot take: in the fork use PF-PPO with "
        "--baseline.pf_ppo_keep_count (the pair refills the filtered slots); PODS and dropping PF-PPO run on the "
        "local engine"
    )


def _pf_ppo(mode):
    def plan(config, state, batch, rewards, hidden):
        return pf_ppo_plan(rewards, batch.group_ids, mode, state.generator, keep_count=config.pf_ppo_keep_count)

    return plan


def _baseline_stream(config, seed):
    return Stream(stream(seed, "baseline"))


def _pf_ppo_drops(config):
    return not config.pf_ppo_keep_count


for _name, _mode in (("pf_ppo_br", "best_random"), ("pf_ppo_bw", "best_worst")):
    register_curation(_name, state=_baseline_stream, drops=_pf_ppo_drops, fork=_fork_keeps_counts)(_pf_ppo(_mode))


@torch.no_grad()
def par_rewards(rewards, reference_rewards) -> tuple[torch.Tensor, dict[str, float]]:
    """PAR, preference as reward (Fu et al., arXiv 2502.18770; formula as in the authors' released reward shaper)
    -> (shaped rewards (N,), stats).

    ``r_RL = 1/M sum_m sigmoid(r - r_ref,m)``: the reward model's preference probability of the rollout over each of M
    reference responses to the same prompt (sampled from the SFT/reference policy), averaged. Bounded in [0, 1]
    (float rounding can reach the ends), centred at 1/2 where the rollout matches its references. The paper finds
    M = 1 sufficient; Fu et al.'s released code averages over its references (``--num_refs``, 5 there).
    rewards (N,); reference_rewards (N,) (one reference per rollout) or (N, M), NaN entries meaning "no reference"
    (prompts with fewer references); a per-prompt table ``ref`` (P, M) is passed as ``ref[prompt_index]``.
    Computed in float64, returned in the dtype of ``rewards``. A rollout with no finite reference raises ValueError
    (there is nothing to centre on, and its raw reward would be on another scale).
    """
    _check_rewards(rewards)
    refs = reference_rewards[:, None] if reference_rewards.dim() == 1 else reference_rewards
    if refs.dim() != 2 or refs.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"reference_rewards must have shape ({rewards.shape[0]},) or ({rewards.shape[0]}, M), "
            f"got {tuple(reference_rewards.shape)}"
        )
    refs = refs.double().to(rewards.device)
    present = ~torch.isnan(refs)
    if torch.isinf(refs).any():
        raise ValueError("reference_rewards contain inf")
    if not present.any(1).all():
        missing = (~present.any(1)).nonzero()[:, 0].tolist()
        raise ValueError(f"reference_rewards has no reference for rollouts {missing[:10]} (all NaN)")
    preference = torch.sigmoid(rewards.double()[:, None] - torch.where(present, refs, 0.0))
    shaped = (preference * present).sum(1) / present.sum(1)
    stats = {
        "par/reward_mean": float(shaped.mean()) if shaped.numel() else math.nan,
        "par/raw_reward_mean": float(rewards.double().mean()) if rewards.numel() else math.nan,
        "par/reference_mean": float(refs[present].mean()) if present.any() else math.nan,
    }
    return shaped.to(rewards.dtype), stats


@register_adjustment(
    "par",
    "reward",
    "--baseline.par_references",
    enabled=lambda config: config.par_references > 0,
    inputs=("references",),
    fork=lambda config: (
        "--baseline.par_references: PAR needs, every step, reward-model scores of M reference responses per "
        "prompt sampled from the frozen initial policy; the fork's experience maker has no such generation pass "
        "(it would need the initial weights in vLLM beside the policy's). Run PAR on the local engine "
        "(`openrlhf-geo train --baseline.par_references M`)"
    ),
    needs_groups=False,
)
def _par(config, state, batch, rewards, *, references):
    """PAR on the batch's rewards; references() -> (N, M) rewards of M reference responses per prompt."""
    return par_rewards(rewards, references())


def _max_variance_subset(values, m):
    """Positions (into ``values``) of m values of maximal variance: the top k and bottom m - k for the best k
    (PODS's O(n log n) rule); the first best k wins ties."""
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    n = len(ranked)
    prefix, prefix_sq = np.concatenate([[0.0], np.cumsum(ranked)]), np.concatenate([[0.0], np.cumsum(ranked**2)])
    k = np.arange(m + 1)  # k largest + (m - k) smallest
    total = prefix[m - k] + prefix[n] - prefix[n - k]
    total_sq = prefix_sq[m - k] + prefix_sq[n] - prefix_sq[n - k]
    best = int(np.argmax(total_sq / m - (total / m) ** 2))
    return np.concatenate([order[: m - best], order[n - best :]])


@torch.no_grad()
def pods_plan(rewards, group_ids, m) -> tuple[CurationPlan, dict[str, float]]:
    """PODS max-variance down-sampling (Xu et al., arXiv 2504.13818, the O(n log n) max-variance rule)
    -> (CurationPlan, stats).

    Per prompt, keep the m of its n rollouts whose rewards have the largest variance; the optimum is the k highest and
    m - k lowest rewards for some k, so sorting and scanning k = 0..m finds it (O(n log n)). Equal variances:
    smallest k; equal rewards: lower index first. Dropped rollouts get keep False and weight 0 (so they also leave
    GRPO's group statistics) and are ``flagged``; a prompt with n <= m keeps all its rollouts. ``score`` is NaN.
    m: rollouts kept per prompt, no default (GeoAlign does not report its PODS setting).
    rewards (N,), group_ids (N,) integer prompt ids; plan tensors on the device of ``rewards``.
    """
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
        raise ValueError(f"m (rollouts kept per prompt) must be an integer >= 1 (got {m!r})")
    _check_rewards(rewards)
    n = rewards.numel()
    r = rewards.detach().double().cpu()
    plan = CurationPlan.identity(n)
    before, after = [], []
    for rows in _groups(group_ids, n):
        values = r[rows].numpy()
        before.append(values.var())
        if len(rows) <= m:
            after.append(values.var())
            continue
        chosen = _max_variance_subset(values, m)
        dropped = np.setdiff1d(np.arange(len(rows)), chosen)
        plan.keep[rows[dropped]] = False
        plan.weight[rows[dropped]] = 0.0
        plan.flagged[rows[dropped]] = True
        after.append(values[chosen].var())
    stats = {
        "pods/kept_frac": float(plan.keep.sum()) / max(n, 1),
        "pods/reward_var_before": float(np.mean(before)) if before else math.nan,
        "pods/reward_var_after": float(np.mean(after)) if after else math.nan,
    }
    return plan.to(rewards.device), stats


def _pods_m_given(config):
    if config.pods_m is None:
        return (
            "--baseline.curation pods needs --baseline.pods_m M (rollouts kept per prompt; GeoAlign does not report "
            "its PODS setting)"
        )
    if not (isinstance(config.pods_m, int) and config.pods_m >= 1):
        return f"--baseline.pods_m must be an integer >= 1 (got {config.pods_m!r})"
    return None


@register_curation("pods", drops=lambda config: True, fork=_fork_keeps_counts, check=_pods_m_given)
def _pods(config, state, batch, rewards, hidden):
    return pods_plan(rewards, batch.group_ids, config.pods_m)


@torch.no_grad()
def semantic_entropy(cluster_ids, group_ids, estimator="mc") -> torch.Tensor:
    """Semantic entropy SE(q) of each rollout's prompt (Seed-GRPO, Chen et al., arXiv 2505.12346) -> (N,) float64.

    The G rollouts of a prompt fall into K semantic clusters C_k; p(C_k|q) is estimated by the cluster's share
    |C_k|/G (the paper sums the old policy's sequence probabilities over the cluster; this function does not see them).
    Formulas as summarised from the paper; its full text was not retrievable here.
    ``mc``: the paper's Monte-Carlo form ``-1/K sum_k log p(C_k|q)``; ``shannon``: ``-sum_k p log p`` (discrete
    semantic entropy). Both are 0 for one cluster and log G when all G rollouts differ (the maximum, SE_max = log G).
    cluster_ids (N,) integers (equal id = same meaning; compared within a prompt only), group_ids (N,) prompt ids.
    """
    if estimator not in SE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {SE_ESTIMATORS} (got {estimator!r})")
    n = cluster_ids.numel()
    if tuple(cluster_ids.shape) != (n,) or cluster_ids.is_floating_point() or cluster_ids.dtype == torch.bool:
        raise ValueError(
            f"cluster_ids must be an (N,) integer tensor, got {tuple(cluster_ids.shape)} {cluster_ids.dtype}"
        )
    clusters = cluster_ids.cpu()
    entropy = torch.zeros(n, dtype=torch.float64)
    for rows in _groups(group_ids, n):
        share = torch.unique(clusters[rows], return_counts=True)[1].double() / len(rows)
        value = -share.log().mean() if estimator == "mc" else -(share * share.log()).sum()
        entropy[rows] = value
    return entropy.to(cluster_ids.device)


@torch.no_grad()
def seed_grpo_advantages(
    advantages, cluster_ids, group_ids, alpha, estimator="mc"
) -> tuple[torch.Tensor, dict[str, float]]:
    """Seed-GRPO uncertainty-aware advantages (Chen et al., arXiv 2505.12346) -> (scaled advantages, stats).

    ``A_hat_i = A_i * f(alpha * SE(q) / SE_max(q))`` with SE_max(q) = log G (``semantic_entropy``) and a linear
    f(x) = 1 - x, so each prompt's scale lies in [1 - alpha, 1]: 1 (the plain GRPO signal, as the paper keeps for
    confident prompts) when all its rollouts agree, 1 - alpha when all differ. The paper's text was not retrievable
    here: its linear f is taken as 1 - x (the linear form with f(0) = 1), its exponential and focal f are not
    implemented, and it gives no default alpha here: alpha in [0, 1] is required.
    advantages (N,) or (N, T) (token-level, scaled per row); cluster_ids, group_ids (N,). A prompt with one rollout
    has scale 1 (log 1 = 0: no entropy to normalise).
    """
    if not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise ValueError(f"alpha must be in [0, 1] (got {alpha!r})")
    if advantages.dim() not in (1, 2) or advantages.shape[0] != cluster_ids.numel():
        raise ValueError(
            f"advantages must have shape ({cluster_ids.numel()},) or ({cluster_ids.numel()}, T), "
            f"got {tuple(advantages.shape)}"
        )
    entropy = semantic_entropy(cluster_ids, group_ids, estimator).cpu()
    sizes = torch.zeros(len(entropy), dtype=torch.float64)
    for rows in _groups(group_ids, len(entropy)):
        sizes[rows] = len(rows)
    normalised = torch.where(sizes > 1, entropy / sizes.log().clamp(min=1e-12), 0.0)
    scale = (1 - alpha * normalised).to(advantages.device)
    scaled = advantages * scale.to(advantages.dtype).view(-1, *([1] * (advantages.dim() - 1)))
    stats = {
        "seed_grpo/semantic_entropy": float(entropy.mean()) if len(entropy) else math.nan,
        "seed_grpo/scale_mean": float(scale.mean()) if len(scale) else math.nan,
        "seed_grpo/scale_min": float(scale.min()) if len(scale) else math.nan,
    }
    return scaled, stats


def _in_process_verdicts(responses, golds):
    verdicts = []
    for response, gold in zip(responses, golds):
        try:
            verdicts.append(score_answer(response, gold))
        except Exception:  # a sympy/antlr failure on one pair means "not shown equal", not a crashed batch
            verdicts.append(None)
    return verdicts


@torch.no_grad()
def math_answer_clusters(responses: Sequence[str], group_ids, verifier=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Semantic-equivalence classes of math responses for Seed-GRPO -> (cluster_ids (N,) long, stats).

    Within a prompt, two responses share a cluster when their final answers (last ``\\boxed{}``, math_verify's
    ``extract_last_boxed``) are equal as strings or math-verify shows each equal to the other (both directions, since
    ``verify`` is not symmetric for every pair). Clusters form greedily in response order, each answer joining the
    first cluster whose first answer it equals (as Kuhn et al. cluster by bidirectional entailment). A response with no
    complete, non-empty box forms its own cluster; an answer math-verify cannot parse (or a check that fails) only
    joins string-identical answers. Ids are consecutive from 0, prompt by prompt (in order of each prompt's first
    response) and within a prompt in response order; prompts never share an id. group_ids (N,) prompt ids (tensor or
    sequence; the ids come back on its device).
    verifier: a ``MathVerifyReward`` to check pairs in its worker processes with its per-pair timeout; None checks
    in this process without a timeout. Cost: d(d-1) checks for a prompt with d distinct answer strings.
    """
    n = len(responses)
    group_ids = torch.as_tensor(group_ids)
    groups = _groups(group_ids, n)
    answers = [(extract_last_boxed(text) or "").strip() for text in responses]  # "" = no answer
    keys = [list(dict.fromkeys(answers[row] for row in rows.tolist() if answers[row])) for rows in groups]
    pairs = [(a, b) for distinct in keys for a in distinct for b in distinct if a != b]  # ordered, within a prompt
    golds = ["\\boxed{" + a + "}" for a, _ in pairs]
    candidates = ["\\boxed{" + b + "}" for _, b in pairs]
    verdicts = (
        verifier.verdicts(candidates, golds) if verifier is not None else _in_process_verdicts(candidates, golds)
    )
    equal = {pair for pair, verdict in zip(pairs, verdicts) if verdict is not None and verdict.correct}
    cluster_ids = torch.empty(n, dtype=torch.long)
    next_id, per_prompt = 0, []
    for rows in groups:
        representatives: list[tuple[str, int]] = []  # (answer, id) of each cluster's first answer
        of_answer: dict[str, int] = {}  # id of each answer seen
        for row in rows.tolist():
            answer = answers[row]
            if not answer:  # no answer: a cluster of its own
                cluster_ids[row], next_id = next_id, next_id + 1
                continue
            if answer not in of_answer:
                match = next((c for rep, c in representatives if {(rep, answer), (answer, rep)} <= equal), None)
                if match is None:
                    match, next_id = next_id, next_id + 1
                    representatives.append((answer, match))
                of_answer[answer] = match
            cluster_ids[row] = of_answer[answer]
        per_prompt.append(len(torch.unique(cluster_ids[rows])))
    stats = {
        "answer_clusters/no_box_frac": sum(not answer for answer in answers) / max(n, 1),
        "answer_clusters/clusters_per_prompt": float(np.mean(per_prompt)) if per_prompt else math.nan,
    }
    return cluster_ids.to(group_ids.device), stats


@register_adjustment(
    "seed_grpo",
    "advantage",
    "--baseline.seed_grpo_alpha",
    enabled=lambda config: config.seed_grpo_alpha is not None,
    inputs=("responses", "verifier"),
)
def _seed_grpo(config, state, batch, advantages, *, responses, verifier):
    """Seed-GRPO on the slots' advantages (N,), after the group statistics and before SALT: each prompt's kept slots
    scaled by 1 - alpha SE(q) / log G (`seed_grpo_advantages`). responses() -> the N decoded responses per rollout (a
    slot answers as its source), clustered by final answer (`math_answer_clusters`); verifier() -> a
    MathVerifyReward or None (in-process checks). Dropped slots keep 0 and leave the clustering, so SE and G count a
    prompt's kept slots; the stats describe the kept slots."""
    texts = responses()
    if len(texts) != batch.size:
        raise ValueError(f"seed_grpo: {len(texts)} responses for {batch.size} rollouts")
    kept = torch.nonzero(batch.kept)[:, 0]
    group_ids = batch.group_ids[kept]
    clusters, cluster_stats = math_answer_clusters(
        [texts[i] for i in batch.source[kept].tolist()], group_ids, verifier()
    )
    index = kept.to(advantages.device)
    scaled, stats = seed_grpo_advantages(advantages[index], clusters, group_ids, config.seed_grpo_alpha)
    return advantages.index_copy(0, index, scaled), {**cluster_stats, **stats}
