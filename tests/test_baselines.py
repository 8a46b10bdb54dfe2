"""Baselines: each against an independent numpy float64 / brute-force computation, plus its invariants."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import openrlhf_geo.baselines as baselines
from openrlhf_geo.baselines import (
    clip_cov_policy_loss,
    entropy_bonus_loss,
    kl_cov_policy_loss,
    math_answer_clusters,
    par_rewards,
    pf_ppo_plan,
    pods_plan,
    seed_grpo_advantages,
    semantic_entropy,
    token_covariance,
)
from openrlhf_geo.losses import clipped_surrogate


def multiplicity(plan):
    """(N,) long: how many kept slots each original rollout fills (0 = replaced or dropped, 2+ = copied)."""
    return torch.bincount(plan.source[plan.keep], minlength=plan.source.numel())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def token_batch(seed, n=6, t=9):
    """float64 log-probs (current near old), per-row GRPO-like advantages bounded away from 0, prefix masks of random
    lengths with one empty row."""
    g = gen(seed)
    old = -3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    new = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, 1, generator=g) < 0.5, -1.0, 1.0).double()
    adv = sign * (0.2 + torch.rand(n, 1, generator=g, dtype=torch.float64)) + 0.05 * torch.randn(
        n, t, generator=g, dtype=torch.float64
    )
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return new, old, adv, mask


def np_cov(logp, adv, mask):
    logp, adv, mask = logp.numpy(), adv.numpy(), mask.numpy()
    return np.where(mask, (logp - logp[mask].mean()) * (adv - adv[mask].mean()), 0.0)


# ---------------------------------------------------------------- entropy bonus (SALT Eq. 70-71)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_entropy_bonus_matches_numpy(mode):
    _, _, _, mask = token_batch(0)
    entropy = torch.rand(mask.shape, generator=gen(1), dtype=torch.float64) * 3
    loss, stats = entropy_bonus_loss(entropy, mask, 0.01, mode)
    h, m = entropy.numpy(), mask.numpy()
    if mode == "token-mean":
        expected = h[m].mean()
    else:  # Eq. 71: mean over responses of each response's token mean
        expected = np.mean([h[i][m[i]].mean() for i in range(len(h)) if m[i].any()])
    assert_close(loss, torch.tensor(-0.01 * expected, dtype=torch.float64))
    assert stats["entropy_bonus/entropy"] == pytest.approx(expected)


def test_entropy_bonus_gradient_raises_entropy_and_micro_batches_sum():
    _, _, _, mask = token_batch(2)
    entropy = torch.rand(mask.shape, generator=gen(3), dtype=torch.float64).requires_grad_()
    loss, _ = entropy_bonus_loss(entropy, mask, 0.5, "token-mean")
    loss.backward()
    assert_close(entropy.grad, torch.where(mask, -0.5 / mask.sum(), 0.0).double())  # descending it raises entropy
    whole, _ = entropy_bonus_loss(entropy.detach(), mask, 0.5, "seq-mean-token-mean")
    rows = int((mask.sum(1) > 0).sum())
    shares = [
        entropy_bonus_loss(entropy.detach()[part], mask[part], 0.5, "seq-mean-token-mean", normalizer=rows)[0]
        for part in (slice(0, 3), slice(3, None))
    ]
    assert_close(sum(shares), whole)


@given(coef=st.floats(0, 10), seed=st.integers(0, 10_000))
@settings(max_examples=40)
def test_entropy_bonus_is_minus_coef_times_mean(coef, seed):
    _, _, _, mask = token_batch(seed)
    entropy = torch.rand(mask.shape, generator=gen(seed), dtype=torch.float64)
    loss, stats = entropy_bonus_loss(entropy, mask, coef, "token-mean")
    assert float(loss) == pytest.approx(-coef * stats["entropy_bonus/entropy"], abs=1e-12)
    assert float(loss) <= 0


def test_entropy_bonus_degenerate_and_bad_input():
    entropy = torch.ones(2, 3, requires_grad=True)
    loss, _ = entropy_bonus_loss(entropy, torch.zeros(2, 3, dtype=torch.bool), 0.1)
    assert float(loss.detach()) == 0
    loss.backward()  # still part of the graph
    with pytest.raises(ValueError, match="loss_agg_mode"):
        entropy_bonus_loss(entropy, torch.ones(2, 3), 0.1, "seq-mean")
    with pytest.raises(ValueError, match="coef"):
        entropy_bonus_loss(entropy, torch.ones(2, 3), -1.0)
    with pytest.raises(ValueError, match="shape"):
        entropy_bonus_loss(entropy, torch.ones(3, 2), 0.1)
    with pytest.raises(ValueError, match="NaN"):
        entropy_bonus_loss(torch.tensor([[math.nan, 1.0]]), torch.ones(1, 2), 0.1)
    with pytest.raises(ValueError, match="0 and 1"):
        entropy_bonus_loss(torch.ones(1, 2), torch.tensor([[0.5, 1.0]]), 0.1)


# ---------------------------------------------------------------- Clip-Cov / KL-Cov (Cui et al., arXiv 2505.22617)


def test_token_covariance_matches_numpy():
    new, _, adv, mask = token_batch(4)
    assert_close(token_covariance(new, adv, mask), torch.from_numpy(np_cov(new, adv, mask)))
    assert not token_covariance(new, adv, torch.zeros_like(mask)).any()


def clip_cov_reference(new, old, adv, mask, lb, ub, clip_low, clip_high):
    """numpy: PPO loss per token and the Clip-Cov candidate set."""
    r = np.exp(new.numpy() - old.numpy())
    a, m = adv.numpy(), mask.numpy()
    surrogate, clipped = -a * r, -a * np.clip(r, 1 - clip_low, 1 + clip_high)
    cov = np_cov(new, adv, mask)
    candidates = m & ~(clipped > surrogate) & (cov >= lb) & (cov <= ub)
    return np.maximum(surrogate, clipped), candidates


@pytest.mark.parametrize("clip", [1.0, 0.2])
def test_clip_cov_matches_numpy(clip):
    new, old, adv, mask = token_batch(5, n=8, t=12)
    cov = np_cov(new, adv, mask)
    lb, ub = np.quantile(cov[mask.numpy()], [0.3, 0.9])
    logp = new.clone().requires_grad_()
    loss, stats = clip_cov_policy_loss(
        logp, old, adv, mask, ratio=0.1, cov_lb=lb, cov_ub=ub, clip_low=clip, clip_high=clip, generator=gen(0)
    )
    ppo, candidates = clip_cov_reference(new, old, adv, mask, lb, ub, clip, clip)
    m = mask.numpy()
    selected = m & ~np.isclose(loss.detach().numpy(), ppo, rtol=0, atol=1e-12)
    assert selected.sum() == min(max(1, math.floor(0.1 * m.sum())), candidates.sum())
    assert not (selected & ~candidates).any()
    expected = np.where(m & ~selected, ppo, 0.0)
    assert_close(loss.detach(), torch.from_numpy(expected))
    assert stats["clip_cov/selected_frac"] == pytest.approx(selected.sum() / m.sum())
    assert stats["clip_cov/candidate_frac"] == pytest.approx(candidates.sum() / m.sum())
    # gradient: -A r where the surrogate is active and unselected, 0 where selected, PPO-clipped or masked
    loss.sum().backward()
    r, a = np.exp(new.numpy() - old.numpy()), adv.numpy()
    active = m & ~selected & ~(-a * np.clip(r, 1 - clip, 1 + clip) > -a * r)
    assert_close(logp.grad, torch.from_numpy(np.where(active, -a * r, 0.0)))


def test_clip_cov_selection_is_seeded_and_uniform():
    new, old, adv, mask = token_batch(6, n=4, t=5)
    kwargs = dict(ratio=0.2, cov_lb=-1e9, cov_ub=1e9, clip_low=1.0, clip_high=1.0)
    first, _ = clip_cov_policy_loss(new, old, adv, mask, generator=gen(7), **kwargs)
    again, _ = clip_cov_policy_loss(new, old, adv, mask, generator=gen(7), **kwargs)
    assert torch.equal(first, again)
    ppo, candidates = clip_cov_reference(new, old, adv, mask, -1e9, 1e9, 1.0, 1.0)
    draws = 600
    counts = np.zeros(mask.shape)
    for seed in range(draws):
        loss, _ = clip_cov_policy_loss(new, old, adv, mask, generator=gen(seed), **kwargs)
        counts += mask.numpy() & ~np.isclose(loss.numpy(), ppo, rtol=0, atol=1e-12)
    n_select = max(1, math.floor(0.2 * mask.sum()))
    p = n_select / candidates.sum()
    assert np.abs(counts[candidates] / draws - p).max() < 5 * math.sqrt(p * (1 - p) / draws)
    assert counts[~candidates].sum() == 0


def test_clip_cov_defaults_select_one_token_per_call():
    """SALT Table 4's ratio 2e-4 is below one token per call here; the released floor of 1 still selects one."""
    new, old, adv, mask = token_batch(8, n=8, t=12)
    cov = np_cov(new, adv, mask)
    scale = 2.0 / cov.max()  # put the largest covariance inside the default band [1, 5]
    loss, stats = clip_cov_policy_loss(new, old, adv * math.sqrt(scale), mask, generator=gen(0))
    assert stats["clip_cov/selected_frac"] == pytest.approx(1 / mask.sum().item())


