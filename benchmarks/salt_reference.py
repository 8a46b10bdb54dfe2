"""SALT (openrlhf_geo.salt) against the authors' released code (Chang-pw/SALT at 94ac08e, built on verl), side by side.

Nothing is fetched: --salt-repo is a local checkout of that repository. Its
verl/verl/trainer/gradient/advantage_decomposition.py (and, for part 3, proxy.py) is loaded by file path with
importlib, without the verl package around it. Nothing is stubbed: both files import only the standard library and
torch when run (advantage_decomposition.py's `from .proxy import ProxyResult` is under TYPE_CHECKING), so verl and
its dependencies are never imported. Part 2 alone replaces three torch.distributed functions for one call (below).

The same float32 features F (m, D) and advantages a (m,) go to
  theirs  AdvantageDecomposer(DecompositionConfig(enabled=True, rho=ρ)).decompose(F, a), every other setting at its
          default (k_min 1, k_max 64, fp32 Gram, ReLU exploration, α clipped to [0, 1]); LOBPCG's random start is
          seeded per call
  ours    salt.salt_advantages(a, F, k_rule=..., rho=...)
with "ours | theirs" pairs: paper | code ρ=1.0 (SALT Eq. 14 against the code as its actor.yaml and README ship it),
paper | code ρ=0.5 (against DecompositionConfig's own default), and code ρ | code ρ for ρ = 0.5, 1.0 (this project's
`--salt.k_rule code --salt.rho ρ` against the code itself). Columns: k_t, α_t, n_eff (Eq. 6; ours without ε, as
Eq. 17 takes it; theirs with its 1e-9) and cos(a'_ours, a'_theirs); means over seeds, the cosine's minimum.

Part 1, synthetic batches: m = B·G responses in groups of G, each prompt with its own success rate, 0/1 rewards, GRPO
advantages (sample std + 1e-6, as verl's GRPO), and features of D = --dim columns: "low-rank" = 8 shared directions
+ a per-prompt direction + noise (PR well below m), "diffuse" = mostly noise (PR near m, where the caps bind).
Part 1b, scope: the code runs once per micro-batch of the actor update (dp_actor.py, update_policy), so each call sees
--micro responses; their a' over the micro-batches of each batch, concatenated, against ours on the whole batch.
Part 2: distributed_gram=True on 2 ranks, simulated in one process (torch.distributed's is_initialized,
get_world_size and all_gather replaced for one call: each rank holds the same shard): what decompose does.
Part 3, a tiny LM: the demo's Qwen2 (2 × 64, V = 28), warmed up by the demo's SFT recipe (benchmarks/salt_nulls.py),
--real batches of --prompts × --samples rollouts, rewards 1 for the right \\boxed{} sum. From one forward: our exact
Eq. 19 features (the token-mean gradient of log p, features.lm_head_features) and the code's proxy
(ManualLmHeadProxy.compute_from_logits on −Σ_t log p, as dp_actor.py calls it); prints how far F_code is from
−T_i·F_ours (T_i: response i's tokens) and cos(a'): end to end (ours: Eq. 19, paper rule; theirs: their proxy,
ρ = 1.0), of the proxy alone (ours, paper rule, on each proxy), and on their proxy under the code rule (ours with
k_rule "code", ρ = 1.0, against theirs).

--edge-cases runs part 4 instead, where the code's absolute ε's decide (both under the code's rule, ρ = 1):
  scale   m = 64, G = 8, unit-norm rows in 4 orthonormal directions, 16 rows each (PR = 4 exactly), times c = 1 ...
          1e-6: the code's PR = tr(K)²/(‖K‖²_F + 1e-10) collapses once ‖K‖²_F = c⁴/4 nears 1e-10; ours is scale-free
  zero    F = 0 (m = 64): ours returns a (k = 0, no geometry); the code takes k = 1 and α = 1 on an eigenvector of the
          zero Gram, which its LOBPCG start (seeded here by --seeds) or eigh fallback picks
  ties    m = 48, G = 8, rows in 5 orthogonal directions, 16 rows on one and 8 on each other, entries ±1, ±3, ±5
          or ±7 (exact in float32): PR = 48²/(16² + 4·8²) = 4.5 exactly for every draw (rows, signs and columns
          permuted at random); how often each side's computed ρ·PR lands on 4 or 5 (the paper's rule: half up, 5)

Usage: python benchmarks/salt_reference.py --salt-repo DIR [--seeds 3] [--sizes 64 128 256] [--groups 8 16]
       [--micro 8 16] [--real 4] [--sft-steps 600] [--model DIR] [--threads 1] [--edge-cases [--tie-draws 200]]
"""

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import scipy.linalg
import torch

