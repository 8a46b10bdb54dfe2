"""SALT fidelity of sketched features: exact vs raw sketch vs noise-aware (`shrink`) vs diagonal-only.

Each regime gives exact LM-head-gradient features (SALT Eq. 19) and Kronecker sketches (D = --dim, --seeds sketch
seeds) of the SAME responses, both from `lm_head_features` on one set of (logits, hidden, tokens, mask). SALT
coefficients a' = salt_advantages(a, F, gram=...) from each Gram estimate are compared with a' from the exact Gram
under --draws reward draws (binary rewards, GRPO group normalization over groups of G = 8; on demo rollouts draw 0 is
the real math-verify reward). Estimators:
    raw      K̂ = Φ Φᵀ/m of the sketch (SALT's gram="raw")
    shrink   sketch_gram: debiased PR, SURE-thresholded K̃ for P_k, K̂ for n_eff (gram="shrink")
    diag     only the diagonal of K̂ (every off-diagonal entry 0), same sketch
    diag*    only the EXACT diagonal: an oracle no sketch has (the baseline the issue's motivation quotes)
Columns: Spearman of the off-diagonal Gram cosines vs exact (all pairs / within prompt groups; "-" where they are all
0), PR relative error (signed: < 0 is the raw sketch's k-too-small bias), k (mean over sketch seeds; exact k in the
header) and the share of seeds with k = exact k, a'-cosine vs exact (mean and worst over draws × seeds).

Regimes: (a) synthetic rollouts at a CPU-sized V = 1024, d = 128,
T ∈ [16, 128] (the notes: V = 4096, d = 256, T ∈ [32, 256]): on-policy sampling and a shared prompt prefix (8-32
tokens sampled once per group), m ∈ {64, 256}; (b) real rollouts of the local engine's demo model (the demo's SFT
warm-up, cached in <demo-dir>/sft and reused by `openrlhf-geo demo`), G = 8 samples for 16 / 32 prompts.
Then the cost of the noise-aware Gram next to the raw one, measured interleaved in this run.

Usage: python benchmarks/salt_fidelity.py [--draws 30] [--seeds 3] [--dim 4096] [--demo-dir runs/demo] [--no-demo]
       [--cost-m 256 1024] [--threads 2]
"""

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from openrlhf_geo import diagnostics, sketch_gram
from openrlhf_geo.features import lm_head_features
from openrlhf_geo.salt import salt_advantages

GROUP = 8
ESTIMATORS = ("raw", "shrink", "diag", "diag*")
SYNTH_V, SYNTH_D, T_MIN, T_MAX = 1024, 128, 16, 128
RANK_SHARED, RANK_PROMPT = 16, 4
TARGET_ENTROPY = 2.0  # nats per token, as in the notes
GOAL_MARGIN, DEMO_GOAL = 0.01, 0.95
SHRINK_STATS = ("gram_noise", "gram_threshold", "gram_kept")