@given(
    seed=st.integers(0, 10_000),
    ratio=st.floats(1e-4, 1.0),
    lb=st.floats(-0.5, 0.5),
    width=st.floats(0, 2),
    clip=st.floats(0.05, 1.0),
)
@settings(max_examples=60)
def test_clip_cov_invariants(seed, ratio, lb, width, clip):
    new, old, adv, mask = token_batch(seed, n=5, t=7)
    loss, stats = clip_cov_policy_loss(
        new, old, adv, mask, ratio=ratio, cov_lb=lb, cov_ub=lb + width, clip_low=clip, clip_high=clip, generator=gen(1)
    )
    ppo, candidates = clip_cov_reference(new, old, adv, mask, lb, lb + width, clip, clip)
    m = mask.numpy()
    selected = m & ~np.isclose(loss.numpy(), ppo, rtol=0, atol=1e-12)
    assert selected.sum() == min(max(1, math.floor(ratio * m.sum())), candidates.sum())
    assert not (selected & ~candidates).any()
    assert (loss.numpy()[~m] == 0).all()
    assert stats["clip_cov/selected_frac"] <= stats["clip_cov/candidate_frac"] + 1e-12


def test_kl_cov_matches_numpy_and_gradient():
    new, old, adv, mask = token_batch(9, n=8, t=12)
    logp = new.clone().requires_grad_()
    loss, stats = kl_cov_policy_loss(logp, old, adv, mask, ratio=0.1, kl_coef=0.7)
    m, a = mask.numpy(), adv.numpy()
    log_ratio = new.numpy() - old.numpy()
    cov = np_cov(new, adv, mask)
    k = max(1, math.floor(0.1 * m.sum()))
    threshold = np.sort(cov[m])[-k]
    selected = m & (cov >= threshold)
    assert selected.sum() == k
    expected = np.where(m, -a * np.exp(log_ratio) + 0.7 * np.abs(log_ratio) * selected, 0.0)
    assert_close(loss.detach(), torch.from_numpy(expected))
    loss.sum().backward()
    grad = np.where(m, -a * np.exp(log_ratio) + 0.7 * np.sign(log_ratio) * selected, 0.0)
    assert_close(logp.grad, torch.from_numpy(grad))
    assert stats["kl_cov/selected_frac"] == pytest.approx(k / m.sum())
    assert stats["kl_cov/ppo_kl_abs"] == pytest.approx(np.abs(log_ratio[m]).mean())


