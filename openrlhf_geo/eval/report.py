"""`openrlhf-geo report`: paired multi-seed comparison (SALT App. H) with bootstrap CIs, tables and curves.

Input layout (one directory per method, one per seed; any file may be absent)::

    RUNS/<method>/seed<k>/summary.json        from `openrlhf-geo eval --output-dir RUNS/<method>/seed<k>`
    RUNS/<method>/seed<k>/metrics.jsonl       training curves: one JSON object per step, {"step": 10, "reward": ...}
    RUNS/<method>/seed<k>/**/events.out.tfevents.*   TensorBoard scalars (needs the `tensorboard` package)

Every method is compared with ``--baseline`` on each scalar metric (summary.json's ``metrics`` and, for keys named
with ``--final``, the last value of a training curve): mean paired gain over the seeds both have, with a bootstrap
CI of the mean per-seed difference. Writes ``report.md``, ``comparison.json`` and one PNG per curve metric.
"""

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from openrlhf_geo.eval.metrics import CI_METHODS, paired_gain

SEED_DIR = re.compile(r"seed[_-]?(\d+)$")


@dataclass
class Run:
    """One (method, seed): scalar metrics and training curves ``{metric: (steps (T,), values (T,))}``."""

    scalars: dict = field(default_factory=dict)
    curves: dict = field(default_factory=dict)


def read_metrics_jsonl(path):
    """Curves ``{key: (steps, values)}`` of a metrics.jsonl (numeric keys only; lines without "step" rejected)."""
    points = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "step" not in row:
            raise ValueError(f"{path}:{number}: every metrics.jsonl line needs a 'step' key")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                points.setdefault(key, []).append((row["step"], float(value)))
    return {key: tuple(np.array(v) for v in zip(*sorted(pts))) for key, pts in points.items()}


