"""`openrlhf-geo study real-lm-geoalign`: GeoAlign's geometry on a real pretrained LM's hidden states (GeoAlign arXiv
2606.26917 §4, §5.3-5.4, Fig. 6, Fig. 9), no training. Protocol: docs/studies/real-lm-geoalign.md.

The rollouts are real-lm-geometry's T = 0.6 collection (`real_lm.collect`, shared cache): SmolLM2-135M-Instruct (a
4-bit quantization of the release) on 64 word problems x 16 samples, full responses (cap 256), last-token final
hidden states (d = 576). On 4 disjoint batches of 16 prompts x 16 rollouts (GeoAlign §5.1's math G = 16), for clean
rewards and for planted random flips (GeoAlign §5.3: 5 % and 10 % of each prompt's rollouts, 5 draws each):
`geoalign.curate` with the math preset (the projector trained fresh on the batch) -> the projector's validation
accuracy (§5.4, Fig. 9: median > 97 % on math), the share of pair directions with cosine > 0.8 to the prototype
(Fig. 6d: nearly 90 %) next to the same share of the raw directions (Fig. 6a-b), and, under flips, GDI's detection of
the flipped rollouts (AUROC, the KDE rule's precision and recall) against the reward-only score (how many pairs a
rollout is in) that beat GDI on the demo's tiny model.

The protocol's amendment (items 1-5) adds, beside every row above: the projector's accuracy and the cos > 0.8 share
on held-out prompts by cross-fitting (`crossfit`), the same on two nulls that keep the real rewards (hidden states
permuted within each prompt, `permuted_within_prompts`; Gaussian rows, `gaussian_like`), GDI's pooled AUROC beside
GDI's on the permuted null, precision and recall at the KDE rule's flag rate (`top_flags`), all with CIs from
resampling the prompts (`prompt_resamples`, `prompt_ci`), and the amended verdicts (`amended_verdicts`).
"""

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from openrlhf_geo.jsonl import nan_json, strict_json
from openrlhf_geo.lab.studies import real_lm
from openrlhf_geo.lab.studies.base import Study
from openrlhf_geo.lab.studies.real_lm_geometry import FULL, QUICK, interval

TEMPERATURE = 0.6  # real-lm-geometry's first collection (SALT Table 4's rollout temperature)
PROMPTS_PER_BATCH = {"full": 16, "quick": 2}
RATES = (0.05, 0.10)  # GeoAlign Table 3's flip rates (math)
DRAWS = 5  # flip draws per batch and rate
FLIP_SEED = 20262691  # generator per (FLIP_SEED, batch, rate, draw): never another study's stream
PROJECTOR_SEED = 0  # the projector's init and minibatches (a generator per call)
PAPER = {"val_acc_median": 0.97, "cos_gt_0.8": 0.90}
TINY_DEMO = {"gdi_auroc": 0.892, "pair_count_auroc": 0.920, "val_acc": 0.54, "cos_gt_0.8": 0.23}  # docs/results.md
METRICS = ("val_acc", "proj_train_acc", "cos_gt_0.8", "cos_gt_0.8_val", "cos_mean", "raw_cos_gt_0.8", "raw_cos_mean",
           "consensus", "raw_consensus", "pairs", "flag_frac", "precision", "recall", "auroc", "pair_count_auroc",
           "auroc_gain", "accuracy")  # fmt: skip
# The amendment (docs/studies/real-lm-geoalign.md, items 1-5)
CROSSFIT_SEED = 20261204  # item 1's fold permutation; the nulls, tie-breaks and prompt resamples use its sub-streams
STREAMS = {"folds": 0, "permuted": 1, "gaussian": 2, "ties": 3, "resamples": 4}
FOLDS = 4  # item 1: 4 folds of 4 prompts per batch of 16
RESAMPLES = 2000  # items 1-4: prompt resamples per CI
NULLS = ("permuted", "gaussian")  # item 2 (a) within-prompt permutation, (b) Gaussian rows
HIDDEN_KINDS = ("real", *NULLS)
HELD_OUT_VERDICTS = ("projector", "reward direction", "paper's cosine share")  # item 5's rules on held-out prompts
DETECTORS = ("kde_flagged", "pair_count_top", "gdi_top")  # item 4: the KDE rule, then the two matched to its count


def raw_spread(hidden, rewards, group_ids) -> dict:
    """GeoAlign Fig. 6(a-b) before the projector: unit displacement directions u_p = (h_w − h_l) / ‖h_w − h_l‖ of
    every within-prompt pair (Eq. 3), their margin-weighted prototype (Eq. 5 on u) and cosines to it."""
    from openrlhf_geo.geoalign import preference_pairs, prototype

    winner, loser = preference_pairs(rewards, group_ids)
    if winner.numel() == 0:
        return {"raw_cos_gt_0.8": math.nan, "raw_cos_mean": math.nan, "raw_consensus": math.nan}
    d = hidden[winner].double() - hidden[loser].double()
    keep = d.norm(dim=1) > 0
    u = torch.nn.functional.normalize(d[keep], dim=1)
    proto, consensus = prototype(u, (rewards[winner] - rewards[loser]).double()[keep])
    cos = u @ proto
    return {"raw_cos_gt_0.8": float((cos > 0.8).double().mean()), "raw_cos_mean": float(cos.mean()),
            "raw_consensus": consensus}  # fmt: skip


