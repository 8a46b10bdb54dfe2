"""GeoAlign core: equations against brute force, plan invariants, degenerate inputs, a planted-outlier batch."""

import io
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import gaussian_kde
from torch.testing import assert_close

import openrlhf_geo.geoalign as geoalign
from openrlhf_geo.geoalign import (
    GDI_KINDS,
    MODES,
    PROTOTYPES,
    CurationPlan,
    GeoAlignConfig,
    Projector,
    best_random_probs,
    curate,
    deviation,
    gdi,
    kde_tail_threshold,
    orientation_loss,
    pair_distances,
    preference_pairs,
    prototype,
    rectify,
)
from openrlhf_geo.rewards.noise import flip_binary

# Small projector so each curate call takes milliseconds; min_scores low enough for small batches.
TINY = GeoAlignConfig(hidden_sizes=(16,), out_dim=8, steps=5, min_scores=4)
SMALL = GeoAlignConfig(hidden_sizes=(128, 128), out_dim=32)


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
    for field in ("source", "weight", "keep", "flagged", "gdi"):
        assert_close(getattr(plan_a, field), getattr(plan_b, field), rtol=0, atol=0, equal_nan=True)
    drop = {"time_s"}
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

    monkeypatch.setattr(geoalign, "fit_projector", spy)
    hidden, rewards, ids, _ = planted(20, 6, 16, 0.0, seed=6)
    _, stats = curate(hidden, rewards, ids, TINY, gen(0))
    prompt = ids[seen["winner"]]
    val_prompts = set(prompt[seen["val_mask"]].tolist())
    assert not val_prompts & set(prompt[~seen["val_mask"]].tolist())
    assert len(val_prompts) == round(TINY.val_frac * stats["prompts_paired"])


def test_training_stops_early_once_validation_accuracy_is_reached():
    hidden, rewards, ids, _ = planted(16, 8, 32, 0.0, seed=8)
    cfg = GeoAlignConfig(hidden_sizes=(32,), out_dim=16, steps=40, val_acc=0.75, min_scores=4)
    _, stats = curate(hidden, rewards, ids, cfg, gen(0))
    assert stats["proj_steps"] < 40 and stats["proj_val_acc"] >= 0.75
    # pure-noise hidden states never reach 100 % on held-out prompts: all steps run
    noise = torch.randn(hidden.shape, generator=gen(1))
    _, stats = curate(noise, rewards, ids, replace(cfg, val_acc=1.0), gen(0))
    assert stats["proj_steps"] == 40


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


# ---------------------------------------------------------------- KDE threshold


def reference_threshold(scores, alpha, points=50_001):
    """First point right of the density mode where scipy's KDE drops below alpha * peak, on a fine grid."""
    kde = gaussian_kde(scores)
    grid = np.linspace(scores.min(), scores.max(), points)
    density = kde(grid)
    mode = np.argmax(density)
    below = np.nonzero((np.arange(points) > mode) & (density < alpha * density[mode]))[0]
    return (grid[below[0]] if len(below) else math.inf), grid[1] - grid[0]


@pytest.mark.parametrize("alpha", [0.05, 0.12, 0.3])
def test_kde_tail_threshold_matches_scipy_on_a_fine_grid(alpha):
    rng = np.random.default_rng(1)
    scores = np.concatenate([rng.gamma(2.0, 0.5, 300), rng.normal(6.0, 0.3, 12)])
    threshold, _ = kde_tail_threshold(scores, alpha)
    expected, step = reference_threshold(scores, alpha)
    assert abs(threshold - expected) <= 2 * step


def test_kde_tail_flags_a_dense_far_cluster_as_a_whole():
    """Beyond the threshold every score is in the tail, even inside a secondary outlier cluster whose own density
    exceeds alpha * peak (a pointwise density test would keep most of that cluster)."""
    rng = np.random.default_rng(2)
    scores = np.concatenate([rng.normal(1.0, 0.3, 300), rng.normal(8.0, 0.05, 40)])
    threshold, _ = kde_tail_threshold(scores, 0.05)
    kde = gaussian_kde(scores)
    cluster = scores[300:]
    assert threshold < cluster.min()
    assert (kde(cluster) >= 0.05 * kde(np.linspace(0, 9, 9001)).max()).any()


