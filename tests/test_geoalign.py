"""GeoAlign core: equations against brute force, the anomaly rules, config validation, plan invariants, degenerate
and bad inputs, a planted-outlier batch."""

import dataclasses
import io
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm
from torch.testing import assert_close

import openrlhf_geo.geoalign as geoalign
from openrlhf_geo.estimators import group_norm
from openrlhf_geo.geoalign import (
    GDI_KINDS,
    MODES,
    PROTOTYPES,
    SKIP_REASONS,
    GeoAlignConfig,
    Projector,
    best_random_probs,
    curate,
    deviation,
    gdi,
    kde_flags,
    kde_tail_threshold,
    orientation_loss,
    pair_distances,
    preference_pairs,
    prototype,
    rectify,
)
from openrlhf_geo.geoalign.pairs import _minibatches
from openrlhf_geo.rewards.noise import flip_binary
from openrlhf_geo.stages import CurationPlan

# Small projector so each curate call takes milliseconds.
TINY = GeoAlignConfig(hidden_sizes=(16,), out_dim=8, steps=5)
SMALL = GeoAlignConfig(hidden_sizes=(128, 128), out_dim=32)


def multiplicity(plan):
    """(N,) long: how many kept slots each original rollout fills (0 = replaced or dropped, 2+ = copied)."""
    return torch.bincount(plan.source[plan.keep], minlength=plan.source.numel())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def planted(n_prompts=64, group=16, dim=128, rate=0.1, seed=0):
    """Hidden states h = prompt base + 1[truly correct] * e + noise: correct-minus-incorrect displacements share the
    consensus direction e. Binary rewards, then `rate` of each prompt's rewards flipped (the planted outliers)."""
    g = gen(seed)
    e = torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
    base = 3 * torch.randn(n_prompts, dim, generator=g)
    p_correct = 0.2 + 0.6 * torch.rand(n_prompts, generator=g)
    truth = (torch.rand(n_prompts, group, generator=g) < p_correct[:, None]).double().flatten()
    ids = 1000 + 7 * torch.arange(n_prompts).repeat_interleave(group)  # non-contiguous prompt ids
    hidden = (
        base.repeat_interleave(group, 0) + truth[:, None] * e + torch.randn(len(truth), dim, generator=g) / dim**0.5
    )
    rewards, corrupted = flip_binary(truth, ids, rate, g)
    return hidden, rewards, ids, corrupted


def same_result(a, b):
    (plan_a, stats_a), (plan_b, stats_b) = a, b
    for field in ("source", "weight", "keep", "flagged", "score"):
        assert_close(getattr(plan_a, field), getattr(plan_b, field), rtol=0, atol=0, equal_nan=True)
    assert stats_a["skipped_reason"] == stats_b["skipped_reason"]
    drop = {"time_s", "skipped_reason"}
    assert {k: v for k, v in stats_a.items() if k not in drop} == pytest.approx(
        {k: v for k, v in stats_b.items() if k not in drop}, nan_ok=True, rel=0, abs=0
    )


# ---------------------------------------------------------------- Eq. 3: pairs


@settings(max_examples=60)
@given(st.data())
def test_pairs_are_exactly_the_strict_within_prompt_pairs(data):
    n = data.draw(st.integers(0, 24))
    rewards = data.draw(st.lists(st.sampled_from([-2.0, 0.0, 0.5, 1.0]), min_size=n, max_size=n))
    ids = data.draw(st.lists(st.sampled_from([-7, 3, 10, 11]), min_size=n, max_size=n))
    winner, loser = preference_pairs(torch.tensor(rewards, dtype=torch.float64), torch.tensor(ids, dtype=torch.long))
    got = list(zip(winner.tolist(), loser.tolist()))
    expected = {(k, j) for k in range(n) for j in range(n) if ids[k] == ids[j] and rewards[k] > rewards[j]}
    assert len(got) == len(set(got))
    assert set(got) == expected


def test_subsampled_pairs_are_top_m_winners_times_bottom_m_losers():
    g = gen(0)
    rewards = torch.randn(60, generator=g, dtype=torch.float64)  # distinct: the top/bottom m are unique
    ids = torch.arange(6).repeat_interleave(10)[torch.randperm(60, generator=g)]
    m = 3
    winner, loser = preference_pairs(rewards, ids, max_per_side=m, generator=g)
    expected = set()
    for prompt in range(6):
        members = [i for i in range(60) if ids[i] == prompt]
        ranked = sorted(members, key=lambda i: -rewards[i].item())
        expected |= {(k, j) for k in ranked[:m] for j in ranked[-m:] if rewards[k] > rewards[j]}
    assert set(zip(winner.tolist(), loser.tolist())) == expected


@settings(max_examples=40)
@given(st.data())
def test_subsampling_with_ties_keeps_at_most_m_winners_and_losers_from_the_extremes(data):
    n = data.draw(st.integers(1, 20))
    m = data.draw(st.integers(1, 4))
    rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=n, max_size=n)))
    ids = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    winner, loser = preference_pairs(rewards, ids, max_per_side=m, generator=gen(data.draw(st.integers(0, 99))))
    for prompt in ids.unique():
        in_prompt = ids[winner] == prompt
        w, l = winner[in_prompt], loser[in_prompt]
        assert len(w.unique()) <= m and len(l.unique()) <= m
        others = rewards[ids == prompt]
        for k in w.unique():  # fewer than m rollouts of the prompt are strictly better than a kept winner
            assert (others > rewards[k]).sum() < m
        for j in l.unique():
            assert (others < rewards[j]).sum() < m
    assert bool((rewards[winner] > rewards[loser]).all())


@pytest.mark.parametrize("case", ["shared-offset", "near-duplicates"])
def test_pair_distances_survive_float32_cancellation(case):
    """shared-offset: a massive shared activation (1e4) with 1e-2 differences, where a raw float32 Gram loses every
    digit; near-duplicates: rollouts 1e-4 apart next to a distant one, where even the prompt-centred Gram cancels."""
    g = gen(1)
    ids = torch.arange(8).repeat_interleave(6)
    rewards = torch.rand(48, generator=g)
    if case == "shared-offset":
        hidden = (1e4 + 1e-2 * torch.randn(48, 256, generator=g, dtype=torch.float64)).float()
    else:
        hidden = torch.randn(48, 256, generator=g)
        hidden[1::6] = hidden[::6] + 1e-4 * torch.randn(8, 256, generator=g)  # rollout 1 of each prompt ~ rollout 0
        hidden[2::6] += 30.0  # rollout 2 far away: prompt-centred norms ~ 300, near-duplicate distances ~ 2e-3
    winner, loser = preference_pairs(rewards, ids)
    reference = torch.tensor(
        [np.linalg.norm(hidden[k].double().numpy() - hidden[j].double().numpy()) for k, j in zip(winner, loser)]
    )
    assert_close(pair_distances(hidden, winner, loser, ids), reference, rtol=1e-5, atol=0)
    gram = hidden @ hidden.T
    raw = (gram[winner, winner] + gram[loser, loser] - 2 * gram[winner, loser]).double().clamp(min=0).sqrt()
    assert ((raw - reference).abs() / reference).max() > 0.1  # the guard is needed here


