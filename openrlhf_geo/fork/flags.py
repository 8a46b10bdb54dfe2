"""The fork's parse time, called by the cli/train_ppo_ray.py diff before Ray starts: its flags on upstream's parser
(`add_args`) and their checks (`validate_args`): flag combinations, local paths and .jsonl datasets
(`check_datasets`), a vision-language actor's processor (`check_processor`), writable output folders, outputs of an
earlier run (`check_outputs`). Each refusal is a ValueError naming the flag, shown as one line. `resume_flags` is what
a checkpoint stores and a resume compares."""

import errno
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from openrlhf_geo import GeoWarning, options, registry
from openrlhf_geo.jsonl import iter_jsonl
from openrlhf_geo.local import rundir
from openrlhf_geo.registry import POLICY_LOSSES


def add_args(parser) -> None:
    """The fork's flags on upstream's parser: the ones both engines share (`options.add_args`) and --ckpt.overwrite
    (the local engine's flag of that name, with this engine's meaning: `check_outputs`)."""
    options.add_args(parser)
    # the estimators registered without an upstream branch (registry.ESTIMATORS, upstream=False) are choices of
    # upstream's --advantage_estimator too: options.validate maps them onto upstream's dr_grpo path and the pipeline
    # computes them (GeometryBatch.salt)
    action = next(a for a in parser._actions if a.dest == "algo.advantage.estimator")
    added = [name for name, entry in registry.ESTIMATORS.items() if not entry.upstream and name not in action.choices]
    action.choices = [*action.choices, *added]
    action.__class__ = options.EstimatorFlag  # upstream's store action, also keeping each spelling's value
    parser.add_argument(
        "--ckpt.overwrite",
        action="store_true",
        default=False,
        help="openrlhf-geo: start over where an earlier run wrote: deletes its checkpoints in --ckpt.path (_actor/, "
        "_critic/, *_hf/); the final save writes over its model in --ckpt.output_dir (other files there stay)",
    )


def validate_args(args) -> None:
    """`options.validate` for the fork (which also asks the registries what the fork cannot run), then the fork's
    own limits and input checks; raises ValueError naming the flag (shown in one line, exit 2). Deletes nothing:
    --ckpt.overwrite's deletion runs after upstream's checks too (`clear_checkpoints`)."""
    options.validate(args, engine="fork")
    n = args.rollout.n_samples_per_prompt
    if n < 2 and args.algo.advantage.estimator in registry.ESTIMATORS:  # upstream asserts it after parsing
        salt = args.geometry.salt
        named = "salt" if salt is not None and salt.apply else args.geometry.estimator or args.algo.advantage.estimator
        raise ValueError(
            f"--rollout.n_samples_per_prompt must be >= 2 (group baselines) with --advantage_estimator {named}: "
            f"each prompt's samples are its baseline (got {n})"
        )
    for flag, value in (("--ckpt.output_dir", args.ckpt.output_dir), ("--ckpt.path", args.ckpt.path)):
        if not value:  # "" would be the current directory, and upstream's final save fails on it after the run
            raise ValueError(f"{flag} is empty: give a folder")
    for flag in ("--actor.model_name_or_path", "--critic.model_name_or_path", "--reward.model_name_or_path"):
        section, name = flag[2:].split(".", 1)
        value = getattr(getattr(args, section), name)
        for part in value.split(",") if value else ():  # upstream takes several reward models, comma-separated
            options.check_local_path(flag, part)
    check_datasets(args)
    check_processor(args.actor.model_name_or_path)
    # a folder the policy actor cannot write fails only at the first checkpoint or the final save, hours in: probe it
    # here (a file created and removed in the folder, or in its nearest existing parent; root ignores permission
    # bits, so os.access cannot tell). The driver's view: on several nodes the folder must be the same shared one.
    saving = {"--ckpt.output_dir": args.ckpt.output_dir}
    if writes_checkpoints(args):
        saving["--ckpt.path"] = args.ckpt.path
    for flag, value in saving.items():
        folder = Path(value).expanduser().absolute()
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            if not folder.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            raise ValueError(
                f"{flag} {value}: cannot write there ({e.strerror}: {folder}); the run would fail at its first save"
            ) from None
    reads_responses = args.geometry.salt is not None or args.geometry.geoalign is not None
    if reads_responses and args.ds.ring_attn_size > 1:
        raise ValueError(
            f"--ds.ring_attn_size {args.ds.ring_attn_size} splits each response across ranks, but SALT (its "
            "--salt.diagnostics too) and GeoAlign read every response's features and last hidden state from one "
            "forward: use --ds.ring_attn_size 1"
        )
    baseline = args.geometry.baseline
    if baseline is not None and not POLICY_LOSSES[baseline.policy_loss].upstream:
        ignored = {
            "--actor.dual_clip": args.actor.dual_clip is not None,
            "--actor.policy_loss_type gspo": args.actor.policy_loss_type != "ppo",
            "--algo.advantage.is_correction_level": args.algo.advantage.is_correction_level != "off",
        }
        given = [flag for flag, on in ignored.items() if on]
        if given:
            raise ValueError(
                f"--baseline.policy_loss {baseline.policy_loss} replaces PolicyLoss's per-token surrogate, so "
                f"{given[0]} would be silently ignored: drop it"
            )
    check_outputs(args)


