"""Paired multi-seed report: bootstrap CI vs brute-force resampling, markdown table, plots, input layout."""

import itertools
import json

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
    assert report.main([str(runs_dir), "--baseline", "grpo", "--final", "accuracy", "--n-resamples", "2000"]) == 0
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


def test_report_errors_name_the_problem(runs_dir, tmp_path):
    with pytest.raises(ValueError, match="--baseline 'ppo'"):
        report.main([str(runs_dir), "--baseline", "ppo"])
    with pytest.raises(ValueError, match="--curves"):
        report.main([str(runs_dir), "--baseline", "grpo", "--curves", "entropy"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="seed<k>"):
        report.load_runs(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reward": 1}\n')
    with pytest.raises(ValueError, match="'step'"):
        report.read_metrics_jsonl(bad)
