"""The demo's recipe, shared by `openrlhf-geo demo` and the studies: the task's data, the SFT warm-up (cached per
configuration), the flags every run shares, the four methods' flags, and running `openrlhf-geo train` jobs in a
process pool with one progress bar.
"""

import hashlib
import json
import shutil
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from openrlhf_geo import GeoWarning
from openrlhf_geo.local.rundir import save_model

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
# the studies' size, the demo's with --steps 60 (demo.DEFAULT); workers: runs in parallel processes (one thread each)
FULL = {"seeds": 5, "steps": 60, "eval_steps": 10, "sft_max_steps": 600, "workers": 2}
# per_prompt: solutions drawn per training prompt; shortcut_rate: share of them that follow the flawed procedure;
# strategies: the correct ones drawn (only "digits": the tiny model learns it to >90 % in the SFT budget, so that
# random slips stay rare next to the shortcut); final_lr_ratio: cosine decay of the SFT learning rate to this
# fraction (a stable end point); task: bump when the SFT targets change (invalidates caches)
SFT = {"hidden_size": 64, "num_layers": 2, "lr": 3e-3, "batch_size": 128, "seed": 0, "eval_every": 50,
       "per_prompt": 8, "shortcut_rate": 0.5, "strategies": ["digits"], "final_lr_ratio": 0.05,
       "task": "carry-shortcut-v2"}  # fmt: skip
N_TRAIN, N_EVAL, EVAL_SAMPLES = 3000, 256, 2
MAX_NEW_TOKENS = 48  # the longest worked solution is 40 tokens + EOS
# The demo's SFT warm-up as `warm_up` trains it (the files of its <out>/sft): with the same configuration key (SFT,
# its step budget, torch 2.13.0+cpu and the pinned kernels of local.kernels; transformers is pinned in
# requirements.txt) training gave these bytes on the CPUs docs/results.md lists ("Same seeds, same numbers"; another
# CPU class may train others), so `warm_up` copies them instead of training for 3-4 min (tests/test_demo_sft.py
# retrains and compares with the bytes recorded for the CPU's class). After a change to SFT:
# `openrlhf-geo demo --sft-from-scratch`, then copy runs/demo/sft here.
SHIPPED_SFT = Path(__file__).resolve().parents[1] / "assets" / "demo_sft"


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
    from openrlhf_geo.lab.task import addition_problems, write_jsonl

    train = addition_problems(N_TRAIN, seed=0, max_operand=max_operand, carry_only=True)
    held_out = addition_problems(
        N_EVAL, seed=1, max_operand=max_operand, exclude={r["prompt"] for r in train}, carry_only=True
    )
    write_jsonl(out / "data" / "train.jsonl", train)
    write_jsonl(out / "data" / "eval.jsonl", held_out)
    return train, held_out


def warm_up(
    out, train, held_out, target=None, max_steps=FULL["sft_max_steps"], log=print, sft_config=SFT, shipped=True
):
    """SFT for `max_steps` steps (the learning rate decays over them), or until the held-out accuracy (T = 1) reaches
    `target` when one is given (checked every sft_config["eval_every"] steps); cached per configuration in <out>/sft.
    `sft_config`: the SFT dict's keys (default SFT; the studies vary the model size and the strategies). `shipped`:
    copy SHIPPED_SFT when its key is this configuration's (a copy whose model file fails its sha256 is not used:
    a GeoWarning, then training); False trains here (and retrains a copied <out>/sft)."""
    from openrlhf_geo.lab.task import build_model, build_tokenizer, sft, sft_rows
    from openrlhf_geo.local import kernels
    from openrlhf_geo.local.engine import evaluate
    from openrlhf_geo.local.reward import shared_reward_fn

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
        if info.get("key") == key and (shipped or info.get("source") != "shipped"):
            log(f"SFT: reusing {out / 'sft'} ({info['steps']} steps, held-out accuracy {info['accuracy']:.3f})")
            return info
    copy = json.loads((SHIPPED_SFT / "sft.json").read_text()) if shipped else {}
    if copy.get("key") == key:
        digest = hashlib.sha256((SHIPPED_SFT / "model.safetensors").read_bytes()).hexdigest()
        if digest == copy["sha256"]:
            shutil.rmtree(out / "sft", ignore_errors=True)
            shutil.copytree(SHIPPED_SFT, out / "sft")
            info = {**copy, "source": "shipped"}
            info_path.write_text(json.dumps(info, indent=1))
            log(f"SFT: the shipped warm-up ({info['steps']} steps, held-out accuracy {info['accuracy']:.3f}; "
                "--sft-from-scratch trains it here)")  # fmt: skip
            return info
        warnings.warn(
            f"{SHIPPED_SFT / 'model.safetensors'} does not match its sha256 in sft.json (a damaged install?): "
            "training the SFT warm-up instead",
            GeoWarning,
            stacklevel=2,
        )
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, sft_config["hidden_size"], sft_config["num_layers"], seed=sft_config["seed"])
    reward_fn = shared_reward_fn("math_verify")
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
        "source": "trained",
        "sha256": hashlib.sha256((out / "sft" / "model.safetensors").read_bytes()).hexdigest(),
        "config": config,
        "steps": state["steps"],
        "accuracy": state["accuracy"],
        "target": target,
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": time.perf_counter() - start,
        "environment": kernels.environment(),  # not in the key: the same key gave other bytes on other CPUs
    }
    info_path.write_text(json.dumps(info, indent=1))
    return info


def run_one(job):
    """One `openrlhf-geo train` run (a process-pool task): job = {"argv", "out", "tags"}; it starts over in its
    directory (a study resumes whole runs, `study.finished`)."""
    from openrlhf_geo.lab.task import ShortcutPayer, shortcut_stats
    from openrlhf_geo.local import training
    from openrlhf_geo.local.flags import parse_args
    from openrlhf_geo.local.reward import shared_reward_fn

    args = parse_args(job["argv"])
    noise = args.geometry.noise
    reward_fn = shared_reward_fn(args.reward.func, args.reward.timeout_s)
    training.run(
        args,
        reward_fn,
        rollout_stats=shortcut_stats,  # task/* counts for the report (the training is the train command's)
        # --reward.noise.type misspecified: this task's verifier that also pays the shortcut's answer
        misspecified_pay=ShortcutPayer(reward_fn, noise.rate, noise.seed) if noise.type == "misspecified" else None,
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
