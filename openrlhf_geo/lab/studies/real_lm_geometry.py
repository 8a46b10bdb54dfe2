"""`openrlhf-geo study real-lm-geometry`: SALT's geometry of GRPO batches of a real pretrained LM's rollouts (SALT
arXiv 2606.05800 §2.2, Fig. 2, Table 10's backbone row, App. D.1), no training.
Protocol: docs/studies/real-lm-geometry.md.

Per temperature, one collection (`real_lm.collect`): 64 word problems x 16 samples of SmolLM2-135M-Instruct (a 4-bit
quantization of the release), their rewards and SALT's default proxy Gram at each response-length cap. A condition
(T, cap, G) is analysed on 4 disjoint batches of m = 256 rollouts (B = 256 / G prompts x G samples: SALT §4.4's fixed
budget; G = 8 is Table 4's 32 x 8): GRPO advantages (group_norm) -> n_eff (Eq. 6/60), PR (Eq. 5), k_t (Eq. 14),
SALT's a' (Eq. 18) with its α_t (Eq. 17), D_a / D_g (Eq. 59), U⊥ gain (Eq. 61), sign flips and ‖a'‖/‖a‖, and App.
D.1's within-group statistics. Each number: the mean over the 4 batches with a 95 % percentile-bootstrap CI.

The protocol's amendment (docs/studies/real-lm-geometry.md, "Amendment") adds: item 2, the rule's CI over prompts
(`prompt_weights`, `weighted_n_eff`; the batch-percentile CI stays as "first analysis"); item 3, SALT's a' beside
`matched-rand-subspace` and a plain random subspace of its k_t (`null_subspaces`), and the gap SALT − random
subspace with a CI over prompts (`subspace_gap_replicates`; recentred on the gap after the rerun); item 4, the share
of the top-k_t eigenvectors in the span of prompt / name / item indicators against chance and permuted labels
(`family_shares`, `family_verdict`).
"""

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch

from openrlhf_geo.jsonl import nan_json, strict_json
from openrlhf_geo.lab import word_task
from openrlhf_geo.lab.studies import real_lm
from openrlhf_geo.lab.studies.base import Study

TEMPERATURES = (0.6, 1.0)  # SALT Table 4's rollout temperature, and upstream's / the demo's T = 1
GROUPS = (4, 8, 16)  # G at the fixed budget m = 256
M = 256  # SALT Table 4: mini-batch 32 prompts x 8 rollouts
CAPS = (32, 64, 128, 256)
FULL = {"prompts": 64, "samples": 16, "max_tokens": 256, "caps": CAPS, "groups": GROUPS, "m": M}
QUICK = {"prompts": 4, "samples": 8, "max_tokens": 32, "caps": (16, 32), "groups": (4, 8), "m": 16}
# SALT Table 10 (DeepSeek-Distill-Qwen-7B / MATH-TRAIN, last 20 % of checkpoints, 5 seeds): mean ± sd
PAPER_TABLE10 = {
    "backbone": {"n_eff": (0.31, 0.05)},
    "salt": {"D_a": (0.24, 0.04), "D_g": (0.16, 0.03), "n_eff": (0.80, 0.04), "U_perp_gain": (1.47, None)},
}
TINY_DEMO_N_EFF = 1.54  # the demo's GRPO n_eff(a) on the 135k-parameter Qwen2 (docs/results.md)
METRICS = (
    *("n_eff", "pr", "k", "alpha", "n_eff_salt", "D_a", "D_g", "U_perp_gain", "sign_flip", "norm_ratio"),
    *("n_eff_group", "n_eff_means", "r_in", "r_total", "pr_in", "accuracy", "mixed", "length", "truncated", "signal"),
    *("n_eff_perm_mean", "n_eff_perm_lo", "n_eff_perm_hi", "n_eff_vs_perm"),
)
N_EFF_PERMUTATIONS = 200  # amendment item 6's draws per batch
# the amendment's counts and seed (docs/studies/real-lm-geometry.md, "Amendment", items 2-4)
AMENDMENT_SEED = 20261204
PROMPT_REPLICATES = 2000  # item 2: the rule's CI over prompts
GAP_REPLICATES = 200  # item 3: the CI of SALT − random subspace at the longest cap
NULL_DRAWS = 20  # item 3: draws of each random-subspace null per batch
PERMUTATIONS = 200  # item 4: permuted-label draws per batch and family
NULLS = {"matched": "matched-rand-subspace", "random": "rand-proj"}  # item 3's nulls as salt.VARIANTS
NULL_METRICS = ("norm_ratio", "D_a", "D_g", "n_eff_salt", "U_perp_gain", "sign_flip")
# prompt_cis' entries of a condition
PROMPT_CIS = ("n_eff_prompts", "n_eff_prompts_apart", "gap_vs_random", "gap_vs_random_centred")
PLOT = "geometry_by_cap.png"
FAMILIES = ("prompt", "name", "item")  # item 4's indicator families
NULL_LABELS = {"norm_ratio": "‖a'‖/‖a‖", "D_a": "D_a", "D_g": "D_g", "n_eff_salt": "n_eff(a')",
               "U_perp_gain": "U⊥ gain", "sign_flip": "sign flips"}  # fmt: skip
# unit costs for the estimate, measured on this project's 2-core VM (docs/studies/real-lm-geometry.md, "Cost")
GEN_TOKENS_PER_S, FORWARD_TOKENS_PER_S, VLLM_START_S = 140.0, 600.0, 60.0
MEAN_LENGTH = {0.6: 55.0, 1.0: 90.0}  # generated tokens per rollout (calibration probes at 0.7 and 1.0)