@pytest.mark.parametrize("scale", [1e19, 1e-30])
def test_pair_distances_neither_overflow_nor_underflow_at_extreme_magnitudes(scale):
    """(1e19)^2 summed over d overflows float32 and (1e-30)^2 underflows it: the Gram is taken after an exact
    power-of-two rescale, so distances match float64 at any magnitude float32 can hold."""
    g = gen(9)
    ids = torch.arange(4).repeat_interleave(5)
    rewards = torch.rand(20, generator=g)
    hidden = (scale * torch.randn(20, 64, generator=g, dtype=torch.float64)).float()
    winner, loser = preference_pairs(rewards, ids)
    reference = (hidden[winner].double() - hidden[loser].double()).norm(dim=1)
    assert_close(pair_distances(hidden, winner, loser, ids), reference, rtol=1e-5, atol=0)


# ---------------------------------------------------------------- Eq. 4: projector


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_pair_factored_loss_and_grads_equal_naive_per_pair(dtype, tol):
    g = gen(2)
    cfg = GeoAlignConfig(hidden_sizes=(24, 20), out_dim=12)
    ids = torch.arange(5).repeat_interleave(6)
    rewards = torch.randint(0, 3, (30,), generator=g).double()
    hidden = (5 + torch.randn(30, 40, generator=g, dtype=torch.float64)).to(dtype)
    winner, loser = preference_pairs(rewards, ids)
    dist = pair_distances(hidden, winner, loser, ids)
    projector = Projector(40, cfg, g).to(dtype)
    probe = torch.randn(12, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    params = [*projector.parameters(), probe]

    loss = orientation_loss(*(projector.pair_forward(hidden, winner, loser, dist) @ probe))
    grads = torch.autograd.grad(loss, params)

    # naive: materialise every unit displacement and push both orientations through the whole MLP
    u = torch.stack(
        [(hidden[k] - hidden[j]) / torch.linalg.vector_norm(hidden[k] - hidden[j]) for k, j in zip(winner, loser)]
    )
    s_pos, s_neg = projector(u) @ probe, projector(-u) @ probe
    naive = torch.log1p(torch.exp(-s_pos)).mean() + torch.log1p(torch.exp(s_neg)).mean()
    naive_grads = torch.autograd.grad(naive, params)

    assert_close(loss, naive, rtol=tol, atol=tol)
    for a, b in zip(grads, naive_grads):
        assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


def test_projector_state_dict_round_trips():
    cfg = GeoAlignConfig(hidden_sizes=(32, 16), out_dim=8)
    trained = Projector(20, cfg, gen(3))
    hidden, rewards, ids, _ = planted(8, 4, 20, 0.0, seed=3)
    curate(
        hidden,
        rewards,
        ids,
        GeoAlignConfig(hidden_sizes=(32, 16), out_dim=8, steps=3, min_scores=4),
        gen(3),
        projector=trained,
    )
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    restored = Projector(20, cfg, gen(99))
    restored.load_state_dict(torch.load(buffer))
    u = torch.randn(7, 20, generator=gen(4))
    assert_close(restored(u), trained(u), rtol=0, atol=0)


def test_warm_start_trains_the_given_projector_in_place_and_cold_start_reinitialises_it():
    hidden, rewards, ids, _ = planted(12, 6, 24, 0.1, seed=5)
    warm = TINY
    projector = Projector(24, warm, gen(0))
    before = [p.detach().clone() for p in projector.parameters()]
    curate(hidden, rewards, ids, warm, gen(1), projector=projector)
    assert any(not torch.equal(a, b) for a, b in zip(before, projector.parameters()))

    cold = replace(TINY, warm_start=False)
    fresh = curate(hidden, rewards, ids, cold, gen(7))  # projector=None: a fresh one from the generator
    reused = curate(hidden, rewards, ids, cold, gen(7), projector=projector)  # already trained, but re-initialised
    same_result(fresh, reused)


def test_validation_split_holds_out_whole_prompts(monkeypatch):
    seen = {}
    real = geoalign.fit_projector

    def spy(projector, hidden, winner, loser, dist, config, generator=None, *, val_mask=None):
        seen.update(winner=winner, val_mask=val_mask)
        return real(projector, hidden, winner, loser, dist, config, generator, val_mask=val_mask)

    monkeypatch.setattr(geoalign.plan, "fit_projector", spy)
    hidden, rewards, ids, _ = planted(20, 6, 16, 0.0, seed=6)
    _, stats = curate(hidden, rewards, ids, TINY, gen(0))
    prompt = ids[seen["winner"]]
    val_prompts = set(prompt[seen["val_mask"]].tolist())
    assert not val_prompts & set(prompt[~seen["val_mask"]].tolist())
    assert len(val_prompts) == round(TINY.val_frac * stats["prompts_paired"])


def test_training_stops_early_once_validation_accuracy_is_reached():
    hidden, rewards, ids, _ = planted(16, 8, 32, 0.0, seed=8)
    cfg = GeoAlignConfig(hidden_sizes=(32,), out_dim=16, steps=40, val_acc=0.75)
    _, stats = curate(hidden, rewards, ids, cfg, gen(0))
    assert stats["proj_steps"] < 40 and stats["val_acc"] >= 0.75
    # pure-noise hidden states never reach 100 % on held-out prompts: all steps run
    noise = torch.randn(hidden.shape, generator=gen(1))
    _, stats = curate(noise, rewards, ids, replace(cfg, val_acc=1.0), gen(0))
    assert stats["proj_steps"] == 40


def test_pairs_of_a_single_prompt_train_every_step_without_early_stopping():
    """No prompt can be held out: the projector trains config.steps steps on all pairs, val_acc is NaN, and the
    batch is still curated (the paper returns the identity only without pairs)."""
    hidden, rewards, ids, _ = planted(1, 64, 16, 0.1, seed=2)
    plan, stats = curate(hidden, rewards, ids, replace(TINY, steps=12, val_acc=0.01), gen(0))
    assert stats["prompts_paired"] == 1.0 and stats["pairs"] > 0
    assert stats["proj_steps"] == 12.0 and math.isnan(stats["val_acc"]) and stats["proj_train_acc"] > 0
    assert stats["skipped_reason"] == "" and not math.isnan(stats["kde_mode"])
    assert stats["n_scored"] == (~torch.isnan(plan.score)).sum()


@settings(max_examples=60)
@given(st.integers(0, 40), st.integers(0, 50), st.integers(1, 12), st.integers(0, 99))
def test_minibatches_use_each_pair_once_per_epoch(n_pairs, batch, steps, seed):
    pairs = torch.arange(100, 100 + n_pairs)  # the training pairs' indices
    batches = _minibatches(pairs, batch, steps, gen(seed))
    assert len(batches) == steps
    if batch == 0 or batch >= n_pairs:
        assert all(torch.equal(b, pairs) and end for b, end in batches)
        return
    per_epoch = math.ceil(n_pairs / batch)
    last = n_pairs - (per_epoch - 1) * batch
    ends = [(t + 1) % per_epoch == 0 for t in range(steps)]
    assert [end for _, end in batches] == ends
    assert [len(b) for b, _ in batches] == [last if end else batch for end in ends]
    for start in range(0, steps, per_epoch):
        epoch = torch.cat([b for b, _ in batches[start : start + per_epoch]])
        assert len(epoch.unique()) == len(epoch) and set(epoch.tolist()) <= set(pairs.tolist())


def test_each_training_step_sees_one_minibatch_of_pairs(monkeypatch):
    sizes = []
    real = Projector.pair_forward

    def spy(self, hidden, winner, loser, dist):
        if torch.is_grad_enabled():  # training steps; validation and scoring run under no_grad
            sizes.append(len(winner))
        return real(self, hidden, winner, loser, dist)

    monkeypatch.setattr(Projector, "pair_forward", spy)
    hidden, rewards, ids, _ = planted(1, 24, 16, 0.0, seed=3)  # one prompt: every pair trains
    _, stats = curate(hidden, rewards, ids, replace(TINY, pair_batch=40, steps=7), gen(0))
    pairs = int(stats["pairs"])
    per_epoch = math.ceil(pairs / 40)
    assert pairs > 80 and sizes == [40 if (t + 1) % per_epoch else pairs - 40 * (per_epoch - 1) for t in range(7)]


def test_validation_runs_after_each_epoch_of_minibatches(monkeypatch):
    calls = []
    real = Projector.pair_forward

    def spy(self, hidden, winner, loser, dist):
        calls.append("train" if torch.is_grad_enabled() else "val")
        return real(self, hidden, winner, loser, dist)

    monkeypatch.setattr(Projector, "pair_forward", spy)
    hidden = torch.randn(120, 16, generator=gen(0))  # noise: held-out accuracy never reaches 100 %
    rewards = (torch.arange(120) % 6 < 3).float()
    ids = torch.arange(20).repeat_interleave(6)
    _, stats = curate(hidden, rewards, ids, replace(TINY, pair_batch=40, steps=10, val_acc=1.0), gen(0))
    # 20 prompts x 9 pairs, 2 prompts held out: 162 training pairs = epochs of 5 steps (40, 40, 40, 40, 2)
    assert stats["proj_steps"] == 10 and calls[:-1] == (["train"] * 5 + ["val"]) * 2  # the last call scores


def test_a_pair_batch_holding_every_training_pair_is_full_batch_training():
    hidden, rewards, ids, _ = planted(12, 6, 24, 0.1, seed=5)
    full = curate(hidden, rewards, ids, replace(TINY, pair_batch=0), gen(3))
    same_result(full, curate(hidden, rewards, ids, replace(TINY, pair_batch=10**6), gen(3)))
    _, small = curate(hidden, rewards, ids, replace(TINY, pair_batch=16), gen(3))
    assert small["proj_loss"] != full[1]["proj_loss"]  # mini-batches do change the training


# ---------------------------------------------------------------- Eq. 5-7: prototype, deviation, GDI


@pytest.mark.parametrize("kind", ["margin", "plain"])
@pytest.mark.parametrize("gdi_kind", ["cumulative", "mean"])
def test_prototype_deviation_and_gdi_match_brute_force(kind, gdi_kind):
    rng = np.random.default_rng(0)
    n, pairs, dim = 12, 30, 6
    winner = rng.integers(0, 10, pairs)  # rollouts 10, 11 have no pair
    loser = (winner + rng.integers(1, 10, pairs)) % 10  # never the winner itself
    v = rng.normal(size=(pairs, dim)) + 0.8
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    margins = rng.uniform(0.1, 2.0, pairs)

    weights = margins if kind == "margin" else np.ones(pairs)
    centroid = sum(weights[p] * v[p] for p in range(pairs))
    proto_ref = centroid / np.sqrt(sum(c * c for c in centroid))
    dev_ref = np.array([1 - sum(v[p, j] * proto_ref[j] for j in range(dim)) for p in range(pairs)])
    gdi_ref = np.full(n, np.nan)
    for i in range(n):
        mine = [dev_ref[p] for p in range(pairs) if winner[p] == i or loser[p] == i]
        if mine:
            gdi_ref[i] = sum(mine) / (len(mine) if gdi_kind == "mean" else 1)

    proto, resultant = prototype(torch.from_numpy(v), torch.from_numpy(margins), kind)
    dev = deviation(torch.from_numpy(v), proto)
    scores = gdi(dev, torch.from_numpy(winner), torch.from_numpy(loser), n, gdi_kind)
    assert_close(proto, torch.from_numpy(proto_ref))
    assert resultant == pytest.approx(np.linalg.norm(centroid) / weights.sum())
    assert_close(dev, torch.from_numpy(dev_ref))
    assert_close(scores, torch.from_numpy(gdi_ref), equal_nan=True)


# ---------------------------------------------------------------- §4.4: the KDE anomaly rule


def scott_kde(scores, x):
    """Gaussian KDE with Scott's bandwidth, by hand: h = sd(scores, ddof=1) * n^(-1/5)."""
    n, h = len(scores), np.std(scores, ddof=1) * len(scores) ** -0.2
    z = (np.asarray(x, dtype=float)[:, None] - scores[None, :]) / h
    return np.exp(-0.5 * z**2).sum(1) / (n * h * math.sqrt(2 * math.pi))


def reference_threshold(scores, alpha, points=50_001):
    """First point right of the density mode where the KDE drops below alpha * peak, on a fine grid."""
    grid = np.linspace(scores.min(), scores.max(), points)
    density = scott_kde(scores, grid)
    mode = np.argmax(density)
    below = np.nonzero((np.arange(points) > mode) & (density < alpha * density[mode]))[0]
    return (grid[below[0]] if len(below) else math.inf), grid[1] - grid[0]


@settings(max_examples=40)
@given(st.integers(0, 10**6), st.integers(20, 300), st.integers(0, 8), st.sampled_from([0.05, 0.12, 0.3]))
def test_pointwise_rule_flags_exactly_the_sparse_scores_right_of_the_mode(seed, n, n_far, alpha):
    rng = np.random.default_rng(seed)
    scores = np.concatenate([rng.gamma(2.0, 0.5, n), rng.uniform(3.0, 12.0, n_far)])
    flags, mode, threshold = kde_flags(scores, alpha)
    density = scott_kde(scores, scores)
    level = alpha * density.max()  # Algorithm 1 line 24: the peak over the observed scores
    assert scott_kde(scores, [mode])[0] == pytest.approx(density.max(), rel=1e-9) and mode in scores
    assert math.isnan(threshold)
    expected = (scores > mode) & (density < level)
    clear = np.abs(density - level) > 1e-9 * level  # rounding may decide a score exactly at the level
    assert np.array_equal(flags[clear], expected[clear])
    assert (scores[flags] > mode).all()


def test_a_dense_high_gdi_cluster_separates_the_pointwise_and_threshold_rules():
    """300 typical scores around 1, a dense cluster of 60 at 8 and four stragglers (3, 4.5, 6, 10.5). The cluster's
    own density stays above alpha * peak, so the paper's pointwise rule flags none of it but the sparse stragglers
    beyond the main body; the threshold rule flags everything beyond the first density collapse."""
    body = 1 + 0.3 * norm.ppf((np.arange(300) + 0.5) / 300)
    cluster = 8 + 0.05 * norm.ppf((np.arange(60) + 0.5) / 60)
    scores = np.concatenate([body, cluster, [3.0, 4.5, 6.0, 10.5]])
    density = scott_kde(scores, scores)
    assert (density[300:360] > 0.05 * density.max()).all()  # the cluster is dense

    pointwise, _, _ = kde_flags(scores, 0.05, "pointwise")
    assert set(np.nonzero(pointwise)[0]) == {361, 362, 363}  # the stragglers at 4.5, 6 and 10.5
    threshold_flags, _, threshold = kde_flags(scores, 0.05, "threshold")
    assert set(np.nonzero(threshold_flags)[0]) == set(range(300, 364)) - {360}  # all 60, and every straggler but 3
    expected, step = reference_threshold(scores, 0.05)
    assert abs(threshold - expected) <= 2 * step and 3.0 < threshold < 4.5


@pytest.mark.parametrize("alpha", [0.05, 0.12, 0.3])
def test_kde_tail_threshold_matches_a_hand_written_kde_on_a_fine_grid(alpha):
    rng = np.random.default_rng(1)
    scores = np.concatenate([rng.gamma(2.0, 0.5, 300), rng.normal(6.0, 0.3, 12)])
    threshold, _ = kde_tail_threshold(scores, alpha)
    expected, step = reference_threshold(scores, alpha)
    assert abs(threshold - expected) <= 2 * step
    flags, _, same = kde_flags(scores, alpha, "threshold")
    assert same == threshold and np.array_equal(flags, scores >= threshold)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(20, 200),
    st.integers(0, 6),
    st.sampled_from([0.05, 0.12, 0.3]),
    st.floats(-300, 300),
    st.floats(-10, 10),
)
def test_kde_rules_give_the_same_flags_under_an_affine_rescaling_of_the_scores(seed, n, n_far, alpha, log_a, b):
    """The rules compare densities with alpha * peak, which an affine map s -> a s + b (a > 0) leaves alone: the
    flags are the same (the KDE works on standardized scores; at a ~ 1e300 scipy's covariance overflowed)."""
    rng = np.random.default_rng(seed)
    scores = np.concatenate([rng.gamma(2.0, 0.5, n), rng.uniform(3.0, 12.0, n_far)])
    a = 10.0**log_a
    moved = a * scores + a * b  # b in units of a: a shift far beyond the spread leaves only float noise (degenerate)
    for rule in ("pointwise", "threshold"):
        flags, mode, threshold = kde_flags(scores, alpha, rule)
        moved_flags, moved_mode, moved_threshold = kde_flags(moved, alpha, rule)
        assert np.array_equal(moved_flags, flags), rule
        assert moved_mode == pytest.approx(a * mode + a * b, rel=1e-9, abs=1e-9 * a)
        if rule == "threshold" and math.isfinite(threshold):
            assert moved_threshold == pytest.approx(a * threshold + a * b, rel=1e-9, abs=1e-9 * a)


