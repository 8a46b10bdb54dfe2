"""The real-lm-geoalign protocol's amendment (docs/studies/real-lm-geoalign.md, items 1-5) and curate's held-out
cos > 0.8 share, each against an independent brute-force computation."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import geoalign
from openrlhf_geo.geoalign import GeoAlignConfig, curate, detection_auroc
from openrlhf_geo.lab.studies import real_lm_geoalign as study

SMALL = GeoAlignConfig(hidden_sizes=(32,), out_dim=8, steps=20, val_acc=1.0, val_frac=0.25)


def batch(prompts=8, samples=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(prompts * samples, generator=g) < 0.5).float()
    hidden = torch.randn(prompts * samples, d, generator=g) + rewards[:, None] * torch.linspace(0, 1, d)
    return hidden, rewards, torch.arange(prompts * samples) // samples


# ---------------------------------------------------------------- curate's cos_gt_0.8_val


def test_cos_gt_0_8_val_is_the_share_of_held_out_pairs_near_the_prototype(monkeypatch):
    seen = {}
    held_out, deviation = geoalign.plan._held_out_pairs, geoalign.plan.deviation

    def spy_split(*args):
        seen["val"] = held_out(*args).numpy()
        return torch.from_numpy(seen["val"])

    def spy_deviation(v, v_proto):
        seen["v"], seen["proto"] = v.numpy().astype(np.float64), v_proto.numpy().astype(np.float64)
        return deviation(v, v_proto)

    monkeypatch.setattr(geoalign.plan, "_held_out_pairs", spy_split)
    monkeypatch.setattr(geoalign.plan, "deviation", spy_deviation)
    hidden, rewards, ids = batch(seed=1)
    _, stats = curate(hidden, rewards, ids, SMALL, torch.Generator().manual_seed(0))
    v, proto, val = seen["v"], seen["proto"], seen["val"]
    cos = (v @ proto) / np.linalg.norm(v, axis=1) / np.linalg.norm(proto)
    assert 0 < val.sum() < len(val)  # some pairs held out, some trained
    assert stats["cos_gt_0.8_val"] == pytest.approx(np.mean(cos[val] > 0.8), abs=1e-12)
    assert stats["cos_gt_0.8"] == pytest.approx(np.mean(cos > 0.8), abs=1e-12)  # all pairs, as always
    assert stats["cos_gt_0.8_val"] != stats["cos_gt_0.8"]  # a different set of pairs here


def test_cos_gt_0_8_val_is_nan_when_no_prompt_is_held_out():
    hidden, rewards, ids = batch(prompts=1, samples=8, seed=2)  # pairs in one prompt: no validation split
    _, stats = curate(hidden, rewards, ids, SMALL, torch.Generator().manual_seed(0))
    assert stats["pairs"] > 0 and math.isnan(stats["val_acc"]) and math.isnan(stats["cos_gt_0.8_val"])
    assert 0 <= stats["cos_gt_0.8"] <= 1


# ---------------------------------------------------------------- item 1: cross-fitting


def test_folds_hold_every_prompt_out_exactly_once():
    prompts = torch.arange(32, 48)
    parts = study.folds(prompts, 4, study._rng(study.STREAMS["folds"], 2))
    assert [len(p) for p in parts] == [4] * 4
    assert sorted(torch.cat(parts).tolist()) == prompts.tolist()
    again = study.folds(prompts, 4, study._rng(study.STREAMS["folds"], 2))
    assert all(torch.equal(a, b) for a, b in zip(parts, again))  # seeded
    assert torch.cat(parts).tolist() != prompts.tolist()  # permuted


def test_crossfit_trains_on_the_other_folds_only_and_as_curate_trains(monkeypatch):
    hidden, rewards, ids = batch(prompts=8, samples=8, d=12, seed=3)
    held_out = study.folds(torch.unique(ids), 4, study._rng(study.STREAMS["folds"], 0))
    trained_on, fit = [], geoalign.fit_projector

    def spy(projector, h, winner, loser, *args, **kwargs):
        trained_on.append(set(ids[winner].tolist()) | set(ids[loser].tolist()))
        return fit(projector, h, winner, loser, *args, **kwargs)

    monkeypatch.setattr(geoalign.pairs, "fit_projector", spy)
    records = study.crossfit(hidden, rewards, ids, held_out)
    assert sorted(r["prompt"] for r in records) == list(range(8))  # every prompt held out once
    for fold, train in zip(held_out, trained_on):
        assert not train & set(fold.tolist())  # no prompt on both sides
        assert train | set(fold.tolist()) == set(range(8))
    # curate on the training prompts alone (math preset, seed 0) trains the same projector: same steps, prototype
    monkeypatch.setattr(geoalign.pairs, "fit_projector", fit)
    for f, fold in enumerate(held_out):
        keep = ~torch.isin(ids, fold)
        _, stats = curate(hidden[keep], rewards[keep], ids[keep], GeoAlignConfig.preset("math"),
                          torch.Generator().manual_seed(study.PROJECTOR_SEED))  # fmt: skip
        rec = next(r for r in records if r["fold"] == f)
        assert rec["proj_steps"] == stats["proj_steps"]
        assert rec["train_consensus"] == pytest.approx(stats["consensus"], abs=1e-6)


def test_crossfit_metrics_are_the_held_out_prompts_orientation_accuracy_and_cosine_share(monkeypatch):
    hidden, rewards, ids = batch(prompts=8, samples=8, d=12, seed=4)
    held_out = study.folds(torch.unique(ids), 4, study._rng(study.STREAMS["folds"], 1))
    seen, fit, prototype = {}, geoalign.fit_projector, geoalign.prototype

    def spy_fit(projector, *args, **kwargs):
        seen["projector"] = projector
        seen["probe"] = fit(projector, *args, **kwargs)[0]
        return seen["probe"], 0

    def spy_prototype(v, margins, kind="margin"):
        seen["proto"] = prototype(v, margins, kind)[0]
        return prototype(v, margins, kind)

    monkeypatch.setattr(geoalign.pairs, "fit_projector", spy_fit)
    monkeypatch.setattr(geoalign.scores, "prototype", spy_prototype)
    fold = held_out[:1]
    records = study.crossfit(hidden, rewards, ids, fold)
    scale = geoalign.pairs._pow2_scale(hidden)
    for rec in records:
        rows = torch.nonzero(ids == rec["prompt"])[:, 0].tolist()
        pairs = [(w, l) for w in rows for l in rows if rewards[w] > rewards[l]]
        assert rec["pairs"] == len(pairs)
        if not pairs:
            assert math.isnan(rec["val_acc"]) and math.isnan(rec["cos_gt_0.8"])
            continue
        u = torch.stack([hidden[w] - hidden[l] for w, l in pairs]) * scale
        u = u / u.norm(dim=1, keepdim=True)
        with torch.no_grad():
            plus, minus = seen["projector"](u), seen["projector"](-u)
        right = np.concatenate([(plus @ seen["probe"]).numpy() > 0, (minus @ seen["probe"]).numpy() < 0])
        v = plus.double().numpy()
        cos = v @ seen["proto"].numpy() / np.linalg.norm(v, axis=1) / np.linalg.norm(seen["proto"].numpy())
        assert rec["val_acc"] == pytest.approx(right.mean())
        assert rec["cos_gt_0.8"] == pytest.approx(np.mean(cos > 0.8))


# ---------------------------------------------------------------- item 2: nulls keeping the real rewards


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_within_prompt_permutation_keeps_each_prompts_multiset_of_rows(prompts, samples, seed):
    g = torch.Generator().manual_seed(seed % 1000)
    ids = torch.arange(prompts * samples) // samples
    order = torch.randperm(len(ids), generator=g)  # prompts interleaved in the batch
    ids, hidden = ids[order], torch.randn(len(ids), 3, generator=g)
    out = study.permuted_within_prompts(hidden, ids, np.random.default_rng(seed))
    for p in range(prompts):
        mine = ids == p
        assert sorted(map(tuple, out[mine].tolist())) == sorted(map(tuple, hidden[mine].tolist()))


def test_within_prompt_permutation_moves_rows_and_is_seeded():
    hidden, _, ids = batch(prompts=4, samples=16, d=4, seed=5)
    a = study.permuted_within_prompts(hidden, ids, study._rng(1, 0))
    assert torch.equal(a, study.permuted_within_prompts(hidden, ids, study._rng(1, 0)))
    assert not torch.equal(a, hidden)


def test_gaussian_null_has_the_batchs_per_coordinate_mean_and_sd():
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(20000, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1]) + 7
    out = study.gaussian_like(hidden, np.random.default_rng(0)).numpy()
    np.testing.assert_allclose(out.mean(0), hidden.numpy().mean(0), atol=0.1)
    np.testing.assert_allclose(out.std(0), hidden.numpy().std(0), rtol=0.03)


# ---------------------------------------------------------------- item 4: the matched-rate detectors


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(0, 45), st.integers(0, 2**32 - 1))
def test_matched_rate_detector_flags_the_top_n_scored_by_pair_count_with_random_ties(counts, n, seed):
    rng = np.random.default_rng(seed)
    score = np.asarray(counts, dtype=float)
    scored = rng.random(len(score)) < 0.8
    key = rng.random(len(score))
    flags = study.top_flags(score, scored, n, key)
    for i in range(len(score)):  # brute force: i's rank among the scored rollouts
        above = sum(scored[j] and (score[j] > score[i] or (score[j] == score[i] and key[j] < key[i]))
                    for j in range(len(score)))  # fmt: skip
        assert flags[i] == (scored[i] and above < n)
    assert flags.sum() == min(n, scored.sum())


# ---------------------------------------------------------------- items 1-4: the prompt-cluster bootstrap


def test_prompt_resamples_draw_each_row_of_prompts_with_replacement():
    counts = study.prompt_resamples(7, n=300)
    assert counts.shape == (300, 7) and bool((counts.sum(1) == 7).all())
    assert np.array_equal(counts, study.prompt_resamples(7, n=300))  # seeded
    assert len({tuple(c) for c in counts}) > 250


def test_weighted_auroc_is_the_auroc_of_the_resample_with_every_drawn_prompts_rollouts():
    rng = np.random.default_rng(7)
    prompt = np.repeat(np.arange(6), 10)
    score = rng.integers(0, 5, len(prompt)).astype(float)  # ties across and within prompts
    bad = rng.random(len(prompt)) < 0.3
    auroc = study.weighted_auroc(score, bad, prompt)
    assert auroc(np.ones(6)) == pytest.approx(detection_auroc(score, bad, np.ones(len(score), bool))[0])
    for counts in study.prompt_resamples(6, n=20):
        rows = np.concatenate([np.nonzero(prompt == p)[0] for p in range(6) for _ in range(counts[p])])
        expected = detection_auroc(score[rows], bad[rows], np.ones(len(rows), bool))[0]
        assert auroc(counts) == pytest.approx(expected, nan_ok=True)


def test_pair_weighted_mean_of_a_resample_counts_every_pair_of_each_drawn_prompt():
    rows = [{"prompt": 0, "pairs": 3, "val_acc": 1.0}, {"prompt": 1, "pairs": 1, "val_acc": 0.0},
            {"prompt": 2, "pairs": 0, "val_acc": math.nan}, {"prompt": 3, "pairs": 4, "val_acc": 0.5}]  # fmt: skip
    mean = study.pair_weighted(rows, "val_acc", 4)
    assert mean(np.ones(4)) == pytest.approx((3 * 1.0 + 0 + 4 * 0.5) / 8)
    assert mean(np.array([0, 2, 5, 1])) == pytest.approx((2 * 0.0 + 4 * 0.5) / (2 + 4))
    assert math.isnan(mean(np.array([0, 0, 3, 0])))  # only a prompt without pairs drawn


def test_prompt_ci_is_the_point_at_every_prompt_and_percentiles_over_resamples():
    values = np.array([0.1, 0.5, 0.9, 0.3])
    counts = study.prompt_resamples(4, n=500)
    row = study.prompt_ci(lambda w: float(w @ values / w.sum()), counts)
    boots = counts @ values / counts.sum(1)
    assert row["mean"] == pytest.approx(values.mean()) and row["n"] == 4
    assert (row["low"], row["high"]) == pytest.approx(tuple(np.percentile(boots, (2.5, 97.5))))


def _rollouts_record(batch, gdi, pair_count, corrupted, kde, pc_top, gdi_top, rate=0.1):
    return {"analysis": "rollouts", "batch": batch, "rate": rate, "draw": 0, "gdi": gdi, "gdi_permuted": gdi,
            "gdi_gaussian": gdi, "pair_count": pair_count, "corrupted": corrupted, "kde_flagged": kde,
            "pair_count_top": pc_top, "gdi_top": gdi_top}  # fmt: skip


def test_matched_rate_precision_and_recall_pool_calls_and_resample_prompts_whole():
    setup = {"prompts_per_batch": 2, "samples": 2, "batches": 2}
    records = [  # batch 0 holds prompts 0-1, batch 1 prompts 2-3 (rows i * samples + j)
        _rollouts_record(0, [0.1, 0.2, 0.3, math.nan], [1, 1, 2, 0], [0, 2], [2], [0, 2], [2]),
        _rollouts_record(1, [0.5, 0.6, 0.7, 0.8], [1, 1, 1, 1], [3], [0, 3], [1, 3], [3, 2]),
    ]
    pool = study._pooled_rollouts(records, setup)
    assert pool["prompt"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    counts = study.prompt_resamples(4, n=50)
    out = study.matched_rate_summary(pool, counts)
    assert out["flagged"] == 3 and out["corrupted"] == 3
    assert out["kde_flagged"]["precision"]["mean"] == pytest.approx(2 / 3)  # rows 2 and 7 of 2, 4, 7
    assert out["pair_count_top"]["recall"]["mean"] == pytest.approx(3 / 3)
    assert out["gdi_top"]["precision"]["mean"] == pytest.approx(2 / 3)
    diffs = []
    for c in counts:  # brute force: the drawn prompts' rollouts, replicated
        rows = np.concatenate([np.nonzero(pool["prompt"] == p)[0] for p in range(4) for _ in range(c[p])])
        hits = {n: (pool[n][rows] & pool["bad"][rows]).sum() for n in study.DETECTORS}
        if pool["kde_flagged"][rows].sum() and pool["pair_count_top"][rows].sum():
            diffs.append(hits["pair_count_top"] / pool["pair_count_top"][rows].sum()
                         - hits["kde_flagged"] / pool["kde_flagged"][rows].sum())  # fmt: skip
    row = out["pair_count_top_minus_kde"]["precision"]
    assert (row["low"], row["high"]) == pytest.approx(tuple(np.percentile(diffs, (2.5, 97.5))))


# ---------------------------------------------------------------- item 5: the amended rules


def _ci(mean, low, high):
    return {"mean": mean, "low": low, "high": high, "n": 64}


@pytest.mark.parametrize(
    ("acc", "gap_acc", "gap_cos", "gap_cos_b", "auroc_gap", "expected"),
    [
        (
            _ci(0.99, 0.98, 1.0),
            _ci(0.4, 0.3, 0.5),
            _ci(0.2, 0.1, 0.3),
            _ci(0.1, 0.05, 0.2),
            _ci(0.1, 0.05, 0.2),
            ("reproduced", "stated", "matches", "GDI detects"),
        ),
        (
            _ci(0.8, 0.7, 0.9),
            _ci(0.4, 0.3, 0.5),
            _ci(0.0, -0.1, 0.1),
            _ci(0.1, 0.05, 0.2),
            _ci(-0.1, -0.2, -0.01),
            ("not reproduced", "not stated", "not stated", "the reward-only score"),
        ),
        (
            _ci(0.97, 0.9, 0.99),
            _ci(0.1, -0.1, 0.3),
            _ci(0.2, 0.1, 0.3),
            _ci(0.0, -0.05, 0.2),
            _ci(0.0, -0.1, 0.1),
            ("not decided", "not stated", "not stated", "not decided"),
        ),
        (*[_ci(math.nan, math.nan, math.nan)] * 5, ("no verdict",) * 4),  # no held-out pair, no scored rollout
    ],
)
def test_amended_verdicts_read_the_prompt_cis(acc, gap_acc, gap_cos, gap_cos_b, auroc_gap, expected):
    amendment = {
        "held_out": {"real": {"val_acc": acc}},
        "held_out_gap": {
            "permuted": {"val_acc": gap_acc, "cos_gt_0.8": gap_cos},
            "gaussian": {"val_acc": gap_acc, "cos_gt_0.8": gap_cos_b},
        },
        "detection": {"0.10": {"gdi_minus_pair_count": auroc_gap}},
    }
    verdicts = study.amended_verdicts(amendment)
    got = (verdicts["projector"], verdicts["reward direction"], verdicts["paper's cosine share"],
           verdicts["detection 0.10"])  # fmt: skip
    assert all(text.startswith(prefix) for text, prefix in zip(got, expected)), got


# ---------------------------------------------------------------- the whole amended analysis on a small batch


def test_the_amended_analysis_runs_the_null_calls_on_the_same_flips_and_renders(monkeypatch):
    monkeypatch.setattr(study, "RESAMPLES", 50)
    monkeypatch.setattr(geoalign.GeoAlignConfig, "preset", classmethod(lambda cls, name: replace(SMALL, val_acc=0.95)))
    hidden, rewards, _ = batch(prompts=8, samples=8, d=12, seed=8)
    data = {"collection": {"caps": [32], "samples": 8, "prompts": 8}, "geometry": {32: {"hidden": hidden}},
            "rewards": {32: rewards}}  # fmt: skip
    records = study.analyse(data, per_batch=4, draws=1)
    first = [r for r in records if "analysis" not in r]
    assert len(first) == 2 * (1 + len(study.RATES)) and all("rollouts" not in r for r in first)
    nulls = [r for r in records if r.get("analysis") == "null_flip"]
    for r in nulls:  # the same flips as the real call of its (batch, rate, draw)
        real = next(f for f in first if (f["batch"], f["rate"], f["draw"]) == (r["batch"], r["rate"], r["draw"]))
        assert r["corrupted"] == real["corrupted"] and r["accuracy"] == real["accuracy"]
    assert len(nulls) == 2 * len(study.RATES) * len(study.NULLS)
    held = [r for r in records if r.get("analysis") == "held_out"]
    assert sorted((r["hidden"], r["prompt"]) for r in held) == sorted((k, p) for k in study.HIDDEN_KINDS
                                                                      for p in range(8))  # fmt: skip
    setup = {"model": "m", "temperature": 0.6, "seed": 0, "cap": 32, "samples": 8, "prompts_per_batch": 4,
             "batches": 2, "rates": list(study.RATES), "draws": 1, "wall_s": 1.0, "estimate_s": 1.0}  # fmt: skip
    summary = study.summarize(records, setup)
    for entry in summary["amendment"]["detection"].values():
        assert 0 <= entry["gdi"]["low"] <= entry["gdi"]["high"] <= 1
    assert set(summary["amendment"]["detection"]) == {f"{r:.2f}" for r in study.RATES}
    assert set(summary["amended_verdicts"]) == {"projector", "reward direction", "paper's cosine share",
                                                *(f"detection {r:.2f}" for r in study.RATES)}  # fmt: skip
    report = study.render(summary)
    assert report.index("Verdicts, first analysis") < report.index("## Amendment") < report.index("Verdicts, amended")
