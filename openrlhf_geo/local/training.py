"""`openrlhf-geo train`: a single-process GRPO / Dr.GRPO / DAPO run with optional SALT and GeoAlign.

Flag names follow upstream OpenRLHF 0.11.2 (`--rollout.n_samples_per_prompt`, `--actor.eps_clip_low_high`, ...)
and the fork (`--advantage_estimator salt`, `--salt.*`, `--geoalign.*`, `--reward.noise.*`), so a local run
translates to a Ray run flag by flag. Example, continuing from the demo's SFT model::

    openrlhf-geo train --actor.model_name_or_path runs/demo/sft --data.prompt_dataset runs/demo/data/train.jsonl \\
        --rollout.max_new_tokens 48 --actor.adam.lr 3e-4 \\
        --advantage_estimator salt --salt.features exact --train.steps 50 --ckpt.output_dir runs/my_salt

Writes `<ckpt.output_dir>/metrics.jsonl` (one JSON object per step), `checkpoint.pt` (resume with
`--ckpt.load_enable`) and the final model + tokenizer (`save_pretrained`) in `<ckpt.output_dir>/model`; with
`--use_tensorboard` / `--use_wandb` the same metrics as upstream's `train/<key>` and `eval/<key>` (`tracking`).

A run never silently replaces another: a used output directory needs `--ckpt.load_enable` (resume) or
`--ckpt.overwrite`, a lock keeps two runs out of one directory, and a resume refuses flags that would change the
training (`rundir.SAFE_TO_CHANGE` lists the ones it accepts). Bad input is a one-line error naming the flag, file
and line, without a traceback: exit status 2 for bad flags, 1 for bad files, an unusable output directory or
checkpoint, or a run that must stop (e.g. non-finite weights, which are never written).

One way to build and run a local training run, for `openrlhf-geo train`, the demo and the studies alike.

`run` takes validated flags (`flags.parse_args`) to a finished run in --ckpt.output_dir: the data and the flags'
record are read first (bad input touches nothing), then the directory is claimed (`rundir.claim`: fresh, resumed
or started over), the model loaded, the engine built (`make_trainer`: prompts measured against the model's
positions), the steps fitted (`fit`: metrics.jsonl, gdi.jsonl, checkpoints, --logger.* loggers) and the final model
saved. A start that fails before writing anything leaves no lock file or new directory behind (`rundir.locked`).
"""

import contextlib
import json
import os
import sys
import warnings
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from openrlhf_geo import GeoWarning
from openrlhf_geo.jsonl import parse_line, strict_json
from openrlhf_geo.local import rundir
from openrlhf_geo.local.flags import build_parser, check_resume_config, parse_args, run_config
from openrlhf_geo.local.reward import CachedMathVerify, make_reward_fn
from openrlhf_geo.options import check_local_path

# The longest prompt a dataset may hold, checked when it is read, before a tokenizer sees it: tokenizing holds ~150
# bytes a character, and one 50 MB prompt grew a run past 24 GB. 16 characters for each of the engine's
# MAX_PROMPT_TOKENS (engine.py) leave room for any prompt the engine can train on.
MAX_PROMPT_CHARS = 2_097_152


class PromptRows(Sequence):
    """The {"prompt", "answer"} rows of a jsonl dataset that `read_dataset` checked, read again from the file when
    used: memory holds two int64 numbers a row (the line's byte offset and number), not its text.

    `source` ("<flag> <path>") and `where(i)` ("<flag> <path>:<line>") name the file and a row in messages. A file
    whose size or modification time changed since it was checked is a ValueError naming it (its rows moved).
    """

    def __init__(self, path, flag, input_key, label_key):
        self.path, self.source, self.keys = Path(path), f"{flag} {path}", (input_key, label_key)
        self.offsets, self.lines, self.stamp = array("q"), array("q"), None

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        with self.open_checked() as handle:
            handle.seek(self.offsets[i])
            return self.row(parse_line(handle.readline(), self.lines[i], self.source), self.lines[i])

    def __iter__(self):  # one sequential pass over the file (a seek a row would refill the read buffer each time)
        with self.open_checked() as handle:
            lines = iter(self.lines)
            wanted = next(lines)
            for number, raw in enumerate(handle, 1):
                if number == wanted:
                    yield self.row(parse_line(raw, number, self.source), number)
                    wanted = next(lines, None)

    def where(self, i):
        return f"{self.source}:{self.lines[i]}"

    def open_checked(self):
        """The file, binary; ValueError naming it when it cannot be read or changed since `read_dataset`."""
        try:
            handle = open(self.path, "rb")
        except OSError as error:
            raise ValueError(f"{self.source}: {error.strerror}") from None
        stat = os.fstat(handle.fileno())
        if self.stamp is None:
            self.stamp = stat.st_size, stat.st_mtime_ns
        elif (stat.st_size, stat.st_mtime_ns) != self.stamp:
            handle.close()
            raise ValueError(
                f"{self.source}: changed since the run read it (size or modification time); restore it, or start "
                "the run again"
            )
        return handle

    def row(self, row, number):
        """{"prompt", "answer"} of a parsed line; ValueError naming the flag, file and line of a bad one."""
        for key, key_flag in zip(self.keys, ("--data.input_key", "--data.label_key")):
            if key not in row:
                raise ValueError(f"{self.source}:{number}: no {key!r} field ({key_flag}; the line has {sorted(row)})")
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(
                    f"{self.source}:{number}: {key!r} must be a string or number (got {json.dumps(value)})"
                )
        return {"prompt": str(row[self.keys[0]]), "answer": str(row[self.keys[1]])}


