"""`openrlhf-geo` console entry point: one sub-command per module, imported only when used.

Each target module exposes ``main(argv: list[str]) -> int | None`` and parses its own arguments, so
``openrlhf-geo train-ppo-ray ARGS`` hands every upstream flag through untouched.
"""

import importlib
import sys

COMMANDS = {
    "demo": ("openrlhf_geo.lab.demo", "tiny SFT->RL on CPU: GRPO vs +SALT vs +GeoAlign, with a report"),
    "study": ("openrlhf_geo.lab.study", "the CPU studies of docs/studies/, resumable, with a report"),
    "inspect": ("openrlhf_geo.lab.inspection", "SALT's regime and GeoAlign's separability on your model and data"),
    "train": ("openrlhf_geo.local.training", "single-process training run (CPU or one GPU)"),
    "train-ppo-ray": ("openrlhf_geo.fork.launch", "upstream openrlhf.cli.train_ppo_ray with the fork's patches"),
    "fork": ("openrlhf_geo.fork.install", "fork maintenance: `fork verify`, `fork path`"),
    "eval": ("openrlhf_geo.eval.harness", "avg@n and pass@k on math benchmarks"),
    "report": ("openrlhf_geo.eval.report", "paired multi-seed comparison with bootstrap CIs and plots"),
    "judge": ("openrlhf_geo.eval.judge", "pairwise LLM judge with position swap (GeoAlign HH-RLHF win rate)"),
    "serve-rm": ("openrlhf_geo.rewards.armorm", "serve ArmoRM scores over HTTP for --reward.remote_url"),
    "model": ("openrlhf_geo.real_lm", "convert a registry-installed pretrained LM (smollm2) once into the cache"),
}

# commands whose per-seed results the README reports: the same CPU kernels on every machine (local.kernels)
PINNED = ("demo", "study")


def usage():
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "usage: openrlhf-geo COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"openrlhf-geo: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if command in PINNED and "torch" not in sys.modules:  # else too late for this process (the run warns)
        from openrlhf_geo.local import kernels  # imports nothing heavy: before torch computes anything

        kernels.pin()
    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
