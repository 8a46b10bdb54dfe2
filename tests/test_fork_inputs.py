"""What `openrlhf-geo train-ppo-ray` refuses before Ray starts, through upstream's real parser on the patched copy:
the outputs of an earlier run (which upstream writes over without a word) and local .jsonl datasets it could not
load (a Ray actor's traceback half a minute after the cluster started)."""

import pytest
from fork_helpers import parse

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
    for path in (final / "config.json", final / "model.safetensors", actor / "global_step2" / "model_states.pt"):
        path.write_text("earlier run")
    (actor / "latest").write_text("global_step2")
    return final, root / "ckpt"


def snapshot(root):
    return {p: p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


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


def test_overwrite_deletes_the_earlier_runs_checkpoints_and_nothing_else(up, monkeypatch, tmp_path):
    final, ckpt = finished_run(tmp_path)
    (ckpt / "_critic" / "global_step2").mkdir(parents=True)
    (ckpt / "global_step2_hf").mkdir()
    (ckpt / "notes.txt").write_text("mine")
    argv = [*GRPO, "--ckpt.save_steps", "2", "--ckpt.output_dir", str(final), "--ckpt.path", str(ckpt)]
    args = parse(up, monkeypatch, [*argv, "--ckpt.overwrite"])
    assert args.ckpt.overwrite
    # no later --ckpt.load_enable can resume the earlier run, nor the --ckpt.max_num rotation count its checkpoints
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt"]
    assert (final / "model.safetensors").read_text() == "earlier run"  # upstream's final save replaces it


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


def test_datasets_the_fork_does_not_read_are_left_to_upstream(up, monkeypatch, tmp_path):
    """Hub names, folders and other formats are loaded by upstream; --data.label_key is optional there, and fields are
    not type-checked (chat messages with --data.apply_chat_template, any label a .py reward_func reads)."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"input": [{"role": "user", "content": "hi"}], "label": [1, 2]}\n')
    (tmp_path / "data.parquet").write_bytes(b"\xff\x00not checked here")
    value = f"{chat},{tmp_path / 'data.parquet'},{tmp_path},org/dataset"
    args = parse(up, monkeypatch, [*GRPO, "--data.prompt_dataset", value, "--ckpt.output_dir", str(tmp_path / "o")])
    assert args.data.prompt_dataset == value