from openrlhf_geo import diagnostics
from openrlhf_geo.features import lm_head_features
from openrlhf_geo.lab import task
from openrlhf_geo.salt import salt_advantages

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import salt_nulls  # noqa: E402  (the demo's tiny-LM warm-up and reward)

GRADIENT = Path("verl", "verl", "trainer", "gradient")
# (ours: k_rule, rho) | theirs: rho
PAIRS = ((("paper", None), 1.0), (("paper", None), 0.5), (("code", 0.5), 0.5), (("code", 1.0), 1.0))
STRUCTURES = ("low-rank", "diffuse")


def load(repo: Path, name: str):
    """The checkout's verl/verl/trainer/gradient/<name>.py as a module of its own (not the verl package)."""
    path = repo / GRADIENT / f"{name}.py"
    if not path.is_file():
        raise SystemExit(f"salt_reference: {path} not found: --salt-repo must be a checkout of Chang-pw/SALT")
    spec = importlib.util.spec_from_file_location(f"salt_reference_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def theirs(code, a, F, rho, **config):
    """(a' float64, k_t, α_t, n_eff, PR) from the released AdvantageDecomposer."""
    with torch.random.fork_rng():
        torch.manual_seed(0)  # torch.lobpcg draws its start from the global generator
        result = code.AdvantageDecomposer(code.DecompositionConfig(enabled=True, rho=rho, **config)).decompose(F, a)
    metrics = result.metrics
    return (
        result.advantage_final.double(),
        result.k_t,
        result.alpha_t,
        metrics["adv_decomp/neff"],
        metrics["adv_decomp/participation_ratio"],
    )


def ours(a, F, k_rule, rho):
    """(a' float64, k_t, α_t, n_eff, PR) from salt.salt_advantages; n_eff by Eq. 6 without ε, as Eq. 17 takes it."""
    out, stats = salt_advantages(a, F, k_rule=k_rule, rho=rho)
    return out.double(), int(stats["k"]), stats["alpha"], diagnostics.effective_sample_size_vectors(a, F), stats["pr"]


def cosine(x, y) -> float:
    norm = float(x.norm() * y.norm())
    return float(x @ y) / norm if norm > 0 else float("nan")


def synthetic(m, group, structure, seed, dim):
    """(a, F) float32: GRPO advantages of m // group prompts with 0/1 rewards, low-rank-plus-noise features."""
    rng = np.random.default_rng(seed)
    prompts = m // group
    rate = rng.uniform(0, 1, (prompts, 1))
    r = (rng.uniform(size=(prompts, group)) < rate).astype(float)
    a = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    noise = {"low-rank": 0.15, "diffuse": 2.0}[structure]
    shared = rng.standard_normal((m, 8)) @ rng.standard_normal((8, dim)) / np.sqrt(8)
    per_prompt = np.repeat(rng.standard_normal((prompts, dim)), group, axis=0)
    F = shared + 0.7 * per_prompt + noise * rng.standard_normal((m, dim))
    F *= rng.lognormal(0, 0.3, (m, 1))  # responses differ in gradient norm
    return torch.tensor(a, dtype=torch.float32), torch.tensor(F, dtype=torch.float32)


def compare(code, a, F):
    """{pair label: (ours tuple, theirs tuple, cosine)} for the PAIRS on one batch."""
    rows = {}
    for (k_rule, rho), their_rho in PAIRS:
        mine, other = ours(a, F, k_rule, rho), theirs(code, a, F, their_rho)
        label = f"{k_rule if rho is None else f'code ρ={rho:g}'} | code ρ={their_rho:g}"
        rows[label] = (mine, other, cosine(mine[0], other[0]))
    return rows


def fmt(values, digits=2):
    return f"{statistics.mean(values):.{digits}f}"


def part_synthetic(code, args):
    print(f"## 1. synthetic batches, D = {args.dim}, seeds {args.seeds} (means over seeds; cos: minimum)")
    print("| m | G | features | PR | ours \\| theirs | k ours | k theirs | α ours | α theirs | n_eff ours | "
          "n_eff theirs | cos(a') |")  # fmt: skip
    print("|" + "---|" * 12)
    batches = {}
    for m in args.sizes:
        for group in args.groups:
            for structure in STRUCTURES:
                cells = {}
                for seed in range(args.seeds):
                    a, F = synthetic(m, group, structure, seed, args.dim)
                    batches[m, group, structure, seed] = (a, F)
                    for label, row in compare(code, a, F).items():
                        cells.setdefault(label, []).append(row)
                pr = fmt([row[0][4] for row in next(iter(cells.values()))], 1)
                for label, rows in cells.items():
                    cols = [fmt([r[side][1] for r in rows], 1) for side in (0, 1)]
                    cols += [fmt([r[side][2] for r in rows]) for side in (0, 1)]
                    cols += [fmt([r[side][3] for r in rows]) for side in (0, 1)]
                    print(f"| {m} | {group} | {structure} | {pr} | {label.replace('|', chr(92) + '|')} | "
                          + " | ".join(cols) + f" | {min(r[2] for r in rows):.6f} |")  # fmt: skip
    return batches


def part_scope(code, args, batches):
    print(f"\n## 1b. scope: theirs per micro-batch (ρ = 1.0) vs ours (paper) on the whole batch, seeds {args.seeds}")
    print("| m | G | features | micro-batch | k ours | k theirs per micro-batch | cos(a') |")
    print("|" + "---|" * 7)
    for m in args.sizes:
        for group in args.groups:
            for structure in STRUCTURES:
                for micro in (b for b in args.micro if b < m):
                    k_ours, k_theirs, coss = [], [], []
                    for seed in range(args.seeds):
                        a, F = batches[m, group, structure, seed]
                        mine = ours(a, F, "paper", None)
                        parts = [theirs(code, a[i : i + micro], F[i : i + micro], 1.0) for i in range(0, m, micro)]
                        k_ours.append(mine[1])
                        k_theirs.append(statistics.mean(part[1] for part in parts))
                        coss.append(cosine(mine[0], torch.cat([part[0] for part in parts])))
                    print(f"| {m} | {group} | {structure} | {micro} | {fmt(k_ours, 1)} | {fmt(k_theirs, 1)} | "
                          f"{min(coss):.6f} |")  # fmt: skip


def part_distributed(code, batches):
    """decompose with distributed_gram=True on 2 simulated ranks holding the same shard."""
    dist = getattr(code, "dist", None)
    if dist is None:
        print("\n## 2. distributed_gram: not checked (the module does not use torch.distributed)")
        return
    a, F = next(iter(batches.values()))

    def all_gather(tensors, tensor, group=None):
        for t in tensors:
            t.copy_(tensor)

    with (
        mock.patch.object(dist, "is_initialized", lambda: True),
        mock.patch.object(dist, "get_world_size", lambda group=None: 2),
        mock.patch.object(dist, "all_gather", all_gather),
    ):
        try:
            theirs(code, a, F, 1.0, distributed_gram=True)
            outcome = "ran"
        except RuntimeError as error:
            outcome = f"RuntimeError: {error}"
    print(f"\n## 2. distributed_gram=True, 2 simulated ranks, m = {len(a)} per rank: {outcome}")


def proxies(code_proxy, model, tokenizer, problems, samples, seed):
    """(a, F by Eq. 19, F by the code's proxy, response lengths T_i, reward rate) from one forward over rollouts."""
    a, rewards, tokens, mask, logits, hidden = salt_nulls.sampled_rollouts(model, tokenizer, problems, samples, seed)
    ours_F = lm_head_features(logits, hidden, tokens, mask, method="exact")
    # dp_actor.py: per_sample_loss = −(log_prob · response_mask).sum(−1), gradients w.r.t. the (temperature-scaled)
    # logits, times the lm_head input, summed over the response's tokens (the demo samples at temperature 1)
    leaf = logits.detach().requires_grad_()
    log_prob = torch.log_softmax(leaf, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    loss = -(log_prob * mask).sum(-1)
    group_ids = torch.arange(len(problems)).repeat_interleave(samples)
    code_F = code_proxy.ManualLmHeadProxy().compute_from_logits(loss, leaf, mask.float(), group_ids, hidden).grads_flat
    return a.float(), ours_F.float(), code_F.detach().float(), mask.sum(1).float(), float(rewards.mean())


def part_tiny_lm(args):
    code_proxy = load(args.salt_repo, "proxy")
    code = sys.modules["salt_reference_advantage_decomposition"]
    start = time.perf_counter()
    model, tokenizer = salt_nulls.warmed_up_model(args.sft_steps, args.model)
    source = f"loaded {args.model}" if args.model else f"{args.sft_steps} SFT steps"
    print(f"\n## 3. the demo's tiny LM ({source}, {time.perf_counter() - start:.0f} s), "
          f"m = {args.prompts} x {args.samples}, exact features (V·d = 1792)")  # fmt: skip
    print("| batch | reward rate | T_i | max ‖F_code + T_i·F_ours‖/‖F_code‖ | PR ours (Eq. 19) | PR theirs | k ours | "
          "k theirs | α ours | α theirs | cos end to end | cos proxy alone | cos on their proxy, code |")  # fmt: skip
    print("|" + "---|" * 13)
    problems = task.addition_problems(3000, seed=0, carry_only=True)
    for b in range(args.real):
        picked = random.Random(b).sample(problems, args.prompts)
        a, F, code_F, lengths, reward = proxies(code_proxy, model, tokenizer, picked, args.samples, seed=b)
        gap = float(((code_F + lengths[:, None] * F).norm(dim=1) / code_F.norm(dim=1).clamp_min(1e-30)).max())
        cells = [f"{reward:.2f}", f"{lengths.min():.0f}-{lengths.max():.0f}", f"{gap:.1e}"]
        if not a.any():
            print(f"| {b} | " + " | ".join(cells) + " | every group has equal rewards (a = 0): skipped |" + " |" * 8)
            continue
        mine, other = ours(a, F, "paper", None), theirs(code, a, code_F, 1.0)
        swapped = ours(a, code_F, "paper", None)  # the code's proxy, the paper's rule: the proxy alone
        rule = ours(a, code_F, "code", 1.0)  # the code's proxy and rule in ours: theirs up to rounding
        cells += [f"{mine[4]:.1f}", f"{other[4]:.1f}", str(mine[1]), str(other[1])]
        cells += [f"{mine[2]:.2f}", f"{other[2]:.2f}"]
        cells += [f"{cosine(mine[0], other[0]):.4f}", f"{cosine(mine[0], swapped[0]):.4f}"]
        cells += [f"{cosine(rule[0], other[0]):.6f}"]
        print(f"| {b} | " + " | ".join(cells) + " |")


EDGE_SCALES = (1.0, 1e-2, 1e-3, 1e-4, 1e-6)


def grpo_advantages(rng, m, group):
    r = (rng.uniform(size=(m // group, group)) < 0.5).astype(float)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)


def clustered(rng, sizes, dim, value=1.0):
    """(m, dim) float32 rows value·h_j on len(sizes) orthogonal ±1 Hadamard directions h_j (sizes[j] rows on h_j),
    signs, rows and columns permuted: every entry exact in float32, K's eigenvalues ∝ sizes."""
    hadamard = scipy.linalg.hadamard(dim)[rng.permutation(dim)[: len(sizes)]]
    rows = np.concatenate([np.repeat(hadamard[j : j + 1], n, axis=0) for j, n in enumerate(sizes)])
    rows = rows * rng.choice([-1, 1], size=(len(rows), 1)) * value
    return torch.tensor(rows[rng.permutation(len(rows))][:, rng.permutation(dim)], dtype=torch.float32)


def part_edge_cases(code, args):
    print("\n## 4. edge cases: the code's ε terms and rounding (ours: --salt.k_rule code --salt.rho 1; theirs: ρ = 1)")
    print(f"\n### scale: m = 64, G = 8, PR = 4 exactly, features times c (seeds {args.seeds}; means, cos: minimum)")
    print("| c | ‖K‖²_F | PR ours | PR theirs | k ours | k theirs | α ours | α theirs | cos(a') |")
    print("|" + "---|" * 9)
    for c in EDGE_SCALES:
        rows = []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            a = torch.tensor(grpo_advantages(rng, 64, 8), dtype=torch.float32)
            F = clustered(rng, (16,) * 4, 64) / 8.0 * c  # unit-norm rows: ‖K‖²_F = c⁴ / 4
            mine, other = ours(a, F, "code", 1.0), theirs(code, a, F, 1.0)
            rows.append((mine, other, cosine(mine[0], other[0])))
        cells = [f"{c:g}", f"{c**4 / 4:.1e}"]
        cells += [fmt([r[side][4] for r in rows], 4) for side in (0, 1)]
        cells += [fmt([r[side][1] for r in rows], 1) for side in (0, 1)]
        cells += [fmt([r[side][2] for r in rows], 3) for side in (0, 1)]
        print("| " + " | ".join(cells) + f" | {min(r[2] for r in rows):.6f} |")
    print(f"\n### zero features: m = 64, G = 8, F = 0 (seeds {args.seeds}: the advantages, the code's LOBPCG start)")
    print("| seed | k ours | k theirs | α ours | α theirs | ours: a' = a | cos(a'_theirs, a) | theirs' a' − a: "
          "nonzero entries | cos(a'_theirs, a'_theirs from another start) |")  # fmt: skip
    print("|" + "---|" * 9)
    for seed in range(args.seeds):
        a = torch.tensor(grpo_advantages(np.random.default_rng(seed), 64, 8), dtype=torch.float32)
        F = torch.zeros(64, 256)
        out, stats = salt_advantages(a, F, k_rule="code", rho=1.0)
        results = []
        for start in (seed, seed + 1000):
            with torch.random.fork_rng():
                torch.manual_seed(start)
                decomposer = code.AdvantageDecomposer(code.DecompositionConfig(enabled=True, rho=1.0))
                results.append(decomposer.decompose(F, a))
        new, again = (r.advantage_final.double() for r in results)
        moved = int((new - a.double()).abs().gt(1e-6).sum())
        print(
            f"| {seed} | {int(stats['k'])} | {results[0].k_t} | {stats['alpha']:g} | {results[0].alpha_t:g} | "
            f"{bool(torch.equal(out, a))} | {cosine(new, a.double()):.4f} | {moved} | {cosine(new, again):.4f} |"
        )
    print(f"\n### ties: m = 48, G = 8, PR = 4.5 exactly, {args.tie_draws} draws: how often each k")
    counts = {"ours (code)": {}, "ours (paper)": {}, "theirs": {}}
    apart, deviation = 0, {"ours": 0.0, "theirs": 0.0}
    for draw in range(args.tie_draws):
        rng = np.random.default_rng(10_000 + draw)
        a = torch.tensor(grpo_advantages(rng, 48, 8), dtype=torch.float32)
        F = clustered(rng, (16, 8, 8, 8, 8), 64, value=(1.0, 3.0, 5.0, 7.0)[draw % 4])
        mine, paper, other = ours(a, F, "code", 1.0), ours(a, F, "paper", None), theirs(code, a, F, 1.0)
        for name, row in (("ours (code)", mine), ("ours (paper)", paper), ("theirs", other)):
            counts[name][row[1]] = counts[name].get(row[1], 0) + 1
        apart += mine[1] != other[1]
        for name, row in (("ours", mine), ("theirs", other)):
            deviation[name] = max(deviation[name], abs(row[4] - 4.5))
    print("| side | " + " | ".join(f"k = {k}" for k in (4, 5)) + " |")
    print("|---|---|---|")
    for name, seen in counts.items():
        print(f"| {name} | {seen.get(4, 0)} | {seen.get(5, 0)} |")
    print(f"\nlargest |PR − 4.5|: ours {deviation['ours']:.1e}, theirs {deviation['theirs']:.1e}; k ours (code) ≠ "
          f"k theirs in {apart} of {args.tie_draws} draws")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--salt-repo", type=Path, required=True, help="a local checkout of Chang-pw/SALT")
    p.add_argument("--seeds", type=int, default=3, help="synthetic batches per shape")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256], help="m = B·G")
    p.add_argument("--groups", type=int, nargs="+", default=[8, 16], help="G, responses per prompt")
    p.add_argument("--dim", type=int, default=2048, help="synthetic feature columns D")
    p.add_argument("--micro", type=int, nargs="*", default=[8, 16], help="micro-batch sizes for part 1b")
    p.add_argument("--real", type=int, default=4, help="tiny-LM batches (0: skip part 3)")
    p.add_argument("--sft-steps", type=int, default=600, help="the tiny LM's SFT warm-up steps (the demo's: 600)")
    p.add_argument("--model", default=None, help="a saved tiny model instead of the warm-up (runs/demo/sft)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--edge-cases", action="store_true", help="part 4 only: feature scale, zero features, PR ties")
    p.add_argument("--tie-draws", type=int, default=200, help="part 4's draws of a batch with PR = 4.5")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    code = load(args.salt_repo, "advantage_decomposition")
    start = time.perf_counter()
    if args.edge_cases:
        part_edge_cases(code, args)
        print(f"\ntotal {time.perf_counter() - start:.0f} s, torch {torch.__version__}, {args.threads} thread(s)")
        return 0
    batches = part_synthetic(code, args)
    if args.micro:
        part_scope(code, args, batches)
    part_distributed(code, batches)
    if args.real:
        part_tiny_lm(args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s, torch {torch.__version__}, {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