def check_datasets(args) -> None:
    """Each local .jsonl file of --data.prompt_dataset and --eval.dataset read here as `openrlhf-geo train` reads
    its datasets (`iter_jsonl`, one line at a time: a missing file, bad UTF-8, a line that is not a JSON object), and
    checked for rows and the --data.input_key (and --data.label_key when given) of every one: ValueError naming the
    flag, file and line, instead of a Ray actor's traceback half a minute after the cluster started. The fields are
    not type-checked (--data.apply_chat_template takes message lists; a .py reward_func any label); empty prompts
    (blank text, no messages) are trained as written, with one GeoWarning counting them, as `openrlhf-geo train`
    does. Hub names, folders and other formats are upstream's to load (`blending_datasets`: comma-separated entries,
    each `path[@data_dir]`)."""
    for flag, value in (("--data.prompt_dataset", args.data.prompt_dataset), ("--eval.dataset", args.eval.dataset)):
        for entry in value.split(",") if value else ():
            path = entry.split("@")[0].strip()
            if not path.endswith(".jsonl"):
                continue
            keys = {"--data.input_key": args.data.input_key, "--data.label_key": args.data.label_key}
            rows, empty = 0, []
            for number, row in iter_jsonl(path, flag):
                rows += 1
                for key_flag, key in keys.items():
                    if key is not None and key not in row:
                        raise ValueError(
                            f"{flag} {path}:{number}: no {key!r} field ({key_flag}; the line has {sorted(row)})"
                        )
                prompt = row[args.data.input_key]
                if not (prompt.strip() if isinstance(prompt, str) else prompt):
                    empty.append(number)
            if not rows:
                raise ValueError(f"{flag} {path}: no rows")
            if empty:
                warnings.warn(
                    f"{len(empty)} of the {rows} prompts of {flag} {path} are empty (the first on line {empty[0]}; "
                    f"--data.input_key {args.data.input_key!r}): they are trained on as written",
                    GeoWarning,
                    stacklevel=2,
                )


def check_processor(model) -> None:
    """A local vision-language actor (its config has `vision_config`, upstream's `is_vlm_model`) is loaded with its
    AutoProcessor by the driver, the trainer and every vLLM engine, to put --data.image_key's images into the prompts:
    one that cannot load here is refused naming the cause, instead of an ImportError from Ray actors. The Qwen-VL
    processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) carry a video processor that needs torchvision, which the CPU
    engines leave out (requirements/engines-cpu.txt). Hub ids are upstream's to load."""
    if not model or not Path(model, "config.json").is_file():
        return
    try:
        config = json.loads(Path(model, "config.json").read_text())
    except (OSError, ValueError):  # unreadable: upstream's load names it
        return
    if not isinstance(config, dict) or "vision_config" not in config:
        return
    from transformers import AutoProcessor

    try:
        AutoProcessor.from_pretrained(model, trust_remote_code=True)
    except Exception as e:  # an ImportError without torchvision; a registry torchvision's RuntimeError on CPU torch
        cause = " ".join(str(e).split()).split(". ")[0]  # transformers' message: its first sentence, on one line
        raise ValueError(
            f"--data.image_key: --actor.model_name_or_path {model} is a vision-language model whose processor "
            f"cannot load here ({type(e).__name__}: {cause}); upstream needs it for the images"
        ) from None


def writes_checkpoints(args) -> bool:
    """Whether upstream writes checkpoints into --ckpt.path: every --ckpt.save_steps steps, and at evaluations that
    improve the --ckpt.best_metric_key metric (best_global_step<N>)."""
    evaluates = args.eval.dataset and args.eval.steps > 0 and args.ckpt.best_metric_key != "none"
    return args.ckpt.save_steps > 0 or bool(evaluates)


