"""The advantage estimators (--advantage_estimator), registered in `registry.ESTIMATORS`: sequence advantages (N,)
from rewards (N,) and prompt ids (N,), with float64 group statistics.

The local engine computes the ones with a function; the fork runs upstream's branch of the same name in OpenRLHF
0.11.2's `compute_advantages_and_returns` where upstream has one (`upstream=True`), and otherwise computes the
registered function in place of upstream's dr_grpo advantages (fork.hooks.GeometryBatch.salt);
tests/test_fork_pipeline.py checks that both engines give the same advantages. Both engines refuse rewards whose
float32 group statistics would overflow (`check_reward_scale`).
`salt` is not an estimator of its own: SALT reweights the sequence advantages of its --salt.base, one of the group
estimators (SALT §3: a' replaces the group-normalized advantages).
"""

import math

import torch

from openrlhf_geo.groups import group_index
from openrlhf_geo.registry import register_estimator

EPS = 1e-9  # upstream's group_norm: (r - mean) / (std + 1e-9)


def reward_limit(group_size: int) -> float:
    """The largest |reward| whose float32 group statistics stay finite for groups of `group_size` rollouts: a
    deviation from the group mean is at most 2·max|r|, and the sum of the group's squared deviations must stay below
    float32's largest value (about 4.6e18 for 4 rollouts per prompt)."""
    return math.sqrt(torch.finfo(torch.float32).max / max(group_size, 1)) / 2


def check_reward_scale(rewards: torch.Tensor, group_ids: torch.Tensor, step: int, source: str) -> None:
    """ValueError naming the step, the rollout, the value and the reward `source` when a reward's magnitude exceeds
    `reward_limit` of the batch's largest group. The fork's group statistics are upstream's, in float32: past the
    limit the std is inf and every advantage silently 0. Both engines refuse, so that they train alike."""
    group, _ = group_index(group_ids)
    limit = reward_limit(int(torch.bincount(group).max()) if group.numel() else 1)
    big = rewards.detach().double().abs() > limit
    if bool(big.any()):
        i = int(torch.nonzero(big)[0, 0])
        raise ValueError(
            f"step {step}: {source} gave rollout {i} (prompt {int(group_ids[i])}) the reward {float(rewards[i]):g}; "
            f"{int(big.sum())} of {rewards.numel()} rewards lie beyond ±{limit:.3g}, where the group statistics "
            "overflow float32 (the std becomes inf and every advantage 0): rescale the rewards"
        )


def _centred(rewards, group_ids):
    """(r - mean_g (N,), n_g per rollout (N,)) in float64 on rewards' device."""
    group, n_groups = group_index(group_ids)
    group = group.to(rewards.device)
    r = rewards.double()
    n = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros_like(n).index_add_(0, group, r) / n
    return r - mean[group], n, group


@register_estimator("group_norm", upstream=True)
def group_norm(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + 1e-9), std with Bessel's correction as upstream OpenRLHF; a single-rollout group
    gets 0."""
    centred, n, group = _centred(rewards, group_ids)
    var = torch.zeros_like(n).index_add_(0, group, centred**2) / (n - 1).clamp(min=1)
    adv = centred / (var.sqrt()[group] + EPS)
    return torch.where(n[group] > 1, adv, 0.0).to(rewards.dtype)


@register_estimator("dr_grpo", upstream=True)
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al., arXiv 2503.20783): r - mean_g, no std."""
    return _centred(rewards, group_ids)[0].to(rewards.dtype)


# The fork's other group estimator, and upstream's REINFORCE++-baseline, which is refused where a group is read.
register_estimator("rloo", upstream=True)(None)
register_estimator(
    "reinforce_baseline",
    upstream=True,
    whitens="upstream whitens the whole batch after the group statistics, which would re-centre and rescale what a "
    "method computed per prompt (SALT's a' must reach the loss unchanged)",
)(None)
