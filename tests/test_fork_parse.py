"""The fork's command line through upstream's own parser (the real patched openrlhf 0.11.2 `train_ppo_ray`, run on
the materialized fork; CPU, test-only import shims), stopped where `train()` starts.

Covers: `--help` listing upstream's and the fork's flags, with each config flag's dataclass default shown alike by
both engines; `--advantage_estimator salt` parsing to its base estimator plus SALT; every fork and baseline flag
reaching the nested args; invalid flag combinations, and save folders that cannot be written, refused at parse time
(exit 2, the reason on stderr); SALT's partitions as optimizer steps in upstream's asynchronous trainer too.
Parsing that needs the tiny model, flags mapped to the actor's geometry spec, and the pipeline itself are in
test_fork_pipeline.py.
"""

import importlib.util
import re
import warnings
from types import SimpleNamespace as NS

import pytest
import torch
from fork_helpers import parse

from openrlhf_geo.fork import flags as fork_flags
from openrlhf_geo.fork import hooks as fork_hooks
from openrlhf_geo.fork import install as fork
from openrlhf_geo.fork import launch

pytestmark = pytest.mark.fork

PROG = "train_ppo_ray.py"  # upstream's parser is named after sys.argv[0]: runpy sets it to the module's file

# ── upstream's parser (`parse`: fork_helpers.py; the `up` fixture: conftest.py) ──


def test_help_lists_upstream_and_fork_flags(up, monkeypatch, capsys):
    monkeypatch.setenv(fork.CACHE_ENV, str(up.cache))
    with pytest.raises(SystemExit) as caught:
        launch.main(["--help"])
    out = capsys.readouterr().out
    assert caught.value.code == 0
    flags = set(re.findall(r"(--[\w.]+)", out))
    assert {"--algo.advantage.estimator", "--advantage_estimator", "--vllm.num_engines", "--salt.variant"} <= flags
    assert {"--geoalign.projector.hidden_sizes", "--reward.noise.type", "--reward.noise.rate"} <= flags
    assert "salt (openrlhf-geo" in " ".join(out.split())


def help_entries(text):
    """--help text -> {option: its entry, whitespace collapsed}."""
    entries, current = {}, None
    for line in text.splitlines():
        start = re.match(r"\s{2}(--[\w.]+)", line)
        if start:
            current = start.group(1)
            entries[current] = line
        elif current and line.startswith(" " * 4):
            entries[current] += " " + line
        else:
            current = None
    return {option: " ".join(entry.split()) for option, entry in entries.items()}


