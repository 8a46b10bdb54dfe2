"""What `openrlhf-geo train-ppo-ray` refuses before Ray starts, through upstream's real parser on the patched copy:
the outputs of an earlier run (which upstream writes over without a word) and local .jsonl datasets it could not
load (a Ray actor's traceback half a minute after the cluster started)."""

import json
import os
import zipfile

import pytest
import torch
from fork_helpers import parse

from openrlhf_geo import GeoWarning
from openrlhf_geo.fork import hooks as fork_hooks
from openrlhf_geo.local import rundir

pytestmark = pytest.mark.fork
GRPO = ["--advantage_estimator", "group_norm"]


def refused(up, monkeypatch, capsys, argv) -> str:
    """The fork's refusal of `argv` at parse time: its message line (parser.error's, exit 2)."""
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, argv)
    assert caught.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ── outputs of an earlier run ──


def finished_run(root):
    """What a finished upstream run with --ckpt.save_steps 2 leaves: final model, DeepSpeed checkpoint."""
    final, actor = root / "final", root / "ckpt" / "_actor"
    (actor / "global_step2").mkdir(parents=True)
    final.mkdir()
    for path in (final / "config.json", final / "model.safetensors"):
        path.write_text("earlier run")
    torch.save({"module": {}}, actor / "global_step2" / "model_states.pt")  # read back whole by a resume
    (actor / "latest").write_text("global_step2")
    return final, root / "ckpt"


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_into_a_finished_runs_outputs_is_refused_naming_flag_and_way_out(up, monkeypatch, capsys, tmp_path):
    """It replaced the earlier run's final model and its global_step2 model and optimizer states, exit 0."""
    final, ckpt = finished_run(tmp_path)
    before = snapshot(tmp_path)
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(final), "--ckpt.path", str(ckpt)]
    line = refused(up, monkeypatch, capsys, argv)
    assert line.endswith(
        f"error: --ckpt.output_dir {final} already holds a run (config.json, model.safetensors); resume it with "
        "--ckpt.load_enable, replace it with --ckpt.overwrite, or choose another --ckpt.output_dir"
    ), line
    # a new final folder: the checkpoints are what would be written over
    line = refused(up, monkeypatch, capsys, [*argv[:-3], str(tmp_path / "new"), *argv[-2:]])
    assert f"error: --ckpt.path {ckpt} already holds a run (_actor); resume it with --ckpt.load_enable" in line
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()

    # a resume continues the run; without periodic saves --ckpt.path is not written, so only the final model counts
    parse(up, monkeypatch, [*argv, "--ckpt.load_enable"])
    parse(up, monkeypatch, [*GRPO, "--ckpt.output_dir", str(tmp_path / "new"), "--ckpt.path", str(ckpt)])
    assert snapshot(tmp_path) == before


def test_overwrite_deletes_the_earlier_runs_checkpoints_and_nothing_else(up, monkeypatch, capsys, tmp_path):
    """It also deleted every folder whose name ends in _hf (the user's mymodel_hf/), without a word."""
    final, ckpt = finished_run(tmp_path)
    (ckpt / "_critic" / "global_step2").mkdir(parents=True)
    (ckpt / "global_step2_hf").mkdir()
    (ckpt / "mymodel_hf").mkdir()
    (ckpt / "notes.txt").write_text("mine")
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(final), "--ckpt.path", str(ckpt)]
    args = parse(up, monkeypatch, [*argv, "--ckpt.overwrite"])
    assert args.ckpt.overwrite
    # no later --ckpt.load_enable can resume the earlier run, nor the --ckpt.max_num rotation count its checkpoints
    assert sorted(p.name for p in ckpt.iterdir()) == ["mymodel_hf", "notes.txt"]
    deleted = "_actor, _critic, global_step2_hf"
    assert f"--ckpt.overwrite: deleting the earlier run's checkpoints in {ckpt}: {deleted}" in capsys.readouterr().out
    assert (final / "model.safetensors").read_text() == "earlier run"  # upstream's final save replaces it


def test_a_run_records_what_it_writes_in_ckpt_path_and_overwrite_deletes_only_that(up, monkeypatch, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(tmp_path / "final"), "--ckpt.path", str(ckpt)]
    with fork_hooks.claim_outputs(parse(up, monkeypatch, argv)):  # as the patched __main__ holds it for train()
        for name in ("_actor/global_step2", "global_step2_hf", "best_global_step4_hf"):
            (ckpt / name).mkdir(parents=True)
    assert json.loads((ckpt / rundir.RECORD).read_text())["paths"] == list(fork_hooks.RUN_CHECKPOINTS)
    (ckpt / "mymodel_hf").mkdir()
    (ckpt / "global_step_mine_hf").mkdir()
    parse(up, monkeypatch, [*argv, "--ckpt.overwrite"])
    assert sorted(p.name for p in ckpt.iterdir()) == [rundir.LOCK, "global_step_mine_hf", "mymodel_hf", rundir.RECORD]
    (ckpt / rundir.RECORD).write_text(json.dumps({"paths": ["*"]}))  # a record never widens what is deleted
    (ckpt / "_actor").mkdir()
    parse(up, monkeypatch, [*argv, "--ckpt.overwrite"])
    assert sorted(p.name for p in ckpt.iterdir()) == [
        rundir.LOCK, "_actor", "global_step_mine_hf", "mymodel_hf", rundir.RECORD
    ]  # fmt: skip


