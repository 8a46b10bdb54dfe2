"""`openrlhf-geo demo`: tiny SFT -> RL on CPU, GRPO vs GRPO+SALT vs GRPO+GeoAlign, with a report and plots.

1. Data: two-digit additions that need a carry in the ones column (train / held-out jsonl in <out>/data).
2. SFT warm-up of a tiny Qwen2 (cached in <out>/sft) on randomly drawn solutions: half of them worked solutions
   that carry correctly (`task.worked_solution`, "digits" strategy with random operand order and connectives, so
   that sampled correct responses differ, as an LLM's do), half the flawed "quick" procedure that drops the carry
   (`task.shortcut_solution`), which is wrong on every prompt of this task. RL thus starts near 50 % accuracy with
   wrong answers that mostly share one recognisable cause, the regime GeoAlign's premise is about (the report says
   what the errors are made of; this is a property of the synthetic task, not a claim about LLMs).
3. Four methods x --seeds seeds, same prompts per step and the same budget, each one `openrlhf-geo train` run:
   grpo, salt (exact LM-head features), grpo_noise and geoalign_noise (10 % flipped binary rewards).
4. The runs' logs in <out>/runs/<method>/seed<k>/ (metrics.jsonl, gdi.jsonl), and from them <out>/summary.json
   (every number of the report), <out>/report.md and PNG plots (`openrlhf_geo.local.report`).

<out> belongs to the demo configuration that first wrote it (`claim_output`, shared with the studies): running it
again reruns it there; another configuration, a study or a directory of other files is refused.
"""

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from openrlhf_geo import GeoWarning
from openrlhf_geo.local.rundir import LOCK, save_model

NOISE = ["--reward.noise.type", "flip", "--reward.noise.rate", "0.1"]
# fmt: off
METHOD_FLAGS = {
    # GRPO also computes the exact features (diagnostics only) so its PR / n_eff sit next to SALT's
    "grpo": ["--advantage_estimator", "group_norm", "--salt.diagnostics", "--salt.features", "exact"],
    "salt": ["--advantage_estimator", "salt", "--salt.features", "exact"],
    "grpo_noise": [*NOISE],
    # projector sized for d=64 hidden states (the paper's 512-512-128 is for LLM widths), and the KDE fed by
    # the 128-rollout batch (the paper's min 100 scores assumes bigger batches; here ~100-128 rollouts get pairs)
    "geoalign_noise": [
        *NOISE,
        "--geoalign.enable",
        "--geoalign.projector.hidden_sizes", "128", "128",
        "--geoalign.projector.out_dim", "32",
    ],
}
# fmt: on
METHODS = tuple(METHOD_FLAGS)
# (method, baseline) pairs the report compares, paired by seed: each method against GRPO, and GeoAlign against
# GRPO under the same reward noise
COMPARISONS = (("salt", "grpo"), ("grpo_noise", "grpo"), ("geoalign_noise", "grpo"), ("geoalign_noise", "grpo_noise"))
# workers: runs in parallel processes (one thread each); the quick run stays in-process (imports dominate it)
FULL = {"seeds": 5, "steps": 60, "eval_steps": 10, "sft_max_steps": 600, "workers": 2}
QUICK = {"seeds": 1, "steps": 4, "eval_steps": 4, "sft_max_steps": 30, "workers": 1}
# per_prompt: solutions drawn per training prompt; shortcut_rate: share of them that follow the flawed procedure;
# strategies: the correct ones drawn (only "digits": the tiny model learns it to >90 % in the SFT budget, so that
# random slips stay rare next to the shortcut); final_lr_ratio: cosine decay of the SFT learning rate to this
# fraction (a stable end point); task: bump when the SFT targets change (invalidates caches)
SFT = {"hidden_size": 64, "num_layers": 2, "lr": 3e-3, "batch_size": 128, "seed": 0, "eval_every": 50,
       "per_prompt": 8, "shortcut_rate": 0.5, "strategies": ["digits"], "final_lr_ratio": 0.05,
       "task": "carry-shortcut-v2"}  # fmt: skip
N_TRAIN, N_EVAL, EVAL_SAMPLES = 3000, 256, 2
MAX_NEW_TOKENS = 48  # the longest worked solution is 40 tokens + EOS
_REWARD_FNS = {}  # one memoised math-verify scorer (and its worker process) per demo process, shared by its runs


