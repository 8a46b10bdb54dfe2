"""The long chain-of-thought task family (`task.chain_*`, the repeated-addition trace "a+b*k=") as inputs of
`openrlhf-geo train`: one SFT warm-up on several lengths, then RL data per length.

The length is k, the number of additions (responses of ~116 tokens at k = 3, ~193 at 5, ~269 at 7, ~347 at 9). One
model is warmed up on a mix of lengths (`SftRecipe.ks`), so that the RL candidates of a study differ in k only.
`prepare_sft(out, recipe)` writes the model + tokenizer to <out>/sft (cached by a key of the recipe, as
`recipe.warm_up` caches the demo's) with its held-out accuracy per k; `prepare_data(out, k)` writes
<out>/data/k<k>/{train,eval}.jsonl (the SFT's problems of that length and disjoint held-out ones); `train_flags`
gives the `openrlhf-geo train` flags of an RL run at length k. The task is selected by these flags (the prompt
dataset, the model and --rollout.max_new_tokens): `openrlhf-geo train` itself is task-agnostic and needs no task flag.

    python -m openrlhf_geo.lab.long_cot_task --out runs/long-cot-pilot/mix

warms up the default recipe and prints a train command per length.

Why long responses: SALT (arXiv 2606.05800) §2.2-2.3 and Fig. 2 diagnose signed low-rank redundancy of per-rollout
gradients in long reasoning, where many tokens of a response are shared or near-deterministic and per-response
LM-head gradients cancel inside a group; its α_t = max(0, 1 − n_eff) (Eq. 17, n_eff of Eq. 6) is nonzero only there.
"""

import argparse
import hashlib
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

N_TRAIN_PER_K, N_EVAL, EVAL_SAMPLES = 1000, 256, 1
MAX_POSITIONS = 512  # the longest prompt (8 tokens with <bos>) + the longest response at k = 9 (390) fit


def max_new_tokens(k):
    """Room for the longest correct solution of k additions (at most 41 tokens each, the box included) plus EOS."""
    return 42 * k + 12


@dataclass(frozen=True)
class SftRecipe:
    """The warm-up: a Qwen2 of `hidden_size` x `num_layers` trained on `per_prompt` solutions of each of
    N_TRAIN_PER_K problems per length in `ks`, a share `shortcut_rate` of them the carry-dropping shortcut (the demo's
    50/50 mix), `steps` AdamW steps of `batch_size` sequences (lr warm-up 50 steps, cosine decay to `final_lr_ratio`,
    as the demo's `task.sft`). batch_size 32 x ~190 tokens is about the demo's 128 x 28 tokens per step.

    3 x 96 (449,280 parameters): in a pilot on k = 3 only (600 steps of 64), the demo's 2 x 64 model reached a held-out
    accuracy of 0.047 (operands copied wrong), 3 x 96 reached 0.443 with half of its answers the shortcut's."""

    hidden_size: int = 96
    num_layers: int = 3
    num_heads: int = 4
    ks: tuple = (3, 5, 7)
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    final_lr_ratio: float = 0.05
    per_prompt: int = 4
    shortcut_rate: float = 0.5
    seed: int = 0
    task: str = "repeat-add-v1"  # bump when the SFT targets change (invalidates caches)


def problems(k):
    """(train, held-out) problems of length k: N_TRAIN_PER_K seeded with k, N_EVAL disjoint ones seeded 100 + k."""
    from openrlhf_geo.lab.task import chain_problems

    train = chain_problems(N_TRAIN_PER_K, seed=k, steps=k)
    held_out = chain_problems(N_EVAL, seed=100 + k, steps=k, exclude={r["prompt"] for r in train})
    return train, held_out


def prepare_data(out, k):
    """<out>/data/k<k>/{train,eval}.jsonl (`problems`) -> (train path, eval path)."""
    from openrlhf_geo.lab.task import write_jsonl

    train, held_out = problems(k)
    where = Path(out) / "data" / f"k{k}"
    write_jsonl(where / "train.jsonl", train)
    write_jsonl(where / "eval.jsonl", held_out)
    return where / "train.jsonl", where / "eval.jsonl"


