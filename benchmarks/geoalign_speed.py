"""GeoAlign step before / after mini-batched projector training: time and detection quality, side by side in one run.

  before  the previous defaults: every training pair in every Adam step (pair_batch=0), 20 % of the prompts held
          out, threshold rule, 0.2 flag cap, 100-score minimum. This reproduces the earlier code's plan and GDI
          exactly (same generator draws in the same order).
  after   the current defaults: epoch-wise shuffled mini-batches of 1024 pairs (the reference code's batch size),
          10 % of the prompts held out and validated once per epoch, the paper's pointwise rule, no gates.

[1] Step time: one whole `curate` call (pairs, 50 projector steps, GDI, KDE rule, plan) at 96 prompts x 16
    rollouts, d = 2048, projector 2048-512-512-128, binary rewards with 8 correct per prompt (6144 pairs), float32,
    2 threads, random hidden states (held-out accuracy stays near 50 %: no early stop, all 50 steps run). The two
    alternate within each repeat, in a flipped order every repeat, so a shared machine's load hits both alike; the
    per-repeat ratio before / after is the claim. Process CPU time (all threads) is printed beside the wall time: it
    does not count the time other processes hold the cores (though threads spinning at a barrier still count).
[2] Detection quality: the unit test's planted-outlier batches (64 prompts x 16, d = 128, projector 128-128-32,
    10 % of each prompt's binary rewards flipped; h = prompt base + 1[truly correct] e + noise), one per seed. AUROC
    of GDI for the flipped rollouts among the scored ones (depends on the projector training only), and the flags'
    precision / recall (these also follow the rule and gates), before and after on the same batch and seed; "full"
    is after with pair_batch=0, which isolates the mini-batches' effect on the AUROC.
Usage: python benchmarks/geoalign_speed.py [--reps 3] [--seeds 10] [--threads 2]
"""

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

from openrlhf_geo.geoalign import GeoAlignConfig, curate
from openrlhf_geo.rewards.noise import flip_binary

BEFORE = {"pair_batch": 0, "val_frac": 0.2, "rule": "threshold", "max_flag_frac": 0.2, "min_scores": 100}


def planted(n_prompts, group, dim, rate, seed):
    """The planted-outlier batch of tests/test_geoalign.py: (hidden, rewards, prompt ids, corrupted)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
    base = 3 * torch.randn(n_prompts, dim, generator=g)
    p_correct = 0.2 + 0.6 * torch.rand(n_prompts, generator=g)
    truth = (torch.rand(n_prompts, group, generator=g) < p_correct[:, None]).double().flatten()
    ids = 1000 + 7 * torch.arange(n_prompts).repeat_interleave(group)
    noise = torch.randn(len(truth), dim, generator=g) / dim**0.5
    hidden = base.repeat_interleave(group, 0) + truth[:, None] * e + noise
    rewards, corrupted = flip_binary(truth, ids, rate, g)
    return hidden, rewards, ids, corrupted


def mean_sd(values):
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    after = GeoAlignConfig()
    configs = {"before": replace(after, **BEFORE), "after": after}

    g = torch.Generator().manual_seed(0)
    n = args.prompts * args.group
    hidden = torch.randn(n, args.dim, generator=g)
    ids = torch.arange(args.prompts).repeat_interleave(args.group)
    rewards = (torch.arange(n) % args.group < args.group // 2).float()  # half correct: (G/2)^2 pairs per prompt
    widths = "-".join(map(str, (args.dim, *after.hidden_sizes, after.out_dim)))
    print(
        f"[1] step time: {args.prompts} prompts x {args.group} rollouts, d={args.dim}, projector {widths}, "
        f"{after.steps} steps, {args.threads} threads, load average {os.getloadavg()[0]:.1f}"
    )
    curate(hidden[: 4 * args.group], rewards[: 4 * args.group], ids[: 4 * args.group], replace(after, steps=2))
    times = {name: {"wall": [], "cpu": []} for name in configs}
    for rep in range(args.reps):
        for name in list(configs)[:: 1 if rep % 2 == 0 else -1]:
            cpu = time.process_time()
            _, stats = curate(hidden, rewards, ids, configs[name], torch.Generator().manual_seed(1))
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(stats["time_s"])
            print(
                f"  rep {rep} {name:<6} wall {stats['time_s']:6.2f} s, process CPU {times[name]['cpu'][-1]:6.2f} s "
                f"({stats['pairs']:.0f} pairs, {stats['proj_steps']:.0f} steps, val_acc {stats['val_acc']:.3f})"
            )
    for name, clock in times.items():
        wall, cpu = clock["wall"], clock["cpu"]
        print(
            f"  {name:<6} wall min {min(wall):.2f} s, median {statistics.median(wall):.2f} s; "
            f"process CPU min {min(cpu):.2f} s, median {statistics.median(cpu):.2f} s"
        )
    for clock in ("wall", "cpu"):
        ratios = [b / a for b, a in zip(times["before"][clock], times["after"][clock])]
        each = " ".join(f"{r:.2f}x" for r in ratios)
        print(f"  before / after {clock} per repeat: {each} (median {statistics.median(ratios):.2f}x)")

    print(f"\n[2] planted outliers: 64 prompts x 16, d=128, projector 128-128-32, 10 % flipped, {args.seeds} seeds")
    small = {name: replace(cfg, hidden_sizes=(128, 128), out_dim=32) for name, cfg in configs.items()}
    small["full"] = replace(small["after"], pair_batch=0)  # isolates the mini-batches' effect on GDI
    quality = {name: {"auroc": [], "precision": [], "recall": []} for name in small}
    print(f"  {'seed':>4} {'pairs':>6}   AUROC before  after   full   precision before  after   recall before  after")
    for seed in range(args.seeds):
        batch = planted(64, 16, 128, 0.1, seed)
        row = {}
        for name, cfg in small.items():
            _, stats = curate(*batch[:3], cfg, torch.Generator().manual_seed(seed), corrupted=batch[3])
            row[name] = stats
            for key in quality[name]:
                quality[name][key].append(stats[key])
        b, a, f = row["before"], row["after"], row["full"]
        print(
            f"  {seed:>4} {a['pairs']:>6.0f}   {b['auroc']:12.4f} {a['auroc']:6.4f} {f['auroc']:6.4f}   "
            f"{b['precision']:16.4f} {a['precision']:6.4f}   {b['recall']:13.4f} {a['recall']:6.4f}"
        )
    for key in ("auroc", "precision", "recall"):
        print(f"  {key:<9} " + "   ".join(f"{name} {mean_sd(values[key])}" for name, values in quality.items()))
    for other in ("before", "full"):
        diff = [a - b for a, b in zip(quality["after"]["auroc"], quality[other]["auroc"])]
        se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
        print(f"  AUROC after - {other}: mean {statistics.mean(diff):+.4f}, paired standard error {se:.4f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
