"""Reward-noise injection for robustness experiments (GeoAlign §5.3: flipped verifier labels, HH swap-to-extremes),
and a systematically misspecified verifier (`pay_wrong`).

`flip_binary` and `swap_to_extremes` corrupt a fraction `rate` of the rollouts of EACH prompt. A prompt with n
rollouts gets floor(rate·n) corrupted rollouts plus one more with probability frac(rate·n) (stochastic rounding),
chosen uniformly within the prompt, so the expected corrupted fraction is exactly `rate` for every prompt size.
`pay_wrong` is not random: the engine's task says which rollouts a misspecified verifier also pays (e.g. one wrong
procedure's answer on a fixed share `rate` of the prompts, `lab.task.ShortcutPayer`), so its errors share a cause.
All return `(new_rewards, corrupted)` — new tensors; the inputs are never modified. `generator` must be a CPU
`torch.Generator` (None = the global RNG).
"""

import math
from dataclasses import dataclass

import torch

from openrlhf_geo.config_flags import setting
from openrlhf_geo.groups import group_index, group_range

NOISE_TYPES = ("none", "flip", "swap", "misspecified")


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


def corruption_mask(group_ids, rate, generator=None) -> torch.Tensor:
    """(N,) bool: floor(rate·n_g) + Bernoulli(frac(rate·n_g)) rollouts of each prompt g, uniformly at random."""
    group, _ = group_index(group_ids)
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


def flip_binary(rewards, group_ids, rate, generator=None, *, levels=(0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
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


def swap_to_extremes(rewards, group_ids, rate, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """HH-style corruption -> (new_rewards (N,), corrupted (N,) bool).

    A selected rollout below its prompt's mean reward gets the prompt's max, one at or above the mean gets the
    prompt's min (mean/min/max of the clean rewards). `corrupted` marks rollouts whose reward actually changed:
    a selected rollout of an all-tied prompt keeps its reward and is not marked.
    """
    _check(rewards, group_ids, rate, generator)
    selected = corruption_mask(group_ids, rate, generator).to(rewards.device)
    group, n_groups = group_index(group_ids)
    group = group.to(rewards.device)
    r = rewards.double()
    mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, r)
    mean = mean / torch.bincount(group, minlength=n_groups)
    low, high = group_range(r, group, n_groups)
    target = torch.where(r < mean[group], high[group], low[group]).to(rewards.dtype)
    new = torch.where(selected, target, rewards)
    return new, selected & (new != rewards)


def pay_wrong(rewards, paid) -> tuple[torch.Tensor, torch.Tensor]:
    """A verifier that also pays some wrong rollouts -> (new_rewards (N,), corrupted (N,) bool).

    paid (N,) bool: the rollouts the misspecified verifier pays; each gets the top reward 1 (a correct verdict under
    both 0/1 and DAPO's ±1 rewards). `corrupted` marks those whose reward changed (the wrong ones it paid). GeoAlign
    §5.3 corrupts rewards at random; its §1 names misspecified rewards as a cause of directional inconsistency, and
    this is a controlled case of one. rewards must be binary verdicts: 0/1 or -1/+1.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    paid = torch.as_tensor(paid, device=rewards.device)
    if paid.shape != rewards.shape or paid.dtype != torch.bool:
        raise ValueError(
            f"paid must be a bool tensor of shape {tuple(rewards.shape)} (got {paid.dtype} {tuple(paid.shape)})"
        )
    binary = (rewards == 0) | (rewards == 1) | (rewards == -1)
    if not bool(binary.all()):
        raise ValueError(
            "--reward.noise.type misspecified needs binary verifier rewards (0/1 or -1/+1), got values such as "
            f"{rewards[~binary][:3].tolist()}"
        )
    corrupted = paid & (rewards != 1)
    return torch.where(corrupted, torch.ones_like(rewards), rewards), corrupted


@dataclass(frozen=True)
class NoiseConfig:
    """`--reward.noise.*`: which corruption (flip: binary flips; swap: HH swap-to-extremes; misspecified: a verifier
    that also pays one wrong procedure), its rate, levels, seed.

    Validated here, the one place (errors name the flag). `rate` is the share of each prompt's rollouts for flip and
    swap, the share of prompts on which the verifier is misspecified for misspecified (the engine's task picks them
    with `seed`). `levels` applies to flip only: the two reward values it swaps, (0, 1) for GRPO or (-1, 1) for DAPO.
    """

    FLAG_PREFIX = "reward.noise"

    type: str = setting(
        "none",
        "flip: binary flips of a fraction of each prompt's rollouts; swap: HH-style swap-to-extremes; misspecified: "
        "the verifier also pays one wrong procedure on a fixed fraction of prompts (needs a task hook: "
        "`openrlhf-geo study geoalign-failure`)",
        choices=NOISE_TYPES,
    )
    rate: float = setting(
        0.0, "fraction of each prompt's rollouts corrupted (flip, swap); of prompts misspecified (misspecified)"
    )
    levels: tuple | None = setting(
        None,
        "the two reward values flip swaps: 0 1 (unset; GRPO) or -1 1 (DAPO)",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
    )
    seed: int = setting(0, "seed of the corruption draw")

    def __post_init__(self):
        if self.type not in NOISE_TYPES:
            raise ValueError(f"--reward.noise.type must be one of {', '.join(NOISE_TYPES)} (got {self.type!r})")
        if self.type == "none" and self.rate != 0:
            raise ValueError(
                f"--reward.noise.rate {self.rate} needs --reward.noise.type flip or swap (or misspecified)"
            )
        if self.type != "none" and not (math.isfinite(self.rate) and 0 < self.rate < 1):
            raise ValueError(f"--reward.noise.rate must be in (0, 1) with --reward.noise.type {self.type}")
        if self.type != "flip" and self.levels is not None:
            raise ValueError("--reward.noise.levels only applies with --reward.noise.type flip")
        if self.type == "flip":
            levels = tuple(float(v) for v in (self.levels or (0.0, 1.0)))
            if levels not in ((0.0, 1.0), (-1.0, 1.0)):
                raise ValueError(f"--reward.noise.levels must be 0 1 or -1 1 (got {' '.join(map(str, levels))})")
            object.__setattr__(self, "levels", levels)

    @property
    def enabled(self) -> bool:
        return self.type != "none"


def corrupt(rewards, group_ids, config, generator=None, paid=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply `config`'s corruption -> (new_rewards (N,), corrupted (N,) bool); type none: (rewards, all False).

    paid (N,) bool: for type misspecified, the rollouts the misspecified verifier pays (`pay_wrong`), which only
    the engine's task can tell; required by that type and ignored by the others.
    """
    if config.type == "misspecified":
        if paid is None:
            raise ValueError(
                "--reward.noise.type misspecified needs the engine to say which rollouts the misspecified verifier "
                "pays (a task hook: the demo task's `lab.task.ShortcutPayer` in `openrlhf-geo study`); this engine "
                "passes none"
            )
        return pay_wrong(rewards, paid)
    if config.type == "flip":
        return flip_binary(rewards, group_ids, config.rate, generator, levels=config.levels)
    if config.type == "swap":
        return swap_to_extremes(rewards, group_ids, config.rate, generator)
    return rewards, torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device)