def test_a_second_run_into_the_folders_of_a_running_one_is_refused_and_the_lock_is_released(
    up, monkeypatch, capsys, tmp_path
):
    """Two runs into one --ckpt.output_dir, started 20 s apart, both exited 0; the second replaced the first's model
    and checkpoints."""
    for flag in ("--ckpt.output_dir", "--ckpt.path"):
        final, ckpt = tmp_path / flag / "final", tmp_path / flag / "ckpt"
        argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(final), "--ckpt.path", str(ckpt)]
        held, other = (final, ckpt) if flag == "--ckpt.output_dir" else (ckpt, final)
        with rundir.locked(held):  # what the first run's driver holds until it ends
            with pytest.raises(SystemExit) as caught:
                parse(up, monkeypatch, argv)
        assert caught.value.code == f"train_ppo_ray.py: error: {flag} {held}: another run is writing it (pid " \
            f"{os.getpid()}); wait for it or choose another {flag}"  # fmt: skip
        assert not other.exists()  # a refused run leaves nothing behind
    final, ckpt = tmp_path / "final", tmp_path / "ckpt"
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(final), "--ckpt.path", str(ckpt)]
    parse(up, monkeypatch, argv)  # released when the run ends, here in an exception out of train()
    assert not final.exists() and not ckpt.exists()
    with fork_hooks.claim_outputs(parse(up, monkeypatch, argv)):
        assert (final / rundir.LOCK).read_text() == f"pid {os.getpid()}\n"
        with pytest.raises(SystemExit, match="--ckpt.output_dir .* another run is writing it"):
            parse(up, monkeypatch, argv)
    with rundir.locked(final):  # released when the block ends
        pass


def test_overwrite_deletes_nothing_when_upstreams_own_checks_refuse_the_command(up, monkeypatch, tmp_path):
    """Upstream checks its flags after the fork's (an assert in its __main__): the deletion waits for them."""
    final, ckpt = finished_run(tmp_path)
    before = snapshot(tmp_path)
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(final), "--ckpt.path", str(ckpt)]
    with pytest.raises(AssertionError, match="--train.partial_rollout_enable requires --train.async_enable"):
        parse(up, monkeypatch, [*argv, "--ckpt.overwrite", "--train.partial_rollout_enable"])
    assert snapshot(tmp_path) == before


def test_a_resume_without_a_checkpoint_into_a_used_folder_is_refused(up, monkeypatch, capsys, tmp_path):
    """--ckpt.load_enable without <ckpt.path>/_actor: upstream starts fresh and writes over the final model."""
    final, ckpt = finished_run(tmp_path)
    argv = [*GRPO, "--ckpt.load_enable", "--ckpt.output_dir", str(final), "--ckpt.path", str(tmp_path / "none")]
    assert refused(up, monkeypatch, capsys, argv).endswith(
        f"error: --ckpt.load_enable: {tmp_path / 'none' / '_actor'} holds no checkpoint to resume, and "
        f"--ckpt.output_dir {final} holds an earlier run (config.json, model.safetensors); replace it with "
        "--ckpt.overwrite, or choose another --ckpt.output_dir"
    )


def test_upstreams_default_layout_nests_the_checkpoints_in_the_output_folder(up, monkeypatch, capsys, tmp_path):
    """--ckpt.path defaults to ./ckpt/checkpoints_ppo_ray inside --ckpt.output_dir ./ckpt: a crashed run left only
    checkpoints there, which a run without periodic saves does not touch, and one with them resumes or is refused."""
    monkeypatch.chdir(tmp_path)  # upstream's relative defaults
    (tmp_path / "ckpt" / "checkpoints_ppo_ray" / "_actor" / "global_step1").mkdir(parents=True)
    (tmp_path / "ckpt" / "tensorboard").mkdir()
    argv = [*GRPO, "--logger.tensorboard_dir", "ckpt/tensorboard"]
    argv += ["--ckpt.output_dir", "./ckpt", "--ckpt.path", "./ckpt/checkpoints_ppo_ray"]  # (parse's are elsewhere)
    parse(up, monkeypatch, argv)
    parse(up, monkeypatch, [*argv, "--ckpt.save_steps", "1", "--ckpt.load_enable"])
    line = refused(up, monkeypatch, capsys, [*argv, "--ckpt.save_steps", "1"])
    assert "error: --ckpt.path ./ckpt/checkpoints_ppo_ray already holds a run (_actor)" in line
    (tmp_path / "ckpt" / "config.json").write_text("{}")  # the final model of a finished run
    assert "--ckpt.output_dir ./ckpt already holds a run (config.json);" in refused(up, monkeypatch, capsys, argv)


