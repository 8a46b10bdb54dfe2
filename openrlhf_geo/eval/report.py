"""`openrlhf-geo report`: paired multi-seed comparison (SALT App. H) with bootstrap CIs, tables and curves.

Input layout (one directory per method, one per seed; any file may be absent)::

    RUNS/<method>/seed<k>/summary.json        from `openrlhf-geo eval --output-dir RUNS/<method>/seed<k>`
    RUNS/<method>/seed<k>/metrics.jsonl       training curves: one JSON object per step, {"step": 10, "reward": ...}
    RUNS/<method>/seed<k>/**/events.out.tfevents.*   TensorBoard scalars (needs the `tensorboard` package)

Every method is compared with ``--baseline`` on each scalar metric (summary.json's ``metrics`` and, for curve
metrics named with ``--final-metrics``, the ``--final`` aggregate of the curve): mean paired gain over the seeds both
have, with a bootstrap CI of the mean per-seed difference (seeds only one of the two has are a warning naming the
method and those seeds). Writes ``report.md``, ``comparison.json`` and one PNG per curve metric into ``--out``: a new
directory or a previous report's (rewritten); one holding any of those files from elsewhere (a study's report.md, say)
is refused, as is a file.

``--final`` aggregates a curve over its last logged steps, the same steps for every run: ``last`` (the final step),
``last-n 5`` (GeoAlign, arXiv 2606.26917 §5.1 and App. B.2: the mean of the last five evaluations, run every 10 steps)
or ``last-frac 0.2`` (SALT, arXiv 2606.05800 App. F.5, Table 10: the last 20 % of checkpoints, ceil(0.2·T) of the T
logged steps; the paper does not say how a fraction of a checkpoint rounds). ``--smooth-ema 0.6`` smooths the plotted
curves as GeoAlign App. B.2 does (EMA factor 0.6, TensorBoard's convention: weight 0.6 on the running value).

Bad input is an error naming the method, seed and file, never a silent merge or fallback: a summary.json metric that
is not a finite number, two directories naming one seed (``seed0``, ``seed_0``), a metric logged twice at one step,
a run whose curve lacks a step of the ``--final`` window or is null/NaN there. ``main`` prints such errors on one
line and exits with status 2.
"""

import argparse
import json
import math
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats
from scipy.signal import lfilter

from openrlhf_geo import GeoWarning
from openrlhf_geo.eval.metrics import CI_METHODS, check_bootstrap_flags, paired_gain

SEED_DIR = re.compile(r"seed[_-]?(\d+)$")
# Keys of metrics.jsonl lines that are not metrics: the run tags `openrlhf-geo train` writes on every line, and
# GeoAlign's skip reason (a str, "" when curation ran).
TAG_KEYS = ("method", "seed", "geo/skipped_reason")


@dataclass
class Run:
    """One (method, seed): scalar metrics and training curves ``{metric: (steps (T,), values (T,))}``."""

    scalars: dict = field(default_factory=dict)
    curves: dict = field(default_factory=dict)