def build_parser():
    from openrlhf_geo.local.flags import FlagParser

    p = FlagParser(prog="openrlhf-geo demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke check: 1 seed, a few steps, short SFT (<= 60 s)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per method (default 5; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 60; --quick 4)")
    p.add_argument("--out", default=None, help="output directory (default runs/demo, runs/demo-quick with --quick)")
    p.add_argument(
        "--sft-target",
        type=float,
        default=None,
        help="stop SFT early once the held-out accuracy reaches this (default: the whole SFT schedule)",
    )
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-up steps (default 600; --quick 30)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="runs in parallel processes, one CPU thread each (default 2; --quick 1)",
    )
    return p


# 128 rollouts per step as 8 prompts x G = 16: more within-prompt pairs per rollout for GeoAlign's GDI than 16 x 8
ROLLOUT_FLAGS = [
    "--rollout.batch_size", "8",
    "--rollout.n_samples_per_prompt", "16",
    "--rollout.max_new_tokens", str(MAX_NEW_TOKENS),
    "--actor.adam.lr", "3e-4",
]  # fmt: skip


def common_flags(out, steps, eval_steps, rollout=ROLLOUT_FLAGS):
    """The flags every run shares: the SFT model and data under `out`, evaluation, `rollout` flags, the budget."""
    return [
        "--actor.model_name_or_path", str(out / "sft"),
        "--data.prompt_dataset", str(out / "data" / "train.jsonl"),
        "--eval.dataset", str(out / "data" / "eval.jsonl"),
        "--eval.steps", str(eval_steps),
        "--eval.n_samples_per_prompt", str(EVAL_SAMPLES),
        *rollout,
        "--train.steps", str(steps),
        "--train.device", "cpu",
        "--train.threads", "1",
    ]  # fmt: skip


def prepare_data(out, max_operand=99):
    """Train / held-out additions a+b= (a, b <= max_operand) that need a carry, in <out>/data."""
    from openrlhf_geo.local.task import addition_problems, write_jsonl

    train = addition_problems(N_TRAIN, seed=0, max_operand=max_operand, carry_only=True)
    held_out = addition_problems(
        N_EVAL, seed=1, max_operand=max_operand, exclude={r["prompt"] for r in train}, carry_only=True
    )
    write_jsonl(out / "data" / "train.jsonl", train)
    write_jsonl(out / "data" / "eval.jsonl", held_out)
    return train, held_out


def warm_up(out, train, held_out, target=None, max_steps=FULL["sft_max_steps"], log=print, sft_config=SFT):
    """SFT for `max_steps` steps (the learning rate decays over them), or until the held-out accuracy (T = 1) reaches
    `target` when one is given (checked every sft_config["eval_every"] steps); cached per configuration in <out>/sft.
    `sft_config`: the SFT dict's keys (default SFT; the studies vary the model size and the strategies)."""
    from openrlhf_geo.local import kernels
    from openrlhf_geo.local.engine import evaluate
    from openrlhf_geo.local.reward import make_reward_fn
    from openrlhf_geo.local.task import build_model, build_tokenizer, sft, sft_rows

    config = {
        **sft_config,
        "target": target,
        "max_steps": max_steps,
        "n_train": len(train),
        "torch": torch.__version__,
        "kernels": kernels.active(),  # another CPU's kernels warm up to other weights (local.kernels)
    }
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    info_path = out / "sft" / "sft.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("key") == key:
            log(f"SFT: reusing {out / 'sft'} ({info['steps']} steps, held-out accuracy {info['accuracy']:.3f})")
            return info
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, sft_config["hidden_size"], sft_config["num_layers"], seed=sft_config["seed"])
    if "math_verify" not in _REWARD_FNS:
        _REWARD_FNS["math_verify"] = make_reward_fn("math_verify")
    reward_fn = _REWARD_FNS["math_verify"]
    rows = sft_rows(
        train, sft_config["per_prompt"], sft_config["seed"], sft_config["strategies"], sft_config["shortcut_rate"]
    )
    state = {"accuracy": 0.0, "steps": 0}

    from tqdm.auto import tqdm

    bar = tqdm(total=max_steps, desc="SFT warm-up", unit="step")

    def callback(step, loss):
        bar.update(1)
        state["steps"] = step
        if step < max_steps and (target is None or step % sft_config["eval_every"]):
            return False
        state["accuracy"] = evaluate(model, tokenizer, held_out, reward_fn, EVAL_SAMPLES, MAX_NEW_TOKENS)
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{state['accuracy']:.3f}")
        return target is not None and state["accuracy"] >= target

    start = time.perf_counter()
    sft(
        model,
        tokenizer,
        rows,
        max_steps,
        sft_config["batch_size"],
        sft_config["lr"],
        seed=sft_config["seed"],
        callback=callback,
        final_lr_ratio=sft_config["final_lr_ratio"],
    )
    bar.close()
    save_model(model, out / "sft")
    tokenizer.save_pretrained(out / "sft")
    info = {
        "key": key,
        "config": config,
        "steps": state["steps"],
        "accuracy": state["accuracy"],
        "target": target,
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": time.perf_counter() - start,
    }
    info_path.write_text(json.dumps(info, indent=1))
    return info