def replicates(prompts: int, samples: int, G: int, m: int) -> list[np.ndarray]:
    """Disjoint batches of m rows (B = m / G prompts x G samples) that partition the prompts x samples collection,
    row i * samples + j = sample j of prompt i: (prompts / B) prompt blocks x (samples / G) sample blocks."""
    if m % G or prompts % (m // G) or samples % G:
        raise ValueError(f"m = {m}, G = {G} do not tile {prompts} prompts x {samples} samples")
    B = m // G
    out = []
    for p in range(prompts // B):
        for s in range(samples // G):
            rows = [i * samples + j for i in range(p * B, (p + 1) * B) for j in range(s * G, (s + 1) * G)]
            out.append(np.array(rows))
    return out


def gram_factor(gram: torch.Tensor) -> torch.Tensor:
    """F' (m, m) float64 with F' F'ᵀ = gram (an eigen-factor): every SALT quantity depends on F only through F Fᵀ, so
    salt_advantages on F' equals it on the features the Gram came from (up to rounding)."""
    lam, vec = torch.linalg.eigh(gram.double())
    return vec * lam.clamp(min=0).sqrt()


def draw_seed(T, cap, G, batch, stream=0) -> int:
    """The seed of a batch's random draws: amendment item 3's (20261204, T, cap, G, batch) as a numpy SeedSequence
    (T in thousandths); stream 0 the item-3 subspace draws, 1 the gap CI's subspace draws, 2 item 4's permutations,
    3 item 6's."""
    key = (AMENDMENT_SEED, round(1000 * T), cap, G, batch) + ((stream,) if stream else ())
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def within_group_permutations(rng, draws, m, G) -> np.ndarray:
    """(draws, m) row indices: a uniform permutation of each group of G consecutive rows, one per draw."""
    within = np.argsort(rng.random((draws, m // G, G)), axis=2)
    return (within + G * np.arange(m // G)[None, :, None]).reshape(draws, m)


def n_eff_permutation_null(a, gram, samples_per_prompt, seed, draws=N_EFF_PERMUTATIONS) -> dict:
    """Amendment item 6: n_eff (Eq. 6 on the Gram) of a with its values permuted within each group, `draws` times
    (numpy generator seeded `seed`): each group's zero sum and values kept, their link to the features broken ->
    {"n_eff_perm_mean", "n_eff_perm_lo", "n_eff_perm_hi" (2.5 / 97.5 percentiles), "n_eff_vs_perm": −1 / 0 / +1 as
    n_eff(a) lies below, inside or above that range}."""
    a = np.asarray(a, dtype=np.float64)
    K = np.asarray(gram, dtype=np.float64)
    m, G = len(a), samples_per_prompt
    A = a[within_group_permutations(np.random.default_rng(seed), draws, m, G)]
    values = np.einsum("di,ij,dj->d", A, K, A) / (A**2 * np.diag(K)).sum(1)
    lo, hi = np.percentile(values, (2.5, 97.5))
    n_eff = float(a @ K @ a / (a**2 * np.diag(K)).sum())
    return {"n_eff_perm_mean": float(values.mean()), "n_eff_perm_lo": float(lo), "n_eff_perm_hi": float(hi),
            "n_eff_vs_perm": float(-1 if n_eff < lo else 1 if n_eff > hi else 0)}  # fmt: skip


def salt_metrics(a, new, stats) -> dict:
    """What coefficients a' = new do to a batch (the protocol's "Metrics"), from salt_advantages' stats: n_eff(a')
    (Eq. 60), D_a and D_g (Eq. 59), U⊥ gain (Eq. 61 ratio, on SALT's own P_k for every variant); and the share of
    nonzero a_i whose a'_i has another sign and ‖a'‖/‖a‖ (diagnostics.salt_weight_stats' sign_flip and √kept, here
    without its rank correlations, which cost a third of the amendment's resampling); the last two NaN for a = 0."""
    moving = a != 0
    any_moving = bool(moving.any())
    return {
        "n_eff_salt": stats["n_eff_out"],
        "D_a": stats["D_a"],
        "D_g": stats["D_g"],
        "U_perp_gain": stats["U_perp_gain"],
        "sign_flip": float((torch.sign(new[moving]) != torch.sign(a[moving])).double().mean())
        if any_moving
        else math.nan,
        "norm_ratio": float(new.norm() / a.norm()) if any_moving else math.nan,
    }


def null_subspaces(a, factor, seed, draws=NULL_DRAWS) -> dict:
    """Amendment item 3: the means over `draws` draws of salt_metrics for SALT's App. F.3.2 `matched-rand-subspace`
    (Table 9) and for a plain random subspace of SALT's k_t, a' = P_R a + α_t (I − P_R)[a]₊: Eq. 18 with P_k replaced
    by a uniformly random k_t-dimensional projector P_R, which is salt.py's `rand-proj` (F.3.1) ->
    {"matched_<metric>", "random_<metric>"}. Each null draws from a CPU generator seeded `seed`, so draw j of both
    uses the same subspace."""
    from openrlhf_geo.salt import salt_advantages

    out = {}
    for name, variant in NULLS.items():
        generator = torch.Generator().manual_seed(seed)
        rows = [salt_metrics(a, *salt_advantages(a, factor, variant, generator=generator)) for _ in range(draws)]
        out.update({f"{name}_{metric}": float(np.mean([r[metric] for r in rows])) for metric in NULL_METRICS})
    return out


def problem_labels(question: str) -> tuple[int, int]:
    """(name index in word_task.NAMES, item index in word_task.ITEMS) of a word problem, recovered from its text."""
    numbers = [int(x) for x in re.findall(r"\d+", question)]
    for i, name in enumerate(word_task.NAMES):
        for j, item in enumerate(word_task.ITEMS):
            if len(numbers) == 2 and word_task.question(name, item, *numbers) == question:
                return i, j
    raise ValueError(f"not a word_task problem (no name and item of word_task render it): {question!r}")


def family_shares(basis, is_top, k, gram, labels, samples_per_prompt) -> dict:
    """Amendment item 4 for labelings of the batch's prompts -> {"share", "trace_share"}, each (P,) float64.

    basis (m, r) and is_top as salt_advantages returns them (U, the top-k_t eigenvectors of K, spans the basis when
    is_top, else its complement); gram K (m, m); labels (P, B) integer labels of the B prompts (rows grouped by
    prompt, `samples_per_prompt` each, so a prompt's rollouts share its label). With Q_Z the orthonormal basis of
    the label indicators' span (indicator of class c over √n_c): share = ‖Q_Zᵀ U‖_F² / k_t (= (dim Z − ‖Q_Zᵀ B‖²) / k_t
    when B spans U's complement) and trace_share = tr(Q_Zᵀ K Q_Z) / tr(K). NaN when k_t = 0 or tr K = 0.
    """
    B = np.asarray(basis, dtype=np.float64)
    K = np.asarray(gram, dtype=np.float64)
    labels = np.asarray(labels)
    G = samples_per_prompt
    n_prompts = labels.shape[1]
    onehot = (labels[:, :, None] == np.arange(labels.max() + 1)).astype(np.float64)  # (P, B, C)
    sizes = G * onehot.sum(1)  # (P, C) rollouts per class
    inv = np.divide(1.0, sizes, out=np.zeros_like(sizes), where=sizes > 0)
    per_prompt = B.reshape(n_prompts, G, -1).sum(1)  # (B, r): 1_pᵀ B
    captured = (np.einsum("pbc,br->pcr", onehot, per_prompt) ** 2).sum(-1)  # (P, C): (1_cᵀ B)²
    captured = (captured * inv).sum(1)  # ‖Q_Zᵀ B‖_F²
    dim = (sizes > 0).sum(1)
    inside = captured if is_top else dim - captured
    blocks = K.reshape(n_prompts, G, n_prompts, G).sum((1, 3))  # (B, B): 1_pᵀ K 1_q
    between = ((onehot * (blocks @ onehot)).sum(1) * inv).sum(1)  # Σ_c 1_cᵀ K 1_c / n_c
    trace = float(np.trace(K))
    return {
        "share": inside / k if k > 0 else np.full(len(labels), math.nan),
        "trace_share": between / trace if trace > 0 else np.full(len(labels), math.nan),
    }


def family_records(basis, is_top, k, gram, families, samples_per_prompt, seed, permutations=PERMUTATIONS) -> dict:
    """Amendment item 4 per batch: for each family (name -> (B,) labels of the batch's prompts) its share and trace
    share, chance = dim span Z / m, and the max / mean / min over `permutations` draws of the labels permuted over
    the prompts (numpy generator seeded `seed`, one per family in `families`' order). The family "prompt" (every
    prompt its own label) is the exception: relabelling prompts leaves its partition unchanged, so its null permutes
    the rollouts instead (a random grouping of the m rollouts into groups of the same sizes; amendment note)."""
    rng = np.random.default_rng(seed)
    m = np.asarray(gram).shape[0]
    out = {"family_k": float(k)}
    for family, labels in families.items():
        labels = np.asarray(labels)
        if family == "prompt":
            B, K = np.asarray(basis, dtype=np.float64), np.asarray(gram, dtype=np.float64)
            values = family_shares(B, is_top, k, K, labels[None], samples_per_prompt)
            draws = [family_shares(B[p], is_top, k, K[np.ix_(p, p)], labels[None], samples_per_prompt)
                     for p in (rng.permutation(m) for _ in range(permutations))]  # fmt: skip
            values = {stat: np.concatenate([values[stat], *(d[stat] for d in draws)]) for stat in values}
        else:
            permuted = np.stack([labels, *(rng.permutation(labels) for _ in range(permutations))])
            values = family_shares(basis, is_top, k, gram, permuted, samples_per_prompt)
        out[f"{family}_chance"] = len(np.unique(labels)) / m
        for stat, v in values.items():
            out[f"{family}_{stat}"] = float(v[0])
            out[f"{family}_{stat}_perm_max"] = float(v[1:].max())
            out[f"{family}_{stat}_perm_mean"] = float(v[1:].mean())
            out[f"{family}_{stat}_perm_min"] = float(v[1:].min())
    return out


def analyse_batch(rewards, gram, lengths, samples_per_prompt, *, seed=None, families=None) -> dict:
    """One batch of m rollouts (rows grouped by prompt, G each): GRPO advantages and SALT's geometry of them; the
    geometry is NaN (signal 0) when every group is tied (a = 0: GRPO makes no update, Eq. 6 is 0/0).
    seed (`draw_seed`'s key (T, cap, G, batch)): add amendment item 3's nulls (`null_subspaces`); families ({name:
    (B,) labels of the prompts}): add item 4's shares (`family_records`, defined for a tied batch too)."""
    from openrlhf_geo import diagnostics
    from openrlhf_geo.estimators import group_norm
    from openrlhf_geo.salt import salt_advantages

    m = rewards.numel()
    group_ids = torch.arange(m) // samples_per_prompt
    a = group_norm(rewards.double(), group_ids)  # upstream's GRPO: Bessel std, eps 1e-9
    factor = gram_factor(gram)
    new, stats, geo = salt_advantages(a, factor, return_basis=True)
    groups = diagnostics.group_geometry(a, geo.gram, group_ids, is_gram=True)
    tied = rewards.view(-1, samples_per_prompt)
    context = {
        "accuracy": float(rewards.mean()),
        "mixed": float(((tied.min(1).values != tied.max(1).values).double()).mean()),
        "length": float(lengths.double().mean()),
    }
    if families is not None:
        context.update(family_records(geo.basis, geo.is_top, int(stats["k"]), gram, families, samples_per_prompt,
                                      draw_seed(*seed, stream=2)))  # fmt: skip
    if not bool((a != 0).any()):  # every group tied: no GRPO update, so no cancellation to measure (n_eff 0/0)
        nulls = {f"{n}_{metric}": math.nan for n in NULLS for metric in NULL_METRICS} if seed is not None else {}
        return {**dict.fromkeys(METRICS, math.nan), **nulls, **context, "signal": 0.0}
    record = {
        "n_eff": stats["n_eff_in"],
        "pr": stats["pr"],
        "k": stats["k"],
        "alpha": stats["alpha"],
        **salt_metrics(a, new, stats),
        "n_eff_group": groups["n_eff_group"],
        "n_eff_means": groups["n_eff_means"],
        "r_in": groups["r_in"],
        "r_total": groups["r_total"],
        "pr_in": groups["pr_in"],
        **context,
        "signal": 1.0,
    }
    if seed is not None:
        record.update(null_subspaces(a, factor, draw_seed(*seed)))
        record.update(n_eff_permutation_null(a, gram, samples_per_prompt, draw_seed(*seed, stream=3)))
    return record


def batch_families(questions, rows, samples) -> dict:
    """Amendment item 4's indicator families of a batch -> {"prompt", "name", "item"}: (B,) labels of its prompts
    (rows i * samples + j = sample j of prompt i, grouped by prompt)."""
    prompts = np.unique(np.asarray(rows) // samples)  # ascending, as the batch's rows are
    labels = np.array([problem_labels(questions[p]) for p in prompts])
    return {"prompt": np.arange(len(prompts)), "name": labels[:, 0], "item": labels[:, 1]}


def analyse(data, setup, families=True, progress=None) -> list[dict]:
    """Every (cap, G) condition of one collection on its disjoint batches -> records (amendment item 3 at every
    condition, item 4 at the longest cap unless `families` is False: it reads word_task's names and items, which
    `openrlhf-geo inspect`'s prompts do not have). `progress(1)` after each batch."""
    records = []
    collection = data["collection"]
    T, longest = collection["temperature"], max(setup["caps"])
    for cap in setup["caps"]:
        geometry, rewards = data["geometry"][cap], data["rewards"][cap]
        lengths = torch.as_tensor(geometry["lengths"])
        # the response tokens of a rollout still unfinished at the cap: T_i = cap, no EOS among them
        finished_by_cap = torch.tensor([len(r) <= cap and r[-1] == data["eos"] for r in data["response_ids"]])
        for G in setup["groups"]:
            for r, rows in enumerate(replicates(collection["prompts"], collection["samples"], G, setup["m"])):
                idx = torch.as_tensor(rows)
                labels = (batch_families(data["questions"], rows, collection["samples"])
                          if families and cap == longest else None)  # fmt: skip
                record = analyse_batch(rewards[idx], geometry["gram"][idx][:, idx], lengths[idx], G,
                                       seed=(T, cap, G, r), families=labels)  # fmt: skip
                record["truncated"] = float((~finished_by_cap[idx]).double().mean())
                records.append({"T": T, "cap": cap, "G": G, "replicate": r, **record})
                if progress is not None:
                    progress(1)
    return records


def prompt_weights(batch_prompts, count, seed=AMENDMENT_SEED) -> list[np.ndarray]:
    """Amendment item 2's resampling: per batch, (count, B) multiplicities of its B prompts (in its order).

    batch_prompts: each batch's prompt ids. Every distinct prompt set among the batches is resampled with
    replacement once per replicate, and the batches that use it share that draw. numpy's default_rng(seed) fills
    one (count, Σ B_set) array row by row, so the first R replicates are the same for any count >= R.
    """
    sets = list(dict.fromkeys(tuple(int(p) for p in prompts) for prompts in batch_prompts))
    sizes = np.array([len(s) for s in sets])
    draws = np.random.default_rng(seed).integers(0, np.repeat(sizes, sizes), size=(count, sizes.sum()))
    counts, start = {}, 0
    for prompts, size in zip(sets, sizes):
        block = draws[:, start : start + size] + size * np.arange(count)[:, None]
        counts[prompts] = np.bincount(block.ravel(), minlength=count * size).reshape(count, size)
        start += size
    return [counts[tuple(int(p) for p in prompts)] for prompts in batch_prompts]


def weighted_n_eff(a, gram, weights, samples_per_prompt, copies="paired") -> np.ndarray:
    """Amendment item 2: Eq. 6 on the Gram with row multiplicities w, Σ_ij w_i w_j a_i a_j K_ij / Σ_i w_i a_i² K_ii,
    for each row of weights (R, B) (w_i = the multiplicity of row i's prompt; rows grouped by prompt) -> (R,)
    float64, NaN where the resampled batch has no signal (denominator 0: Eq. 6 is 0/0).

    copies="paired" (as registered): the resample's batch holds w_p identical copies of prompt p's rollouts, and
    the numerator pairs each copy with the others: prompt p's block Σ_{i,j ∈ p} a_i a_j K_ij enters w_p² times
    against w_p in the denominator, so a prompt drawn twice doubles its weight in the ratio (E[w_p²] = 2 − 1/B):
    n_eff is biased upward (measured: the point estimate below the whole interval). copies="apart" (added after the
    rerun): a copy is paired with itself only (w_p times its block), and the cross-prompt blocks are scaled by
    B/(B − 1), so that the numerator's mean over the resamples is the batch's own (E[w_p w_q] = (B − 1)/B)."""
    a = np.asarray(a, dtype=np.float64)
    K = np.asarray(gram, dtype=np.float64)
    W = np.asarray(weights, dtype=np.float64)
    n_prompts = W.shape[1]
    pairs = (a[:, None] * K * a[None, :]).reshape(n_prompts, samples_per_prompt, n_prompts, samples_per_prompt)
    blocks = pairs.sum((1, 3))  # (B, B): Σ_{i ∈ p, j ∈ q} a_i a_j K_ij
    own = (a * a * np.diagonal(K)).reshape(n_prompts, -1).sum(1)  # (B,): Σ_{i ∈ p} a_i² K_ii
    if copies == "paired":
        num = np.einsum("rp,pq,rq->r", W, blocks, W)
    elif copies == "apart":
        own_block = np.diagonal(blocks)
        scale = n_prompts / (n_prompts - 1) if n_prompts > 1 else 0.0
        num = W @ own_block + scale * np.einsum("rp,pq,rq->r", W, blocks - np.diag(own_block), W)
    else:
        raise ValueError(f"copies must be paired or apart (got {copies!r})")
    den = W @ own
    return np.divide(num, den, out=np.full(len(W), math.nan), where=den > 0)


def subspace_gap_replicates(batches, weights, seeds) -> dict:
    """Amendment item 3's gap CI: per replicate, the mean over the resampled batches with signal of SALT (`full`)
    minus one plain random subspace draw (`rand-proj`) of each NULL_METRICS -> {metric: (R,) float64, NaN where no
    batch has signal}. batches: (a (m,), factor (m, m), G) per batch; weights: prompt_weights';
    seeds: one per batch, for a CPU generator whose r-th subspace draw is replicate r's."""
    from openrlhf_geo.salt import salt_advantages

    count = len(weights[0])
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    out = {metric: np.full(count, math.nan) for metric in NULL_METRICS}
    for r in range(count):
        gaps = []
        for (a, factor, G), w, generator in zip(batches, weights, generators):
            prompts = np.repeat(np.arange(len(w[r])), w[r])
            idx = torch.as_tensor((prompts[:, None] * G + np.arange(G)).ravel())
            a_r = a[idx]
            if not bool((a_r != 0).any()):
                continue  # no signal in this resample; its subspace draw is not taken, as analyse_batch skips it
            full = salt_metrics(a_r, *salt_advantages(a_r, factor[idx]))
            rand = salt_metrics(a_r, *salt_advantages(a_r, factor[idx], NULLS["random"], generator=generator))
            gaps.append([full[m] - rand[m] for m in NULL_METRICS])
        if gaps:
            for metric, value in zip(NULL_METRICS, np.mean(gaps, axis=0)):
                out[metric][r] = value
    return out


def resample(data, setup, count=PROMPT_REPLICATES, gap_count=GAP_REPLICATES) -> dict:
    """Amendment items 2 and 3 on one collection -> {(T, cap, G): {"n_eff": (R, batches) weighted_n_eff per
    replicate and batch, "n_eff_point": (batches,) Eq. 6 on the batches as drawn, and at the longest cap "gap":
    subspace_gap_replicates'}}. Every condition draws from prompt_weights (seed 20261204): the same draws at every
    cap and temperature of a G, so differences between caps are paired."""
    from openrlhf_geo.estimators import group_norm

    collection = data["collection"]
    T, samples, longest = collection["temperature"], collection["samples"], max(setup["caps"])
    out = {}
    for cap in setup["caps"]:
        geometry, rewards = data["geometry"][cap], data["rewards"][cap]
        for G in setup["groups"]:
            batches = replicates(collection["prompts"], samples, G, setup["m"])
            weights = prompt_weights([np.unique(rows // samples) for rows in batches], count)
            values, apart, points, kept = [], [], [], []
            for rows, w in zip(batches, weights):
                idx = torch.as_tensor(rows)
                a = group_norm(rewards[idx].double(), torch.arange(len(rows)) // G)
                K = geometry["gram"][idx][:, idx]
                values.append(weighted_n_eff(a.numpy(), K.numpy(), w, G))
                apart.append(weighted_n_eff(a.numpy(), K.numpy(), w, G, copies="apart"))
                points.append(weighted_n_eff(a.numpy(), K.numpy(), np.ones((1, w.shape[1])), G)[0])
                if cap == longest:
                    kept.append((a, gram_factor(K), G))
            entry = {"n_eff": np.stack(values, axis=1), "n_eff_apart": np.stack(apart, axis=1),
                     "n_eff_point": np.array(points)}  # fmt: skip
            if cap == longest:
                seeds = [draw_seed(T, cap, G, r, stream=1) for r in range(len(batches))]
                entry["gap"] = subspace_gap_replicates(kept, [w[:gap_count] for w in weights], seeds)
            out[(T, cap, G)] = entry
    return out


def interval(values) -> dict:
    from openrlhf_geo.lab.studies.salt_proxy import interval as seed_interval

    v = [x for x in values if math.isfinite(x)]
    return seed_interval(v)


def regime(row) -> str:
    """The protocol's rule on n_eff(a): in SALT's regime if the CI lies below 1, outside if above, else undecided.
    row: a CI {"low", "high", "n"} over batches with a learning signal (first analysis) or over prompt replicates
    (amendment item 2: the rule's CI); no verdict without two of them."""
    if row["n"] < 2 or not (math.isfinite(row["low"]) and math.isfinite(row["high"])):
        return "no verdict (no CI: fewer than two batches or replicates with a learning signal)"
    if row["high"] < 1:
        return "in SALT's regime (n_eff < 1)"
    if row["low"] > 1:
        return "outside SALT's regime (n_eff > 1)"
    return "not decided (the CI contains 1)"


def finite_mean(values) -> float:
    """The mean of the finite values (the batches with signal), NaN without any."""
    v = np.asarray(values, dtype=np.float64)
    return float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else math.nan


def replicate_means(values) -> np.ndarray:
    """(R, batches) -> (R,): each replicate's mean over its finite batch values (amendment item 2: the batches with
    signal), NaN for a replicate without any."""
    ok = np.isfinite(values)
    counts = ok.sum(1)
    total = np.where(ok, values, 0.0).sum(1)
    return np.divide(total, counts, out=np.full(len(values), math.nan), where=counts > 0)


def percentile_ci(point, replicates, centred=False) -> dict:
    """{"mean" (the point estimate), "low", "high", "n"}: the 95 % percentile interval of the finite replicates
    (amendment items 2-3); NaN bounds with fewer than two. centred: the interval moved by the replicates' mean shift
    from the point ("shift": their mean minus the point), for resamples whose centre moves for a reason that is not
    the estimator's (item 3's gap: `subspace_gap_replicates`)."""
    v = np.asarray(replicates, dtype=np.float64)
    v = v[np.isfinite(v)]
    low, high = np.percentile(v, [2.5, 97.5]) if v.size >= 2 else (math.nan, math.nan)
    if not centred:
        return {"mean": float(point), "low": float(low), "high": float(high), "n": int(v.size)}
    shift = float(v.mean()) - float(point) if v.size >= 2 else math.nan
    return {"mean": float(point), "low": float(low - shift), "high": float(high - shift), "n": int(v.size),
            "shift": shift}  # fmt: skip


def family_verdict(shares, perm_max, perm_min) -> str:
    """Amendment item 4's reading over a condition's batches: "set by the family" iff in every batch the share
    exceeds the largest of its permuted-label values. Relabelling the prompt family's labels over the prompts leaves
    its partition, so the statistic, unchanged: when every batch's permuted values equal its share the null is
    undefined, and the reading says so rather than "not set"."""
    shares, perm_max, perm_min = (np.asarray(x, dtype=np.float64) for x in (shares, perm_max, perm_min))
    if not shares.size or not np.isfinite(shares).all():
        return "no reading (a batch without a top-k_t subspace)"
    if np.allclose(perm_max, shares, rtol=1e-9, atol=1e-12) and np.allclose(perm_min, shares, rtol=1e-9, atol=1e-12):
        return "no permutation null (relabelling the prompts leaves the partition unchanged)"
    if (shares > perm_max).all():
        return "set by the family"
    return f"not set by the family ({int((shares > perm_max).sum())} of {shares.size} batches above the null)"


def _conditions(records) -> dict:
    conditions = {}
    for rec in records:
        conditions.setdefault((rec["T"], rec["cap"], rec["G"]), []).append(rec)
    return conditions


def prompt_cis(records, setup, resampled) -> dict:
    """Items 2-3's CIs over prompts from `resample`'s replicates (all collections) -> {"table": {condition:
    {"n_eff_prompts", "n_eff_prompts_apart"[, "gap_vs_random", "gap_vs_random_centred"]}}, "by_cap": {n_eff at a
    cap minus at the longest}}: the part of the summary that resamples the collection's Grams (a result directory
    holds only the records)."""
    table = {}
    for (T, cap, G), rows in _conditions(records).items():
        boot = resampled[(T, cap, G)]
        # item 2: the rule's CI over prompts
        entry = {"n_eff_prompts": percentile_ci(finite_mean(boot["n_eff_point"]), replicate_means(boot["n_eff"]))}
        entry["n_eff_prompts"]["replicates"] = len(boot["n_eff"])
        # added after the rerun: the same resamples with a drawn prompt's copies not paired (weighted_n_eff)
        entry["n_eff_prompts_apart"] = percentile_ci(finite_mean(boot["n_eff_point"]),
                                                     replicate_means(boot["n_eff_apart"]))  # fmt: skip
        if "gap" in boot:  # item 3: SALT − plain random subspace, CI over prompts
            points = {m: finite_mean([r[m] - r[f"random_{m}"] for r in rows]) for m in NULL_METRICS}
            entry["gap_vs_random"] = {m: percentile_ci(points[m], boot["gap"][m]) for m in NULL_METRICS}
            # added after the rerun: the registered interval excludes its own point in most conditions, since a
            # resampled batch's copies of a prompt lower PR and so k_t (SALT's and the random subspace's), which
            # moves every replicate; the same replicates recentred on the point
            entry["gap_vs_random_centred"] = {m: percentile_ci(points[m], boot["gap"][m], centred=True)
                                              for m in NULL_METRICS}  # fmt: skip
        table[f"T={T} cap={cap} G={G}"] = entry
    # n_eff at each cap minus at the longest cap with item 2's CI (the same prompt draws at every cap: paired)
    longest = max(setup["caps"])
    by_cap = {}
    for (T, cap, G), boot in resampled.items():
        if cap == longest:
            continue
        base = resampled[(T, longest, G)]
        diff, point = boot["n_eff"] - base["n_eff"], boot["n_eff_point"] - base["n_eff_point"]
        by_cap[f"T={T} G={G} cap {cap} - cap {longest}"] = percentile_ci(finite_mean(point), replicate_means(diff))
    return {"table": table, "by_cap": by_cap}


def summarize(records, setup, cis) -> dict:
    """The first analysis (batches) and the amendment's (items 2-4; `cis`: `prompt_cis`' CIs over prompts)."""
    from openrlhf_geo.eval.metrics import paired_gain

    conditions = _conditions(records)
    table = {}
    for (T, cap, G), rows in conditions.items():
        rows = sorted(rows, key=lambda r: r["replicate"])
        entry = {metric: interval([r[metric] for r in rows]) for metric in METRICS}
        side = [r.get("n_eff_vs_perm", math.nan) for r in rows]
        entry["n_eff_vs_perm_counts"] = {name: sum(1 for x in side if x == v)
                                         for name, v in (("below", -1), ("inside", 0), ("above", 1))}  # fmt: skip
        entry.update({f"{null}_{metric}": interval([r[f"{null}_{metric}"] for r in rows])
                      for null in NULLS for metric in NULL_METRICS})  # fmt: skip
        key = f"T={T} cap={cap} G={G}"
        ci = cis["table"][key]
        # item 2: the rule's CI over prompts; the first analysis's batch-percentile CI and verdict stay beside it
        entry["n_eff_prompts"] = ci["n_eff_prompts"]
        entry["regime"] = regime(entry["n_eff_prompts"])
        entry["regime_first_analysis"] = regime(entry["n_eff"])
        entry["n_eff_prompts_apart"] = ci["n_eff_prompts_apart"]
        entry["regime_apart"] = regime(entry["n_eff_prompts_apart"])
        entry["per_batch_n_eff"] = [r["n_eff"] for r in rows]
        for name in ("gap_vs_random", "gap_vs_random_centred"):
            if name in ci:
                entry[name] = ci[name]
        table[key] = {"T": T, "cap": cap, "G": G, **entry}
    # n_eff at each cap minus at the longest cap, paired by batch (the same rollouts, cut)
    longest = max(setup["caps"])
    by_cap = {}
    for (T, cap, G), rows in conditions.items():
        if cap == longest:
            continue
        base = sorted(conditions[(T, longest, G)], key=lambda r: r["replicate"])
        rows = sorted(rows, key=lambda r: r["replicate"])
        x, y = np.array([r["n_eff"] for r in rows]), np.array([r["n_eff"] for r in base])
        ok = np.isfinite(x) & np.isfinite(y)
        by_cap[f"T={T} G={G} cap {cap} - cap {longest}"] = paired_gain(x[ok], y[ok])
    # item 4 at the longest cap, per (T, G)
    families = {}
    for (T, cap, G), rows in conditions.items():
        if cap != longest or "family_k" not in rows[0]:  # item 4 not measured (`analyse`'s families)
            continue
        entry = {"batches": len(rows), "k": interval([r["family_k"] for r in rows])}
        for family in FAMILIES:
            row = {"chance": float(np.mean([r[f"{family}_chance"] for r in rows]))}
            for stat in ("share", "trace_share"):
                row[stat] = float(np.mean([r[f"{family}_{stat}"] for r in rows]))
                row[f"{stat}_perm_mean"] = float(np.mean([r[f"{family}_{stat}_perm_mean"] for r in rows]))
                row[f"{stat}_perm_max"] = float(max(r[f"{family}_{stat}_perm_max"] for r in rows))
                row[f"{stat}_above"] = int(sum(r[f"{family}_{stat}"] > r[f"{family}_{stat}_perm_max"] for r in rows))
            row["verdict"] = family_verdict(
                *([r[f"{family}_share{s}"] for r in rows] for s in ("", "_perm_max", "_perm_min"))
            )
            entry[family] = row
        families[f"T={T} G={G}"] = {"T": T, "cap": cap, "G": G, **entry}
    return {"study": "real-lm-geometry", "setup": setup, "table": table, "n_eff_vs_longest_cap": by_cap,
            "n_eff_vs_longest_cap_prompts": cis["by_cap"], "families": families,
            "paper_table10": PAPER_TABLE10, "tiny_demo_n_eff": TINY_DEMO_N_EFF}  # fmt: skip


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row, digits=3):
    if row["n"] < 2 or not math.isfinite(row["low"]):
        return _f(row["mean"], digits)
    return f"{_f(row['mean'], digits)} [{_f(row['low'], digits)}, {_f(row['high'], digits)}]"


def render(summary) -> str:
    setup = summary["setup"]
    lines = [
        "# SALT's geometry on a real pretrained LM's GRPO batches (`openrlhf-geo study real-lm-geometry`)",
        "",
        f"Model: {setup['model']}: a 4-bit quantization of the release, not the release. Task: one-step "
        "addition word problems in the chat template (docs/real-lm.md). Protocol: docs/studies/real-lm-geometry.md.",
        f"- {setup['prompts']} prompts x {setup['samples']} samples per temperature (sampled by "
        f"{setup['generator']}, seed {setup['seed']}), caps {setup['caps']}, batches "
        f"of m = {setup['m']} (B = m / G prompts x G), {setup['replicates']} disjoint batches per condition; "
        f"features: SALT's default proxy ({setup['features']}).",
        f"- Wall time {setup['wall_s'] / 60:.1f} min (estimate {setup['estimate_s'] / 60:.0f} min); per collection: "
        + "; ".join(
            f"T = {T}: {', '.join(f'{k} {v:.0f} s' for k, v in s.items())}" for T, s in setup["seconds"].items()
        )
        + ".",
        "",
        "Each cell: mean over the disjoint batches [95 % percentile-bootstrap CI]. n_eff: n_eff(a) of GRPO's "
        "advantages (Eq. 6/60); PR (Eq. 5); k_t (Eq. 14); α_t = max(0, 1 − n_eff) (Eq. 17); n_eff(a'), D_a, D_g, U⊥ "
        "gain: what SALT would apply (Eq. 18, 59, 61); sign flips: share of nonzero a_i whose a'_i has the other "
        "sign; ‖a'‖/‖a‖.",
        "",
        "| T | cap | G | n_eff(a) | PR | k_t | α_t | n_eff(a') | D_a | D_g | U⊥ gain | sign flips | ‖a'‖/‖a‖ | "
        "accuracy | mixed groups | length | truncated | regime (rule: CI over prompts, amendment item 2) |",
        "|---|---|---|" + "---|" * 15,
    ]
    for row in summary["table"].values():
        cells = [_ci(row[m], 2 if m in ("pr", "k", "length") else 3) for m in
                 ("n_eff", "pr", "k", "alpha", "n_eff_salt", "D_a", "D_g", "U_perp_gain", "sign_flip", "norm_ratio",
                  "accuracy", "mixed", "length", "truncated")]  # fmt: skip
        signal = f"{round(row['signal']['mean'] * row['signal']['n'])} of {row['signal']['n']} batches with signal"
        lines.append(f"| {row['T']} | {row['cap']} | {row['G']} | " + " | ".join(cells) + f" | {row['regime']}; "
                     f"{signal} |")  # fmt: skip
    lines += [
        "",
        "App. D.1 within-group statistics (same batches; n_eff,in,mean averages Eq. 49 over the groups with signal: "
        "a tied group's is 0/0 and left out):",
        "",
        "| T | cap | G | n_eff,in,mean | n_eff^out | r_in | r_total | PR_in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["table"].values():
        cells = [_ci(row[m]) for m in ("n_eff_group", "n_eff_means", "r_in", "r_total", "pr_in")]
        lines.append(f"| {row['T']} | {row['cap']} | {row['G']} | " + " | ".join(cells) + " |")
    lines += ["", "n_eff(a) at a cap minus at the longest cap, paired by batch (same rollouts, cut):", ""]
    for name, row in summary["n_eff_vs_longest_cap"].items():
        lines.append(f"- {name}: {_f(row['gain'])} [{_f(row['low'])}, {_f(row['high'])}] (n = {row['n']})")
    lines += render_amendment(summary)
    paper = summary["paper_table10"]
    lines += ["", f"SALT Table 10 (7B, MATH-TRAIN): GRPO backbone n_eff {paper['backbone']['n_eff'][0]} ± "
              f"{paper['backbone']['n_eff'][1]}; + SALT D_a {paper['salt']['D_a'][0]}, D_g {paper['salt']['D_g'][0]}, "
              f"n_eff {paper['salt']['n_eff'][0]}, U⊥ gain {paper['salt']['U_perp_gain'][0]}x. The demo's tiny model: "
              f"GRPO n_eff {summary['tiny_demo_n_eff']}."]  # fmt: skip
    plots = summary.get("plots", [])
    lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)] if plots else []
    return "\n".join(lines) + "\n"


def render_amendment(summary) -> list[str]:
    """The report's tables of the protocol's amendment (items 2-4), each statistic beside its null."""
    setup = summary["setup"]["amendment"]
    longest = max(summary["setup"]["caps"])
    lines = [
        "",
        '## Amendment (docs/studies/real-lm-geometry.md, "Amendment")',
        "",
        f"Item 2, the rule's CI: over prompts, {setup['prompt_replicates']} replicates (generator seeded "
        f"{setup['seed']}; one draw per distinct prompt set, shared by the batches that use it); each batch's "
        "n_eff(a) (Eq. 6) on its resampled rows, the replicate's value the mean over the batches with signal; 95 % "
        "percentile interval. Beside it, the first analysis (batch percentile): the percentile bootstrap over the "
        "batch values. Added after the rerun (docs/studies/real-lm-geometry.md): the registered CI pairs the copies "
        "of a prompt drawn more than once, which biases n_eff upward (`weighted_n_eff`); the same resamples with "
        "the copies apart, and the verdict on that CI.",
        "",
        "| T | cap | G | n_eff(a) [CI over prompts, as registered] | regime (rule) | [CI over prompts, copies apart] "
        "| regime on it | first analysis (batch percentile): n_eff(a) [CI over batches] | first analysis: regime |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["table"].values():
        lines.append(f"| {row['T']} | {row['cap']} | {row['G']} | {_ci(row['n_eff_prompts'])} "
                     f"({row['n_eff_prompts']['n']} of {row['n_eff_prompts']['replicates']} replicates) | "
                     f"{row['regime']} | {_ci(row['n_eff_prompts_apart'])} | {row['regime_apart']} | "
                     f"{_ci(row['n_eff'])} | {row['regime_first_analysis']} |")  # fmt: skip
    lines += ["", "n_eff(a) at a cap minus at the longest cap, CI over prompts (the same prompt draws at every cap):",
              ""]  # fmt: skip
    for name, row in summary["n_eff_vs_longest_cap_prompts"].items():
        lines.append(f"- {name}: {_ci(row)} ({row['n']} replicates)")
    lines += [
        "",
        f"Item 3, what SALT would do beside its nulls: each cell SALT (`full`) / `matched-rand-subspace` (App. F.3.2, "
        f"Table 9) / a plain random subspace of SALT's k_t (P_R a + α_t (I − P_R)[a]₊, salt.py's `rand-proj`), the "
        f"nulls' values the mean of {setup['null_draws']} draws per batch (seeded by (20261204, T, cap, G, batch)), "
        "then the mean over the batches with signal. U⊥ gain on SALT's P_k for all three.",
        "",
        "| T | cap | G | " + " | ".join(NULL_LABELS[m] for m in NULL_METRICS) + " |",
        "|---|---|---|" + "---|" * len(NULL_METRICS),
    ]
    for row in summary["table"].values():
        cells = [" / ".join(_f(row[key]["mean"]) for key in (m, f"matched_{m}", f"random_{m}")) for m in NULL_METRICS]
        lines.append(f"| {row['T']} | {row['cap']} | {row['G']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"The gap SALT − random subspace at cap {longest} (mean over the batches with signal of SALT's value minus "
        f"the mean of the {setup['null_draws']} draws), CI over prompts: {setup['gap_replicates']} replicates of item "
        "2's resampling, SALT and one random subspace on each resampled batch:",
        "",
        "| T | G | " + " | ".join(NULL_LABELS[m] for m in NULL_METRICS) + " |",
        "|---|---|" + "---|" * len(NULL_METRICS),
    ]
    for row in summary["table"].values():
        if "gap_vs_random" in row:
            cells = [_ci(row["gap_vs_random"][m]) for m in NULL_METRICS]
            lines.append(f"| {row['T']} | {row['G']} | " + " | ".join(cells) + " |")
    centred = [row for row in summary["table"].values() if "gap_vs_random_centred" in row]
    if centred:  # absent from a result summarized before it was added (its CIs over prompts are kept)
        lines += [
            "",
            "Added after the rerun: the interval above can exclude its own point, since a resampled batch holds "
            "copies of the prompts drawn more than once, which lower PR and so k_t on SALT's side and the random "
            "subspace's, and move every replicate. The same replicates recentred on the point (their mean shift, "
            "in parentheses, removed); each replicate's one subspace draw against the point's mean of "
            f"{setup['null_draws']} makes it wider than the point's own spread:",
            "",
            "| T | G | " + " | ".join(NULL_LABELS[m] for m in NULL_METRICS) + " |",
            "|---|---|" + "---|" * len(NULL_METRICS),
        ]
        for row in centred:
            cells = [f"{_ci(row['gap_vs_random_centred'][m])} ({_f(row['gap_vs_random_centred'][m]['shift'])})"
                     for m in NULL_METRICS]  # fmt: skip
            lines.append(f"| {row['T']} | {row['G']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Item 6, n_eff(a) beside its own null: n_eff of a with its values permuted within each group "
        f"({N_EFF_PERMUTATIONS} draws per batch; each group's zero sum kept, the link to the features broken). Mean "
        "over the batches with signal; then how many batches' n_eff(a) lie below / inside / above their null's "
        "2.5-97.5 % range.",
        "",
        "| T | cap | G | n_eff(a) | permuted within groups | below / inside / above |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["table"].values():
        counts = row.get("n_eff_vs_perm_counts", {})
        lines.append(f"| {row['T']} | {row['cap']} | {row['G']} | {_f(row['n_eff']['mean'])} | "
                     f"{_f(row['n_eff_perm_mean']['mean'])} | {counts.get('below', 0)} / {counts.get('inside', 0)} / "
                     f"{counts.get('above', 0)} |")  # fmt: skip
    lines += [
        "",
        f"Item 4 (descriptive), cap {longest}: U = the top-k_t eigenvectors of K (k_t as SALT picks it). share = "
        "‖Q_Zᵀ U‖_F² / k_t for the indicators Z of the batch's prompts, of the problem's name and of its item; trace "
        "share = tr(Q_Zᵀ K Q_Z) / tr(K). Each beside chance (dim span Z / m) and its "
        f"{setup['permutations']} permuted-label draws (labels permuted over the batch's prompts; for the prompts "
        "themselves the rollouts regrouped at random into groups of G): the mean over "
        'batches of the draws\' mean, and the largest draw of any batch. "set by the family" iff in every batch the '
        "share exceeds the largest of its permuted values.",
        "",
        "| T | G | k_t | family | share | chance | permuted: mean / max | batches above | trace share | chance | "
        "permuted: mean / max | reading |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["families"].values():
        for family in FAMILIES:
            f = row[family]
            lines.append(
                f"| {row['T']} | {row['G']} | {_f(row['k']['mean'], 1)} | {family} | {_f(f['share'])} | "
                f"{_f(f['chance'])} | {_f(f['share_perm_mean'])} / {_f(f['share_perm_max'])} | "
                f"{f['share_above']} of {row['batches']} | {_f(f['trace_share'])} | {_f(f['chance'])} | "
                f"{_f(f['trace_share_perm_mean'])} / {_f(f['trace_share_perm_max'])} | {f['verdict']} |"
            )
    return lines


def plot(summary, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    rows = list(summary["table"].values())
    for ax, metric, label in zip(axes, ("n_eff", "pr", "alpha"), ("n_eff(a) (Eq. 6)", "PR (Eq. 5)", "α_t (Eq. 17)")):
        for T in summary["setup"]["temperatures"]:
            for G in summary["setup"]["groups"]:
                sel = [r for r in rows if r["T"] == T and r["G"] == G]
                caps = [r["cap"] for r in sel]
                mean = [r[metric]["mean"] for r in sel]
                low = [r[metric]["low"] for r in sel]
                high = [r[metric]["high"] for r in sel]
                line = ax.plot(caps, mean, marker="o", label=f"T={T} G={G}")[0]
                ax.fill_between(caps, low, high, color=line.get_color(), alpha=0.15)
        if metric == "n_eff":
            ax.axhline(1.0, color="black", linestyle=":", label="n_eff = 1")
            ax.axhline(PAPER_TABLE10["backbone"]["n_eff"][0], color="black", linestyle="--", label="Table 10 GRPO")
        ax.set(xscale="log", xlabel="response-length cap (tokens)", title=label)
        ax.minorticks_off()
        ax.set_xticks(summary["setup"]["caps"], [str(c) for c in summary["setup"]["caps"]])
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(Path(out) / PLOT, dpi=100)
    plt.close(fig)


def estimate_seconds(sizes, temperatures, cached) -> float:
    total = 0.0
    for T in temperatures:
        if T in cached:
            continue
        n = sizes["prompts"] * sizes["samples"]
        gen = n * min(MEAN_LENGTH.get(T, 90.0), sizes["max_tokens"])
        total += VLLM_START_S + gen / GEN_TOKENS_PER_S + (gen + n * 150) / FORWARD_TOKENS_PER_S
    return total


def study_collections(sizes, generator="vllm", seed=0) -> dict:
    """{T: the study's collection at temperature T} (the committed run's: FULL, vLLM, seed 0)."""
    return {T: real_lm.Collection(prompts=sizes["prompts"], samples=sizes["samples"], temperature=T,
                                  max_tokens=sizes["max_tokens"], caps=sizes["caps"], seed=seed, generator=generator)
            for T in TEMPERATURES}  # fmt: skip


def run(args, out, workers, cache=None):
    sizes = QUICK if args.quick else FULL
    generator = args.generator or "vllm"
    temperatures = TEMPERATURES
    collections = study_collections(sizes, generator, args.seeds[0])
    cached = {T for T, c in collections.items() if real_lm.cached(c, cache)}
    estimate = estimate_seconds(sizes, temperatures, cached)
    print(f"study real-lm-geometry: {len(temperatures)} temperatures x {len(sizes['caps'])} caps x "
          f"{len(sizes['groups'])} G, {len(cached)} collection(s) cached; about {estimate / 60:.0f} min "
          "(docs/studies/real-lm-geometry.md)")  # fmt: skip
    start = time.perf_counter()
    records, seconds, resampled = [], {}, {}
    for T, collection in collections.items():
        data = real_lm.collect(collection, cache)
        real_lm.write_rollouts(data, out)
        seconds[str(T)] = data["seconds"]
        analysis = time.perf_counter()
        records += analyse(data, sizes)
        resampled.update(resample(data, sizes))
        seconds[str(T)] = {**seconds[str(T)], "analysis": time.perf_counter() - analysis}
    from openrlhf_geo.salt import SaltConfig

    config = SaltConfig()
    setup = {**sizes, "temperatures": list(temperatures), "generator": generator, "seed": args.seeds[0],
             "model": real_lm.MODEL_NAME, "features": f"{config.features}, D = {config.dim}, seed {config.seed}",
             "replicates": len(replicates(sizes["prompts"], sizes["samples"], sizes["groups"][0], sizes["m"])),
             "wall_s": time.perf_counter() - start, "estimate_s": estimate, "seconds": seconds,
             "amendment": {"seed": AMENDMENT_SEED, "prompt_replicates": PROMPT_REPLICATES,
                           "gap_replicates": GAP_REPLICATES, "null_draws": NULL_DRAWS,
                           "permutations": PERMUTATIONS}}  # fmt: skip
    (Path(out) / "records.json").write_text(json.dumps(strict_json(records), indent=1) + "\n")
    write_summary(out, summarize(records, setup, prompt_cis(records, sizes, resampled)))
    print(f"study real-lm-geometry finished: {Path(out) / 'report.md'}")
    return 0


def write_summary(out, summary):
    """<out>/summary.json, report.md and the plot of a summary, each derived before anything is written."""
    data = strict_json({**summary, "plots": [PLOT]})
    report = render(data)
    plot(summary, out)
    (Path(out) / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (Path(out) / "report.md").write_text(report)


def resummarize(directory) -> int:
    """DIR's summary.json, report.md and plot re-derived by the current code from its records.json (no model, no
    collection). Items 2-3's CIs over prompts resample the collection's Grams, which a result directory does not hold:
    they and the setup are kept from its summary.json, and the verdicts re-derived from them."""
    with real_lm.rewriting(directory) as directory:
        records = nan_json(real_lm.read_result(directory, "records.json"))
        old = real_lm.read_result(directory, "summary.json")
        try:
            kept = nan_json({"table": {key: {name: row[name] for name in PROMPT_CIS if name in row}
                                       for key, row in old["table"].items()},
                             "by_cap": old["n_eff_vs_longest_cap_prompts"]})  # fmt: skip
            write_summary(directory, summarize(records, old["setup"], kept))
        except (KeyError, TypeError, IndexError, ValueError) as error:
            raise ValueError(f"--resummarize {directory}: not a real-lm-geometry result of the amended analysis "
                             f"({type(error).__name__}: {error})") from None  # fmt: skip
    print(f"study real-lm-geometry: re-derived {directory / 'summary.json'} and {directory / 'report.md'} from "
          f"{len(records)} records")  # fmt: skip
    return 0


class RealLmGeometry(Study):
    name = "real-lm-geometry"
    options = ("generator", "resummarize")
    seed = 0  # the rollouts' sampling seed (`real_lm.Collection.seed`)

    def check(self, generator=None, resummarize=None):
        if generator not in (None, "vllm", "hf"):
            raise ValueError(f"--generator must be vllm or hf (got {generator!r})")

    def run(self, args, out, workers):
        return run(args, out, workers)

    def resummarize(self, directory):
        return resummarize(directory)


STUDY = RealLmGeometry()