def test_help_of_both_engines_shows_each_config_flag_with_its_dataclass_default(up, monkeypatch, capsys):
    from dataclasses import MISSING

    from openrlhf_geo import cli
    from openrlhf_geo.baselines import BaselineConfig
    from openrlhf_geo.config_flags import flag_fields, shown
    from openrlhf_geo.geoalign import GeoAlignConfig
    from openrlhf_geo.rewards.noise import NoiseConfig
    from openrlhf_geo.salt import SaltConfig

    monkeypatch.setenv(fork.CACHE_ENV, str(up.cache))
    with pytest.raises(SystemExit):
        launch.main(["--help"])
    fork_help = help_entries(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    local_help = help_entries(capsys.readouterr().out)
    checked = 0
    for config in (SaltConfig, GeoAlignConfig, NoiseConfig, BaselineConfig):
        for f, option, _ in flag_fields(config):
            default = f.default if f.default is not MISSING else f.default_factory()
            renamed = f"{f.name} " if not option.endswith(f".{f.name}") else ""
            want = f"(default {renamed}{shown(default)}"
            for engine, entries in (("fork", fork_help), ("local", local_help)):
                assert want in entries.get(option, ""), (engine, option, entries.get(option))
                checked += 1
    assert checked > 60


def test_advantage_estimator_salt_parses_to_its_base_plus_salt(up, monkeypatch):
    args = parse(up, monkeypatch, ["--advantage_estimator", "salt", "--salt.base", "rloo"])
    assert args.algo.advantage.estimator == "rloo" and args.salt.enable
    assert args.critic.model_name_or_path is None  # upstream's own post-parse logic saw a group estimator
    flat = parse(up, monkeypatch, ["--advantage_estimator", "group_norm"])
    assert flat.algo.advantage.estimator == "group_norm" and not flat.salt.enable and not flat.geoalign.enable


def test_every_fork_flag_reaches_the_nested_args(up, monkeypatch):
    argv = (
        "--advantage_estimator salt --salt.base dr_grpo --salt.variant fixed-alpha --salt.alpha 0.3 "
        "--salt.features exact --salt.dim 256 --salt.seed 3 --salt.group_prompts 2 "
        "--geoalign.enable --geoalign.preset rlhf --geoalign.alpha 0.1 --geoalign.mode amplify --geoalign.gdi mean "
        "--geoalign.prototype plain --geoalign.max_flag_frac 0.3 --geoalign.min_scores 8 "
        "--geoalign.max_pairs_per_side 2 --geoalign.device cpu --geoalign.projector.hidden_sizes 16 8 "
        "--geoalign.projector.out_dim 4 --geoalign.projector.steps 5 --geoalign.projector.lr 0.01 "
        "--geoalign.projector.val_acc 0.9 --geoalign.projector.val_frac 0.3 --geoalign.projector.no_warm_start "
        "--reward.noise.type flip --reward.noise.rate 0.25 --reward.noise.seed 5"
    ).split()
    args = parse(up, monkeypatch, argv)
    salt = args.salt
    assert (salt.base, salt.variant, salt.alpha, salt.features, salt.dim, salt.seed, salt.group_prompts) == (
        "dr_grpo",
        "fixed-alpha",
        0.3,
        "exact",
        256,
        3,
        2,
    )
    assert args.algo.advantage.estimator == "dr_grpo"
    config = fork_hooks.ExperienceGeometry(args).pipeline.config.geoalign
    assert (config.alpha, config.mode, config.gdi, config.prototype, config.max_flag_frac) == (
        0.1,
        "amplify",
        "mean",
        "plain",
        0.3,
    )
    assert (config.min_scores, config.max_pairs_per_side, config.device) == (8, 2, "cpu")
    assert (config.hidden_sizes, config.out_dim, config.steps, config.lr) == ((16, 8), 4, 5, 0.01)
    assert (config.val_acc, config.val_frac, config.warm_start) == (0.9, 0.3, False)
    noise = fork_hooks.ExperienceGeometry(args).pipeline.config.noise
    assert (noise.type, noise.rate, noise.seed, noise.levels) == ("flip", 0.25, 5, (0.0, 1.0))
    assert args.reward.num_nodes == 1  # upstream's --reward.* flags live beside --reward.noise.*


def test_every_baseline_flag_reaches_the_nested_args(up, monkeypatch):
    argv = (
        "--advantage_estimator group_norm --baseline.policy_loss clip_cov --baseline.clip_cov_ratio 0.001 "
        "--baseline.clip_cov_lb 0.5 --baseline.clip_cov_ub 4 --baseline.curation pf_ppo_bw "
        "--baseline.pf_ppo_keep_count --baseline.seed_grpo_alpha 0.25 --actor.eps_clip_low_high 1 1"
    ).split()
    config = fork_hooks.ExperienceGeometry(parse(up, monkeypatch, argv)).pipeline.config.baseline
    assert (config.policy_loss, config.clip_cov_ratio, config.clip_cov_lb, config.clip_cov_ub) == (
        "clip_cov",
        0.001,
        0.5,
        4.0,
    )
    assert (config.curation, config.pf_ppo_keep_count, config.seed_grpo_alpha) == ("pf_ppo_bw", True, 0.25)
    argv = "--advantage_estimator group_norm --baseline.policy_loss kl_cov --baseline.kl_cov_ratio 0.01 "
    kl = parse(up, monkeypatch, [*argv.split(), "--baseline.kl_cov_coef", "2"])
    assert (kl.baseline.kl_cov_ratio, kl.baseline.kl_cov_coef) == (0.01, 2.0)


@pytest.mark.parametrize(
    "argv,message",
    [
        ("--salt.variant full", "--salt.variant only applies with --advantage_estimator salt"),
        ("--advantage_estimator salt --salt.dim 1000", "--salt.dim must be a perfect square"),
        ("--geoalign.mode replace", "--geoalign.mode only applies with --geoalign.enable"),
        ("--reward.noise.rate 0.1", "needs --reward.noise.type flip or swap"),
        ("--advantage_estimator group_norm --geoalign.enable --geoalign.mode drop", "--geoalign.mode drop changes"),
        ("--advantage_estimator reinforce_baseline --geoalign.enable", "needs a per-prompt group estimator"),
        ("--advantage_estimator salt --salt.base reinforce_baseline", "upstream whitens the whole batch after"),
        ("--salt.diagnostics --salt.variant only-main", "--salt.variant only applies with --advantage_estimator"),
        ("--advantage_estimator group_norm --geoalign.enable --geoalign.device cuda", "starts without a GPU"),
        ("--advantage_estimator salt --ds.ring_attn_size 2 --vllm.num_engines 1", "--ds.ring_attn_size 2 splits"),
        ("--salt.diagnostics --ds.ring_attn_size 2 --vllm.num_engines 1", "(its --salt.diagnostics too)"),
        (
            "--advantage_estimator salt --train.batch_size 30",
            "--train.batch_size 30 is not a multiple of --rollout.n_samples_per_prompt 4: --advantage_estimator salt "
            "partitions rollouts by whole prompts",
        ),
        ("--salt.diagnostics --train.batch_size 2", "use --train.batch_size 4, or set --salt.group_prompts"),
        ("--actor.model_name_or_path /nonexistent/model", "--actor.model_name_or_path /nonexistent/model: no such"),
        ("--actor.model_name_or_path ./no/model", "--actor.model_name_or_path ./no/model: no such file or directory"),
        ("--actor.model_name_or_path ~/no/model", "--actor.model_name_or_path ~/no/model: no such file or directory"),
        ("--reward.model_name_or_path org/rm,../no/rm", "--reward.model_name_or_path ../no/rm: no such file or"),
        ("--advantage_estimator bogus", "invalid choice: 'bogus'"),
        ("--baseline.par_references 2", "PAR needs, every step, reward-model scores of M reference responses"),
        ("--baseline.curation pods --baseline.pods_m 2", "--baseline.curation pods drops rollouts"),
        ("--advantage_estimator group_norm --baseline.curation pf_ppo_br", "use PF-PPO with --baseline.pf_ppo_keep"),
        ("--baseline.curation pf_ppo_br --baseline.pf_ppo_keep_count --geoalign.enable", "use one of them"),
        ("--advantage_estimator reinforce_baseline --baseline.seed_grpo_alpha 0.5", "needs a per-prompt group"),
        ("--baseline.policy_loss clip_cov --actor.dual_clip 3", "--actor.dual_clip would be silently ignored"),
        ("--baseline.policy_loss kl_cov --actor.policy_loss_type gspo", "gspo would be silently ignored"),
        ("--baseline.kl_cov_ratio 0.1", "--baseline.kl_cov_ratio only applies with --baseline.policy_loss kl_cov"),
        ("--baseline.policy_loss clip_cov --actor.eps_clip_low_high 1.5 1.5", "a low PPO clip ratio <= 1 (got 1.5)"),
        (  # upstream's assertion (a traceback) came after parsing
            "--advantage_estimator salt --rollout.n_samples_per_prompt 1",
            "--rollout.n_samples_per_prompt must be >= 2 (group baselines) with --advantage_estimator salt: each "
            "prompt's samples are its baseline (got 1)",
        ),
        ("--advantage_estimator group_norm --rollout.n_samples_per_prompt 1", "with --advantage_estimator group_norm"),
    ],
)
def test_invalid_combinations_fail_at_parse_time(up, monkeypatch, capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, argv.split())
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "invalid choice" not in message:  # the fork's refusals: one line, not after upstream's ~200 lines of usage
        assert len(err.splitlines()) == 1 and err.startswith(f"{PROG}: error: "), err


def test_one_sample_per_prompt_still_parses_for_an_estimator_without_groups(up, monkeypatch):
    args = parse(up, monkeypatch, "--advantage_estimator flash_reinforce --rollout.n_samples_per_prompt 1".split())
    assert args.algo.advantage.estimator == "flash_reinforce" and args.rollout.n_samples_per_prompt == 1


@pytest.mark.parametrize(
    "argv",
    [
        "--advantage_estimator salt --algo.advantage.estimator group_norm",  # parsed to GRPO with SALT off
        "--algo.advantage.estimator group_norm --advantage_estimator salt",
        "--advantage_estimator reinforce_baseline --algo.advantage.estimator salt",  # parsed to SALT on group_norm
    ],
)
def test_the_two_estimator_spellings_given_different_values_are_refused(up, monkeypatch, capsys, argv):
    """(the local engine's alike: tests/test_local_cli.py)"""
    first, first_value, second, second_value = argv.split()
    with pytest.raises(SystemExit) as caught:  # before train(), so before Ray starts
        parse(up, monkeypatch, argv.split())
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PROG}: error: {first} {first_value} and {second} {second_value}: one setting given two values (the last "
        "would silently win); give it once"
    ]