@given(seed=st.integers(0, 10_000), ratio=st.floats(1e-4, 1.0), coef=st.floats(0.01, 5))
@settings(max_examples=60)
def test_kl_cov_invariants(seed, ratio, coef):
    new, old, adv, mask = token_batch(seed, n=5, t=7)
    loss, _ = kl_cov_policy_loss(new, old, adv, mask, ratio=ratio, kl_coef=coef)
    m = mask.numpy()
    log_ratio = new.numpy() - old.numpy()
    penalty = loss.numpy() - np.where(m, -adv.numpy() * np.exp(log_ratio), 0.0)
    selected = m & (np.abs(penalty) > 1e-12)
    assert selected.sum() == min(max(1, math.floor(ratio * m.sum())), m.sum())
    assert_close(torch.from_numpy(penalty[selected]), torch.from_numpy(coef * np.abs(log_ratio[selected])))
    cov = np_cov(new, adv, mask)
    if (m & ~selected).any():
        assert cov[selected].min() >= cov[m & ~selected].max()


def test_cov_losses_degenerate_and_bad_input():
    new, old, adv, _ = token_batch(10)
    empty = torch.zeros_like(new, dtype=torch.bool)
    for fn in (clip_cov_policy_loss, kl_cov_policy_loss):
        loss, stats = fn(new, old, adv, empty)
        assert not loss.any() and all(v == 0 for v in stats.values())
        with pytest.raises(ValueError, match="ratio"):
            fn(new, old, adv, empty, ratio=0.0)
        with pytest.raises(ValueError, match="shape"):
            fn(new, old[:2], adv, empty)
    with pytest.raises(ValueError, match="cov_lb"):
        clip_cov_policy_loss(new, old, adv, empty, cov_lb=2.0, cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_cov_policy_loss(new, old, adv, empty, kl_coef=-1.0)


# ---------------------------------------------------------------- PF-PPO (GeoAlign App. B.5, Eq. 8)


def grouped(sizes, seed, levels=None):
    """Rewards and non-contiguous, interleaved prompt ids for groups of the given sizes."""
    g = gen(seed)
    ids = torch.cat([torch.full((s,), 10 + 3 * i) for i, s in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=g)]
    rewards = torch.rand(len(ids), generator=g, dtype=torch.float64)
    if levels:
        rewards = torch.floor(rewards * levels) / levels
    return rewards, ids


def test_pf_ppo_best_worst_keeps_the_extremes():
    rewards, ids = grouped([5, 3, 1, 2], seed=0)
    plan, stats = pf_ppo_plan(rewards, ids, "best_worst", gen(0))
    for pid in ids.unique():
        rows = (ids == pid).nonzero()[:, 0]
        extremes = {int(rows[rewards[rows].argmax()]), int(rows[rewards[rows].argmin()])}
        assert set(rows[plan.keep[rows]].tolist()) == extremes
    assert torch.equal(plan.source, torch.arange(len(ids)))
    assert torch.equal(plan.weight, plan.keep.double().to(plan.weight.dtype))
    assert torch.equal(plan.flagged, ~plan.keep)
    assert stats["pf_ppo/kept_frac"] == pytest.approx(7 / 11)


def test_pf_ppo_best_random_draws_the_partner_uniformly():
    rewards = torch.tensor([0.1, 0.9, 0.4, 0.3, 0.6], dtype=torch.float64)
    ids = torch.zeros(5, dtype=torch.long)
    draws = 2000
    counts = np.zeros(5)
    for seed in range(draws):
        plan, _ = pf_ppo_plan(rewards, ids, "best_random", gen(seed))
        assert plan.keep[1] and plan.keep.sum() == 2
        counts += plan.keep.numpy()
    others = counts[[0, 2, 3, 4]] / draws  # Eq. 8: the best always, each other with 1/(G-1)
    assert np.abs(others - 0.25).max() < 5 * math.sqrt(0.25 * 0.75 / draws)


def test_pf_ppo_breaks_reward_ties_uniformly():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    ids = torch.zeros(5, dtype=torch.long)
    draws = 1500
    best = np.zeros(5)
    for seed in range(draws):
        plan, _ = pf_ppo_plan(rewards, ids, "best_worst", gen(seed), keep_count=True)
        assert multiplicity(plan)[1] == 2  # the unique worst is the partner: floor(5/2) slots
        best += multiplicity(plan).numpy() == 3  # ceil(5/2) slots for the best
    assert best[[1, 4]].sum() == 0
    assert np.abs(best[[0, 2, 3]] / draws - 1 / 3).max() < 5 * math.sqrt(2 / 9 / draws)


@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["best_random", "best_worst"]),
    levels=st.sampled_from([None, 2, 3]),
)
@settings(max_examples=80)
def test_pf_ppo_keep_count_invariants(sizes, seed, mode, levels):
    rewards, ids = grouped(sizes, seed, levels)
    plan, _ = pf_ppo_plan(rewards, ids, mode, gen(seed), keep_count=True)
    dropped, _ = pf_ppo_plan(rewards, ids, mode, gen(seed), keep_count=False)
    assert plan.keep.all() and (plan.weight == 1).all()
    mult = multiplicity(plan)
    for pid in ids.unique():
        rows = (ids == pid).nonzero()[:, 0]
        size = len(rows)
        assert bool((ids[plan.source[rows]] == pid).all())  # content stays within the prompt
        assert int(mult[rows].sum()) == size  # per-prompt rollout count kept
        kept = rows[dropped.keep[rows]]
        assert len(kept) == min(2, size)
        assert set(rows[mult[rows] > 0].tolist()) == set(kept.tolist())  # same pair as the filtering form
        if size >= 2:
            assert sorted(mult[kept].tolist()) == [size // 2, (size + 1) // 2]
            best = kept[rewards[kept].argmax()]
            assert rewards[best] == rewards[rows].max()
            assert int(mult[best]) == (size + 1) // 2 or rewards[kept[0]] == rewards[kept[1]]
            if mode == "best_worst":
                assert rewards[kept].min() == rewards[rows].min()
        if size % 2 == 0:  # GRPO advantages of the kept-count group equal those of the pair itself
            curated = rewards[plan.source[rows]].numpy()
            pair = rewards[kept].numpy()
            if pair.std() > 0:
                adv_curated = (curated - curated.mean()) / curated.std()
                adv_pair = dict(zip(kept.tolist(), (pair - pair.mean()) / pair.std()))
                np.testing.assert_allclose(adv_curated, [adv_pair[int(s)] for s in plan.source[rows]])


def test_pf_ppo_bad_input():
    rewards, ids = grouped([3], seed=1)
    with pytest.raises(ValueError, match="mode"):
        pf_ppo_plan(rewards, ids, "best_of_n")
    with pytest.raises(ValueError, match="NaN"):
        pf_ppo_plan(torch.tensor([math.nan, 1.0]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer prompt ids"):
        pf_ppo_plan(rewards, ids.double())
    with pytest.raises(ValueError, match="shape"):
        pf_ppo_plan(rewards, ids[:2])
    plan, _ = pf_ppo_plan(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert plan.source.numel() == 0


# ---------------------------------------------------------------- PAR (Fu et al., arXiv 2502.18770)


def test_par_matches_numpy_with_missing_references():
    g = gen(2)
    rewards = 3 * torch.randn(6, generator=g, dtype=torch.float64)
    refs = 3 * torch.randn(6, 4, generator=g, dtype=torch.float64)
    refs[1, 2:] = math.nan
    refs[4, 0] = math.nan
    shaped, stats = par_rewards(rewards, refs)
    r, ref = rewards.numpy(), refs.numpy()
    expected = [np.mean([1 / (1 + np.exp(-(r[i] - x))) for x in ref[i] if not np.isnan(x)]) for i in range(6)]
    assert_close(shaped, torch.tensor(expected, dtype=torch.float64))
    assert stats["par/reward_mean"] == pytest.approx(np.mean(expected))
    one, _ = par_rewards(rewards.float(), refs[:, 1].float())
    assert one.dtype == torch.float32
    assert_close(one, torch.sigmoid(rewards - refs[:, 1]).float())


@given(
    rewards=st.lists(st.floats(-50, 50), min_size=1, max_size=8),
    ref=st.floats(-50, 50),
    bump=st.floats(0.01, 5),
)
@settings(max_examples=60)
def test_par_is_bounded_centred_and_monotone(rewards, ref, bump):
    r = torch.tensor(rewards, dtype=torch.float64)
    refs = torch.full((len(rewards), 2), ref, dtype=torch.float64)
    shaped, _ = par_rewards(r, refs)
    assert ((shaped >= 0) & (shaped <= 1)).all()
    higher, _ = par_rewards(r + bump, refs)
    assert (higher >= shaped).all()
    centred, _ = par_rewards(refs[:, 0], refs)
    assert_close(centred, torch.full_like(centred, 0.5))


def test_par_bad_input():
    with pytest.raises(ValueError, match="no reference"):
        par_rewards(torch.ones(2), torch.tensor([[0.0, 1.0], [math.nan, math.nan]]))
    with pytest.raises(ValueError, match="shape"):
        par_rewards(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="inf"):
        par_rewards(torch.ones(1), torch.tensor([math.inf]))


# ---------------------------------------------------------------- PODS (Xu et al., arXiv 2504.13818)


def brute_max_variance(values, m):
    return max(np.var(values[list(c)]) for c in itertools.combinations(range(len(values)), m))


def test_pods_binary_rewards_keep_a_balanced_subset():
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 1, 0], dtype=torch.float64)
    plan, stats = pods_plan(rewards, torch.zeros(8, dtype=torch.long), 4)
    assert rewards[plan.keep].sum() == 2 and plan.keep.sum() == 4
    assert stats["pods/reward_var_after"] == pytest.approx(0.25)
    assert torch.equal(plan.flagged, ~plan.keep) and torch.equal(plan.weight == 0, ~plan.keep)


@given(
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    m=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    levels=st.sampled_from([None, 2, 4]),
)
@settings(max_examples=80)
def test_pods_matches_brute_force(sizes, m, seed, levels):
    rewards, ids = grouped(sizes, seed, levels)
    plan, _ = pods_plan(rewards, ids, m)
    assert torch.equal(plan.source, torch.arange(len(ids)))
    rng = np.random.default_rng(seed)
    for pid in ids.unique():
        rows = (ids == pid).nonzero()[:, 0]
        values = rewards[rows].numpy()
        kept = plan.keep[rows].numpy()
        assert kept.sum() == min(m, len(rows))
        if len(rows) > m:
            best = brute_max_variance(values, m)
            assert np.var(values[kept]) == pytest.approx(best, abs=1e-12)
            random_subset = rng.choice(len(rows), m, replace=False)
            assert np.var(values[kept]) >= np.var(values[random_subset]) - 1e-12


def test_pods_bad_input():
    with pytest.raises(ValueError, match="m "):
        pods_plan(torch.ones(3), torch.zeros(3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="m "):
        pods_plan(torch.ones(3), torch.zeros(3, dtype=torch.long), 2.0)


# ---------------------------------------------------------------- Seed-GRPO (Chen et al., arXiv 2505.12346)


def np_semantic_entropy(clusters, ids, estimator):
    out = np.zeros(len(ids))
    for pid in np.unique(ids):
        rows = ids == pid
        _, counts = np.unique(clusters[rows], return_counts=True)
        p = counts / rows.sum()
        out[rows] = -np.log(p).mean() if estimator == "mc" else -(p * np.log(p)).sum()
    return out


@pytest.mark.parametrize("estimator", ["mc", "shannon"])
def test_semantic_entropy_matches_numpy(estimator):
    ids = torch.tensor([7, 7, 7, 7, 2, 2, 2, 9, 7, 7])
    clusters = torch.tensor([5, 5, 8, 5, 1, 2, 3, 4, 8, 6])
    se = semantic_entropy(clusters, ids, estimator)
    assert_close(se, torch.from_numpy(np_semantic_entropy(clusters.numpy(), ids.numpy(), estimator)))
    assert se[4] == pytest.approx(math.log(3))  # all distinct: log G
    assert se[7] == 0


@given(
    sizes=st.lists(st.integers(1, 10), min_size=1, max_size=5),
    n_clusters=st.integers(1, 10),
    alpha=st.floats(0, 1),
    seed=st.integers(0, 10_000),
    estimator=st.sampled_from(["mc", "shannon"]),
)
@settings(max_examples=80)
def test_seed_grpo_scale_matches_numpy_and_its_range(sizes, n_clusters, alpha, seed, estimator):
    rewards, ids = grouped(sizes, seed)
    clusters = torch.randint(n_clusters, ids.shape, generator=gen(seed))
    advantages = torch.randn(len(ids), 3, generator=gen(seed + 1), dtype=torch.float64)
    scaled, stats = seed_grpo_advantages(advantages, clusters, ids, alpha, estimator)
    se = np_semantic_entropy(clusters.numpy(), ids.numpy(), estimator)
    group_size = np.array([(ids == i).sum().item() for i in ids])
    scale = np.where(group_size > 1, 1 - alpha * se / np.log(np.maximum(group_size, 2)), 1.0)
    assert_close(scaled, advantages * torch.from_numpy(scale)[:, None])
    assert ((scale >= 1 - alpha - 1e-12) & (scale <= 1 + 1e-12)).all()
    assert stats["seed_grpo/scale_min"] == pytest.approx(scale.min())


def test_seed_grpo_extremes():
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2])
    clusters = torch.tensor([3, 3, 3, 3, 0, 1, 2, 4, 0])  # one meaning / all different / a lone rollout
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5, 2.0])
    scaled, _ = seed_grpo_advantages(advantages, clusters, ids, alpha=0.3)
    assert_close(scaled, advantages * torch.tensor([1.0] * 4 + [0.7] * 4 + [1.0]))
    with pytest.raises(ValueError, match="alpha"):
        seed_grpo_advantages(advantages, clusters, ids, alpha=1.5)
    with pytest.raises(ValueError, match="advantages"):
        seed_grpo_advantages(advantages[:3], clusters, ids, alpha=0.3)
    with pytest.raises(ValueError, match="estimator"):
        semantic_entropy(clusters, ids, "kde")
    with pytest.raises(ValueError, match="cluster_ids"):
        semantic_entropy(clusters.double(), ids)


