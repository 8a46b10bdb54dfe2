"""SALT's driver path at users' sizes: per optimizer step, the features' bytes, the Gram, the solve, the peak memory.

Each policy rank computes the features (D = DEFAULT_DIM float32 per response) in its experience forward. The fork's
first path, measured in [1]-[5] (still the path under --salt.gram shrink): they travel with the log-probs to the
trainer actor (the driver); there `GeometryBatch._geometry` puts the micro-batches in prompt order and
`salt_stage.reweight` runs one `salt_advantages` call per partition of m rollouts (the optimizer mini-batch, SALT
§3.1), serially: the Gram F Fᵀ/m (m²·D) and the solve (PR, top-k_t eigenvectors, α_t, a'). The fork's path now
(--salt.gram raw, the default), [6]-[7]: the features stay in the object store of the rank that computed them
(`fork.hooks.keep_features`), the ranks form each partition's Gram and its eigendecomposition (`RankGrams`,
`rank_gram`) and the driver receives 2·m² floats per partition and runs the rest of the solve (`salt.InnerProducts`).
Ray starts the trainer actor, which asks for no CPUs, with OMP_NUM_THREADS=1 (Ray's default for such an actor): one
thread is what the driver's torch gets unless the job sets the variable, hence `--threads 1`.

[1] Measured, each case in its own process (peak RSS is per process): the fork's driver path on P partitions of m
    rollouts, N = P·m: features arrive as micro-batches of --micro rows (as the actors return them), in shuffled
    order; the real `GeometryBatch._geometry` and `salt_stage.reweight` (default SaltConfig) run on them. Timed per
    step: the Gram (`diagnostics.gram`, per partition, summed), the solve (`salt_advantages`' solve_ms, summed), the
    rest of the stage (copies, checks, App. B/D diagnostics) and the whole; the driver's peak RSS above what the
    process held before the features arrived. Cases run only where the predicted peak fits --max-gib; a Gram-only
    series (one partition, `diagnostics.gram` on F alone) reaches larger m. --features diffuse (default) gives
    PR ≈ m/2 (k_t ≈ m/2: a dense eigensolve, the solve's worst case; real features at the Qwen2.5-1.5B shape had
    exact k_t 158-242 of m = 256, benchmarks/README.md); powerlaw gives k_t ≈ 20-34 (Lanczos).
[2] Fitted: Gram = g·m²·D, solve = s·m³ (dense), rest = r·m·D per partition; peak = c·N·D·4 bytes. Each constant
    is the median over the measured cases at m ≥ 512 (the smallest sizes carry fixed costs); the printed log-log
    slopes check the exponents.
[3] The grid m × P, measured where it ran, projected (marked *) elsewhere.
[4] The papers' settings on 8 and 64 GPUs as a share of their step. Step times from SALT Table 11 (App. G.2,
    GRPO rows, 8 × H20): hours / steps, steps = ⌊prompts / 64⌋ × 2 epochs (§4.1, Table 4: MATH-Train 7,500 and
    DAPO-Math-17k 17,917 prompts; verl drops the last partial batch), times that "include the full training loop"
    (validation too), so the true step is shorter and the share larger. GeoAlign's Table 6 (batch sizes) is lost:
    its rows use the fork's recipe (128 prompts × 16, mini-batch 1024: m = 1024, P = 2; unchecked) and SALT's
    per-rollout cost at 1.5B (the lowest: DAPO-Math, 1.5B), so a 1.7B/4B step of 2048 rollouts is at least that;
    App. B.3's 20-22 h for 1.7B on 8 A100s is ~187 such steps. 64 GPUs: the same batch at ideal scaling, step/8:
    the shortest step, the largest share (8× the rollouts at the same step gives the same share and 8× the bytes).
[5] The features' transfer, N·D·4 bytes to the driver. Assumptions, not measured: on one 8-GPU node the driver
    shares the node, and Ray's object store moves them through shared memory (MEMCPY_GBPS, one extra copy: the
    deserialized tensor); on 8 nodes, 7/8 of them come from other nodes through the driver node's front-end NIC,
    which Ray's object manager uses (TCP, not the GPUs' InfiniBand): NIC_GBITS. This machine's memcpy rate is
    measured and printed.
[6] The Gram formed on the ranks (the fork's path now, `fork.hooks.RankGrams`): partition p of P goes to rank
    p·R // P (round robin when P > R), which fetches its rows' features from the object stores (one node: shared
    memory, MEMCPY_GBPS; 8 nodes: the 7/8 held elsewhere through the node's NIC_GBITS NIC, shared by the node's
    partitions), forms G and eigh(G) on its GPU and returns them; the driver receives 2·m²·8 bytes per partition and
    runs [7]. Rank side projected (no GPU here: GPU_GEMM_TFLOPS, GPU_EIGH_S_PER_M3 assumed); driver side measured.
    Two columns: the driver's work (what the 1 % goal is about) and the step's critical path (ranks + driver).

Usage: python benchmarks/salt_scale.py [--sizes 256 512 1024 2048 4096] [--partitions 1 2 4 8 16] [--threads 1]
       [--max-gib 4] [--reps 2] [--features diffuse|powerlaw] [--dim D] [--out result.json]
"""

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [path for path in (str(HERE.parent), str(HERE)) if path not in sys.path]