def test_the_two_estimator_spellings_given_the_same_value_parse(up, monkeypatch):
    args = parse(up, monkeypatch, "--advantage_estimator salt --algo.advantage.estimator salt".split())
    assert args.salt.enable and args.algo.advantage.estimator == "group_norm"
    assert not hasattr(args, "estimator_spellings")  # read at parse time, not a flag a checkpoint stores


@pytest.mark.parametrize("flag", ["--ckpt.output_dir", "--ckpt.path"])
def test_an_empty_output_folder_is_refused_at_parse_time(up, monkeypatch, capsys, flag):
    """ "" is the current directory: the run trained to the end, then its final save failed on it."""
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, ["--advantage_estimator", "group_norm", flag, ""])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"{PROG}: error: {flag} is empty: give a folder"]


def write_checkpoint(ckpt_path, args, tag="global_step2"):
    """What upstream's actor save leaves in --ckpt.path, as far as the parse-time resume check reads it: `latest`,
    and a model-states file whose client states hold the fork's flags."""
    folder = ckpt_path / "_actor" / tag
    folder.mkdir(parents=True)
    states = {"module": {"w": torch.zeros(4)}, fork_hooks.FLAGS_KEY: fork_flags.resume_flags(args)}
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    (ckpt_path / "_actor" / "latest").write_text(tag)
    return states


