"""Reward-noise injection for robustness experiments (GeoAlign §5: flipped verifier labels, HH swap-to-extremes).

Both functions corrupt a fraction `rate` of the rollouts of EACH prompt. A prompt with n rollouts gets
floor(rate·n) corrupted rollouts plus one more with probability frac(rate·n) (stochastic rounding), chosen
uniformly within the prompt, so the expected corrupted fraction is exactly `rate` for every prompt size.
They return `(new_rewards, corrupted)` — new tensors; the inputs are never modified. `generator` must be a CPU
`torch.Generator` (None = the global RNG).
"""

import torch


def _check(rewards, group_ids, rate, generator):
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have shape {tuple(rewards.shape)} like rewards, got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be integer prompt ids, got dtype {group_ids.dtype}")
    if not torch.isfinite(rewards.double()).all():
        raise ValueError("rewards contain NaN or inf")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1] (got {rate})")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU torch.Generator (got device {generator.device})")


def corruption_mask(group_ids, rate, generator=None):
    """(N,) bool: floor(rate·n_g) + Bernoulli(frac(rate·n_g)) rollouts of each prompt g, uniformly at random."""
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
    n = group.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    sizes = torch.bincount(group).double()
    expected = rate * sizes
    count = expected.floor() + (torch.rand(sizes.numel(), generator=generator, dtype=torch.float64) < expected.frac())
    # rank of each rollout inside its prompt under a uniformly random order
    order = torch.randperm(n, generator=generator)
    order = order[torch.sort(group[order], stable=True).indices]
    starts = torch.cumsum(sizes.long(), 0) - sizes.long()
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n) - starts[group[order]]
    return rank < count.long()[group]


def flip_binary(rewards, group_ids, rate, generator=None, *, levels=(0.0, 1.0)):
    """Flip binary rewards of a fraction `rate` of each prompt's rollouts -> (new_rewards (N,), corrupted (N,) bool).

    `levels` = (low, high), the two reward values: (0, 1) (GRPO) or (-1, 1) (DAPO). Never inferred from the batch
    (an all-correct batch would be ambiguous); a reward outside `levels` raises ValueError.
    """
    _check(rewards, group_ids, rate, generator)
    low, high = (float(v) for v in levels)
    if (low, high) not in ((0.0, 1.0), (-1.0, 1.0)):
        raise ValueError(f"levels must be (0, 1) or (-1, 1) (got {levels})")
    if not bool(((rewards == low) | (rewards == high)).all()):
        bad = rewards[(rewards != low) & (rewards != high)][:3].tolist()
        raise ValueError(f"flip_binary needs rewards in {{{low:g}, {high:g}}}, got values such as {bad}")
    corrupted = corruption_mask(group_ids, rate, generator).to(rewards.device)
    flipped = ((low + high) - rewards).to(rewards.dtype)  # low <-> high
    return torch.where(corrupted, flipped, rewards), corrupted


def swap_to_extremes(rewards, group_ids, rate, generator=None):
    """HH-style corruption -> (new_rewards (N,), corrupted (N,) bool).

    A selected rollout below its prompt's mean reward gets the prompt's max, one at or above the mean gets the
    prompt's min (mean/min/max of the clean rewards). `corrupted` marks rollouts whose reward actually changed:
    a selected rollout of an all-tied prompt keeps its reward and is not marked.
    """
    _check(rewards, group_ids, rate, generator)
    selected = corruption_mask(group_ids, rate, generator).to(rewards.device)
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    r = rewards.double()
    mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, r)
    mean = mean / torch.bincount(group, minlength=n_groups)
    low = torch.full((n_groups,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, group, r, "amin")
    high = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, group, r, "amax"
    )
    target = torch.where(r < mean[group], high[group], low[group]).to(rewards.dtype)
    new = torch.where(selected, target, rewards)
    return new, selected & (new != rewards)