def test_kde_threshold_is_infinite_without_a_sparse_tail_and_nan_when_degenerate():
    assert kde_tail_threshold(np.linspace(0.0, 1.0, 200), 0.05)[0] == math.inf  # flat density: no tail
    assert math.isnan(kde_tail_threshold(np.ones(200), 0.05)[0])
    assert math.isnan(kde_tail_threshold(1 + 1e-9 * np.random.default_rng(0).normal(size=200), 0.05)[0])


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
            assert plan.multiplicity()[ids == p].sum() == (ids == p).sum()


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
    assert plan.multiplicity().tolist() == [2, 0, 2, 0, 0]


# ---------------------------------------------------------------- curate: whole pipeline


def test_planted_outliers_are_found():
    hidden, rewards, ids, corrupted = planted()
    plan, stats = curate(hidden, rewards, ids, SMALL, gen(0), corrupted=corrupted)
    assert stats["auroc"] >= 0.8
    assert stats["n_flagged"] > 0 and stats["precision"] >= 0.8
    # the plan replaced every flagged rollout (each prompt still has stable ones) and kept prompt sizes
    assert bool((plan.source[plan.flagged] != torch.nonzero(plan.flagged)[:, 0]).all())
    assert torch.equal(torch.bincount(ids[plan.source] - 1000), torch.bincount(ids - 1000))


def test_flags_are_the_capped_high_tail_of_the_returned_gdi():
    hidden, rewards, ids, corrupted = planted(seed=1)
    cfg = replace(SMALL, alpha=0.3, max_flag_frac=0.05)
    plan, stats = curate(hidden, rewards, ids, cfg, gen(0), corrupted=corrupted)
    scores = plan.gdi.double().numpy()
    scored = ~np.isnan(scores)
    expected, step = reference_threshold(scores[scored], cfg.alpha)
    assert abs(stats["kde_threshold"] - expected) <= 2 * step
    tail = scored & (scores >= stats["kde_threshold"])
    cap = int(cfg.max_flag_frac * len(scores))
    assert tail.sum() > cap  # the cap binds here: the highest-GDI ones are kept
    assert plan.flagged.sum() == cap
    assert scores[plan.flagged.numpy()].min() >= scores[tail & ~plan.flagged.numpy()].max()
    # precision / recall / AUROC by direct counting
    f, c = plan.flagged.numpy(), corrupted.numpy()
    assert stats["precision"] == pytest.approx((f & c).sum() / f.sum())
    assert stats["recall"] == pytest.approx((f & c).sum() / c.sum())
    pos, neg = scores[scored & c], scores[scored & ~c]
    auroc = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert stats["auroc"] == pytest.approx(auroc)


def test_stats_hold_the_contract_keys_as_floats():
    hidden, rewards, ids, corrupted = planted(16, 8, 16, 0.1, seed=2)
    _, stats = curate(hidden, rewards, ids, TINY, gen(0), corrupted=corrupted)
    required = {
        "pairs",
        "n_scored",
        "n_flagged",
        "flag_frac",
        "proj_train_acc",
        "proj_val_acc",
        "proj_steps",
        "proj_loss",
        "gdi_p50",
        "gdi_p95",
        "cos_gt_0.8",
        "cos_mean",
        "time_s",
        "precision",
        "recall",
        "auroc",
    }
    assert required <= set(stats)
    assert all(type(v) is float for v in stats.values())
    assert stats["pairs"] == len(preference_pairs(rewards, ids)[0])


def test_amplify_duplicates_each_outlier_into_a_stable_slot():
    hidden, rewards, ids, corrupted = planted(32, 12, 32, seed=3)
    plan, stats = curate(hidden, rewards, ids, replace(TINY, mode="amplify", steps=30), gen(0))
    assert stats["n_flagged"] > 0
    assert bool((plan.multiplicity()[plan.flagged] == 2).all())


def test_tied_prompts_are_untouched_and_curate_is_deterministic():
    hidden, rewards, ids, _ = planted(24, 8, 16, 0.2, seed=4)
    tied = ids < 1000 + 7 * 6  # first six prompts: all rewards equal
    rewards = torch.where(tied, torch.ones_like(rewards), rewards)
    cfg = replace(TINY, alpha=0.5, max_flag_frac=0.5)
    first = curate(hidden, rewards, ids, cfg, gen(5))
    plan = first[0]
    assert plan.flagged.any() and not plan.flagged[tied].any()
    assert torch.equal(plan.source[tied], torch.nonzero(tied)[:, 0]) and bool(plan.keep[tied].all())
    assert bool(torch.isnan(plan.gdi[tied]).all())
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


