"""The run directory of `openrlhf-geo train`: who may write it, checkpoints that survive a crash, resume checks.

Layout of ``--ckpt.output_dir``::

    .lock                 flock(2)-ed by the run writing the directory (a second run is refused, never queued)
    run.json              the run record, written when a run starts fresh: the names a run writes here (RUN_FILES),
                          the only ones --ckpt.overwrite replaces; other files make it refuse, naming them
    checkpoint.pt         the newest checkpoint; checkpoint.prev.pt the one before it (the fallback);
                          checkpoint.pt.bad (.bad.1, ...) each one found unreadable at a resume, kept for inspection
    metrics.jsonl         one JSON object per step; gdi.jsonl GeoAlign's per-rollout records
    model/                the final model and tokenizer (save_pretrained)
    tensorboard/          --use_tensorboard's default event directory

A checkpoint is ``{"format", "version", "step", "config", "state", "digest"}``: `state` is `Trainer.state_dict()`,
`config` the run's flags (`options.flag_config`), `digest` a SHA-256 over config and state. The digest is needed
because torch's zip reader does not verify the CRC of the records it reads: a flipped bit in a tensor loads silently.
"""

import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch

from openrlhf_geo import lockfile, options

CHECKPOINT, PREVIOUS, LOCK, RECORD = "checkpoint.pt", "checkpoint.prev.pt", ".lock", "run.json"
FORMAT, VERSION = "openrlhf-geo-local-checkpoint", 1
# what a run writes (fnmatch patterns), stored in its RECORD; --ckpt.overwrite removes exactly these but KEPT
RUN_FILES = (
    CHECKPOINT,
    PREVIOUS,
    f"{CHECKPOINT}.bad",
    f"{CHECKPOINT}.bad.[0-9]*",
    f"{CHECKPOINT}.tmp",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "gdi.jsonl",
    "gdi.jsonl.tmp",
    "model",
    "tensorboard",
    "wandb",
)
KEPT = ("wandb",)  # offline wandb runs may be unsynced
# What a study writes in a run's directory before the run (lab/studies: the command it runs there): a run neither
# refuses nor deletes it.
BESIDE = ("study.json",)

