"""`openrlhf-geo study real-lm-proxy`: does SALT's LM-head proxy preserve the geometry of a real pretrained LM's
full per-sample gradients? SALT (arXiv 2606.05800) §3.2 Table 1 and App. E (E.1 protocol, E.2 metrics, Table 5) on
SmolLM2-135M-Instruct (a 4-bit quantization of the release). Protocol: docs/studies/real-lm-proxy.md.

The rollouts are the study's own T = 0.6 collection (64 of real-lm-geometry's problems x 8, up to 256 tokens, geometry
at the one cap; the protocol's second amendment), full responses. Two blocks of 32 prompts x 8
samples (m = 256, Table 4's mini-batch), each split into 4 mini-batches of 8 prompts x 8 (m = 64). Per rollout: the
full gradient of ℓ_i = mean log softmax(z_t/τ)[y_t] over its response tokens, for all 134.5 M parameters, CountSketch-
ed to REF_DIM coordinates (a seeded random projection; error stated and checked on exactly computed pairs), and its
first- and last-block parts sketched the same way. Proxies: Eq. 19 exactly (its Gram from token pairs,
`features.lm_head_gram`), SALT's default sketch (the collection's Gram) and the Kronecker sketch; nulls: permuted
exact-proxy rows and Gaussian rows of the exact proxy's dimension (a Wishart Gram). App. E.2's metrics by
`salt_proxy.fidelity`.
"""

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab.studies import real_lm
from openrlhf_geo.lab.studies.base import Study
from openrlhf_geo.lab.studies.real_lm_geometry import QUICK, gram_factor, interval
from openrlhf_geo.lab.studies.salt_proxy import METRICS, NULLS, PAPER_NAMES, PAPER_TABLE5, fidelity, geometry

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
    from openrlhf_geo.local.engine import group_advantages

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
    small = prompts // sizes["small"]  # prompts per m = 64 mini-batch
    splits = [("m256", np.arange(len(rows)))] + [
        (f"m64-{s}", np.arange(s * small * samples, (s + 1) * small * samples)) for s in range(sizes["small"])
    ]
    generator = np.random.default_rng([NULL_SEED, block])
    for name, sub in splits:
        sub_t = torch.as_tensor(sub)
        m = len(sub)
        a = group_advantages(rewards[sub_t].double(), group_ids[sub_t], "group_norm")
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
            "seconds": {"gradients": t_grad, "proxies": t_proxy}, "rollouts": len(rows),
            "tokens": int(sum(len(data["response_ids"][i]) for i in rows))}  # fmt: skip


def summarize(blocks, setup) -> dict:
    from openrlhf_geo.eval.metrics import paired_gain
    from openrlhf_geo.lab.studies.salt_proxy import verdict

    records = [r for b in blocks for r in b["records"] if r["signal"]]
    table, versus, nested = {}, {}, {}
    for size in ("m256", "m64"):
        rows = [r for r in records if r["batch"].split("-")[0] == size]
        for ref in REFERENCES:
            for vec in (*PROXIES, *NULLS):
                pair = f"{vec}/{ref}"
                table[f"{size} {pair}"] = {m: interval([r["pairs"][pair][m] for r in rows]) for m in METRICS}
                table[f"{size} {pair}"]["batches"] = len(rows)
            for proxy in PROXIES:
                for null in NULLS:
                    for m in METRICS:
                        x = np.array([r["pairs"][f"{proxy}/{ref}"][m] for r in rows])
                        y = np.array([r["pairs"][f"{null}/{ref}"][m] for r in rows])
                        ok = np.isfinite(x) & np.isfinite(y)
                        row = paired_gain(x[ok], y[ok])
                        versus[f"{size} {proxy}/{ref} - {null} {m}"] = row
                        nested.setdefault(size, {}).setdefault(f"{proxy}/{ref}", {}).setdefault(m, {})[null] = row
    # salt-proxy's decision rule at m = 64 against the full gradient (its table and nulls, keyed by pair)
    m64 = {name.split(" ")[1]: row for name, row in table.items() if name.startswith("m64 ")}
    verdicts = {proxy: verdict(m64, nested.get("m64", {}), "full", proxy) for proxy in PROXIES}
    for v in verdicts.values():  # salt-proxy's unit is a seed; here it is a mini-batch
        v["verdict"] = v["verdict"].replace("two seeds", "two mini-batches")
    checks = [b["sketch_check"] for b in blocks]
    return {"study": "real-lm-proxy", "setup": setup, "table": table, "versus_nulls": versus, "verdicts": verdicts,
            "sketch_check": checks, "paper_table5": PAPER_TABLE5, "tiny_demo_exact_full": TINY_DEMO,
            "seconds": [b["seconds"] for b in blocks]}  # fmt: skip


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row):
    if row["n"] < 2 or not math.isfinite(row["low"]):
        return _f(row["mean"])
    return f"{_f(row['mean'])} [{_f(row['low'])}, {_f(row['high'])}]"