# ---------------------------------------------------------------- answer clusters (math-verify)

RESPONSES = [
    "so the answer is \\boxed{0.5}",
    "\\boxed{\\frac{1}{2}}",
    "I give up",  # no box: its own cluster
    "\\boxed{3}",
    "first \\boxed{1} then 1/2 = \\boxed{1/2}",  # last box counts
    "truncated \\boxed{3",  # unclosed box: no answer
    "\\boxed{3.0}",
    "\\boxed{}",  # empty box: no answer
    "\\boxed{0.5}",  # another prompt: never shares a cluster with the first
    "\\boxed{7}",
]
GROUPS = [4, 4, 4, 4, 4, 4, 4, 4, 1, 1]
EXPECTED = [0, 0, 1, 2, 0, 3, 2, 4, 5, 6]


def test_math_answer_clusters_in_process():
    clusters, stats = math_answer_clusters(RESPONSES, GROUPS)
    assert clusters.tolist() == EXPECTED
    assert stats["answer_clusters/no_box_frac"] == pytest.approx(0.3)
    assert stats["answer_clusters/clusters_per_prompt"] == pytest.approx(3.5)
    se = semantic_entropy(clusters, torch.tensor(GROUPS), "shannon")
    p = np.array([3, 2, 1, 1, 1]) / 8
    assert float(se[0]) == pytest.approx(-(p * np.log(p)).sum())