def read_metrics_jsonl(path):
    """Curves ``{key: (steps, values)}`` of a metrics.jsonl; ValueError naming ``file:line`` for a malformed line.

    Every line is a JSON object with an integer "step". Values are numbers; null, NaN and ±inf (``openrlhf-geo
    train`` writes NaN as null) become NaN: a gap in plots, an error where the value is aggregated. ``TAG_KEYS`` are
    skipped; a string, bool, list or object in any other key is an error, as is a key logged twice at one step. A
    last line that does not parse and lacks its newline (a crash mid-write) is dropped with a warning.
    """
    text = Path(path).read_text()
    lines = text.splitlines()
    points, first_line = {}, {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):
                warnings.warn(
                    f"{path}:{number}: dropped a truncated last line (a crash mid-write?)", GeoWarning, stacklevel=2
                )
                continue
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object (got {type(row).__name__})")
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}:{number}: every metrics.jsonl line needs an integer 'step' (got {step!r})")
        for key, value in row.items():
            if key == "step" or key in TAG_KEYS:
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{path}:{number}: metric {key!r} is {str(value)[:40]!r}, not a number")
            if (key, step) in first_line:
                raise ValueError(
                    f"{path}:{number}: {key!r} at step {step} again (first on line {first_line[key, step]})"
                )
            first_line[key, step] = number
            finite = value is not None and math.isfinite(value)
            points.setdefault(key, []).append((step, float(value) if finite else math.nan))
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
    curves, where = {}, {}
    for events_dir in sorted({p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tag in curves:
                raise ValueError(f"TensorBoard tag {tag!r} is logged both under {where[tag]} and {events_dir}")
            events = accumulator.Scalars(tag)
            steps, counts = np.unique([e.step for e in events], return_counts=True)
            if (counts > 1).any():  # e.g. a restarted run that logged the same steps again
                raise ValueError(
                    f"{events_dir}: TensorBoard tag {tag!r} has step {steps[counts > 1][0]} more than once"
                )
            order = np.argsort([e.step for e in events], kind="stable")
            values = np.array([events[i].value for i in order], dtype=np.float64)
            curves[tag], where[tag] = (steps, np.where(np.isfinite(values), values, np.nan)), events_dir
    return curves


def _read_summary(path):
    """summary.json's ``metrics`` as floats; ValueError naming the key unless each is a finite number."""
    try:
        metrics = json.loads(path.read_text()).get("metrics", {})
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{path}: not a JSON object") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: 'metrics' must map names to numbers (got {type(metrics).__name__})")
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path}: metric {key!r} is {str(value)[:40]!r}, not a finite number")
    return {key: float(value) for key, value in metrics.items()}


def scan_runs(root):
    """``({method: {seed: Run}}, {(method, seed): {metric: source file}}, warnings)`` of the module docstring's layout.

    ValueError (naming method, seed and file) for two directories naming one seed, a bad summary.json metric, a
    malformed metrics.jsonl or TensorBoard log (``read_metrics_jsonl``, ``read_tensorboard``), or a curve logged in
    both. Warnings: a truncated last metrics.jsonl line, TensorBoard logs without the `tensorboard` package.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} is a file, not a directory (expected {root}/<method>/seed<k>/)")
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected {root}/<method>/seed<k>/)")
    runs, sources, notes = {}, {}, []
    for method_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        seed_dirs = {}
        for seed_dir in sorted(p for p in method_dir.iterdir() if p.is_dir()):
            match = SEED_DIR.search(seed_dir.name)
            if match is None:
                continue
            seed = int(match.group(1))
            if seed in seed_dirs:
                raise ValueError(
                    f"method {method_dir.name!r}: {seed_dirs[seed]} and {seed_dir} both name seed {seed}; keep one"
                )
            seed_dirs[seed] = seed_dir
        for seed, seed_dir in seed_dirs.items():
            where, run, source = f"method {method_dir.name!r} seed {seed}", Run(), {}
            try:
                for name in ("summary.json", "metrics.jsonl"):
                    if (seed_dir / name).is_dir():
                        raise ValueError(f"{seed_dir / name} is a directory, not a file")
                if (seed_dir / "summary.json").exists():
                    run.scalars.update(_read_summary(seed_dir / "summary.json"))
                    source.update(dict.fromkeys(run.scalars, seed_dir / "summary.json"))
                if (seed_dir / "metrics.jsonl").exists():
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        run.curves.update(read_metrics_jsonl(seed_dir / "metrics.jsonl"))
                    notes += [f"{where}: {w.message}" for w in caught]
                    source.update(dict.fromkeys(run.curves, seed_dir / "metrics.jsonl"))
                if any(seed_dir.rglob("events.out.tfevents.*")):
                    try:
                        curves = read_tensorboard(seed_dir)
                    except ImportError as error:
                        notes.append(str(error))
                        curves = {}
                    if set(curves) & set(run.curves):
                        key = sorted(set(curves) & set(run.curves))[0]
                        raise ValueError(f"{key!r} is logged both in {source[key]} and in TensorBoard; keep one")
                    run.curves.update(curves)
                    source.update(dict.fromkeys(curves, f"TensorBoard logs under {seed_dir}"))
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            runs.setdefault(method_dir.name, {})[seed] = run
            sources[method_dir.name, seed] = source
    if not runs:
        raise FileNotFoundError(f"no runs under {root}: expected {root}/<method>/seed<k>/(summary.json|metrics.jsonl)")
    return runs, sources, notes


def load_runs(root, final_keys=()):
    """``({method: {seed: Run}}, warnings)`` as ``scan_runs`` reads them; each of ``final_keys`` adds the scalar
    ``final/<key>``: the curve's value at the last step any run logged it (``final_scalars``, ``--final last``)."""
    runs, sources, notes = scan_runs(root)
    final_scalars(runs, final_keys, ("last", 1), sources)
    return runs, notes


