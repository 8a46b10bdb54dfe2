"""`openrlhf-geo study real-lm-proxy`: does SALT's LM-head proxy preserve the geometry of a real pretrained LM's
full per-sample gradients? SALT (arXiv 2606.05800) §3.2 Table 1 and App. E (E.1 protocol, E.2 metrics, Table 5) on
SmolLM2-135M-Instruct (a 4-bit quantization of the release). Protocol: docs/studies/real-lm-proxy.md.

The rollouts are the study's own T = 0.6 collection (64 of real-lm-geometry's problems x 8, up to 256 tokens, geometry
at the one cap; the protocol's second amendment), full responses. Two blocks of 32 prompts x 8
samples (m = 256, Table 4's mini-batch), each split into 4 mini-batches of 8 prompts x 8 (m = 64); rows are keyed by
the m their records hold (the committed run's blocks were split at m = 32; third amendment). Per rollout: the
full gradient of ℓ_i = mean log softmax(z_t/τ)[y_t] over its response tokens, for all 134.5 M parameters, CountSketch-
ed to REF_DIM coordinates (a seeded random projection; error stated and checked on exactly computed pairs), and its
first- and last-block parts sketched the same way. Proxies: Eq. 19 exactly (its Gram from token pairs,
`features.lm_head_gram`), SALT's default sketch (the collection's Gram) and the Kronecker sketch; nulls: permuted
exact-proxy rows and Gaussian rows of the exact proxy's dimension (a Wishart Gram). App. E.2's metrics by
`salt_proxy.fidelity`, each beside proxy − null gaps, chance and SALT's own gap (third amendment).
`--resummarize DIR` re-derives a finished output's summary and report from its block files.
"""

import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import torch

from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab.studies import real_lm
from openrlhf_geo.lab.studies.base import Study
from openrlhf_geo.lab.studies.real_lm_geometry import QUICK, gram_factor, interval
from openrlhf_geo.lab.studies.salt_proxy import (
    HIGHER_IS_BETTER,
    METRICS,
    NULLS,
    PAPER_NAMES,
    PAPER_TABLE5,
    fidelity,
    geometry,
)

TEMPERATURE = 0.6
REF_DIM = 1 << 20  # CountSketch coordinates of each per-sample gradient (cosine noise sd <= sqrt(2 / REF_DIM))
SKETCH_SEED = 20260580
NULL_SEED = 20260605
EXACT_PAIRS = (
    4  # per block, the first EXACT_PAIRS rollouts' gradients are also kept whole: their pairs check the sketch
)
SIZES = {"full": {"blocks": 2, "prompts": 32, "samples": 8, "small": 4},  # m = 256 blocks, 4 m = 64 mini-batches each
         "quick": {"blocks": 1, "prompts": 2, "samples": 4, "small": 1}}  # fmt: skip
REFERENCES = ("full", "last_block", "first_block")
PROXIES = ("exact", "default", "kronecker")
TINY_DEMO = {"rho": 0.587, "sign": 0.825, "pr_err": 0.332, "k_match": 0.2, "subspace": 0.2, "a_cos": 0.312}
# the study's own collection (second amendment): 64 problems x 8 at T = 0.6, geometry only at the full-length cap
COLLECTION = {"prompts": 64, "samples": 8, "max_tokens": 256, "caps": (256,)}
PROTOCOL_SPLIT_M = 64  # the protocol's mini-batch: 8 prompts x 8
# SALT Table 1 (§3.2): the full-gradient row and the nulls' rows (ρ, PR err., subspace), SALT's own proxy − null gap
# (third amendment); Table 5 prints the same values and also sign agreement, k_t match and a' cosine
PAPER_TABLE1 = {"full": {"rho": 0.71, "pr_err": 0.09, "subspace": 0.78},
                "permutation": {"rho": 0.02, "pr_err": 0.47, "subspace": 0.18},
                "noise": {"rho": 0.00, "pr_err": 0.56, "subspace": 0.13}}  # fmt: skip
