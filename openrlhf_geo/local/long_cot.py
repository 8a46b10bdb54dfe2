"""The long chain-of-thought task family (`task.chain_*`) as settings `openrlhf-geo train` runs on.

A setting is a number of additions k (the response length: k = 3 ~116 tokens, 5 ~193, 7 ~269, 9 ~347; `task.py`'s
repeated-addition trace "a+b*k=") plus its SFT warm-up. `prepare(out, setting)` writes <out>/data/{train,eval}.jsonl
and the warmed-up model + tokenizer in <out>/sft (cached by a key of the configuration, as `demo.warm_up` caches the
demo's); `train_flags` gives the `openrlhf-geo train` flags that run RL on it. The task is selected by these flags
(the prompt dataset and the model): `openrlhf-geo train` itself is task-agnostic and needs no task flag.

    python -m openrlhf_geo.local.long_cot --setting steps5 --out runs/long-cot/settings/steps5

prints the train command once the setting is ready.

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

N_TRAIN, N_EVAL, EVAL_SAMPLES = 3000, 256, 2


@dataclass(frozen=True)
class ChainSetting:
    """A repeated-addition setting: `steps` additions per prompt (k of "a+b*k=") and its SFT recipe."""

    name: str
    steps: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    sft_steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    final_lr_ratio: float = 0.05
    per_prompt: int = 4
    shortcut_rate: float = 0.5
    seed: int = 0
    task: str = "repeat-add-v1"  # bump when the SFT targets change (invalidates caches)

    @property
    def max_new_tokens(self):
        """Room for the longest correct solution (at most 41 tokens per addition, box included) plus EOS."""
        return 42 * self.steps + 12

    @property
    def max_positions(self):
        return self.max_new_tokens + 16  # the prompt "a+b*k=" is 8 tokens with <bos>


SETTINGS = {f"steps{k}": ChainSetting(f"steps{k}", k) for k in (3, 5, 7, 9)}


def setting(name, **changes):
    """SETTINGS[name] with `changes` (dataclass fields) applied."""
    if name not in SETTINGS:
        raise ValueError(f"unknown long-cot setting {name!r}; choose one of {sorted(SETTINGS)}")
    return replace(SETTINGS[name], **changes)


def prepare_data(out, s: ChainSetting):
    """Train / held-out problems of `s.steps` additions in <out>/data (disjoint, seeded 0 and 1)."""
    from openrlhf_geo.local.task import chain_problems, write_jsonl

    train = chain_problems(N_TRAIN, seed=0, steps=s.steps)
    held_out = chain_problems(N_EVAL, seed=1, steps=s.steps, exclude={r["prompt"] for r in train})
    write_jsonl(Path(out) / "data" / "train.jsonl", train)
    write_jsonl(Path(out) / "data" / "eval.jsonl", held_out)
    return train, held_out


def prepare(out, s: ChainSetting, log=print, bar=True):
    """Data and SFT warm-up of setting `s` in `out` (cached: a finished warm-up with the same key is reused) ->
    info {"key", "config", "steps", "accuracy" (held-out, T = 1, EVAL_SAMPLES each), "shortcut_share", "params",
    "wall_s"}."""
    from openrlhf_geo.local import kernels
    from openrlhf_geo.local.reward import make_reward_fn
    from openrlhf_geo.local.task import build_model, build_tokenizer, chain_sft_rows, sft

    out = Path(out)
    train, held_out = prepare_data(out, s)
    config = {**asdict(s), "n_train": len(train), "torch": torch.__version__, "kernels": kernels.active()}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    info_path = out / "sft" / "sft.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("key") == key:
            log(f"SFT: reusing {out / 'sft'} ({info['steps']} steps, held-out accuracy {info['accuracy']:.3f})")
            return info
    tokenizer = build_tokenizer()
    model = build_model(
        tokenizer, s.hidden_size, s.num_layers, s.num_heads, seed=s.seed, max_positions=s.max_positions
    )
    rows = chain_sft_rows(train, s.per_prompt, s.seed, s.shortcut_rate)
    from tqdm.auto import tqdm

    progress = tqdm(total=s.sft_steps, desc=f"SFT {s.name}", unit="step", disable=not bar)
    start = time.perf_counter()
    sft(
        model,
        tokenizer,
        rows,
        s.sft_steps,
        s.batch_size,
        s.lr,
        seed=s.seed,
        callback=lambda step, loss: progress.update(1) and False,
        final_lr_ratio=s.final_lr_ratio,
    )
    progress.close()
    sft_s = time.perf_counter() - start
    reward_fn = make_reward_fn("math_verify")
    accuracy, shortcut = evaluate_setting(model, tokenizer, held_out, reward_fn, s)
    out.joinpath("sft").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "sft")
    tokenizer.save_pretrained(out / "sft")
    info = {
        "key": key,
        "config": config,
        "steps": s.sft_steps,
        "accuracy": accuracy,
        "shortcut_share": shortcut,
        "params": sum(p.numel() for p in model.parameters()),
        "sft_s": sft_s,
        "wall_s": time.perf_counter() - start,
    }
    info_path.write_text(json.dumps(info, indent=1))
    log(f"SFT {s.name}: {info['params']} parameters, held-out accuracy {accuracy:.3f}, shortcut {shortcut:.3f}")
    return info


def evaluate_setting(model, tokenizer, rows, reward_fn, s: ChainSetting, n_samples=EVAL_SAMPLES, seed=0):
    """(held-out accuracy, share of responses that follow the shortcut) at T = 1, as `engine.evaluate` samples."""
    from openrlhf_geo.local.engine import generate_rollouts
    from openrlhf_geo.local.task import uses_shortcut

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        batch = generate_rollouts(
            model, tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows], n_samples, s.max_new_tokens
        )
    verdicts = torch.as_tensor(reward_fn(batch.prompts, batch.responses, batch.answers), dtype=torch.float32)
    shortcut = sum(uses_shortcut(r) for r in batch.responses) / len(batch.responses)
    return verdicts.mean().item(), shortcut


def train_flags(out, s: ChainSetting, steps, eval_steps, batch_size=8, group=16, lr=3e-4):
    """`openrlhf-geo train` flags of an RL run on the prepared setting in `out` (the demo's RL recipe, with the
    setting's max_new_tokens); method, seed and output flags follow."""
    out = Path(out)
    return [
        "--actor.model_name_or_path", str(out / "sft"),
        "--data.prompt_dataset", str(out / "data" / "train.jsonl"),
        "--eval.dataset", str(out / "data" / "eval.jsonl"),
        "--eval.steps", str(eval_steps),
        "--eval.n_samples_per_prompt", str(EVAL_SAMPLES),
        "--rollout.batch_size", str(batch_size),
        "--rollout.n_samples_per_prompt", str(group),
        "--rollout.max_new_tokens", str(s.max_new_tokens),
        "--actor.adam.lr", str(lr),
        "--train.steps", str(steps),
        "--train.device", "cpu",
        "--train.threads", "1",
    ]  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m openrlhf_geo.local.long_cot", description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", required=True, choices=sorted(SETTINGS))
    p.add_argument("--out", required=True)
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--shortcut-rate", type=float, default=None)
    args = p.parse_args(argv)
    changes = {
        k: v
        for k, v in {
            "sft_steps": args.sft_steps,
            "hidden_size": args.hidden_size,
            "num_layers": args.num_layers,
            "shortcut_rate": args.shortcut_rate,
        }.items()
        if v is not None
    }
    s = setting(args.setting, **changes)
    torch.set_num_threads(1)
    info = prepare(args.out, s)
    print(json.dumps({k: v for k, v in info.items() if k != "config"}, indent=1))
    flags = train_flags(args.out, s, steps=50, eval_steps=25)
    print("openrlhf-geo train " + shlex.join(flags) + " --advantage_estimator group_norm --salt.diagnostics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