def read_dataset(path, input_key, label_key, flag):
    """The {"prompt", "answer"} rows of a jsonl dataset (`PromptRows`), checked in one pass that holds one line at a
    time; ValueError naming the flag, file and line of a bad row or of a prompt longer than MAX_PROMPT_CHARS, or
    the file of one without rows. Empty (or blank) prompts are trained as written, with one GeoWarning counting them.
    """
    rows = PromptRows(path, flag, input_key, label_key)
    offset, empty = 0, []
    with rows.open_checked() as handle:
        for number, raw in enumerate(handle, 1):
            parsed = parse_line(raw, number, rows.source)
            if parsed is not None:
                prompt = rows.row(parsed, number)["prompt"]
                if len(prompt) > MAX_PROMPT_CHARS:
                    raise ValueError(
                        f"{rows.source}:{number}: the prompt is {len(prompt)} characters, over the limit of "
                        f"{MAX_PROMPT_CHARS} (MAX_PROMPT_CHARS)"
                    )
                rows.offsets.append(offset)
                rows.lines.append(number)
                if not prompt.strip():
                    empty.append(number)
            offset += len(raw)
    if not rows:
        raise ValueError(f"{rows.source}: no rows")
    if empty:
        warnings.warn(
            f"{len(empty)} of the {len(rows)} prompts of {rows.source} are empty (the first on line {empty[0]}; "
            f"--data.input_key {input_key!r}): they are trained on as written",
            GeoWarning,
            stacklevel=2,
        )
    return rows