def check_outputs(args) -> None:
    """Refuse (ValueError naming the flag and folder) a run that would write over an earlier one, as `openrlhf-geo
    train` refuses a used --ckpt.output_dir (local.rundir.claim): upstream replaces the final model in
    --ckpt.output_dir (the critic's in <output_dir>_critic with --critic.save_value_network) and, when it writes
    checkpoints (`writes_checkpoints`), the checkpoints of the same tags in --ckpt.path, without a word.

    A folder holding anything but the folders of the run's other outputs nested in it (upstream's default
    --ckpt.path is inside its default --ckpt.output_dir) is used. --ckpt.load_enable with upstream's checkpoint
    (<ckpt.path>/_actor) is a resume: it continues that run, writing over its outputs. --ckpt.overwrite starts over
    (`clear_checkpoints` deletes the earlier run's checkpoints once every check has passed)."""
    ckpt = args.ckpt
    checkpoint = Path(ckpt.path, "_actor")
    if ckpt.load_enable and checkpoint.is_dir():
        check_resume(args, checkpoint)
        return
    outputs = [("--ckpt.output_dir", ckpt.output_dir)]
    if args.critic.save_value_network and args.algo.advantage.estimator == "gae":
        outputs.append(("--ckpt.output_dir", ckpt.output_dir + "_critic"))
    if writes_checkpoints(args):
        outputs.append(("--ckpt.path", ckpt.path))
    folders = [os.path.abspath(p) for p in (ckpt.output_dir, ckpt.path, args.logger.tensorboard_dir) if p]

    def holds_another_output(entry):
        where = os.path.abspath(entry.path)
        return any(p == where or p.startswith(where + os.sep) for p in folders)

    for flag, folder in outputs:
        if not os.path.isdir(folder):
            continue
        # the lock and record of a run's folders (fork_hooks.claim_outputs) are not a run's output
        held = sorted(
            entry.name
            for entry in os.scandir(folder)
            if entry.name not in (rundir.LOCK, rundir.RECORD) and not holds_another_output(entry)
        )
        if not held or ckpt.overwrite:
            continue
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        if ckpt.load_enable:
            raise ValueError(
                f"--ckpt.load_enable: {checkpoint} holds no checkpoint to resume, and {flag} {folder} holds an "
                f"earlier run ({shown}); replace it with --ckpt.overwrite, or choose another {flag}"
            )
        resume = "resume it with --ckpt.load_enable, " if checkpoint.is_dir() else ""
        raise ValueError(
            f"{flag} {folder} already holds a run ({shown}); {resume}replace it with --ckpt.overwrite, or choose "
            f"another {flag}"
        )


# What a resumed run must share with its checkpoint: the fork's sections and the batch shape SALT's partitions and
# GeoAlign's groups are built from. Anything else (episodes, logging, eval) may change on resume.
RESUME_FLAGS = ("salt", "geoalign", "baseline", "reward.noise", "algo.advantage.estimator",
                "rollout.n_samples_per_prompt", "rollout.batch_size", "train.batch_size")  # fmt: skip


def resume_flags(args) -> dict:
    """{"--section.flag": value} of RESUME_FLAGS, read off upstream's hierarchical namespace."""
    flags = options.flag_config(args)
    return {f"--{k}": v for k, v in flags.items() if any(k == f or k.startswith(f"{f}.") for f in RESUME_FLAGS)}


def resume_changes(saved: dict, args) -> list[str]:
    """'--flag old -> new' for each of the checkpoint's `resume_flags` (`saved`) that this run changes, settings
    compared as their configs use them (`options.settled`: a default spelled out is no change)."""

    def settled(flags):
        return {f"--{k}": v for k, v in options.settled({k.removeprefix("--"): v for k, v in flags.items()}).items()}

    old, now = settled(saved), settled(resume_flags(args))
    return [
        f"{k} {old.get(k)!r} -> {now.get(k)!r}" for k in sorted(old.keys() | now.keys()) if old.get(k) != now.get(k)
    ]


FLAGS_KEY = "openrlhf_geo_flags"  # checkpoint client_states entry


def latest_tag(save_dir) -> str | None:
    """The tag DeepSpeed's `latest` file in `save_dir` names (None without one): the last complete checkpoint, which
    the patched rotation never deletes before the checkpoint replacing it is written (with --ckpt.max_num 1 or the
    --ckpt.max_mem limit reached, the folder holds one checkpoint more while a save runs)."""
    try:
        return Path(save_dir, "latest").read_text().strip() or None
    except FileNotFoundError:
        return None


def check_resume(args, checkpoint: Path) -> None:
    """--ckpt.load_enable: refuse before Ray starts, naming each flag, a resume that changes `resume_changes` from
    the checkpoint DeepSpeed's `latest` names in `checkpoint` (<ckpt.path>/_actor). Its flags are read from its
    model-states file, memory-mapped so that the weights in it are not read; a checkpoint that cannot be read here is
    left to the load, which compares them again (`load_geometry_state`)."""
    tag = latest_tag(checkpoint)
    files = sorted(Path(checkpoint, tag).glob("*mp_rank_00_model_states.pt")) if tag else []
    try:
        # the user's own checkpoint, which DeepSpeed's load unpickles alike
        states = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # missing, damaged, an older torch format: the load reports it
        return
    saved = states.get(FLAGS_KEY) if isinstance(states, dict) else None
    changed = resume_changes(saved, args) if saved is not None else []
    if changed:
        raise ValueError(
            f"--ckpt.load_enable: {files[0].parent} was written with other flags: {'; '.join(changed)}. Resume with "
            "the checkpoint's values, or start a new --ckpt.path"
        )