import torch  # noqa: E402

from openrlhf_geo.features import DEFAULT_DIM  # noqa: E402

GROUP = 8  # SALT Table 4: 8 rollouts per prompt (the partition is m / GROUP prompts)
GIB = 2**30
# Stated assumptions for [5] and [6] (not measured here).
MEMCPY_GBPS = 5.0  # one node: Ray's shared-memory object store, put + deserialize, GB/s (this machine's is printed)
NIC_GBITS = 100.0  # the driver node's front-end NIC, Gb/s (a typical 8-GPU node: 25-200 Gb/s Ethernet)
GPU_GEMM_TFLOPS = 25.0  # float32 GEMM on one rank's GPU, half an H100's 51 TFLOP/s without TF32
GPU_EIGH_S_PER_M3 = 5e-11  # torch.linalg.eigh float64 (cuSOLVER syevd) on one GPU: ~0.05 s at m = 1024, assumed

# SALT Table 11 (App. G.2), GRPO rows, hours:minutes on one 8 x H20 server; steps from §4.1 / Table 4 (see [4])
MATH_TRAIN_STEPS = (7500 // 64) * 2
DAPO_MATH_STEPS = (17917 // 64) * 2
PAPER_SETTINGS = [
    # name, rollouts per step, m per partition, step seconds on 8 GPUs, where the step comes from
    (
        "SALT 1.5B MATH-Train (Table 4: 64 x 8, mini-batch 32 x 8)",
        512,
        256,
        (7 * 60 + 21) * 60 / MATH_TRAIN_STEPS,
        "Table 11 GRPO 07:21 / 234 steps",
    ),
    ("SALT 1.5B DAPO-Math", 512, 256, (15 * 60 + 41) * 60 / DAPO_MATH_STEPS, "Table 11 GRPO 15:41 / 558 steps"),
    ("SALT 7B MATH-Train", 512, 256, (24 * 60 + 7) * 60 / MATH_TRAIN_STEPS, "Table 11 GRPO 24:07 / 234 steps"),
    ("SALT 7B DAPO-Math", 512, 256, (61 * 60 + 26) * 60 / DAPO_MATH_STEPS, "Table 11 GRPO 61:26 / 558 steps"),
    (
        "GeoAlign math 1.7B / 4B (§5.1: 16 rollouts; 128 x 16, mini-batch 1024: unchecked)",
        2048,
        1024,
        2048 * (15 * 60 + 41) * 60 / DAPO_MATH_STEPS / 512,
        "SALT's 1.5B DAPO-Math cost per rollout x 2048",
    ),
]


def predicted_peak(m, partitions, dim, gram_only=False):
    """Bytes the case will hold at its peak: the fork's path keeps 2 copies of the N·D features at once (the actors'
    micro-batches, the prompt-ordered copy) plus one of a partition (F / scale; its rows are read in place)."""
    n = m * partitions
    if gram_only:
        return m * dim * 4 + 3 * m * m * 8
    return 2 * n * dim * 4 + m * dim * 4 + 8 * m * m * 8


def make_features(m, dim, kind, gen):
    """(m, dim) float32. diffuse: i.i.d. rows plus a shared direction of weight m^(-1/4), so PR ≈ m/2 (k_t ≈ m/2);
    powerlaw: benchmarks/salt_overhead.py's spectrum (PR ≈ 21-34)."""
    if kind == "powerlaw":
        from salt_overhead import powerlaw_features

        return powerlaw_features(m, dim, gen, rank=256)
    rows = torch.randn(m, dim, generator=gen).div_(math.sqrt(dim))
    shared = torch.randn(dim, generator=gen)
    return rows.add_(shared / shared.norm() * m**-0.25)


def run_case(m, partitions, dim, micro, kind, gram_only, seed=0):
    """One step of the fork's driver path (or one Gram) in this process -> dict of seconds and bytes."""
    from types import SimpleNamespace

    from openrlhf_geo import diagnostics, salt, salt_stage
    from openrlhf_geo.fork import hooks
    from openrlhf_geo.salt import SaltConfig
    from openrlhf_geo.stages import Batch

    warnings.simplefilter("ignore", salt_stage.SaltRegimeWarning)  # synthetic advantages: not the point here
    gen = torch.Generator().manual_seed(seed)
    # warm-up at a small size: libraries' first-call costs and buffers before the baseline
    warm = make_features(64, dim, kind, gen)
    salt_stage.reweight(
        SaltConfig(),
        salt_stage.SaltState(torch.Generator().manual_seed(0)),
        Batch(torch.arange(64) // GROUP, None, torch.arange(64), torch.ones(64, dtype=torch.bool), 1),
        torch.randn(64, dtype=torch.float64),
        features=lambda: warm,
        entropy=lambda: None,
        lengths=lambda: torch.full((64,), 100),
        partition_prompts=lambda: 64 // GROUP,
    )
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base_now = _rss()
    if gram_only:
        features = make_features(m, dim, kind, gen)
        wall, cpu = time.perf_counter(), time.process_time()
        diagnostics.gram(features)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return {"gram": cpu, "total": cpu, "wall": wall, "peak_bytes": _peak_above(base_peak, base_now)}
    n = m * partitions
    order = torch.randperm(n, generator=gen)  # micro-batches arrive in the actors' order, not prompt order
    parts = [make_features(m, dim, kind, gen) for _ in range(partitions)]
    prompt_ordered = torch.cat(parts)
    del parts
    experiences = []
    for first in range(0, n, micro):
        rows = order[first : first + micro]
        side = {"features": prompt_ordered[rows]}  # its own tensor (a copy), as Ray deserializes each result
        experiences.append(SimpleNamespace(index=rows.tolist(), **{hooks.SIDE_ATTR: side}))
    del prompt_ordered
    geometry = hooks.GeometryBatch.__new__(hooks.GeometryBatch)  # only what `_geometry` reads
    geometry.experiences, geometry.indices = experiences, order
    rewards = (torch.rand(n // GROUP, GROUP, generator=gen) < 0.4).double()
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)
    batch = Batch(torch.arange(n) // GROUP, None, torch.arange(n), torch.ones(n, dtype=torch.bool), 1)
    spent = {"gram": 0.0, "solve": 0.0, "gram_wall": 0.0, "solve_wall": 0.0, "k": []}
    real_gram, real_eig = diagnostics.gram, salt._top_eigenspace

    def timed(name, fn):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            spent[name] += time.process_time() - cpu
            spent[name + "_wall"] += time.perf_counter() - wall
            if name == "solve":
                spent["k"].append(args[1])
            return out

        return run

    diagnostics.gram, salt._top_eigenspace = timed("gram", real_gram), timed("solve", real_eig)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        salt_stage.reweight(
            SaltConfig(),
            salt_stage.SaltState(torch.Generator().manual_seed(0)),
            batch,
            advantages,
            features=lambda: geometry._geometry("features"),
            entropy=lambda: None,
            lengths=lambda: torch.full((n,), 100),
            partition_prompts=lambda: m // GROUP,
        )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        diagnostics.gram, salt._top_eigenspace = real_gram, real_eig
    return {
        "gram": spent["gram"],
        "solve": spent["solve"],
        "rest": cpu - spent["gram"] - spent["solve"],
        "total": cpu,
        "wall": wall,
        "gram_wall": spent["gram_wall"],
        "solve_wall": spent["solve_wall"],
        "k": spent["k"],
        "peak_bytes": _peak_above(base_peak, base_now),
    }


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_above(base_peak, base_now):
    """Peak RSS of the case above what the process held before it (ru_maxrss is the process's peak so far: when the
    warm-up's peak exceeds the case's, the case's own peak cannot be read and 0 is reported)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(peak - base_now, 0) if peak > base_peak else 0


def child(args):
    torch.set_num_threads(args.threads)
    m, partitions, gram_only = args.case
    result = run_case(m, partitions, args.dim, args.micro, args.features, bool(gram_only))
    print("RESULT " + json.dumps(result))


def measure(args, m, partitions, gram_only):
    """Run one case in a fresh process --reps times (--inline: in this one); -> per-key lists (peak: max)."""
    if args.inline:
        runs = [run_case(m, partitions, args.dim, args.micro, args.features, gram_only) for _ in range(args.reps)]
        return _collect(runs)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(m), str(partitions), str(int(gram_only))]
    command += ["--threads", str(args.threads), "--dim", str(args.dim), "--micro", str(args.micro)]
    command += ["--features", args.features]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(HERE.parent)}
    runs = []
    for _ in range(args.reps):
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"case m={m} P={partitions} failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(lines[-1][7:]))
    return _collect(runs)


def _collect(runs):
    out = {key: [run[key] for run in runs] for key in runs[0] if key not in ("k", "peak_bytes")}
    out["peak_bytes"] = max(run["peak_bytes"] for run in runs)
    if "k" in runs[0]:
        out["k"] = runs[0]["k"]
    return out


def slope(points):
    """Least-squares slope of log y on log x."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def memcpy_gbps(nbytes=64 * 2**20, reps=3):
    """This machine's copy rate of a nbytes float32 tensor, GB/s (best of reps)."""
    x, y = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="m per partition")
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="partitions per step")
    parser.add_argument("--dim", type=int, default=DEFAULT_DIM, help="feature width D (default: the fork's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the fork's driver under Ray: 1)")
    parser.add_argument("--max-gib", type=float, default=4.0, help="measure only cases whose peak fits this")
    parser.add_argument("--reps", type=int, default=2, help="processes per case (min time, max peak)")
    parser.add_argument("--micro", type=int, default=8, help="rows per actor result (the recipes' micro-batch)")
    parser.add_argument("--features", choices=("diffuse", "powerlaw"), default="diffuse")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--inline", action="store_true", help="cases in this process (quick checks; no peak memory)")
    parser.add_argument(
        "--child", type=int, nargs=3, metavar=("M", "P", "GRAM_ONLY"), dest="case", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if not args.case and (min(args.sizes) < 2 * GROUP or any(m % GROUP for m in args.sizes)):
        parser.error(f"--sizes must be multiples of {GROUP} (the group size), at least {2 * GROUP}")
    return args


def measure_all(args):
    """[1]: the full path where it fits --max-gib, then the Gram alone -> (measured, gram_only)."""
    budget, dim = args.max_gib * GIB, args.dim
    measured, gram_only = {}, {}
    print(
        "\n[1] measured: one step of the fork's driver path (CPU seconds of the process, min over processes; the "
        "step's wall time beside it; peak: max)"
    )
    print(
        f"{'m':>5} {'P':>3} {'N':>6} {'bytes':>9} {'Gram s':>8} {'solve s':>8} {'rest s':>8} {'step s':>8} "
        f"{'wall s':>8} {'peak GiB':>9} {'peak/ND4':>8} {'k_t':>6}"
    )
    for m in args.sizes:
        for partitions in args.partitions:
            if predicted_peak(m, partitions, dim) > budget:
                continue
            cell = measured[(m, partitions)] = measure(args, m, partitions, gram_only=False)
            n = m * partitions
            best = {key: min(cell[key]) for key in ("gram", "solve", "rest", "total", "wall")}
            print(
                f"{m:>5} {partitions:>3} {n:>6} {_size(n * dim * 4):>9} {best['gram']:>8.3f} {best['solve']:>8.3f} "
                f"{best['rest']:>8.3f} {best['total']:>8.3f} {best['wall']:>8.3f} "
                f"{_peak(cell['peak_bytes'], n * dim * 4)} "
                f"{statistics.median(cell['k']):>6.0f}",
                flush=True,
            )
    print("\n    Gram alone (diagnostics.gram on one partition's F, nothing else held)")
    for m in args.sizes:
        need = predicted_peak(m, 1, dim, gram_only=True)
        if need > budget:
            print(f"{m:>5}: not run (F and K need {_size(need)})")
            continue
        cell = gram_only[m] = measure(args, m, 1, gram_only=True)
        print(
            f"{m:>5}: {min(cell['gram']):.3f} CPU s ({min(cell['wall']):.3f} wall), peak "
            f"{cell['peak_bytes'] / GIB:.2f} GiB",
            flush=True,
        )
    return measured, gram_only


def driver_from_gram(args):
    """[7] measured: the driver's part when the Gram is formed on the ranks, one `salt_advantages` call on
    InnerProducts(G) per partition (K = G/m, the solve, the stats) -> {m: CPU seconds (min over --reps), k_t}."""
    from openrlhf_geo.salt import InnerProducts, salt_advantages

    print("\n[7] measured: the driver's part with the Gram formed on the ranks, salt_advantages on InnerProducts(G,")
    print("    eigh(G)) (the fork's path) and on InnerProducts(G) (the eigensolve on the driver); G from features of")
    print(f"    width 8m ({args.features}: the same spectrum class); CPU seconds per partition, min over --reps")
    gen, out = torch.Generator().manual_seed(2), {}
    for m in args.sizes:
        F = make_features(m, 8 * m, args.features, gen).double()
        G = F @ F.T * (8 * m / args.dim)
        a = torch.randn(m, generator=gen, dtype=torch.float64)
        cell = {}
        for name, given in (("seconds", InnerProducts(G, torch.linalg.eigh(G))), ("with_eigh", InnerProducts(G))):
            times = []
            for _ in range(args.reps):
                cpu = time.process_time()
                cell["k"] = int(salt_advantages(a, given, return_basis=True)[1]["k"])
                times.append(time.process_time() - cpu)
            cell[name] = min(times)
        out[m] = cell
        print(
            f"{m:>5}: {cell['seconds']:.3f} s (eigensolve on the driver: {cell['with_eigh']:.3f} s), k_t {cell['k']}"
        )
    return out


def fit_models(measured, gram_only, dim):
    """[2]: per-partition Gram = g·m²·D, solve = s·m³, rest = r·m·D; peak = c·N·D·4 (medians over m >= 512)."""
    grams = [(m, min(c["gram"]) / p) for (m, p), c in measured.items()]
    grams += [(m, min(c["gram"])) for m, c in gram_only.items()]
    solves = [(m, min(c["solve"]) / p) for (m, p), c in measured.items()]
    rests = [(m, min(c["rest"]) / p) for (m, p), c in measured.items()]

    def large(points):
        return [pair for pair in points if pair[0] >= 512] or points

    peaks = [(m * p, c["peak_bytes"]) for (m, p), c in measured.items() if c["peak_bytes"]]
    fit = {
        "gram_per_m2D": statistics.median(t / (m * m * dim) for m, t in large(grams)),
        "solve_per_m3": statistics.median(t / m**3 for m, t in large(solves)),
        "rest_per_mD": statistics.median(t / (m * dim) for m, t in large(rests)),
        "peak_per_ND4": statistics.median(b / (n * dim * 4) for n, b in peaks) if peaks else 3.0,
        "gram_slope_m": slope(grams) if len({m for m, _ in grams}) > 1 else None,
        "solve_slope_m": slope(solves) if len({m for m, _ in solves}) > 1 else None,
    }
    g, s, r, c = (fit[key] for key in ("gram_per_m2D", "solve_per_m3", "rest_per_mD", "peak_per_ND4"))
    slopes = [fit[key] if fit[key] is not None else math.nan for key in ("gram_slope_m", "solve_slope_m")]
    print(
        f"\n[2] fit (medians over m >= 512): Gram = {g:.3g}·m²·D s ({2 / g / 1e9:.0f} GFLOP/s), solve = "
        f"{s:.3g}·m³ s, rest = {r:.3g}·m·D s per partition; peak = {c:.2f}·N·D·4 bytes. log-log slopes in m: "
        f"Gram {slopes[0]:.2f} (model 2), solve {slopes[1]:.2f} (model 3)"
    )
    return fit


def projected_step(fit, m, partitions, dim):
    """(CPU seconds, peak bytes) of one driver step of P partitions of m, from the fit."""
    per = fit["gram_per_m2D"] * m * m * dim + fit["solve_per_m3"] * m**3 + fit["rest_per_mD"] * m * dim
    return partitions * per, fit["peak_per_ND4"] * m * partitions * dim * 4


def grid_table(args, measured, fit):
    """[3]: every (m, P), measured where it ran."""
    print("\n[3] per step on the driver: CPU seconds, peak GiB, features sent; * = projected by [2]")
    print(f"{'m':>5} " + " ".join(f"{'P=' + str(p):>25}" for p in args.partitions))
    grid = {}
    for m in args.sizes:
        cells = []
        for partitions in args.partitions:
            seconds, peak = projected_step(fit, m, partitions, args.dim)
            cell = measured.get((m, partitions))
            if cell:
                seconds, peak = min(cell["total"]), cell["peak_bytes"]
            nbytes = m * partitions * args.dim * 4
            grid[f"{m}x{partitions}"] = {
                "seconds": seconds,
                "peak_bytes": peak,
                "bytes": nbytes,
                "measured": bool(cell),
            }
            cells.append(f"{seconds:>8.2f}{'' if cell else '*':1} {peak / GIB:>6.1f} {_size(nbytes):>8}")
        print(f"{m:>5} " + " ".join(cells))
    return grid


def papers_table(args, measured, fit, from_gram):
    """[4]-[6]: the papers' settings on 8 and 64 GPUs as shares of their step."""
    dim, node = args.dim, MEMCPY_GBPS
    print(
        f"\n[4] the papers' settings: SALT's driver work per step as a share of the step (8 GPUs: the paper's "
        f"step; 64 GPUs: step/8)\n[5] features' transfer: 8 GPUs {node:.1f} GB/s shared memory; 64 GPUs 7/8 of "
        f"them through a {NIC_GBITS:.0f} Gb/s NIC\n[6] Gram on the ranks (the fork's path; rank side projected): "
        f"{GPU_GEMM_TFLOPS:.0f} TFLOP/s and eigh {GPU_EIGH_S_PER_M3:.0e}·m³ s per GPU, features fetched at [5]'s "
        "rates; driver: 2·m²·8 bytes and [7] per partition (driver s/%: its work; path s/%: ranks + driver)"
    )
    print(
        f"{'setting':<44} {'N':>5} {'m':>5} {'P':>2} {'step s':>7} {'GPUs':>4} {'driver s':>9} {'share':>7} "
        f"{'bytes':>8} {'send s':>7} {'send %':>7} {'ranks: driver s':>15} {'%':>6} {'path s':>7} {'%':>6}"
    )
    papers = []
    for name, n, m, step8, source in PAPER_SETTINGS:
        partitions = n // m
        cell = measured.get((m, partitions))
        seconds = min(cell["total"]) if cell else projected_step(fit, m, partitions, dim)[0]
        nbytes = n * dim * 4
        known = from_gram.get(m)
        solve = partitions * (known["seconds"] if known else fit["solve_per_m3"] * m**3)
        for gpus in (8, 64):
            step_s = step8 * 8 / gpus
            send = nbytes / (node * 1e9) if gpus == 8 else nbytes * 7 / 8 / (NIC_GBITS / 8 * 1e9)
            # a rank per partition (spread over the nodes): fetch its features, G and eigh(G) on the GPU; the driver
            # receives G and its eigenvectors (float64) and runs the rest of the solve, [7]
            per_rank, per_node = math.ceil(partitions / gpus), math.ceil(partitions / (gpus // 8))
            fetch = per_node * m * dim * 4 / (node * 1e9 if gpus == 8 else NIC_GBITS / 8 * 1e9 * 8 / 7)
            on_rank = per_rank * (m * m * dim * 2 / (GPU_GEMM_TFLOPS * 1e12) + GPU_EIGH_S_PER_M3 * m**3)
            driver = solve + partitions * 2 * m * m * 8 / (node * 1e9)
            ranks = fetch + on_rank + driver
            papers.append(
                {
                    "setting": name,
                    "rollouts": n,
                    "m": m,
                    "partitions": partitions,
                    "gpus": gpus,
                    "step_s": step_s,
                    "step_source": source,
                    "driver_s": seconds,
                    "driver_share": seconds / step_s,
                    "driver_measured": bool(cell),
                    "bytes": nbytes,
                    "send_s": send,
                    "send_share": send / step_s,
                    "ranks_driver_s": driver,
                    "ranks_driver_share": driver / step_s,
                    "ranks_s": ranks,
                    "ranks_share": ranks / step_s,
                }
            )
            print(
                f"{name[:44]:<44} {n:>5} {m:>5} {partitions:>2} {step_s:>7.1f} {gpus:>4} {seconds:>8.3f}"
                f"{'' if cell else '*'} {seconds / step_s:>7.2%} {_size(nbytes):>8} {send:>7.3f} "
                f"{send / step_s:>7.2%} {driver:>15.3f} {driver / step_s:>6.2%} {ranks:>7.3f} {ranks / step_s:>6.2%}"
            )
    for label, key in (("the features sent to the driver (--salt.gram shrink)", "driver_share"),
                       ("the fork's path, Gram on the ranks: the driver's work", "ranks_driver_share"),
                       ("the fork's path: the step's critical path (ranks + driver)", "ranks_share")):  # fmt: skip
        worst = max(papers, key=lambda row: row[key])
        print(
            f"largest share, {label}: {worst[key]:.2%} ({worst['setting'][:40]}, {worst['gpus']} GPUs): "
            f"{'over' if worst[key] > 0.01 else 'under'} 1 % of a step"
        )
    return papers


def main(argv=None):
    args = parse(argv)
    if args.case:
        return child(args)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    copy_rate = memcpy_gbps()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} thread(s), D = {args.dim}, {args.features} features, micro-batches of {args.micro}, "
        f"{args.reps} process(es) per case; load average {load[0]:.2f}; memcpy {copy_rate:.1f} GB/s"
    )
    measured, gram_only = measure_all(args)
    from_gram = driver_from_gram(args)
    load.append(os.getloadavg()[0])
    fit = fit_models(measured, gram_only, args.dim)
    grid = grid_table(args, measured, fit)
    papers = papers_table(args, measured, fit, from_gram)
    load.append(os.getloadavg()[0])
    wall = time.perf_counter() - started
    print(f"load average at start / after [1] / end: {' / '.join(f'{x:.2f}' for x in load)}; wall {wall:.0f} s")
    if args.out:
        result = {
            "settings": {key: value for key, value in vars(args).items() if key not in ("out", "case")},
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "load_average": load,
                "memcpy_gbps": copy_rate,
            },
            "measured": {f"{m}x{p}": cell for (m, p), cell in measured.items()},
            "gram_only": {str(m): cell for m, cell in gram_only.items()},
            "driver_from_gram": {str(m): cell for m, cell in from_gram.items()},
            "fit": fit,
            "grid": grid,
            "papers": papers,
            "wall_s": wall,
            "assumptions": {
                "memcpy_gbps": MEMCPY_GBPS,
                "nic_gbits": NIC_GBITS,
                "gpu_gemm_tflops": GPU_GEMM_TFLOPS,
                "gpu_eigh_s_per_m3": GPU_EIGH_S_PER_M3,
            },
        }
        args.out.write_text(json.dumps(result, indent=1))
    return None


def _peak(peak, nbytes):
    """Peak GiB and peak / (N·D·4 bytes), or n/a where the warm-up's peak hid the case's (see _peak_above)."""
    return f"{peak / GIB:>9.2f} {peak / nbytes:>8.2f}" if peak else f"{'n/a':>9} {'n/a':>8}"


def _size(nbytes):
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"


if __name__ == "__main__":
    main()