def pair_count(rewards, group_ids) -> np.ndarray:
    """The reward-only score: how many rollouts of the same prompt have another reward (= the rollout's pairs)."""
    r, g = rewards.numpy(), group_ids.numpy()
    return ((g[:, None] == g[None, :]) & (r[:, None] != r[None, :])).sum(1)


def analyse_batch(hidden, clean, group_ids, rate, generator, rollouts=False) -> dict:
    """One curate call on one batch, with `rate` of each prompt's rewards flipped (0: clean). `rollouts`: a flipped
    call's record also carries "rollouts", its per-rollout GDI (NaN: unscored), pair count and the indices of the
    corrupted and of the KDE-flagged rollouts."""
    from openrlhf_geo.geoalign import GeoAlignConfig, curate, detection_auroc
    from openrlhf_geo.rewards.noise import flip_binary

    if rate > 0:
        rewards, corrupted = flip_binary(clean, group_ids, rate, generator)
    else:
        rewards, corrupted = clean.clone(), None
    config = GeoAlignConfig.preset("math")
    plan, stats = curate(hidden, rewards, group_ids, config, torch.Generator().manual_seed(PROJECTOR_SEED),
                         corrupted=corrupted)  # fmt: skip
    record = {key: float(stats[key]) for key in ("val_acc", "proj_train_acc", "cos_gt_0.8", "cos_gt_0.8_val",
                                                   "cos_mean", "consensus", "pairs", "flag_frac")}  # fmt: skip
    record.update(raw_spread(hidden, rewards, group_ids))
    record["accuracy"] = float(clean.mean())
    record["skipped"] = stats["skipped_reason"]
    if corrupted is not None:
        gdi = plan.score.double().cpu().numpy()
        scored = np.isfinite(gdi)
        record.update(precision=float(stats["precision"]), recall=float(stats["recall"]), auroc=float(stats["auroc"]))
        count = pair_count(rewards, group_ids)
        record["pair_count_auroc"] = detection_auroc(count, corrupted.numpy(), scored)[0]
        record["auroc_gain"] = record["auroc"] - record["pair_count_auroc"]
        record["corrupted"] = int(corrupted.sum())
        if rollouts:
            record["rollouts"] = {"gdi": gdi.tolist(), "pair_count": count.tolist(),
                                  "corrupted": torch.nonzero(corrupted)[:, 0].tolist(),
                                  "kde_flagged": torch.nonzero(plan.flagged.cpu())[:, 0].tolist()}  # fmt: skip
    return record


def _rng(*key):
    """A numpy generator on the amendment's stream `key` (STREAMS' purpose first, then batch, rate, draw)."""
    return np.random.default_rng(np.random.SeedSequence([CROSSFIT_SEED, *key]))


def folds(prompts, n_folds, rng) -> list[torch.Tensor]:
    """Amendment item 1: the batch's prompt ids in a seeded random order, cut into n_folds folds (4 of 4 at 16)."""
    order = torch.as_tensor(np.asarray(prompts)[rng.permutation(len(prompts))])
    return list(torch.tensor_split(order, n_folds))


def permuted_within_prompts(hidden, group_ids, rng) -> torch.Tensor:
    """Amendment item 2 (a): each prompt's hidden rows in a seeded random order among its own rollouts (the prompt's
    cloud kept, the order of its rewards broken)."""
    out = hidden.clone()
    for prompt in torch.unique(group_ids):
        rows = torch.nonzero(group_ids == prompt)[:, 0]
        out[rows] = hidden[rows[torch.as_tensor(rng.permutation(len(rows)))]]
    return out


def gaussian_like(hidden, rng) -> torch.Tensor:
    """Amendment item 2 (b): Gaussian rows with the batch's per-coordinate mean and sd (ddof 0), the audit's null."""
    h = hidden.double().numpy()
    return torch.from_numpy(rng.normal(h.mean(0), h.std(0), size=h.shape)).to(hidden.dtype)


def crossfit(hidden, rewards, group_ids, held_out) -> list[dict]:
    """Amendment item 1, GeoAlign §4.2-4.3 on held-out prompts: for each fold of `held_out` (prompt-id tensors), the
    projector trained as `curate` trains it (Eq. 4; preset "math", fresh, seeded PROJECTOR_SEED, its own App. C.1
    early-stop split of 10 % of the training prompts) on the other folds' pairs, the margin-weighted prototype (Eq. 5)
    of those training pairs' projected directions; then per held-out prompt -> {"prompt", "fold", "pairs" (with a
    direction), "val_acc" (the probe's orientation accuracy on the prompt's pairs, curate's val_acc), "cos_gt_0.8"
    (share of the prompt's projected directions with cosine > 0.8 to that prototype, Eq. 6), the fold's
    "proj_steps" and "train_consensus"}; NaN metrics for a prompt without pairs or a fold without training pairs."""
    from openrlhf_geo import geoalign as ga
    from openrlhf_geo.geoalign import pairs, plan, scores

    config = ga.GeoAlignConfig.preset("math")
    r = rewards.double()
    h = (hidden * pairs._pow2_scale(hidden)).float()  # curate's exact power-of-two rescale
    winner, loser, dist, _ = plan._directed_pairs(h, r, group_ids, config.max_pairs_per_side, None)
    pair_prompt = group_ids[winner]
    records = []
    for f, fold in enumerate(held_out):
        held = torch.isin(pair_prompt, fold)
        train = torch.nonzero(~held)[:, 0]
        fit = {"proj_steps": math.nan, "train_consensus": math.nan}
        if len(train):
            # curate's Eq. 4 on the training pairs, the generator drawn in curate's order: split, init, training
            generator = torch.Generator().manual_seed(PROJECTOR_SEED)
            tw, tl, td = winner[train], loser[train], dist[train]
            val_mask = plan._held_out_pairs(pair_prompt[train], torch.unique(pair_prompt[train]), config.val_frac,
                                          generator)  # fmt: skip
            projector = plan._ready_projector(None, h.shape[1], config, generator)
            probe, steps = pairs.fit_projector(projector, h, tw, tl, td, config, generator, val_mask=val_mask)
            with torch.no_grad():
                out = projector.pair_forward(*pairs._compact(h, winner, loser, dist, torch.ones_like(held)))
                s_pos, s_neg = out @ probe
            v = F.normalize(out[0].double(), dim=1)
            v_proto, consensus = scores.prototype(v[train], plan._pair_margins(r, tw, tl), config.prototype)
            cos = 1 - scores.deviation(v, v_proto)
            fit = {"proj_steps": float(steps), "train_consensus": consensus}
        for prompt in fold.tolist():
            mine = pair_prompt == prompt
            rec = {"prompt": prompt, "fold": f, "pairs": int(mine.sum()), "val_acc": math.nan, "cos_gt_0.8": math.nan}
            if len(train) and mine.any():
                rec["val_acc"] = pairs._orientation_acc(s_pos[mine], s_neg[mine])
                rec["cos_gt_0.8"] = float((cos[mine] > 0.8).double().mean())
            records.append({**rec, **fit})
    return records


def top_flags(score, scored, n, key) -> np.ndarray:
    """Amendment item 4: (N,) bool, the n `scored` rollouts with the largest `score` (a detector matched to the KDE
    rule's flag count n), ties broken by the smaller `key` (N,) (seeded uniform draws: a random order)."""
    order = np.lexsort((key, np.where(scored, -np.asarray(score, dtype=float), np.inf)))
    flags = np.zeros(len(score), dtype=bool)
    flags[order[: min(n, int(scored.sum()))]] = True
    return flags