# Flags a resumed run may change: none of them alters the state a step produces from the state before it.
SAFE_TO_CHANGE = {
    "train.steps": "where the run stops; the local engine's learning rate does not depend on it",
    "eval.steps": "evaluation samples from its own seeded, forked RNG and never touches the training state",
    "eval.n_samples_per_prompt": "as --eval.steps",
    "eval.dataset": "as --eval.steps (the eval curve then changes data at the resume step)",
    "ckpt.save_steps": "when the state is written, not what it is",
    "ckpt.output_dir": "where the run is (a moved directory resumes)",
    "logger.tensorboard_dir": "logging only",
    "logger.wandb.key": "logging only",
    "logger.wandb.project": "logging only",
    "logger.wandb.group": "logging only",
    "logger.wandb.org": "logging only",
    "logger.wandb.run_name": "logging only",
    "train.threads": "the same arithmetic on more or fewer CPU threads (floating-point rounding may differ)",
    "train.device": "the same algorithm on another device (rounding and the CUDA sampling stream differ)",
    "geoalign.device": "as --train.device, for the GeoAlign projector",
    "rollout.micro_batch_size": "chunks a no-grad forward whose rows are independent (same numbers up to rounding)",
    "train.micro_batch_size": "gradient accumulation over the same mini-batch loss (same gradient up to rounding)",
    "data.prompt_dataset": "the path only: its content is compared separately (content.data.prompt_dataset)",
    "reward.func": "the path only: a .py reward's content is compared separately (content.reward.func)",
    "reward.timeout_s": "how long a reward call may take before the run stops, not what it returns",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or must not be written (the message names the file and the step)."""


def warn(message):
    print(f"warning: {message}", file=sys.stderr)


def save_model(model, path):
    """`model.save_pretrained(path)` without importing DeepSpeed: transformers unwraps the model through accelerate,
    which imports DeepSpeed whenever it is installed (printing "Setting accelerator to CPU") only to test for its
    engine's wrapper, and this package's single-process models are never wrapped."""
    from transformers import modeling_utils

    with mock.patch.object(modeling_utils, "unwrap_model", lambda model, recursive=False: model):
        model.save_pretrained(path)


# ---------------------------------------------------------------- the directory


class Busy(Exception):
    """Another process holds the directory's lock; `owner` is what it wrote there ("pid N")."""

    def __init__(self, owner):
        super().__init__(owner)
        self.owner = owner


@contextmanager
def locked(path):
    """Create the directory `path` and hold its lock (LOCK, holding this process's pid) until the block ends: the one
    lock of a train run's directory and of a demo's or study's --out. OSError when it cannot be written there, Busy
    when another process holds it (each caller words the refusal with its flag).

    A block that raises (a refusal, a failed start) undoes what this created: the lock file, and the directories
    when empty; a lock file or directory that was there stays. A lock file may so be removed while another process
    opens it: the lock is then taken again on the file at the path.
    """
    path = Path(path)
    created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, new = _lock(path / LOCK)
    except BaseException:
        _remove_empty(created)
        raise
    with handle:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        try:
            yield path
        except BaseException:
            if new:
                (path / LOCK).unlink(missing_ok=True)  # while still held: see `_lock`
            _remove_empty(created)
            raise
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _lock(path):
    """(open file, created by this call) of the lock file `path`, flock-ed (`lockfile.lock`); Busy when another
    process holds it."""
    try:
        return lockfile.lock(path, blocking=False)
    except BlockingIOError:  # held; a PermissionError (EACCES too) is the file's, and raised as it is
        try:
            owner = Path(path).read_text().strip()
        except OSError:
            owner = ""
        raise Busy(owner or "another process") from None


def _unwritable(error):
    """Why `locked` failed with the OSError `error`, for a message that names the directory: "<strerror>", or
    ".lock: <strerror>" when the lock file itself is the problem (a directory, a link to nothing, not writable)."""
    return f"{LOCK}: {error.strerror}" if error.filename and Path(error.filename).name == LOCK else error.strerror


def _remove_empty(directories):
    """rmdir each of `directories` (deepest first) while empty; one that holds something stops it."""
    for directory in directories:
        try:
            directory.rmdir()
        except FileNotFoundError:  # a failed mkdir did not get this deep
            continue
        except OSError:
            return


@contextmanager
def claim(out_dir, resume=False, overwrite=False):
    """Create and lock `out_dir` for this process -> yields True to resume from its checkpoint, False to start fresh.

    A fresh start needs an empty directory, or `overwrite` in one that holds only a run's files (`run_files`: the
    caller then deletes them with `clear_run` once its own inputs are checked); files no run wrote are refused, named,
    with or without `overwrite`. `resume` with a checkpoint present resumes; without one it starts fresh as without
    `resume` (in a non-empty directory only with `overwrite`). A fresh start writes the run record (RECORD), taken back
    when the block raises before anything else was written. ValueError naming the flag.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--ckpt.output_dir {out_dir}: is a file, not a directory")
    with ExitStack() as stack:
        hold(stack, out_dir, "--ckpt.output_dir")
        resuming = _decide(out_dir, resume, overwrite)
        record = out_dir / RECORD
        written = not resuming and not record.exists()
        if written:
            record.write_text(json.dumps({"written_by": "openrlhf-geo train", "paths": list(RUN_FILES)}) + "\n")
        try:
            yield resuming
        except BaseException:
            if written and {p.name for p in out_dir.iterdir()} <= {LOCK, RECORD, *BESIDE}:  # nothing of the run's yet
                record.unlink()
            raise


def hold(stack, folder, flag) -> None:
    """Enter `locked(folder)`, the output folder `flag` names, into the ExitStack `stack`; ValueError naming the flag
    and the folder when it cannot be written there or another run is writing it."""
    try:
        stack.enter_context(locked(folder))
    except OSError as error:
        raise ValueError(f"{flag} {folder}: cannot write there ({_unwritable(error)})") from None
    except Busy as busy:
        raise ValueError(
            f"{flag} {folder}: another run is writing it ({busy.owner}); wait for it or choose another {flag}"
        ) from None


def _shown(names):
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _decide(out_dir, resume, overwrite):
    has_checkpoint = (out_dir / CHECKPOINT).exists() or (out_dir / PREVIOUS).exists()
    if resume and has_checkpoint:
        return True
    ours, others = run_files(out_dir)
    if others:
        why = (
            f"--ckpt.overwrite replaces only what a run's {RECORD} lists" if overwrite else "a run needs an empty one"
        )
        raise ValueError(
            f"--ckpt.output_dir {out_dir} holds files no run wrote ({_shown(others)}), and {why}: move them, or "
            "choose another --ckpt.output_dir"
        )
    if ours not in ([], [RECORD]) and not overwrite:  # a record alone: a run that wrote nothing yet
        if resume:
            raise ValueError(
                f"--ckpt.load_enable: {out_dir} has no checkpoint to resume but holds a run ({_shown(ours)}); "
                "pass --ckpt.overwrite to start over there, or choose another --ckpt.output_dir"
            )
        raise ValueError(
            f"--ckpt.output_dir {out_dir} already holds a run ({_shown(ours)}); resume it with --ckpt.load_enable, "
            "replace it with --ckpt.overwrite, or choose another --ckpt.output_dir"
        )
    if resume:
        print(f"--ckpt.load_enable: no checkpoint in {out_dir}, starting fresh", file=sys.stderr)
    return False


def run_files(out_dir):
    """(the run's, the others): the names in `out_dir` but the lock, sorted. A run's are its RECORD and the names
    the record lists (as far as RUN_FILES has them: a record never widens what `clear_run` deletes); an older
    version's run, which wrote no record, is recognised by its checkpoint. Anything else but BESIDE is not a run's."""
    out_dir = Path(out_dir)
    names = sorted(p.name for p in out_dir.iterdir() if p.name not in (LOCK, *BESIDE))
    listed = recorded(out_dir, RUN_FILES, legacy=(out_dir / CHECKPOINT).exists() or (out_dir / PREVIOUS).exists())
    patterns = [] if listed is None else [*listed, RECORD]
    ours = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    return ours, [name for name in names if name not in ours]


def recorded(directory, allowed, legacy) -> list[str] | None:
    """The patterns of what a run wrote in `directory` (`run_files`, and the fork's --ckpt.path): those its RECORD
    lists, as far as `allowed` has them (a record never widens what is deleted); without a record, every one of
    `allowed` when `legacy` (an older version's run, recognised by what it left), else none. None for a record this
    code did not write: nothing is accounted for."""
    try:
        listed = json.loads((Path(directory) / RECORD).read_text())["paths"]
        return [p for p in listed if p in allowed]
    except FileNotFoundError:
        return list(allowed) if legacy else []
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_run(out_dir):
    """Delete what an earlier run wrote in `out_dir` (`run_files`, but KEPT and the record), naming it; anything
    else stays."""
    out_dir = Path(out_dir)
    replaced = [name for name in run_files(out_dir)[0] if name not in (*KEPT, RECORD)]
    if replaced:
        print(f"replacing the earlier run in {out_dir}: {_shown(replaced)}", file=sys.stderr)
    for name in replaced:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------- checkpoints


def find_nonfinite(tree, prefix=""):
    """Dotted name of the first floating-point tensor in a nested dict/list holding NaN or inf, else None."""
    if isinstance(tree, torch.Tensor):
        return prefix if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = find_nonfinite(value, f"{prefix}.{key}" if prefix else str(key))
        if found is not None:
            return found
    return None


def _digest(tree, h):
    """Feed a nested structure of tensors and plain data to hash `h`, independently of how it was serialized."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(tree, dict):
        h.update(f"{{{len(tree)}".encode())
        for key, value in tree.items():
            _digest(key, h)
            _digest(value, h)
    elif isinstance(tree, (list, tuple)):  # a tuple may come back as either; the content is what matters
        h.update(f"[{len(tree)}".encode())
        for value in tree:
            _digest(value, h)
    else:
        h.update(f"{type(tree).__name__}:{tree!r};".encode())
    return h


def save_checkpoint(out_dir, state, config=None):
    """Write `state` (Trainer.state_dict()) and the run's `config` to <out_dir>/checkpoint.pt -> its path.

    Atomic: a temporary file is written and fsync-ed, the current checkpoint becomes checkpoint.prev.pt, then the
    new one is renamed into place, so a kill at any moment leaves a readable checkpoint. Refuses (CheckpointError
    naming the step and tensor) a state with a NaN/inf floating-point tensor: the last good checkpoint stays.
    """
    out_dir = Path(out_dir)
    path = out_dir / CHECKPOINT
    step = state.get("global_step")
    bad = find_nonfinite(state)
    if bad is not None:
        raise CheckpointError(f"step {step}: {bad} holds NaN/inf; not writing {path} (the last checkpoint is kept)")
    body = {"step": step, "config": config, "state": state}
    record = {"format": FORMAT, "version": VERSION, **body, "digest": _digest(body, hashlib.sha256()).hexdigest()}
    tmp = out_dir / f"{CHECKPOINT}.tmp"
    with open(tmp, "wb") as f:
        torch.save(record, f)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        os.replace(path, out_dir / PREVIOUS)
    os.replace(tmp, path)
    directory = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the renames durable
    finally:
        os.close(directory)
    return path


def read_checkpoint(path):
    """{"step", "config", "state"} of one checkpoint file; CheckpointError naming the file when it cannot be used.

    A plain `Trainer.state_dict()` written by the engine's own save is accepted with config None (no flags to check).
    """
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickles before refusing them
            warnings.simplefilter("ignore")
            record = torch.load(path, map_location="cpu", weights_only=True)  # RNG states stay on the CPU
    except Exception as error:  # torch.load raises many types on a damaged file (zip, pickle, EOF, OS errors)
        if error.__class__.__name__ == "UnpicklingError":
            detail = "it holds objects other than tensors and plain data"
        else:
            first = str(error).strip().splitlines()[0].split(". ")[0][:160] if str(error).strip() else ""
            detail = f"{type(error).__name__}: {first}" if first else type(error).__name__
        raise CheckpointError(f"{path}: unreadable: truncated, corrupted or not a checkpoint ({detail})") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: not an openrlhf-geo checkpoint (holds a {type(record).__name__})")
    if record.get("format") != FORMAT:
        if {"global_step", "model", "optimizer"} <= record.keys():
            return {"step": record["global_step"], "config": None, "state": record}
        raise CheckpointError(f"{path}: not an openrlhf-geo checkpoint (keys {sorted(map(str, record))[:6]})")
    if record.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {record.get('version')!r}, this code reads {VERSION}")
    body = {key: record.get(key) for key in ("step", "config", "state")}
    if record.get("digest") != _digest(body, hashlib.sha256()).hexdigest():
        raise CheckpointError(f"{path}: corrupted (its content does not match the digest written with it)")
    return body


def set_aside(path) -> Path:
    """Move the damaged file or folder `path` to <name>.bad, or .bad.1, ... when one is there (one kept by an earlier
    fallback stays too), kept for inspection; -> where it went."""
    path = Path(path)
    bad, number = path.with_name(f"{path.name}.bad"), 0
    while bad.exists():
        number += 1
        bad = path.with_name(f"{path.name}.bad.{number}")
    os.replace(path, bad)
    return bad


def load_checkpoint(out_dir):
    """The newest usable checkpoint of `out_dir` -> {"step", "config", "state", "path"}.

    Falls back to checkpoint.prev.pt with a warning when checkpoint.pt is unreadable (the bad file is moved aside
    to checkpoint.pt.bad, or .bad.1, ... when one is there, so that the next save does not rotate it over the good
    one); CheckpointError naming the files when neither can be used.
    """
    out_dir = Path(out_dir)
    problems = []
    for name in (CHECKPOINT, PREVIOUS):
        path = out_dir / name
        if not path.exists():
            continue
        try:
            checkpoint = read_checkpoint(path)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        if problems:
            bad = set_aside(out_dir / CHECKPOINT)
            warn(f"{problems[0]}; moved it to {bad.name} and resuming from {path} (step {checkpoint['step']})")
        elif name == PREVIOUS:
            warn(f"{out_dir / CHECKPOINT} is missing (a kill between renames?); resuming from {path}")
        return {**checkpoint, "path": path}
    if not problems:
        raise CheckpointError(f"{out_dir}: no {CHECKPOINT} or {PREVIOUS}")
    # the advice holds with --ckpt.overwrite given too: with --ckpt.load_enable a checkpoint is resumed, never replaced
    raise CheckpointError(
        "; ".join(problems) + ". Restore a copy, or start over: run without --ckpt.load_enable, with --ckpt.overwrite"
    )


# ---------------------------------------------------------------- logs


def trim_jsonl(path, step):
    """Keep the rows of a jsonl log with "step" <= `step` (a resumed run rewrites what follows its checkpoint).

    A truncated last line (a kill mid-write: no newline, not JSON) is dropped with a warning; any other line that
    is not a JSON object with a "step" is a ValueError naming file and line.
    """
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            if number == len(lines):  # no newline after it: the write was cut off
                warn(f"{path}:{number}: dropped a truncated last line")
                continue
            raise ValueError(f"{path}:{number}: not a JSON line ({error}); fix or delete it to resume") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number}: expected a JSON object with an integer 'step'; fix it to resume")
        if row["step"] <= step:
            kept.append(line + b"\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)


# ---------------------------------------------------------------- flags


ABSENT = "(no such flag)"


def config_changes(old, new):
    """Flags whose values differ between a checkpoint's config and this run's -> (safe, unsafe), each a list of
    (key, old, new). A key on one side only (a flag added or removed by another version of this code, which the
    user cannot pass) counts as safe, with the value ABSENT on the other side, so that it is reported, not refused.
    Settings are compared as their configs use them (`options.settled`): a default spelled out is no change.
    """
    old, new = options.settled(old), options.settled(new)
    safe, unsafe = [], []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        if a != b:
            allowed = key in SAFE_TO_CHANGE or ABSENT in (a, b)
            (safe if allowed else unsafe).append((key, a, b))
    return safe, unsafe


COMMAND_FILE = "command.json"  # in the --out of the demo and the studies: the command it belongs to


class OutputClaimed(ValueError):
    """`--out` cannot be used by this command (`claim_output`); the message names it."""


@contextmanager
def claim_output(path, command, name="--out"):
    """Create and lock `--out` of the demo or a study (or another command's output directory, `name` in messages)
    for `command` -> yields it as a Path.

    `command` is what the outputs depend on, as a command line (e.g. "openrlhf-geo demo --quick --seeds 1 --steps 4";
    not --workers). The protection `openrlhf-geo train` gives its output directory (`claim`): the first use
    records `command` in <out>/command.json; the same command later proceeds (the demo reruns its runs, a study
    resumes the unfinished ones), while a directory recorded for another command, holding files but no record (a
    train run, an older version's output, anything else) or being written by another process is refused with an
    OutputClaimed naming `name` and the path, before anything in it changes. The lock is held until the block ends;
    a block that raises before writing anything takes the record back (and `locked` the lock and a new directory).
    """
    out = Path(path)
    with ExitStack() as stack:
        try:
            stack.enter_context(locked(out))
        except OSError as error:
            raise OutputClaimed(f"{name} {out}: {_unwritable(error)}") from None
        except Busy:
            raise OutputClaimed(
                f"{name} {out}: another run is writing it; wait for it or choose another {name}"
            ) from None
        record, written = out / COMMAND_FILE, False
        if record.exists():
            try:
                owner = json.loads(record.read_text())["command"]
            except (OSError, ValueError, KeyError, TypeError):
                owner = f"unreadable {record}"
            if owner != command:
                raise OutputClaimed(
                    f"{name} {out} holds the output of `{owner}`; `{command}` would replace it: choose another "
                    f"{name} (or delete that directory)"
                )
        else:
            held = sorted(p.name for p in out.iterdir() if p.name != LOCK)
            if held:
                shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
                raise OutputClaimed(
                    f"{name} {out} holds files not written by `{command}` ({shown}); choose another {name} "
                    "(an empty or new directory)"
                )
            record.write_text(json.dumps({"command": command}) + "\n")
            written = True
        try:
            yield out
        except BaseException:
            if written and {p.name for p in out.iterdir()} <= {LOCK, COMMAND_FILE}:  # nothing of the command's yet
                record.unlink()
            raise
