"""Paired multi-seed report: bootstrap CI vs brute-force resampling, markdown table, plots, input layout."""

import itertools
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.eval import report
from openrlhf_geo.eval.metrics import paired_gain


def _exact_bootstrap_means(diffs):
    """Means of all n^n equally likely resamples of ``diffs`` (the exact bootstrap distribution)."""
    n = len(diffs)
    index = np.array(list(itertools.product(range(n), repeat=n)))  # (n^n, n)
    return diffs[index].mean(1)


@pytest.mark.parametrize("ci_method", ["percentile", "basic"])
def test_bootstrap_ci_matches_brute_force_resampling(ci_method):
    rng = np.random.default_rng(7)
    baseline = rng.normal(0.40, 0.05, size=6)
    method = baseline + rng.normal(0.02, 0.01, size=6)
    diffs = method - baseline
    means = _exact_bootstrap_means(diffs)  # 46656 resamples
    low, high = np.percentile(means, [2.5, 97.5])
    if ci_method == "basic":  # reflected around the observed mean
        low, high = 2 * diffs.mean() - high, 2 * diffs.mean() - low
    stats = paired_gain(method, baseline, n_resamples=20000, seed=0, ci_method=ci_method)
    tolerance = 0.03 * diffs.std()
    assert stats["gain"] == pytest.approx(diffs.mean())
    assert stats["low"] == pytest.approx(low, abs=tolerance) and stats["high"] == pytest.approx(high, abs=tolerance)
    assert stats["n"] == 6


def test_pairing_removes_between_seed_variance():
    # Seeds differ a lot (0.2..0.6) but the method beats the baseline by ~0.01 on every seed.
    baseline = np.array([0.2, 0.35, 0.5, 0.6, 0.45])
    method = baseline + np.array([0.011, 0.009, 0.010, 0.012, 0.008])
    stats = paired_gain(method, baseline, seed=1)
    assert 0.008 <= stats["low"] < stats["gain"] < stats["high"] <= 0.012


@settings(max_examples=30)
@given(
    st.lists(st.floats(-1, 1, allow_nan=False), min_size=3, max_size=6),
    st.floats(-1, 1, allow_nan=False),
)
def test_ci_depends_only_on_differences_and_shifts_with_them(values, shift):
    values = np.array(values)
    baseline = np.linspace(0.1, 0.9, len(values))
    a = paired_gain(baseline + values, baseline, n_resamples=999, seed=3)
    b = paired_gain(values + shift, np.full(len(values), shift), n_resamples=999, seed=3)
    assert a["gain"] == pytest.approx(b["gain"], abs=1e-9)
    assert a["low"] == pytest.approx(b["low"], abs=1e-9) and a["high"] == pytest.approx(b["high"], abs=1e-9)
    assert a["low"] <= a["gain"] + 1e-12 and a["gain"] <= a["high"] + 1e-12


def test_degenerate_inputs_have_documented_intervals():
    one = paired_gain([0.5], [0.4])
    assert one["gain"] == pytest.approx(0.1) and np.isnan(one["low"]) and np.isnan(one["high"])
    same = paired_gain([0.5, 0.6, 0.7], [0.4, 0.5, 0.6], ci_method="bca")
    assert same["low"] == same["high"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="matching"):
        paired_gain([0.5, 0.6], [0.4])
    with pytest.raises(ValueError, match="finite"):
        paired_gain([0.5, np.nan], [0.4, 0.1])


