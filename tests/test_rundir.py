"""The run directory: claiming and locking it, crash-safe checkpoints, log trimming, resume flag checks, loggers."""

import errno
import json
import math
import os
import random
import subprocess
import sys
import types

import pytest
import torch

from openrlhf_geo import options
from openrlhf_geo.local import rundir, tracking


def fake_state(step=3, seed=0):
    """Shaped like Trainer.state_dict(): weights, optimizer state, RNG states and plain Python data."""
    g = torch.Generator().manual_seed(seed)
    return {
        "global_step": step,
        "model": {"embed.weight": torch.randn(8, 4, generator=g), "head.bias": torch.randn(8, generator=g)},
        "optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(8, 4, generator=g)}}},
        "sampler": {"rng": random.Random(seed).getstate(), "order": [2, 0, 1], "cursor": 1},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": None,
    }


def assert_same(a, b):
    assert type(a) is type(b) or {type(a), type(b)} <= {list, tuple}, (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------- claiming the directory


def test_claim_starts_fresh_in_a_missing_or_empty_directory(tmp_path):
    with rundir.claim(tmp_path / "new") as resuming:
        assert resuming is False
        assert (tmp_path / "new" / rundir.LOCK).read_text() == f"pid {os.getpid()}\n"
    with rundir.claim(tmp_path / "new") as resuming:  # only the lock file in it: still empty
        assert resuming is False


def test_claim_refuses_a_used_directory_unless_resuming_or_overwriting(tmp_path):
    with rundir.claim(tmp_path):  # a run's record, then its first log
        (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(
        ValueError, match=r"already holds a run \(metrics.jsonl, run.json\).*--ckpt.load_enable.*--ckpt.overwrite"
    ):
        with rundir.claim(tmp_path):
            pass
    with pytest.raises(ValueError, match="--ckpt.load_enable: .* has no checkpoint to resume but holds a run"):
        with rundir.claim(tmp_path, resume=True):
            pass
    with rundir.claim(tmp_path, overwrite=True) as resuming:
        assert resuming is False
    assert (tmp_path / "metrics.jsonl").exists()  # claim decides; only clear_run deletes
    rundir.save_checkpoint(tmp_path, fake_state())
    with rundir.claim(tmp_path, resume=True) as resuming:
        assert resuming is True


@pytest.mark.parametrize("overwrite", [False, True])
def test_files_no_run_wrote_are_named_as_such_and_refused_even_with_overwrite(tmp_path, overwrite):
    """One user file was called "a run"; --ckpt.overwrite deleted a user's model/, tensorboard/ and metrics.jsonl."""
    names = ["keep.txt", "metrics.jsonl", "model", "tensorboard"]
    for name in ("keep.txt", "metrics.jsonl", "model/my_weights.bin", "tensorboard/events.mine"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("mine")
    for resume in (False, True):
        with pytest.raises(ValueError, match=f"{tmp_path} holds files no run wrote \\({', '.join(names)}\\)") as e:
            with rundir.claim(tmp_path, resume=resume, overwrite=overwrite):
                pass
        assert "a run" not in str(e.value).split("wrote")[0]
    with rundir.claim(tmp_path / "run"):
        (tmp_path / "run" / "keep.txt").write_text("mine")  # a user's file beside a run's
        (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"holds files no run wrote \(keep.txt\)"):
        with rundir.claim(tmp_path / "run", overwrite=overwrite):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, "run"])
    assert (tmp_path / "model" / "my_weights.bin").read_text() == "mine"


def test_a_studys_command_file_beside_a_run_is_neither_refused_nor_deleted(tmp_path):
    """A study writes study.json in a run's directory before the run starts (lab/studies)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "study.json").write_text('{"argv": []}')
    with rundir.claim(run):
        (run / "metrics.jsonl").write_text("")
    with rundir.claim(run, overwrite=True):
        rundir.clear_run(run)
    assert sorted(p.name for p in run.iterdir() if p.name != rundir.LOCK) == [rundir.RECORD, "study.json"]


def test_a_fresh_start_writes_the_run_record_and_takes_it_back_when_nothing_else_was_written(tmp_path):
    with pytest.raises(RuntimeError):
        with rundir.claim(tmp_path / "run"):
            assert (tmp_path / "run" / rundir.RECORD).exists()
            raise RuntimeError("a failed start")
    assert not (tmp_path / "run").exists()
    with pytest.raises(RuntimeError):
        with rundir.claim(tmp_path / "run"):
            (tmp_path / "run" / "metrics.jsonl").write_text("")
            raise RuntimeError("a failed step")
    assert rundir.run_files(tmp_path / "run") == (["metrics.jsonl", rundir.RECORD], [])


def test_clear_run_deletes_and_names_only_what_the_record_lists_and_this_code_writes(tmp_path, capsys):
    with rundir.claim(tmp_path):
        pass
    record = json.loads((tmp_path / rundir.RECORD).read_text())
    assert record["paths"] == list(rundir.RUN_FILES)
    for name in ("metrics.jsonl", "checkpoint.pt", "checkpoint.pt.bad", "checkpoint.pt.bad.1", "wandb", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    rundir.clear_run(tmp_path)
    shown = "checkpoint.pt, checkpoint.pt.bad, checkpoint.pt.bad.1, metrics.jsonl, model"
    assert capsys.readouterr().err == f"replacing the earlier run in {tmp_path}: {shown}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [rundir.LOCK, "notes.txt", rundir.RECORD, "wandb"]
    (tmp_path / rundir.RECORD).write_text(json.dumps({"paths": ["*", "notes.txt"]}))  # a record never widens it
    rundir.clear_run(tmp_path)
    assert (tmp_path / "notes.txt").exists() and capsys.readouterr().err == ""


def test_an_older_versions_run_without_a_record_is_recognised_by_its_checkpoint(tmp_path):
    rundir.save_checkpoint(tmp_path, fake_state())
    (tmp_path / "metrics.jsonl").write_text("")
    assert rundir.run_files(tmp_path) == (["checkpoint.pt", "metrics.jsonl"], [])
    (tmp_path / "checkpoint.pt").unlink()
    assert rundir.run_files(tmp_path) == ([], ["metrics.jsonl"])


def test_resume_without_a_checkpoint_in_an_empty_directory_starts_fresh_with_a_notice(tmp_path, capsys):
    with rundir.claim(tmp_path / "run", resume=True) as resuming:
        assert resuming is False
    assert "no checkpoint in" in capsys.readouterr().err


def test_claim_names_an_output_path_that_is_a_file_or_under_one(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--ckpt.output_dir .*file: is a file"):
        with rundir.claim(tmp_path / "file"):
            pass
    with pytest.raises(ValueError, match=r"--ckpt.output_dir .*file/run: cannot write there \(Not a directory\)"):
        with rundir.claim(tmp_path / "file" / "run"):
            pass


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_claim_names_an_unwritable_output_directory(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot write there"):
        with rundir.claim(tmp_path / "ro" / "run"):
            pass


def test_a_second_run_on_the_same_directory_is_refused_while_the_first_holds_it(tmp_path):
    with rundir.claim(tmp_path):
        with pytest.raises(ValueError, match=f"another run is writing it \\(pid {os.getpid()}\\)"):
            with rundir.claim(tmp_path):
                pass
    with rundir.claim(tmp_path):  # released at exit
        pass


def test_a_lock_file_that_cannot_be_used_is_named_with_the_flag_and_folder_not_as_another_run(tmp_path, monkeypatch):
    """No permission on the lock file was refused as "another run is writing it"; a lock file that is a symbolic
    link to nothing made the claim loop forever (run in a child process, killed if it does not return)."""
    (tmp_path / "dir" / rundir.LOCK).mkdir(parents=True)
    with pytest.raises(ValueError, match=f"--ckpt.output_dir {tmp_path / 'dir'}: cannot write there \\(.lock: Is a"):
        with rundir.claim(tmp_path / "dir"):
            pass
    with pytest.raises(rundir.OutputClaimed, match=f"--out {tmp_path / 'dir'}: .lock: Is a directory"):
        with rundir.claim_output(tmp_path / "dir", "cmd"):
            pass
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / rundir.LOCK).symlink_to(tmp_path / "nothing")
    claim = "from openrlhf_geo.local import rundir; import sys\nwith rundir.claim(sys.argv[1]): pass"
    child = subprocess.Popen([sys.executable, "-c", claim, str(tmp_path / "link")], stderr=subprocess.PIPE, text=True)
    try:
        err = child.communicate(timeout=120)[1]
    finally:
        child.kill()
        child.wait()
    assert "cannot write there (.lock: a symbolic link to nothing)" in err
    assert not (tmp_path / "nothing").exists()

    def denied(path, blocking=True):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(rundir.lockfile, "lock", denied)
    with pytest.raises(ValueError, match=r"dir: cannot write there \(.lock: Permission denied\)"):
        with rundir.claim(tmp_path / "dir"):
            pass


def test_the_lock_holds_against_another_process_and_dies_with_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); f.write('pid x\\n'); f.flush();"
         " fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(tmp_path / rundir.LOCK)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another run is writing it"):
            with rundir.claim(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with rundir.claim(tmp_path) as resuming:  # a killed run leaves its lock file, not its lock
        assert resuming is False


def test_clear_run_deletes_only_what_an_older_versions_run_wrote(tmp_path):
    for name in ("metrics.jsonl", "gdi.jsonl", "checkpoint.pt", "checkpoint.prev.pt", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    rundir.clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_keeps_the_state_config_and_the_previous_one(tmp_path):
    first, second = fake_state(step=1, seed=1), fake_state(step=2, seed=2)
    rundir.save_checkpoint(tmp_path, first, {"train.steps": 5})
    rundir.save_checkpoint(tmp_path, second, {"train.steps": 5})
    loaded = rundir.load_checkpoint(tmp_path)
    assert loaded["step"] == 2 and loaded["config"] == {"train.steps": 5}
    assert loaded["path"] == tmp_path / rundir.CHECKPOINT
    assert_same(loaded["state"], second)
    assert_same(rundir.read_checkpoint(tmp_path / rundir.PREVIOUS)["state"], first)
    assert {p.name for p in tmp_path.iterdir()} == {rundir.CHECKPOINT, rundir.PREVIOUS}  # no temp file left


def _corrupt(path, how, rng):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: rng.randrange(len(data))]
    elif how == "bitflip":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_a_damaged_newest_checkpoint_is_never_loaded_silently(tmp_path, capsys, how):
    """Over many damage positions the loader either falls back to the previous checkpoint (with a warning) or, when
    the damage left every value intact (zip padding, unused header bytes), loads exactly what was written."""
    rng = random.Random(0)
    previous, newest = fake_state(step=1, seed=1), fake_state(step=2, seed=2)
    for trial in range(60):
        run = tmp_path / f"run{trial}"
        run.mkdir()
        rundir.save_checkpoint(run, previous)
        rundir.save_checkpoint(run, newest)
        _corrupt(run / rundir.CHECKPOINT, how, rng)
        loaded = rundir.load_checkpoint(run)
        err = capsys.readouterr().err
        if loaded["step"] == 1:
            assert_same(loaded["state"], previous)
            assert f"{run / rundir.CHECKPOINT}:" in err and "resuming from" in err
            assert (run / f"{rundir.CHECKPOINT}.bad").exists() and not (run / rundir.CHECKPOINT).exists()
        else:
            assert_same(loaded["state"], newest)
    assert how == "bitflip" or len(list(tmp_path.glob("*/*.bad"))) == 60  # every truncation is caught


def test_a_second_fallback_keeps_the_bad_checkpoint_the_first_one_kept(tmp_path, capsys):
    """The second fallback's checkpoint.pt.bad replaced the first one's."""
    for damage, steps in ((b"first damage", (1, 2)), (b"second damage", (3, 4))):
        for step in steps:
            rundir.save_checkpoint(tmp_path, fake_state(step=step))
        (tmp_path / rundir.CHECKPOINT).write_bytes(damage)
        assert rundir.load_checkpoint(tmp_path)["step"] == steps[0]
    assert "moved it to checkpoint.pt.bad.1 and resuming from" in capsys.readouterr().err
    assert (tmp_path / "checkpoint.pt.bad").read_bytes() == b"first damage"
    assert (tmp_path / "checkpoint.pt.bad.1").read_bytes() == b"second damage"


def test_flipped_tensor_bytes_are_detected_by_the_digest(tmp_path):
    """torch's zip reader does not check CRCs: a flipped bit inside a tensor's bytes loads unless digested."""
    state = fake_state()
    state["model"]["embed.weight"] = torch.full((64, 64), 0.5)
    rundir.save_checkpoint(tmp_path, state)
    path = tmp_path / rundir.CHECKPOINT
    data = bytearray(path.read_bytes())
    pattern = torch.full((64,), 0.5).numpy().tobytes()
    data[data.index(pattern) + 100] ^= 0x10
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["state"]["model"]["embed.weight"].ne(0.5).sum() == 1  # loads silently
    with pytest.raises(rundir.CheckpointError, match="checkpoint.pt: corrupted .* digest"):
        rundir.read_checkpoint(path)


class Foreign:
    pass


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda p: p.write_bytes(b""), "unreadable: truncated, corrupted or not a checkpoint"),
        (lambda p: p.write_bytes(b"not a checkpoint at all"), "unreadable: truncated, corrupted or not a checkpoint"),
        (lambda p: torch.save({"x": Foreign()}, p), "holds objects other than tensors and plain data"),
        (lambda p: torch.save({"weight": torch.zeros(2)}, p), r"not an openrlhf-geo checkpoint \(keys \['weight'\]\)"),
        (lambda p: torch.save([1, 2], p), "not an openrlhf-geo checkpoint"),
        (lambda p: torch.save({"format": rundir.FORMAT, "version": 99}, p), "checkpoint version 99"),
    ],
)
def test_unusable_checkpoints_give_an_error_naming_the_file(tmp_path, write, message):
    write(tmp_path / rundir.CHECKPOINT)
    with pytest.raises(rundir.CheckpointError, match=message) as error:
        rundir.load_checkpoint(tmp_path)
    assert str(tmp_path / rundir.CHECKPOINT) in str(error.value) and "weights_only" not in str(error.value)


def test_a_plain_trainer_state_dict_loads_without_flags(tmp_path):
    state = fake_state()
    torch.save(state, tmp_path / rundir.CHECKPOINT)  # what Trainer.save_checkpoint writes
    loaded = rundir.load_checkpoint(tmp_path)
    assert loaded["config"] is None and loaded["step"] == 3
    assert_same(loaded["state"], state)


def test_a_missing_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    rundir.save_checkpoint(tmp_path, fake_state(step=1))
    rundir.save_checkpoint(tmp_path, fake_state(step=2))
    (tmp_path / rundir.CHECKPOINT).unlink()  # a kill between the two renames
    assert rundir.load_checkpoint(tmp_path)["step"] == 1
    assert "is missing" in capsys.readouterr().err


def test_a_kill_while_writing_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    rundir.save_checkpoint(tmp_path, fake_state(step=1, seed=1))
    before = (tmp_path / rundir.CHECKPOINT).read_bytes()

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        rundir.save_checkpoint(tmp_path, fake_state(step=2, seed=2))
    assert (tmp_path / rundir.CHECKPOINT).read_bytes() == before
    monkeypatch.undo()
    assert rundir.load_checkpoint(tmp_path)["step"] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_never_written(tmp_path, bad):
    rundir.save_checkpoint(tmp_path, fake_state(step=1))
    before = (tmp_path / rundir.CHECKPOINT).read_bytes()
    state = fake_state(step=2)
    state["model"]["head.bias"][3] = bad
    with pytest.raises(rundir.CheckpointError, match=r"step 2: model\.head\.bias holds NaN/inf; not writing"):
        rundir.save_checkpoint(tmp_path, state)
    assert (tmp_path / rundir.CHECKPOINT).read_bytes() == before
    assert not (tmp_path / rundir.PREVIOUS).exists()


def test_find_nonfinite_checks_only_floating_tensors():
    tree = {"a": [torch.tensor([1, 2]), {"b": torch.tensor([0.0, 1.0])}], "c": 3.0}
    assert rundir.find_nonfinite(tree) is None
    tree["a"][1]["b"][1] = float("nan")
    assert rundir.find_nonfinite(tree) == "a.1.b"


# ---------------------------------------------------------------- logs


def test_trim_keeps_rows_up_to_the_step_and_drops_a_truncated_last_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "a": 1}\n\n{"step": 2}\n{"step": 3, "a": 0.')
    rundir.trim_jsonl(path, 1)
    assert path.read_text() == '{"step": 0}\n{"step": 1, "a": 1}\n'
    assert f"{path}:5: dropped a truncated last line" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, line, message",
    [
        ('{"step": 0}\n{"step": 1, "a": 0.\n{"step": 2}\n', 2, "not a JSON line"),  # cut off, then written on
        ('{"step": 0}\n{"step": 1\n', 2, "not a JSON line"),  # ends in a newline: not a cut-off write
        ('{"step": 0}\n[1, 2]\n', 2, "expected a JSON object with an integer 'step'"),
        ('{"acc": 0.5}\n', 1, "expected a JSON object with an integer 'step'"),
        (b'{"step": 0}\n{"step": 1, "x": "\xff"}\n', 2, "not a JSON line"),
    ],
)
def test_trim_names_file_and_line_of_a_malformed_row(tmp_path, text, line, message):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"metrics.jsonl:{line}: {message}"):
        rundir.trim_jsonl(path, 5)


# ---------------------------------------------------------------- flags


def test_flag_config_flattens_the_namespace_and_changes_split_into_safe_and_unsafe():
    args = types.SimpleNamespace(
        train=types.SimpleNamespace(steps=5, seed=1, threads=None),
        actor=types.SimpleNamespace(adam=types.SimpleNamespace(betas=(0.9, 0.95))),
    )
    old = options.flag_config(args)
    assert old == {"train.steps": 5, "train.seed": 1, "train.threads": None, "actor.adam.betas": [0.9, 0.95]}
    new = {**old, "train.steps": 9, "train.threads": 2, "train.seed": 2, "salt.new_flag": 1}
    safe, unsafe = rundir.config_changes(old, new)
    assert safe == [("salt.new_flag", rundir.ABSENT, 1), ("train.steps", 5, 9), ("train.threads", None, 2)]
    assert unsafe == [("train.seed", 1, 2)]
    assert rundir.config_changes(old, old) == ([], [])


# ---------------------------------------------------------------- loggers


def test_rows_split_into_upstream_train_and_eval_names_skipping_non_numbers():
    row = {"step": 4, "method": "salt", "seed": 1, "accuracy": 0.5, "salt/pr": 2, "eval/accuracy": 0.25}
    row.update({"flag": True, "missing": None, "texts": ["a"], "nan": float("nan")})
    train, evaluation = tracking.split_row(row)
    assert math.isnan(train.pop("train/nan"))  # a NaN is a number (TensorBoard and wandb show it as a gap)
    assert train == {"train/seed": 1.0, "train/accuracy": 0.5, "train/salt/pr": 2.0}
    assert evaluation == {"eval/accuracy": 0.25}


def test_tensorboard_logger_round_trips_through_the_report_reader_and_purges_on_resume(tmp_path):
    from openrlhf_geo.eval.report import read_tensorboard

    logger = tracking.TensorboardLogger(tmp_path / "tb")
    for step in range(4):
        logger.log(step, {"step": step, "accuracy": step / 10, "method": "x", "eval/accuracy": 1 - step / 10})
    logger.close()
    resumed = tracking.TensorboardLogger(tmp_path / "tb", resume_step=2)  # the checkpoint was at step 2
    for step in (3, 4):
        resumed.log(step, {"step": step, "accuracy": 1 + step})
    resumed.close()
    curves = read_tensorboard(tmp_path)
    assert sorted(curves) == ["eval/accuracy", "train/accuracy"]
    steps, values = curves["train/accuracy"]
    assert steps.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(values.tolist(), [0.0, 0.1, 0.2, 4.0, 5.0])
    assert curves["eval/accuracy"][0].tolist() == [0, 1, 2]  # step 3's old eval value was purged


def test_wandb_logger_uses_upstream_step_metrics(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(
        define_metric=lambda *a, **k: calls.append(("define", a, k)),
        log=lambda d: calls.append(("log", d)),
        finish=lambda: calls.append(("finish",)),
    )
    fake = types.SimpleNamespace(init=lambda **k: calls.append(("init", k)) or run, login=None, Error=RuntimeError)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = tracking.WandbLogger(tmp_path, {"train.steps": 3}, "proj")
    logger.log(2, {"step": 2, "accuracy": 0.5, "method": "salt", "eval/accuracy": 0.75})
    logger.close()
    init = calls[0][1]
    assert init["project"] == "proj" and init["config"] == {"train.steps": 3} and init["dir"] == str(tmp_path)
    assert init["id"] == (tmp_path / "wandb" / "run_id").read_text().strip()
    assert ("define", ("train/*",), {"step_metric": "train/global_step", "step_sync": True}) in calls
    assert ("log", {"train/accuracy": 0.5, "train/global_step": 2}) in calls
    assert ("log", {"eval/accuracy": 0.75, "eval/global_step": 2}) in calls
    assert calls[-1] == ("finish",)
    tracking.WandbLogger(tmp_path, {}, "proj", resume=True)  # a resume continues the same wandb run
    tracking.WandbLogger(tmp_path, {}, "proj")  # a fresh run gets a new one
    ids = [call[1]["id"] for call in calls if call[0] == "init"]
    assert ids[1] == ids[0] != ids[2]


def test_missing_logging_packages_are_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match="--use_wandb needs the wandb package: pip install wandb"):
        tracking.WandbLogger(tmp_path, {}, "proj")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match="--use_tensorboard needs the tensorboard package"):
        tracking.TensorboardLogger(tmp_path)
