"""The command line of `openrlhf-geo train`: its parser (upstream's flag names plus the fork's, `options.add_args`),
the validated nested namespace (`parse_args`), and the flags a checkpoint stores and a resume compares (`run_config`,
`check_resume_config`). `FlagParser`, shared with `openrlhf-geo demo` and `study`: one-line errors and close matches
for typos."""

import argparse
import dataclasses
import difflib
import hashlib
import math
import sys
from pathlib import Path

import torch

from openrlhf_geo import options, registry
from openrlhf_geo.config_flags import default_text
from openrlhf_geo.local import rundir
from openrlhf_geo.rewards.noise import NoiseConfig


def build_parser():
    p = FlagParser(
        prog="openrlhf-geo train", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    model = p.add_argument_group("model")
    model.add_argument("--actor.model_name_or_path", default=None, help="HF model directory (weights + tokenizer)")
    model.add_argument("--actor.config", default=None, help="config.json of a randomly initialised model instead")
    model.add_argument("--actor.tokenizer", default=None, help="tokenizer directory (default: the model's)")

    data = p.add_argument_group("data")
    data.add_argument("--data.prompt_dataset", required=True, help="jsonl with one prompt and answer per line")
    data.add_argument("--data.input_key", default="prompt", help="jsonl key of the prompt text")
    data.add_argument("--data.label_key", default="answer", help="jsonl key of the gold answer")
    data.add_argument("--eval.dataset", default=None, help="held-out jsonl scored every --eval.steps steps")
    data.add_argument("--eval.steps", type=int, default=-1, help="evaluate every N steps (and at 0); -1 = never")
    data.add_argument("--eval.n_samples_per_prompt", type=int, default=1, help="samples per held-out prompt")

    reward = p.add_argument_group("reward")
    reward.add_argument(
        "--reward.func",
        default="math_verify",
        help="math_verify (boxed answer, 1/0) or a .py file defining upstream's reward_func(queries, prompts, labels)",
    )
    reward.add_argument("--reward.pm1", action="store_true", help="DAPO: map verdicts 1/0 to rewards +1/-1")
    reward.add_argument(
        "--reward.clip_range",
        type=float,
        nargs=2,
        default=(-10.0, 10.0),
        help="clamp of each rollout's advantage (SALT's a' too) before its tokens get it, as upstream's flag",
    )

    rollout = p.add_argument_group("rollout")
    rollout.add_argument("--rollout.batch_size", type=int, default=16, help="prompts per step")
    rollout.add_argument("--rollout.n_samples_per_prompt", type=int, default=8, help="G, samples per prompt (>= 2)")
    rollout.add_argument("--rollout.max_new_tokens", type=int, default=16)
    rollout.add_argument("--rollout.temperature", type=float, default=1.0)
    rollout.add_argument("--rollout.top_p", type=float, default=1.0)
    rollout.add_argument(
        "--rollout.micro_batch_size", type=int, default=0, help="rows per no-grad forward; 0 = the whole batch"
    )

    algo = p.add_argument_group("algorithm")
    algo.add_argument(
        "--algo.advantage.estimator",
        "--advantage_estimator",
        action=options.EstimatorFlag,  # the two spellings with different values are refused
        # the registered estimators the local engine computes, and SALT on a group one: read as the parser is built,
        # so an estimator registered after this module's import is a choice
        choices=(*registry.local_estimators(), "salt"),
        default="group_norm",
        help="group_norm (GRPO), dr_grpo (Dr. GRPO: no std), salt (--salt.base + SALT reweighting)",
    )
    algo.add_argument("--algo.dynamic_filtering_enable", action="store_true", help="DAPO: drop all-equal groups")
    algo.add_argument("--algo.kl.init_coef", type=float, default=0.0, help="KL-to-reference loss coefficient")
    algo.add_argument("--algo.kl.estimator", choices=("k1", "k2", "k3"), default="k3")

    actor = p.add_argument_group("optimisation")
    actor.add_argument("--actor.adam.lr", type=float, default=1e-6)
    actor.add_argument("--actor.adam.betas", type=float, nargs=2, default=(0.9, 0.95))
    actor.add_argument("--actor.adam.weight_decay", type=float, default=0.0)
    actor.add_argument("--actor.max_norm", type=float, default=1.0, help="gradient-norm clip")
    actor.add_argument("--actor.eps_clip", type=float, default=0.2, help="PPO clip range")
    actor.add_argument(
        "--actor.eps_clip_low_high", type=float, nargs=2, default=None, help="DAPO clip-higher: eps_low eps_high"
    )
    actor.add_argument("--actor.loss_agg_mode", choices=("token-mean", "seq-mean-token-mean"), default="token-mean")
    actor.add_argument(
        "--actor.entropy_coef",
        type=float,
        default=None,
        help="entropy bonus lambda_ENT >= 0 (SALT Eq. 71), aggregated like the loss; 0 = log entropy_loss only",
    )
    actor.add_argument("--train.steps", type=int, default=50, help="RL steps (rollout batches)")
    actor.add_argument("--train.batch_size", type=int, default=0, help="rollouts per AdamW step; 0 = all")
    actor.add_argument("--train.micro_batch_size", type=int, default=0, help="rows per backward; 0 = mini-batch")
    actor.add_argument("--train.max_epochs", type=int, default=1, help="passes over each rollout batch")
    actor.add_argument("--train.seed", type=int, default=42)
    actor.add_argument("--train.device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    actor.add_argument("--train.threads", type=int, default=None, help="torch CPU threads (default: torch's)")

    ckpt = p.add_argument_group("output")
    ckpt.add_argument("--ckpt.output_dir", default="runs/train")
    ckpt.add_argument("--ckpt.save_steps", type=int, default=-1, help="checkpoint every N steps (and at the end)")
    ckpt.add_argument("--ckpt.load_enable", action="store_true", help="resume from <output_dir>/checkpoint.pt")
    ckpt.add_argument(
        "--ckpt.overwrite",
        action="store_true",
        help="start over in an output dir that holds an earlier run (deletes its checkpoints, logs and model)",
    )

    log = p.add_argument_group("logging (upstream's metric names: train/<key>, eval/<key>)")
    log.add_argument(
        "--logger.tensorboard_dir",
        "--use_tensorboard",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="TensorBoard event files in DIR (default <ckpt.output_dir>/tensorboard); needs `tensorboard`",
    )
    log.add_argument(
        "--logger.wandb.key",
        "--use_wandb",
        nargs="?",
        const="",
        default=None,
        metavar="KEY",
        help="log to Weights & Biases (optionally logging in with API key KEY); WANDB_MODE=offline needs no network",
    )
    log.add_argument("--logger.wandb.project", default="openrlhf_geo")
    log.add_argument("--logger.wandb.group", default=None)
    log.add_argument("--logger.wandb.org", default=None)
    log.add_argument("--logger.wandb.run_name", default=None, help="default: the output directory's name")

    options.add_args(p)
    # --reward.noise.type misspecified needs a task that says which wrong answers the verifier pays (the studies' demo
    # task, `openrlhf-geo study geoalign-failure`): a train run has none, so its help does not offer it (`main`)
    fields = {f.name: f for f in dataclasses.fields(NoiseConfig)}
    for action in p._actions:
        if "--reward.noise.type" in action.option_strings:
            action.metavar = "{" + ",".join(c for c in action.choices if c != "misspecified") + "}"
            action.help = (
                "flip: binary flips of a fraction of each prompt's rollouts; swap: HH-style swap-to-extremes "
                + default_text(fields["type"])
            )
        elif "--reward.noise.rate" in action.option_strings:
            action.help = "fraction of each prompt's rollouts corrupted " + default_text(fields["rate"])
    return p


def validate(args):
    """options.validate plus the local engine's own limits; ValueError naming the flag."""
    noise = args.reward.noise
    if args.reward.pm1 and noise.type == "flip" and noise.levels is None:
        noise.levels = (-1.0, 1.0)  # --reward.pm1 makes the rewards DAPO's -1/+1, so that is what a flip swaps
    options.validate(args)
    if args.reward.pm1 and noise.type == "flip" and tuple(noise.levels) != (-1.0, 1.0):
        raise ValueError("--reward.pm1 makes rewards -1/+1: use --reward.noise.levels -1 1 (or leave it out)")
    salt_bases = [name for name in registry.local_estimators() if name in registry.group_estimators()]
    if args.salt.enable and args.algo.advantage.estimator not in salt_bases:
        raise ValueError(
            f"the local engine supports --salt.base {' or '.join(salt_bases)} (got {args.geometry.salt_base})"
        )
    if (args.actor.model_name_or_path is None) == (args.actor.config is None):
        raise ValueError("give exactly one of --actor.model_name_or_path and --actor.config")
    if args.actor.config is not None and args.actor.tokenizer is None:
        raise ValueError("--actor.config needs --actor.tokenizer (a randomly initialised model has no tokenizer)")
    r, t, o, e = args.rollout, args.train, args.actor, args.eval
    checks = [  # (holds, message, the value it is about)
        (
            r.n_samples_per_prompt >= 2,
            "--rollout.n_samples_per_prompt must be >= 2 (group baselines)",
            r.n_samples_per_prompt,
        ),
        (r.batch_size >= 1, "--rollout.batch_size must be >= 1", r.batch_size),
        (r.max_new_tokens >= 1, "--rollout.max_new_tokens must be >= 1", r.max_new_tokens),
        (r.temperature > 0, "--rollout.temperature must be > 0", r.temperature),
        (
            args.reward.clip_range[0] < args.reward.clip_range[1],
            "--reward.clip_range must be LOW HIGH with LOW < HIGH",
            tuple(args.reward.clip_range),
        ),
        (0 < r.top_p <= 1, "--rollout.top_p must be in (0, 1]", r.top_p),
        (t.steps >= 0, "--train.steps must be >= 0", t.steps),
        (t.max_epochs >= 1, "--train.max_epochs must be >= 1", t.max_epochs),
        (t.threads is None or t.threads >= 1, "--train.threads must be >= 1", t.threads),
        (
            min(t.batch_size, t.micro_batch_size, r.micro_batch_size) >= 0,
            "--train.batch_size, --train.micro_batch_size and --rollout.micro_batch_size must be >= 0",
            (t.batch_size, t.micro_batch_size, r.micro_batch_size),
        ),
        (args.algo.kl.init_coef >= 0, "--algo.kl.init_coef must be >= 0", args.algo.kl.init_coef),
        (o.adam.lr > 0, "--actor.adam.lr must be > 0", o.adam.lr),
        (all(0 <= b < 1 for b in o.adam.betas), "--actor.adam.betas must be in [0, 1)", o.adam.betas),
        (o.adam.weight_decay >= 0, "--actor.adam.weight_decay must be >= 0", o.adam.weight_decay),
        (o.max_norm > 0, "--actor.max_norm must be > 0", o.max_norm),
        (o.eps_clip > 0, "--actor.eps_clip must be > 0", o.eps_clip),
        (
            o.eps_clip_low_high is None or min(o.eps_clip_low_high) > 0,
            "--actor.eps_clip_low_high values must be > 0",
            o.eps_clip_low_high,
        ),
        (e.n_samples_per_prompt >= 1, "--eval.n_samples_per_prompt must be >= 1", e.n_samples_per_prompt),
        (e.steps == -1 or e.steps >= 1, "--eval.steps must be >= 1, or -1 for never", e.steps),
        (e.steps == -1 or e.dataset is not None, "--eval.steps needs --eval.dataset", e.steps),
        (
            args.ckpt.save_steps == -1 or args.ckpt.save_steps >= 1,
            "--ckpt.save_steps must be >= 1, or -1 for the end only",
            args.ckpt.save_steps,
        ),
    ]
    for ok, message, value in checks:
        if not ok:
            raise ValueError(f"{message} (got {value})")
    if not args.ckpt.output_dir:
        raise ValueError("--ckpt.output_dir is empty: name the run's directory (an empty path is the current one)")
    check_inputs_outside_output(args)
    if args.reward.noise.type == "swap" and args.reward.pm1:
        raise ValueError("--reward.noise.type swap is for scalar rewards; use flip with --reward.pm1")
    if args.train.device is not None:
        try:
            device = torch.device(args.train.device)
        except RuntimeError:
            raise ValueError(f"--train.device {args.train.device!r}: not a device (cpu, cuda, cuda:N)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--train.device {args.train.device}: CUDA is not available on this machine")
    return args


def parse_args(argv):
    """The validated nested namespace of `openrlhf-geo train ARGV`; ValueError naming the flag otherwise."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    for action in parser._actions:  # every float flag, the fork's included: inf/nan pass `> 0`-style checks
        value = getattr(namespace, action.dest, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        if action.type is float and any(v is not None and not math.isfinite(v) for v in values):
            raise ValueError(f"{action.option_strings[0]} must be a finite number (got {value})")
    return validate(options.nest(namespace))


# flags naming files, stored resolved so that a resume from another working directory compares equal: an input
# when it exists (else it may be a hub id or a reward name), an output always (a fresh run's does not exist yet)
INPUT_PATH_FLAGS = (
    "actor.model_name_or_path",
    "actor.config",
    "actor.tokenizer",
    "data.prompt_dataset",
    "eval.dataset",
    "reward.func",
)
OUTPUT_PATH_FLAGS = ("ckpt.output_dir", "logger.tensorboard_dir")


def check_inputs_outside_output(args):
    """Refuse (ValueError naming both flags) an input path flag that names something inside --ckpt.output_dir or a
    directory holding it: a run replaces its model there, and --ckpt.overwrite deletes what an earlier run wrote."""
    out = args.ckpt.output_dir
    output = Path(out).resolve()
    for key in INPUT_PATH_FLAGS:
        group, _, name = key.partition(".")
        value = getattr(getattr(args, group), name)
        if not value or not Path(value).exists():  # a hub id or the built-in reward's name
            continue
        given = Path(value).resolve()
        if output in given.parents:
            where = "holds"
        elif given.is_dir() and (given == output or given in output.parents):
            where = "is" if given == output else "is inside"
        else:
            continue
        raise ValueError(
            f"--ckpt.output_dir {out} {where} --{key} {value}: a run there would replace or delete its own input; "
            "choose another --ckpt.output_dir"
        )


def resolve_paths(config):
    """`config` (flag key -> value) with its path flags resolved as a checkpoint stores them (a copy)."""
    config = dict(config)
    for key in INPUT_PATH_FLAGS + OUTPUT_PATH_FLAGS:
        value = config.get(key)
        if isinstance(value, str) and value and (key in OUTPUT_PATH_FLAGS or Path(value).exists()):
            config[key] = str(Path(value).resolve())
    return config


def run_config(args):
    """The flags a checkpoint stores and a resume compares (`options.flag_config`), with paths resolved
    (`resolve_paths`), the content hash of the prompt dataset and of a .py reward, and the wandb API key masked."""
    config = resolve_paths(options.flag_config(args))
    for key in ("data.prompt_dataset", "reward.func"):
        path = Path(config[key])
        if path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 16), b""):  # a block at a time: datasets may be large
                    digest.update(block)
            config[f"content.{key}"] = digest.hexdigest()
        else:
            config[f"content.{key}"] = None
    if config.get("logger.wandb.key"):
        config["logger.wandb.key"] = "<given>"
    for key in ("ckpt.load_enable", "ckpt.overwrite"):  # how this invocation starts, not what the run is
        del config[key]
    return config


def check_resume_config(parser, checkpoint, config):
    """Refuse (ValueError listing old -> new) a resume whose flags differ from the checkpoint's in a way that
    changes the training; report the differences `rundir.SAFE_TO_CHANGE` allows."""
    if checkpoint["config"] is None:
        rundir.warn(f"{checkpoint['path']} stores no flags (an older format): cannot check that they match")
        return
    names = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}

    def show(changes):
        shown = [(names.get(k, k), *(v if v == rundir.ABSENT else repr(v) for v in (a, b))) for k, a, b in changes]
        return ", ".join(f"{name} {a} -> {b}" for name, a, b in shown)

    # an older checkpoint stored a fresh run's output directory as given (relative): resolved here, as now
    safe, unsafe = rundir.config_changes(resolve_paths(checkpoint["config"]), config)
    if unsafe:
        allowed = []  # a group whose flags are all safe is shown as --group.*
        for key in rundir.SAFE_TO_CHANGE:
            group = key.split(".")[0]
            whole = all(k in rundir.SAFE_TO_CHANGE for k in names if k.split(".")[0] == group and k in config)
            allowed.append(f"--{group}.*" if whole else names.get(key, key))
        allowed = ", ".join(dict.fromkeys(allowed))
        raise ValueError(
            f"--ckpt.load_enable: {checkpoint['path']} was written with other flags, and these change the "
            f"training: {show(unsafe)}. Resume with the original values (changes allowed: {allowed}) or start a "
            "new run in another --ckpt.output_dir"
        )
    if safe:
        print(f"resuming with changed flags: {show(safe)}", file=sys.stderr)


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are ValueError (one line, no usage dump) and whose unknown flags get a close match."""

    def error(self, message):
        raise ValueError(message)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [s for action in self._actions for s in action.option_strings]
            unknown = next((x.split("=")[0] for x in extras if x.startswith("-")), None)
            close = []
            if unknown:  # the same last part under another group (--diagnostics.dim -> --salt.dim), else spelling
                close = [f for f in flags if f.split(".")[-1] == unknown.split(".")[-1] and "." in unknown]
                close = close or difflib.get_close_matches(unknown, flags, n=1)
            hint = f" (did you mean {' or '.join(close[:3])}?)" if close else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace
