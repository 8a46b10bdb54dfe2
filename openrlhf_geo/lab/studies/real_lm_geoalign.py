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
"""

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from openrlhf_geo.jsonl import strict_json
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
METRICS = ("val_acc", "proj_train_acc", "cos_gt_0.8", "cos_mean", "raw_cos_gt_0.8", "raw_cos_mean", "consensus",
           "raw_consensus", "pairs", "flag_frac", "precision", "recall", "auroc", "pair_count_auroc", "auroc_gain",
           "accuracy")  # fmt: skip


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


def analyse_batch(hidden, clean, group_ids, rate, generator) -> dict:
    """One curate call on one batch, with `rate` of each prompt's rewards flipped (0: clean)."""
    from openrlhf_geo.geoalign import GeoAlignConfig, curate, detection_auroc
    from openrlhf_geo.rewards.noise import flip_binary

    if rate > 0:
        rewards, corrupted = flip_binary(clean, group_ids, rate, generator)
    else:
        rewards, corrupted = clean.clone(), None
    config = GeoAlignConfig.preset("math")
    plan, stats = curate(hidden, rewards, group_ids, config, torch.Generator().manual_seed(PROJECTOR_SEED),
                         corrupted=corrupted)  # fmt: skip
    record = {key: float(stats[key]) for key in ("val_acc", "proj_train_acc", "cos_gt_0.8", "cos_mean", "consensus",
                                                   "pairs", "flag_frac")}  # fmt: skip
    record.update(raw_spread(hidden, rewards, group_ids))
    record["accuracy"] = float(clean.mean())
    record["skipped"] = stats["skipped_reason"]
    if corrupted is not None:
        gdi = plan.gdi.double().cpu().numpy()
        scored = np.isfinite(gdi)
        record.update(precision=float(stats["precision"]), recall=float(stats["recall"]), auroc=float(stats["auroc"]))
        record["pair_count_auroc"] = detection_auroc(pair_count(rewards, group_ids), corrupted.numpy(), scored)[0]
        record["auroc_gain"] = record["auroc"] - record["pair_count_auroc"]
        record["corrupted"] = int(corrupted.sum())
    return record


