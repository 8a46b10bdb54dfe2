"""`openrlhf-geo train` on inputs that are too long, too large, corrupted or foreign: one warning or one line, and
nothing left behind (the packaged demo SFT model: 128 positions)."""

import importlib.util
import json
import random
import shutil
import tracemalloc
from pathlib import Path

import pytest

import openrlhf_geo
from openrlhf_geo import GeoWarning, cli, jsonl
from openrlhf_geo.local import engine, flags, rundir, training

DEMO_SFT = Path(openrlhf_geo.__file__).parent / "assets" / "demo_sft"
LONG = "3+4=" * 90  # 361 tokens with <bos>: past the demo model's 128 positions


def write_rows(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in prompts))
    return path


def train_argv(tmp, data, *extra, model=DEMO_SFT, steps=1):
    return [
        "train",
        "--actor.model_name_or_path", str(model),
        "--data.prompt_dataset", str(data),
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.max_new_tokens", "16",
        "--rollout.batch_size", "2",
        "--train.steps", str(steps),
        "--train.threads", "1",
        "--ckpt.output_dir", str(tmp / "out"),
        *extra,
    ]  # fmt: skip


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ---------------------------------------------------------------- prompts longer than the model's positions


def test_a_prompt_past_the_models_positions_is_truncated_on_the_left_keeping_bos():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_SFT)
    model = AutoModelForCausalLM.from_pretrained(DEMO_SFT)
    batch = engine.generate_rollouts(model, tokenizer, [LONG, "12+34="], ["7", "46"], 2, 4, max_prompt_tokens=112)
    ids = tokenizer(LONG)["input_ids"]
    assert batch.prompt_width == 112 and batch.sequences.shape[1] <= 128
    assert batch.sequences[0, :112].tolist() == [ids[0], *ids[-111:]]  # <bos>, then the prompt's last tokens
    assert batch.prompts[0] == LONG  # the reward still sees the prompt as written
    assert tokenizer.truncation_side == "right"  # the tokenizer saved with the model is left as it was


def test_train_warns_once_naming_how_many_prompts_are_truncated_and_the_limit(tmp_path, recwarn):
    """They trained past the model's 128 positions with no warning (only transformers' "friendly reminder")."""
    data = write_rows(tmp_path / "long.jsonl", [LONG, "12+34=", LONG, "1+2="])
    assert cli.main(train_argv(tmp_path, data, "--eval.dataset", str(data), "--eval.steps", "1")) == 0
    shown = [str(w.message) for w in recwarn if issubclass(w.category, GeoWarning) and "truncated" in str(w.message)]
    assert shown == [
        f"2 of the 4 prompts of --data.prompt_dataset {data} are longer than the 112 tokens the model leaves a prompt "
        "(max_position_embeddings 128 - --rollout.max_new_tokens 16): they are truncated on the left, as upstream "
        "OpenRLHF does, keeping their end (where the response continues) after any leading special token",
        f"2 of the 4 prompts of --eval.dataset {data} are longer than the 112 tokens the model leaves a prompt "
        "(max_position_embeddings 128 - --rollout.max_new_tokens 16): they are truncated on the left, as upstream "
        "OpenRLHF does, keeping their end (where the response continues) after any leading special token",
    ]


def test_train_warns_once_naming_how_many_prompts_are_empty_and_the_dataset(tmp_path, recwarn):
    """Empty prompts trained without a word."""
    data = write_rows(tmp_path / "empty.jsonl", ["12+34=", "", "1+2=", "  "])
    assert cli.main(train_argv(tmp_path, data)) == 0
    shown = [str(w.message) for w in recwarn if issubclass(w.category, GeoWarning) and "empty" in str(w.message)]
    assert shown == [
        f"2 of the 4 prompts of --data.prompt_dataset {data} are empty (the first on line 2; --data.input_key "
        "'prompt'): they are trained on as written"
    ]


