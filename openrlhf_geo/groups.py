"""Prompt groups: the one place rollouts are numbered by prompt and their rewards checked for ties.

A batch's `group_ids` (N,) are any integer prompt ids; `group_index` numbers the prompts 0..G-1 in ascending id
order (each rollout's index into per-prompt tensors), on the CPU.
"""

import math

import torch


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(N,) integer prompt ids -> (each rollout's prompt number (N,) long on the CPU, the number of prompts G)."""
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
    return group, int(group.max()) + 1 if group.numel() else 0


def group_range(values: torch.Tensor, group: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's (min (G,), max (G,)) of values (N,), float64 on values' device; `group` from `group_index`."""
    v = values.detach().double()
    group = group.to(v.device)
    low = torch.full((n_groups,), math.inf, dtype=torch.float64, device=v.device).scatter_reduce(0, group, v, "amin")
    high = torch.full((n_groups,), -math.inf, dtype=torch.float64, device=v.device).scatter_reduce(0, group, v, "amax")
    return low, high


def tied_groups(values: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(G,) bool: the prompts whose values (N,) are all equal (min == max)."""
    low, high = group_range(values, group, n_groups)
    return low == high
