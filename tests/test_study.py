"""`openrlhf-geo study`: each study's plan (conditions -> train argv), the protocols listing exactly those flags, time
estimates within budget, resumability, a --quick study end to end; the misspecified verifier (task.ShortcutPayer,
noise.pay_wrong, the engine's hook)."""

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import cli
from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab import recipe, studies
from openrlhf_geo.lab.studies import common as shared
from openrlhf_geo.lab.studies import geoalign_failure, learnable_regime, runner, salt_ablations, salt_scaling
from openrlhf_geo.lab.studies import regime as regime_study
from openrlhf_geo.lab.studies.base import ConditionStudy
from openrlhf_geo.lab.task import (
    ShortcutPayer,
    addition_problems,
    build_model,
    build_tokenizer,
    misspecified_prompt,
    shortcut_answer,
    shortcut_solution,
    worked_solution,
)
from openrlhf_geo.local import engine, rundir
from openrlhf_geo.local.flags import parse_args
from openrlhf_geo.rewards.math_verify import extract_last_boxed
from openrlhf_geo.rewards.noise import NoiseConfig, corrupt, pay_wrong

DOCS = Path(__file__).resolve().parents[1] / "docs" / "studies"
ALL = {name: s.design() for name, s in studies.REGISTRY.items() if isinstance(s, ConditionStudy)}


def flag(argv, name):
    """The value argparse keeps for `name` (its last occurrence)."""
    return argv[len(argv) - argv[::-1].index(name)]


def pairs(argv):
    """The common flags of a planned argv as {flag: value} (each of them takes exactly one value)."""
    common = argv[: argv.index("--train.threads") + 2]
    return dict(zip(common[::2], common[1::2]))


def method_part(job):
    """The argv after the common flags, without the per-seed tail."""
    argv = job["argv"]
    return argv[argv.index("--train.threads") + 2 : argv.index("--train.seed")]


# ---------------------------------------------------------------- plans


@pytest.mark.parametrize("name", list(ALL))
def test_every_planned_command_parses_and_the_plan_is_conditions_times_seeds(name, tmp_path):
    s = ALL[name]
    jobs = runner.plan(s, tmp_path)
    names = [c.name for c in s.conditions]
    assert len(set(names)) == len(names) and len(jobs) == len(names) * len(s.seeds)
    assert {(j["condition"], j["seed"]) for j in jobs} == {(c, seed) for c in names for seed in s.seeds}
    assert {c for pair in s.comparisons for c in pair} <= set(names) and set(s.quick) <= set(names)
    for job in jobs:
        args = parse_args(job["argv"])  # every flag exists and the combination validates
        assert args.train.steps == s.steps and args.eval.steps == s.eval_steps
        assert args.train.seed == args.reward.noise.seed == job["seed"]
        assert Path(args.ckpt.output_dir) == tmp_path / "runs" / job["condition"] / f"seed{job['seed']}"
        assert Path(args.actor.model_name_or_path) == tmp_path / "settings" / job["setting"] / "sft"
        assert job["tags"] == {"method": job["condition"], "seed": job["seed"]}


def test_salt_scaling_sweeps_g_at_a_fixed_budget_for_grpo_and_dapo_each_with_and_without_salt(tmp_path):
    jobs = runner.plan(ALL["salt-scaling"], tmp_path, seeds=[2025])
    assert [j["seed"] for j in runner.plan(ALL["salt-scaling"], tmp_path)[:5]] == [2025, 2026, 2027, 2028, 2029]
    seen = set()
    for job in jobs:
        args = parse_args(job["argv"])
        g = args.rollout.n_samples_per_prompt
        assert job["condition"].startswith(f"g{g:02d}_") and args.rollout.batch_size * g == 128
        dapo, salt = "_dapo" in job["condition"], job["condition"].endswith("_salt")
        assert args.algo.dynamic_filtering_enable == args.reward.pm1 == dapo
        assert tuple(args.actor.eps_clip_low_high or ()) == ((0.2, 0.28) if dapo else ())
        assert args.salt.enable == salt and args.salt.diagnostics == (not salt) and args.salt.features == "exact"
        seen.add((g, dapo, salt))
    assert seen == {(g, d, s) for g in (2, 4, 8, 16, 32, 64) for d in (False, True) for s in (False, True)}
    assert set(ALL["salt-scaling"].comparisons) == {
        (f"g{g:02d}_{b}_salt", f"g{g:02d}_{b}") for g in (2, 4, 8, 16, 32, 64) for b in ("grpo", "dapo")
    }


