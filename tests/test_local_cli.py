"""`openrlhf-geo train` and `openrlhf-geo demo --quick` end to end (CPU, tiny model, tmp_path)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openrlhf_geo import cli
from openrlhf_geo.lab import recipe
from openrlhf_geo.lab.task import addition_problems, build_model, build_tokenizer, write_jsonl
from openrlhf_geo.local import engine, rundir

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
    assert {"accuracy", "reward", "loss", "salt/pr", "salt/n_eff_out", "salt/alpha", "eval/accuracy"} <= rows[
        -1
    ].keys()
    assert (out / "checkpoint.pt").exists() and (out / "model" / "config.json").exists()
    assert (out / "model" / "tokenizer.json").exists()

    with (out / "metrics.jsonl").open("a") as f:  # a row written after the last checkpoint (then a crash)
        f.write(json.dumps({"step": 3, "accuracy": -1.0}) + "\n")
    assert cli.main(train_argv(tmp, 3, "--ckpt.load_enable")) == 0
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["accuracy"] >= 0  # resumed at 2, appended 3


def same_numbers(a, b):
    """Rows equal on every shared key but timings (NaN == NaN)."""
    keys = {k for k in a.keys() & b.keys() if not k.startswith("time/") and k not in ("salt/solve_ms", "geo/time_s")}
    assert keys, "no shared metrics"
    for key in keys:
        x, y = a[key], b[key]
        assert x == y or (x is None and y is None) or (math.isnan(x) and math.isnan(y)), key


def test_a_used_output_dir_is_never_replaced_silently_and_a_crashed_run_resumes(setup, capsys):
    tmp, out = setup, setup / "out"
    assert cli.main(train_argv(tmp, 2, "--ckpt.save_steps", "1")) == 0
    first = read_rows(out / "metrics.jsonl")
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != rundir.LOCK}
    capsys.readouterr()

    refusals = [
        ([], "already holds a run (checkpoint.prev.pt, checkpoint.pt, metrics.jsonl, model, run.json)"),  # fresh
        (
            ["--ckpt.load_enable", "--actor.adam.lr", "1e-3", "--train.seed", "7"],
            "lr 1e-06 -> 0.001, --train.seed 42 -> 7",
        ),
        (["--ckpt.load_enable", "--rollout.max_new_tokens", "6"], "--rollout.max_new_tokens 5 -> 6"),
    ]
    for extra, message in refusals:
        assert cli.main(train_argv(tmp, 2, *extra)) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != rundir.LOCK} == files

    with rundir.claim(out, resume=True):  # another run holds the directory
        assert cli.main(train_argv(tmp, 3, "--ckpt.load_enable")) == 1
        assert "another run is writing it" in capsys.readouterr().err

    # a crash: the step-2 checkpoint cut short and the metrics line being written cut off
    (out / "checkpoint.pt").write_bytes(files["checkpoint.pt"][:5000])
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 3, "accura')
    assert cli.main(train_argv(tmp, 3, "--ckpt.load_enable", "--eval.steps", "3")) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl:4: dropped a truncated last line" in err
    assert "checkpoint.pt: unreadable" in err and "resuming from" in err and "checkpoint.prev.pt (step 1)" in err
    # the safe ones pass, reported
    assert "resuming with changed flags: --ckpt.save_steps 1 -> -1, --eval.steps 2 -> 3, --train.steps 2 -> 3" in err
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    same_numbers(rows[2], first[2])  # step 2 again from the step-1 checkpoint: the same numbers

    assert cli.main(train_argv(tmp, 1, "--ckpt.overwrite")) == 0
    replaced = "checkpoint.prev.pt, checkpoint.pt, checkpoint.pt.bad, metrics.jsonl, model"
    assert f"replacing the earlier run in {out}: {replaced}\n" in capsys.readouterr().err  # named, then replaced
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [0, 1]
    assert not (out / "checkpoint.prev.pt").exists() and not (out / "checkpoint.pt.bad").exists()


def test_overwrite_refuses_a_directory_no_run_wrote_and_deletes_nothing(setup, capsys):
    """--ckpt.overwrite deleted model/, tensorboard/ and metrics.jsonl of a directory that never held a run."""
    out = setup / "out"
    for name in ("model/my_weights.bin", "tensorboard/events.mine", "metrics.jsonl", "keep.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    before = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file())
    assert cli.main(train_argv(setup, 1, "--ckpt.overwrite")) == 1
    err = capsys.readouterr().err
    assert f"--ckpt.output_dir {out} holds files no run wrote (keep.txt, metrics.jsonl, model, tensorboard)" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) == before


def test_an_output_dir_holding_or_inside_an_input_is_refused_and_the_input_kept(setup, capsys):
    """--actor.model_name_or_path DIR/model --ckpt.output_dir DIR --ckpt.overwrite deleted DIR/model at the start."""
    out = setup / "out"
    build_model(build_tokenizer(), hidden_size=32, num_layers=1, num_heads=2).save_pretrained(out / "model")
    build_tokenizer().save_pretrained(out / "model")
    before = sorted((p.name, p.read_bytes()) for p in (out / "model").iterdir())
    capsys.readouterr()  # save_pretrained's progress bar
    argv = with_model(train_argv(setup, 1, "--ckpt.overwrite"), out / "model")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--ckpt.output_dir {out} holds --actor.model_name_or_path {out / 'model'}: a run there would" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted((p.name, p.read_bytes()) for p in (out / "model").iterdir()) == before
    for name in ("data/train.jsonl", "r/reward.py"):
        (setup / name).parent.mkdir()
        (setup / name).write_bytes((setup / Path(name).name).read_bytes())
    refusals = [  # (output directory, the input flag, its value, how the message relates them)
        (setup / "data", "--data.prompt_dataset", setup / "data" / "train.jsonl", "holds"),
        (setup / "r" / "x" / "..", "--reward.func", setup / "r" / "reward.py", "holds"),
        (setup / "tok", "--actor.tokenizer", setup / "tok", "is"),
        (setup / "tok" / "run", "--actor.tokenizer", setup / "tok", "is inside"),
        (setup, "--actor.config", setup / "cfg" / "config.json", "holds"),
    ]
    for output, flag, value, relation in refusals:
        argv = train_argv(setup, 1, flag, str(value), "--ckpt.output_dir", str(output))
        assert cli.main(argv) == 2
        assert f"--ckpt.output_dir {output} {relation} {flag} {value}: a run there" in capsys.readouterr().err


def test_resume_without_a_checkpoint_needs_an_empty_dir(setup, capsys):
    tmp, out = setup, setup / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert cli.main(train_argv(tmp, 1, "--ckpt.load_enable")) == 1
    assert f"--ckpt.output_dir {out} holds files no run wrote (metrics.jsonl)" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert cli.main(train_argv(tmp, 1, "--ckpt.load_enable", "--ckpt.output_dir", str(tmp / "empty"))) == 0
    assert "no checkpoint in" in capsys.readouterr().err


def test_a_checkpoint_that_does_not_fit_the_model_is_named(setup, capsys):
    assert cli.main(train_argv(setup, 1)) == 0
    config = json.loads((setup / "cfg" / "config.json").read_text())
    (setup / "cfg" / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))  # same path, other model
    assert cli.main(train_argv(setup, 2, "--ckpt.load_enable")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"openrlhf-geo train: {setup / 'out' / 'checkpoint.pt'}: its state does not fit this model")


def test_non_finite_weights_stop_the_run_and_keep_the_last_good_checkpoint(setup, capsys, monkeypatch):
    step = engine.Trainer.step

    def poisoned(self):
        row = step(self)
        if self.global_step == 2:
            with torch.no_grad():
                next(self.model.parameters())[0, 0] = float("nan")
        return row

    monkeypatch.setattr(engine.Trainer, "step", poisoned)
    out = setup / "out"
    assert cli.main(train_argv(setup, 3, "--ckpt.save_steps", "1", "--eval.steps", "-1")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("openrlhf-geo train: step 2: model.") and "holds NaN/inf; not writing" in err
    assert rundir.load_checkpoint(out)["step"] == 1 and not (out / "model").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--salt.base", "rloo"], "supports --salt.base group_norm or dr_grpo"),
        (["--salt.diagnostics", "--advantage_estimator", "salt"], "--salt.diagnostics is for runs without SALT"),
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


def with_model(argv, path):
    """`argv` loading the model directory `path` in place of --actor.config and --actor.tokenizer."""
    i = argv.index("--actor.config")
    return [*argv[:i], "--actor.model_name_or_path", str(path), *argv[i + 4 :]]


BAD_LINES = {
    "json": b'{"question": "1+1=", "label": "2"}\n{"q\n',
    "utf8": b'{"question": "1+1=", "label": "\xff"}\n',
    "null": b'{"question": "1+1=", "label": null}\n',
    "field": b'{"label": "2"}\n',
}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data.prompt_dataset", "{t}/json.jsonl"], "--data.prompt_dataset {t}/json.jsonl:2: not JSON"),
        (["--eval.dataset", "{t}/utf8.jsonl"], "--eval.dataset {t}/utf8.jsonl:1: not UTF-8 (byte 0xff at column 32)"),
        (["--data.prompt_dataset", "{t}/null.jsonl"], "null.jsonl:1: 'label' must be a string or number (got null)"),
        (["--data.prompt_dataset", "{t}/field.jsonl"], "field.jsonl:1: no 'question' field (--data.input_key"),
        (["--data.prompt_dataset", "{t}/no.jsonl"], "--data.prompt_dataset {t}/no.jsonl: No such file"),
        (["--actor.config", "{t}/no/config.json"], "--actor.config {t}/no/config.json: no such file or directory"),
        (["--actor.model_name_or_path", "./no/model"], "--actor.model_name_or_path ./no/model: no such file or"),
        (["--ckpt.output_dir", "{t}/train.jsonl"], "--ckpt.output_dir {t}/train.jsonl: is a file"),
        (["--ckpt.output_dir", "{t}/train.jsonl/x"], "{t}/train.jsonl/x: cannot write there (Not a directory)"),
        (["--ckpt.output_dir", ""], "--ckpt.output_dir is empty: name the run's directory"),  # not the cwd
        (["--rollout.temperature", "inf"], "--rollout.temperature must be a finite number (got inf)"),
        (["--rollout.temperature", "nan"], "--rollout.temperature must be a finite number (got nan)"),
        (["--rollout.temperature", "0"], "--rollout.temperature must be > 0 (got 0.0)"),
        (["--rollout.temperature", "-1"], "--rollout.temperature must be > 0 (got -1.0)"),
        (["--actor.adam.lr", "inf"], "--actor.adam.lr must be a finite number (got inf)"),
        (["--eval.n_samples_per_prompt", "0"], "--eval.n_samples_per_prompt must be >= 1 (got 0)"),
        (["--salt.dim", "50"], "--salt.dim must be a perfect square >= 16 (got 50)"),
        (["--geoalign.enable", "--geoalign.projector.steps", "2.5"], "projector.steps: invalid int value: '2.5'"),
        (["--geoalign.enable", "--geoalign.projector.steps", "1e3"], "projector.steps: invalid int value: '1e3'"),
        (["--rollout.temprature", "0.5"], "(did you mean --rollout.temperature?)"),
        (["--diagnostics.dim", "64"], "unrecognized arguments: --diagnostics.dim 64 (did you mean --salt.dim?)"),
        (["--train.device", "gpu"], "--train.device 'gpu': not a device"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag_file_or_value(setup, capsys, extra, message):
    for name, data in BAD_LINES.items():
        (setup / f"{name}.jsonl").write_bytes(data)
    extra = [x.format(t=setup) for x in extra]
    argv = train_argv(setup, 1, *extra)
    if "--actor.model_name_or_path" in extra:
        argv = with_model(argv[: -len(extra)], extra[1])
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert err.startswith("openrlhf-geo train: ") and len(err.strip().splitlines()) == 1, err
    assert message.format(t=setup) in err
    if "dataset" in message:
        assert not (setup / "out").exists()  # inputs are checked before the output dir is touched


BAD_REWARDS = {
    "strings": ("def reward_func(queries, prompts, labels):\n    return ['1'] * len(queries)\n",
                "reward_func returned ['1', '1', '1', '1', '1', '1', ...]: expected 12 numbers"),
    "count": ("def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0, 0.0]}\n",
              "reward_func returned 2 rewards for 12 responses"),
    "raises": ("def reward_func(queries, prompts, labels):\n    return 1 / 0\n",
               "reward_func raised ZeroDivisionError: division by zero"),
    "syntax": ("def reward_func(queries, prompts, labels)\n    return []\n",
               "cannot load it: SyntaxError: expected ':' (syntax.py, line 1)"),
    "import": ("import no_such_module_here\n", "cannot load it: ModuleNotFoundError: No module named"),
    # a SystemExit was the run's exit status (3), with nothing said
    "exits": ("def reward_func(queries, prompts, labels):\n    raise SystemExit(3)\n",
              "reward_func raised SystemExit: 3"),
    "exits on load": ("import sys\nsys.exit(3)\n", "cannot load it: SystemExit: 3"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_REWARDS))
def test_a_broken_reward_file_is_one_line_naming_flag_file_function_and_what_it_did(setup, capsys, name):
    """A reward returning strings failed with torch's "too many dimensions 'str'"; a syntax error or a raising
    function printed a traceback."""
    code, message = BAD_REWARDS[name]
    (setup / f"{name}.py").write_text(code)
    assert cli.main(train_argv(setup, 1, "--reward.func", str(setup / f"{name}.py"))) != 0
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the progress bar of a run the error stopped
    assert "Traceback" not in err and line.startswith(f"openrlhf-geo train: --reward.func {setup / name}.py: ")
    assert message in line, err


def test_an_interrupt_inside_the_reward_function_names_it(setup, capsys):
    (setup / "interrupt.py").write_text("def reward_func(queries, prompts, labels):\n    raise KeyboardInterrupt\n")
    assert cli.main(train_argv(setup, 1, "--reward.func", str(setup / "interrupt.py"))) == 130
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert line.startswith(f"openrlhf-geo train: interrupted in --reward.func {setup / 'interrupt.py'}: reward_func;")


def test_zero_steps_names_only_what_it_wrote(setup, capsys):
    assert cli.main(train_argv(setup, 0, "--eval.steps", "-1")) == 0
    out = setup / "out"
    assert not (out / "metrics.jsonl").exists()
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {out / 'checkpoint.pt'} and {out / 'model'}"


def test_train_never_imports_deepspeed(setup):
    """A local run (here 0 steps: build, checkpoint, save the model) in a fresh process leaves DeepSpeed unimported:
    transformers' save_pretrained unwraps through accelerate, which imports it when installed, and its import prints
    "Setting accelerator to CPU" after the run."""
    code = (
        "import sys\n"
        "from openrlhf_geo import cli\n"
        f"assert cli.main({train_argv(setup, 0, '--eval.steps', '-1')!r}) == 0\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'deepspeed'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]" and "Setting accelerator" not in done.stderr


def test_misspecified_noise_is_not_offered_by_train_and_refused_before_anything_is_written(setup, capsys):
    """It needs a task hook that says which wrong answers the verifier pays (the studies' task); train has none."""
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "misspecified" not in capsys.readouterr().out
    argv = train_argv(setup, 1, "--reward.noise.type", "misspecified", "--reward.noise.rate", "0.2")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "openrlhf-geo study geoalign-failure" in err
    assert not (setup / "out").exists()


def test_tensorboard_and_offline_wandb_log_upstream_names_with_one_progress_bar(setup, capsys, monkeypatch):
    """A pretrained model directory, so transformers would show its own "Loading weights" bar if not silenced."""
    from openrlhf_geo.eval.report import read_tensorboard

    tmp = setup
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    capsys.readouterr()  # the bars of that save_pretrained
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    assert cli.main(with_model(train_argv(tmp, 2, "--use_tensorboard", "--use_wandb"), tmp / "model")) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err and "train:" in err

    out = tmp / "out"
    curves = read_tensorboard(out / "tensorboard")
    rows = read_rows(out / "metrics.jsonl")
    assert curves["train/accuracy"][0].tolist() == [1, 2] and curves["eval/accuracy"][0].tolist() == [0, 2]
    torch.testing.assert_close(curves["train/loss"][1].tolist(), [r["loss"] for r in rows[1:]])
    assert "train/step" not in curves and not any(tag.startswith("train/eval/") for tag in curves)
    (record,) = out.glob("wandb/offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert b"train/accuracy" in data and b"eval/accuracy" in data and b"train/global_step" in data


def test_demo_quick_writes_report_metrics_and_plots(tmp_path):
    assert cli.main(["demo", "--quick", "--out", str(tmp_path), "--workers", "1"]) == 0
    report = (tmp_path / "report.md").read_text()
    for section in ("## Final held-out accuracy", "## Paired differences", "## GeoAlign detection"):
        assert section in report
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["methods"]) == {"grpo", "salt", "grpo_noise", "geoalign_noise"}
    runs = tmp_path / "runs"
    for method in summary["methods"]:
        rows = [r for r in read_rows(runs / method / "seed0" / "metrics.jsonl") if r["step"] > 0]
        assert rows and all(r["method"] == method for r in rows)
        if method in ("grpo", "salt"):  # GRPO logs the geometry of its own advantages (--salt.diagnostics)
            assert all("salt/n_eff_out" in r and "salt/n_eff_in" in r for r in rows)
        if method == "geoalign_noise":
            assert all("geo/val_acc" in r and "geo/skipped_reason" in r for r in rows)
    for name in ("eval_accuracy", "salt_pr", "salt_n_eff_in", "salt_alpha", "gdi_geoalign_noise"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "sft" / "sft.json").read_text())["steps"] >= 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0"], "--seeds must be >= 1 (got 0)"),
        (["--workers", "0"], "--workers must be >= 1 (got 0)"),
        (["--sft-target", "1.5"], "--sft-target must be an accuracy in (0, 1]"),
        (["--out", "{file}"], "--out {file}: File exists"),
        (["--stpes", "3"], "did you mean --steps?"),
    ],
)
def test_demo_misuse_is_a_one_line_error_before_any_work(tmp_path, capsys, argv, message):
    file = tmp_path / "a_file"
    file.write_text("x")
    argv = [a.replace("{file}", str(file)) for a in argv]
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.replace("{file}", str(file)) in err
    assert not (tmp_path / "sft").exists()