@contextlib.contextmanager
def _quiet_transformers():
    """No transformers/hub progress bars inside (weight loading, shard writing): the run's own bar is the one shown."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model(args, device):
    """(model, tokenizer) from --actor.*; a local path that does not exist or a failed load (a missing, truncated or
    malformed file, weights of another shape) is a one-line ValueError naming the flag and the cause (a hub id still
    downloads, with the hub's progress bar)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    actor = args.actor
    for flag, value in (
        ("--actor.model_name_or_path", actor.model_name_or_path),
        ("--actor.config", actor.config),
        ("--actor.tokenizer", actor.tokenizer),
    ):
        check_local_path(flag, value)
    source = ("--actor.model_name_or_path", actor.model_name_or_path)  # what is being loaded, for the error
    try:
        if actor.model_name_or_path is not None:
            local = Path(actor.model_name_or_path).exists()
            with _quiet_transformers() if local else contextlib.nullcontext():
                model = AutoModelForCausalLM.from_pretrained(actor.model_name_or_path, dtype=torch.float32)
        else:
            source = ("--actor.config", actor.config)
            with torch.random.fork_rng():
                torch.manual_seed(args.train.seed)
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(actor.config))
        if actor.tokenizer is not None:
            source = ("--actor.tokenizer", actor.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(actor.tokenizer or actor.model_name_or_path)
    except OSError as error:  # transformers' "not a model directory / not on the hub / offline" errors
        raise ValueError(f"{source[0]} {source[1]}: {str(error).strip().splitlines()[0]}") from None
    except Exception as error:  # a damaged file: safetensors, JSON, config validation and shape errors, among others
        lines = [line.strip() for line in str(error).strip().splitlines()] or [""]
        detail = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "Validation error for field 'x':"
        raise ValueError(f"{source[0]} {source[1]}: cannot load it ({type(error).__name__}: {detail[:300]})") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{source[0]} {source[1]}: the tokenizer has no EOS token; rollouts need one to end")
    return model.to(device), tokenizer


def fit(
    trainer,
    steps,
    out_dir,
    eval_steps=-1,
    eval_samples=1,
    save_steps=-1,
    tags=None,
    progress=None,
    config=None,
    loggers=(),
):
    """Run RL steps up to `steps` (continuing from trainer.global_step) -> the metric rows written.

    Writes one JSON object per step to <out_dir>/metrics.jsonl (plus `tags`, e.g. method and seed) and, with
    GeoAlign, each step's per-rollout GDI / corruption / flags to <out_dir>/gdi.jsonl; evaluates
    every `eval_steps` steps (and before the first step when starting fresh), checkpoints every `save_steps` and at
    the end (`rundir.save_checkpoint`, storing `config`, the run's flags). Each row also goes to every logger's
    `log(step, row)` (`tracking`); `progress(row)` is called after each step. A fresh run (global_step 0) starts
    the logs over; a resumed one keeps their rows up to its step (`rundir.trim_jsonl`) and appends.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tags = tags or {}
    rows = []
    for name in ("metrics.jsonl", "gdi.jsonl"):
        if trainer.global_step == 0:
            (out_dir / name).unlink(missing_ok=True)
        else:
            rundir.trim_jsonl(out_dir / name, trainer.global_step)

    def write(row):
        row = {**tags, **row}
        rows.append(row)
        with (out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({k: strict_json(v) for k, v in row.items()}) + "\n")
        for logger in loggers:
            logger.log(row["step"], row)

    saved = trainer.global_step if trainer.global_step > 0 else None  # a resumed state is already on disk
    if eval_steps > 0 and trainer.global_step == 0:
        write({"step": 0, **trainer.evaluate(eval_samples)})
    while trainer.global_step < steps:
        row = trainer.step()
        if trainer.last_curation is not None:
            record = {k: None if v is None else strict_json(v.tolist()) for k, v in trainer.last_curation.items()}
            with (out_dir / "gdi.jsonl").open("a") as f:
                f.write(json.dumps({**tags, "step": trainer.global_step, **record}) + "\n")
        if eval_steps > 0 and (trainer.global_step % eval_steps == 0 or trainer.global_step == steps):
            row.update(trainer.evaluate(eval_samples))
        write(row)
        if save_steps > 0 and trainer.global_step % save_steps == 0:
            rundir.save_checkpoint(out_dir, trainer.state_dict(), config)
            saved = trainer.global_step
        if progress is not None:
            progress(row)
    if saved != trainer.global_step:
        rundir.save_checkpoint(out_dir, trainer.state_dict(), config)
    return rows


def make_loggers(args, out, config, resumed_step):
    """The TensorBoard / wandb loggers the --logger.* flags ask for (`tracking`)."""
    from openrlhf_geo.local import tracking

    loggers = []
    if args.logger.tensorboard_dir is not None:
        log_dir = args.logger.tensorboard_dir or out / "tensorboard"
        loggers.append(tracking.TensorboardLogger(log_dir, resumed_step))
    wandb = args.logger.wandb
    if wandb.key is not None:
        loggers.append(
            tracking.WandbLogger(
                out, config, wandb.project, wandb.run_name, wandb.group, wandb.org, wandb.key, resumed_step > 0
            )
        )
    return loggers


def make_trainer(args, model, tokenizer, rows, reward_fn, eval_rows=None, rollout_stats=None, misspecified_pay=None):
    """The engine's Trainer; Seed-GRPO checks answer pairs in the math reward's worker pool when the reward is the
    math-verify memo (its timeout applies), otherwise in the engine's process."""
    from openrlhf_geo.local.engine import Trainer

    verifier = reward_fn.scorer if isinstance(reward_fn, CachedMathVerify) else None
    return Trainer(args, model, tokenizer, rows, reward_fn, eval_rows, rollout_stats, misspecified_pay, verifier)


def run(
    args,
    reward_fn=None,
    *,
    rollout_stats=None,
    misspecified_pay=None,
    tags=None,
    progress=None,
    bar=True,
    overwrite=False,
):
    """The training run of validated `args` (`flags.parse_args`) in --ckpt.output_dir -> its Trainer, trained.

    `reward_fn`: default the one --reward.func names; `rollout_stats`, `misspecified_pay`: the task's hooks
    (`engine.Trainer`); `tags`: keys added to every metrics row; `progress(row)` after each step, and a progress bar
    unless `bar` is False; `overwrite`: start over in a used directory, as --ckpt.overwrite does.
    """
    from tqdm.auto import tqdm

    if args.train.threads:
        torch.set_num_threads(args.train.threads)
    device = torch.device(args.train.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = read_dataset(args.data.prompt_dataset, args.data.input_key, args.data.label_key, "--data.prompt_dataset")
    eval_rows = None
    if args.eval.dataset:
        eval_rows = read_dataset(args.eval.dataset, args.data.input_key, args.data.label_key, "--eval.dataset")
    config = run_config(args)
    if reward_fn is None:  # a broken reward file is found before the output dir is touched
        reward_fn = make_reward_fn(args.reward.func, args.reward.timeout_s)
    out = Path(args.ckpt.output_dir)
    with rundir.claim(out, args.ckpt.load_enable, args.ckpt.overwrite or overwrite) as resuming:
        checkpoint = None
        if resuming:
            checkpoint = rundir.load_checkpoint(out)
            check_resume_config(build_parser(), checkpoint, config)
            for name in ("metrics.jsonl", "gdi.jsonl"):  # as fit does, but before the model loads and the bar shows
                rundir.trim_jsonl(out / name, checkpoint["step"])
        model, tokenizer = load_model(args, device)
        trainer = make_trainer(args, model, tokenizer, rows, reward_fn, eval_rows, rollout_stats, misspecified_pay)
        if checkpoint is not None:
            try:
                trainer.load_state_dict(checkpoint["state"])
            except (KeyError, RuntimeError) as error:  # e.g. another architecture behind the same model path
                detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
                raise rundir.CheckpointError(
                    f"{checkpoint['path']}: its state does not fit this model and engine ({type(error).__name__}: "
                    f"{detail})"
                ) from None
            print(f"resumed from {checkpoint['path']} at step {trainer.global_step}", file=sys.stderr)
        else:
            rundir.clear_run(out)  # only an earlier run's files (the directory was empty, or --ckpt.overwrite)
        loggers = make_loggers(args, out, config, trainer.global_step)
        shown = None
        if bar:
            shown = tqdm(
                total=args.train.steps, initial=min(trainer.global_step, args.train.steps), desc="train", unit="step"
            )

        def on_step(row):
            if shown is not None:
                shown.update(1)
                shown.set_postfix(acc=f"{row['accuracy']:.2f}", loss=f"{row['loss']:.3f}")
            if progress is not None:
                progress(row)

        try:
            fit(
                trainer,
                args.train.steps,
                out,
                args.eval.steps,
                args.eval.n_samples_per_prompt,
                args.ckpt.save_steps,
                tags=tags,
                progress=on_step,
                config=config,
                loggers=loggers,
            )
        finally:
            if shown is not None:
                shown.close()
            for logger in loggers:
                logger.close()
        bad = rundir.find_nonfinite(model.state_dict())
        if bad is not None:
            raise rundir.CheckpointError(
                f"step {trainer.global_step}: {bad} holds NaN/inf; not writing {out / 'model'}"
            )
        with _quiet_transformers():
            rundir.save_model(model, out / "model")
        tokenizer.save_pretrained(out / "model")
    return trainer


def train(args):
    """The `openrlhf-geo train` run of validated `args` (after `parse_args`) -> exit status."""
    out = Path(args.ckpt.output_dir)
    run(args)
    written = [str(p) for p in (out / "metrics.jsonl", out / rundir.CHECKPOINT, out / "model") if p.exists()]
    print(f"wrote {', '.join(written[:-1])} and {written[-1]}")  # no metrics.jsonl after 0 steps without evaluation
    return 0


def main(argv=None):
    try:
        args = parse_args(argv)
        from openrlhf_geo.local.engine import check_misspecified  # transformers: after a parse error, not before

        check_misspecified(args, None)  # the studies pass the engine their task's hook
    except ValueError as error:
        print(f"openrlhf-geo train: {error}", file=sys.stderr)
        return 2
    try:
        return train(args)
    except ValueError as error:  # bad input found while setting up, or a run that must stop (e.g. NaN weights)
        print(f"openrlhf-geo train: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        where = f" {error}" if str(error) else ""  # e.g. "in --reward.func PATH: reward_func"
        out = Path(args.ckpt.output_dir)
        saved = next((out / name for name in (rundir.CHECKPOINT, rundir.PREVIOUS) if (out / name).exists()), None)
        if saved is None:
            resume = f"no checkpoint was written in {out} (--ckpt.save_steps N writes one every N steps)"
        else:
            resume = f"--ckpt.load_enable resumes from {saved}"
        print(f"openrlhf-geo train: interrupted{where}; {resume}", file=sys.stderr)
        return 130