def test_a_resume_with_changed_flags_is_refused_at_parse_time(up, monkeypatch, capsys, tmp_path):
    """Refused before Ray starts (it was refused at the checkpoint's load, 80 s in); a default spelled out is no
    change, at parse time and at the load alike."""
    ckpt = tmp_path / "ckpt"
    run = ["--advantage_estimator", "salt", "--ckpt.path", str(ckpt), "--ckpt.output_dir", str(tmp_path / "out")]
    states = write_checkpoint(ckpt, parse(up, monkeypatch, [*run, "--ckpt.save_steps", "2"]))
    resume = [*run, "--ckpt.save_steps", "2", "--ckpt.load_enable"]
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, [*resume, "--salt.k_rule", "code", "--train.batch_size", "8"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PROG}: error: --ckpt.load_enable: {ckpt}/_actor/global_step2 was written with other flags: --salt.k_rule "
        "'paper' -> 'code'; --train.batch_size 128 -> 8. Resume with the checkpoint's values, or start a new "
        "--ckpt.path"
    ]
    spelled = parse(up, monkeypatch, [*resume, "--salt.k_rule", "paper", "--salt.base", "group_norm"])
    fork_hooks.load_geometry_state(NS(args=spelled), states)  # the load's own comparison agrees
    (ckpt / "_actor" / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"damaged")
    # unreadable here, and no intact checkpoint before it to fall back to (fork_hooks.fall_back_from_damaged)
    with pytest.raises(SystemExit, match=r"model_states.pt is damaged \(checkpoint global_step2, step 2\)"):
        parse(up, monkeypatch, [*resume, "--salt.k_rule", "code"])