def run_one(job):
    """One `openrlhf-geo train` run (a process-pool task): job = {"argv", "out", "tags"}; it starts over in its
    directory (a study resumes whole runs, `study.finished`)."""
    from openrlhf_geo.local import training
    from openrlhf_geo.local.reward import make_reward_fn
    from openrlhf_geo.local.task import ShortcutPayer, shortcut_stats
    from openrlhf_geo.local.train import parse_args

    args = parse_args(job["argv"])
    if args.reward.func not in _REWARD_FNS:
        _REWARD_FNS[args.reward.func] = make_reward_fn(args.reward.func)
    reward_fn = _REWARD_FNS[args.reward.func]
    training.run(
        args,
        reward_fn,
        rollout_stats=shortcut_stats,  # task/* counts for the report (the training is the train command's)
        # --reward.noise.type misspecified: this task's verifier that also pays the shortcut's answer
        misspecified_pay=ShortcutPayer(reward_fn, args.reward.noise.rate, args.reward.noise.seed)
        if args.reward.noise.type == "misspecified"
        else None,
        tags=job["tags"],
        progress=job.get("progress"),
        bar=False,
        overwrite=True,
    )
    return job["out"]


def _count_lines(path):
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


class RunsFailed(RuntimeError):
    """Some runs of `run_all` raised; the others ran to the end. `failures`: [(job, exception)] in job order."""

    def __init__(self, failures):
        self.failures = failures
        job, error = failures[0]
        super().__init__(f"{len(failures)} run(s) failed; the first, {job['out']}: {type(error).__name__}: {error}")