def parse_final(tokens):
    """``--final`` tokens -> ``(mode, N or F)``: ``last``, ``last-n N`` (N >= 1) or ``last-frac F`` (0 < F <= 1)."""
    usage = "--final takes last, last-n N or last-frac F (curve metrics are named with --final-metrics)"
    mode, *rest = tokens
    if mode == "last" and not rest:
        return "last", 1
    if mode in ("last-n", "last-frac") and len(rest) == 1:
        try:
            value = int(rest[0]) if mode == "last-n" else float(rest[0])
        except ValueError:
            raise ValueError(f"{usage} (got --final {' '.join(tokens)})") from None
        if (mode == "last-n" and value >= 1) or (mode == "last-frac" and 0 < value <= 1):
            return mode, value
    raise ValueError(f"{usage} (got --final {' '.join(tokens)})")


def final_name(key, final):
    """The scalar a ``--final`` aggregate of curve ``key`` is compared as: final/, last<N>/ or last<P>%/<key>."""
    mode, value = final
    return {"last": "final", "last-n": f"last{value}", "last-frac": f"last{100 * value:g}%"}[mode] + f"/{key}"


def final_scalars(runs, keys, final=("last", 1), sources=None, skip_undefined=False):
    """Adds ``final_name(key, final)`` to every run's scalars: the mean of curve ``key`` over the final window.

    The window is the last steps of the union of the steps any run logged ``key`` at: one (``last``), N (``last-n``,
    GeoAlign arXiv 2606.26917 App. B.2) or ceil(F·T) of the T steps (``last-frac``, SALT arXiv 2606.05800 App. F.5
    Table 10). Every run must have a finite value at every window step, so a run that stopped early, or logged
    null/NaN there, is a ValueError naming it rather than a silent fallback to its own last step.
    ``skip_undefined``: for a diagnostic that is undefined on some steps (SALT's geometry is NaN on a step where every
    group is tied), such a step is left out of the run's mean instead, and a run without a value in the window, or
    not logging ``key``, gets no scalar. Returns ``{key: window steps}``. ``sources``: ``scan_runs``'s
    ``{(method, seed): {metric: file}}`` for messages.
    """
    mode, value = final
    flag = f"--final {mode}" + ("" if mode == "last" else f" {value}")
    windows = {}
    for key in keys:
        logged = [run.curves[key][0] for seeds in runs.values() for run in seeds.values() if key in run.curves]
        if not logged:
            raise ValueError(f"--final-metrics: no run logs {key!r}")
        steps = np.unique(np.concatenate(logged)).tolist()
        count = value if mode != "last-frac" else math.ceil(round(value * len(steps), 9))
        if count > len(steps):
            raise ValueError(f"{flag}: the runs log {key!r} at only {len(steps)} steps ({steps})")
        window = windows[key] = steps[-count:]
        for method, seeds in sorted(runs.items()):
            for seed, run in sorted(seeds.items()):
                where = f"method {method!r} seed {seed}"
                if sources and key in sources.get((method, seed), {}):
                    where += f" ({sources[method, seed][key]})"
                if key not in run.curves and skip_undefined:
                    continue
                if key not in run.curves:
                    raise ValueError(f"{flag}: {where} does not log {key!r}; other runs do, up to step {steps[-1]}")
                values = dict(zip(*(a.tolist() for a in run.curves[key])))
                if skip_undefined:
                    defined = [values[t] for t in window if t in values and math.isfinite(values[t])]
                    if defined:
                        run.scalars[final_name(key, final)] = float(np.mean(defined))
                    continue
                missing = [t for t in window if t not in values]
                if missing:
                    raise ValueError(
                        f"{flag}: {where} has no {key!r} at step(s) {missing} of the final window {window} "
                        f"(its last step is {max(values)}); every run must reach the same final step"
                    )
                bad = [t for t in window if not math.isfinite(values[t])]
                if bad:
                    raise ValueError(
                        f"{flag}: {where} logged {key!r} as null/NaN at step(s) {bad} of the final window"
                    )
                run.scalars[final_name(key, final)] = float(np.mean([values[t] for t in window]))
    return windows