def test_a_save_folder_that_cannot_be_written_is_refused_at_parse_time(up, monkeypatch, capsys, tmp_path):
    """Found before Ray starts, not at the first save hours in (a real read-only mount: tests/test_fork_faults.py)."""
    blocker, GRPO = tmp_path / "a_file", ["--advantage_estimator", "group_norm"]
    blocker.write_text("")
    for argv, flag in (
        (["--ckpt.save_steps", "1", "--ckpt.path", str(blocker / "ckpt")], "--ckpt.path"),
        (["--ckpt.output_dir", str(blocker / "out")], "--ckpt.output_dir"),
    ):
        with pytest.raises(SystemExit) as caught:
            parse(up, monkeypatch, [*GRPO, "--ckpt.output_dir", str(tmp_path / "out"), *argv])
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag} {blocker}/" in err and "cannot write there (Not a directory" in err, err
    # --ckpt.path is only written with periodic saves; a folder that does not exist yet is created by upstream
    args = parse(
        up, monkeypatch, [*GRPO, "--ckpt.path", str(blocker / "ckpt"), "--ckpt.output_dir", str(tmp_path / "new")]
    )
    assert args.ckpt.path == str(blocker / "ckpt") and not (tmp_path / "new").exists()

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", kwargs.get("dir"))

    monkeypatch.setattr(fork_flags.tempfile, "TemporaryFile", read_only)  # as root, permission bits do not stop it
    with pytest.raises(SystemExit):
        parse(up, monkeypatch, [*GRPO, "--ckpt.output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"--ckpt.output_dir {tmp_path / 'out'}: cannot write there (Read-only file system" in err


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision here: it loads")
def test_a_vision_language_actor_whose_processor_cannot_load_is_refused_naming_image_key(
    up, monkeypatch, capsys, tmp_path
):
    """A Qwen2-VL's processor carries a video processor that needs torchvision, which the CPU engines leave out:
    upstream's driver, trainer and vLLM engines would each raise transformers' ImportError after Ray started."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig

    vlm = tmp_path / "qwen2-vl"
    Qwen2VLConfig().save_pretrained(vlm)  # the config is what marks a VLM (upstream's is_vlm_model); no weights read
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                         "<|video_pad|>", "Q"])}  # fmt: skip
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="Q"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(vlm)
    (vlm / "processor_config.json").write_text(
        '{"processor_class": "Qwen2VLProcessor", '
        '"image_processor": {"image_processor_type": "Qwen2VLImageProcessor"}, '
        '"video_processor": {"video_processor_type": "Qwen2VLVideoProcessor"}}'
    )
    argv = ["--advantage_estimator", "salt", "--geoalign.enable", "--actor.model_name_or_path", str(vlm)]
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, [*argv, "--data.max_images_per_prompt", "1"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"{PROG}: error: --data.image_key: --actor.model_name_or_path {vlm} is a vision-language model whose "
        "processor cannot load here (ImportError: Qwen2VLVideoProcessor requires the Torchvision library but it was "
        "not found in your environment); upstream needs it for the images\n"
    )
    (vlm / "config.json").write_text((vlm / "config.json").read_text().replace('"vision_config"', '"text_only"'))
    assert parse(up, monkeypatch, argv).actor.model_name_or_path == str(vlm)  # a text model: its tokenizer only


def test_async_training_and_partial_rollouts_keep_salt_partitions_as_optimizer_steps(up, monkeypatch):
    """Upstream's asynchronous trainer trains through the patched train_step and ppo_train (rank_batches), so
    SALT's partitions stay optimizer steps there, with partial rollouts too: no warning, the same partitions."""
    from openrlhf_geo import GeoWarning

    argv = ["--advantage_estimator", "salt", "--train.batch_size", "8"]
    for extra in ([], ["--train.async_enable"], ["--train.async_enable", "--train.partial_rollout_enable"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", GeoWarning)
            args = parse(up, monkeypatch, [*argv, *extra])
        assert fork_hooks.aligned_partitions(args) == 2, extra  # prompts per partition = per optimizer step