def test_a_critic_saved_next_to_the_output_folder_counts(up, monkeypatch, capsys, tmp_path):
    (tmp_path / "final_critic").mkdir()
    (tmp_path / "final_critic" / "config.json").write_text("{}")
    argv = ["--advantage_estimator", "gae", "--reward.remote_url", "http://rm"]
    argv += ["--ckpt.output_dir", str(tmp_path / "final")]
    parse(up, monkeypatch, argv)  # no --critic.save_value_network: nothing is written there
    line = refused(up, monkeypatch, capsys, [*argv, "--critic.save_value_network"])
    assert f"--ckpt.output_dir {tmp_path / 'final_critic'} already holds a run (config.json)" in line


# ── local .jsonl datasets ──

ROWS = b'{"input": "Q: 1 + 2 = ? A:", "label": "3"}\n'
BAD_DATASETS = {
    "not utf-8": (ROWS + b'{"input": "caf\xe9", "label": "1"}\n', ":2: not UTF-8 (byte 0xe9 at column 15)"),
    "empty": (b"", ": no rows"),
    "blank lines": (b"\n \n", ": no rows"),
    "not json": (ROWS + b"{oops\n", ":2: not JSON (Expecting property name enclosed in double quotes at column 2)"),
    "no input": (ROWS + b'{"question": "x", "label": "1"}\n', ":2: no 'input' field (--data.input_key; the line"),
    "no label": (ROWS + b'{"input": "x"}\n', ":2: no 'label' field (--data.label_key; the line has ['input'])"),
}


@pytest.mark.parametrize("name", list(BAD_DATASETS))
@pytest.mark.parametrize("flag", ["--data.prompt_dataset", "--eval.dataset"])
def test_a_local_jsonl_dataset_upstream_cannot_load_is_one_line_naming_the_flag_and_file(
    up, monkeypatch, capsys, tmp_path, name, flag
):
    """It was a Ray ActorDiedError about 28 s after the cluster started."""
    content, message = BAD_DATASETS[name]
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_bytes(ROWS)
    bad.write_bytes(content)
    datasets = {"--data.prompt_dataset": str(good), "--eval.dataset": str(good), flag: f"{good}, {bad}@sub"}
    argv = [*GRPO, "--data.label_key", "label", "--ckpt.output_dir", str(tmp_path / "out")]
    for key, value in datasets.items():
        argv += [key, value]
    assert f"error: {flag} {bad}{message}" in refused(up, monkeypatch, capsys, argv)


def test_empty_prompts_are_counted_in_one_warning_naming_the_flag_and_file(up, monkeypatch, tmp_path):
    """They trained without a word, as in `openrlhf-geo train` before it warned."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(ROWS + b'{"input": " ", "label": "1"}\n' + ROWS + b'{"input": [], "label": "1"}\n')
    argv = [*GRPO, "--data.prompt_dataset", str(data), "--ckpt.output_dir", str(tmp_path / "out")]
    with pytest.warns(GeoWarning) as caught:
        parse(up, monkeypatch, argv)
    (line,) = [str(w.message) for w in caught if "empty" in str(w.message)]
    assert line == (
        f"2 of the 4 prompts of --data.prompt_dataset {data} are empty (the first on line 2; --data.input_key "
        "'input'): they are trained on as written"
    )


def test_datasets_the_fork_does_not_read_are_left_to_upstream(up, monkeypatch, tmp_path):
    """Hub names, folders and other formats are loaded by upstream; --data.label_key is optional there, and fields are
    not type-checked (chat messages with --data.apply_chat_template, any label a .py reward_func reads)."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"input": [{"role": "user", "content": "hi"}], "label": [1, 2]}\n')
    (tmp_path / "data.parquet").write_bytes(b"\xff\x00not checked here")
    value = f"{chat},{tmp_path / 'data.parquet'},{tmp_path},org/dataset"
    args = parse(up, monkeypatch, [*GRPO, "--data.prompt_dataset", value, "--ckpt.output_dir", str(tmp_path / "o")])
    assert args.data.prompt_dataset == value


# ── a resume from a damaged newest checkpoint ──