def test_kde_tail_threshold_of_finite_scores_near_the_float_limit():
    threshold, mode = kde_tail_threshold(np.array([0.0, 1.0, 2.0]), 0.05)
    huge_threshold, huge_mode = kde_tail_threshold(np.array([0.0, 1e300, 2e300]), 0.05)
    assert huge_mode == pytest.approx(mode * 1e300) and huge_threshold == threshold == math.inf
    scores = np.concatenate([np.random.default_rng(0).gamma(2.0, 0.5, 100), [9.0]])
    top = float(np.finfo(np.float64).max) / 10
    expected, _ = kde_tail_threshold(scores, 0.3)
    assert kde_tail_threshold(scores * top, 0.3)[0] == pytest.approx(expected * top, rel=1e-9)


def test_kde_rules_flag_nothing_without_a_sparse_tail_or_a_density():
    flat = np.linspace(0.0, 1.0, 200)
    assert kde_tail_threshold(flat, 0.05)[0] == math.inf  # flat density: no tail
    assert not kde_flags(flat, 0.05, "threshold")[0].any()
    # a spread within float64 rounding of the scores' magnitude (curate also skips GDI spreads of float32 noise)
    for degenerate in (np.ones(200), 1 + 1e-15 * np.random.default_rng(0).normal(size=200), np.array([2.0])):
        assert math.isnan(kde_tail_threshold(degenerate, 0.05)[0])
        for rule in ("pointwise", "threshold"):
            flags, mode, _ = kde_flags(degenerate, 0.05, rule)
            assert not flags.any() and math.isnan(mode)


