"""GeoAlign projector training: naive per-pair vs pair-factored first layer, side by side in one run (issue 3).

Setup (defaults): 96 prompts x 16 rollouts, d = 2048, binary rewards with 8 correct per prompt (64 pairs per prompt,
6144 pairs), the default projector 2048-512-512-128, 50 full-batch Adam steps with cosine LR, 2 threads, float32.

  naive     materialise u_p = (h_w - h_l) / ||h_w - h_l|| (P, d) and push [u; -u] (2P rows) through the whole MLP
  factored  Projector.pair_forward, as curate trains: Z = H W1^T once per rollout, (Z_w - Z_l) / dist, both
            orientations share Z
  tail      layers 2-3 alone on the 2P rows (forward + backward): the part factoring the first layer cannot remove
  curate    one whole curate() call (80 % of prompts train, validation each step, GDI, KDE, plan)

naive, factored and tail start from the same weights and run in lockstep, one step of each in turn (rotating the
order), so a shared machine's load hits them alike; each variant's time is the sum of its step times, and the
median step time x steps is printed as a load-robust estimate. naive and factored losses are compared step by step.
Usage: python benchmarks/geoalign_speed.py [--reps 3] [--threads 2] [--hidden-sizes 512 512] [--out-dim 128]
"""

import argparse
import copy
import os
import statistics
import time
from dataclasses import replace

import torch

from openrlhf_geo.geoalign import GeoAlignConfig, Projector, curate, orientation_loss, pair_distances, preference_pairs


def stepper(projector, probe, steps, lr, scores):
    """A function doing one Adam step (cosine LR over `steps`) on the orientation loss of
    `scores(projector, probe)` -> (2, P), returning the loss."""
    optimizer = torch.optim.Adam([*projector.parameters(), probe], lr=lr, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    def step():
        loss = orientation_loss(*scores(projector, probe))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        return loss.item()

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--hidden-sizes", type=int, nargs="+", default=list(GeoAlignConfig.hidden_sizes))
    parser.add_argument("--out-dim", type=int, default=GeoAlignConfig.out_dim)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-curate", action="store_true", help="time only the three training loops")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    config = GeoAlignConfig(hidden_sizes=tuple(args.hidden_sizes), out_dim=args.out_dim, steps=args.steps)
    g = torch.Generator().manual_seed(0)
    n = args.prompts * args.group
    hidden = torch.randn(n, args.dim, generator=g)
    ids = torch.arange(args.prompts).repeat_interleave(args.group)
    rewards = (torch.arange(n) % args.group < args.group // 2).float()  # half correct: (G/2)^2 pairs per prompt
    winner, loser = preference_pairs(rewards, ids)
    dist = pair_distances(hidden, winner, loser, ids).float()
    pairs = len(winner)
    base = Projector(args.dim, config, g)
    base_probe = torch.empty(args.out_dim).uniform_(-(args.out_dim**-0.5), args.out_dim**-0.5, generator=g)

    widths = (args.dim, *args.hidden_sizes, args.out_dim)
    tail_macs = 3 * 2 * pairs * sum(a * b for a, b in zip(widths[1:-1], widths[2:]))  # fwd + both backward matmuls
    naive_macs = 2 * 2 * pairs * widths[0] * widths[1] + tail_macs  # forward + weight gradient, no input gradient
    factored_macs = 2 * n * widths[0] * widths[1] + tail_macs
    print(
        f"{args.prompts} prompts x {args.group} rollouts, d={args.dim}, projector {'-'.join(map(str, widths))}, "
        f"{pairs} pairs, {args.steps} steps, {args.threads} threads, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"multiply-adds per step: naive {naive_macs / 1e9:.1f} G, factored {factored_macs / 1e9:.1f} G "
        f"(layers after the first: {tail_macs / 1e9:.1f} G); FLOP-bound speed-up {naive_macs / factored_macs:.2f}x"
    )

    u = (hidden[winner] - hidden[loser]) / dist[:, None]
    both = torch.cat((u, -u))  # the naive form materialises [u; -u] once (untimed: it favours naive)
    first = torch.randn(2, pairs, widths[1], generator=g)  # stand-in first-layer output for the tail

    def naive(projector, probe):
        return projector(both).view(2, pairs, -1) @ probe

    def factored(projector, probe):
        return projector.pair_forward(hidden, winner, loser, dist) @ probe

    def tail(projector, probe):
        a = first.detach().requires_grad_()  # backward computes its gradient too, as layer 1 would need
        for layer in projector.layers[1:]:
            a = layer(torch.relu(a))
        return a @ probe

    def variants():
        """Fresh steppers, all from the same initial weights."""
        made = {}
        for scores in (naive, factored, tail):
            projector, probe = copy.deepcopy(base), base_probe.clone().requires_grad_()
            made[scores.__name__] = stepper(projector, probe, args.steps, config.lr, scores)
        return made

    for step in variants().values():  # warm-up (allocator, BLAS and kernel initialisation), not timed
        step()
    totals = {name: [] for name in ("naive", "factored", "tail", "curate")}
    step_times = {name: [] for name in ("naive", "factored", "tail")}
    for _ in range(args.reps):
        steps = variants()
        names = list(steps)
        spent = dict.fromkeys(names, 0.0)
        losses = {name: [] for name in names}
        for t in range(args.steps):
            for name in names[t % 3 :] + names[: t % 3]:
                start = time.perf_counter()
                losses[name].append(steps[name]())
                took = time.perf_counter() - start
                spent[name] += took
                step_times[name].append(took)
        for name in names:
            totals[name].append(spent[name])
        if not args.skip_curate:
            start = time.perf_counter()
            _, stats = curate(hidden, rewards, ids, replace(config), torch.Generator().manual_seed(1))
            totals["curate"].append(time.perf_counter() - start)

    print(f"\n{'variant':<10} {'min s':>8} {'median s':>9} {'median step x steps':>20}   per-run seconds")
    for name, ts in totals.items():
        if ts:
            robust = f"{statistics.median(step_times[name]) * args.steps:20.2f}" if name in step_times else " " * 20
            runs = " ".join(f"{t:.2f}" for t in ts)
            print(f"{name:<10} {min(ts):8.2f} {statistics.median(ts):9.2f} {robust}   {runs}")
    ratio = min(totals["naive"]) / min(totals["factored"])
    ratio_median = statistics.median(totals["naive"]) / statistics.median(totals["factored"])
    ratio_step = statistics.median(step_times["naive"]) / statistics.median(step_times["factored"])
    print(f"\nspeed-up naive / factored: {ratio:.2f}x (min), {ratio_median:.2f}x (median), {ratio_step:.2f}x (step)")
    print(f"factored / tail: {statistics.median(step_times['factored']) / statistics.median(step_times['tail']):.2f}x")
    if totals["curate"]:
        print(f"curate ran {stats['proj_steps']:.0f} projector steps (no early stop on random hidden states)")
    diff = max(abs(a - b) for a, b in zip(losses["naive"], losses["factored"]))
    print(
        f"losses: naive {losses['naive'][0]:.6f} -> {losses['naive'][-1]:.6f}, factored "
        f"{losses['factored'][0]:.6f} -> {losses['factored'][-1]:.6f}, max |diff| over {args.steps} steps {diff:.2e}"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
