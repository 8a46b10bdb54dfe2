"""TensorBoard and Weights & Biases logging of the local engine's metric rows, named as upstream OpenRLHF names them.

Upstream 0.11.2 (`openrlhf.utils.logging_utils`) logs each step's training metrics as ``train/<key>`` and evaluation
metrics as ``eval/<key>``, and wandb steps them by ``train/global_step`` / ``eval/global_step``. A metrics.jsonl row
of the local engine mixes both: its ``eval/...`` keys are evaluation metrics (already upstream's names), every other
number a training metric. Non-numeric values (the demo's method / seed tags) and None are skipped. Upstream's
classes are not reused: openrlhf is an optional dependency of the local engine, and they expect its `args.logger`.
"""

import numbers
import secrets
from pathlib import Path


def split_row(row):
    """A metrics row -> (train {"train/<key>": float}, eval {"eval/<key>": float}); "step" and non-numbers dropped."""
    train, evaluation = {}, {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if key.startswith("eval/"):
            evaluation[key] = float(value)
        else:
            train[f"train/{key}"] = float(value)
    return train, evaluation


class TensorboardLogger:
    """Scalars in TensorBoard event files under `log_dir`; `resume_step` hides events a crashed run wrote after it."""

    def __init__(self, log_dir, resume_step=0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("--use_tensorboard needs the tensorboard package: pip install tensorboard") from None
        # purge_step: TensorBoard drops the old events at steps >= it, so a resumed run's steps are not doubled
        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step, row):
        train, evaluation = split_row(row)
        for tag, value in {**train, **evaluation}.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a crash loses no logged step

    def close(self):
        self.writer.close()


class WandbLogger:
    """A wandb run (WANDB_MODE=offline works without a network) whose id is kept in <out_dir>/wandb/run_id, so a
    resumed run continues the same wandb run; steps a crashed run logged after its checkpoint appear twice there."""

    def __init__(self, out_dir, config, project, run_name=None, group=None, org=None, key=None, resume=False):
        try:
            import wandb
        except ImportError:
            raise ValueError(
                "--use_wandb needs the wandb package: pip install wandb (WANDB_MODE=offline logs without a network)"
            ) from None
        id_file = Path(out_dir) / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else secrets.token_hex(6)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        try:
            if key:
                wandb.login(key=key)
            self.run = wandb.init(
                project=project,
                entity=org,
                group=group,
                name=run_name or Path(out_dir).resolve().name,
                config=config,
                dir=str(out_dir),
                id=run_id,
                resume="allow",
            )
        except wandb.Error as error:
            raise ValueError(f"--use_wandb: {error} (WANDB_MODE=offline logs without an account)") from None
        for kind in ("train", "eval"):
            self.run.define_metric(f"{kind}/global_step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/global_step", step_sync=True)

    def log(self, step, row):
        train, evaluation = split_row(row)
        for kind, metrics in (("train", train), ("eval", evaluation)):
            if metrics:
                self.run.log({**metrics, f"{kind}/global_step": step})

    def close(self):
        self.run.finish()