# ---------------------------------------------------------------- Eq. 8 and the plan


def test_best_random_probs_match_the_two_stage_draw():
    rewards = torch.tensor([0.9, 0.2, 0.9, 0.5, 0.9])
    stable = rewards.tolist()
    size, best = len(stable), [i for i, r in enumerate(stable) if r == max(stable)]
    expected = np.zeros(size)
    for b in best:  # the best is one of the tied ones, uniformly; then Eq. 8
        for j in range(size):
            expected[j] += (0.5 if j == b else 0.5 / (size - 1)) / len(best)
    # row 0: that prompt; row 1: the same with two more padding/flagged columns; row 2: one stable; row 3: none
    table = torch.tensor([[*stable, 0.0, 0.0], [0.0, *stable, 0.0], [7.0, 3.0, 0, 0, 0, 0, 0], [1.0, *[0.0] * 6]])
    mask = torch.tensor(
        [[True] * 5 + [False] * 2, [False] + [True] * 5 + [False], [False, True] + [False] * 5, [False] * 7]
    )
    probs = best_random_probs(table, mask)
    assert_close(probs[0, :5], torch.from_numpy(expected))
    assert_close(probs[1, 1:6], torch.from_numpy(expected))
    assert probs[2].tolist() == [0, 1, 0, 0, 0, 0, 0] and probs[3].sum() == 0
    assert probs[0, 5:].sum() == 0 and probs[1, [0, 6]].sum() == 0


@pytest.mark.parametrize("stable", [[0.9, 0.5, 0.1, 0.7], [1.0, 1.0, 0.0, 0.0, 0.0], [0.4]])
def test_best_random_draw_frequencies_match_eq8(stable):
    prompts, size = 4000, len(stable) + 1
    rewards = torch.tensor([0.0, *stable]).repeat(prompts)  # slot 0 of every prompt is the flagged one
    ids = torch.arange(prompts).repeat_interleave(size)
    flagged = (torch.arange(size * prompts) % size) == 0
    plan = rectify(flagged, rewards, ids, "replace", gen(11))
    picked = (plan.source[flagged] % size) - 1  # position among the stable rollouts
    freq = torch.bincount(picked, minlength=len(stable)).double() / prompts
    top = max(stable)
    tied = sum(r == top for r in stable)
    for j, r in enumerate(stable):
        if len(stable) == 1:
            p = 1.0
        elif r == top:
            p = 0.5 / tied + 0.5 * (tied - 1) / (tied * (len(stable) - 1))
        else:
            p = 0.5 / (len(stable) - 1)
        assert abs(freq[j].item() - p) <= 4.5 * math.sqrt(p * (1 - p) / prompts) + 1e-12


@settings(max_examples=100)
@given(st.data())
def test_plan_keeps_prompt_counts_and_replaces_only_within_the_prompt_from_stable_rollouts(data):
    n = data.draw(st.integers(1, 30))
    mode = data.draw(st.sampled_from(MODES))
    ids = torch.tensor(data.draw(st.lists(st.sampled_from([4, 9, -1, 100]), min_size=n, max_size=n)))
    rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=n, max_size=n)))
    flagged = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    plan = rectify(flagged, rewards, ids, mode, gen(data.draw(st.integers(0, 9))))

    has_stable = {p: bool((~flagged[ids == p]).any()) for p in ids.tolist()}
    acted = torch.tensor([bool(f) and has_stable[p] for f, p in zip(flagged.tolist(), ids.tolist())])
    assert torch.equal(plan.flagged, flagged)
    assert bool((ids[plan.source] == ids).all())  # content only moves within a prompt
    moved = plan.source != torch.arange(n)
    if mode == "replace":
        assert torch.equal(moved, acted) and not flagged[plan.source[moved]].any()
    elif mode == "amplify":
        assert not flagged[moved].any() and flagged[plan.source[moved]].all()
        assert len(plan.source[moved].unique()) == moved.sum()  # each outlier overwrites at most one slot
        for p in has_stable:
            in_p = ids == p
            assert moved[in_p].sum() == min(int(acted[in_p].sum()), int((~flagged[in_p]).sum()))
    else:
        assert not moved.any()
    assert torch.equal(plan.keep, ~acted if mode == "drop" else torch.ones(n, dtype=torch.bool))
    assert torch.equal(plan.weight, (~acted).float() if mode in ("zero", "drop") else torch.ones(n))
    if mode != "drop":
        for p in ids.unique():
            assert multiplicity(plan)[ids == p].sum() == (ids == p).sum()


