"""GeoAlign's projector step on one thread against N threads, side by side in one run, at the fork's batch sizes.

One `curate` call (GeoAlign §4.2's online projector, 50 Adam steps, then GDI and the KDE rule) per shape and thread
count, the two thread counts alternating within each repeat in a flipped order, so a shared machine's load hits both
alike. Random hidden states, binary rewards, the math preset with early stop off (val_acc 1.0; App. C.1's rule would
otherwise end some calls after a few steps), projector in_dim-512-512-128. It prints milliseconds per projector step
(the call's wall time over its steps; min over repeats) and the ratio one thread / N threads (> 1: N threads faster).
The shapes run from the CPU smoke's real LM (4 prompts x 4 rollouts, d = 576: the fork's `curate` in
benchmarks/fork_step_time.py --model smollm2) up to 96 x 16 at d = 2048 (benchmarks/geoalign_speed.py's).
Usage: python benchmarks/geoalign_threads.py [--threads 2] [--reps 4]
"""

import argparse
import time

import torch

from openrlhf_geo.geoalign import GeoAlignConfig, Projector, curate

# (prompts, rollouts per prompt, hidden size)
SHAPES = (
    (4, 4, 576), (8, 4, 576), (16, 4, 576), (32, 4, 576), (16, 8, 576), (8, 8, 2048), (16, 8, 2048), (96, 16, 2048)
)  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="the thread count compared with one")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args(argv)
    config = GeoAlignConfig.preset("math", val_acc=1.0)
    initial = torch.get_num_threads()
    try:
        table(config, args)
    finally:
        torch.set_num_threads(initial)
    return 0


def table(config, args):
    print(f"ms per projector step, min of {args.reps} (torch {torch.__version__}):")
    print(f"{'prompts x G':>12} {'d':>5} {'pairs':>6} {'1 thread':>9} {f'{args.threads} threads':>10} {'1 / N':>7}")
    for prompts, group, dim in SHAPES:
        gen = torch.Generator().manual_seed(0)
        group_ids = torch.arange(prompts).repeat_interleave(group)
        projectors = {t: Projector(dim, config, torch.Generator().manual_seed(0)) for t in (1, args.threads)}
        best, pairs = {1: float("inf"), args.threads: float("inf")}, []
        for rep in range(args.reps + 1):  # repeat 0 warms both up and is not counted
            hidden = torch.randn(prompts * group, dim, generator=gen)
            rewards = torch.randint(0, 2, (prompts * group,), generator=gen).double()
            order = (1, args.threads) if rep % 2 else (args.threads, 1)
            for threads in order:
                torch.set_num_threads(threads)
                start = time.perf_counter()
                _, stats = curate(hidden, rewards, group_ids, config, torch.Generator().manual_seed(rep),
                                  projector=projectors[threads])  # fmt: skip
                if rep and stats["proj_steps"] > 0:
                    best[threads] = min(best[threads], (time.perf_counter() - start) / stats["proj_steps"])
            pairs.append(stats["pairs"])
        one, many = 1e3 * best[1], 1e3 * best[args.threads]
        print(f"{prompts:>7} x {group:<3} {dim:>5} {max(pairs):>6.0f} {one:>9.2f} {many:>10.2f} {one / many:>7.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
