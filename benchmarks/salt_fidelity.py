"""SALT fidelity of the proxy features: the default TensorSketch next to the Kronecker sketch it replaced, vs exact.

Each regime gives the exact Gram of the LM-head-gradient features (SALT Eq. 19) and sketches of the SAME responses,
all from one set of (logits, hidden, tokens, mask): the exact Gram from `lm_head_features(..., "exact")` where V·d
is small and from `lm_head_gram` (token pairs, no features) at LLM shapes. SALT coefficients a' = salt_advantages(a,
F) from each sketch are compared with a' from the exact Gram under --draws reward draws (binary rewards, GRPO group
normalization over groups of G = 8; on demo rollouts draw 0 is the real math-verify reward), for --seeds sketch
seeds. Feature sets (rows):
    kronecker D        the Kronecker sketch at --old-dim (the default before the TensorSketch), Gram raw
    kronecker+shrink D the same features with sketch_gram's noise-aware Gram (--salt.gram shrink)
    sketch D (default) the TensorSketch at --dim (the default), Gram raw (SALT Eq. 4, what SALT runs by default)
    sketch D           the TensorSketch at each --extra-dims
Columns: Spearman of the off-diagonal Gram cosines vs exact, the sd of their error, PR relative error (signed: < 0
is the k-too-small bias), k (mean over seeds; exact k in the header) and the worst |k − exact k| over seeds,
a'-cosine vs exact (mean and worst over draws × seeds). Targets: mean a'-cosine ≥ 0.95 and every seed's k within
max(1, 10 %) of the exact k.

Regimes: (a) synthetic rollouts at a CPU-sized V = 1024, d = 128, T ∈ [16, 128]: on-policy sampling and a shared
prompt prefix (8-32 tokens sampled once per group), m ∈ {64, 256}; (b) real rollouts of the local engine's demo model
(the demo's SFT warm-up, cached in <demo-dir>/sft and reused by `openrlhf-geo demo`), G = 8 samples for 16 / 32
prompts; (c) with --real M:T, the synthetic recipe at Qwen2.5-1.5B's LM-head shape (V = 151936, d = 1536), M
responses of T/2..T tokens, on-policy and shared-prefix (logits in a temporary memory-mapped file).
Then the cost of the noise-aware Gram next to the raw one (--cost-m), measured interleaved in this run.

Usage: python benchmarks/salt_fidelity.py [--draws 30] [--seeds 3] [--dim D] [--old-dim 4096] [--extra-dims ...]
       [--demo-dir runs/demo] [--no-demo] [--no-synthetic] [--real 64:64 ...] [--real-kinds on-policy shared-prefix]
       [--no-kronecker] [--cost-m 256 1024] [--threads 2]
(--real-kinds and --no-kronecker only shorten a run: an LLM-shape regime costs minutes per kind.)
"""

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from openrlhf_geo import diagnostics, sketch_gram
from openrlhf_geo.features import DEFAULT_DIM, lm_head_features, lm_head_gram
from openrlhf_geo.lab import recipe
from openrlhf_geo.salt import salt_advantages

GROUP = 8
SYNTH_V, SYNTH_D, T_MIN, T_MAX = 1024, 128, 16, 128
LLM_V, LLM_D = 151936, 1536  # Qwen2.5-1.5B's lm_head
RANK_SHARED, RANK_PROMPT = 16, 4
TARGET_ENTROPY = 2.0  # nats per token, as in the notes
COS_TARGET, K_TOLERANCE = 0.95, 0.10


def _hidden_states(gen, d, n_groups, lengths, shared_prefix, max_prefix=32):
    """RMS-normalized hidden states per response = global mean + prompt offset + shared low-rank + prompt low-rank +
    isotropic noise; with a shared prefix each group's first L states (L ∈ [8, max_prefix]) are identical across it.
    `lengths(L)` draws one response length. Returns (list of (T_i, d), list of prefix lengths)."""
    U = torch.randn(d, RANK_SHARED, generator=gen) / math.sqrt(RANK_SHARED)
    mu = 0.5 * torch.randn(d, generator=gen)
    hiddens, prefix_len = [], []
    for _ in range(n_groups):
        U_p = torch.randn(d, RANK_PROMPT, generator=gen) / math.sqrt(RANK_PROMPT)
        c_p = 0.7 * torch.randn(d, generator=gen)

        def states(T, U_p=U_p, c_p=c_p):
            h = (
                mu
                + c_p
                + torch.randn(T, RANK_SHARED, generator=gen) @ U.T
                + torch.randn(T, RANK_PROMPT, generator=gen) @ U_p.T
                + 0.5 * torch.randn(T, d, generator=gen)
            )
            return h / h.square().mean(1, keepdim=True).sqrt()

        L = int(torch.randint(min(8, max_prefix), max_prefix + 1, (1,), generator=gen)) if shared_prefix else 0
        prefix = states(L)
        for _ in range(GROUP):
            T = lengths(L)
            hiddens.append(torch.cat([prefix, states(T - L)]))
            prefix_len.append(L)
    return hiddens, prefix_len