BUDGET_S = 60 * 60  # the budget stop after block 0 (second amendment): projected on time alone, no metric read
# unit costs for the estimate: a per-sample gradient with its sketches profiled at ~3 s on an idle 2-core VM (the
# first full run's progress bar showed 13-15 s; the estimate prints both)
PER_GRADIENT_S, FIRST_RUN_GRADIENT_S, EXACT_GRAM_S_PER_MTOKEN2 = 3.5, 14.0, 25.0


def countsketch_tables(model, dim, seed):
    """{name: (bucket (numel,) int64, sign (numel,) float32)} per trainable parameter, from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    tables = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            bucket = torch.randint(0, dim, (p.numel(),), generator=generator, dtype=torch.int32)
            sign = torch.randint(0, 2, (p.numel(),), generator=generator).float().mul_(2).sub_(1)
            tables[name] = (bucket, sign)
    return tables


def response_objective(model, prompt, response, temperature):
    """ℓ_i: the mean log-prob of the response's tokens under softmax(z/τ), the objective Eq. 19's proxy is the
    LM-head gradient of (`features.lm_head_features`)."""
    seq = torch.tensor([prompt + response])
    logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).mean()


def sketched_gradients(model, prompt_ids, response_ids, rows, samples, temperature, tables, progress=None):
    """Per rollout of `rows`: the full gradient of ℓ_i, CountSketched -> {"full", "last_block", "first_block"}:
    (R, REF_DIM) float32 each, the exact squared norms (R,) of each part, and the first EXACT_PAIRS full gradients
    kept whole for the sketch check."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    parts = {"full": names, "last_block": [n for n in names if n.startswith(f"model.layers.{layers[-1]}.")],
             "first_block": [n for n in names if n.startswith(f"model.layers.{layers[0]}.")]}  # fmt: skip
    out = {part: torch.zeros(len(rows), REF_DIM) for part in parts}
    norms = {part: torch.zeros(len(rows), dtype=torch.float64) for part in parts}
    whole = []
    params = dict(model.named_parameters())
    for k, i in enumerate(rows):
        model.zero_grad(set_to_none=True)
        response_objective(model, prompt_ids[i // samples], response_ids[i], temperature).backward()
        for part, members in parts.items():
            for name in members:
                g = params[name].grad.reshape(-1)
                bucket, sign = tables[name]
                out[part][k].index_add_(0, bucket, g * sign)
                norms[part][k] += float(torch.dot(g, g))
        if k < EXACT_PAIRS:
            whole.append(torch.cat([params[n].grad.reshape(-1) for n in names]))
        if progress is not None:
            progress(1)
    model.zero_grad(set_to_none=True)
    return out, norms, whole


@torch.no_grad()
def proxy_grams(model, prompt_ids, response_ids, rows, samples, temperature):
    """Eq. 19's exact Gram ⟨G_i, G_j⟩ (token pairs, `features.lm_head_gram`) and the Kronecker sketch's Gram (D =
    4096, seed 0: `--salt.features kronecker`) of the rollouts `rows`, float64 (R, R), from one forward per rollout
    over the packed response positions."""
    from openrlhf_geo.features import lm_head_features, lm_head_gram

    logits, hidden, tokens, segments = [], [], [], []
    for k, i in enumerate(rows):
        prompt, response = prompt_ids[i // samples], response_ids[i]
        seq = torch.tensor([prompt + response])
        out = model(input_ids=seq, output_hidden_states=True)
        lo, hi = len(prompt) - 1, len(prompt) - 1 + len(response)  # positions producing the response tokens
        logits.append(out.logits[0, lo:hi])
        hidden.append(out.hidden_states[-1][0, lo:hi])
        tokens.append(torch.tensor(response))
        segments.append(torch.full((len(response),), k))
    z, h = torch.cat(logits)[None], torch.cat(hidden)[None]
    y, seg = torch.cat(tokens)[None], torch.cat(segments)[None]
    mask = torch.ones_like(y, dtype=torch.bool)
    exact = lm_head_gram(z, h, y, mask, temperature=temperature, segment_ids=seg)  # softmax(z/τ), weights 1/(T τ)
    # as `features.response_geometry` calls it: the sampling distribution's logits and hidden / τ
    kron = lm_head_features(z / temperature, h / temperature, y, mask, "kronecker", 4096, 0, segment_ids=seg).double()
    return exact, kron @ kron.T


def wishart_gram(m, dim, seed):
    """The Gram of m i.i.d. standard normal rows of dimension `dim`, drawn as Wishart(dim, I_m) (Bartlett)."""
    from scipy.stats import wishart

    return torch.as_tensor(wishart.rvs(df=dim, scale=np.eye(m), random_state=np.random.default_rng(seed)))


def minibatch_metrics(a, grams) -> dict:
    """App. E.2 on one mini-batch from Grams -> {vectors/reference: fidelity}, and PR / k_t / α_t per set."""
    geo = {name: geometry(a, gram_factor(K)) for name, K in grams.items()}
    pairs = {f"{p}/{r}": fidelity(geo[p], geo[r]) for r in REFERENCES for p in (*PROXIES, *NULLS)}
    sets = {name: {"pr": g.pr, "k": g.k, "alpha": g.alpha} for name, g in geo.items()}
    return {"pairs": pairs, "sets": sets}


def analyse_block(data, model, block, sizes, tables, progress=None) -> dict:
    from openrlhf_geo.estimators import group_norm

    collection = data["collection"]
    samples_all, cap = collection["samples"], collection["caps"][-1]
    prompts, samples = sizes["prompts"], sizes["samples"]
    first = block * prompts
    rows = [i * samples_all + j for i in range(first, first + prompts) for j in range(samples)]
    t0 = time.perf_counter()
    grads, norms, whole = sketched_gradients(model, data["prompt_ids"], data["response_ids"], rows, samples_all,
                                             TEMPERATURE, tables, progress)  # fmt: skip
    t_grad = time.perf_counter() - t0
    t0 = time.perf_counter()
    exact, kron = proxy_grams(model, data["prompt_ids"], data["response_ids"], rows, samples_all, TEMPERATURE)
    t_proxy = time.perf_counter() - t0
    idx = torch.as_tensor(rows)
    default = data["geometry"][cap]["gram"][idx][:, idx]
    refs = {part: (g @ g.T).double() for part, g in grads.items()}
    # the sketch's error where it is known exactly: the diagonal (exact squared norms) and the kept whole pairs
    diag = {part: float(((refs[part].diagonal() - norms[part]) / norms[part]).abs().max()) for part in refs}
    pair_err = []
    for a_ in range(len(whole)):
        for b_ in range(a_):
            x, y = whole[a_].double(), whole[b_].double()
            exact_cos = float(x @ y / (x.norm() * y.norm()))
            K = refs["full"]
            sketch_cos = float(K[a_, b_] / (K[a_, a_] * K[b_, b_]).sqrt())
            pair_err.append(abs(sketch_cos - exact_cos))
    rewards = data["rewards"][cap][idx]
    group_ids = torch.arange(len(rows)) // samples
    records = []
    small = prompts // sizes["small"]  # prompts per small mini-batch (m = 64 at the protocol's sizes)
    split_m = small * samples
    splits = [(f"m{len(rows)}", np.arange(len(rows)))]  # named by their m (the rows are keyed by it)
    if sizes["small"] > 1:  # one small mini-batch would be the block itself, analysed once
        splits += [(f"m{split_m}-{s}", np.arange(s * split_m, (s + 1) * split_m)) for s in range(sizes["small"])]
    generator = np.random.default_rng([NULL_SEED, block])
    for name, sub in splits:
        sub_t = torch.as_tensor(sub)
        m = len(sub)
        a = group_norm(rewards[sub_t].double(), group_ids[sub_t])
        perm = torch.as_tensor(generator.permutation(m))
        grams = {name: K[sub_t][:, sub_t] for name, K in (("exact", exact), ("default", default), ("kronecker", kron),
                                                         *refs.items())}  # fmt: skip
        grams["permutation"] = grams["exact"][perm][:, perm]
        grams["noise"] = wishart_gram(m, 49152 * 576, int(generator.integers(2**31)))
        if not bool((a != 0).any()):
            records.append({"block": block, "batch": name, "m": m, "signal": 0})
            continue
        record = minibatch_metrics(a, grams)
        records.append({"block": block, "batch": name, "m": m, "signal": 1, **record,
                        "accuracy": float(rewards[sub_t].mean())})  # fmt: skip
    return {"records": records, "sketch_check": {"diagonal_rel_err_max": diag, "pair_cos_err": pair_err},
            "seconds": {"gradients": t_grad, "proxies": t_proxy}, "rollouts": len(rows), "split_m": split_m,
            "tokens": int(sum(len(data["response_ids"][i]) for i in rows))}  # fmt: skip


def block_split(block) -> tuple:
    """(the block's m, its small mini-batches' m) of a block file: the split it records ("split_m"), else read from
    its records' m (a block written before blocks recorded it); ValueError when they disagree."""
    block_m = block["rollouts"]
    small = sorted({r["m"] for r in block["records"]} - {block_m})
    where = f"block {block['records'][0]['block']}" if block["records"] else "a block"
    if len(small) > 1:
        raise ValueError(f"{where} holds mini-batches of several sizes (m = {', '.join(map(str, small))})")
    read = small[0] if small else block_m
    if block.get("split_m", read) != read:
        raise ValueError(f"{where} records split_m {block['split_m']} but its mini-batches hold m = {read}")
    return block_m, read


def paper_gap(null, metric) -> float:
    """SALT's own proxy − null gap against the full gradient (third amendment, item 2): Table 1's full-gradient row
    minus its null's row for ρ, PR err. and subspace (0.78 − 0.18 = 0.60 for the subspace and the permutation null),
    Table 5's for sign agreement, k_t match and a' cosine."""
    if metric in PAPER_TABLE1["full"]:
        return round(PAPER_TABLE1["full"][metric] - PAPER_TABLE1[null][metric], 2)
    return round(PAPER_TABLE5["full"][metric][0] - PAPER_TABLE5[null][metric][0], 2)


def gap_level(row, paper, metric):
    """Third amendment, item 2: "at Table 1's level" only when the gap's 95 % CI contains SALT's gap `paper`; "above"
    / "below" it when the CI lies wholly on the better / worse side (PR rel. err.: lower is better, so a more negative
    gap is the better one); None without a CI (fewer than two mini-batches)."""
    low, high = row["low"], row["high"]
    if row["n"] < 2 or not (math.isfinite(low) and math.isfinite(high)):
        return None
    if low <= paper <= high:
        return "at Table 1's level"
    better = low > paper if HIGHER_IS_BETTER[metric] else high < paper
    return f"{'above' if better else 'below'} Table 1's level"


def _values(rows, pair, metric) -> np.ndarray:
    """`metric` of `pair` over the records `rows`, float64 (a value strict JSON stored as null is NaN)."""
    return np.array([np.nan if r["pairs"][pair][metric] is None else r["pairs"][pair][metric] for r in rows])


def summarize(blocks, setup) -> dict:
    """Every number of the report from the blocks' records -> dict (strict JSON once passed through `strict_json`).
    Rows are keyed by the m their records hold (third amendment, item 1); the decision rule applies at the small
    mini-batches' m, whichever the blocks were split at."""
    from openrlhf_geo.eval.metrics import paired_gain
    from openrlhf_geo.lab.studies.salt_proxy import verdict

    splits = {block_split(b) for b in blocks}
    if len(splits) != 1:
        shown = ", ".join(f"m = {b} into m = {m}" for b, m in sorted(splits, key=lambda split: split[::-1]))
        raise ValueError(f"the blocks were split differently ({shown}); summarize each split alone")
    ((block_m, split_m),) = splits
    records = [r for b in blocks for r in b["records"] if r["signal"]]
    table, versus, nested, gaps = {}, {}, {}, {}
    for size in sorted({block_m, split_m}, reverse=True):
        label, rows = f"m{size}", [r for r in records if r["m"] == size]
        for ref in REFERENCES:
            for vec in (*PROXIES, *NULLS):
                pair = f"{vec}/{ref}"
                table[f"{label} {pair}"] = {m: interval(_values(rows, pair, m)) for m in METRICS}
                table[f"{label} {pair}"]["batches"] = len(rows)
            for proxy in PROXIES:
                pair, cells = f"{proxy}/{ref}", {}
                for m in METRICS:
                    cell = {vec: table[f"{label} {vec}/{ref}"][m]["mean"] for vec in (proxy, *NULLS)}
                    for null in NULLS:
                        x, y = _values(rows, pair, m), _values(rows, f"{null}/{ref}", m)
                        ok = np.isfinite(x) & np.isfinite(y)
                        row = paired_gain(x[ok], y[ok])
                        versus[f"{label} {pair} - {null} {m}"] = row
                        nested.setdefault(label, {}).setdefault(pair, {}).setdefault(m, {})[null] = row
                        cell[f"minus_{null}"] = row
                        if ref == "full":  # SALT's gaps are against its full gradient
                            cell[f"paper_minus_{null}"] = paper_gap(null, m)
                            cell[f"level_{null}"] = gap_level(row, paper_gap(null, m), m)
                    cells[m] = cell
                # chance for the subspace: k_t/m of the reference (`fidelity`'s subspace_chance), per mini-batch
                cells["subspace"]["chance"] = interval(_values(rows, pair, "subspace_chance"))
                gaps.setdefault(label, {})[pair] = cells
    # salt-proxy's decision rule at the small mini-batches against the full gradient (its table and nulls, by pair)
    small = {name.split(" ")[1]: row for name, row in table.items() if name.startswith(f"m{split_m} ")}
    verdicts = {proxy: verdict(small, nested.get(f"m{split_m}", {}), "full", proxy) for proxy in PROXIES}
    for v in verdicts.values():  # salt-proxy's unit is a seed; here it is a mini-batch
        v["verdict"] = v["verdict"].replace("two seeds", "two mini-batches")
    checks = [b["sketch_check"] for b in blocks]
    setup = {**setup, "block_m": block_m, "split_m": split_m, "blocks_run": len(blocks),
             "block_ids": [b["records"][0]["block"] for b in blocks]}  # fmt: skip
    return {"study": "real-lm-proxy", "setup": setup, "table": table, "versus_nulls": versus, "verdicts": verdicts,
            "gaps": gaps, "sketch_check": checks, "paper_table5": PAPER_TABLE5, "paper_table1": PAPER_TABLE1,
            "tiny_demo_exact_full": TINY_DEMO, "seconds": [b["seconds"] for b in blocks]}  # fmt: skip


def _f(x, digits=3, sign=""):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{sign}.{digits}f}"


def _ci(row, sign=""):
    """mean [low, high]; the mean alone without a CI (one mini-batch). Reads a summary or its strict-JSON form."""
    mean = row.get("mean", row.get("gain"))
    if row["n"] < 2 or row["low"] is None or not math.isfinite(row["low"]):
        return _f(mean, sign=sign)
    return f"{_f(mean, sign=sign)} [{_f(row['low'], sign=sign)}, {_f(row['high'], sign=sign)}]"


def render(summary) -> str:
    setup = summary["setup"]
    block_m, split_m = setup["block_m"], setup["split_m"]
    cols = ("Gram ρ", "sign agr.", "PR rel. err.", "k_t match", "subspace", "a' cos")
    seed = f" (seed {setup['seed']})" if setup.get("seed") is not None else ""
    shape = f" ({setup['prompts']} prompts x {setup['samples']})" if setup.get("prompts") else ""
    wall = f"{setup['wall_s'] / 60:.1f} min" if setup.get("wall_s") is not None else "not recorded"
    estimate = f" (estimate {setup['estimate_s'] / 60:.0f} min)" if setup.get("estimate_s") is not None else ""
    lines = [
        "# SALT's LM-head proxy on a real pretrained LM (`openrlhf-geo study real-lm-proxy`)",
        "",
        f"Model: {setup['model']}: a 4-bit quantization of the release, not the release. Rollouts: the study's own "
        f"T = {setup['temperature']} collection{seed}, full responses. {setup['blocks_run']} block(s) of m = "
        f"{block_m}{shape}, each split into {block_m // split_m} mini-batches of m = {split_m}. Reference Grams: "
        f"CountSketch of the full per-sample gradients to {setup['ref_dim']:,} coordinates. Protocol: "
        f"docs/studies/real-lm-proxy.md. Wall time {wall}{estimate}.",
        *(["", f"**{setup['stopped']}.**"] if setup.get("stopped") else []),
    ]
    if split_m != PROTOCOL_SPLIT_M:
        lines += ["", f"**The protocol's mini-batch is m = {PROTOCOL_SPLIT_M}; these blocks were split at m = "
                  f"{split_m}: the m = {split_m} rows and the decision rule rest on them** (rows keyed by the m their "
                  "records hold; docs/studies/real-lm-proxy.md, third amendment)."]  # fmt: skip
    lines += [
        "",
        "Mean over mini-batches [95 % percentile-bootstrap CI] (App. E.2; `salt_proxy.fidelity`).",
        "",
        "| m | vectors | reference | batches | " + " | ".join(cols) + " |",
        "|---|---|---|---|" + "---|" * len(cols),
    ]
    for name, row in summary["table"].items():
        size, pair = name.split(" ")
        vec, ref = pair.split("/")
        lines.append(f"| {size[1:]} | {vec} | {ref} | {row['batches']} | " + " | ".join(_ci(row[m]) for m in METRICS)
                     + " |")  # fmt: skip
    lines += ["", "SALT Table 5 (mean ± sd; its ρ, PR err. and subspace rows are Table 1's):", "",
              "| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]  # fmt: skip
    for key, row in summary["paper_table5"].items():
        lines.append(f"| {PAPER_NAMES[key]} | " + " | ".join(f"{row[m][0]:.2f} ± {row[m][1]:.2f}" for m in METRICS)
                     + " |")  # fmt: skip
    tiny = summary["tiny_demo_exact_full"]
    lines += ["", "The demo's tiny model (salt-proxy study, exact proxy vs full gradient): "
              + ", ".join(f"{c} {tiny[m]}" for c, m in zip(cols, METRICS)) + "."]  # fmt: skip
    lines += [
        "",
        "## Proxy − null against the full gradient, beside chance and SALT's own gap (third amendment)",
        "",
        "Proxy − null paired by mini-batch [95 % CI]. Chance: the reference's k_t/m (the subspace overlap of a "
        "uniformly random k_t-dimensional subspace), mean over the mini-batches. SALT's gap: Table 1's full-gradient "
        "row minus its null row (ρ, PR err., subspace; Table 5 for sign, k_t match, a' cos), permutation / noise. "
        "\"at Table 1's level\" only where the gap's CI contains SALT's gap; above / below: the CI wholly on the "
        "better / worse side. PR rel. err. is lower-better: a negative gap is the better one. With one mini-batch "
        "(no CI) the values stand alone. The permutation null permutes the exact proxy's Gram (K[π][:, π]): its "
        "spectrum, so its PR and k_t, are the exact proxy's (the exact proxy's PR and k_t gaps to it are 0 by "
        "construction). Every reference's gaps: summary.json `gaps`.",
        "",
        "| m | vectors | metric | proxy | perm. null | noise null | proxy − perm. | proxy − noise | chance | "
        "SALT's gap (perm. / noise) | vs SALT's gap (perm. / noise) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, pairs in summary["gaps"].items():
        for pair, cells in pairs.items():
            if not pair.endswith("/full"):
                continue
            for m, label_m in zip(METRICS, cols):
                c = cells[m]
                chance = _ci(c["chance"]) if "chance" in c else ""
                levels = " / ".join((c[f"level_{n}"] or "no CI").replace(" Table 1's level", "") for n in NULLS)
                lines.append(f"| {label[1:]} | {pair.split('/')[0]} | {label_m} | {_f(c[pair.split('/')[0]])} | "
                             f"{_f(c['permutation'])} | {_f(c['noise'])} | {_ci(c['minus_permutation'], '+')} | "
                             f"{_ci(c['minus_noise'], '+')} | {chance} | {c['paper_minus_permutation']:+.2f} / "
                             f"{c['paper_minus_noise']:+.2f} | {levels} |")  # fmt: skip
    lines += ["", f"## Verdicts at m = {split_m} against the full gradient (salt-proxy's rule, applied mechanically)",
              ""]  # fmt: skip
    for proxy, v in summary["verdicts"].items():
        failed = f" (failed: {', '.join(v['failed'])})" if v["failed"] else ""
        lines.append(f"- `{proxy}`: **{v['verdict']}**{failed}.")
    lines += ["", "## The reference sketch's error where it is known exactly", ""]
    for b, check in zip(setup["block_ids"], summary["sketch_check"]):
        errs = check["pair_cos_err"]
        worst = max(errs) if errs else math.nan
        norms = ", ".join(f"{k} {v:.4f}" for k, v in check["diagonal_rel_err_max"].items())
        lines.append(f"- block {b}: max relative error of the sketched squared norms {norms}; |sketched − exact| "
                     f"cosine on {len(errs)} pairs: max {worst:.4f}")  # fmt: skip
    return "\n".join(lines) + "\n"


BLOCK_FILE = re.compile(r"block(\d+)\.json")


def block_files(directory) -> list:
    """The block<b>.json files of a --resummarize DIR, by block number (ValueError when it holds none)."""
    found = [(int(match[1]), path) for path in Path(directory).glob("block*.json")
             if (match := BLOCK_FILE.fullmatch(path.name))]  # fmt: skip
    if not found:
        raise ValueError(f"--resummarize {directory}: no block<b>.json files there (what a real-lm-proxy run writes "
                         "in its --out)")  # fmt: skip
    return [path for _, path in sorted(found)]


def _read_json(path):
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--resummarize: {path} is not readable JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--resummarize: {path} is not a JSON object")
    return value


def resummarize(directory) -> int:
    """Third amendment, item 1: `directory`'s summary.json and report.md re-derived by the current code from its
    block<b>.json files (no model, no collection). The setup the run recorded (wall time, collection seconds, stop,
    estimate) is kept from its summary.json when there is one."""
    with real_lm.rewriting(directory) as directory:
        blocks = [_read_json(path) for path in block_files(directory)]
        old = directory / "summary.json"
        setup = _read_json(old).get("setup", {}) if old.exists() else {}
        # what the blocks themselves tell, where the run's summary does not
        known = {"model": real_lm.MODEL_NAME, "temperature": TEMPERATURE, **blocks[0].get("sizes", {}),
                 "ref_dim": REF_DIM, "collection": blocks[0].get("collection")}  # fmt: skip
        setup.update({key: value for key, value in known.items() if key not in setup})
        try:
            summary = strict_json(summarize(blocks, setup))
            report = render(summary)  # both derived before either is written
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"--resummarize {directory}: its block files are not real-lm-proxy blocks "
                             f"({type(error).__name__}: {error})") from None  # fmt: skip
        (directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (directory / "report.md").write_text(report)
    print(f"study real-lm-proxy: re-derived {directory / 'summary.json'} and {directory / 'report.md'} from "
          f"{len(blocks)} block file(s)")  # fmt: skip
    return 0


def run(args, out, workers, cache=None):
    from transformers import AutoModelForCausalLM

    # `openrlhf-geo study` pins one thread (local.kernels, for the toy studies' bit-reproducible training); nothing
    # here trains, and one thread made each gradient 14 s instead of ~3 s
    torch.set_num_threads(os.cpu_count() or 1)
    quick = args.quick
    sizes = SIZES["quick" if quick else "full"]
    base = QUICK if quick else COLLECTION
    collection = real_lm.Collection(prompts=base["prompts"], samples=base["samples"], temperature=TEMPERATURE,
                                    max_tokens=base["max_tokens"], caps=base["caps"], seed=args.seeds[0],
                                    generator=args.generator or "vllm")  # fmt: skip
    n_grad = sizes["blocks"] * sizes["prompts"] * sizes["samples"]
    grams = sizes["blocks"] * EXACT_GRAM_S_PER_MTOKEN2 * (256 * 60 / 1e3) ** 2 / 1e3
    estimate = n_grad * PER_GRADIENT_S + grams
    print(f"study real-lm-proxy: {n_grad} per-sample gradients of 134.5 M parameters; about {estimate / 60:.0f} min "
          f"after the collection ({(n_grad * FIRST_RUN_GRADIENT_S + grams) / 60:.0f} min at the first run's "
          f"{FIRST_RUN_GRADIENT_S:.0f} s per gradient; docs/studies/real-lm-proxy.md)")  # fmt: skip
    start = time.perf_counter()
    data = real_lm.collect(collection, cache)
    model = AutoModelForCausalLM.from_pretrained(real_lm.model_dir(), dtype=torch.float32).eval()
    tables = countsketch_tables(model, REF_DIM, SKETCH_SEED)
    from tqdm.auto import tqdm

    blocks, stopped = [], None
    with tqdm(total=n_grad, desc="real-lm-proxy", unit="gradient") as bar:
        for block in range(sizes["blocks"]):
            path = Path(out) / f"block{block}.json"
            kept = json.loads(path.read_text()) if path.exists() else None
            if kept is not None and kept.get("collection") == data["key"] and kept.get("sizes") == sizes:
                blocks.append(kept)  # resumed: this block of this collection and split is finished
                bar.update(kept["rollouts"])
            else:
                t0 = time.perf_counter()
                blocks.append({**analyse_block(data, model, block, sizes, tables, progress=bar.update),
                               "collection": data["key"], "sizes": sizes,
                               "block_s": time.perf_counter() - t0})  # fmt: skip
                path.write_text(json.dumps(strict_json(blocks[-1]), indent=1) + "\n")
            projected = time.perf_counter() - start + blocks[0].get("block_s", 0.0)
            if not quick and block == 0 and sizes["blocks"] > 1 and projected > BUDGET_S:
                stopped = (f"stopped after block 0 by the 60-min budget stop (projected {projected / 60:.0f} min; "
                           "protocol, second amendment)")  # fmt: skip
                print(f"study real-lm-proxy: {stopped}")
                break
    setup = {"model": real_lm.MODEL_NAME, "temperature": TEMPERATURE, "seed": args.seeds[0], **sizes,
             "ref_dim": REF_DIM, "stopped": stopped, "wall_s": time.perf_counter() - start,
             "estimate_s": estimate, "collection": data["key"],
             "collection_seconds": data["seconds"]}  # fmt: skip
    summary = strict_json(summarize(blocks, setup))
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(summary))
    print(f"study real-lm-proxy finished: {Path(out) / 'report.md'}")
    return 0


class RealLmProxy(Study):
    name = "real-lm-proxy"
    options = ("generator", "resummarize")
    seed = 0  # the rollouts' sampling seed (`real_lm.Collection.seed`)

    def check(self, generator=None, resummarize=None):
        if resummarize is not None:
            block_files(resummarize)

    def run(self, args, out, workers):
        return run(args, out, workers)

    def resummarize(self, directory):
        return resummarize(directory)


STUDY = RealLmProxy()