def _write_run(root, method, seed, pass1, accuracy_curve):
    run = root / method / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"metrics": {"math500/pass@1": pass1, "aime24/avg@16": pass1 / 4}}))
    lines = [
        json.dumps({"step": step, "accuracy": acc, "reward": 2 * acc - 1}) for step, acc in enumerate(accuracy_curve)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "runs"
    for seed, (base, gain) in enumerate([(0.40, 0.03), (0.45, 0.01), (0.38, 0.02)]):
        _write_run(root, "grpo", seed, base, [0.1, 0.2, 0.3 + seed / 100])
        _write_run(root, "salt", seed, base + gain, [0.1, 0.25, 0.35 + seed / 100])
    _write_run(root, "salt", 7, 0.9, [0.1, 0.2, 0.9])  # no baseline run with seed 7: must be ignored
    return root


def test_report_writes_markdown_table_json_and_plots(runs_dir):
    argv = [str(runs_dir), "--baseline", "grpo", "--final-metrics", "accuracy", "--n-resamples", "2000"]
    assert report.main(argv) == 0
    out = runs_dir / "report"
    comparison = json.loads((out / "comparison.json").read_text())
    rows = {r["metric"]: r for r in comparison["rows"]}
    assert set(rows) == {"math500/pass@1", "aime24/avg@16", "final/accuracy"}
    pass1 = rows["math500/pass@1"]
    assert pass1["seeds"] == [0, 1, 2] and pass1["n"] == 3  # seed 7 has no pair
    assert pass1["gain"] == pytest.approx(0.02) and pass1["method_mean"] == pytest.approx(np.mean([0.43, 0.46, 0.40]))
    assert rows["final/accuracy"]["gain"] == pytest.approx(0.05)

    text = (out / "report.md").read_text()
    assert "| method | metric | grpo (mean ± sd) | method (mean ± sd) | paired gain | 95% CI | seeds |" in text
    sd = np.std([0.40, 0.45, 0.38], ddof=1)
    row = next(line for line in text.splitlines() if line.startswith("| salt | math500/pass@1 |"))
    assert f"| {0.41:.4f} ± {sd:.4f} |" in row and "| +0.0200 | [+0.0100, +0.0300] | 3 |" in row
    for name in ("accuracy.png", "reward.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
        assert f"]({name})" in text


def test_seeds_a_method_or_the_baseline_lacks_are_warned_about_by_name(tmp_path, capsys):
    """With salt at seeds 10-14 and grpo at 0-4 the salt rows were silently absent (exit 0)."""
    root = tmp_path / "runs"
    for seed in range(5):
        _write_run(root, "grpo", seed, 0.4, [0.1, 0.2])
        _write_run(root, "salt", 10 + seed, 0.5, [0.1, 0.3])
    for seed in (0, 1, 2, 7):
        _write_run(root, "dapo", seed, 0.45, [0.1, 0.25])
    assert report.main([str(root), "--baseline", "grpo", "--n-resamples", "200"]) == 0
    err = capsys.readouterr().err
    assert (
        "warning: method 'salt' lacks every seed of --baseline 'grpo' ([0, 1, 2, 3, 4]; it has [10, 11, 12, 13, 14]):"
        " it is not compared" in err
    )
    assert "warning: method 'dapo' lacks seeds [3, 4] of --baseline 'grpo': compared on seeds [0, 1, 2]" in err
    assert "warning: --baseline 'grpo' lacks seeds [7] of method 'dapo': compared on seeds [0, 1, 2]" in err
    text = (root / "report" / "report.md").read_text()
    assert "> warning: method 'salt' lacks every seed of --baseline 'grpo'" in text
    rows = json.loads((root / "report" / "comparison.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"dapo"}


def test_report_reads_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "runs" / "grpo" / "seed0"
    with SummaryWriter(str(run / "tb")) as writer:
        for step in range(4):
            writer.add_scalar("train/reward", step / 4, step)
    runs, warnings = report.load_runs(tmp_path / "runs", final_keys=["train/reward"])
    steps, values = runs["grpo"][0].curves["train/reward"]
    assert steps.tolist() == [0, 1, 2, 3] and values.tolist() == pytest.approx([0, 0.25, 0.5, 0.75])
    assert runs["grpo"][0].scalars["final/train/reward"] == pytest.approx(0.75) and not warnings


def _fails(argv, capsys, *needles):
    """``report.main(argv)`` exits 2 with one error line (no traceback) that contains every needle."""
    assert report.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openrlhf-geo report: error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


def test_report_errors_name_the_problem(runs_dir, tmp_path, capsys):
    _fails([runs_dir, "--baseline", "ppo"], capsys, "--baseline 'ppo'")
    _fails([runs_dir, "--baseline", "grpo", "--curves", "entropy"], capsys, "--curves")
    _fails([runs_dir, "--baseline", "grpo", "--final", "accuracy"], capsys, "--final takes last", "--final-metrics")
    _fails([runs_dir, "--baseline", "grpo", "--final", "last-n", "0"], capsys, "--final last-n 0")
    _fails([runs_dir, "--baseline", "grpo", "--final", "last-frac", "1.5"], capsys, "--final last-frac 1.5")
    _fails([runs_dir, "--baseline", "grpo", "--final-metrics", "entropy"], capsys, "no run logs 'entropy'")
    _fails([runs_dir, "--baseline", "grpo", "--smooth-ema", "1"], capsys, "--smooth-ema")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails([empty, "--baseline", "grpo"], capsys, "seed<k>")
    with pytest.raises(FileNotFoundError, match="seed<k>"):
        report.load_runs(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reward": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*integer 'step'"):
        report.read_metrics_jsonl(bad)


def test_a_bootstrap_too_small_for_its_confidence_level_is_refused(runs_dir, capsys):
    """--n-resamples 1 printed a zero-width "95 % CI"; each 2.5 % tail needs a resample of its own (40 in all)."""
    for n in ("1", "39"):
        _fails(
            [runs_dir, "--baseline", "grpo", "--n-resamples", n], capsys, "--n-resamples must be >= 40", f"got {n})"
        )
    _fails([runs_dir, "--baseline", "grpo", "--confidence", "0.99", "--n-resamples", "100"], capsys, ">= 200")
    assert report.main([str(runs_dir), "--baseline", "grpo", "--n-resamples", "40"]) == 0


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl"])
def test_a_seed_file_that_is_a_directory_is_one_line(runs_dir, capsys, name):
    target = runs_dir / "salt" / "seed1" / name
    target.unlink()
    target.mkdir()
    _fails([runs_dir, "--baseline", "grpo"], capsys, "method 'salt' seed 1", f"{target} is a directory, not a file")


def test_runs_that_are_a_file_are_called_a_file(tmp_path, capsys):
    (tmp_path / "runs.txt").write_text("x")
    _fails(
        [tmp_path / "runs.txt", "--baseline", "grpo"], capsys, f"{tmp_path / 'runs.txt'} is a file, not a directory"
    )


def test_an_out_that_cannot_be_written_is_one_line_before_any_file(runs_dir, capsys, monkeypatch):
    out = runs_dir / "read-only"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:  # as root, permission bits do not stop a write: the kernel's answer to anyone else

        def read_only(*args, **kwargs):
            raise PermissionError(13, "Permission denied", kwargs.get("dir"))

        monkeypatch.setattr(report.tempfile, "TemporaryFile", read_only)
    _fails(
        [runs_dir, "--baseline", "grpo", "--out", out], capsys, f"--out {out}: cannot write there (Permission denied"
    )
    assert list(out.iterdir()) == []


# ----------------------------------------------------------------------------- --final aggregation, EMA smoothing

EVAL_STEPS = [0, 10, 20, 30, 40, 50, 60]  # GeoAlign evaluates every 10 steps
ACCURACY = {
    ("grpo", 0): [0.10, 0.20, 0.30, 0.40, 0.50, 0.60, 0.70],
    ("grpo", 1): [0.10, 0.15, 0.25, 0.35, 0.45, 0.55, 0.50],
    ("salt", 0): [0.10, 0.20, 0.40, 0.50, 0.60, 0.70, 0.90],
    ("salt", 1): [0.10, 0.30, 0.30, 0.40, 0.50, 0.60, 0.70],
}


def _write_curves(root, method, seed, rows, name="seed"):
    run = root / method / f"{name}{seed}"
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return run / "metrics.jsonl"


@pytest.fixture
def eval_runs(tmp_path):
    root = tmp_path / "runs"
    for (method, seed), acc in ACCURACY.items():
        # training rows every 5 steps, evaluation rows every 10: the windows are per metric
        rows = [{"step": s, "reward": s / 100} for s in range(5, 61, 10)]
        rows += [{"method": method, "seed": seed, "step": s, "accuracy": a} for s, a in zip(EVAL_STEPS, acc)]
        _write_curves(root, method, seed, rows)
    return root


@pytest.mark.parametrize(
    "final, name, window, salt, grpo",
    [
        # hand computations: last = step 60; last-n 5 = steps 20..60; last-frac 0.2 = ceil(0.2 * 7) = 2 steps
        (["last"], "final/accuracy", [60], [0.90, 0.70], [0.70, 0.50]),
        (["last-n", "5"], "last5/accuracy", [20, 30, 40, 50, 60], [3.1 / 5, 2.5 / 5], [2.5 / 5, 2.1 / 5]),
        (["last-frac", "0.2"], "last20%/accuracy", [50, 60], [0.80, 0.65], [0.65, 0.525]),
    ],
)
def test_final_aggregates_match_hand_computation(eval_runs, final, name, window, salt, grpo):
    argv = [str(eval_runs), "--baseline", "grpo", "--final-metrics", "accuracy", "--final", *final]
    assert report.main([*argv, "--n-resamples", "999"]) == 0
    comparison = json.loads((eval_runs / "report" / "comparison.json").read_text())
    row = next(r for r in comparison["rows"] if r["metric"] == name)
    assert comparison["final"]["windows"] == {"accuracy": window}
    assert row["method_mean"] == pytest.approx(np.mean(salt)) and row["baseline_mean"] == pytest.approx(np.mean(grpo))
    assert row["gain"] == pytest.approx(np.mean(np.subtract(salt, grpo)))
    assert f"`{name}`: mean of `accuracy` over steps {window}" in (eval_runs / "report" / "report.md").read_text()


def _runs(steps_per_run):
    """{method: {seed: Run}} with curve "m" logged at the given steps (value = step)."""
    runs = {}
    for (method, seed), steps in steps_per_run.items():
        curve = (np.array(steps), np.array(steps, dtype=np.float64))
        runs.setdefault(method, {})[seed] = report.Run(curves={"m": curve})
    return runs


@pytest.mark.parametrize(
    "count, final, expected",
    [
        (15, ("last-frac", 0.2), 3),  # 0.2 * 15 = 3.0000000000000004 in floating point: still 3
        (10, ("last-frac", 0.25), 3),  # ceil(2.5)
        (4, ("last-frac", 0.1), 1),  # at least one checkpoint
        (6, ("last-frac", 1.0), 6),
        (6, ("last-n", 6), 6),
    ],
)
def test_final_window_sizes(count, final, expected):
    steps = list(range(0, 10 * count, 10))
    runs = _runs({("a", 0): steps, ("b", 0): steps})
    windows = report.final_scalars(runs, ["m"], final)
    assert windows["m"] == steps[-expected:]
    assert runs["a"][0].scalars[report.final_name("m", final)] == pytest.approx(np.mean(steps[-expected:]))


def test_final_never_falls_back_to_an_earlier_step(eval_runs, capsys):
    # salt seed 1 crashed after step 50: its last value must not be compared with the others' step 60
    path = eval_runs / "salt" / "seed1" / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if '"step": 60' not in line))
    for final in (["last"], ["last-n", "5"]):
        _fails(
            [eval_runs, "--baseline", "grpo", "--final-metrics", "accuracy", "--final", *final],
            capsys,
            "method 'salt' seed 1",
            str(path),
            "no 'accuracy' at step(s) [60]",
        )
    with pytest.raises(ValueError, match=r"--final last-n 8: the runs log 'accuracy' at only 7 steps"):
        report.final_scalars(report.load_runs(eval_runs)[0], ["accuracy"], ("last-n", 8))
    # a run that never logs the metric is an error too, not a silently dropped seed
    runs = _runs({("a", 0): [0, 10], ("b", 0): [0, 10]})
    runs["b"][1] = report.Run()
    with pytest.raises(ValueError, match="method 'b' seed 1 does not log 'm'"):
        report.final_scalars(runs, ["m"], ("last", 1))


def test_final_skip_undefined_leaves_out_nan_steps_and_runs_without_a_value():
    """A diagnostic's window mean over the finite values only (the studies' last-20 % means of SALT's geometry)."""
    steps = list(range(1, 11))  # window: steps 9 and 10
    runs = _runs({("a", 0): steps, ("a", 1): steps, ("b", 0): steps, ("b", 1): steps[:8] + [10]})
    runs["a"][1].curves["m"][1][-1] = np.nan  # step 10 undefined: the mean is step 9's alone
    runs["b"][0].curves["m"][1][-2:] = np.nan  # nothing defined in the window: no scalar
    runs["c"] = {0: report.Run()}  # does not log it: no scalar, no error
    with pytest.raises(ValueError, match="null/NaN at step"):
        report.final_scalars(runs, ["m"], ("last-frac", 0.2))
    report.final_scalars(runs, ["m"], ("last-frac", 0.2), skip_undefined=True)
    name = "last20%/m"
    assert runs["a"][0].scalars[name] == 9.5 and runs["a"][1].scalars[name] == 9.0
    assert name not in runs["b"][0].scalars and runs["b"][1].scalars[name] == 10.0  # step 9 never logged
    assert name not in runs["c"][0].scalars


def _ema_brute_force(x, w):
    return np.array(
        [sum(w ** (t - i) * x[i] for i in range(t + 1)) / sum(w**k for k in range(t + 1)) for t in range(len(x))]
    )


def test_ema_matches_hand_computation():
    # GeoAlign App. B.2 factor 0.6: s0 = 1, s1 = 0.6 / 1.6, s2 = 0.36 / 1.96
    np.testing.assert_allclose(report.ema([1.0, 0.0, 0.0], 0.6), [1.0, 0.375, 0.36 / 1.96], rtol=1e-12)
    np.testing.assert_allclose(report.ema([[1.0, 3.0], [2.0, 2.0]], 0.5), [[1.0, 1 / 3 + 2], [2.0, 2.0]], rtol=1e-12)
    np.testing.assert_array_equal(report.ema([0.3, 0.9, 0.1], 0.0), [0.3, 0.9, 0.1])  # weight 0: identity
    with pytest.raises(ValueError, match="--smooth-ema"):
        report.ema([1.0], -0.1)


@settings(max_examples=40)
@given(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=12),
    st.floats(0, 0.95),
    st.floats(-5, 5, allow_nan=False),
)
def test_ema_is_a_weighted_mean_of_the_past(values, weight, shift):
    values = np.array(values)
    smoothed = report.ema(values, weight)
    np.testing.assert_allclose(smoothed, _ema_brute_force(values, weight), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(report.ema(values + shift, weight), smoothed + shift, rtol=1e-9, atol=1e-9)
    assert smoothed[0] == pytest.approx(values[0])
    running_min, running_max = np.minimum.accumulate(values), np.maximum.accumulate(values)
    assert np.all(smoothed >= running_min - 1e-9) and np.all(smoothed <= running_max + 1e-9)


def test_smoothed_plots(eval_runs, monkeypatch):
    calls = []
    monkeypatch.setattr(report, "ema", lambda values, weight: calls.append((np.shape(values), weight)) or values)
    assert report.main([str(eval_runs), "--baseline", "grpo", "--smooth-ema", "0.6", "--curves", "accuracy"]) == 0
    assert calls.count(((2, 7), 0.6)) == 2  # each method's (seeds, steps) curves
    text = (eval_runs / "report" / "report.md").read_text()
    assert "EMA-smoothed per seed (weight 0.6)" in text and (eval_runs / "report" / "accuracy.png").exists()


# --------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", ['"0.5"', "true", "[0.5]", '{"mean": 0.5}'])
def test_non_numeric_metric_names_method_seed_and_file(eval_runs, capsys, value):
    path = eval_runs / "salt" / "seed1" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[3] = lines[3].replace('"reward": 0.35', f'"reward": {value}')
    path.write_text("\n".join(lines) + "\n")
    _fails([eval_runs, "--baseline", "grpo"], capsys, "method 'salt' seed 1", f"{path}:4", "'reward'", "not a number")


@pytest.mark.parametrize("value", ["null", "NaN", "Infinity"])
def test_null_or_nan_metric_is_an_error_where_it_is_aggregated(eval_runs, capsys, value):
    path = eval_runs / "grpo" / "seed0" / "metrics.jsonl"
    text = path.read_text().replace('"accuracy": 0.2}', f'"accuracy": {value}}}')  # step 10
    path.write_text(text.replace('"accuracy": 0.7}', f'"accuracy": {value}}}'))  # step 60
    argv = [str(eval_runs), "--baseline", "grpo", "--final-metrics", "accuracy", "--n-resamples", "99"]
    _fails(argv, capsys, "method 'grpo' seed 0", str(path), "'accuracy' as null/NaN at step(s) [60]")
    # outside the --final window it is only a gap in the plot
    path.write_text(text)
    assert report.main([*argv, "--final", "last-n", "5"]) == 0
    row = json.loads((eval_runs / "report" / "comparison.json").read_text())["rows"][0]
    assert row["metric"] == "last5/accuracy" and row["baseline_mean"] == pytest.approx((2.5 / 5 + 2.1 / 5) / 2)


@pytest.mark.parametrize("value", ["null", '"0.41"', "NaN", "true"])
def test_summary_metric_that_is_not_a_finite_number(runs_dir, capsys, value):
    path = runs_dir / "salt" / "seed2" / "summary.json"
    path.write_text('{"metrics": {"math500/pass@1": ' + value + "}}")
    _fails([runs_dir, "--baseline", "grpo"], capsys, "method 'salt' seed 2", str(path), "'math500/pass@1'")


def test_two_directories_naming_one_seed(runs_dir, capsys):
    _write_run(runs_dir, "salt", "_0", 0.5, [0.1, 0.2, 0.3])  # salt/seed_0 next to salt/seed0
    _fails([runs_dir, "--baseline", "grpo"], capsys, "method 'salt'", "seed0", "seed_0", "both name seed 0")


def test_duplicate_steps_are_errors(tmp_path, capsys):
    root = tmp_path / "runs"
    rows = [{"step": 0, "reward": 0.1}, {"step": 10, "reward": 0.2}, {"step": 10, "accuracy": 0.5}]
    _write_curves(root, "grpo", 0, rows)  # one step split over two lines: fine
    path = _write_curves(root, "salt", 0, [*rows, {"step": 10, "reward": 0.3}])
    _fails([root, "--baseline", "grpo"], capsys, "method 'salt' seed 0", f"{path}:4", "'reward' at step 10 again")


def test_duplicate_tensorboard_steps_and_curves_logged_twice(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    _write_curves(root, "grpo", 0, [{"step": 0, "reward": 0.1}])
    run = root / "salt" / "seed0"
    with SummaryWriter(str(run / "tb")) as writer:  # a restarted run logging step 1 again
        for step in (0, 1, 1):
            writer.add_scalar("reward", 0.5, step)
    _fails([root, "--baseline", "grpo"], capsys, "method 'salt' seed 0", "'reward' has step 1 more than once")
    shutil.rmtree(run / "tb")
    for name in ("tb_a", "tb_b"):  # one tag in two event directories: which one is the run?
        with SummaryWriter(str(run / name)) as writer:
            writer.add_scalar("reward", 0.5, 0)
    _fails([root, "--baseline", "grpo"], capsys, "method 'salt' seed 0", "'reward' is logged both under", "tb_a")
    shutil.rmtree(run / "tb_b")
    path = _write_curves(root, "salt", 0, [{"step": 0, "reward": 0.1}])
    _fails([root, "--baseline", "grpo"], capsys, f"'reward' is logged both in {path} and in TensorBoard")


def test_truncated_last_line_is_dropped_with_a_warning(eval_runs, capsys):
    path = eval_runs / "salt" / "seed0" / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 70, "accur')  # a crash mid-write
    argv = [str(eval_runs), "--baseline", "grpo", "--final-metrics", "accuracy", "--n-resamples", "99"]
    assert report.main(argv) == 0
    assert f"warning: method 'salt' seed 0: {path}:" in capsys.readouterr().err
    assert "dropped a truncated last line" in (eval_runs / "report" / "report.md").read_text()
    with pytest.warns(UserWarning, match="truncated"):
        steps, _ = report.read_metrics_jsonl(path)["accuracy"]
    assert steps.tolist() == EVAL_STEPS
    # the same text followed by a newline is a complete but malformed line, and so is one in the middle
    path.write_text(path.read_text() + "\n")
    _fails(argv, capsys, f"{path}:14", "not valid JSON")
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[-1], *lines[1:-1]]))
    _fails(argv, capsys, f"{path}:2", "not valid JSON")