def test_max_new_tokens_that_leave_no_room_for_a_prompt_is_one_line(tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", ["12+34="])
    argv = train_argv(tmp_path, data, "--rollout.max_new_tokens", "127")
    assert cli.main(argv) == 1
    assert one_error_line(capsys) == (
        f"openrlhf-geo train: --rollout.max_new_tokens 127 leaves no room for a prompt in the 128 positions "
        f"(max_position_embeddings) of --actor.model_name_or_path {DEMO_SFT}"
    )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- prompt size caps


def test_the_prompt_caps_are_generous_and_a_prompt_over_the_character_cap_is_refused_before_tokenizing(
    tmp_path, capsys, monkeypatch
):
    """One 50 MB prompt grew the run to 24 GB until the kernel killed it, with no message."""
    assert training.MAX_PROMPT_CHARS >= 1_000_000 and engine.MAX_PROMPT_TOKENS >= 100_000
    monkeypatch.setattr(training, "MAX_PROMPT_CHARS", 100, raising=False)
    data = write_rows(tmp_path / "d.jsonl", ["12+34=", "1" * 101])
    assert cli.main(train_argv(tmp_path, data)) == 1
    assert one_error_line(capsys) == (
        f"openrlhf-geo train: --data.prompt_dataset {data}:2: the prompt is 101 characters, over the limit of 100 "
        "(MAX_PROMPT_CHARS)"
    )
    assert not (tmp_path / "out").exists()


def test_a_prompt_over_the_token_cap_is_refused_naming_file_row_and_limit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(engine, "MAX_PROMPT_TOKENS", 20, raising=False)
    data = write_rows(tmp_path / "d.jsonl", ["12+34=", "", "1+2=3+4=5+6=7+8=9+1="])  # line 2 is blank
    assert cli.main(train_argv(tmp_path, data)) == 1
    assert one_error_line(capsys) == (
        f"openrlhf-geo train: --data.prompt_dataset {data}:3: the prompt is 21 tokens, over the local engine's "
        "limit of 20 (MAX_PROMPT_TOKENS)"
    )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a corrupted model directory


def _truncate(path, end):
    path.write_bytes(path.read_bytes()[:end])


CORRUPTIONS = {
    "weights cut at the header": lambda m: _truncate(m / "model.safetensors", 1000),
    "weights cut in the tensors": lambda m: _truncate(m / "model.safetensors", -999),
    "config a JSON list": lambda m: (m / "config.json").write_text("[]\n"),
    "config a bad field": lambda m: (m / "config.json").write_text(
        json.dumps({**json.loads((m / "config.json").read_text()), "hidden_size": "x"})),
    "config of another shape": lambda m: (m / "config.json").write_text(
        json.dumps({**json.loads((m / "config.json").read_text()), "hidden_size": 32})),
    "no config": lambda m: (m / "config.json").unlink(),
    "tokenizer cut": lambda m: _truncate(m / "tokenizer.json", 500),
    "no tokenizer": lambda m: (m / "tokenizer.json").unlink(),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_corrupted_model_directory_is_one_line_naming_the_flag(tmp_path, capsys, name):
    model = tmp_path / "model"
    shutil.copytree(DEMO_SFT, model)
    CORRUPTIONS[name](model)
    data = write_rows(tmp_path / "d.jsonl", ["12+34="])
    assert cli.main(train_argv(tmp_path, data, model=model)) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"openrlhf-geo train: --actor.model_name_or_path {model}: "), line
    assert not (tmp_path / "out").exists()  # a failed start leaves no output directory behind


# ---------------------------------------------------------------- Ctrl-C and resume messages


def interrupt_at(monkeypatch, at_step):
    step = engine.Trainer.step

    def interrupted(self):
        if self.global_step + 1 == at_step:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(engine.Trainer, "step", interrupted)


def test_ctrl_c_names_the_checkpoint_there_is_or_says_none_was_written(tmp_path, capsys, monkeypatch):
    """It said "--ckpt.load_enable resumes from the last checkpoint" when no checkpoint had been written."""
    data = write_rows(tmp_path / "d.jsonl", ["12+34=", "1+2="])
    out = tmp_path / "out"
    interrupt_at(monkeypatch, 2)
    assert cli.main(train_argv(tmp_path, data, steps=3)) == 130
    assert one_error_line(capsys) == (
        f"openrlhf-geo train: interrupted; no checkpoint was written in {out} (--ckpt.save_steps N writes one "
        "every N steps)"
    )
    assert cli.main(train_argv(tmp_path, data, "--ckpt.overwrite", "--ckpt.save_steps", "1", steps=3)) == 130
    assert one_error_line(capsys) == (
        f"openrlhf-geo train: interrupted; --ckpt.load_enable resumes from {out / 'checkpoint.pt'}"
    )


def test_a_resume_in_the_same_relative_directory_reports_no_changed_flags(tmp_path, capsys, monkeypatch):
    """Every resume reported "--ckpt.output_dir 'out' -> '/abs/out'" for the same directory."""
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "d.jsonl", ["12+34=", "1+2="])
    argv = train_argv(Path("."), "d.jsonl", "--ckpt.output_dir", "out", "--logger.tensorboard_dir", "tb")
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main([*argv, "--ckpt.load_enable", "--train.steps", "2"]) == 0
    err = capsys.readouterr().err
    assert "resuming with changed flags: --train.steps 1 -> 2\n" in err, err