@settings(max_examples=30)
@given(st.integers(0, 40), st.sampled_from(MODES), st.integers(0, 5))
def test_plan_is_identity_when_nothing_is_flagged(n, mode, seed):
    ids = torch.randint(0, 4, (n,), generator=gen(seed))
    plan = rectify(torch.zeros(n, dtype=torch.bool), torch.rand(n, generator=gen(seed)), ids, mode, gen(seed))
    identity = CurationPlan.identity(n)
    for field in ("source", "weight", "keep", "flagged"):
        assert torch.equal(getattr(plan, field), getattr(identity, field))


def test_plan_apply_and_multiplicity_follow_source_and_keep():
    plan = CurationPlan.identity(5)
    plan.source = torch.tensor([0, 0, 2, 3, 2])
    plan.keep = torch.tensor([True, True, True, False, True])
    x = torch.arange(5) * 10
    assert plan.apply(x).tolist() == [0, 0, 20, 20]
    assert plan.apply(list("abcde")) == ["a", "a", "c", "c"]
    assert multiplicity(plan).tolist() == [2, 0, 2, 0, 0]


# ---------------------------------------------------------------- curate: whole pipeline


def test_planted_outliers_are_found():
    hidden, rewards, ids, corrupted = planted()
    plan, stats = curate(hidden, rewards, ids, SMALL, gen(0), corrupted=corrupted)
    assert stats["skipped_reason"] == "" and stats["pairs"] > SMALL.pair_batch  # mini-batched training
    assert stats["auroc"] >= 0.8
    assert stats["n_flagged"] > 0 and stats["precision"] >= 0.8
    # the plan replaced every flagged rollout (each prompt still has stable ones) and kept prompt sizes
    assert bool((plan.source[plan.flagged] != torch.nonzero(plan.flagged)[:, 0]).all())
    assert torch.equal(torch.bincount(ids[plan.source] - 1000), torch.bincount(ids - 1000))


def test_curate_flags_the_pointwise_rule_on_the_returned_gdi():
    hidden, rewards, ids, corrupted = planted(seed=1)
    plan, stats = curate(hidden, rewards, ids, replace(SMALL, alpha=0.12), gen(0), corrupted=corrupted)
    scores = plan.score.double().numpy()
    scored = ~np.isnan(scores)
    density = scott_kde(scores[scored], scores[scored])
    expected = np.zeros(len(scores), dtype=bool)
    expected[scored] = (scores[scored] > stats["kde_mode"]) & (density < 0.12 * density.max())
    assert plan.flagged.any() and np.array_equal(plan.flagged.numpy(), expected)
    assert stats["n_candidates"] == stats["n_flagged"] == expected.sum() and stats["skipped_reason"] == ""
    assert stats["flag_frac"] == expected.sum() / len(scores)
    # precision / recall / AUROC by direct counting
    f, c = plan.flagged.numpy(), corrupted.numpy()
    assert stats["precision"] == pytest.approx((f & c).sum() / f.sum())
    assert stats["recall"] == pytest.approx((f & c).sum() / c.sum())
    pos, neg = scores[scored & c], scores[scored & ~c]
    auroc = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert stats["auroc"] == pytest.approx(auroc)


def test_the_opt_in_cap_keeps_the_highest_gdi_candidates_of_the_threshold_rule():
    hidden, rewards, ids, _ = planted(seed=1)
    cfg = replace(SMALL, alpha=0.3, rule="threshold", max_flag_frac=0.05)
    plan, stats = curate(hidden, rewards, ids, cfg, gen(0))
    scores = plan.score.double().numpy()
    scored = ~np.isnan(scores)
    expected, step = reference_threshold(scores[scored], cfg.alpha)
    assert abs(stats["kde_threshold"] - expected) <= 2 * step
    tail = scored & (scores >= stats["kde_threshold"])
    cap = int(cfg.max_flag_frac * scored.sum())  # a fraction of the scored rollouts, as in the reference code
    assert stats["n_candidates"] == tail.sum() > cap  # the cap binds here: the highest-GDI ones are kept
    assert plan.flagged.sum() == stats["n_flagged"] == cap and stats["skipped_reason"] == ""
    assert scores[plan.flagged.numpy()].min() >= scores[tail & ~plan.flagged.numpy()].max()
    uncapped, _ = curate(hidden, rewards, ids, replace(cfg, max_flag_frac=None), gen(0))
    assert torch.equal(uncapped.flagged, torch.from_numpy(tail))


STATS_KEYS = {
    *("pairs", "pairs_identical", "prompts_paired", "n_scored", "n_candidates", "n_flagged", "flag_frac"),
    *("proj_steps", "proj_loss", "proj_train_acc", "val_acc", "consensus", "cos_mean", "cos_gt_0.8", "cos_gt_0.8_val"),
    *("gdi_p50", "gdi_p95", "kde_mode", "kde_threshold", "skip_no_pairs", "skip_few_scores", "skip_degenerate"),
    *("skipped_reason", "time_s", "zero_action_rollouts", "zero_variance_groups_after"),
}


def test_stats_hold_the_contract_keys_as_floats_and_one_reason_string():
    hidden, rewards, ids, corrupted = planted(16, 8, 16, 0.1, seed=2)
    _, stats = curate(hidden, rewards, ids, TINY, gen(0), corrupted=corrupted)
    assert set(stats) == STATS_KEYS | {"precision", "recall", "auroc"}
    assert stats.pop("skipped_reason") == ""
    assert all(type(v) is float for v in stats.values())
    assert stats["pairs"] == len(preference_pairs(rewards, ids)[0])
    _, plain = curate(hidden, rewards, ids, TINY, gen(0))
    assert set(plain) == STATS_KEYS


def test_cos_gt_0_8_is_the_share_of_projected_pair_directions_near_the_prototype(monkeypatch):
    """§5.4 / Fig. 6d: the share of projected directions v_p whose cosine with v_proto exceeds 0.8."""
    seen = {}
    real = geoalign.deviation

    def spy(v, v_proto):
        seen["cos"] = (v @ v_proto / v.norm(dim=1) / v_proto.norm()).numpy()
        return real(v, v_proto)

    monkeypatch.setattr(geoalign.plan, "deviation", spy)
    hidden, rewards, ids, _ = planted(16, 8, 16, 0.1, seed=3)
    _, stats = curate(hidden, rewards, ids, TINY, gen(0))
    assert len(seen["cos"]) == stats["pairs"]
    assert stats["cos_gt_0.8"] == pytest.approx(np.mean([c > 0.8 for c in seen["cos"]]))
    assert 0 < stats["cos_gt_0.8"] < 1


def test_amplify_duplicates_each_outlier_into_a_stable_slot():
    hidden, rewards, ids, corrupted = planted(32, 12, 32, seed=3)
    plan, stats = curate(hidden, rewards, ids, replace(TINY, mode="amplify", steps=30), gen(0))
    assert stats["n_flagged"] > 0
    assert bool((multiplicity(plan)[plan.flagged] == 2).all())


