"""SALT overhead at Qwen2.5-1.5B scale (the feature-cost and solve-time targets), side by side in one run.

1. Feature cost / logits-matmul cost: `lm_head_features(..., "sketch")` given the logits, against the LM-head matmul
   z = h Wᵀ that produced them (V=151936, d=1536), per token, for T tokens and sketch sizes D (goal: ≤ 5 % at D=4096),
   plus the softmax alone (part of the feature cost; the policy forward computes one too) and a chunk-size sweep.
2. SALT solve time `salt_advantages(a, F)` for m rollouts (goals: ≤ 50 ms at m=1024, ≤ 1 s at m=4096): the Gram
   K = F Fᵀ/m timed separately from the solve (PR, top-k eigvecs, α, a'; salt's own `solve_ms`) and the whole call.

Timings are min and median over repeats, interleaved so each ratio compares calls made under the same load.
Usage: python benchmarks/salt_overhead.py [--part features|salt|all] [--reps N] [--threads 2]
"""

import argparse
import math
import os
import statistics
import time

import torch

from openrlhf_geo.features import DEFAULT_CHUNK_SIZE, lm_head_features, sketch_projections

V, HIDDEN = 151936, 1536


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(times):
    return min(times), statistics.median(times)


def feature_cases(T, weight, gen, dims, chunks):
    """Callables timed for T tokens: the logits matmul, the softmax alone, and lm_head_features per D/chunk."""
    hidden = torch.randn(1, T, HIDDEN, generator=gen)
    logits = 4.0 * hidden @ weight.T  # sharper than random init, like a trained LM
    tokens = torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen).T
    mask = torch.ones(1, T, dtype=torch.bool)
    cases = {
        "logits matmul": lambda: hidden @ weight.T,
        "softmax alone": lambda: [torch.softmax(c, -1) for c in logits[0].split(DEFAULT_CHUNK_SIZE)],
    }
    for dim in dims:
        cases[f"sketch D={dim}"] = lambda dim=dim: lm_head_features(logits, hidden, tokens, mask, "sketch", dim)
    for chunk in chunks:
        cases[f"D=4096 chunk={chunk}"] = lambda chunk=chunk: lm_head_features(
            logits, hidden, tokens, mask, "sketch", 4096, chunk_size=chunk
        )
    return cases


def bench_features(reps, token_counts=(64, 256), dims=(1024, 4096), chunks=(64, 128, 512)):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
    for dim in dims:
        t = timed(lambda dim=dim: sketch_projections(V, HIDDEN, dim, seed=0))
        print(f"projections D={dim}: generated once per process in {t * 1e3:.0f} ms, then cached")
    print(f"\n[1] feature cost vs logits matmul z = h W^T, V={V}, d={HIDDEN}, chunk_size={DEFAULT_CHUNK_SIZE}")
    print(f"{'T':>5} {'what':>18} {'min ms':>9} {'med ms':>9} {'us/token':>9} {'ratio min':>10} {'ratio med':>10}")
    for T in token_counts:
        # the chunk-size sweep only at the largest T
        cases = feature_cases(T, weight, gen, dims, chunks if T == max(token_counts) else ())
        for fn in cases.values():  # warm-up
            fn()
        times = {name: [] for name in cases}
        for _ in range(reps):
            for name, fn in cases.items():
                times[name].append(timed(fn))
        stats = {name: summary(ts) for name, ts in times.items()}
        for dim in dims:  # what the sketch adds on top of a softmax the caller may already compute
            stats[f"D={dim} - softmax"] = tuple(
                a - b for a, b in zip(stats[f"sketch D={dim}"], stats["softmax alone"])
            )
        base_min, base_med = stats["logits matmul"]
        for name, (t_min, t_med) in stats.items():
            print(
                f"{T:>5} {name:>18} {t_min * 1e3:>9.1f} {t_med * 1e3:>9.1f} {t_min / T * 1e6:>9.0f}"
                f" {t_min / base_min:>10.1%} {t_med / base_med:>10.1%}"
            )


def powerlaw_features(m, dim, gen, rank=1024):
    """(m, dim) float32 whose Gram spectrum decays like λ_j ∝ 1/j over `rank` directions: PR ≈ 21 / 32 / 34 at
    m = 256 / 1024 / 4096, the few-dozen-directions regime of real rollouts (docs/architecture.md §4)."""
    r = min(m, rank)
    spectrum = torch.arange(1, r + 1, dtype=torch.float32).rsqrt()
    return (torch.randn(m, r, generator=gen) * spectrum) @ torch.randn(r, dim, generator=gen) / math.sqrt(dim)


def bench_salt(reps, sizes=(256, 1024, 4096), dim=4096, group=8):
    try:
        from openrlhf_geo.diagnostics import gram
        from openrlhf_geo.salt import salt_advantages
    except ImportError as err:
        print(f"\n[2] skipped: openrlhf_geo.salt.salt_advantages is not available ({err})")
        return
    print(f"\n[2] SALT on power-law features (m, D={dim}) float32, groups of {group}, variant full; ms: min / median")
    print("    Gram = diagnostics.gram (float32 product, float64 result: what salt_advantages forms),")
    print("    f32 matmul = the bare F @ F.T / m for comparison;")
    print("    solve = stats['solve_ms'] (K -> a': PR, top-k eigvecs, alpha, a'); total = the whole call")
    print(f"{'m':>5} {'k=PR':>5} {'Gram':>15} {'f32 matmul':>15} {'solve':>15} {'total':>15}")
    gen = torch.Generator().manual_seed(1)
    for m in sizes:
        features = powerlaw_features(m, dim, gen)
        rewards = (torch.rand(m // group, group, generator=gen) < 0.4).float()
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)
        salt_advantages(adv, features)  # warm-up
        times = {"Gram": [], "f32 matmul": [], "solve": [], "total": []}
        for _ in range(reps if m < 4096 else min(reps, 3)):
            times["Gram"].append(timed(lambda features=features: gram(features)))
            times["f32 matmul"].append(timed(lambda features=features: features @ features.T / features.shape[0]))
            start = time.perf_counter()
            _, stats = salt_advantages(adv, features)
            times["total"].append(time.perf_counter() - start)
            times["solve"].append(stats["solve_ms"] / 1e3)
        cells = [f"{1e3 * min(ts):>7.1f} /{1e3 * statistics.median(ts):>6.1f}" for ts in times.values()]
        print(f"{m:>5} {int(stats['k']):>5} " + " ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("features", "salt", "all"), default="all")
    parser.add_argument("--reps", type=int, default=3, help="timed repeats per case (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; min and median over {args.reps} repeats")
    print(f"load average at start (other processes share these cores): {os.getloadavg()[0]:.1f}")
    if args.part in ("features", "all"):
        bench_features(args.reps)
    if args.part in ("salt", "all"):
        bench_salt(args.reps)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