def deepspeed_checkpoints(ckpt, steps, folders=("_actor", "_critic")):
    """What upstream's saves leave in --ckpt.path, as far as the resume's fallback reads it: per tag a model-states
    and a ZeRO optimizer-states file (torch zip archives), and `latest` naming the newest tag."""
    for name in folders:
        for step in steps:
            tag = ckpt / name / f"global_step{step}"
            tag.mkdir(parents=True)
            torch.save({"module": {"w": torch.full((256,), float(step))}}, tag / "mp_rank_00_model_states.pt")
            torch.save({"optimizer": torch.zeros(64)}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (ckpt / name / "latest").write_text(f"global_step{steps[-1]}")


def test_a_damaged_newest_checkpoint_falls_back_to_the_intact_one_before_it(tmp_path, capsys):
    """The fork resumed from whatever `latest` named: a flipped bit in a weight loaded silently (torch's reader does
    not check CRCs), a cut-off file failed in DeepSpeed's load on the actors, naming neither file nor step."""
    ckpt = tmp_path / "ckpt"
    deepspeed_checkpoints(ckpt, [1, 2, 3])
    states = ckpt / "_actor" / "global_step3" / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[data.index(torch.full((256,), 3.0).numpy().tobytes()) + 100] ^= 0x10  # one bit of one weight
    states.write_bytes(bytes(data))
    assert torch.load(states, weights_only=True)["module"]["w"].ne(3.0).sum() == 1  # loads silently
    fork_hooks.fall_back_from_damaged(ckpt)
    assert capsys.readouterr().err == (
        f"warning: --ckpt.load_enable: {states} is damaged (checkpoint global_step3, step 3); moved it aside to "
        f"global_step3.bad and resuming from {ckpt / '_actor' / 'global_step2'} (step 2)\n"
    )
    for name in ("_actor", "_critic"):  # both resume the same step; the damaged one is kept for inspection
        assert fork_hooks.latest_tag(ckpt / name) == "global_step2"
        assert sorted(p.name for p in (ckpt / name).iterdir()) == [
            "global_step1", "global_step2", "global_step3.bad", "latest"
        ]  # fmt: skip
    fork_hooks.fall_back_from_damaged(ckpt)  # intact now: nothing to do
    assert capsys.readouterr().err == "" and fork_hooks.latest_tag(ckpt / "_actor") == "global_step2"

    # the resumed run writes global_step3 again, and it is damaged again (the critic's optimizer states, cut off)
    for name in ("_actor", "_critic"):
        (ckpt / name / "global_step3").mkdir()
        for source in (ckpt / name / "global_step2").iterdir():
            (ckpt / name / "global_step3" / source.name).write_bytes(source.read_bytes())
        (ckpt / name / "latest").write_text("global_step3")
    optim = ckpt / "_critic" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:300])
    fork_hooks.fall_back_from_damaged(ckpt)
    assert f"{optim} is damaged (checkpoint global_step3, step 3); moved it aside to global_step3.bad.1" in (
        capsys.readouterr().err
    )
    assert (ckpt / "_actor" / "global_step3.bad").is_dir() and (ckpt / "_actor" / "global_step3.bad.1").is_dir()

    for step in (1, 2):  # nothing intact is left before it: refused, naming the file, its step and what to do
        (ckpt / "_actor" / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError) as refused:
        fork_hooks.fall_back_from_damaged(ckpt)
    assert str(refused.value) == (
        f"--ckpt.load_enable: {ckpt / '_actor' / 'global_step2' / 'mp_rank_00_model_states.pt'} is damaged "
        f"(checkpoint global_step2, step 2) and no intact checkpoint precedes it in {ckpt / '_actor'}: restore a "
        "copy, or start over: run without --ckpt.load_enable, with --ckpt.overwrite"
    )


def test_the_resume_falls_back_before_ray_starts_or_refuses_in_one_line(up, monkeypatch, capsys, tmp_path):
    ckpt, final = tmp_path / "ckpt", tmp_path / "final"
    deepspeed_checkpoints(ckpt, [2, 4], folders=("_actor",))
    states = ckpt / "_actor" / "global_step4" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:-40])  # a kill while DeepSpeed wrote it
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.load_enable", "--ckpt.output_dir", str(final)]
    parse(up, monkeypatch, [*argv, "--ckpt.path", str(ckpt)])
    assert fork_hooks.latest_tag(ckpt / "_actor") == "global_step2"
    assert f"{states} is damaged (checkpoint global_step4, step 4)" in capsys.readouterr().err
    (ckpt / "_actor" / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, [*argv, "--ckpt.path", str(ckpt)])
    assert caught.value.code.startswith("train_ppo_ray.py: error: --ckpt.load_enable: ")
    assert "global_step2/mp_rank_00_model_states.pt is damaged (checkpoint global_step2, step 2)" in caught.value.code
    assert zipfile.is_zipfile(ckpt / "_actor" / "global_step4.bad" / states.name) is False  # kept as it was
