"""`openrlhf-geo study NAME`: the CPU studies, most a declarative list of conditions (protocols: docs/studies/).

    salt-scaling      SALT rollout scaling at a fixed rollout budget (SALT arXiv 2606.05800 §4.4, Fig. 4(c, d),
                      Fig. 9, App. F.4-F.5, Table 10), GRPO and DAPO backbones, each ± SALT
    regime            what moves the backbone's n_eff below 1 and D_a toward Table 10's on CPU-sized models
    learnable-regime  a task of intermediate difficulty where GRPO learns and its n_eff is below 1 (GRPO runs only)
    salt-ablations    SALT's App. F.3 ablations, fixed-α sweep and matched nulls under the demo's setting
    geoalign-failure  GeoAlign under a systematically misspecified reward next to random flips (GeoAlign arXiv
                      2606.26917 §5.3), against noisy GRPO and the four baselines of its App. B.5
    salt-proxy        SALT Table 1 / App. E: the LM-head proxy against full per-sample gradients and nulls at
                      checkpoints of the demo's GRPO run (not a list of conditions: it steps the runs itself)
    long-cot          a long chain-of-thought task (repeated-addition traces of 116-260 tokens): GRPO's n_eff per
                      length, then GRPO vs SALT and fixed α where a length is learnable and n_eff < 1 (two phases)

Each study is a module of `openrlhf_geo.lab.studies` (registered in its MODULES); a study of conditions runs
through `studies.runner` (plan, resume, time estimate, settings, summary.json, report.md). This module is the
command line: it checks the options, claims --out for the command (`rundir.claim_output`) and runs the study there.
"""

import os
import signal
import sys
from pathlib import Path

from openrlhf_geo.lab.studies.registry import REGISTRY
from openrlhf_geo.local import rundir
from openrlhf_geo.local.flags import FlagParser

MAX_SEED = 2**32 - 1  # a run's seed and its streams' (seed + stages.STREAM_OFFSETS) fit every generator it seeds
OPTIONS = {
    "regime": "demo",
    "generator": "vllm",
    "resummarize": None,
}  # study-specific options (a study takes those in its `options`) and their defaults


def build_parser():
    p = FlagParser(prog="openrlhf-geo study", description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=tuple(REGISTRY), help="which study (protocol: docs/studies/NAME.md)")
    p.add_argument("--out", default=None, help="output directory (default runs/studies/NAME, NAME-quick with --quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the protocol's)")
    p.add_argument("--quick", action="store_true", help="smoke run: one seed, two conditions, 2 steps, short SFT")
    p.add_argument("--workers", type=int, default=None, help="runs in parallel processes (default 2; --quick 1)")
    p.add_argument("--regime", default=None, help="salt-scaling only: a regime or learnable-regime setting to run in")
    p.add_argument(
        "--generator",
        default=None,
        choices=("vllm", "hf"),
        help="real-LM studies only: sample rollouts with vLLM's CPU build (default) or HF generate",
    )
    p.add_argument(
        "--resummarize",
        default=None,
        metavar="DIR",
        help="real-LM studies only: rewrite DIR's summary.json and report.md from the records the run wrote there "
        "(real-lm-proxy: block<b>.json; real-lm-geometry, real-lm-geoalign: records.json; real-lm-rl: the runs' "
        "metrics) with the current code (no model, no collection; nothing else runs)",
    )
    return p


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        study = REGISTRY[args.name]
        for option in OPTIONS:
            if getattr(args, option) is not None and option not in study.options:
                takers = " and ".join(name for name, s in REGISTRY.items() if option in s.options)
                raise ValueError(f"--{option} only applies to {takers} (got study {args.name})")
        options = {key: getattr(args, key) for key in study.options if getattr(args, key) is not None}
        if args.resummarize is not None:
            run_flags = {"out": args.out, "seeds": args.seeds, "quick": args.quick or None, "workers": args.workers,
                         "generator": args.generator}  # fmt: skip
            extra = [f"--{key}" for key, value in run_flags.items() if value is not None]
            if extra:
                raise ValueError(f"--resummarize rewrites DIR's summary and report from its blocks in place; it takes "
                                 f"no {' or '.join(extra)}")  # fmt: skip
        study.check(**options)
        workers = args.workers if args.workers is not None else 1 if args.quick else min(2, os.cpu_count() or 1)
        if workers < 1:
            raise ValueError(f"--workers must be >= 1 (got {workers})")
        bad = [seed for seed in args.seeds or () if not 0 <= seed <= MAX_SEED]
        if bad:
            raise ValueError(f"--seeds must lie in [0, {MAX_SEED}] (got {bad[0]}): a run's random streams are "
                             "seeded with it, and its directory is seed<k>")  # fmt: skip
        if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
            raise ValueError(f"--seeds must be distinct (got {' '.join(map(str, args.seeds))})")
        if args.seeds is not None and study.seed is not None and len(args.seeds) != 1:
            raise ValueError(f"--seeds: {args.name} runs one seed (got {' '.join(map(str, args.seeds))}); run it once "
                             "per seed, each with its own --out")  # fmt: skip
    except ValueError as error:
        print(f"openrlhf-geo study: error: {error}", file=sys.stderr)
        return 2
    if args.resummarize is not None:  # no run: DIR is rewritten in place, not claimed as an --out
        try:
            return study.resummarize(args.resummarize)
        except ValueError as error:
            print(f"openrlhf-geo study: error: {error}", file=sys.stderr)
            return 2
    # what the runs depend on (not the --seeds of a study of several: each run records its own command,
    # `runner.finished`)
    given = "".join(f" --{key} {value}" for key, value in options.items() if value != OPTIONS[key])
    if study.seed is not None:
        args.seeds = args.seeds or [study.seed]
        given += f" --seeds {args.seeds[0]}" if args.seeds[0] != study.seed else ""
    command = f"openrlhf-geo study {args.name}{given}" + (" --quick" if args.quick else "")
    # SIGTERM unwinds like Ctrl-C, so what a study started (the real-LM studies' vLLM sampler, its own process
    # group) is stopped by its handle; the default SIGTERM exits without running a `finally`
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        out = Path(args.out or f"runs/studies/{args.name}" + ("-quick" if args.quick else ""))
        with rundir.claim_output(out, command):
            return study.run(args, out, workers)
    except rundir.OutputClaimed as error:
        print(f"openrlhf-geo study: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what finished is kept (runs, checkpoints, cached rollouts): the study resumes from it
        print(f"openrlhf-geo study: interrupted; the same command with --out {out} resumes where it stopped",
              file=sys.stderr)  # fmt: skip
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