def test_salt_scaling_in_another_regime_keeps_its_change_and_refuses_a_change_of_g(tmp_path):
    for job in runner.plan(salt_scaling.design("t06"), tmp_path, seeds=[0]):
        assert flag(job["argv"], "--rollout.temperature") == "0.6" and job["setting"] == "demo"
    assert {j["setting"] for j in runner.plan(salt_scaling.design("width128"), tmp_path)} == {"width128"}
    with pytest.raises(ValueError, match="--regime g64 changes G"):
        salt_scaling.design("g64")
    with pytest.raises(ValueError, match="--regime must be one of"):
        salt_scaling.design("nope")


def test_regime_study_changes_one_thing_at_a_time_from_the_demo(tmp_path):
    jobs = {j["condition"]: j for j in runner.plan(ALL["regime"], tmp_path, seeds=[0])}
    demo_common = pairs(jobs["demo_grpo"]["argv"])
    assert set(jobs) == {f"{n}_{m}" for n in regime_study.ONE_FACTOR for m in ("grpo", "salt")}
    for name in regime_study.ONE_FACTOR:
        regime = shared.REGIMES[name]
        for method, flags in (("grpo", shared.GRPO_DIAG), ("salt", shared.SALT)):
            job = jobs[f"{name}_{method}"]
            assert tuple(method_part(job)) == flags and job["setting"] == regime.setting
            common = pairs(job["argv"])
            differs = {k for k in common.keys() | demo_common.keys() if common.get(k) != demo_common.get(k)}
            assert {k: common[k] for k in regime.rollout} == {k: str(v) for k, v in regime.rollout.items()}
            paths = {"--actor.model_name_or_path", "--data.prompt_dataset", "--eval.dataset"}
            assert differs == set(regime.rollout) | (paths if regime.setting != "demo" else set())
    assert shared.SETTINGS["three_digit"].sft_config()["max_operand"] == 999
    assert shared.SETTINGS["width128"].sft_config() == {**recipe.SFT, "hidden_size": 128}
    assert "max_operand" not in shared.SETTINGS["demo"].sft_config()  # the demo's own SFT cache key


def test_salt_ablations_are_the_demos_runs_plus_one_variant_each(tmp_path):
    s = ALL["salt-ablations"]
    assert s.seeds == (0, 1, 2, 3, 4) and (s.steps, s.eval_steps) == (recipe.FULL["steps"], recipe.FULL["eval_steps"])
    jobs = {j["condition"]: j for j in runner.plan(s, tmp_path, seeds=[1])}
    # grpo and salt: the demo's own commands for seed 1 (paths aside)
    demo_common = recipe.common_flags(tmp_path / "settings" / "demo", recipe.FULL["steps"], recipe.FULL["eval_steps"])
    for method in ("grpo", "salt"):
        expected = [*demo_common, *recipe.METHOD_FLAGS[method], "--train.seed", "1", "--reward.noise.seed", "1"]
        assert jobs[method]["argv"][: len(expected)] == expected
    variants = {c: parse_args(j["argv"]).salt for c, j in jobs.items() if c.startswith("salt_")}
    assert {v.variant for v in variants.values()} == {*salt_ablations.ABLATIONS, "fixed-alpha"}
    assert sorted(v.alpha for v in variants.values() if v.variant == "fixed-alpha") == [0, 0.25, 0.5, 0.75, 1]
    for condition in variants:
        assert (condition, "grpo") in s.comparisons and (condition, "salt") in s.comparisons


def test_geoalign_failure_puts_every_method_under_every_noise(tmp_path):
    s = ALL["geoalign-failure"]
    jobs = {j["condition"]: parse_args(j["argv"]) for j in runner.plan(s, tmp_path, seeds=[0])}
    assert jobs["grpo_clean"].reward.noise.type == "none"
    for noise, (kind, rate) in {
        "mis20": ("misspecified", 0.2),
        "flip05": ("flip", 0.05),
        "flip10": ("flip", 0.1),
    }.items():
        for method in ("grpo", "geoalign", "pf_ppo", "par", "pods", "seed_grpo"):
            args = jobs[f"{method}_{noise}"]
            assert (args.reward.noise.type, args.reward.noise.rate) == (kind, rate)
            assert args.geoalign.enable == (method == "geoalign")
        assert jobs[f"pf_ppo_{noise}"].baseline.curation == "pf_ppo_br"
        assert jobs[f"pods_{noise}"].baseline.pods_m == 8 and jobs[f"par_{noise}"].baseline.par_references == 1
        assert jobs[f"seed_grpo_{noise}"].baseline.seed_grpo_alpha == 0.5
        for baseline in ("grpo", "pf_ppo", "par", "pods", "seed_grpo"):
            assert (f"geoalign_{noise}", f"{baseline}_{noise}") in s.comparisons
    # GeoAlign as the demo runs it, without the demo's 10 % flips
    assert recipe.METHOD_FLAGS["geoalign_noise"] == [*recipe.NOISE, *geoalign_failure.GEOALIGN]


