"""`openrlhf-geo train`: a single-process GRPO / Dr.GRPO / DAPO run with optional SALT and GeoAlign.

Flag names follow upstream OpenRLHF 0.11.2 (`--rollout.n_samples_per_prompt`, `--actor.eps_clip_low_high`, ...)
and the fork (`--advantage_estimator salt`, `--salt.*`, `--geoalign.*`, `--reward.noise.*`), so a local run
translates to a Ray run flag by flag. Example, continuing from the demo's SFT model::

    openrlhf-geo train --actor.model_name_or_path runs/demo/sft --data.prompt_dataset runs/demo/data/train.jsonl \\
        --advantage_estimator salt --salt.features exact --train.steps 50 --ckpt.output_dir runs/my_salt

Writes `<ckpt.output_dir>/metrics.jsonl` (one JSON object per step), `checkpoint.pt` (resume with
`--ckpt.load_enable`) and the final model + tokenizer (`save_pretrained`) in `<ckpt.output_dir>/model`.
"""

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from openrlhf_geo import options

ESTIMATORS = ("group_norm", "dr_grpo", "salt")
LOCAL_SALT_BASES = ("group_norm", "dr_grpo")


def build_parser():
    p = argparse.ArgumentParser(
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
        choices=ESTIMATORS,
        default="group_norm",
        help="group_norm (GRPO), dr_grpo (Dr. GRPO: no std), salt (--salt.base + SALT reweighting)",
    )
    algo.add_argument("--algo.dynamic_filtering_enable", action="store_true", help="DAPO: drop all-equal groups")
    algo.add_argument("--algo.kl.init_coef", type=float, default=0.0, help="KL-to-reference loss coefficient")
    algo.add_argument("--algo.kl.estimator", choices=("k1", "k2", "k3"), default="k3")
    algo.add_argument(
        "--diagnostics.features",
        choices=("exact", "sketch"),
        default=None,
        help="without SALT: compute LM-head features anyway and log PR and n_eff of the unmodified advantages",
    )
    algo.add_argument("--diagnostics.dim", type=int, default=4096, help="sketch dimension for --diagnostics.features")

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

    options.add_args(p)
    return p


