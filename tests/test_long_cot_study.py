"""The long-cot study's bookkeeping on synthetic runs (no training): its plan is train commands of the protocol's
conditions, the per-run numbers read from metrics.jsonl (Table 10's window, skipping undefined steps), the decision
rule of docs/studies/long-cot.md, the paired comparisons and the report."""

import json
import math

import pytest

from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab.studies import long_cot as study
from openrlhf_geo.local.flags import parse_args


def write_run(path, steps, acc, n_eff, extra=None):
    """metrics.jsonl: eval rows at 0 / mid / end with accuracies `acc`, and per step n_eff_in = n_eff(step)."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": acc[0]}]
    for step in range(1, steps + 1):
        row = {"step": step, "salt/n_eff_in": n_eff(step), "salt/alpha": max(0.0, 1 - n_eff(step)), "salt/pr": 3.0,
               "response_length": 120.0, **(extra or {})}  # fmt: skip
        if step == steps // 2:
            row["eval/accuracy"] = acc[1]
        if step == steps:
            row["eval/accuracy"] = acc[2]
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plan_is_train_commands_of_the_protocol(tmp_path):
    jobs = study.phase1_jobs(tmp_path, (3, 5), (1, 2), 40, 20)
    assert [(j["k"], j["seed"]) for j in jobs] == [(3, 1), (3, 2), (5, 1), (5, 2)]
    args = parse_args(jobs[2]["argv"])
    assert args.rollout.max_new_tokens == 42 * 5 + 12
    assert args.rollout.batch_size == 8 and args.rollout.n_samples_per_prompt == 8
    assert args.salt.diagnostics and args.algo.advantage.estimator == "group_norm"
    assert args.data.prompt_dataset.endswith("k5/train.jsonl")
    phase2 = study.phase2_jobs(tmp_path, 5, (1, 2), 40, 20)
    assert [(j["condition"], j["seed"]) for j in phase2[:4]] == [("grpo", 1), ("salt", 1), ("grpo", 2), ("salt", 2)]
    assert [j["condition"] for j in phase2[4:]] == ["salt_fixed0", "salt_fixed1"] * 2 + ["salt_fixed0.5"] * 2
    fixed = parse_args(phase2[-1]["argv"])
    assert fixed.salt.variant == "fixed-alpha" and fixed.salt.alpha == 0.5
    assert phase2[0]["argv"] == jobs[2]["argv"]  # phase 2's GRPO at a phase-1 seed is that phase-1 run
    slow = study.phase1_jobs(tmp_path, (3,), (1,), 40, 20, lr=3e-5)[0]
    assert parse_args(slow["argv"]).actor.adam.lr == 3e-5 and slow["cell"] == "k3_lr3e-05"
    assert "/runs/k3_lr3e-05/grpo/seed1" in slow["out"] and jobs[0]["cell"] == "k3"


def test_read_run_averages_the_last_20_percent_and_skips_undefined(tmp_path):
    write_run(tmp_path, 10, (0.3, 0.5, 0.6), lambda s: float("nan") if s == 10 else s / 10)
    r = study.read_run(tmp_path, 10)
    assert r["acc0"] == 0.3 and r["acc_final"] == 0.6 and r["acc_mean"] == pytest.approx(0.55)
    assert r["salt/n_eff_in"] == pytest.approx(0.9)  # steps 9 and 10 are the window; step 10 is NaN
    write_run(tmp_path, 10, (0.3, 0.5, 0.6), lambda s: 0.0 if s == 9 else 1.5, {"signal/tied_groups": 0.5})
    assert study.read_run(tmp_path, 10)["salt/n_eff_in"] == pytest.approx(0.75)  # a partly tied step counts
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = json.loads(lines[9])
    row["signal/tied_groups"] = 1.0  # step 9: every group tied, n_eff logged as 0/0 := 0
    lines[9] = json.dumps(row)
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    r = study.read_run(tmp_path, 10)
    assert r["salt/n_eff_in"] == pytest.approx(1.5) and r["response_length"] == 120.0
    assert math.isnan(r["salt/D_a"])


def test_decision_rule():
    def row(acc0, low, n_eff):
        return {"acc0": {"mean": acc0}, "gain": {"low": low}, "n_eff": {"mean": n_eff}}

    phase1 = {3: row(0.5, 0.01, 1.2), 5: row(0.4, 0.02, 0.8), 7: row(0.3, 0.05, 0.6), 9: row(0.1, 0.2, 0.3)}
    assert study.decide(phase1) == {"learnable": [3, 5, 7], "in_regime": [5, 7, 9], "chosen": 7}
    phase1[7] = row(0.85, 0.05, 0.6)  # step-0 accuracy above the range
    phase1[5] = row(0.4, -0.01, 0.8)  # the gain's CI reaches 0
    assert study.decide(phase1)["chosen"] is None


def test_phase_summaries_and_report(tmp_path):
    runs1 = {}
    for k, n_eff in (("k3", 1.4), ("k5", 0.7)):
        for seed, lift in ((1, 0.10), (2, 0.12), (3, 0.08)):
            write_run(tmp_path / f"{k}{seed}", 10, (0.4, 0.45, 0.4 + lift), lambda s, n=n_eff: n)
            runs1.setdefault(k, {})[seed] = study.read_run(tmp_path / f"{k}{seed}", 10)
    phase1 = study.summarize_phase1(runs1)
    assert phase1["k5"]["gain"]["gain"] == pytest.approx(0.10)
    assert phase1["k5"]["gain"]["low"] > 0 and phase1["k5"]["n_eff"]["mean"] == pytest.approx(0.7)
    decision = study.decide(phase1)
    assert decision == {"learnable": ["k3", "k5"], "in_regime": ["k5"], "chosen": "k5"}
    runs2 = {"grpo": runs1["k5"], "salt": {}}
    for seed in (1, 2, 3):
        write_run(tmp_path / f"salt{seed}", 10, (0.4, 0.4, 0.3), lambda s: 0.9, {"salt/D_a": 0.3})
        runs2["salt"][seed] = study.read_run(tmp_path / f"salt{seed}", 10)
    phase2 = study.summarize_phase2(runs2)
    row = phase2["vs_grpo"]["salt"]["acc_final"]
    assert row["gain"] == pytest.approx(0.3 - 0.5) and study.verdict(row) == "loss"
    assert phase2["table"]["salt"]["salt/D_a"]["mean"] == pytest.approx(0.3)
    setup = {"sft": {"params": 1, "steps": 1, "sft_s": 1.0, "accuracy": {}, "shortcut": {}}, "steps": 10,
             "workers": 1, "wall_s": 1.0, "kernels": {}, "commands": {"k5_grpo": "--x"}}  # fmt: skip
    summary = {"setup": setup, "phase1": phase1, "decision": decision, "phase1b": phase1, "decision1b": decision,
               "descriptive": phase1, "phase2": phase2, "phase2_k": "k5", "stopped": {}}  # fmt: skip
    text = study.render(json.loads(json.dumps(strict_json(summary))))  # NaN -> null, as summary.json holds it
    assert "| k5 | 120.0 |" in text and "loss" in text and "chosen: k5" in text and "Phase 1b" in text
    assert "Descriptive runs" in text
    assert "| yes | yes |" in text and "| yes | no |" in text  # k5 learnable and in the regime, k3 learnable only
    assert study.verdict({"gain": 0.1, "low": 0.05, "high": 0.2}) == "win"
    assert study.verdict({"gain": 0.0, "low": -0.05, "high": 0.2}) == "no difference detected"
    assert study.verdict({"gain": 0.1, "low": None, "high": None}).startswith("undecided")
    assert study._ci({"gain": 0.1, "low": None, "high": None}) == "+0.100 [n/a, n/a]"