def _entropy_scale(probe_logits):
    """β with mean token entropy of softmax(β z) = TARGET_ENTROPY over the probe (bisection)."""
    lo, hi = 0.1, 50.0
    for _ in range(30):
        beta = (lo + hi) / 2
        logp = torch.log_softmax(beta * probe_logits, -1)
        lo, hi = (beta, hi) if -(logp.exp() * logp).sum(-1).mean() > TARGET_ENTROPY else (lo, beta)
    return beta


def synthetic_rollouts(m, seed, shared_prefix):
    """(logits (m, S, V), hidden (m, S, d), tokens (m, S), mask (m, S)) of m // GROUP prompts × GROUP responses.

    A fixed LM head W (V, d); hidden states from `_hidden_states`; logits β h Wᵀ with β set for TARGET_ENTROPY;
    tokens sampled on-policy. With a shared prefix, each group's first L tokens (hidden states and tokens) are
    identical across its responses.
    """
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(SYNTH_V, SYNTH_D, generator=gen) / math.sqrt(SYNTH_D)
    hiddens, prefix_len = _hidden_states(
        gen,
        SYNTH_D,
        m // GROUP,
        lambda L: int(torch.randint(max(T_MIN, L + 8), T_MAX + 1, (1,), generator=gen)),
        shared_prefix,
    )
    beta = _entropy_scale(torch.cat(hiddens[:16]) @ W.T)
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