@pytest.mark.parametrize("name", list(ALL))
def test_the_protocol_lists_exactly_the_flags_the_runner_runs(name):
    text = (DOCS / f"{name}.md").read_text()
    s = ALL[name]
    for condition, command in runner.protocol_commands(s).items():
        assert f"{condition}: {command}\n" in text, condition
    assert runner.common_command("<out>", s.steps, s.eval_steps) in text
    assert f"seeds {' '.join(map(str, s.seeds))}" in text.lower()


@pytest.mark.parametrize("name", list(ALL))
def test_each_full_study_is_estimated_within_an_hour_on_two_workers(name, tmp_path):
    jobs = runner.plan(ALL[name], tmp_path)
    estimate = runner.estimate_seconds(jobs, 2)
    assert 600 < estimate <= 3600
    assert f"{estimate / 60:.0f} min" in (DOCS / f"{name}.md").read_text()


def test_the_estimate_reproduces_the_demos_measured_run_time(tmp_path):
    """The unit costs are calibrated on the demo: 12 runs of its setting -> 261 s on 2 workers (+ 91 s SFT)."""
    grpo = runner.plan(ALL["salt-ablations"], tmp_path, seeds=[0, 1, 2])[:3]  # 3 runs of the demo's GRPO
    assert runner.estimate_seconds(grpo * 4, 2) == pytest.approx(91 + 261, rel=0.03)


# ---------------------------------------------------------------- resumability and the command line


def write_run(job, steps, argv=None):
    run = Path(job["out"])
    run.mkdir(parents=True, exist_ok=True)
    (run / "study.json").write_text(json.dumps({"argv": argv or job["argv"]}))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": t, "accuracy": 0.5}) + "\n" for t in range(steps + 1))
    )


