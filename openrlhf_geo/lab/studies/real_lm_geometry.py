"""`openrlhf-geo study real-lm-geometry`: SALT's geometry of GRPO batches of a real pretrained LM's rollouts (SALT
arXiv 2606.05800 §2.2, Fig. 2, Table 10's backbone row, App. D.1), no training.
Protocol: docs/studies/real-lm-geometry.md.

Per temperature, one collection (`real_lm.collect`): 64 word problems x 16 samples of SmolLM2-135M-Instruct (a 4-bit
quantization of the release), their rewards and SALT's default proxy Gram at each response-length cap. A condition
(T, cap, G) is analysed on 4 disjoint batches of m = 256 rollouts (B = 256 / G prompts x G samples: SALT §4.4's fixed
budget; G = 8 is Table 4's 32 x 8): GRPO advantages (group_norm) -> n_eff (Eq. 6/60), PR (Eq. 5), k_t (Eq. 14),
SALT's a' (Eq. 18) with its α_t (Eq. 17), D_a / D_g (Eq. 59), U⊥ gain (Eq. 61), sign flips and ‖a'‖/‖a‖, and App.
D.1's within-group statistics. Each number: the mean over the 4 batches with a 95 % percentile-bootstrap CI.
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
)
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


def analyse_batch(rewards, gram, lengths, samples_per_prompt) -> dict:
    """One batch of m rollouts (rows grouped by prompt, G each): GRPO advantages and SALT's geometry of them; the
    geometry is NaN (signal 0) when every group is tied (a = 0: GRPO makes no update, Eq. 6 is 0/0)."""
    from openrlhf_geo import diagnostics
    from openrlhf_geo.local.engine import group_advantages
    from openrlhf_geo.salt import salt_advantages

    m = rewards.numel()
    group_ids = torch.arange(m) // samples_per_prompt
    a = group_advantages(rewards.double(), group_ids, "group_norm")  # upstream's GRPO: Bessel std, eps 1e-9
    factor = gram_factor(gram)
    new, stats, geo = salt_advantages(a, factor, return_basis=True)
    weights = diagnostics.salt_weight_stats(a, new, geo.gram, geo.basis, geo.is_top, lengths)
    groups = diagnostics.group_geometry(a, geo.gram, group_ids, is_gram=True)
    tied = rewards.view(-1, samples_per_prompt)
    context = {
        "accuracy": float(rewards.mean()),
        "mixed": float(((tied.min(1).values != tied.max(1).values).double()).mean()),
        "length": float(lengths.double().mean()),
    }
    if not bool((a != 0).any()):  # every group tied: no GRPO update, so no cancellation to measure (n_eff 0/0)
        return {**dict.fromkeys(METRICS, math.nan), **context, "signal": 0.0}
    return {
        "n_eff": stats["n_eff_in"],
        "pr": stats["pr"],
        "k": stats["k"],
        "alpha": stats["alpha"],
        "n_eff_salt": stats["n_eff_out"],
        "D_a": stats["D_a"],
        "D_g": stats["D_g"],
        "U_perp_gain": stats["U_perp_gain"],
        "sign_flip": weights["sign_flip"],
        "norm_ratio": math.sqrt(weights["kept"]) if math.isfinite(weights["kept"]) else math.nan,
        "n_eff_group": groups["n_eff_group"],
        "n_eff_means": groups["n_eff_means"],
        "r_in": groups["r_in"],
        "r_total": groups["r_total"],
        "pr_in": groups["pr_in"],
        **context,
        "signal": 1.0,
    }


def analyse(data, setup) -> list[dict]:
    """Every (cap, G) condition of one collection on its disjoint batches -> records."""
    records = []
    collection = data["collection"]
    for cap in setup["caps"]:
        geometry, rewards = data["geometry"][cap], data["rewards"][cap]
        lengths = torch.as_tensor(geometry["lengths"])
        # the response tokens of a rollout still unfinished at the cap: T_i = cap, no EOS among them
        finished_by_cap = torch.tensor([len(r) <= cap and r[-1] == data["eos"] for r in data["response_ids"]])
        for G in setup["groups"]:
            for r, rows in enumerate(replicates(collection["prompts"], collection["samples"], G, setup["m"])):
                idx = torch.as_tensor(rows)
                record = analyse_batch(rewards[idx], geometry["gram"][idx][:, idx], lengths[idx], G)
                record["truncated"] = float((~finished_by_cap[idx]).double().mean())
                records.append({"T": collection["temperature"], "cap": cap, "G": G, "replicate": r, **record})
    return records


def interval(values) -> dict:
    from openrlhf_geo.lab.studies.salt_proxy import interval as seed_interval

    v = [x for x in values if math.isfinite(x)]
    return seed_interval(v)


def regime(row) -> str:
    """The protocol's rule on n_eff(a): in SALT's regime if the CI lies below 1, outside if above, else undecided
    (over the batches with a learning signal)."""
    if row["n"] < 2:
        return "no verdict (fewer than two batches with a learning signal)"
    if row["high"] < 1:
        return "in SALT's regime (n_eff < 1)"
    if row["low"] > 1:
        return "outside SALT's regime (n_eff > 1)"
    return "not decided (the CI contains 1)"


def summarize(records, setup) -> dict:
    from openrlhf_geo.eval.metrics import paired_gain

    conditions = {}
    for rec in records:
        conditions.setdefault((rec["T"], rec["cap"], rec["G"]), []).append(rec)
    table = {}
    for (T, cap, G), rows in conditions.items():
        rows = sorted(rows, key=lambda r: r["replicate"])
        entry = {metric: interval([r[metric] for r in rows]) for metric in METRICS}
        entry["regime"] = regime(entry["n_eff"])
        entry["per_batch_n_eff"] = [r["n_eff"] for r in rows]
        table[f"T={T} cap={cap} G={G}"] = {"T": T, "cap": cap, "G": G, **entry}
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
    return {"study": "real-lm-geometry", "setup": setup, "table": table, "n_eff_vs_longest_cap": by_cap,
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
        "accuracy | mixed groups | length | truncated | regime (rule) |",
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
    paper = summary["paper_table10"]
    lines += ["", f"SALT Table 10 (7B, MATH-TRAIN): GRPO backbone n_eff {paper['backbone']['n_eff'][0]} ± "
              f"{paper['backbone']['n_eff'][1]}; + SALT D_a {paper['salt']['D_a'][0]}, D_g {paper['salt']['D_g'][0]}, "
              f"n_eff {paper['salt']['n_eff'][0]}, U⊥ gain {paper['salt']['U_perp_gain'][0]}x. The demo's tiny model: "
              f"GRPO n_eff {summary['tiny_demo_n_eff']}."]  # fmt: skip
    plots = summary.get("plots", [])
    lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)] if plots else []
    return "\n".join(lines) + "\n"


def plot(summary, out) -> str:
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
    name = "geometry_by_cap.png"
    fig.savefig(Path(out) / name, dpi=100)
    plt.close(fig)
    return name


def estimate_seconds(sizes, temperatures, cached) -> float:
    total = 0.0
    for T in temperatures:
        if T in cached:
            continue
        n = sizes["prompts"] * sizes["samples"]
        gen = n * min(MEAN_LENGTH.get(T, 90.0), sizes["max_tokens"])
        total += VLLM_START_S + gen / GEN_TOKENS_PER_S + (gen + n * 150) / FORWARD_TOKENS_PER_S
    return total


def run(args, out, workers, cache=None):
    sizes = QUICK if args.quick else FULL
    generator = args.generator or "vllm"
    temperatures = TEMPERATURES
    collections = {
        T: real_lm.Collection(
            prompts=sizes["prompts"],
            samples=sizes["samples"],
            temperature=T,
            max_tokens=sizes["max_tokens"],
            caps=sizes["caps"],
            seed=args.seeds[0],
            generator=generator,
        )  # fmt: skip
        for T in temperatures
    }
    cached = {T for T, c in collections.items() if real_lm.cached(c, cache)}
    estimate = estimate_seconds(sizes, temperatures, cached)
    print(f"study real-lm-geometry: {len(temperatures)} temperatures x {len(sizes['caps'])} caps x "
          f"{len(sizes['groups'])} G, {len(cached)} collection(s) cached; about {estimate / 60:.0f} min "
          "(docs/studies/real-lm-geometry.md)")  # fmt: skip
    start = time.perf_counter()
    records, seconds = [], {}
    for T, collection in collections.items():
        data = real_lm.collect(collection, cache)
        seconds[str(T)] = data["seconds"]
        records += analyse(data, sizes)
    from openrlhf_geo.salt import SaltConfig

    config = SaltConfig()
    setup = {**sizes, "temperatures": list(temperatures), "generator": generator, "seed": args.seeds[0],
             "model": real_lm.MODEL_NAME, "features": f"{config.features}, D = {config.dim}, seed {config.seed}",
             "replicates": len(replicates(sizes["prompts"], sizes["samples"], sizes["groups"][0], sizes["m"])),
             "wall_s": time.perf_counter() - start, "estimate_s": estimate, "seconds": seconds}  # fmt: skip
    summary = summarize(records, setup)
    summary["plots"] = [plot(summary, out)]
    data = strict_json(summary)
    (Path(out) / "records.json").write_text(json.dumps(strict_json(records), indent=1) + "\n")
    (Path(out) / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(data))
    print(f"study real-lm-geometry finished: {Path(out) / 'report.md'}")
    return 0


class RealLmGeometry(Study):
    name = "real-lm-geometry"
    options = ("generator",)
    seed = 0  # the rollouts' sampling seed (`real_lm.Collection.seed`)

    def check(self, generator=None):
        if generator not in (None, "vllm", "hf"):
            raise ValueError(f"--generator must be vllm or hf (got {generator!r})")

    def run(self, args, out, workers):
        return run(args, out, workers)


STUDY = RealLmGeometry()