def ema(values, weight):
    """GeoAlign App. B.2 curve smoothing (EMA factor 0.6), as TensorBoard computes it, along the last axis.

    s_t = (1 - w) Σ_{i<=t} w^(t-i) x_i / (1 - w^(t+1)): weight ``w`` on the running value, debiased so that the first
    point is x_0 (not (1 - w) x_0). ``w = 0`` is the identity. The paper names only the factor; 0.6 is TensorBoard's
    default smoothing weight, which fixes the convention.
    """
    if not 0 <= weight < 1:
        raise ValueError(f"--smooth-ema must be in [0, 1) (got {weight})")
    values = np.asarray(values, dtype=np.float64)
    running = lfilter([1 - weight], [1, -weight], values, axis=-1)
    return running / (1 - weight ** np.arange(1, values.shape[-1] + 1))


def curve_correlation(seeds, x_key, y_key):
    """Pearson and Spearman correlation of two curves over the steps (>= 1) where both are finite, pooled over the
    runs {seed: Run} -> {"pearson", "spearman", "n"}; NaN with fewer than 3 points or a constant curve."""
    x, y = [], []
    for run in seeds.values():
        if x_key in run.curves and y_key in run.curves:
            (sx, vx), (sy, vy) = run.curves[x_key], run.curves[y_key]
            steps, ix, iy = np.intersect1d(sx, sy, return_indices=True)
            ok = (steps >= 1) & np.isfinite(vx[ix]) & np.isfinite(vy[iy])
            x, y = [*x, *vx[ix][ok]], [*y, *vy[iy][ok]]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"pearson": math.nan, "spearman": math.nan, "n": len(x)}
    return {"pearson": float(stats.pearsonr(x, y).statistic), "spearman": float(stats.spearmanr(x, y).statistic),
            "n": len(x)}  # fmt: skip


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


def unpaired_seeds(runs, baseline):
    """Warnings for the seeds ``compare`` leaves out: a method's seeds the baseline lacks and the baseline's seeds
    a method lacks, each naming the method and those seeds (a method sharing none is not compared at all)."""
    if baseline not in runs:
        return []  # compare says so
    base, notes = set(runs[baseline]), []
    for method in sorted(m for m in runs if m != baseline):
        own = set(runs[method])
        if not base & own:
            notes.append(
                f"method {method!r} lacks every seed of --baseline {baseline!r} ({sorted(base)}; it has "
                f"{sorted(own)}): it is not compared"
            )
            continue
        compared = f"compared on seeds {sorted(base & own)}"
        if base - own:
            notes.append(f"method {method!r} lacks seeds {sorted(base - own)} of --baseline {baseline!r}: {compared}")
        if own - base:
            notes.append(f"--baseline {baseline!r} lacks seeds {sorted(own - base)} of method {method!r}: {compared}")
    return notes


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


