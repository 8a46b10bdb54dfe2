"""SALT overhead at Qwen2.5-1.5B scale (the feature-cost and solve-time targets), side by side in one run.

1. Feature cost / logits-matmul cost: `lm_head_features` given the logits, against the LM-head matmul z = h Wᵀ that
   produced them (V=151936, d=1536), for T tokens: the default TensorSketch (`sketch`, D = DEFAULT_DIM) next to the
   Kronecker sketch it replaced (`kronecker`, D = 4096), plus a softmax alone (the Kronecker sketch computes one; the
   TensorSketch only an exp pass) and, at the largest T, TensorSketch sizes and CPU tile sizes (goal: ≤ 5 %).
   In the fork, Actor.forward takes the log-probs of the action tokens from the sketch's own exp pass and skips
   upstream's `log_probs_from_logits` (patches/openrlhf.models.actor.diff), so the features' cost there is
   "sketch D + log-probs" minus upstream's log-prob pass on the same tokens: printed as "fork's extra, D=…".
   Upstream's pass is its own function, loaded from the installed openrlhf (on a GPU with flash-attn, its
   Triton cross-entropy, as upstream runs it).
2. SALT on m rollouts: the Gram K = F Fᵀ/m (diagnostics.gram) and the solve (PR, top-k eigvecs, α, a'; salt's own
   `solve_ms`) of `salt_advantages(a, F)` for the features' width D of each sketch (goal: Gram + solve ≤ 1 s at
   m = 1024 for the default D), and the whole call.

Timings are min and median over repeats, interleaved so each ratio compares calls made under the same load.
On a GPU (`--device cuda`, part 1 only) the LM head runs in bf16, as a model's does, and the features read its
logits cast to float32, as `Actor.forward` casts them (its log-prob pass, which the fork pays anyway, is timed too).
Usage: python benchmarks/salt_overhead.py [--part features|salt|all] [--reps N] [--threads 2] [--device cpu|cuda]
       [--dims 4096 102400] [--sizes 256 1024]
"""

import argparse
import ast
import importlib.util
import math
import os
import statistics
import time

import torch

from openrlhf_geo import features as feature_module
from openrlhf_geo.features import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DIM,
    kronecker_projections,
    lm_head_features,
    sketch_hashes,
)

V, HIDDEN = 151936, 1536
OLD_DIM = 4096  # the Kronecker sketch's D when it was the default


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None  # a GPU call only queues work
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def with_tile(tile, fn):
    """fn run with features.EXP_TILE = tile (the CPU tile of the TensorSketch), restored after."""

    def run():
        saved, feature_module.EXP_TILE = feature_module.EXP_TILE, tile
        try:
            return fn()
        finally:
            feature_module.EXP_TILE = saved

    return run


def upstream_log_probs():
    """openrlhf 0.11.2's `models/utils.py::log_probs_from_logits` (with its `_logsumexp_by_chunk`), compiled from
    that file's source without importing it (the module imports deepspeed, and openrlhf.models flash-attn), or None
    when openrlhf is not installed. On a GPU with flash-attn it runs flash-attn's Triton cross-entropy, as upstream."""
    spec = importlib.util.find_spec("openrlhf")  # locates the package without running it
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "models", "utils.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    wanted = ("_logsumexp_by_chunk", "log_probs_from_logits")
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), namespace)
    return namespace["log_probs_from_logits"]


def feature_cases(T, weight, gen, sweep, log_probs_from_logits):
    """Callables timed for T tokens: the logits matmul, the softmax alone, each sketch (and the sweep's variants)."""
    device = weight.device
    hidden = torch.randn(1, T, HIDDEN, generator=gen).to(device, weight.dtype)
    logits = (4.0 * hidden @ weight.T).float()  # sharper than random init, like a trained LM
    tokens = torch.multinomial(torch.softmax(logits[0].cpu(), -1), 1, generator=gen).T.to(device)
    mask = torch.ones(1, T, dtype=torch.bool, device=device)

    def features(method, dim, **kwargs):
        return lambda: lm_head_features(logits, hidden, tokens, mask, method, dim, **kwargs)

    cases = {
        "logits matmul": lambda: hidden @ weight.T,
        "softmax alone": lambda: [torch.softmax(c, -1) for c in logits[0].split(DEFAULT_CHUNK_SIZE)],
        f"kronecker D={OLD_DIM}": features("kronecker", OLD_DIM),
        f"sketch D={DEFAULT_DIM}": features("sketch", DEFAULT_DIM),
        # the fork's pass: features and the action tokens' log-probs from one exp pass over the logits
        f"sketch D={DEFAULT_DIM} + log-probs": features("sketch", DEFAULT_DIM, return_log_probs=True),
    }
    if log_probs_from_logits is not None:  # what Actor.forward computes from the same float32 logits upstream
        cases["log-probs (upstream)"] = lambda: log_probs_from_logits(logits, tokens)
    if sweep:
        for dim in (25600, 65536):
            cases[f"sketch D={dim} + log-probs"] = features("sketch", dim, return_log_probs=True)
        for tile in (4, 32):
            cases[f"sketch tile={tile}"] = with_tile(tile, features("sketch", DEFAULT_DIM))
        for chunk in (64, 1024):
            cases[f"sketch chunk={chunk}"] = features("sketch", DEFAULT_DIM, chunk_size=chunk)
    return cases


