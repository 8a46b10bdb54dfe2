"""Reward-noise injection: exact expected corruption rate per prompt, correct masks, swap-to-extremes semantics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.rewards.noise import corruption_mask, flip_binary, swap_to_extremes


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_flip_corrupts_exactly_rate_of_each_prompt_in_expectation():
    sizes, rate, copies = [3, 5, 7, 10], 0.3, 3000
    size_of = torch.tensor(sizes).repeat(copies)  # prompt p has size_of[p] rollouts
    ids = torch.repeat_interleave(torch.arange(len(size_of)), size_of)
    rewards = (torch.arange(len(ids)) % 2).float()
    _, corrupted = flip_binary(rewards, ids, rate, gen(0))
    per_prompt = torch.bincount(ids, weights=corrupted.double())
    for n in sizes:
        counts = per_prompt[size_of == n]
        low = math.floor(rate * n)
        assert set(counts.unique().tolist()) <= {low, low + 1}
        frac = rate * n - low  # the stochastic-rounding part: a Bernoulli(frac) per prompt
        assert abs(counts.mean().item() - rate * n) <= 4.5 * math.sqrt(frac * (1 - frac) / copies)


@settings(max_examples=50)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.floats(0, 1), st.integers(0, 99))
def test_each_prompt_gets_floor_or_ceil_of_rate_times_its_size(sizes, rate, seed):
    ids = torch.cat([torch.full((n,), 3 * i - 5, dtype=torch.long) for i, n in enumerate(sizes)])
    shuffled = ids[torch.randperm(len(ids), generator=gen(seed))]  # prompts need not be contiguous
    mask = corruption_mask(shuffled, rate, gen(seed))
    for i, n in enumerate(sizes):
        count = int(mask[shuffled == 3 * i - 5].sum())
        assert math.floor(rate * n) <= count <= math.ceil(rate * n)


@pytest.mark.parametrize("levels", [(0.0, 1.0), (-1.0, 1.0)])
def test_flip_mask_marks_exactly_the_flipped_rewards_and_inputs_stay_untouched(levels):
    low, high = levels
    rewards = torch.tensor([low, high] * 20)
    ids = torch.arange(8).repeat_interleave(5)
    before = rewards.clone()
    new, corrupted = flip_binary(rewards, ids, 0.4, gen(1), levels=levels)
    assert torch.equal(rewards, before)
    assert torch.equal(new != rewards, corrupted) and corrupted.any()
    assert torch.equal(new[corrupted], low + high - rewards[corrupted])
    assert torch.equal(flip_binary(rewards, ids, 0.4, gen(1), levels=levels)[0], new)  # seeded


def test_flip_keeps_integer_dtype_and_takes_levels_as_given_for_an_all_plus_one_batch():
    new, corrupted = flip_binary(torch.ones(6, dtype=torch.long), torch.zeros(6, dtype=torch.long), 1.0, gen(0))
    assert new.dtype == torch.long and new.tolist() == [0] * 6 and corrupted.all()
    new, _ = flip_binary(torch.ones(6), torch.zeros(6, dtype=torch.long), 1.0, gen(0), levels=(-1, 1))
    assert new.tolist() == [-1.0] * 6


@pytest.mark.parametrize(
    "rewards,kwargs,match",
    [
        (torch.tensor([0.0, 0.5]), {}, r"flip_binary needs rewards in \{0, 1\}"),
        (torch.tensor([-1.0, 0.0]), {"levels": (-1, 1)}, r"needs rewards in \{-1, 1\}"),
        (torch.tensor([-1.0, 1.0]), {}, r"needs rewards in \{0, 1\}"),
        (torch.tensor([0.0, 1.0]), {"levels": (0, 2)}, "levels must be"),
        (torch.tensor([0.0, math.nan]), {}, "NaN"),
    ],
)
def test_flip_rejects_non_binary_rewards(rewards, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flip_binary(rewards, torch.zeros(2, dtype=torch.long), 0.5, gen(0), **kwargs)


def test_swap_sends_below_mean_to_the_group_max_and_the_rest_to_the_group_min():
    g = gen(2)
    rewards = torch.randn(60, generator=g).round(decimals=1)
    rewards[:6] = 0.25  # an all-tied prompt: selection there changes nothing
    ids = torch.arange(10).repeat_interleave(6)
    selected = corruption_mask(ids, 0.5, gen(3))  # the draw swap_to_extremes makes with the same seed
    new, corrupted = swap_to_extremes(rewards, ids, 0.5, gen(3))
    expected = rewards.clone()
    for i in range(60):
        group = rewards[ids == ids[i]].tolist()
        mean = sum(group) / len(group)
        if selected[i]:
            expected[i] = max(group) if rewards[i].item() < mean else min(group)
    assert torch.equal(new, expected)
    assert torch.equal(corrupted, new != rewards)
    assert selected[:6].any() and not corrupted[:6].any()


def test_rate_zero_changes_nothing():
    rewards, ids = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1, 1, 2, 2])
    for corrupt in (flip_binary, swap_to_extremes):
        new, corrupted = corrupt(rewards, ids, 0.0, gen(0))
        assert torch.equal(new, rewards) and not corrupted.any()


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(3), torch.zeros(3, dtype=torch.long), 1.5), r"rate must be in \[0, 1\]"),
        ((torch.zeros(3), torch.zeros(2, dtype=torch.long), 0.5), "group_ids must have shape"),
        ((torch.zeros(3), torch.zeros(3), 0.5), "group_ids must be integer"),
        ((torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), 0.5), r"rewards must have shape \(N,\)"),
    ],
)
def test_bad_arguments_raise_a_clear_error(args, match):
    for corrupt in (flip_binary, swap_to_extremes):
        with pytest.raises(ValueError, match=match):
            corrupt(*args, gen(0))