def test_math_answer_clusters_with_worker_pool():
    from openrlhf_geo.rewards.math_verify import MathVerifyReward

    with MathVerifyReward(workers=1, timeout=30) as verifier:
        clusters, _ = math_answer_clusters(RESPONSES, torch.tensor(GROUPS), verifier=verifier)
    assert clusters.tolist() == EXPECTED


def test_math_answer_clusters_survive_a_failing_check(monkeypatch):
    real = baselines.score_answer

    def flaky(response, gold):
        if "3.0" in response or "3.0" in gold:
            raise RuntimeError("sympy blew up")
        return real(response, gold)

    monkeypatch.setattr(baselines, "score_answer", flaky)
    clusters, _ = math_answer_clusters(["\\boxed{3}", "\\boxed{3.0}", "\\boxed{3}"], [0, 0, 0])
    assert clusters.tolist() == [0, 1, 0]  # unverifiable pair: separate clusters; identical strings still merge


# ---------------------------------------------------------------- BaselineConfig and the engines' loss dispatch


def test_baseline_config_defaults_follow_salt_table_4_and_flags_classify():
    config = baselines.BaselineConfig()
    assert (config.policy_loss, config.curation, config.seed_grpo_alpha, config.par_references) == (
        "ppo",
        None,
        None,
        0,
    )
    # SALT Table 4: Clip-Cov ratio 0.0002, bounds 1 and 5; KL-Cov ratio 0.002, PPO KL coefficient 1
    assert (config.clip_cov_ratio, config.clip_cov_lb, config.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (config.kl_cov_ratio, config.kl_cov_coef) == (2e-3, 1.0)
    assert not config.in_pipeline and not config.drops_rollouts
    cases = {
        baselines.BaselineConfig(curation="pods", pods_m=3): (True, True),
        baselines.BaselineConfig(curation="pf_ppo_br"): (True, True),
        baselines.BaselineConfig(curation="pf_ppo_bw", pf_ppo_keep_count=True): (True, False),
        baselines.BaselineConfig(seed_grpo_alpha=0.0): (True, False),
        baselines.BaselineConfig(par_references=1): (True, False),
        baselines.BaselineConfig(policy_loss="kl_cov"): (False, False),
    }
    for config, (in_pipeline, drops) in cases.items():
        assert (config.in_pipeline, config.drops_rollouts) == (in_pipeline, drops), config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy_loss": "grpo"}, "--baseline.policy_loss must be one of ppo, clip_cov, kl_cov"),
        ({"clip_cov_ratio": 0.0}, "--baseline.clip_cov_ratio must be in (0, 1]"),
        ({"kl_cov_ratio": 2.0}, "--baseline.kl_cov_ratio must be in (0, 1]"),
        ({"clip_cov_lb": 2.0, "clip_cov_ub": 1.0}, "--baseline.clip_cov_lb must be <="),
        ({"clip_cov_ub": math.inf}, "both finite"),
        ({"kl_cov_coef": math.nan}, "--baseline.kl_cov_coef must be a finite number >= 0"),
        ({"curation": "best"}, "--baseline.curation must be one of pf_ppo_br, pf_ppo_bw, pods"),
        ({"curation": "pods"}, "--baseline.curation pods needs --baseline.pods_m"),
        ({"pods_m": 2}, "--baseline.pods_m only applies"),
        ({"curation": "pods", "pods_m": 0}, "--baseline.pods_m must be an integer >= 1"),
        ({"pf_ppo_keep_count": True}, "--baseline.pf_ppo_keep_count only applies"),
        ({"seed_grpo_alpha": -0.1}, "--baseline.seed_grpo_alpha must be in [0, 1]"),
        ({"par_references": 1.5}, "--baseline.par_references must be an integer >= 0"),
    ],
)
def test_baseline_config_rejects_bad_values_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError) as err:
        baselines.BaselineConfig(**kwargs)
    assert message in str(err.value)