def render(summary) -> str:
    setup = summary["setup"]
    cols = ("Gram ρ", "sign agr.", "PR rel. err.", "k_t match", "subspace", "a' cos")
    lines = [
        "# SALT's LM-head proxy on a real pretrained LM (`openrlhf-geo study real-lm-proxy`)",
        "",
        f"Model: {setup['model']}: a 4-bit quantization of the release, not the release. Rollouts: the study's own "
        f"T = {setup['temperature']} collection (seed {setup['seed']}), full responses. {setup['blocks_run']} "
        f"block(s) of {setup['prompts']} prompts x {setup['samples']} (m = {setup['prompts'] * setup['samples']}), "
        f"each split into {setup['small']} mini-batches of m = "
        f"{setup['prompts'] * setup['samples'] // setup['small']}. "
        f"Reference Grams: CountSketch of the full per-sample gradients to {setup['ref_dim']:,} coordinates. "
        f"Protocol: docs/studies/real-lm-proxy.md. Wall time {setup['wall_s'] / 60:.1f} min (estimate "
        f"{setup['estimate_s'] / 60:.0f} min).",
        *(["", f"**{setup['stopped']}.**"] if setup.get("stopped") else []),
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
    lines += ["", "SALT Table 5 (mean ± sd):", "", "| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for key, row in summary["paper_table5"].items():
        lines.append(f"| {PAPER_NAMES[key]} | " + " | ".join(f"{row[m][0]:.2f} ± {row[m][1]:.2f}" for m in METRICS)
                     + " |")  # fmt: skip
    tiny = summary["tiny_demo_exact_full"]
    lines += ["", "The demo's tiny model (salt-proxy study, exact proxy vs full gradient): "
              + ", ".join(f"{c} {tiny[m]}" for c, m in zip(cols, METRICS)) + "."]  # fmt: skip
    lines += ["", "## Proxy − null (paired by mini-batch, 95 % CI; PR rel. err.: lower is better)", ""]
    for name, row in summary["versus_nulls"].items():
        if "/full - " in name:
            lines.append(f"- {name}: {_f(row['gain'])} [{_f(row['low'])}, {_f(row['high'])}] (n = {row['n']})")
    lines += ["", "## Verdicts at m = 64 against the full gradient (salt-proxy's rule, applied mechanically)", ""]
    for proxy, v in summary["verdicts"].items():
        failed = f" (failed: {', '.join(v['failed'])})" if v["failed"] else ""
        lines.append(f"- `{proxy}`: **{v['verdict']}**{failed}.")
    lines += ["", "## The reference sketch's error where it is known exactly", ""]
    for b, check in enumerate(summary["sketch_check"]):
        errs = check["pair_cos_err"]
        worst = max(errs) if errs else math.nan
        norms = ", ".join(f"{k} {v:.4f}" for k, v in check["diagonal_rel_err_max"].items())
        lines.append(f"- block {b}: max relative error of the sketched squared norms {norms}; |sketched − exact| "
                     f"cosine on {len(errs)} pairs: max {worst:.4f}")  # fmt: skip
    return "\n".join(lines) + "\n"


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
             "ref_dim": REF_DIM, "blocks_run": len(blocks), "stopped": stopped, "wall_s": time.perf_counter() - start,
             "estimate_s": estimate, "collection": data["key"],
             "collection_seconds": data["seconds"]}  # fmt: skip
    summary = strict_json(summarize(blocks, setup))
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(summary))
    print(f"study real-lm-proxy finished: {Path(out) / 'report.md'}")
    return 0


class RealLmProxy(Study):
    name = "real-lm-proxy"
    options = ("generator",)
    seed = 0  # the rollouts' sampling seed (`real_lm.Collection.seed`)

    def run(self, args, out, workers):
        return run(args, out, workers)


STUDY = RealLmProxy()