def plot_curve(runs, metric, path, smooth=None):
    """PNG of ``metric`` vs step: per method, the mean over seeds (on the steps where all seeds have a finite value)
    and the min-max band; with ``smooth`` (an ``ema`` weight) each seed's curve is smoothed first and the raw mean is
    drawn faintly behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, seeds in sorted(runs.items()):
        curves = [run.curves[metric] for run in seeds.values() if metric in run.curves]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(s[np.isfinite(v)].tolist()) for s, v in curves)))
        if not steps:
            continue
        values = np.array([[dict(zip(s.tolist(), v))[t] for t in steps] for s, v in curves])  # (seeds, steps)
        if smooth:
            raw, values = values.mean(0), ema(values, smooth)
        line = ax.plot(steps, values.mean(0), label=f"{method} (n={len(curves)})")[0]
        ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.2, linewidth=0)
        if smooth:
            ax.plot(steps, raw, color=line.get_color(), alpha=0.3, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: mean over seeds, band = min..max" + (f", EMA {smooth:g}" if smooth else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser():
    parser = argparse.ArgumentParser(prog="openrlhf-geo report", description=__doc__.split("\n")[0])
    parser.add_argument("runs", help="directory laid out as RUNS/<method>/seed<k>/")
    parser.add_argument("--baseline", required=True, help="method every other method is compared with")
    parser.add_argument("--out", default=None, help="new directory or a previous report's (default: RUNS/report)")
    parser.add_argument("--curves", nargs="*", default=None, help="curve metrics to plot (default: all)")
    parser.add_argument("--final-metrics", nargs="*", default=[], help="curve metrics compared by their --final value")
    parser.add_argument(
        "--final",
        nargs="+",
        default=["last"],
        metavar="MODE",
        help="how --final-metrics curves are summarised: last (default) | last-n N (GeoAlign arXiv 2606.26917 "
        "App. B.2: last-n 5) | last-frac F (SALT arXiv 2606.05800 App. F.5 Table 10: last-frac 0.2)",
    )
    parser.add_argument(
        "--smooth-ema",
        type=float,
        default=None,
        metavar="W",
        help="EMA-smooth plotted curves with weight W on the running value (GeoAlign App. B.2: 0.6)",
    )
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--n-resamples", type=int, default=9999)
    parser.add_argument("--ci-method", choices=CI_METHODS, default="percentile")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return parser


def is_report(out):
    """Whether directory `out` holds a report this command wrote (its comparison.json)."""
    try:
        previous = json.loads((Path(out) / "comparison.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(previous, dict) and {"baseline", "final", "rows"} <= previous.keys()


def claim_out(out, names):
    """Create directory `out` for the report's files `names`; ValueError naming --out when it is a file, cannot be
    written, or would overwrite a file of `names` that is not a previous report's (a study's report.md, say)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a directory (a new one or a previous report's)")
    taken = [] if is_report(out) else [name for name in names if (out / name).exists()]
    if taken:
        raise ValueError(f"--out {out} holds {', '.join(taken)} not written by `openrlhf-geo report`; choose another "
                         "--out (a new directory or a previous report's)")  # fmt: skip
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # a read-only --out fails here, before any file is written
            pass
    except OSError as error:  # e.g. a file where a parent directory should be
        raise ValueError(f"--out {out}: cannot write there ({error.strerror or error})") from None


def write_report(args):
    """report.md, comparison.json and the plots for parsed ``build_parser`` arguments."""
    final = parse_final(args.final)
    check_bootstrap_flags(args.confidence, args.n_resamples)
    if args.smooth_ema is not None:
        ema(np.zeros(1), args.smooth_ema)  # validates the weight before any work
    out = Path(args.out or Path(args.runs) / "report")
    runs, sources, notes = scan_runs(args.runs)
    windows = final_scalars(runs, args.final_metrics, final, sources)
    notes = [*notes, *unpaired_seeds(runs, args.baseline)]
    rows = compare(runs, args.baseline, args.confidence, args.n_resamples, args.seed, args.ci_method)
    available = sorted({k for seeds in runs.values() for run in seeds.values() for k in run.curves})
    missing = sorted(set(args.curves or []) - set(available))
    if missing:
        raise ValueError(f"--curves: no run logs {missing}; available: {available}")
    plots = [(metric, re.sub(r"[^A-Za-z0-9_.-]+", "_", metric) + ".png")
             for metric in (args.curves if args.curves is not None else available)]  # fmt: skip
    claim_out(out, ["report.md", "comparison.json", *(name for _, name in plots)])
    for note in notes:  # after the last check: an error stays the one line main prints
        print(f"warning: {note}", file=sys.stderr)
    for metric, name in plots:
        plot_curve(runs, metric, out / name, smooth=args.smooth_ema)

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
    for key, window in windows.items():
        lines += [
            "",
            f"`{final_name(key, final)}`: mean of `{key}` over steps {window} (`--final {' '.join(args.final)}`).",
        ]
    lines += [w for note in notes for w in ("", f"> warning: {note}")]
    if plots:
        lines += ["", "## Training curves", ""]
        if args.smooth_ema:
            lines += [f"EMA-smoothed per seed (weight {args.smooth_ema:g}); the faint line is the raw mean.", ""]
        lines += [f"![{metric}]({name})" for metric, name in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    comparison = {"baseline": args.baseline, "final": {"mode": final, "windows": windows}, "rows": rows}
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    print(f"wrote {out / 'report.md'} ({len(rows)} comparisons, {len(plots)} plots)")
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return write_report(args)
    except (ValueError, OSError) as error:  # bad input, an unreadable file, a full disk: one line, no traceback
        print(f"openrlhf-geo report: error: {error}", file=sys.stderr)
        return 2