def test_a_run_counts_as_finished_only_with_its_own_command_and_every_step(tmp_path):
    job = runner.plan(ALL["regime"], tmp_path, seeds=[0])[0]
    assert not runner.finished(job, 50)
    write_run(job, 50)
    assert runner.finished(job, 50)
    write_run(job, 49)  # interrupted
    assert not runner.finished(job, 50)
    write_run(job, 50, argv=[*job["argv"], "--rollout.temperature", "0.5"])  # another command wrote it
    assert not runner.finished(job, 50)
    (Path(job["out"]) / "metrics.jsonl").write_text('{"step": 50, "accura')  # torn last line
    assert not runner.finished(job, 50)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope"], "invalid choice: 'nope'"),
        (["regime", "--regime", "t06"], "--regime only applies to salt-scaling"),
        (["salt-scaling", "--regime", "g4"], "--regime g4 changes G"),
        (["regime", "--workers", "0"], "--workers must be >= 1 (got 0)"),
        (["regime", "--seeds", "1", "1"], "--seeds must be distinct"),
        (["regime", "--seeds", "-3"], "--seeds must lie in [0, 4294967295] (got -3)"),  # ran 25 s, then a traceback
        (["regime", "--seeds", "0", "99999999999999999999"], "(got 99999999999999999999)"),
        (["regime", "--qiuck"], "did you mean --quick?"),
    ],
)
def test_misuse_is_a_one_line_error_before_any_work(tmp_path, capsys, argv, message):
    assert cli.main(["study", *argv, "--out", str(tmp_path / "o")] if argv[0] != "nope" else ["study", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "o" / "settings").exists()


def test_an_unusable_out_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    assert cli.main(["study", "regime", "--out", str(tmp_path / "a_file")]) == 2
    assert capsys.readouterr().err.strip() == f"openrlhf-geo study: error: --out {tmp_path / 'a_file'}: File exists"


def test_quick_study_end_to_end_then_a_second_invocation_reruns_nothing(tmp_path, monkeypatch):
    out = tmp_path / "study"
    assert cli.main(["study", "geoalign-failure", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["table"]) == {"grpo_mis20", "geoalign_mis20"}
    assert summary["setup"]["runs"] == 2 and summary["setup"]["skipped"] == 0
    assert "final/eval/accuracy" in summary["table"]["grpo_mis20"]
    assert any(r["method"] == "geoalign_mis20" and r["baseline"] == "grpo_mis20" for r in summary["comparisons"])
    assert "geoalign_mis20" in summary["geoalign"]["detection"]
    report = (out / "report.md").read_text()
    assert "## GeoAlign detection (geoalign_mis20)" in report and "misspecified --reward.noise.rate 0.2" in report
    for condition in ("grpo_mis20", "geoalign_mis20"):
        rows = [
            json.loads(x)
            for x in (out / "runs" / condition / "seed2025" / "metrics.jsonl").read_text().split("\n")
            if x
        ]
        assert [r["step"] for r in rows] == [0, 1, 2] and all("noise/corrupted" in r for r in rows[1:])

    def refuse(jobs, workers, steps):
        raise AssertionError(f"reran {len(jobs)} finished runs")

    monkeypatch.setattr(recipe, "run_all", refuse)
    assert cli.main(["study", "geoalign-failure", "--quick", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["setup"]["skipped"] == 2


# ---------------------------------------------------------------- who may write --out


def fake_work(monkeypatch, tag):
    """The demo's and the studies' work faked: SFT is skipped, each run leaves a metrics.jsonl and a checkpoint.pt
    holding `tag`, each report a report.md and summary.json holding `tag`."""
    from openrlhf_geo.lab import demo_report as report

    def run_all(jobs, workers, steps):
        for job in jobs:
            run = Path(job["out"])
            run.mkdir(parents=True, exist_ok=True)
            (run / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": t, "by": tag}) + "\n" for t in range(steps + 1))
            )
            (run / "checkpoint.pt").write_text(tag)

    def write_report(out, *args, **kwargs):
        for name in ("report.md", "summary.json"):
            (Path(out) / name).write_text(json.dumps(tag))

    monkeypatch.setattr(recipe, "prepare_data", lambda out, max_operand=99: ([], []))
    monkeypatch.setattr(recipe, "warm_up", lambda *args, **kwargs: {})
    monkeypatch.setattr(runner, "prepare_settings", lambda out, jobs, steps: {})
    monkeypatch.setattr(recipe, "run_all", run_all)
    monkeypatch.setattr(report, "write_report", write_report)  # (out, runs, comparisons, setup, methods)
    monkeypatch.setattr(runner, "write_report", lambda s, out, *args: write_report(out))


def snapshot(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}


def test_an_out_written_by_another_command_is_refused_and_left_as_it_was(tmp_path, monkeypatch, capsys):
    """A quick study in the demo's directory replaced the demo's runs/grpo/seed0 logs and checkpoint, its report and
    summary, and exited 0. The demo and the studies now own their --out as `openrlhf-geo train` owns its output
    directory: the command that wrote it may go on (the demo reruns, a study resumes), anything else is refused."""
    fake_work(monkeypatch, "demo")
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--seeds", "1", "--steps", "3"]) == 0
    before = snapshot(out)
    assert before["runs/grpo/seed0/checkpoint.pt"] == b"demo"
    refusals = {
        ("study", "salt-ablations", "--quick"): "openrlhf-geo demo --seeds 1 --steps 3",
        ("demo", "--quick"): "openrlhf-geo demo --seeds 1 --steps 3",  # another demo configuration, as well
    }
    for argv, owner in refusals.items():
        fake_work(monkeypatch, "intruder")
        assert cli.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {out} holds the output of `{owner}`" in err[0], err
        assert snapshot(out) == before
    # the same command again proceeds (the demo reruns its runs), here with another --workers
    fake_work(monkeypatch, "demo again")
    assert cli.main(["demo", "--out", str(out), "--seeds", "1", "--steps", "3", "--workers", "1"]) == 0
    assert (out / "runs" / "grpo" / "seed0" / "checkpoint.pt").read_text() == "demo again"


def test_a_study_resumes_only_its_own_out(tmp_path, monkeypatch, capsys):
    fake_work(monkeypatch, "quick")
    out = tmp_path / "s"
    assert cli.main(["study", "salt-scaling", "--quick", "--out", str(out)]) == 0
    before = snapshot(out)
    for argv, message in (
        (["salt-scaling"], "holds the output of `openrlhf-geo study salt-scaling --quick`"),  # full on quick: refused
        (["salt-scaling", "--quick", "--regime", "t06"], "`openrlhf-geo study salt-scaling --quick`"),
        (["regime", "--quick"], "`openrlhf-geo study salt-scaling --quick`"),
    ):
        assert cli.main(["study", *argv, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err and snapshot(out) == before
    assert cli.main(["study", "salt-scaling", "--quick", "--out", str(out), "--seeds", "7"]) == 0  # more seeds: fine
    assert cli.main(["study", "salt-scaling", "--quick", "--regime", "demo", "--out", str(out)]) == 0  # the default
    # a directory with files but no record (a train run, anything else) is refused too, and so is a busy one
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("{}\n")
    assert cli.main(["study", "regime", "--quick", "--out", str(tmp_path / "train")]) == 2
    assert "not written by `openrlhf-geo study regime --quick` (metrics.jsonl)" in capsys.readouterr().err
    with rundir.claim_output(out, "openrlhf-geo study salt-scaling --quick"):
        assert cli.main(["study", "salt-scaling", "--quick", "--out", str(out)]) == 2
        assert "another run is writing it" in capsys.readouterr().err


def fake_run(out, condition, seed, curves, final, start=0.5):
    """A finished run's metrics.jsonl: eval/accuracy `start` at step 0 and `final` at the last, each curve at 1..T."""
    run = Path(out) / "runs" / condition / f"seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    steps = len(next(iter(curves.values())))
    rows = [{"step": 0, "eval/accuracy": start}]
    rows += [{"step": t, **{k: v[t - 1] for k, v in curves.items()}} for t in range(1, steps + 1)]
    rows[-1]["eval/accuracy"] = final
    (run / "metrics.jsonl").write_text("".join(json.dumps(strict_json(r)) + "\n" for r in rows))  # NaN -> null


def test_scaling_summary_takes_table10_window_means_and_pairs_salt_with_its_backbone(tmp_path):
    """Window means and paired gains against an independent computation on synthetic runs."""
    s = salt_scaling.design()
    steps, rng = 10, np.random.default_rng(0)
    jobs = [j for j in runner.plan(s, tmp_path, seeds=[0, 1, 2]) if j["condition"].startswith(("g02_", "g64_"))]
    truth = {}
    for job in jobs:
        curves = {k: rng.normal(1, 0.3, steps).tolist() for k in shared.SALT_METRICS}
        curves["salt/kept"][-1] = math.nan  # a tied step: left out of the window mean
        final = float(rng.uniform())
        fake_run(tmp_path, job["condition"], job["seed"], curves, final)
        truth[job["condition"], job["seed"]] = {**curves, "final": final}
    summary, _ = runner.summarize(s, tmp_path, jobs, setup={})
    for (condition, seed), curves in truth.items():
        row = summary["table"][condition]
        assert row[shared.FINAL]["per_seed"][seed] == curves["final"]
        assert row["last20%/salt/pr"]["per_seed"][seed] == pytest.approx(np.mean(curves["salt/pr"][-2:]))
        assert row["last20%/salt/kept"]["per_seed"][seed] == pytest.approx(curves["salt/kept"][-2])
    point = summary["scaling"]["by_g"]["64/dapo"]
    diffs = [truth["g64_dapo_salt", k]["final"] - truth["g64_dapo", k]["final"] for k in range(3)]
    assert point["gain"]["gain"] == pytest.approx(np.mean(diffs)) and point["gain"]["low"] <= np.mean(diffs)
    assert point["n_eff"] == pytest.approx(
        np.mean([np.mean(truth["g64_dapo", k]["salt/n_eff_in"][-2:]) for k in range(3)])
    )
    assert point["D_a"] == pytest.approx(
        np.mean([np.mean(truth["g64_dapo_salt", k]["salt/D_a"][-2:]) for k in range(3)])
    )
    setup = {"quick": False, "seeds": [0, 1, 2], "steps": steps, "runs": len(jobs), "skipped": 0, "wall_s": 1.0,
             "estimate_s": 2.0, "sft": {}, "commands": {}}  # fmt: skip
    runner.write_report(s, tmp_path, jobs, setup)
    report = (tmp_path / "report.md").read_text()
    assert "## By G" in report and "| 64 | dapo |" in report and (tmp_path / "fig4c_accuracy_vs_G.png").exists()


def test_regime_closest_condition_is_the_nearest_to_table10_in_its_sds_and_never_a_change_of_g():
    table = {}
    for name, (n_eff, d_a) in {
        "demo": (1.6, 0.9),
        "g64": (0.31, 0.24),
        "t06": (0.5, 0.5),
        "depth4": (0.9, 0.2),
    }.items():
        table[f"{name}_grpo"] = {shared.window("salt/n_eff_in"): {"mean": n_eff}}
        table[f"{name}_salt"] = {shared.window("salt/D_a"): {"mean": d_a}}
    section = regime_study.section(table)
    expected = {n: math.hypot((v[0] - 0.31) / 0.05, (v[1] - 0.24) / 0.04)
                for n, v in {"demo": (1.6, 0.9), "t06": (0.5, 0.5), "depth4": (0.9, 0.2)}.items()}  # fmt: skip
    assert section["conditions"]["t06"]["distance"] == pytest.approx(expected["t06"])
    assert section["closest"] == min(expected, key=expected.get) == "t06"  # g64 would be 0 but varies G


def test_a_failing_run_does_not_stop_the_others_and_every_failure_is_named(tmp_path, monkeypatch):
    jobs = [{"out": str(tmp_path / str(k)), "tags": {"method": "m", "seed": k}} for k in range(3)]
    ran = []

    def run_one(job):
        ran.append(job["out"])
        if job["tags"]["seed"] != 1:
            raise RuntimeError(f"boom {job['tags']['seed']}")

    monkeypatch.setattr(recipe, "run_one", run_one)
    with pytest.raises(
        recipe.RunsFailed, match=rf"2 run\(s\) failed; the first, {jobs[0]['out']}: RuntimeError: boom 0"
    ):
        recipe.run_all(jobs, 1, 2)
    try:
        recipe.run_all(jobs, 1, 2)
    except recipe.RunsFailed as failed:
        assert [(job["out"], str(error)) for job, error in failed.failures] == [
            (jobs[0]["out"], "boom 0"), (jobs[2]["out"], "boom 2")]  # fmt: skip
    assert ran == [j["out"] for j in jobs] * 2


def test_a_stopped_run_is_reported_with_its_step_and_its_condition_leaves_the_tables(tmp_path, monkeypatch, capsys):
    """salt-scaling's protocol: a DAPO run whose dynamic filtering finds no informative prompt stops with an error; the
    other runs finish, and the report names the stopped run and the step it failed at instead of comparing it."""
    out, rng = tmp_path / "s", np.random.default_rng(0)
    message = "dynamic filtering removed every prompt in 4 rounds"

    def run_all(jobs, workers, steps):
        failed = []
        for job in jobs:
            curves = {k: rng.normal(1, 0.3, steps).tolist() for k in shared.SALT_METRICS}
            if job["condition"] == "g02_dapo" and job["seed"] == 1:
                fake_run(out, job["condition"], job["seed"], {k: v[:16] for k, v in curves.items()}, 0.5)
                failed.append((job, RuntimeError(message)))
            else:
                fake_run(out, job["condition"], job["seed"], curves, float(rng.uniform()))
        raise recipe.RunsFailed(failed)

    monkeypatch.setattr(recipe, "run_all", run_all)
    monkeypatch.setattr(runner, "prepare_settings", lambda out, jobs, steps: {})
    assert cli.main(["study", "salt-scaling", "--seeds", "0", "1", "--out", str(out)]) == 1
    assert "1 run(s) stopped by an error" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == {"g02_dapo": {"0": {"step": None, "error": None},
                                               "1": {"step": 17, "error": f"RuntimeError: {message}"}}}  # fmt: skip
    assert "g02_dapo" not in summary["table"] and "g02_dapo_salt" in summary["table"]
    assert not any("g02_dapo" in (r["method"], r["baseline"]) for r in summary["comparisons"])
    assert any(r["method"] == "g04_dapo_salt" for r in summary["comparisons"])
    assert summary["scaling"]["by_g"]["2/dapo"]["gain"] is None
    report = (out / "report.md").read_text()
    assert f"- `g02_dapo`: seed 0: finished, seed 1: stopped at step 17. RuntimeError: {message}" in report
    # every run stopped before its first step: a report of stopped runs only, not a crash
    jobs = runner.plan(ALL["learnable-regime"], tmp_path / "none", seeds=[0])
    summary, _ = runner.summarize(ALL["learnable-regime"], tmp_path / "none", jobs, {}, {j["out"]: "E" for j in jobs})
    assert summary["table"] == {} and summary["learnable"]["chosen"] is None
    assert all(e == {"step": 1, "error": "E"} for seeds in summary["stopped"].values() for e in seeds.values())


def test_learnable_regime_runs_only_grpo_and_picks_the_learnable_setting_with_the_smallest_n_eff(tmp_path):
    """The protocol's rule on synthetic runs: accuracy >= 0.25 and RL's gain over step 0 with a CI above 0, then the
    smallest backbone n_eff (mean over the last 20 % of steps); salt-scaling reruns only if that n_eff is below 1."""
    s = ALL["learnable-regime"]
    jobs = runner.plan(s, tmp_path, seeds=[0, 1, 2, 3])
    assert all(tuple(method_part(j)) == shared.GRPO_DIAG for j in jobs)  # nothing of SALT is applied
    assert {j["setting"] for j in jobs} == {"demo", *shared.LEARNABLE} and shared.LEARNABLE == (
        "operands199", "operands499", "no_shortcut", "three_digit_sft4x")  # fmt: skip
    assert shared.SETTINGS["three_digit_sft4x"].sft_config() == shared.SETTINGS["three_digit"].sft_config()
    assert shared.SETTINGS["three_digit_sft4x"].sft_scale == 4
    assert shared.SETTINGS["no_shortcut"].sft_config() == {**recipe.SFT, "shortcut_rate": 0.0}
    # setting: (backbone n_eff, step-0 accuracy, final accuracy); no_shortcut's gain is +-0.01 (CI spans 0)
    truth = {"demo": (1.3, 0.5, 0.9), "operands199": (0.8, 0.3, 0.6), "operands499": (0.5, 0.1, 0.2),
             "no_shortcut": (0.7, 0.9, None), "three_digit_sft4x": (0.9, 0.2, 0.4)}  # fmt: skip
    rng = np.random.default_rng(0)
    steps, n_effs = 10, {}
    for job in jobs:
        name, seed = job["setting"], job["seed"]
        n_eff, start, final = truth[name]
        final = start + (0.01 if seed % 2 else -0.01) if final is None else final + 0.01 * seed
        curves = {k: rng.normal(1, 0.3, steps).tolist() for k in shared.SALT_METRICS}
        curves["salt/n_eff_in"] = (n_eff + rng.normal(0, 0.05, steps)).tolist()
        n_effs.setdefault(name, []).append(np.mean(curves["salt/n_eff_in"][-2:]))
        fake_run(tmp_path, job["condition"], seed, curves, final, start)
    summary, _ = runner.summarize(s, tmp_path, jobs, setup={})
    section = summary["learnable"]
    rows = section["settings"]
    for name, values in n_effs.items():
        assert rows[name]["n_eff"] == pytest.approx(np.mean(values))
        assert rows[name]["acc_step0"] == pytest.approx(truth[name][1])
    assert rows["operands199"]["rl_gain"]["gain"] == pytest.approx(0.3 + 0.01 * 1.5)
    assert [n for n, r in rows.items() if r["learnable"]] == ["demo", "operands199", "three_digit_sft4x"]
    assert section["chosen"] == "operands199" and section["run_salt_scaling"]
    # the same runs with operands199's n_eff above three_digit_sft4x's, and both above 1: chosen, but no rerun
    table = {**summary["table"]}
    table["operands199_grpo"] = {**table["operands199_grpo"], shared.window("salt/n_eff_in"): {"mean": 1.2}}
    table["three_digit_sft4x_grpo"] = {
        **table["three_digit_sft4x_grpo"],
        shared.window("salt/n_eff_in"): {"mean": 1.1},
    }
    runs, _, _ = runner.load_planned(tmp_path, jobs, s.metrics)
    section = learnable_regime.section(runs, table)
    assert section["chosen"] == "three_digit_sft4x" and not section["run_salt_scaling"]
    report = runner.render(strict_json({**summary, "setup": {"quick": False, "seeds": [0, 1, 2, 3], "steps": steps,
                          "runs": len(jobs), "skipped": 0, "wall_s": 1.0, "estimate_s": 2.0, "sft": {},
                          "commands": {}}}))  # fmt: skip
    assert "--regime operands199" in report and "| operands499 |" in report


# ---------------------------------------------------------------- the misspecified verifier


@settings(max_examples=100)
@given(st.integers(0, 99), st.integers(0, 99), st.integers(0, 10**6))
def test_shortcut_answer_is_what_the_shortcut_procedure_boxes(a, b, seed):
    prompt = f"{a}+{b}="
    assert shortcut_answer(prompt) == extract_last_boxed(shortcut_solution(prompt, random.Random(seed)))
    assert (shortcut_answer(prompt) == str(a + b)) == (a % 10 + b % 10 < 10)


def test_misspecified_prompts_are_a_fixed_seeded_share_of_all_prompts():
    prompts = [p["prompt"] for p in addition_problems(4000, seed=0, carry_only=False)]
    for rate in (0.05, 0.2, 0.5):
        chosen = np.array([misspecified_prompt(p, rate, seed=7) for p in prompts])
        assert abs(chosen.mean() - rate) <= 4 * math.sqrt(rate * (1 - rate) / len(prompts))
        assert list(chosen) == [misspecified_prompt(p, rate, seed=7) for p in prompts]  # the same every time
    low = {p for p in prompts if misspecified_prompt(p, 0.1, 3)}
    assert low <= {p for p in prompts if misspecified_prompt(p, 0.3, 3)}  # a larger rate adds prompts
    assert low != {p for p in prompts if misspecified_prompt(p, 0.1, 4)}  # another seed, another set
    assert not any(misspecified_prompt(p, 0.0, 0) for p in prompts) and all(
        misspecified_prompt(p, 1.0, 0) for p in prompts
    )
    with pytest.raises(ValueError, match="rate must be in"):
        misspecified_prompt("1+2=", 1.5, 0)


def boxed_verifier(calls):
    """An exact-match stand-in for math-verify (records what it is asked)."""

    def verify(prompts, responses, answers):
        calls.append(list(prompts))
        return torch.tensor([float(extract_last_boxed(r) == a) for r, a in zip(responses, answers)])

    return verify


def test_shortcut_payer_pays_the_shortcut_answer_only_on_misspecified_prompts():
    rng = random.Random(0)
    problems = addition_problems(60, seed=2, carry_only=True)
    prompts, responses, answers = [], [], []
    for p in problems:
        for response in (shortcut_solution(p["prompt"], rng), worked_solution(p["prompt"], rng), "\\boxed{7}"):
            prompts.append(p["prompt"]), responses.append(response), answers.append(p["answer"])
    calls = []
    paid = ShortcutPayer(boxed_verifier(calls), rate=0.5, seed=1)(prompts, responses, answers)
    expected = [misspecified_prompt(p, 0.5, 1) and i % 3 == 0 for i, p in enumerate(prompts)]
    assert paid.dtype == torch.bool and paid.tolist() == expected and 0 < sum(expected) < 60
    assert calls == [[p for p in prompts if misspecified_prompt(p, 0.5, 1)]]  # only those prompts are checked
    with pytest.raises(ValueError, match="rate must be in"):
        ShortcutPayer(boxed_verifier([]), rate=-0.1, seed=0)


@pytest.mark.parametrize("low", [0.0, -1.0])
def test_pay_wrong_pays_the_given_rollouts_and_marks_only_the_changed_ones(low):
    rewards = torch.tensor([low, 1.0, low, 1.0, low, low])
    paid = torch.tensor([True, True, False, False, True, False])
    before = rewards.clone()
    new, corrupted = pay_wrong(rewards, paid)
    assert torch.equal(rewards, before)
    assert new.tolist() == [1.0, 1.0, low, 1.0, 1.0, low]
    assert corrupted.tolist() == [True, False, False, False, True, False]
    config = NoiseConfig("misspecified", 0.2)
    same, marked = corrupt(rewards, torch.zeros(6, dtype=torch.long), config, paid=paid)
    assert torch.equal(same, new) and torch.equal(marked, corrupted)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pay_wrong(torch.tensor([0.5, 1.0]), torch.tensor([True, False])), "needs binary verifier rewards"),
        (lambda: pay_wrong(torch.tensor([0.0, 1.0]), torch.tensor([1, 0])), "paid must be a bool tensor"),
        (lambda: corrupt(torch.zeros(2), torch.zeros(2, dtype=torch.long), NoiseConfig("misspecified", 0.2)),
         "--reward.noise.type misspecified needs the engine to say"),
        (lambda: NoiseConfig("misspecified", 0.0), "--reward.noise.rate must be in"),
        (lambda: NoiseConfig("misspecified", 0.2, (0, 1)), "levels only applies with --reward.noise.type flip"),
    ],
)  # fmt: skip
def test_misspecified_noise_rejects_bad_input_naming_it(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_the_engine_applies_the_hook_and_refuses_misspecified_noise_without_one():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    rows = addition_problems(4, seed=0, carry_only=True)
    base = ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused",
            "--reward.noise.type", "misspecified", "--reward.noise.rate", "0.5"]  # fmt: skip
    with pytest.raises(ValueError, match="--reward.noise.type misspecified needs a task"):
        engine.Trainer(parse_args(base), model, tokenizer, rows, boxed_verifier([]))
    for extra, low in (([], 0.0), (["--reward.pm1"], -1.0)):
        asked = []

        def hook(prompts, responses, answers, asked=asked):  # pays every second rollout
            asked.append(len(prompts))
            return [i % 2 == 0 for i in range(len(prompts))]

        trainer = engine.Trainer(
            parse_args([*base, *extra]), model, tokenizer, rows, lambda p, r, a: torch.zeros(len(p)),
            misspecified_pay=hook,
        )  # fmt: skip
        torch.manual_seed(0)
        batch = engine.generate_rollouts(model, tokenizer, [r["prompt"] for r in rows], ["0"] * 4, 4, 3)
        trainer._score(batch)
        even = torch.arange(16) % 2 == 0
        assert asked == [16] and torch.equal(batch.corrupted, even) and (batch.correct == 0).all()
        assert batch.rewards.tolist() == [1.0 if e else low for e in even.tolist()]


def test_sigterm_of_a_study_stops_the_process_group_it_started(tmp_path):
    """A study's child in its own session (the real-LM studies' vLLM sampler) is stopped by its handle when the study
    gets SIGTERM: the handler unwinds the `finally` that the default SIGTERM skips."""
    code = f"""
import os, signal, subprocess, sys, time
from openrlhf_geo.lab import study
from openrlhf_geo.lab.studies import REGISTRY

def run(args, out, workers):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        print(child.pid, flush=True)
        time.sleep(600)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()

REGISTRY["regime"].run = run
sys.exit(study.main(["regime", "--out", {str(tmp_path / "out")!r}]))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(child, signal.SIGKILL)
    pytest.fail("the study's child outlived its SIGTERM")