def synthetic_rollouts(m, seed, shared_prefix):
    """(logits (m, S, V), hidden (m, S, d), tokens (m, S), mask (m, S)) of m // GROUP prompts × GROUP responses.

    A fixed LM head W (V, d); RMS-normalized hidden states = global mean + prompt offset + shared low-rank +
    prompt low-rank + isotropic noise; logits β h Wᵀ with β set for TARGET_ENTROPY; tokens sampled on-policy. With a
    shared prefix, each group's first L tokens (hidden states and tokens) are identical across its responses.
    """
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(SYNTH_V, SYNTH_D, generator=gen) / math.sqrt(SYNTH_D)
    U = torch.randn(SYNTH_D, RANK_SHARED, generator=gen) / math.sqrt(RANK_SHARED)
    mu = 0.5 * torch.randn(SYNTH_D, generator=gen)
    hiddens, prefix_len = [], []
    for _ in range(m // GROUP):
        U_p = torch.randn(SYNTH_D, RANK_PROMPT, generator=gen) / math.sqrt(RANK_PROMPT)
        c_p = 0.7 * torch.randn(SYNTH_D, generator=gen)

        def states(T, U_p=U_p, c_p=c_p):
            h = (
                mu
                + c_p
                + torch.randn(T, RANK_SHARED, generator=gen) @ U.T
                + torch.randn(T, RANK_PROMPT, generator=gen) @ U_p.T
                + 0.5 * torch.randn(T, SYNTH_D, generator=gen)
            )
            return h / h.square().mean(1, keepdim=True).sqrt()

        L = int(torch.randint(8, 33, (1,), generator=gen)) if shared_prefix else 0
        prefix = states(L)
        for _ in range(GROUP):
            T = int(torch.randint(max(T_MIN, L + 8), T_MAX + 1, (1,), generator=gen))
            hiddens.append(torch.cat([prefix, states(T - L)]))
            prefix_len.append(L)
    probe = torch.cat(hiddens[:16])
    lo, hi = 0.1, 50.0  # bisect β for the target mean entropy
    for _ in range(30):
        beta = (lo + hi) / 2
        logp = torch.log_softmax(beta * probe @ W.T, -1)
        lo, hi = (beta, hi) if -(logp.exp() * logp).sum(-1).mean() > TARGET_ENTROPY else (lo, beta)
    S = max(h.shape[0] for h in hiddens)
    logits, hidden = torch.zeros(m, S, SYNTH_V), torch.zeros(m, S, SYNTH_D)
    tokens, mask = torch.zeros(m, S, dtype=torch.long), torch.zeros(m, S, dtype=torch.bool)
    shared = {}
    for i, (h, L) in enumerate(zip(hiddens, prefix_len)):
        z = beta * h @ W.T
        y = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)[:, 0]
        if L:
            y[:L] = shared.setdefault(i // GROUP, y[:L].clone())
        T = h.shape[0]
        logits[i, :T], hidden[i, :T], tokens[i, :T], mask[i, :T] = z, h, y, True
    return logits, hidden, tokens, mask


def demo_model(demo_dir):
    """The demo's SFT-warmed model and tokenizer (trained once into <demo_dir>/sft, then reused) and its train rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_geo.local import demo

    out = Path(demo_dir)
    train, held_out = demo.prepare_data(out)
    demo.warm_up(out, train, held_out, None, demo.FULL["sft_max_steps"])  # the demo's defaults: same cache key
    model = AutoModelForCausalLM.from_pretrained(out / "sft", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(out / "sft"), train


def demo_rollouts(model, tokenizer, train, n_prompts, seed):
    """GROUP rollouts for n_prompts train prompts -> (logits, hidden, tokens, mask, rewards (m,)) from ONE forward."""
    from openrlhf_geo.local import demo
    from openrlhf_geo.local.engine import generate_rollouts, response_forward
    from openrlhf_geo.rewards.math_verify import score_answer

    rows = random.Random(seed).sample(train, n_prompts)
    torch.manual_seed(seed)
    batch = generate_rollouts(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        [r["answer"] for r in rows],
        GROUP,
        max_new_tokens=demo.MAX_NEW_TOKENS,
    )
    with torch.no_grad():
        _, logits, hidden = response_forward(
            model, batch.sequences, batch.attention_mask, batch.prompt_width, with_hidden=True
        )
    rewards = torch.tensor([float(score_answer(r, a).correct) for r, a in zip(batch.responses, batch.answers)])
    return logits, hidden, batch.sequences[:, batch.prompt_width :], batch.mask, rewards


def features(logits, hidden, tokens, mask, method, dim=4096, seed=0, rows_per_call=32):
    """lm_head_features over row chunks (bounds the padded logits' float32 softmax buffer)."""
    return torch.cat(
        [
            lm_head_features(logits[s : s + rows_per_call], hidden[s : s + rows_per_call],
                             tokens[s : s + rows_per_call], mask[s : s + rows_per_call], method, dim, seed)
            for s in range(0, len(logits), rows_per_call)
        ]
    )  # fmt: skip


def group_advantages(rewards):
    """GRPO: (r − mean_g) / (std_g + 1e-6) over consecutive groups of GROUP (Bessel std; 0 for uniform groups)."""
    r = rewards.double().reshape(-1, GROUP)
    std = r.std(1, keepdim=True)
    return torch.where(std > 0, (r - r.mean(1, keepdim=True)) / (std + 1e-6), 0.0).reshape(-1)


def reward_draws(m, draws, seed, real=None):
    gen = torch.Generator().manual_seed(seed)
    out = [group_advantages(torch.randint(0, 2, (m,), generator=gen)) for _ in range(draws)]
    if real is not None:
        out[0] = group_advantages(real)
    return out


def off_diagonal_cosines(K, iu):
    norm = K.diagonal().clamp_min(1e-300).sqrt()
    return (K / norm[:, None] / norm[None, :])[iu[0], iu[1]].numpy()


def cosine(x, y):
    den = float(x.norm() * y.norm())
    return float(x @ y) / den if den > 0 else float("nan")


def evaluate(name, exact, sketches, advantages):
    """One regime: a row of metrics per estimator (see the module docstring) -> dict estimator -> metrics."""
    m = exact.shape[0]
    K_exact = diagnostics.gram(exact.double())
    # SALT depends on F only through F Fᵀ: an (m, m) factor of the exact Gram gives the same a' without re-running
    # the (m, V·d) product per draw.
    lam, vecs = torch.linalg.eigh(K_exact * m)
    exact_factor = vecs * lam.clamp_min(0).sqrt()
    reference = [salt_advantages(a, exact_factor) for a in advantages]
    pr_exact, k_exact = reference[0][1]["pr"], reference[0][1]["k"]
    iu = torch.triu_indices(m, m, 1)
    same = (torch.arange(m) // GROUP)[iu[0]] == (torch.arange(m) // GROUP)[iu[1]]
    cos_exact = off_diagonal_cosines(K_exact, iu)
    exact_diag = torch.diag(exact.double().norm(dim=1))
    results = {e: {"cos": [], "pr": [], "k": [], "rho": [], "rho_in": []} for e in ESTIMATORS}
    noise_sd, gram_stats, trace_ratio = [], [], []
    for F in sketches:
        K, noise = sketch_gram.gram_and_noise(F)
        shrunk, stats = sketch_gram.shrink(K, noise)
        noise_sd.append(float((off_diagonal_cosines(K, iu) - cos_exact).std()))
        trace_ratio.append(float(K.trace() / K_exact.trace()))  # noise shared by every entry (a common scale)
        gram_stats.append(stats)
        for est in ESTIMATORS:
            r = results[est]
            if est in ("raw", "shrink"):
                K_est = K if est == "raw" else shrunk
                cos_est = off_diagonal_cosines(K_est, iu)
                r["rho"].append(spearmanr(cos_exact, cos_est).statistic)
                r["rho_in"].append(spearmanr(cos_exact[same], cos_est[same]).statistic)
            # diagonal-only: (m, m) features diag(‖φ_i‖) have the Gram diag(K̂_ii)
            Fe = {"raw": F, "shrink": F, "diag": torch.diag(F.double().norm(dim=1)), "diag*": exact_diag}[est]
            gram = "shrink" if est == "shrink" else "raw"
            for a, (a_exact, _) in zip(advantages, reference):
                out, stats = salt_advantages(a, Fe, gram=gram)
                r["cos"].append(cosine(a_exact, out))
            r["pr"].append(stats["pr"] / pr_exact - 1)
            r["k"].append(stats["k"])
    C = K_exact / K_exact.diagonal().sqrt()[:, None] / K_exact.diagonal().sqrt()[None, :]
    within, between = C[iu[0], iu[1]][same].mean(), C[iu[0], iu[1]][~same].mean()
    print(
        f"\n{name}: m={m}, exact PR {pr_exact:.1f} -> k {k_exact:.0f}, mean exact cosine within groups "
        f"{within:.3f} / between {between:.3f}, n_eff(a) {statistics.mean(s['n_eff_in'] for _, s in reference):.2f}"
    )
    noise_share, threshold, kept = (np.mean([g[key] for g in gram_stats]) for key in SHRINK_STATS)
    print(
        f"  off-diagonal cosines: exact sd {cos_exact.std():.4f}, sketch error sd {np.mean(noise_sd):.4f}; "
        f"estimated noise share of the sketch's off-diagonal energy {noise_share:.2f}; shrink: SURE threshold "
        f"{threshold:.2f} noise sd, {kept:.0%} of off-diagonal entries kept; tr(sketch K) / tr(exact K) over the "
        f"sketch seeds {min(trace_ratio):.3f}-{max(trace_ratio):.3f}"
    )
    print(
        f"  {'estimator':<9} {'rho all':>8} {'rho in':>8} {'PR err':>8} {'k':>6} {'k = ex':>7} "
        f"{'cos mean':>9} {'cos worst':>10}"
    )
    rows = {}
    for est, r in results.items():
        rho = f"{np.mean(r['rho']):8.3f} {np.mean(r['rho_in']):8.3f}" if r["rho"] else f"{'-':>8} {'-':>8}"
        k_match = np.mean([k == k_exact for k in r["k"]])
        rows[est] = {"mean": float(np.mean(r["cos"])), "worst": float(np.min(r["cos"]))}
        print(
            f"  {est:<9} {rho} {np.mean(r['pr']):+8.3f} {np.mean(r['k']):6.1f} {k_match:7.2f} "
            f"{rows[est]['mean']:9.4f} {rows[est]['worst']:10.4f}"
        )
    return rows


def bench_cost(sizes, dim, reps=3):
    """Noise-aware Gram (gram_and_noise + shrink + debiased PR) vs the raw Gram, timed interleaved."""
    print(
        f"\ncost of the Gram estimate, D={dim}, {torch.get_num_threads()} threads (min over {reps} interleaved reps)"
    )
    print(f"  {'m':>5} {'raw ms':>9} {'noise-aware ms':>15} {'ratio':>7}")
    gen = torch.Generator().manual_seed(0)
    for m in sizes:
        F = torch.randn(m, dim, generator=gen)
        times = {"raw": [], "shrink": []}
        for _ in range(reps):
            start = time.perf_counter()
            diagnostics.gram(F)
            times["raw"].append(time.perf_counter() - start)
            start = time.perf_counter()
            K, noise = sketch_gram.gram_and_noise(F)
            sketch_gram.shrink(K, noise)
            sketch_gram.participation_ratio(K, noise)
            times["shrink"].append(time.perf_counter() - start)
        raw, shrink = min(times["raw"]), min(times["shrink"])
        print(f"  {m:>5} {raw * 1e3:>9.1f} {shrink * 1e3:>15.1f} {shrink / raw:>7.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=30, help="reward draws per sketch seed (default 30)")
    p.add_argument("--seeds", type=int, default=3, help="sketch seeds per regime (default 3)")
    p.add_argument("--dim", type=int, default=4096, help="sketch dimension D (default 4096)")
    p.add_argument("--demo-dir", default="runs/demo", help="where the demo's SFT checkpoint is cached (runs/demo)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo-rollout regimes")
    p.add_argument("--cost-m", type=int, nargs="*", default=[256, 1024], help="m for the cost table (256 1024)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(f"SALT fidelity vs exact features: D={args.dim}, {args.seeds} sketch seeds x {args.draws} reward draws")

    regimes = []
    for m in (64, 256):
        for prefix in (False, True):
            regimes.append(
                (f"synthetic {'shared-prefix' if prefix else 'on-policy'}", synthetic_rollouts(m, 0, prefix))
            )
    if not args.no_demo:
        model, tokenizer, train = demo_model(args.demo_dir)
        for n_prompts in (16, 32):
            regimes.append(("demo rollouts", demo_rollouts(model, tokenizer, train, n_prompts, seed=n_prompts)))

    summary = []
    for name, (logits, hidden, tokens, mask, *real) in regimes:
        exact = features(logits, hidden, tokens, mask, "exact")
        sketches = [features(logits, hidden, tokens, mask, "sketch", args.dim, s) for s in range(args.seeds)]
        advantages = reward_draws(exact.shape[0], args.draws, seed=1, real=real[0] if real else None)
        summary.append((name, exact.shape[0], evaluate(name, exact, sketches, advantages)))

    print("\na'-cosine vs exact (mean over draws x seeds): goal shrink >= max(raw, diag) + 0.01; demo shrink >= 0.95")
    print(f"  {'regime':<24} {'m':>4} {'raw':>7} {'diag':>7} {'shrink':>7} {'margin':>7} {'goal':>5} {'diag*':>7}")
    for name, m, rows in summary:
        best = max(rows["raw"]["mean"], rows["diag"]["mean"])
        margin = rows["shrink"]["mean"] - best
        met = margin >= GOAL_MARGIN and (not name.startswith("demo") or rows["shrink"]["mean"] >= DEMO_GOAL)
        print(
            f"  {name:<24} {m:>4} {rows['raw']['mean']:7.4f} {rows['diag']['mean']:7.4f} {rows['shrink']['mean']:7.4f}"
            f" {margin:+7.4f} {'met' if met else 'NOT':>5} {rows['diag*']['mean']:7.4f}"
        )
    if args.cost_m:
        bench_cost(args.cost_m, args.dim)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