def test_policy_loss_dispatch_broadcasts_sequence_advantages_and_passes_the_settings():
    new, old, adv, mask = token_batch(3)
    sequence_adv = adv[:, 0]
    config = baselines.BaselineConfig(policy_loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=0.3)
    got, stats = baselines.policy_loss(config, new, old, sequence_adv, mask, 0.2, 0.2)
    want, want_stats = kl_cov_policy_loss(new, old, sequence_adv[:, None].expand_as(new), mask, ratio=0.1, kl_coef=0.3)
    assert_close(got, want)
    assert stats == want_stats
    config = baselines.BaselineConfig(policy_loss="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-1.0, clip_cov_ub=1.0)
    got, stats = baselines.policy_loss(config, new, old, adv, mask, 0.1, 0.3, gen(4))
    want, want_stats = clip_cov_policy_loss(
        new, old, adv, mask, ratio=0.5, cov_lb=-1.0, cov_ub=1.0, clip_low=0.1, clip_high=0.3, generator=gen(4)
    )
    assert_close(got, want)
    assert stats == want_stats
    # the default, ppo, is registered too: PPO's clipped surrogate (the fork keeps upstream's PolicyLoss for it)
    got, stats = baselines.policy_loss(baselines.BaselineConfig(), new, old, sequence_adv, mask, 0.2, 0.3)
    want, clipped = clipped_surrogate(new, old, sequence_adv, 0.2, 0.3)
    assert_close(got, want)
    assert stats == {"clip_frac": float((clipped & mask).sum()) / float(mask.sum())}