def prepare_sft(out, recipe: SftRecipe, log=print, bar=True, eval_ks=None):
    """The warm-up of `recipe` in <out>/sft (cached: a finished warm-up with the same key is reused) -> info {"key",
    "recipe", "steps", "accuracy" {k: held-out accuracy at T = 1, EVAL_SAMPLES each}, "shortcut" {k: share of
    responses that follow the shortcut}, "params", "sft_s", "wall_s"}; accuracy is measured for `eval_ks` (default
    the recipe's ks)."""
    from openrlhf_geo.lab.task import build_model, build_tokenizer, chain_sft_rows, sft
    from openrlhf_geo.local import kernels
    from openrlhf_geo.local.reward import make_reward_fn
    from openrlhf_geo.local.rundir import save_model

    out = Path(out)
    eval_ks = tuple(eval_ks or recipe.ks)
    config = {**asdict(recipe), "eval_ks": eval_ks, "torch": torch.__version__, "kernels": kernels.active()}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    info_path = out / "sft" / "sft.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("key") == key:
            log(f"SFT: reusing {out / 'sft'} ({info['steps']} steps, held-out accuracy {info['accuracy']})")
            return info
    tokenizer = build_tokenizer()
    r = recipe
    model = build_model(tokenizer, r.hidden_size, r.num_layers, r.num_heads, seed=r.seed, max_positions=MAX_POSITIONS)
    rows = [row for k in recipe.ks for row in problems(k)[0]]
    sft_rows = chain_sft_rows(rows, recipe.per_prompt, recipe.seed, recipe.shortcut_rate)
    from tqdm.auto import tqdm

    progress = tqdm(total=recipe.steps, desc="SFT warm-up (long-cot)", unit="step", disable=not bar)
    start = time.perf_counter()
    sft(
        model,
        tokenizer,
        sft_rows,
        recipe.steps,
        recipe.batch_size,
        recipe.lr,
        seed=recipe.seed,
        callback=lambda step, loss: progress.update(1) and False,
        final_lr_ratio=recipe.final_lr_ratio,
    )
    progress.close()
    sft_s = time.perf_counter() - start
    reward_fn = make_reward_fn("math_verify")
    accuracy, shortcut = {}, {}
    for k in eval_ks:
        accuracy[k], shortcut[k] = evaluate_length(model, tokenizer, problems(k)[1], reward_fn, k)
    out.joinpath("sft").mkdir(parents=True, exist_ok=True)
    save_model(model, out / "sft")
    tokenizer.save_pretrained(out / "sft")
    info = {
        "key": key,
        "recipe": config,
        "steps": recipe.steps,
        "accuracy": accuracy,
        "shortcut": shortcut,
        "params": sum(p.numel() for p in model.parameters()),
        "sft_s": sft_s,
        "wall_s": time.perf_counter() - start,
    }
    info_path.write_text(json.dumps(info, indent=1))
    log(f"SFT: {info['params']} parameters, held-out accuracy {accuracy}, shortcut share {shortcut}")
    return json.loads(info_path.read_text())  # as a reuse reads it (keys as strings)


def evaluate_length(model, tokenizer, rows, reward_fn, k, n_samples=EVAL_SAMPLES, seed=0):
    """(held-out accuracy, share of responses that follow the shortcut) at T = 1, sampled as `engine.evaluate`."""
    from openrlhf_geo.lab.task import uses_shortcut
    from openrlhf_geo.local.engine import generate_rollouts

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        batch = generate_rollouts(
            model, tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows], n_samples, max_new_tokens(k)
        )
    verdicts = torch.as_tensor(reward_fn(batch.prompts, batch.responses, batch.answers), dtype=torch.float32)
    shortcut = sum(uses_shortcut(r) for r in batch.responses) / len(batch.responses)
    return verdicts.mean().item(), shortcut


def train_flags(out, k, steps, eval_steps, batch_size=8, group=8, lr=3e-4):
    """`openrlhf-geo train` flags of an RL run at length k on the model and data prepared in `out` (the demo's RL
    recipe with SALT Table 4's G = 8 and the length's max_new_tokens); method, seed and output flags follow."""
    out = Path(out)
    return [
        "--actor.model_name_or_path", str(out / "sft"),
        "--data.prompt_dataset", str(out / "data" / f"k{k}" / "train.jsonl"),
        "--eval.dataset", str(out / "data" / f"k{k}" / "eval.jsonl"),
        "--eval.steps", str(eval_steps),
        "--eval.n_samples_per_prompt", str(EVAL_SAMPLES),
        "--rollout.batch_size", str(batch_size),
        "--rollout.n_samples_per_prompt", str(group),
        "--rollout.max_new_tokens", str(max_new_tokens(k)),
        "--actor.adam.lr", str(lr),
        "--train.steps", str(steps),
        "--train.device", "cpu",
        "--train.threads", "1",
    ]  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m openrlhf_geo.lab.long_cot_task", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="SFT steps")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--ks", type=int, nargs="+", default=None, help="lengths of the SFT mix")
    args = p.parse_args(argv)
    given = {
        "steps": args.steps,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "batch_size": args.batch_size,
        "ks": tuple(args.ks) if args.ks else None,
    }
    recipe = replace(SftRecipe(), **{k: v for k, v in given.items() if v is not None})
    torch.set_num_threads(1)
    info = prepare_sft(args.out, recipe)
    print(json.dumps({k: v for k, v in info.items() if k != "recipe"}, indent=1))
    for k in recipe.ks:
        prepare_data(args.out, k)
        flags = train_flags(args.out, k, steps=40, eval_steps=20)
        print("openrlhf-geo train " + shlex.join(flags) + " --advantage_estimator group_norm --salt.diagnostics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