# ---------------------------------------------------------------- degenerate inputs


def assert_identity(plan, n):
    identity = CurationPlan.identity(n)
    for field in ("source", "weight", "keep", "flagged"):
        assert torch.equal(getattr(plan, field), getattr(identity, field))


def test_all_tied_prompts_give_the_identity_plan():
    hidden, _, ids, _ = planted(8, 4, 16, 0.0)
    plan, stats = curate(hidden, torch.ones(32), ids, TINY, gen(0))
    assert_identity(plan, 32)
    assert stats["skip_no_pairs"] == 1.0 and stats["pairs"] == 0.0


def test_identical_hidden_states_give_no_direction_and_the_identity_plan():
    _, rewards, ids, _ = planted(8, 4, 16, 0.0)
    hidden = torch.randn(8, 16, generator=gen(0)).repeat_interleave(4, 0)  # every prompt's rollouts identical
    plan, stats = curate(hidden, rewards, ids, TINY, gen(0))
    assert_identity(plan, 32)
    assert stats["skip_no_pairs"] == 1.0 and stats["pairs_identical"] > 0


def test_one_prompt_gives_the_identity_plan():
    hidden, rewards, ids, _ = planted(1, 64, 16, 0.0)
    plan, stats = curate(hidden, rewards, ids, TINY, gen(0))
    assert_identity(plan, 64)
    assert stats["skip_one_prompt"] == 1.0 and stats["pairs"] > 0


def test_too_few_scores_flag_nothing():
    hidden, rewards, ids, _ = planted(12, 6, 16, 0.0)
    plan, stats = curate(hidden, rewards, ids, replace(TINY, min_scores=100), gen(0))
    assert_identity(plan, 72)
    assert stats["prompts_paired"] >= 2 and stats["n_scored"] < 100
    assert stats["skip_few_scores"] == 1.0 and stats["proj_steps"] == 0.0


def test_equal_gdi_scores_flag_nothing():
    """Every prompt: one winner, one loser, the same displacement -> every deviation is 0 up to rounding."""
    g = gen(7)
    base = torch.randn(20, 16, generator=g, dtype=torch.float64)
    hidden = torch.stack([base, base + 0.5], 1).reshape(40, 16)
    rewards = torch.tensor([0.0, 1.0]).repeat(20)
    ids = torch.arange(20).repeat_interleave(2)
    plan, stats = curate(hidden, rewards, ids, TINY, g)
    assert_identity(plan, 40)
    assert stats["skip_degenerate"] == 1.0 and stats["cos_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h, r, i: (h, r.index_fill(0, torch.tensor([3]), math.nan), i), "rewards contain NaN"),
        (lambda h, r, i: (h.index_fill(0, torch.tensor([1]), math.inf), r, i), "hidden contains NaN or inf"),
        (lambda h, r, i: (h, r[:-1], i), "rewards must have shape"),
        (lambda h, r, i: (h, r, i[:-1]), "group_ids must have shape"),
        (lambda h, r, i: (h[0], r, i), "hidden must have shape"),
        (lambda h, r, i: (h, r, i.double()), "group_ids must be integer"),
    ],
)
def test_bad_inputs_raise_a_clear_error(change, match):
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0)
    with pytest.raises(ValueError, match=match):
        curate(*change(hidden, rewards, ids), TINY)


@pytest.mark.parametrize(
    "override,match",
    [
        ({"mode": "swap"}, "config.mode must be one of"),
        ({"alpha": 1.5}, r"config.alpha must be in \(0, 1\)"),
        ({"gdi": "max"}, "config.gdi"),
        ({"val_frac": 0.0}, "config.val_frac"),
    ],
)
def test_bad_config_raises_naming_the_field(override, match):
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0)
    with pytest.raises(ValueError, match=match):
        curate(hidden, rewards, ids, replace(TINY, **override))


def test_projector_of_the_wrong_width_is_rejected():
    hidden, rewards, ids, _ = planted(4, 4, 8, 0.0)
    with pytest.raises(ValueError, match="projector expects hidden size 9"):
        curate(hidden, rewards, ids, TINY, projector=Projector(9, TINY))