def batches(prompts, samples, per_batch):
    return [np.arange(b * per_batch * samples, (b + 1) * per_batch * samples) for b in range(prompts // per_batch)]


def analyse(data, per_batch, draws) -> list[dict]:
    collection = data["collection"]
    cap = collection["caps"][-1]
    hidden, rewards = data["geometry"][cap]["hidden"], data["rewards"][cap]
    samples = collection["samples"]
    records = []
    for b, rows in enumerate(batches(collection["prompts"], samples, per_batch)):
        idx = torch.as_tensor(rows)
        group_ids = idx // samples
        records.append({"batch": b, "rate": 0.0, "draw": 0,
                        **analyse_batch(hidden[idx], rewards[idx], group_ids, 0.0, None)})  # fmt: skip
        for r, rate in enumerate(RATES):
            for draw in range(draws):
                state = np.random.SeedSequence([FLIP_SEED, b, r, draw]).generate_state(1)[0]
                generator = torch.Generator().manual_seed(int(state))
                rec = analyse_batch(hidden[idx], rewards[idx], group_ids, rate, generator)
                records.append({"batch": b, "rate": rate, "draw": draw, **rec})
    return records


def summarize(records, setup) -> dict:
    table = {}
    for rate in (0.0, *RATES):
        rows = [r for r in records if r["rate"] == rate]
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
    return {"study": "real-lm-geoalign", "setup": setup, "table": table, "verdicts": verdicts, "paper": PAPER,
            "tiny_demo": TINY_DEMO}  # fmt: skip


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row):
    if row["n"] < 2 or not math.isfinite(row["low"]):
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
        "| flip rate | projector val. acc. (median) | val. acc. | cos > 0.8, projected | cos > 0.8, raw | "
        "consensus projected / raw | GDI AUROC | reward-only AUROC | GDI − reward-only | precision | recall | "
        "flagged | accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, row in summary["table"].items():
        lines.append(
            f"| {rate} | {_f(row['val_acc_median'])} | {_ci(row['val_acc'])} | {_ci(row['cos_gt_0.8'])} | "
            f"{_ci(row['raw_cos_gt_0.8'])} | {_f(row['consensus']['mean'])} / {_f(row['raw_consensus']['mean'])} | "
            f"{_ci(row['auroc'])} | {_ci(row['pair_count_auroc'])} | {_ci(row['auroc_gain'])} | "
            f"{_ci(row['precision'])} | {_ci(row['recall'])} | {_ci(row['flag_frac'])} | {_ci(row['accuracy'])} |"
        )
    lines += ["", "## Verdicts (the protocol's rules)", ""]
    lines += [f"- {name}: **{text}**" for name, text in summary["verdicts"].items()]
    tiny = summary["tiny_demo"]
    lines += ["", f"GeoAlign's paper: projector validation accuracy median > {summary['paper']['val_acc_median']} on "
              f"math (Fig. 9), nearly {summary['paper']['cos_gt_0.8']:.0%} of projected directions with cosine > 0.8 "
              f"(Fig. 6d). The demo's tiny model (10 % flips, pooled over training): GDI AUROC {tiny['gdi_auroc']}, "
              f"reward-only {tiny['pair_count_auroc']}, validation accuracy {tiny['val_acc']}, cos > 0.8 "
              f"{tiny['cos_gt_0.8']}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def run(args, out, workers, cache=None):
    sizes = QUICK if args.quick else FULL
    per_batch = PROMPTS_PER_BATCH["quick" if args.quick else "full"]
    draws = 2 if args.quick else DRAWS
    collection = real_lm.Collection(prompts=sizes["prompts"], samples=sizes["samples"], temperature=TEMPERATURE,
                                    max_tokens=sizes["max_tokens"], caps=sizes["caps"], seed=args.seeds[0],
                                    generator=args.generator or "vllm")  # fmt: skip
    calls = (sizes["prompts"] // per_batch) * (1 + len(RATES) * draws)
    from openrlhf_geo.lab.studies.real_lm_geometry import estimate_seconds

    estimate = estimate_seconds(sizes, (TEMPERATURE,), {TEMPERATURE} if real_lm.cached(collection, cache) else set())
    estimate += calls * 3.0  # one curate call at 256 rollouts, d = 576 (measured ~1-3 s)
    print(f"study real-lm-geoalign: {calls} curate calls; about {estimate / 60:.0f} min "
          "(docs/studies/real-lm-geoalign.md)")  # fmt: skip
    start = time.perf_counter()
    data = real_lm.collect(collection, cache)
    records = analyse(data, per_batch, draws)
    setup = {"model": real_lm.MODEL_NAME, "temperature": TEMPERATURE, "seed": args.seeds[0], "cap": sizes["caps"][-1],
             "samples": sizes["samples"], "prompts_per_batch": per_batch,
             "batches": sizes["prompts"] // per_batch, "rates": list(RATES), "draws": draws,
             "wall_s": time.perf_counter() - start, "estimate_s": estimate, "collection": data["key"]}  # fmt: skip
    summary = strict_json(summarize(records, setup))
    (Path(out) / "records.json").write_text(json.dumps(strict_json(records), indent=1) + "\n")
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(summary))
    print(f"study real-lm-geoalign finished: {Path(out) / 'report.md'}")
    return 0


class RealLmGeoAlign(Study):
    name = "real-lm-geoalign"
    options = ("generator",)
    seed = 0  # the rollouts' sampling seed (real-lm-geometry's collection at that seed)

    def run(self, args, out, workers):
        return run(args, out, workers)


STUDY = RealLmGeoAlign()