def batches(prompts, samples, per_batch):
    return [np.arange(b * per_batch * samples, (b + 1) * per_batch * samples) for b in range(prompts // per_batch)]


def analyse(data, per_batch, draws, progress=None) -> list[dict]:
    """Every call's record: the first analysis's (one per curate call, no "analysis" key), then the amendment's
    ("analysis": "held_out" per (hidden kind, prompt), "null_flip" per curate call on a null, "rollouts" per
    flipped call: per-rollout GDI on the real and null hidden states, pair counts, and each detector's flags).
    `progress(1)` after each batch."""
    collection = data["collection"]
    cap = collection["caps"][-1]
    hidden, rewards = data["geometry"][cap]["hidden"], data["rewards"][cap]
    samples = collection["samples"]
    records, amended = [], []
    for b, rows in enumerate(batches(collection["prompts"], samples, per_batch)):
        idx = torch.as_tensor(rows)
        group_ids = idx // samples
        h, clean = hidden[idx], rewards[idx]
        records.append({"batch": b, "rate": 0.0, "draw": 0, **analyse_batch(h, clean, group_ids, 0.0, None)})
        hiddens = {"real": h, "permuted": permuted_within_prompts(h, group_ids, _rng(STREAMS["permuted"], b)),
                   "gaussian": gaussian_like(h, _rng(STREAMS["gaussian"], b))}  # fmt: skip
        prompts = torch.unique(group_ids)
        held_out = folds(prompts, min(FOLDS, len(prompts)), _rng(STREAMS["folds"], b))
        for kind, hk in hiddens.items():
            amended += [{"analysis": "held_out", "hidden": kind, "batch": b, **rec}
                        for rec in crossfit(hk, clean, group_ids, held_out)]  # fmt: skip
        for r, rate in enumerate(RATES):
            for draw in range(draws):
                state = int(np.random.SeedSequence([FLIP_SEED, b, r, draw]).generate_state(1)[0])
                rec = analyse_batch(h, clean, group_ids, rate, torch.Generator().manual_seed(state), rollouts=True)
                detail = rec.pop("rollouts")
                records.append({"batch": b, "rate": rate, "draw": draw, **rec})
                for kind in NULLS:  # the same flips (the same generator), on the null's hidden states
                    null = analyse_batch(hiddens[kind], clean, group_ids, rate, torch.Generator().manual_seed(state),
                                         rollouts=True)  # fmt: skip
                    detail[f"gdi_{kind}"] = null.pop("rollouts")["gdi"]
                    amended.append({"analysis": "null_flip", "hidden": kind, "batch": b, "rate": rate, "draw": draw,
                                    **null})  # fmt: skip
                gdi, n_f = np.asarray(detail["gdi"], dtype=float), len(detail["kde_flagged"])
                key = _rng(STREAMS["ties"], b, r, draw).random(len(gdi))  # one tie order per call, both rankings
                for name, score in (("pair_count_top", detail["pair_count"]), ("gdi_top", gdi)):
                    detail[name] = np.nonzero(top_flags(score, np.isfinite(gdi), n_f, key))[0].tolist()
                amended.append({"analysis": "rollouts", "batch": b, "rate": rate, "draw": draw, **detail})
        if progress is not None:
            progress(1)
    return records + amended


def prompt_resamples(n_prompts, n) -> np.ndarray:
    """Amendment items 1-4: (n, n_prompts) int, how often each prompt is drawn in each of n seeded resamples of the
    prompts with replacement."""
    draws = _rng(STREAMS["resamples"]).integers(0, n_prompts, size=(n, n_prompts))
    counts = np.zeros((n, n_prompts), dtype=np.int64)
    np.add.at(counts, (np.arange(n)[:, None], draws), 1)
    return counts


def prompt_ci(statistic, counts) -> dict:
    """Amendment items 1-4: statistic(w) of prompt weights w (P,) (prompt p's pairs or rollouts counted w_p times)
    at w = 1, with the 95 % percentile CI over the prompt resamples `counts` (B, P) (a drawn prompt brings all its
    pairs or rollouts) -> {"mean", "low", "high", "n" (prompts)}; resamples where it is undefined are left out."""
    boots = np.array([statistic(c) for c in counts], dtype=float)
    boots = boots[np.isfinite(boots)]
    low, high = np.percentile(boots, (2.5, 97.5)) if boots.size else (math.nan, math.nan)
    return {"mean": float(statistic(np.ones(counts.shape[1]))), "low": float(low), "high": float(high),
            "n": int(counts.shape[1])}  # fmt: skip


def _minus(f, g):
    """The statistic w -> f(w) − g(w): a difference whose CI resamples the prompts once for both (paired by prompt)."""
    return lambda w: f(w) - g(w)


def _ratio(num, den):
    return float(num / den) if den > 0 else math.nan


def weighted_auroc(score, bad, prompt):
    """Amendment item 3: w -> AUROC of `score` for the `bad` items (Mann-Whitney U / (n+ n-), ties 1/2, as
    `geoalign.detection_auroc`), each item counted w[prompt] times; NaN without both classes."""
    values, inverse = np.unique(score, return_inverse=True)
    bad = np.asarray(bad, dtype=bool)

    def auroc(w):
        weight = np.asarray(w, dtype=float)[prompt]
        pos = np.bincount(inverse, weight * bad, len(values))
        neg = np.bincount(inverse, weight * ~bad, len(values))
        return _ratio(pos @ (np.cumsum(neg) - neg / 2), pos.sum() * neg.sum())

    return auroc


def pair_weighted(rows, metric, n_prompts):
    """Amendment item 1: w -> the pair-weighted mean sum_p w_p n_p m_p / sum_p w_p n_p of the held-out prompts'
    `metric` m_p (n_p pairs; prompts where it is undefined left out)."""
    num, den = np.zeros(n_prompts), np.zeros(n_prompts)
    for row in rows:
        if math.isfinite(row[metric]):
            num[row["prompt"]] += row["pairs"] * row[metric]
            den[row["prompt"]] += row["pairs"]
    return lambda w: _ratio(w @ num, w @ den)


def _pooled_rollouts(rows, setup):
    """The flipped calls' per-rollout arrays concatenated (item 3-4's pooling), with each rollout's prompt id."""
    per_batch, samples = setup["prompts_per_batch"], setup["samples"]
    out = {}
    for row in rows:
        n = len(row["gdi"])
        bad = np.zeros(n, dtype=bool)
        bad[row["corrupted"]] = True
        parts = {"prompt": row["batch"] * per_batch + np.arange(n) // samples, "bad": bad,
                 "pair_count": np.asarray(row["pair_count"], dtype=float)}  # fmt: skip
        parts.update({f"gdi{s}": np.asarray(row[f"gdi{s}"], dtype=float) for s in ("", "_permuted", "_gaussian")})
        for name in ("kde_flagged", "pair_count_top", "gdi_top"):
            parts[name] = np.zeros(n, dtype=bool)
            parts[name][row[name]] = True
        for name, value in parts.items():
            out.setdefault(name, []).append(value)
    return {name: np.concatenate(parts) for name, parts in out.items()}


def summarize_amendment(records, setup) -> dict:
    """Amendment items 1-4 from the records: held-out metrics per hidden kind and their gaps over the nulls (paired
    by prompt), and per flip rate the pooled AUROCs and the matched-rate precision and recall, all with prompt CIs."""
    n_prompts = setup["prompts_per_batch"] * setup["batches"]
    counts = prompt_resamples(n_prompts, RESAMPLES)
    held = [r for r in records if r.get("analysis") == "held_out"]
    means = {(kind, metric): pair_weighted([r for r in held if r["hidden"] == kind], metric, n_prompts)
             for kind in HIDDEN_KINDS for metric in ("val_acc", "cos_gt_0.8")}  # fmt: skip
    out = {"prompts": n_prompts, "folds": len({r["fold"] for r in held}), "resamples": RESAMPLES, "held_out": {},
           "held_out_gap": {}, "detection": {}, "matched_rate": {}}  # fmt: skip
    for kind in HIDDEN_KINDS:
        rows = [r for r in held if r["hidden"] == kind and math.isfinite(r["val_acc"])]
        out["held_out"][kind] = {m: prompt_ci(means[kind, m], counts) for m in ("val_acc", "cos_gt_0.8")}
        out["held_out"][kind].update(pairs=sum(r["pairs"] for r in rows), prompts=len(rows))
    for null in NULLS:
        out["held_out_gap"][null] = {m: prompt_ci(_minus(means["real", m], means[null, m]), counts)
                                     for m in ("val_acc", "cos_gt_0.8")}  # fmt: skip
    for rate in RATES:
        rows = [r for r in records if r.get("analysis") == "rollouts" and r["rate"] == rate]
        if rows:
            pool = _pooled_rollouts(rows, setup)
            out["detection"][f"{rate:.2f}"] = detection_summary(pool, counts)
            out["matched_rate"][f"{rate:.2f}"] = matched_rate_summary(pool, counts)
    return out


def detection_summary(pool, counts) -> dict:
    """Amendment item 3 on one flip rate's pooled rollouts: AUROC of GDI, of GDI on each null and of the reward-only
    pair count (over the rollouts GDI scores), and the differences GDI − reward-only and GDI − GDI on null (a)."""
    prompt, bad, scored = pool["prompt"], pool["bad"], np.isfinite(pool["gdi"])
    auroc = {"pair_count": weighted_auroc(pool["pair_count"][scored], bad[scored], prompt[scored])}
    for name in ("gdi", "gdi_permuted", "gdi_gaussian"):
        own = np.isfinite(pool[name])  # a null's GDI scores the rollouts that have a pair there
        auroc[name] = weighted_auroc(pool[name][own], bad[own], prompt[own])
    entry = {name: prompt_ci(f, counts) for name, f in auroc.items()}
    entry["gdi_minus_pair_count"] = prompt_ci(_minus(auroc["gdi"], auroc["pair_count"]), counts)
    entry["gdi_minus_permuted"] = prompt_ci(_minus(auroc["gdi"], auroc["gdi_permuted"]), counts)
    entry.update(corrupted_scored=int((bad & scored).sum()), clean_scored=int((~bad & scored).sum()))
    return entry


def matched_rate_summary(pool, counts) -> dict:
    """Amendment item 4 on one flip rate's pooled rollouts: precision (hits / flagged) and recall (hits / corrupted)
    of the KDE rule, the reward-only top-n_f and GDI's top-n_f, and each one's difference from the KDE rule."""
    n_prompts = counts.shape[1]
    bad = pool["bad"]
    per_prompt = {name: np.bincount(pool["prompt"], weights=x, minlength=n_prompts)
                  for name, x in (("corrupted", bad), *((n, pool[n]) for n in DETECTORS),
                                  *((f"{n}_hits", pool[n] & bad) for n in DETECTORS))}  # fmt: skip

    def precision(name):
        return lambda w: _ratio(w @ per_prompt[f"{name}_hits"], w @ per_prompt[name])

    def recall(name):
        return lambda w: _ratio(w @ per_prompt[f"{name}_hits"], w @ per_prompt["corrupted"])

    out = {"flagged": int(pool["kde_flagged"].sum()), "corrupted": int(bad.sum())}
    for name in DETECTORS:
        out[name] = {"precision": prompt_ci(precision(name), counts), "recall": prompt_ci(recall(name), counts)}
    for name in DETECTORS[1:]:
        out[f"{name}_minus_kde"] = {measure.__name__: prompt_ci(_minus(measure(name), measure("kde_flagged")), counts)
                                    for measure in (precision, recall)}  # fmt: skip
    return out


def _above(row, level=0.0):
    return math.isfinite(row["low"]) and row["low"] > level


def amended_verdicts(amendment) -> dict:
    """Amendment item 5's rules, applied mechanically to `summarize_amendment`'s output."""
    acc = amendment["held_out"]["real"]["val_acc"]
    permuted, gaussian = amendment["held_out_gap"]["permuted"], amendment["held_out_gap"]["gaussian"]
    if not (math.isfinite(acc["low"]) and math.isfinite(acc["high"])):
        verdicts = dict.fromkeys(HELD_OUT_VERDICTS, "no verdict (no held-out pairs)")
    else:
        if acc["low"] > PAPER["val_acc_median"]:
            projector = "reproduced (the held-out accuracy's CI lies above 0.97)"
        elif acc["high"] < PAPER["val_acc_median"]:
            projector = "not reproduced (the held-out accuracy's CI lies below 0.97)"
        else:
            projector = "not decided (the held-out accuracy's CI contains 0.97)"
        missing = [name for m, name in (("val_acc", "held-out accuracy"), ("cos_gt_0.8", "held-out cos > 0.8 share"))
                   if not _above(permuted[m])]  # fmt: skip
        below = [name for name, gap in (("null (a)", permuted), ("null (b)", gaussian))
                 if not _above(gap["cos_gt_0.8"])]  # fmt: skip
        direction = (
            "stated: the hidden states carry a reward-ordered direction that the projector makes explicit "
            "(held-out accuracy and cos > 0.8 share both above null (a), CIs of the gaps above 0)"
            if not missing
            else f"not stated (the gap over null (a) has no CI above 0 for: {', '.join(missing)})"
        )
        cosine = (
            "matches: the held-out cos > 0.8 share exceeds both nulls (CIs of the gaps above 0)"
            if not below
            else f"not stated (the held-out cos > 0.8 share's gap has no CI above 0 over: {', '.join(below)})"
        )
        verdicts = dict(zip(HELD_OUT_VERDICTS, (projector, direction, cosine)))
    for rate, entry in amendment["detection"].items():
        gain = entry["gdi_minus_pair_count"]
        if not (math.isfinite(gain["low"]) and math.isfinite(gain["high"])):
            verdicts[f"detection {rate}"] = "no verdict (no CI of the pooled AUROC difference)"
        elif gain["low"] > 0:
            verdicts[f"detection {rate}"] = "GDI detects the flips better than the reward-only score"
        elif gain["high"] < 0:
            verdicts[f"detection {rate}"] = "the reward-only score detects the flips better than GDI"
        else:
            verdicts[f"detection {rate}"] = "not decided (the prompt CI of the pooled AUROC difference contains 0)"
    return verdicts


def summarize(records, setup) -> dict:
    first = [r for r in records if "analysis" not in r]  # the first analysis's records, one per curate call
    table = {}
    for rate in (0.0, *RATES):
        rows = [r for r in first if r["rate"] == rate]
        per_batch = {}
        for r in rows:
            per_batch.setdefault(r["batch"], []).append(r)
        entry = {}
        for metric in METRICS:
            # the batches are the independent units: a batch's draws are averaged first (over those where the metric
            # is defined, e.g. precision needs a flagged rollout)
            values = [[v for r in rs if math.isfinite(v := r.get(metric, math.nan))] for rs in per_batch.values()]
            entry[metric] = interval([float(np.mean(v)) for v in values if v])
        val = [r["val_acc"] for r in rows if math.isfinite(r["val_acc"])]
        entry["val_acc_median"] = float(np.median(val)) if val else math.nan
        entry["calls"] = len(rows)
        entry["skipped"] = sum(bool(r["skipped"]) for r in rows)
        table[f"{rate:.2f}"] = entry
    clean = table["0.00"]
    median = clean["val_acc_median"]
    verdicts = {
        "projector": "no verdict (no held-out pairs)"
        if not math.isfinite(median)
        else "reproduced (median validation accuracy above 0.97)"
        if median > PAPER["val_acc_median"]
        else "not reproduced (median validation accuracy at or below 0.97)",
    }
    for rate in RATES:
        gain = table[f"{rate:.2f}"]["auroc_gain"]
        if gain["n"] < 2:
            verdicts[f"detection {rate:.2f}"] = "no verdict (fewer than two batches)"
        elif gain["low"] > 0:
            verdicts[f"detection {rate:.2f}"] = "GDI detects the flips better than the reward-only score"
        elif gain["high"] < 0:
            verdicts[f"detection {rate:.2f}"] = "the reward-only score detects the flips better than GDI"
        else:
            verdicts[f"detection {rate:.2f}"] = "not decided (the CI of the AUROC difference contains 0)"
    amendment = summarize_amendment(records, setup)
    return {"study": "real-lm-geoalign", "setup": setup, "table": table, "verdicts": verdicts, "paper": PAPER,
            "tiny_demo": TINY_DEMO, "amendment": amendment,
            "amended_verdicts": amended_verdicts(amendment)}  # fmt: skip


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row):
    if row["n"] < 2 or row["low"] is None or not math.isfinite(row["low"]):  # None: NaN in the written summary
        return _f(row["mean"])
    return f"{_f(row['mean'])} [{_f(row['low'])}, {_f(row['high'])}]"


def render(summary) -> str:
    setup = summary["setup"]
    lines = [
        "# GeoAlign's geometry on a real pretrained LM's hidden states (`openrlhf-geo study real-lm-geoalign`)",
        "",
        f"Model: {setup['model']}: a 4-bit quantization of the release, not the release. Rollouts: real-lm-geometry's "
        f"T = {setup['temperature']} collection (seed {setup['seed']}), full responses (cap {setup['cap']}), "
        f"{setup['batches']} disjoint batches of {setup['prompts_per_batch']} prompts x {setup['samples']}; "
        "`geoalign.curate`, math preset, a fresh projector per call. Protocol: docs/studies/real-lm-geoalign.md. "
        f"Wall time {setup['wall_s'] / 60:.1f} min (estimate {setup['estimate_s'] / 60:.0f} min).",
        "",
        "Mean over batches [95 % percentile-bootstrap CI] (a batch's flip draws averaged first); flip rate 0: clean "
        "rewards.",
        "",
        "| flip rate | projector val. acc. (median) | val. acc. | cos > 0.8, projected | cos > 0.8, projected, "
        "curate's held-out pairs | cos > 0.8, raw | consensus projected / raw | GDI AUROC | reward-only AUROC | "
        "GDI − reward-only | precision | recall | flagged | accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, row in summary["table"].items():
        lines.append(
            f"| {rate} | {_f(row['val_acc_median'])} | {_ci(row['val_acc'])} | {_ci(row['cos_gt_0.8'])} | "
            f"{_ci(row['cos_gt_0.8_val'])} | {_ci(row['raw_cos_gt_0.8'])} | {_f(row['consensus']['mean'])} / "
            f"{_f(row['raw_consensus']['mean'])} | {_ci(row['auroc'])} | {_ci(row['pair_count_auroc'])} | "
            f"{_ci(row['auroc_gain'])} | {_ci(row['precision'])} | {_ci(row['recall'])} | {_ci(row['flag_frac'])} | "
            f"{_ci(row['accuracy'])} |"
        )
    lines += ["", "## Verdicts, first analysis (the protocol's original rules)", ""]
    lines += [f"- {name}: **{text}**" for name, text in summary["verdicts"].items()]
    tiny = summary["tiny_demo"]
    lines += ["", f"GeoAlign's paper: projector validation accuracy median > {summary['paper']['val_acc_median']} on "
              f"math (Fig. 9), nearly {summary['paper']['cos_gt_0.8']:.0%} of projected directions with cosine > 0.8 "
              f"(Fig. 6d). The demo's tiny model (10 % flips, pooled over training): GDI AUROC {tiny['gdi_auroc']}, "
              f"reward-only {tiny['pair_count_auroc']}, validation accuracy {tiny['val_acc']}, cos > 0.8 "
              f"{tiny['cos_gt_0.8']}."]  # fmt: skip
    lines += render_amendment(summary["amendment"], summary["amended_verdicts"])
    return "\n".join(lines) + "\n"


def render_amendment(amendment, verdicts) -> list[str]:
    """The report's section for the protocol's amendment (items 1-5)."""
    kinds = {"real": "real", "permuted": "null (a): permuted within each prompt",
             "gaussian": "null (b): Gaussian, the batch's mean and sd"}  # fmt: skip
    lines = ["", "## Amendment (docs/studies/real-lm-geoalign.md, items 1-5)", "",
             f"Every CI: 95 % percentile over {amendment['resamples']} resamples of the {amendment['prompts']} "
             "prompts (a drawn prompt brings all its pairs or rollouts, in every flip draw).", "",
             f"Item 1-2, held out by prompt (cross-fitting: {amendment['folds']} folds per batch, the projector "
             "trained as curate trains it on the other folds' pairs, their prototype); pair-weighted means over the "
             "held-out prompts:", "",
             "| hidden states | prompts with pairs | held-out pairs | orientation accuracy | cos > 0.8 share |",
             "|---|---|---|---|---|"]  # fmt: skip
    for kind, row in amendment["held_out"].items():
        lines.append(f"| {kinds[kind]} | {row['prompts']} | {row['pairs']} | {_ci(row['val_acc'])} | "
                     f"{_ci(row['cos_gt_0.8'])} |")  # fmt: skip
    for null, gap in amendment["held_out_gap"].items():
        lines.append(f"| real − {kinds[null].split(':')[0]} (paired by prompt) | | | {_ci(gap['val_acc'])} | "
                     f"{_ci(gap['cos_gt_0.8'])} |")  # fmt: skip
    lines += ["", "Item 3, detection of the flipped rollouts (AUROC, every call of a rate pooled; scored rollouts):",
              "",
              "| flip rate | corrupted / clean scored | GDI | GDI, null (a) | GDI, null (b) | reward-only | "
              "GDI − reward-only | GDI − GDI null (a) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rate, row in amendment["detection"].items():
        lines.append(f"| {rate} | {row['corrupted_scored']} / {row['clean_scored']} | {_ci(row['gdi'])} | "
                     f"{_ci(row['gdi_permuted'])} | {_ci(row['gdi_gaussian'])} | {_ci(row['pair_count'])} | "
                     f"{_ci(row['gdi_minus_pair_count'])} | {_ci(row['gdi_minus_permuted'])} |")  # fmt: skip
    lines += ["", "Item 4, precision / recall at the KDE rule's flag count per call (pooled over calls):", "",
              "| flip rate | flagged / corrupted | KDE rule | reward-only top-n_f | GDI top-n_f | reward-only − KDE | "
              "GDI top − KDE |", "|---|---|---|---|---|---|---|"]  # fmt: skip

    def pr(row):
        return f"{_ci(row['precision'])} / {_ci(row['recall'])}"

    for rate, row in amendment["matched_rate"].items():
        lines.append(f"| {rate} | {row['flagged']} / {row['corrupted']} | {pr(row['kde_flagged'])} | "
                     f"{pr(row['pair_count_top'])} | {pr(row['gdi_top'])} | {pr(row['pair_count_top_minus_kde'])} | "
                     f"{pr(row['gdi_top_minus_kde'])} |")  # fmt: skip
    lines += ["", "## Verdicts, amended (item 5; they replace the first analysis's)", ""]
    lines += [f"- {name}: **{text}**" for name, text in verdicts.items()]
    return lines


def run(args, out, workers, cache=None):
    sizes = QUICK if args.quick else FULL
    per_batch = PROMPTS_PER_BATCH["quick" if args.quick else "full"]
    draws = 2 if args.quick else DRAWS
    collection = real_lm.Collection(prompts=sizes["prompts"], samples=sizes["samples"], temperature=TEMPERATURE,
                                    max_tokens=sizes["max_tokens"], caps=sizes["caps"], seed=args.seeds[0],
                                    generator=args.generator or "vllm")  # fmt: skip
    n_batches = sizes["prompts"] // per_batch
    calls = n_batches * (1 + len(RATES) * draws * (1 + len(NULLS)))  # the first analysis's, and item 2's on the nulls
    fits = n_batches * len(HIDDEN_KINDS) * min(FOLDS, per_batch)  # item 1's cross-fitted projectors
    from openrlhf_geo.lab.studies.real_lm_geometry import estimate_seconds

    estimate = estimate_seconds(sizes, (TEMPERATURE,), {TEMPERATURE} if real_lm.cached(collection, cache) else set())
    # one curate call at 256 rollouts, d = 576: 3.5 s measured on Gaussian data of that size (no early stop) on the
    # shared 2-core VM, one thread; a fold's projector trains on 3/4 of the pairs (half a call measured); the
    # prompt-resampling CIs, ~5 s at full size
    estimate += calls * 3.5 + fits * 1.75 + 5
    print(f"study real-lm-geoalign: {calls} curate calls, {fits} cross-fitted projectors; about "
          f"{estimate / 60:.0f} min (docs/studies/real-lm-geoalign.md)")  # fmt: skip
    start = time.perf_counter()
    data = real_lm.collect(collection, cache)
    real_lm.write_rollouts(data, out)
    records = analyse(data, per_batch, draws)
    setup = {"model": real_lm.MODEL_NAME, "temperature": TEMPERATURE, "seed": args.seeds[0], "cap": sizes["caps"][-1],
             "samples": sizes["samples"], "prompts_per_batch": per_batch, "batches": n_batches,
             "rates": list(RATES), "draws": draws, "folds": min(FOLDS, per_batch), "resamples": RESAMPLES,
             "crossfit_seed": CROSSFIT_SEED, "estimate_s": estimate, "collection": data["key"]}  # fmt: skip
    summary = summarize(records, setup)
    summary["setup"]["wall_s"] = time.perf_counter() - start  # the collection, every call and the CIs
    summary = strict_json(summary)
    (Path(out) / "records.json").write_text(json.dumps(strict_json(records), indent=1) + "\n")
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(summary))
    print(f"study real-lm-geoalign finished: {Path(out) / 'report.md'}")
    return 0


def resummarize(directory) -> int:
    """DIR's summary.json and report.md re-derived by the current code from its records.json (no model, no
    collection), with the setup the run recorded in its summary.json."""
    with real_lm.rewriting(directory) as directory:
        records = nan_json(real_lm.read_result(directory, "records.json"))
        old = real_lm.read_result(directory, "summary.json")
        try:  # both derived before either is written
            summary = strict_json(summarize(records, old["setup"]))
            report = render(summary)
        except (KeyError, TypeError, IndexError, ValueError) as error:
            raise ValueError(f"--resummarize {directory}: not a real-lm-geoalign result of the amended analysis "
                             f"({type(error).__name__}: {error})") from None  # fmt: skip
        (directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (directory / "report.md").write_text(report)
    print(f"study real-lm-geoalign: re-derived {directory / 'summary.json'} and {directory / 'report.md'} from "
          f"{len(records)} records")  # fmt: skip
    return 0


class RealLmGeoAlign(Study):
    name = "real-lm-geoalign"
    options = ("generator", "resummarize")
    seed = 0  # the rollouts' sampling seed (real-lm-geometry's collection at that seed)

    def run(self, args, out, workers):
        return run(args, out, workers)

    def resummarize(self, directory):
        return resummarize(directory)


STUDY = RealLmGeoAlign()