def test_tied_prompts_are_untouched_and_curate_is_deterministic():
    hidden, rewards, ids, _ = planted(24, 8, 16, 0.2, seed=4)
    tied = ids < 1000 + 7 * 6  # first six prompts: all rewards equal
    rewards = torch.where(tied, torch.ones_like(rewards), rewards)
    cfg = replace(TINY, alpha=0.5, max_flag_frac=0.5)
    first = curate(hidden, rewards, ids, cfg, gen(5))
    plan = first[0]
    assert plan.flagged.any() and not plan.flagged[tied].any()
    assert torch.equal(plan.source[tied], torch.nonzero(tied)[:, 0]) and bool(plan.keep[tied].all())
    assert bool(torch.isnan(plan.score[tied]).all())
    same_result(first, curate(hidden, rewards, ids, cfg, gen(5)))


@settings(max_examples=25)
@given(
    st.integers(2, 6),
    st.integers(2, 6),
    st.integers(0, 3),
    st.sampled_from(MODES),
    st.sampled_from(GDI_KINDS),
    st.sampled_from(PROTOTYPES),
    st.integers(0, 999),
)
def test_curate_keeps_prompt_counts_leaves_tied_prompts_and_repeats_under_a_seed(
    prompts, group, n_tied, mode, gdi_kind, proto, seed
):
    hidden, rewards, ids, _ = planted(prompts + n_tied, group, 8, 0.2, seed=seed)
    tied = ids >= 1000 + 7 * prompts
    rewards = torch.where(tied, torch.zeros_like(rewards), rewards)
    cfg = replace(TINY, mode=mode, gdi=gdi_kind, prototype=proto, alpha=0.5, max_flag_frac=0.5, min_scores=2)
    result = curate(hidden, rewards, ids, cfg, gen(seed))
    plan = result[0]
    assert not plan.flagged[tied].any() and torch.equal(plan.source[tied], torch.nonzero(tied)[:, 0])
    assert bool((ids[plan.source] == ids).all())
    if mode != "drop":
        assert torch.equal(torch.bincount(ids[plan.source[plan.keep]] - 1000), torch.bincount(ids - 1000))
    same_result(result, curate(hidden, rewards, ids, cfg, gen(seed)))


def test_low_precision_hidden_states_are_accepted():
    hidden, rewards, ids, _ = planted(16, 8, 16, 0.1, seed=6)
    _, stats = curate(hidden.bfloat16(), rewards, ids, TINY, gen(0))
    assert stats["pairs"] > 0 and not math.isnan(stats["gdi_p50"])


def test_curate_is_invariant_to_the_scale_of_hidden_states():
    """Unit displacements are scale-free; an exact power-of-two rescale keeps squared norms and first-layer
    products finite for |h| ~ 1e20 (float32 squares overflow) and for float64 states beyond float32's range."""
    hidden, rewards, ids, _ = planted(12, 6, 24, 0.1, seed=5)
    base = curate(hidden, rewards, ids, TINY, gen(2))
    for scaled in (hidden * 2.0**64, hidden * 2.0**-100, hidden.double() * 2.0**900):
        same_result(base, curate(scaled, rewards, ids, TINY, gen(2)))
    plan, stats = curate(hidden * 1e19, rewards, ids, TINY, gen(2))
    assert stats["pairs"] == base[1]["pairs"] and stats["skipped_reason"] == ""
    assert bool(torch.isfinite(plan.score[~torch.isnan(base[0].score)]).all())


def test_curate_is_invariant_to_a_common_positive_scale_of_the_rewards():
    """Eq. 5 normalizes the margin-weighted centroid, so a positive reward scale cancels; at 1e300 the raw weighted
    sum overflows (it flagged nothing) and at 1e-300 its squared norm underflows."""
    hidden, rewards, ids, _ = planted(16, 8, 16, 0.1, seed=1)
    config = replace(TINY, alpha=0.3)
    base, stats = curate(hidden, rewards, ids, config, gen(0))
    assert base.flagged.any()
    for scale in (2.0**-1000, 1e-300, 1e30, 1e300, float(np.finfo(np.float64).max)):
        plan, scaled = curate(hidden, rewards * scale, ids, config, gen(0))
        assert torch.equal(plan.flagged, base.flagged), scale
        assert scaled["consensus"] == pytest.approx(stats["consensus"], rel=1e-12)


def test_prototype_weights_are_relative_and_must_be_finite_and_positive():
    v = torch.nn.functional.normalize(torch.randn(6, 4, generator=gen(0), dtype=torch.float64), dim=1)
    margins = torch.rand(6, generator=gen(1), dtype=torch.float64) + 0.1
    proto, consensus = prototype(v, margins)
    for scale in (1e-300, 1e300):
        assert_close(prototype(v, margins * scale)[0], proto)
        assert prototype(v, margins * scale)[1] == pytest.approx(consensus, rel=1e-12)
    for bad in (margins * math.inf, -margins):
        with pytest.raises(ValueError, match="margins"):
            prototype(v, bad)


def test_group_ids_may_be_lists_of_integers_or_strings():
    hidden, rewards, ids, _ = planted(8, 6, 16, 0.1, seed=1)
    base = curate(hidden, rewards, ids, TINY, gen(0))
    same_result(base, curate(hidden, rewards.tolist(), ids.tolist(), TINY, gen(0)))
    same_result(base, curate(hidden, rewards, [f"prompt-{i}" for i in ids.tolist()], TINY, gen(0)))


# ---------------------------------------------------------------- skips and degenerate inputs


def assert_identity(plan, n):
    identity = CurationPlan.identity(n)
    for field in ("source", "weight", "keep", "flagged"):
        assert torch.equal(getattr(plan, field), getattr(identity, field))


def assert_skipped(stats, reason):
    assert stats["skipped_reason"] == reason
    assert {why: stats[f"skip_{why}"] for why in SKIP_REASONS} == {why: float(why == reason) for why in SKIP_REASONS}


def test_all_tied_prompts_give_the_identity_plan():
    hidden, _, ids, _ = planted(8, 4, 16, 0.0)
    plan, stats = curate(hidden, torch.ones(32), ids, TINY, gen(0))
    assert_identity(plan, 32)
    assert_skipped(stats, "no_pairs")
    assert stats["pairs"] == 0.0 and stats["proj_steps"] == 0.0 and math.isnan(stats["val_acc"])


def test_identical_hidden_states_give_no_direction_and_the_identity_plan():
    _, rewards, ids, _ = planted(8, 4, 16, 0.0)
    hidden = torch.randn(8, 16, generator=gen(0)).repeat_interleave(4, 0)  # every prompt's rollouts identical
    plan, stats = curate(hidden, rewards, ids, TINY, gen(0))
    assert_identity(plan, 32)
    assert_skipped(stats, "no_pairs")
    assert stats["pairs_identical"] > 0


@pytest.mark.parametrize("as_lists", [False, True])
def test_an_empty_batch_gives_the_empty_identity_plan(as_lists):
    rewards, ids = ([], []) if as_lists else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
    plan, stats = curate(torch.zeros(0, 16), rewards, ids, TINY, gen(0))
    assert_identity(plan, 0)
    assert_skipped(stats, "no_pairs")
    assert stats["flag_frac"] == 0.0


def test_small_batches_are_curated_by_default():
    """The paper has no minimum batch: 72 rollouts (the reference code's 100-score minimum would skip them)."""
    hidden, rewards, ids, _ = planted(12, 6, 16, 0.2, seed=4)
    plan, stats = curate(hidden, rewards, ids, replace(TINY, alpha=0.3), gen(0))
    assert GeoAlignConfig().min_scores is None and GeoAlignConfig().max_flag_frac is None
    assert stats["n_scored"] < 100 and stats["skipped_reason"] == "" and plan.flagged.any()