def llm_rollouts(m, max_len, seed, shared_prefix, directory):
    """The synthetic recipe at V = 151936, d = 1536: responses of max_len/2..max_len tokens, on-policy (prefix: up
    to max_len/4 shared tokens). The (m, max_len, V) float32 logits live in a memory-mapped file in `directory`."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(LLM_V, LLM_D, generator=gen) / math.sqrt(LLM_D)
    hiddens, prefix_len = _hidden_states(
        gen,
        LLM_D,
        m // GROUP,
        lambda L: int(torch.randint(max(max_len // 2, L + 8), max_len + 1, (1,), generator=gen)),
        shared_prefix,
        max_prefix=max_len // 4,
    )
    beta = _entropy_scale(hiddens[0] @ W.T)
    path = Path(directory) / f"logits_{m}_{max_len}_{int(shared_prefix)}.f32"
    logits = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="w+", shape=(m, max_len, LLM_V)))
    hidden = torch.zeros(m, max_len, LLM_D)
    tokens, mask = torch.zeros(m, max_len, dtype=torch.long), torch.zeros(m, max_len, dtype=torch.bool)
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

    out = Path(demo_dir)
    train, held_out = recipe.prepare_data(out)
    recipe.warm_up(out, train, held_out, None, recipe.FULL["sft_max_steps"])  # the demo's defaults: same cache key
    model = AutoModelForCausalLM.from_pretrained(out / "sft", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(out / "sft"), train


def demo_rollouts(model, tokenizer, train, n_prompts, seed):
    """GROUP rollouts for n_prompts train prompts -> (logits, hidden, tokens, mask, rewards (m,)) from ONE forward."""
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
        max_new_tokens=recipe.MAX_NEW_TOKENS,
    )
    with torch.no_grad():
        _, logits, hidden = response_forward(
            model, batch.sequences, batch.attention_mask, batch.prompt_width, with_geometry=True
        )
    rewards = torch.tensor([float(score_answer(r, a).correct) for r, a in zip(batch.responses, batch.answers)])
    produced = slice(batch.prompt_width - 1, -1)  # the positions whose logits produced the response tokens
    return logits[:, produced], hidden[:, produced], batch.sequences[:, batch.prompt_width :], batch.mask, rewards


def features(logits, hidden, tokens, mask, method, dim=DEFAULT_DIM, seed=0, rows_per_call=32):
    """lm_head_features over row chunks (bounds the padded logits' float32 buffers)."""
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


def k_within_target(k, k_exact):
    return abs(k - k_exact) <= max(1.0, K_TOLERANCE * k_exact)


def evaluate(name, gram_exact, candidates, advantages, note=""):
    """One regime: gram_exact (m, m) = ⟨G_i, G_j⟩ float64; candidates {label: (list of F per seed, gram)}.

    Prints a row of metrics per candidate (module docstring) and returns {label: {"mean", "worst", "k_ok", ...}}.
    """
    m = gram_exact.shape[0]
    K_exact = gram_exact / m
    # SALT depends on F only through F Fᵀ: an (m, m) factor of the exact Gram gives the same a' without the
    # (m, V·d) features.
    lam, vecs = torch.linalg.eigh(K_exact * m)
    exact_factor = vecs * lam.clamp_min(0).sqrt()
    reference = [salt_advantages(a, exact_factor) for a in advantages]
    pr_exact, k_exact = reference[0][1]["pr"], reference[0][1]["k"]
    iu = torch.triu_indices(m, m, 1)
    same = (torch.arange(m) // GROUP)[iu[0]] == (torch.arange(m) // GROUP)[iu[1]]
    cos_exact = off_diagonal_cosines(K_exact, iu)
    C = torch.from_numpy(cos_exact)
    print(
        f"\n{name}: m={m}, exact PR {pr_exact:.1f} -> k {k_exact:.0f}, mean exact cosine within groups "
        f"{C[same].mean():.3f} / between {C[~same].mean():.3f} (sd {cos_exact.std():.4f}), "
        f"n_eff(a) {statistics.mean(s['n_eff_in'] for _, s in reference):.2f}{note}"
    )
    print(
        f"  {'features':<22} {'rho':>6} {'err sd':>7} {'PR err':>7} {'k':>6} {'max|dk|':>7} {'k ok':>5} "
        f"{'cos mean':>9} {'cos worst':>10} {'cos ok':>6}"
    )
    rows = {}
    for label, (sketches, gram) in candidates.items():
        cos, pr_err, ks, rho, err_sd = [], [], [], [], []
        for F in sketches:
            K = diagnostics.gram(F.double())
            cos_F = off_diagonal_cosines(K, iu)
            rho.append(spearmanr(cos_exact, cos_F).statistic)
            err_sd.append(float((cos_F - cos_exact).std()))
            for a, (a_exact, _) in zip(advantages, reference):
                out, stats = salt_advantages(a, F, gram=gram)
                cos.append(cosine(a_exact, out))
            pr_err.append(stats["pr"] / pr_exact - 1)
            ks.append(stats["k"])
        worst_dk = max(abs(k - k_exact) for k in ks)
        row = {"mean": float(np.mean(cos)), "worst": float(np.min(cos)), "dk": worst_dk, "k_exact": k_exact}
        row["k_ok"] = all(k_within_target(k, k_exact) for k in ks)
        row["cos_ok"] = row["mean"] >= COS_TARGET
        rows[label] = row
        print(
            f"  {label:<22} {np.mean(rho):6.3f} {np.mean(err_sd):7.4f} {np.mean(pr_err):+7.3f} {np.mean(ks):6.1f} "
            f"{worst_dk:7.0f} {'yes' if row['k_ok'] else 'NO':>5} {row['mean']:9.4f} {row['worst']:10.4f} "
            f"{'yes' if row['cos_ok'] else 'NO':>6}"
        )
    return rows


def candidates_for(logits, hidden, tokens, mask, args, rows_per_call=32):
    """{label: (list of per-seed features, gram)} for the feature sets of the module docstring."""
    out = {}
    if not args.no_kronecker:
        kron = [
            features(logits, hidden, tokens, mask, "kronecker", args.old_dim, s, rows_per_call)
            for s in range(args.seeds)
        ]
        out = {f"kronecker {args.old_dim}": (kron, "raw"), f"kronecker+shrink {args.old_dim}": (kron, "shrink")}
    for dim in (args.dim, *args.extra_dims):
        label = f"sketch {dim}" + (" (default)" if dim == DEFAULT_DIM else "")
        out[label] = (
            [features(logits, hidden, tokens, mask, "sketch", dim, s, rows_per_call) for s in range(args.seeds)],
            "raw",
        )
    return out  # fmt: skip


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


def parse_real(text):
    m, T = (int(x) for x in text.split(":"))
    if m % GROUP or T < 32:
        raise argparse.ArgumentTypeError(f"--real M:T needs M a multiple of {GROUP} and T >= 32 (got {text})")
    return m, T


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=30, help="reward draws per sketch seed (default 30)")
    p.add_argument("--seeds", type=int, default=3, help="sketch seeds per regime (default 3)")
    p.add_argument("--dim", type=int, default=DEFAULT_DIM, help=f"TensorSketch D (default {DEFAULT_DIM})")
    p.add_argument("--old-dim", type=int, default=4096, help="Kronecker sketch D (the old default, 4096)")
    p.add_argument("--extra-dims", type=int, nargs="*", default=[], help="more TensorSketch sizes to compare")
    p.add_argument("--demo-dir", default="runs/demo", help="where the demo's SFT checkpoint is cached (runs/demo)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo-rollout regimes")
    p.add_argument("--no-synthetic", action="store_true", help="skip the CPU-sized synthetic regimes")
    p.add_argument("--real", type=parse_real, nargs="*", default=[], help="LLM-shape regimes M:T (e.g. 64:64)")
    p.add_argument(
        "--real-kinds",
        nargs="+",
        choices=("on-policy", "shared-prefix"),
        default=["on-policy", "shared-prefix"],
        help="which LLM-shape regimes --real runs (both)",
    )
    p.add_argument("--no-kronecker", action="store_true", help="skip the Kronecker sketch rows")
    p.add_argument("--cost-m", type=int, nargs="*", default=[256, 1024], help="m for the cost table (256 1024)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(
        f"SALT fidelity vs exact features: TensorSketch D={args.dim} {args.extra_dims or ''} vs Kronecker "
        f"D={args.old_dim}, {args.seeds} sketch seeds x {args.draws} reward draws"
    )

    summary = []

    def run(name, batch, rows_per_call=32, gram_exact=None, note=""):
        logits, hidden, tokens, mask, *real = batch
        if gram_exact is None:
            exact = features(logits, hidden, tokens, mask, "exact", rows_per_call=rows_per_call).double()
            gram_exact = exact @ exact.T
        candidates = candidates_for(logits, hidden, tokens, mask, args, rows_per_call)
        advantages = reward_draws(gram_exact.shape[0], args.draws, seed=1, real=real[0] if real else None)
        summary.append((name, gram_exact.shape[0], evaluate(name, gram_exact, candidates, advantages, note)))

    if not args.no_synthetic:
        for m in (64, 256):
            for prefix in (False, True):
                run(f"synthetic {'shared-prefix' if prefix else 'on-policy'}", synthetic_rollouts(m, 0, prefix))
    if not args.no_demo:
        model, tokenizer, train = demo_model(args.demo_dir)
        for n_prompts in (16, 32):
            batch = demo_rollouts(model, tokenizer, train, n_prompts, seed=n_prompts)
            vd = batch[0].shape[2] * batch[1].shape[2]
            note = f"; V*d = {vd} <= D: the sketch is exact" if vd <= args.dim else ""
            run("demo rollouts", batch, note=note)
    with tempfile.TemporaryDirectory(prefix="salt_fidelity_") as directory:
        for m, T in args.real:
            for prefix in (kind == "shared-prefix" for kind in args.real_kinds):
                t0 = time.perf_counter()
                batch = llm_rollouts(m, T, 0, prefix, directory)
                t1 = time.perf_counter()
                gram_exact = lm_head_gram(*batch, chunk_size=512)
                t2 = time.perf_counter()
                note = f"; rollouts {t1 - t0:.0f} s, token-pair exact Gram {t2 - t1:.0f} s"
                kind = "shared-prefix" if prefix else "on-policy"
                run(f"LLM shape {kind} T<={T}", batch, rows_per_call=4, gram_exact=gram_exact, note=note)
                del batch
                for path in Path(directory).glob("*.f32"):  # 10 GB per regime at 256:64: free it now
                    path.unlink()

    print(f"\na'-cosine vs exact (mean over draws x seeds; target >= {COS_TARGET}) and k (target: every seed within")
    print("max(1, 10 %) of exact k); 'no' marks a missed target")
    labels = list(summary[0][2]) if summary else []
    print(f"  {'regime':<34} {'m':>4} {'k':>4} " + " ".join(f"{label:>24}" for label in labels))
    for name, m, rows in summary:
        cells = [
            f"{r['mean']:.4f} {'ok' if r['cos_ok'] else 'no'} dk={r['dk']:.0f} {'ok' if r['k_ok'] else 'no'}"
            for r in rows.values()
        ]
        k_exact = next(iter(rows.values()))["k_exact"]
        print(f"  {name:<34} {m:>4} {k_exact:>4.0f} " + " ".join(f"{c:>24}" for c in cells))
    if args.cost_m:
        bench_cost(args.cost_m, args.old_dim)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