def test_the_readme_local_engine_command_generates_as_long_as_the_demo_needs():
    """The README's command continues from the demo's SFT model; at the default --rollout.max_new_tokens (16) every
    response was cut before its answer (the demo's need 48), so it trained on zero rewards."""
    import re
    import shlex
    from pathlib import Path

    from openrlhf_geo.local.flags import parse_args

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (command,) = re.findall(r"openrlhf-geo train --actor\.model_name_or_path runs/demo/sft[^`]*?(?=\n```)", readme)
    args = parse_args(shlex.split(command.replace("\\\n", " "))[2:])
    assert args.rollout.max_new_tokens >= recipe.MAX_NEW_TOKENS


@pytest.mark.parametrize(
    "argv",
    ["--advantage_estimator salt --algo.advantage.estimator group_norm", "--algo.advantage.estimator group_norm "
     "--advantage_estimator salt"],
)  # fmt: skip
def test_the_two_estimator_spellings_given_different_values_are_refused(argv):
    """argparse kept the last: `--advantage_estimator salt ... --algo.advantage.estimator group_norm` trained GRPO
    under a SALT label (the fork's parser alike: tests/test_fork_parse.py)."""
    from openrlhf_geo.local.flags import parse_args

    first, first_value, second, second_value = argv.split()
    with pytest.raises(ValueError) as refused:
        parse_args(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d.jsonl", *argv.split()])
    assert str(refused.value) == (
        f"{first} {first_value} and {second} {second_value}: one setting given two values (the last would silently "
        "win); give it once"
    )
    same = parse_args(["--actor.config", "c.json", "--actor.tokenizer", "t", "--data.prompt_dataset", "d.jsonl",
                       "--advantage_estimator", "salt", "--algo.advantage.estimator", "salt"])  # fmt: skip
    assert same.salt.enable and same.algo.advantage.estimator == "group_norm"


def test_a_default_spelled_out_is_no_change_on_resume(setup):
    from openrlhf_geo.local.flags import build_parser, check_resume_config, parse_args, run_config

    argv = train_argv(setup, 2)[1:]
    checkpoint = {"config": run_config(parse_args(argv)), "path": setup / "out" / rundir.CHECKPOINT}
    spelled = parse_args([*argv, "--salt.k_rule", "paper", "--salt.base", "group_norm", "--salt.variant", "full"])
    check_resume_config(build_parser(), checkpoint, run_config(spelled))  # no refusal
    changed = run_config(parse_args([*argv, "--salt.k_rule", "code"]))
    with pytest.raises(ValueError, match=r"the training: --salt.k_rule 'paper' -> 'code'\. Resume"):
        check_resume_config(build_parser(), checkpoint, changed)


def test_an_unreadable_checkpoint_with_load_enable_and_overwrite_gets_advice_that_applies(setup, capsys):
    out = setup / "out"
    out.mkdir()
    (out / rundir.CHECKPOINT).write_bytes(b"not a checkpoint")
    assert cli.main(train_argv(setup, 1, "--ckpt.load_enable", "--ckpt.overwrite")) == 1
    err = capsys.readouterr().err
    assert "checkpoint.pt: unreadable" in err and len(err.strip().splitlines()) == 1, err
    assert "Restore a copy, or start over: run without --ckpt.load_enable, with --ckpt.overwrite" in err
    assert (out / rundir.CHECKPOINT).read_bytes() == b"not a checkpoint"