def test_the_opt_in_score_minimum_flags_nothing_after_training():
    hidden, rewards, ids, _ = planted(12, 6, 16, 0.0)
    plan, stats = curate(hidden, rewards, ids, replace(TINY, min_scores=100), gen(0))
    assert_identity(plan, 72)
    assert_skipped(stats, "few_scores")
    assert stats["prompts_paired"] >= 2 and stats["n_scored"] < 100
    assert stats["proj_steps"] > 0 and not math.isnan(stats["val_acc"])  # the projector still trains
    assert not math.isnan(stats["gdi_p50"]) and bool((~torch.isnan(plan.score)).any())


def test_equal_gdi_scores_flag_nothing():
    """Every prompt: one winner, one loser, the same displacement -> every deviation is 0 up to rounding."""
    g = gen(7)
    base = torch.randn(20, 16, generator=g, dtype=torch.float64)
    hidden = torch.stack([base, base + 0.5], 1).reshape(40, 16)
    rewards = torch.tensor([0.0, 1.0]).repeat(20)
    ids = torch.arange(20).repeat_interleave(2)
    plan, stats = curate(hidden, rewards, ids, TINY, g)
    assert_identity(plan, 40)
    assert_skipped(stats, "degenerate")
    assert stats["cos_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h, r, i: (h, r.index_fill(0, torch.tensor([3]), math.nan), i), "rewards contain NaN"),
        (lambda h, r, i: (h.index_fill(0, torch.tensor([1]), math.inf), r, i), "hidden contains NaN or inf"),
        (lambda h, r, i: (h, r[:-1], i), "rewards must have shape"),
        (lambda h, r, i: (h, r, i[:-1]), "group_ids must have shape"),
        (lambda h, r, i: (h[0], r, i), "hidden must be a tensor of shape"),
        (lambda h, r, i: (h.numpy(), r, i), "hidden must be a tensor of shape"),
        (lambda h, r, i: (h, r, i.double()), "group_ids must be integer"),
        (lambda h, r, i: (h, r, i.double().tolist()), "group_ids must be integer or string prompt ids"),
        (lambda h, r, i: (h, r, "prompt"), "group_ids must hold one prompt id per rollout"),
        (lambda h, r, i: (h, r, [[0, 1]] * 8), "group_ids must have shape"),
    ],
)
def test_bad_inputs_raise_a_clear_error(change, match):
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0)
    with pytest.raises(ValueError, match=match):
        curate(*change(hidden, rewards, ids), TINY)


@pytest.mark.parametrize(
    "actions,match",
    [([3] * 15, r"actions must have shape \(16,\)"), ([1.0] * 16, "action-token count"), ([-1] + [2] * 15, ">= 0")],
)
def test_bad_action_counts_raise_a_clear_error(actions, match):
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0)
    with pytest.raises(ValueError, match=match):
        curate(hidden, rewards, ids, TINY, actions=actions)


def test_projector_of_the_wrong_width_and_a_config_of_the_wrong_type_are_rejected():
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0)
    with pytest.raises(ValueError, match="projector expects hidden size 9"):
        curate(hidden, rewards, ids, TINY, projector=Projector(9, TINY))
    with pytest.raises(ValueError, match="config must be a GeoAlignConfig"):
        curate(hidden, rewards, ids, {"alpha": 0.05})


# ---------------------------------------------------------------- GeoAlignConfig: the one place of validation


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("alpha", 1.5, r"^--geoalign.alpha must be a number in \(0, 1\) \(got 1.5\)$"),
        ("alpha", math.nan, "--geoalign.alpha must be"),
        ("alpha", "0.1", "--geoalign.alpha must be"),
        ("rule", "density", r"--geoalign.rule must be one of \('pointwise', 'threshold'\) \(got 'density'\)"),
        ("mode", "swap", "--geoalign.mode must be one of"),
        ("gdi", "max", "--geoalign.gdi must be one of"),
        ("prototype", "median", "--geoalign.prototype must be one of"),
        ("max_flag_frac", 1.5, r"--geoalign.max_flag_frac must be a number in \(0, 1\]"),
        ("max_flag_frac", -0.1, "--geoalign.max_flag_frac"),
        ("min_scores", 2.5, r"--geoalign.min_scores must be an integer >= 0 .* \(got 2.5\)"),
        ("min_scores", -1, "--geoalign.min_scores"),
        ("max_pairs_per_side", -1, "--geoalign.max_pairs_per_side must be"),
        ("hidden_sizes", (512, 0), "--geoalign.projector.hidden_sizes must be a tuple of integer widths >= 1"),
        ("hidden_sizes", (512.0,), "--geoalign.projector.hidden_sizes"),
        ("hidden_sizes", 512, "--geoalign.projector.hidden_sizes"),
        ("out_dim", 0, "--geoalign.projector.out_dim must be an integer >= 1"),
        ("steps", 2.5, r"^--geoalign.projector.steps must be an integer >= 1 \(got 2.5\)$"),
        ("steps", True, "--geoalign.projector.steps"),
        ("steps", 0, "--geoalign.projector.steps"),
        ("lr", math.inf, "--geoalign.projector.lr must be a finite number > 0"),
        ("lr", 0.0, "--geoalign.projector.lr"),
        ("pair_batch", -1, "--geoalign.projector.pair_batch must be an integer >= 0"),
        ("pair_batch", 512.0, "--geoalign.projector.pair_batch"),
        ("val_acc", 0.0, r"--geoalign.projector.val_acc must be a number in \(0, 1\]"),
        ("val_frac", 1.0, "--geoalign.projector.val_frac"),
        ("warm_start", "yes", "--geoalign.projector.warm_start must be True or False"),
        ("device", "gpu", "--geoalign.device must be a torch device string"),
        ("device", 0, "--geoalign.device"),
    ],
)
def test_config_rejects_bad_values_naming_the_flag(field, value, match):
    with pytest.raises(ValueError, match=match):
        GeoAlignConfig(**{field: value})
    with pytest.raises(ValueError, match=match):  # replace() and presets validate too
        replace(TINY, **{field: value})
    with pytest.raises(ValueError, match=match):
        GeoAlignConfig.preset("rlhf", **{field: value})


def test_config_accepts_the_documented_forms_and_its_presets_follow_the_paper():
    cfg = GeoAlignConfig(
        hidden_sizes=[64, 32], max_flag_frac=0, min_scores=0, steps=np.int64(3), alpha=np.float32(0.1)
    )
    assert cfg.hidden_sizes == (64, 32)  # a list (argparse nargs) becomes a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):  # so nothing bypasses the validation
        cfg.alpha = 5.0
    # §5.1: alpha 0.05 on Math, 0.12 on HH-RLHF; App. C.1: early stop at 95 % / 85 % validation accuracy
    assert (GeoAlignConfig.preset("math").alpha, GeoAlignConfig.preset("math").val_acc) == (0.05, 0.95)
    rlhf = GeoAlignConfig.preset("rlhf", mode="zero")
    assert (rlhf.alpha, rlhf.val_acc, rlhf.mode) == (0.12, 0.85, "zero")
    # the defaults are the math preset and the paper's §4.2 / §4.4 method (no gates, pointwise rule)
    default = GeoAlignConfig()
    assert default == GeoAlignConfig.preset("math")
    assert (default.rule, default.max_flag_frac, default.min_scores) == ("pointwise", None, None)
    assert (default.steps, default.lr, len(default.hidden_sizes) + 1) == (50, 1e-3, 3)
    with pytest.raises(ValueError, match="unknown GeoAlign preset 'chat'"):
        GeoAlignConfig.preset("chat")
    with pytest.raises(ValueError, match="unknown GeoAlign config field 'projector_steps'"):
        GeoAlignConfig.preset("math", projector_steps=3)