@pytest.mark.parametrize("step", ['"10"', "1.5", "null", "true"])
def test_step_must_be_an_integer(tmp_path, step):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward": 1}\n{"step": ' + step + ', "reward": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: .*integer 'step'"):
        report.read_metrics_jsonl(path)


def test_out_is_a_new_directory_or_a_previous_report_never_another_file(runs_dir, tmp_path, capsys):
    argv = [str(runs_dir), "--baseline", "grpo", "--n-resamples", "200", "--out"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    _fails([*argv, a_file], capsys, f"--out {a_file}")
    _fails([*argv, a_file / "sub"], capsys, f"--out {a_file / 'sub'}")
    study = tmp_path / "study"  # a study's output: its own report.md and a plot of the name a curve would get
    study.mkdir()
    (study / "report.md").write_text("the study's report")
    (study / "accuracy.png").write_text("the study's plot")
    _fails([*argv, study], capsys, f"--out {study}", "report.md", "accuracy.png")
    assert a_file.read_text() == "keep" and (study / "report.md").read_text() == "the study's report"
    assert sorted(p.name for p in study.iterdir()) == ["accuracy.png", "report.md"]
    out = tmp_path / "report"
    assert report.main([*argv, str(out)]) == 0
    assert report.main([*argv, str(out), "--confidence", "0.9"]) == 0  # a previous report is rewritten
    assert "90% CI" in (out / "report.md").read_text()