def run_all(jobs, workers, steps):
    """Run the jobs (in `workers` processes, or in this one), with one progress bar over all steps. A run that
    raises does not stop the others; RunsFailed names every failed run at the end."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs) * steps, desc="RL runs", unit="step")
    failures = []
    if workers <= 1:
        for job in jobs:
            bar.set_description(f"RL {job['tags']['method']} seed {job['tags']['seed']}")
            try:
                run_one({**job, "progress": lambda row: bar.update(1)})
            except Exception as error:
                failures.append((job, error))
    else:
        import multiprocessing

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_one, job) for job in jobs]
            while not all(f.done() for f in futures):
                time.sleep(0.5)
                # eval rows (step 0) are not RL steps
                done = sum(max(0, _count_lines(Path(j["out"]) / "metrics.jsonl") - 1) for j in jobs)
                bar.update(done - bar.n)
            failures = [(job, f.exception()) for job, f in zip(jobs, futures) if f.exception() is not None]
    bar.update(bar.total - bar.n)
    bar.close()
    if failures:
        raise RunsFailed(failures)


COMMAND_FILE = "command.json"  # in the --out of the demo and the studies: the command it belongs to


class OutputClaimed(ValueError):
    """`--out` cannot be used by this command (`claim_output`); the message names it."""


@contextmanager
def claim_output(path, command, name="--out"):
    """Create and lock `--out` of the demo or a study (or another command's output directory, `name` in messages)
    for `command` -> yields it as a Path.

    `command` is what the outputs depend on, as a command line (e.g. "openrlhf-geo demo --quick --seeds 1 --steps 4";
    not --workers). The protection `openrlhf-geo train` gives its output directory (`rundir.claim`): the first use
    records `command` in <out>/command.json; the same command later proceeds (the demo reruns its runs, a study
    resumes the unfinished ones), while a directory recorded for another command, holding files but no record (a
    train run, an older version's output, anything else) or being written by another process is refused with an
    OutputClaimed naming `name` and the path, before anything in it changes. The lock is held until the block ends.
    """
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = open(out / LOCK, "a+")
    except OSError as error:
        raise OutputClaimed(f"{name} {out}: {error.strerror}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputClaimed(
                f"{name} {out}: another run is writing it; wait for it or choose another {name}"
            ) from None
        try:
            record = out / COMMAND_FILE
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
            yield out
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_kernels(prog):
    """The CPU kernels this process computes with (`kernels.active`); a warning when they are not the pinned ones
    (the demo or a study called from Python after torch computed): its per-seed results are then this CPU's."""
    from openrlhf_geo.local import kernels

    used = kernels.active()
    if not used["pinned"]:
        warnings.warn(
            f"{prog}: CPU kernels not pinned ({used['aten']}; `openrlhf-geo` runs local.kernels.pin before torch "
            "computes): per-seed results may differ from other machines'",
            GeoWarning,
            stacklevel=2,
        )
    return used


def demo_command(args, seeds, steps):
    """The demo's identity for `claim_output`: the options its outputs depend on, resolved."""
    command = ["openrlhf-geo demo", *(["--quick"] if args.quick else []), f"--seeds {seeds} --steps {steps}"]
    command += [f"--sft-target {args.sft_target:g}"] if args.sft_target is not None else []
    return " ".join(command + ([f"--sft-steps {args.sft_steps}"] if args.sft_steps is not None else []))


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        preset = QUICK if args.quick else FULL
        seeds = range(args.seeds if args.seeds is not None else preset["seeds"])
        steps = args.steps if args.steps is not None else preset["steps"]
        workers = args.workers if args.workers is not None else min(preset["workers"], os.cpu_count() or 1)
        if args.sft_steps is not None:
            preset = {**preset, "sft_max_steps": args.sft_steps}
        checks = (("--seeds", len(seeds)), ("--steps", steps), ("--workers", workers))
        for flag, value in (*checks, ("--sft-steps", preset["sft_max_steps"])):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1 (got {value})")
        if args.sft_target is not None and not 0 < args.sft_target <= 1:
            raise ValueError(f"--sft-target must be an accuracy in (0, 1] (got {args.sft_target})")
    except ValueError as error:
        print(f"openrlhf-geo demo: error: {error}", file=sys.stderr)
        return 2
    try:
        path = args.out or ("runs/demo-quick" if args.quick else "runs/demo")  # a smoke run never takes the demo's
        with claim_output(path, demo_command(args, len(seeds), steps)) as out:
            return run(args, out, preset, seeds, steps, workers)
    except OutputClaimed as error:
        print(f"openrlhf-geo demo: error: {error}", file=sys.stderr)
        return 2


def run(args, out, preset, seeds, steps, workers):
    """The demo in its claimed `out` (`main` checked the options) -> exit status."""
    from openrlhf_geo.local import report

    eval_steps = min(preset["eval_steps"], steps)
    start = time.perf_counter()
    torch.set_num_threads(1)  # a 0.13M-parameter model gains nothing from more; extra threads only contend
    used = check_kernels("openrlhf-geo demo")

    train, held_out = prepare_data(out)
    sft_info = warm_up(out, train, held_out, args.sft_target, preset["sft_max_steps"])

    common = common_flags(out, steps, eval_steps)
    jobs = [
        {
            "argv": [*common, *METHOD_FLAGS[m], "--train.seed", str(s), "--reward.noise.seed", str(s),
                     "--ckpt.output_dir", str(out / "runs" / m / f"seed{s}")],
            "out": str(out / "runs" / m / f"seed{s}"),
            "tags": {"method": m, "seed": s},
        }
        for s in seeds
        for m in METHODS
    ]  # fmt: skip
    # the report reads every run under <out>/runs: runs of an earlier demo there (other seeds or methods) would join it
    shutil.rmtree(out / "runs", ignore_errors=True)
    rl_start = time.perf_counter()
    run_all(jobs, workers, steps)
    rl_wall = time.perf_counter() - rl_start

    setup = {
        "quick": args.quick,
        "task": f"two-digit additions `a+b=` that need a carry in the ones column; {len(train)} training and "
        f"{len(held_out)} held-out prompts; reward: math-verify verdict of the last `\\boxed{{}}` (1/0).",
        "steps": steps,
        "seeds": list(seeds),
        "sft": sft_info,
        "n_train": len(train),
        "n_eval": len(held_out),
        "eval_samples": EVAL_SAMPLES,
        "wall_s": rl_wall,
        "kernels": used,
        "common": "openrlhf-geo train " + shlex.join(common) + " --train.seed S --reward.noise.seed S",
        "commands": {m: shlex.join(METHOD_FLAGS[m]) for m in METHODS},
    }
    report.write_report(out, out / "runs", COMPARISONS, setup, METHODS)
    print(f"demo finished in {time.perf_counter() - start:.0f} s: {out / 'report.md'}")
    return 0
