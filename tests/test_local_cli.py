"""`openrlhf-geo train` and `openrlhf-geo demo --quick` end to end (CPU, tiny model, tmp_path)."""

import json

import pytest

from openrlhf_geo import cli
from openrlhf_geo.local.task import addition_problems, build_model, build_tokenizer, write_jsonl

REWARD_FILE = '''
import torch

def reward_func(queries, prompts, labels):
    """Upstream's signature: 1 when the response part of the query contains the label's last digit."""
    return {"rewards": torch.tensor([float(l[-1] in q[len(p):]) for q, p, l in zip(queries, prompts, labels)])}
'''


@pytest.fixture
def setup(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2).config.save_pretrained(tmp_path / "cfg")
    rows = addition_problems(12, seed=0)
    write_jsonl(tmp_path / "train.jsonl", [{"question": r["prompt"], "label": r["answer"]} for r in rows])
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    return tmp_path


def train_argv(tmp, steps, *extra):
    return [
        "train",
        "--actor.config", str(tmp / "cfg" / "config.json"),
        "--actor.tokenizer", str(tmp / "tok"),
        "--data.prompt_dataset", str(tmp / "train.jsonl"),
        "--data.input_key", "question",
        "--data.label_key", "label",
        "--eval.dataset", str(tmp / "train.jsonl"),
        "--eval.steps", "2",
        "--reward.func", str(tmp / "reward.py"),
        "--rollout.batch_size", "3",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.max_new_tokens", "5",
        "--advantage_estimator", "salt",
        "--salt.features", "sketch",
        "--salt.dim", "64",
        "--train.steps", str(steps),
        "--train.threads", "1",
        "--ckpt.output_dir", str(tmp / "out"),
        *extra,
    ]  # fmt: skip


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_writes_metrics_checkpoint_and_model_then_resumes(setup):
    tmp = setup
    assert cli.main(train_argv(tmp, 2)) == 0
    out = tmp / "out"
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0 = evaluation before training
    assert {"accuracy", "reward", "loss", "salt/pr", "salt/n_eff", "salt/alpha", "eval/accuracy"} <= rows[-1].keys()
    assert "salt/gram_noise" in rows[-1]  # sketch features: --salt.gram defaults to shrink and reaches SALT
    assert (out / "checkpoint.pt").exists() and (out / "model" / "config.json").exists()
    assert (out / "model" / "tokenizer.json").exists()

    with (out / "metrics.jsonl").open("a") as f:  # a row written after the last checkpoint (then a crash)
        f.write(json.dumps({"step": 3, "accuracy": -1.0}) + "\n")
    assert cli.main(train_argv(tmp, 3, "--ckpt.load_enable")) == 0
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["accuracy"] >= 0  # resumed at 2, appended 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--salt.base", "rloo"], "supports --salt.base group_norm or dr_grpo"),
        (["--diagnostics.features", "exact"], "--diagnostics.features is for runs without SALT"),
        (["--rollout.n_samples_per_prompt", "1"], "--rollout.n_samples_per_prompt must be >= 2"),
        (["--actor.model_name_or_path", "somewhere"], "exactly one of --actor.model_name_or_path and --actor.config"),
        (["--reward.noise.type", "flip"], "--reward.noise.rate must be in (0, 1)"),
        (
            [
                "--reward.pm1",
                "--reward.noise.type",
                "flip",
                "--reward.noise.rate",
                "0.1",
                "--reward.noise.levels",
                "0",
                "1",
            ],
            "--reward.pm1 makes rewards -1/+1",
        ),
    ],
)
def test_train_rejects_inconsistent_flags_naming_them(setup, capsys, extra, message):
    assert cli.main(train_argv(setup, 1, *extra)) == 2
    assert message in capsys.readouterr().err


def test_demo_quick_writes_report_metrics_and_plots(tmp_path):
    assert cli.main(["demo", "--quick", "--out", str(tmp_path), "--workers", "1"]) == 0
    report = (tmp_path / "report.md").read_text()
    for section in ("## Final held-out accuracy", "## SALT geometry", "## GeoAlign detection"):
        assert section in report
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert {r["method"] for r in rows} == {"grpo", "salt", "grpo_noise", "geoalign_noise"}
    assert all("salt/n_eff_out" in r for r in rows if r["method"] in ("grpo", "salt") and r["step"] > 0)
    assert any("geo/auroc" in r for r in rows if r["method"] == "geoalign_noise")
    for name in ("accuracy_vs_step", "pr_neff_vs_step", "alpha_vs_step", "gdi_corrupted_vs_clean"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "sft" / "sft.json").read_text())["steps"] >= 1