# ---------------------------------------------------------------- a large prompt dataset


def test_the_jsonl_reader_is_lazy():
    """It read the whole file, then split it, before returning the first row."""
    rows = jsonl.iter_jsonl(Path(__file__))  # not a jsonl file: only reading a row raises
    with pytest.raises(ValueError, match=r"test_local_inputs.py:1: not JSON"):
        next(rows)


def test_a_dataset_is_read_and_sampled_in_memory_far_below_its_size(tmp_path):
    """A 4-million-row dataset was read whole (3.5 GB peak): the file, its lines, then a dict per row."""
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "id": "x" * 200}) + "\n"
                            for i in range(20000)))  # fmt: skip
    args = flags.parse_args(["--actor.model_name_or_path", "unused", "--data.prompt_dataset", str(path)])
    tracemalloc.start()
    try:
        rows = training.read_dataset(path, "prompt", "answer", "--data.prompt_dataset")
        flags.run_config(args)  # hashes the file
        sampler = engine.PromptSampler(rows, seed=0)
        batch = sampler.next(4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert len(rows) == 20000 and rows[5] == {"prompt": "5+5=", "answer": "10"}
    assert all(r["prompt"] == f"{int(r['answer']) // 2}+{int(r['answer']) // 2}=" for r in batch)
    # two int64s a row for the dataset and one for the sampler's order, and a read buffer: 0.6 MB (it was 18.5 MB)
    assert peak < 40 * len(rows) + 2**20 < size / 2, (peak, size)


def test_the_compact_sampler_draws_the_prompts_a_list_drew_and_resumes_from_an_older_checkpoint():
    rows = [{"prompt": str(i), "answer": ""} for i in range(50)]
    expected = list(range(50))
    random.Random(3).shuffle(expected)
    sampler = engine.PromptSampler(rows, seed=3)
    assert [int(r["prompt"]) for r in sampler.next(20)] == expected[:20]
    state = sampler.state_dict()
    assert state["order"] == expected  # a checkpoint stores a list, as before
    resumed = engine.PromptSampler(rows, seed=0)
    resumed.load_state_dict(state)
    assert [int(r["prompt"]) for r in resumed.next(30)] == expected[20:]


def test_a_dataset_changed_during_the_run_is_named(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", ["1+2=", "3+4="])
    rows = training.read_dataset(path, "prompt", "answer", "--data.prompt_dataset")
    write_rows(path, ["1+2=", "3+4=", "5+6="])
    with pytest.raises(ValueError, match=r"--data.prompt_dataset .*d.jsonl: changed since the run read it"):
        rows[1]


# ---------------------------------------------------------------- a refused command leaves nothing behind


@pytest.fixture
def foreign(tmp_path):
    """Someone else's non-empty directory."""
    path = tmp_path / "theirs"
    path.mkdir()
    (path / "notes.txt").write_text("mine\n")
    return path


def test_train_refused_in_a_foreign_directory_leaves_no_lock(tmp_path, foreign, capsys):
    data = write_rows(tmp_path / "d.jsonl", ["12+34="])
    assert cli.main(train_argv(tmp_path, data, "--ckpt.output_dir", str(foreign))) == 1
    assert f"{foreign} holds files no run wrote (notes.txt)" in one_error_line(capsys)  # not "a run"
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_a_failed_claim_removes_only_what_it_created(tmp_path):
    with pytest.raises(RuntimeError):
        with rundir.claim(tmp_path / "a" / "b"):
            raise RuntimeError("the run failed before writing anything")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / rundir.LOCK).write_text("pid 1\n")  # a killed run's lock file: not ours to remove
    with pytest.raises(RuntimeError):
        with rundir.claim(tmp_path / "old"):
            raise RuntimeError
    assert (tmp_path / "old" / rundir.LOCK).exists()
    with rundir.claim(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept" / rundir.LOCK).exists()  # a run that ended keeps its lock file, as before


def test_the_lock_is_taken_again_when_its_file_was_replaced(tmp_path, monkeypatch):
    """A process that opened the lock file just before its holder removed it must not hold a lock on the removed
    file while another process locks the new one."""
    flock = rundir.fcntl.flock
    replaced = []

    def replace_once(handle, operation):
        if not replaced and operation & rundir.fcntl.LOCK_EX:
            replaced.append(True)
            (tmp_path / rundir.LOCK).unlink()  # the holder removed it after we opened it
            (tmp_path / rundir.LOCK).write_text("pid 2\n")  # and a third process created a new one
        return flock(handle, operation)

    monkeypatch.setattr(rundir.fcntl, "flock", replace_once)
    with rundir.locked(tmp_path):
        with pytest.raises(rundir.Busy):
            with rundir.locked(tmp_path):  # the file at the path is the one held
                pass


def test_study_refused_in_a_foreign_directory_leaves_no_lock(foreign, capsys):
    assert cli.main(["study", "salt-scaling", "--quick", "--out", str(foreign)]) == 2
    assert "holds files not written by" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_demo_refused_in_a_foreign_directory_leaves_no_lock(foreign, capsys):
    assert cli.main(["demo", "--quick", "--out", str(foreign)]) == 2
    assert "holds files not written by" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("extra", [[], ["--assets-only"]])
def test_smoke_refused_in_a_foreign_directory_leaves_no_lock(foreign, capsys, monkeypatch, extra):
    import openrlhf_geo.fork.launch

    script = Path(__file__).resolve().parents[1] / "examples" / "scripts" / "smoke_cpu.py"
    spec = importlib.util.spec_from_file_location("smoke_cpu", script)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    monkeypatch.setattr(openrlhf_geo.fork.launch, "check_cpu_engines", lambda: None)
    monkeypatch.setattr(smoke.signal, "signal", lambda *args: None)  # keep pytest's own SIGTERM handling
    assert smoke.main([str(foreign), *extra]) == 1
    assert "holds files not written by" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_a_refusal_after_the_record_was_written_removes_the_record_the_lock_and_the_directory(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with rundir.claim_output(out, "some command"):
            raise RuntimeError("refused before writing anything")
    assert not out.exists()
    with rundir.claim_output(out, "some command"):
        (out / "result.txt").write_text("x")
    with pytest.raises(RuntimeError):
        with rundir.claim_output(out, "some command"):
            raise RuntimeError("a rerun that failed")
    assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK, rundir.COMMAND_FILE, "result.txt"]
