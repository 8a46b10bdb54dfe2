"""The default policy loss, PPO's clipped surrogate, registered as `--baseline.policy_loss ppo` beside the baselines'
Clip-Cov and KL-Cov (baselines.py). The local engine computes it here; the fork keeps upstream's PolicyLoss, the same
surrogate (`upstream=True`), so that upstream's own options (dual-clip, GSPO, IS correction) keep working.
"""

import torch

from openrlhf_geo.registry import register_policy_loss


def clipped_surrogate(logprobs, old_logprobs, advantages, eps_low, eps_high) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip per token -> (loss (N, R), clipped (N, R) bool): -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logprobs / old_logprobs (N, R), advantages (N,) broadcast over tokens or (N, R). eps_high > eps_low is DAPO's
    clip-higher.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


@register_policy_loss("ppo", upstream=True, clip_frac="clip_frac", metrics=None)
def ppo(
    config, log_probs, old_log_probs, advantages, mask, clip_low, clip_high, generator
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate; stats {"clip_frac": the share of valid tokens the ratio clip cuts off}."""
    per_token, clipped = clipped_surrogate(log_probs, old_log_probs, advantages, clip_low, clip_high)
    return per_token, {"clip_frac": float((clipped & mask).sum()) / max(float(mask.sum()), 1.0)}