def read_tensorboard(run_dir):
    """Curves of every scalar tag in the TensorBoard event files under ``run_dir``."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ImportError(
            f"{run_dir} has TensorBoard event files but the `tensorboard` package is not installed: "
            "pip install tensorboard (or log metrics.jsonl)"
        ) from None
    curves = {}
    for events_dir in sorted({p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            events = accumulator.Scalars(tag)
            curves[tag] = (np.array([e.step for e in events]), np.array([e.value for e in events], dtype=np.float64))
    return curves


def load_runs(root, final_keys=()):
    """``{method: {seed: Run}}`` from the layout in the module docstring."""
    runs, warnings = {}, []
    for method_dir in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        for seed_dir in sorted(p for p in method_dir.iterdir() if p.is_dir()):
            match = SEED_DIR.search(seed_dir.name)
            if match is None:
                continue
            run = Run()
            if (seed_dir / "summary.json").exists():
                summary = json.loads((seed_dir / "summary.json").read_text())
                run.scalars.update({k: float(v) for k, v in summary.get("metrics", {}).items()})
            if (seed_dir / "metrics.jsonl").exists():
                run.curves.update(read_metrics_jsonl(seed_dir / "metrics.jsonl"))
            if any(seed_dir.rglob("events.out.tfevents.*")):
                try:
                    run.curves.update(read_tensorboard(seed_dir))
                except ImportError as error:
                    warnings.append(str(error))
            for key in final_keys:
                if key in run.curves:
                    run.scalars[f"final/{key}"] = float(run.curves[key][1][-1])
            runs.setdefault(method_dir.name, {})[int(match.group(1))] = run
    if not runs:
        raise FileNotFoundError(f"no runs under {root}: expected {root}/<method>/seed<k>/(summary.json|metrics.jsonl)")
    return runs, warnings


def compare(runs, baseline, confidence=0.95, n_resamples=9999, seed=0, ci_method="percentile"):
    """Rows ``{method, metric, seeds, baseline_mean/sd, method_mean/sd, gain, low, high}`` per metric both share."""
    if baseline not in runs:
        raise ValueError(f"--baseline {baseline!r} is not among the methods found: {sorted(runs)}")
    rows = []
    for method in sorted(m for m in runs if m != baseline):
        seeds = sorted(set(runs[method]) & set(runs[baseline]))
        metrics = sorted(
            {k for s in seeds for k in runs[method][s].scalars} & {k for s in seeds for k in runs[baseline][s].scalars}
        )
        for metric in metrics:
            paired = [s for s in seeds if metric in runs[method][s].scalars and metric in runs[baseline][s].scalars]
            ours = np.array([runs[method][s].scalars[metric] for s in paired])
            theirs = np.array([runs[baseline][s].scalars[metric] for s in paired])
            stats = paired_gain(ours, theirs, confidence, n_resamples, seed, ci_method)
            rows.append(
                {
                    "method": method,
                    "metric": metric,
                    "seeds": paired,
                    "baseline_mean": float(theirs.mean()),
                    "baseline_sd": float(theirs.std(ddof=1)) if len(paired) > 1 else math.nan,
                    "method_mean": float(ours.mean()),
                    "method_sd": float(ours.std(ddof=1)) if len(paired) > 1 else math.nan,
                    **stats,
                }
            )
    return rows


def _fmt(x, signed=False):
    return "n/a" if math.isnan(x) else (f"{x:+.4f}" if signed else f"{x:.4f}")


def markdown_table(rows, baseline, confidence=0.95):
    """A markdown table of ``compare`` rows: means ± sd over seeds, paired gain and its CI."""
    level = f"{100 * confidence:g}% CI"
    lines = [
        f"| method | metric | {baseline} (mean ± sd) | method (mean ± sd) | paired gain | {level} | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ci = "n/a" if math.isnan(r["low"]) else f"[{_fmt(r['low'], True)}, {_fmt(r['high'], True)}]"
        lines.append(
            f"| {r['method']} | {r['metric']} | {_fmt(r['baseline_mean'])} ± {_fmt(r['baseline_sd'])} | "
            f"{_fmt(r['method_mean'])} ± {_fmt(r['method_sd'])} | {_fmt(r['gain'], True)} | {ci} | {r['n']} |"
        )
    return "\n".join(lines)


def plot_curve(runs, metric, path):
    """PNG of ``metric`` vs step: per method, the mean over seeds (on the steps all seeds share) and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, seeds in sorted(runs.items()):
        curves = [run.curves[metric] for run in seeds.values() if metric in run.curves]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(s.tolist()) for s, _ in curves)))
        if not steps:
            continue
        values = np.array([[dict(zip(s.tolist(), v))[t] for t in steps] for s, v in curves])  # (seeds, steps)
        line = ax.plot(steps, values.mean(0), label=f"{method} (n={len(curves)})")[0]
        ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: mean over seeds, band = min..max")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser():
    parser = argparse.ArgumentParser(prog="openrlhf-geo report", description=__doc__.split("\n")[0])
    parser.add_argument("runs", help="directory laid out as RUNS/<method>/seed<k>/")
    parser.add_argument("--baseline", required=True, help="method every other method is compared with")
    parser.add_argument("--out", default=None, help="output directory (default: RUNS/report)")
    parser.add_argument("--curves", nargs="*", default=None, help="curve metrics to plot (default: all)")
    parser.add_argument("--final", nargs="*", default=[], help="curve metrics whose last value is compared too")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--n-resamples", type=int, default=9999)
    parser.add_argument("--ci-method", choices=CI_METHODS, default="percentile")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = Path(args.out or Path(args.runs) / "report")
    runs, warnings = load_runs(args.runs, args.final)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rows = compare(runs, args.baseline, args.confidence, args.n_resamples, args.seed, args.ci_method)
    out.mkdir(parents=True, exist_ok=True)
    available = sorted({k for seeds in runs.values() for run in seeds.values() for k in run.curves})
    missing = sorted(set(args.curves or []) - set(available))
    if missing:
        raise ValueError(f"--curves: no run logs {missing}; available: {available}")
    plots = []
    for metric in args.curves if args.curves is not None else available:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", metric) + ".png"
        plot_curve(runs, metric, out / name)
        plots.append((metric, name))

    seeds = {m: sorted(s) for m, s in runs.items()}
    lines = [
        "# Paired multi-seed comparison",
        "",
        f"Baseline: `{args.baseline}`. Seeds per method: "
        + ", ".join(f"`{m}` {s}" for m, s in seeds.items())
        + f". Gains are means of per-seed differences over the seeds both methods have; the {args.confidence:.0%} CI"
        f" bootstraps those differences (scipy.stats.bootstrap, {args.ci_method}, {args.n_resamples} resamples,"
        f" seed {args.seed}); n/a with fewer than two paired seeds.",
        "",
        markdown_table(rows, args.baseline, args.confidence) if rows else "_No metric shared with the baseline._",
    ]
    lines += [w for warning in warnings for w in ("", f"> warning: {warning}")]
    if plots:
        lines += ["", "## Training curves", ""] + [f"![{metric}]({name})" for metric, name in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "comparison.json").write_text(json.dumps({"baseline": args.baseline, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out / 'report.md'} ({len(rows)} comparisons, {len(plots)} plots)")
    return 0