def test_reward_margins_that_overflow_float64_are_taken_from_halves():
    """Rewards of opposite sign beyond half the float64 limit: r_k - r_l overflows, r_k / 2 - r_l / 2 does not, and
    Eq. 5's scale invariance makes the halves' margins give the plan of the rewards' signs."""
    hidden, rewards, ids, _ = planted(16, 8, 16, 0.1, seed=1)
    config = replace(TINY, alpha=0.3)
    signs = 2 * rewards.double() - 1
    base, stats = curate(hidden, signs, ids, config, gen(0))
    assert base.flagged.any()
    plan, huge = curate(hidden, signs * 1.5e308, ids, config, gen(0))
    assert torch.equal(plan.flagged, base.flagged) and torch.equal(plan.source, base.source)
    assert huge["consensus"] == pytest.approx(stats["consensus"], rel=1e-12)


# ---------------------------------------------------------------- rollouts without action tokens; tied groups after


@settings(max_examples=60)
@given(st.data())
def test_a_rollout_that_is_not_usable_is_never_a_donor_nor_an_amplify_target(data):
    n = data.draw(st.integers(1, 24))
    mode = data.draw(st.sampled_from(MODES))
    ids = torch.tensor(data.draw(st.lists(st.sampled_from([0, 3, 7]), min_size=n, max_size=n)))
    rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n)))
    usable = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    flagged = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n))) & usable
    plan = rectify(flagged, rewards, ids, mode, gen(data.draw(st.integers(0, 9))), usable=usable)
    moved = plan.source != torch.arange(n)
    assert not moved[~usable].any()  # its own slot keeps it (amplify never overwrites it)
    if mode == "replace":
        assert usable[plan.source[moved]].all() and not flagged[plan.source[moved]].any()
    # a prompt whose only unflagged rollouts are not usable has no stable one: left unchanged
    for p in ids.unique().tolist():
        in_p = ids == p
        if not (usable & ~flagged & in_p).any():
            assert not moved[in_p].any() and plan.weight[in_p].eq(1).all() and plan.keep[in_p].all()


def empty_responses(hidden, actions):
    """What the engines pass for a response without an action token: a zero hidden row."""
    return hidden * (torch.as_tensor(actions) > 0)[:, None]


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10**4), st.floats(0.0, 0.5))
def test_rollouts_without_action_tokens_leave_pairs_projector_scores_and_donors(seed, empty_rate):
    """Independently: GeoAlign's detection on the other rollouts alone gives the same pairs, scores and flags."""
    hidden, rewards, ids, corrupted = planted(12, 8, 16, 0.15, seed=seed)
    actions = (torch.rand(len(rewards), generator=gen(seed)) >= empty_rate).long() * 5
    hidden = empty_responses(hidden, actions)
    plan, stats = curate(hidden, rewards, ids, TINY, gen(3), corrupted=corrupted, actions=actions)
    rows = torch.nonzero(actions)[:, 0]
    alone, alone_stats = curate(hidden[rows], rewards[rows], ids[rows], TINY, gen(3))
    for key in ("pairs", "n_scored", "n_flagged", "proj_loss", "gdi_p50", "kde_mode"):
        assert stats[key] == pytest.approx(alone_stats[key], rel=0, abs=0, nan_ok=True), key
    assert_close(plan.score[rows], alone.score, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(plan.flagged[rows], alone.flagged)
    empty = actions == 0
    assert plan.score[empty].isnan().all() and not plan.flagged[empty].any()
    assert not (plan.source != torch.arange(len(rewards)))[empty].any()  # its own slot keeps it
    assert not empty[plan.source].logical_and(plan.source != torch.arange(len(rewards))).any()  # never a donor
    assert stats["zero_action_rollouts"] == float(empty.sum())
    assert stats["flag_frac"] == stats["n_flagged"] / len(rewards)


def test_a_zero_hidden_row_was_paired_and_could_be_a_donor():
    """What passing no action counts does with an empty response's zero row: it is paired and scored like any."""
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0, seed=3)
    rewards = torch.tensor([1.0, 0, 0, 0] * 4)
    hidden[0] = 0.0
    _, blind = curate(hidden, rewards, ids, TINY, gen(0))
    actions = torch.tensor([0] + [4] * 15)
    _, seen = curate(hidden, rewards, ids, TINY, gen(0), actions=actions)
    assert blind["pairs"] == 12 and seen["pairs"] == 9  # prompt 0 has no winner left
    assert blind["zero_action_rollouts"] == 0 and seen["zero_action_rollouts"] == 1


def brute_force_tied_after(rewards, ids, plan):
    """Prompts whose rewards differ and whose kept slots all hold one reward, by direct counting."""
    count = 0
    for p in set(ids.tolist()):
        slots = [i for i in range(len(ids)) if int(ids[i]) == p]
        before = {float(rewards[i]) for i in slots}
        after = {float(rewards[plan.source[i]]) for i in slots if plan.keep[i]}
        count += len(before) > 1 and len(after) == 1
    return float(count)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_zero_variance_groups_after_counts_the_prompts_a_replacement_tied(data):
    n_prompts, group = data.draw(st.integers(1, 5)), data.draw(st.integers(2, 5))
    n = n_prompts * group
    ids = torch.arange(n) // group
    rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)))
    flagged = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    mode = data.draw(st.sampled_from(MODES))
    hidden = torch.randn(n, 6, generator=gen(0))

    def detect(hidden, rewards, group_ids, config, generator, projector, stats):  # flags drawn, not detected
        return torch.full((len(rewards),), math.nan, dtype=torch.float64), flagged.clone(), ""

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(geoalign.plan, "_detect", detect)
        plan, stats = curate(hidden, rewards, ids, replace(TINY, mode=mode), gen(1))
    assert stats["zero_variance_groups_after"] == brute_force_tied_after(rewards, ids, plan)


def test_a_replacement_can_tie_a_group_that_dynamic_filtering_passed(monkeypatch):
    """DAPO's filter passed [1, 1, 1, 0] (not tied); Best-Random replaces the flagged 0 by one of the three 1s: the
    prompt keeps its 4 slots and gets zero group advantages, counted in zero_variance_groups_after."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    flagged = torch.tensor([False, False, False, True, False, False, False, False])

    def detect(hidden, rewards, group_ids, config, generator, projector, stats):
        return torch.full((len(rewards),), math.nan, dtype=torch.float64), flagged.clone(), ""

    monkeypatch.setattr(geoalign.plan, "_detect", detect)
    ids = torch.arange(8) // 4
    plan, stats = curate(torch.randn(8, 6, generator=gen(0)), rewards, ids, TINY, gen(1))
    slot = rewards[plan.source]
    assert plan.keep.all() and slot[:4].tolist() == [1.0] * 4 and int(plan.source[3]) in (0, 1, 2)
    assert stats["zero_variance_groups_after"] == 1.0
    assert group_norm(slot, ids)[:4].tolist() == [0.0] * 4


def test_the_new_geoalign_and_salt_metrics_are_defined_in_the_usage_doc():
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    for name in ("salt/zero_action_rollouts", "geo/zero_action_rollouts", "geo/zero_variance_groups_after"):
        assert f"`{name}`:" in usage, name