def bench_features(reps, token_counts=(64, 256), device="cpu"):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
    if device != "cpu":  # the LM head in a model's dtype
        weight = weight.to(device, torch.bfloat16)
    t = timed(lambda: kronecker_projections(V, HIDDEN, OLD_DIM, seed=0))
    print(f"kronecker projections D={OLD_DIM}: generated once per process in {t * 1e3:.0f} ms, then cached")
    t = timed(lambda: sketch_hashes(V, HIDDEN, DEFAULT_DIM, seed=0))
    print(f"sketch hashes D={DEFAULT_DIM}: generated once per process in {t * 1e3:.0f} ms, then cached")
    print(
        f"\n[1] feature cost vs logits matmul z = h W^T ({weight.dtype}, {device}), V={V}, d={HIDDEN}, chunk_size="
        f"{DEFAULT_CHUNK_SIZE}"
    )
    log_probs_from_logits = upstream_log_probs()
    if log_probs_from_logits is None:
        print("openrlhf is not installed: upstream's log-prob pass and the fork's marginal cost are not measured")
    print(f"{'T':>5} {'what':>26} {'min ms':>9} {'med ms':>9} {'us/token':>9} {'ratio min':>10} {'ratio med':>10}")
    for T in token_counts:
        cases = feature_cases(T, weight, gen, T == max(token_counts), log_probs_from_logits)
        for fn in cases.values():  # warm-up
            fn()
        times = {name: [] for name in cases}
        for _ in range(reps):
            for name, fn in cases.items():
                times[name].append(timed(fn))
        base_min, base_med = min(times["logits matmul"]), statistics.median(times["logits matmul"])
        for name, ts in times.items():
            t_min, t_med = min(ts), statistics.median(ts)
            print(
                f"{T:>5} {name:>26} {t_min * 1e3:>9.1f} {t_med * 1e3:>9.1f} {t_min / T * 1e6:>9.0f}"
                f" {t_min / base_min:>10.1%} {t_med / base_med:>10.1%}"
            )
        fused = [name for name in times if name.endswith("+ log-probs")]
        for name in fused if "log-probs (upstream)" in times else []:
            # per repeat, so both passes of a difference ran under the same load
            extra = [f - u for f, u in zip(times[name], times["log-probs (upstream)"])]
            ratios = [e / b for e, b in zip(extra, times["logits matmul"])]
            label = f"fork's extra, {name.split()[1]}"
            print(
                f"{T:>5} {label:>26} {min(extra) * 1e3:>9.1f} {statistics.median(extra) * 1e3:>9.1f}"
                f" {min(extra) / T * 1e6:>9.0f} {min(ratios):>10.1%} {statistics.median(ratios):>10.1%}"
            )


def powerlaw_features(m, dim, gen, rank=1024):
    """(m, dim) float32 whose Gram spectrum decays like λ_j ∝ 1/j over `rank` directions: PR ≈ 21 / 32 / 34 at
    m = 256 / 1024 / 4096, the few-dozen-directions regime of real rollouts (docs/architecture.md §4)."""
    r = min(m, rank)
    spectrum = torch.arange(1, r + 1, dtype=torch.float32).rsqrt()
    return (torch.randn(m, r, generator=gen) * spectrum) @ torch.randn(r, dim, generator=gen) / math.sqrt(dim)


def bench_salt(reps, sizes, dims, group=8):
    from openrlhf_geo.diagnostics import gram
    from openrlhf_geo.salt import salt_advantages

    print(f"\n[2] SALT on power-law features (m, D) float32, groups of {group}, variant full; ms: min / median")
    print("    Gram = diagnostics.gram (float32 product, float64 result: what salt_advantages forms);")
    print("    solve = stats['solve_ms'] (K -> a': PR, top-k eigvecs, alpha, a'); Gram+solve = their sum per call;")
    print("    total = the whole salt_advantages call")
    print(f"{'m':>5} {'D':>6} {'k=PR':>5} {'Gram':>17} {'solve':>15} {'Gram+solve':>17} {'total':>17}")
    gen = torch.Generator().manual_seed(1)
    for m in sizes:
        rewards = (torch.rand(m // group, group, generator=gen) < 0.4).float()
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)
        inputs = {dim: powerlaw_features(m, dim, gen) for dim in dims}
        for features in inputs.values():
            salt_advantages(adv, features)  # warm-up
        times = {dim: {"Gram": [], "solve": [], "Gram+solve": [], "total": []} for dim in dims}
        k = {}
        for _ in range(reps if m < 4096 else min(reps, 3)):
            for dim, features in inputs.items():  # interleaved: both widths under the same load
                times[dim]["Gram"].append(timed(lambda features=features: gram(features)))
                start = time.perf_counter()
                _, stats = salt_advantages(adv, features)
                times[dim]["total"].append(time.perf_counter() - start)
                times[dim]["solve"].append(stats["solve_ms"] / 1e3)
                times[dim]["Gram+solve"].append(times[dim]["Gram"][-1] + times[dim]["solve"][-1])
                k[dim] = int(stats["k"])
        for dim in dims:
            cells = [f"{1e3 * min(ts):>8.1f} /{1e3 * statistics.median(ts):>7.1f}" for ts in times[dim].values()]
            print(f"{m:>5} {dim:>6} {k[dim]:>5} " + " ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("features", "salt", "all"), default="all")
    parser.add_argument("--reps", type=int, default=5, help="timed repeats per case (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for part 1 on a GPU (bf16 LM head)")
    parser.add_argument("--dims", type=int, nargs="+", default=[OLD_DIM, DEFAULT_DIM], help="part 2: feature widths")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="part 2: rollouts m")
    args = parser.parse_args(argv)
    if args.device != "cpu" and args.part != "features":
        parser.error("--device cuda measures part 1 only: pass --part features")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; min and median over {args.reps} repeats")
    print(f"load average at start (other processes share these cores): {os.getloadavg()[0]:.1f}")
    if args.part in ("features", "all"):
        bench_features(args.reps, device=args.device)
    if args.part in ("salt", "all"):
        bench_salt(args.reps, args.sizes, args.dims)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