def validate(args):
    """options.validate plus the local engine's own limits; ValueError naming the flag."""
    noise = args.reward.noise
    if args.reward.pm1 and noise.type == "flip" and noise.levels is None:
        noise.levels = (-1.0, 1.0)  # --reward.pm1 makes the rewards DAPO's -1/+1, so that is what a flip swaps
    options.validate(args)
    if args.reward.pm1 and noise.type == "flip" and tuple(noise.levels) != (-1.0, 1.0):
        raise ValueError("--reward.pm1 makes rewards -1/+1: use --reward.noise.levels -1 1 (or leave it out)")
    if args.salt.enable and args.algo.advantage.estimator not in LOCAL_SALT_BASES:
        raise ValueError(
            f"the local engine supports --salt.base {' or '.join(LOCAL_SALT_BASES)} (got {args.salt.base})"
        )
    if args.salt.enable and args.diagnostics.features is not None:
        raise ValueError("--diagnostics.features is for runs without SALT; SALT logs its geometry itself")
    if (args.actor.model_name_or_path is None) == (args.actor.config is None):
        raise ValueError("give exactly one of --actor.model_name_or_path and --actor.config")
    if args.actor.config is not None and args.actor.tokenizer is None:
        raise ValueError("--actor.config needs --actor.tokenizer (a randomly initialised model has no tokenizer)")
    checks = [
        (args.rollout.n_samples_per_prompt >= 2, "--rollout.n_samples_per_prompt must be >= 2 (group baselines)"),
        (args.rollout.batch_size >= 1, "--rollout.batch_size must be >= 1"),
        (args.rollout.max_new_tokens >= 1, "--rollout.max_new_tokens must be >= 1"),
        (args.rollout.temperature > 0, "--rollout.temperature must be > 0"),
        (0 < args.rollout.top_p <= 1, "--rollout.top_p must be in (0, 1]"),
        (args.train.steps >= 0, "--train.steps must be >= 0"),
        (args.train.max_epochs >= 1, "--train.max_epochs must be >= 1"),
        (args.algo.kl.init_coef >= 0, "--algo.kl.init_coef must be >= 0"),
        (args.actor.adam.lr > 0, "--actor.adam.lr must be > 0"),
        (args.actor.eps_clip > 0, "--actor.eps_clip must be > 0"),
        (
            args.actor.eps_clip_low_high is None or min(args.actor.eps_clip_low_high) > 0,
            "--actor.eps_clip_low_high values must be > 0",
        ),
        (
            min(args.train.batch_size, args.train.micro_batch_size, args.rollout.micro_batch_size) >= 0,
            "--train.batch_size, --train.micro_batch_size and --rollout.micro_batch_size must be >= 0",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if args.reward.noise.type == "swap" and args.reward.pm1:
        raise ValueError("--reward.noise.type swap is for scalar rewards; use flip with --reward.pm1")
    return args


def parse_args(argv):
    return validate(options.nest(build_parser().parse_args(argv)))


def load_python_reward(path):
    """reward_fn from a .py file defining upstream's `reward_func(queries, prompts, labels)`."""
    spec = importlib.util.spec_from_file_location("openrlhf_geo_user_reward", path)
    if spec is None or not Path(path).is_file():
        raise ValueError(f"--reward.func {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "reward_func"):
        raise ValueError(f"--reward.func {path}: defines no reward_func(queries, prompts, labels)")

    def reward_fn(prompts, responses, answers):
        out = module.reward_func([p + r for p, r in zip(prompts, responses)], list(prompts), list(answers))
        return torch.as_tensor(out["rewards"] if isinstance(out, dict) else out, dtype=torch.float32).flatten()

    return reward_fn


class CachedMathVerify:
    """math-verify verdicts (1/0) memoised per (response, answer): rollouts of a sharpening policy repeat a lot.

    Timed-out or failed items score 0 and are not memoised (a retry may succeed); the memo is cleared when it
    exceeds `max_entries` so long runs with unique responses stay bounded in memory.
    """

    def __init__(self, workers=1, timeout=5.0, max_entries=200_000):
        from openrlhf_geo.rewards.math_verify import MathVerifyReward

        self.scorer = MathVerifyReward(mode="grpo", timeout=timeout, workers=workers)
        self.cache, self.max_entries = {}, max_entries

    def __call__(self, prompts, responses, answers):
        keys = list(zip(responses, answers))
        missing = sorted(set(keys) - self.cache.keys())
        fresh = {}
        if missing:
            verdicts = self.scorer.verdicts([r for r, _ in missing], [a for _, a in missing])
            fresh = {key: float(v.correct) for key, v in zip(missing, verdicts)}
            if len(self.cache) + len(fresh) > self.max_entries:
                self.cache.clear()
            self.cache.update({k: fresh[k] for k, v in zip(missing, verdicts) if v.status not in ("timeout", "error")})
        return torch.tensor([fresh[k] if k in fresh else self.cache[k] for k in keys])


def make_reward_fn(spec):
    return CachedMathVerify() if spec == "math_verify" else load_python_reward(spec)


def load_model(args, device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if args.actor.model_name_or_path is not None:
        model = AutoModelForCausalLM.from_pretrained(args.actor.model_name_or_path, dtype=torch.float32)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(args.train.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.actor.config))
    tokenizer = AutoTokenizer.from_pretrained(args.actor.tokenizer or args.actor.model_name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; rollouts need one to end")
    return model.to(device), tokenizer


def _finite_or_none(value):
    """NaN/inf -> None (strict JSON), elementwise for lists."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def fit(trainer, steps, out_dir, eval_steps=-1, eval_samples=1, save_steps=-1, tags=None, progress=None):
    """Run RL steps up to `steps` (continuing from trainer.global_step) -> the metric rows written.

    Writes one JSON object per step to <out_dir>/metrics.jsonl (plus `tags`, e.g. method and seed) and, with
    GeoAlign, each step's per-rollout GDI / corruption / flags to <out_dir>/gdi.jsonl; evaluates
    every `eval_steps` steps (and before the first step when starting fresh), checkpoints every `save_steps` and at
    the end. `progress(row)` is called after each step.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tags = tags or {}
    rows = []
    # a fresh run replaces old logs; a resumed one keeps the rows up to its checkpoint's step, then appends
    for name in ("metrics.jsonl", "gdi.jsonl"):
        path = out_dir / name
        if not path.exists():
            continue
        if trainer.global_step == 0:
            path.unlink()
        else:
            lines = path.read_text().splitlines(keepends=True)
            path.write_text("".join(x for x in lines if json.loads(x)["step"] <= trainer.global_step))

    def write(row):
        row = {**tags, **row}
        rows.append(row)
        with (out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({k: _finite_or_none(v) for k, v in row.items()}) + "\n")

    if eval_steps > 0 and trainer.global_step == 0:
        write({"step": 0, **trainer.evaluate(eval_samples)})
    while trainer.global_step < steps:
        row = trainer.step()
        if trainer.last_curation is not None:
            record = {k: None if v is None else _finite_or_none(v.tolist()) for k, v in trainer.last_curation.items()}
            with (out_dir / "gdi.jsonl").open("a") as f:
                f.write(json.dumps({**tags, "step": trainer.global_step, **record}) + "\n")
        if eval_steps > 0 and (trainer.global_step % eval_steps == 0 or trainer.global_step == steps):
            row.update(trainer.evaluate(eval_samples))
        write(row)
        if save_steps > 0 and trainer.global_step % save_steps == 0:
            trainer.save_checkpoint(out_dir / "checkpoint.pt")
        if progress is not None:
            progress(row)
    trainer.save_checkpoint(out_dir / "checkpoint.pt")
    return rows


def main(argv=None):
    from openrlhf_geo.local.engine import Trainer
    from openrlhf_geo.local.task import read_jsonl

    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"openrlhf-geo train: {e}", file=sys.stderr)
        return 2
    if args.train.threads:
        torch.set_num_threads(args.train.threads)
    device = torch.device(args.train.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = load_model(args, device)
    rows = read_jsonl(args.data.prompt_dataset, args.data.input_key, args.data.label_key)
    eval_rows = read_jsonl(args.eval.dataset, args.data.input_key, args.data.label_key) if args.eval.dataset else None
    trainer = Trainer(args, model, tokenizer, rows, make_reward_fn(args.reward.func), eval_rows)
    out = Path(args.ckpt.output_dir)
    if args.ckpt.load_enable and (out / "checkpoint.pt").exists():
        trainer.load_checkpoint(out / "checkpoint.pt")
        print(f"resumed from {out / 'checkpoint.pt'} at step {trainer.global_step}")

    from tqdm.auto import tqdm

    bar = tqdm(total=args.train.steps, initial=trainer.global_step, desc="train", unit="step")

    def progress(row):
        bar.update(1)
        bar.set_postfix(acc=f"{row['accuracy']:.2f}", loss=f"{row['loss']:.3f}")

    fit(
        trainer,
        args.train.steps,
        out,
        args.eval.steps,
        args.eval.n_samples_per_prompt,
        args.ckpt.save_steps,
        progress=progress,
    )
    bar.close()
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'checkpoint.pt'} and {out / 'model'}")
    return 0
