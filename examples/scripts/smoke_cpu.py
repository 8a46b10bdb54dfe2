"""The fork end to end on a CPU-only machine: `openrlhf-geo train-ppo-ray --fork.device cpu` through upstream's real
Ray actors, one vLLM CPU engine and DeepSpeed (CPU accelerator, gloo), on a tiny Qwen2 built from a config.

    python examples/scripts/smoke_cpu.py OUT_DIR [--conditions a,b,...] [--list]

It checks the wiring (flags -> actor forward -> experience maker -> loss -> logged metrics -> weight sync ->
checkpoint/resume), not learning. One local Ray head on 127.0.0.1 (declared GPU slots, so upstream's placement
groups schedule) serves every condition and is shut down by this process, also on failure or Ctrl-C; each condition
is its own `train-ppo-ray` process (its own vLLM engine and DeepSpeed actors). Writes OUT_DIR/summary.json: per
condition the steps completed, the last step's logged metrics (upstream's train/*, the fork's salt/*, geo/*) and the
wall time. Exit 0 only if every condition ran and passed its checks.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 16
SAMPLES = 4
# Per rollout step: 8 prompts x 4 samples = 32 = one optimizer step; 16 prompts = 2 steps per episode.
COMMON = [
    "--fork.device", "cpu",
    "--data.input_key", "input", "--data.label_key", "label",
    "--data.max_samples", str(PROMPTS), "--data.max_len", "96", "--rollout.max_new_tokens", "16",
    "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
    "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
    "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1", "--vllm.gpu_memory_utilization", "0.1",
    "--vllm.enforce_eager", "--vllm.sync_backend", "gloo",
    "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "eager",
    "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", str(SAMPLES), "--rollout.micro_batch_size", "8",
    "--train.batch_size", "32", "--train.micro_batch_size", "8", "--train.max_epochs", "1",
    "--actor.adam.lr", "1e-3", "--algo.kl.init_coef", "0", "--actor.loss_agg_mode", "seq-mean-token-mean",
    "--algo.advantage.is_correction_level", "token",
]  # fmt: skip
GEOALIGN = ["--geoalign.enable", "--geoalign.min_scores", "8", "--geoalign.projector.steps", "5"]
FLIPS = ["--reward.noise.type", "flip", "--reward.noise.rate", "0.2"]
# name -> (extra flags, metric prefixes that every step must log)
CONDITIONS = {
    "grpo_diagnostics": (["--advantage_estimator", "group_norm", "--salt.diagnostics"], ["salt/"]),
    "salt": (["--advantage_estimator", "salt"], ["salt/"]),
    "geoalign_flip": (["--advantage_estimator", "group_norm", *GEOALIGN, *FLIPS], ["geo/", "noise/"]),
    "salt_geoalign_flip": (["--advantage_estimator", "salt", *GEOALIGN, *FLIPS], ["salt/", "geo/", "noise/"]),
}


def build_assets(out: Path) -> None:
    """Tiny Qwen2 (head_dim 64: vLLM's CPU attention rejects 16), byte-level BPE tokenizer, prompts, reward file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if (out / "model" / "config.json").is_file():
        return
    corpus = [f"Q: {a} + {b} = ? A: the answer is {a + b}" for a in range(10) for b in range(10)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.save_pretrained(out / "model")
    config = Qwen2Config(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=hf_tok.eos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        torch_dtype="bfloat16",
    )
    import torch

    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out / "model")
    with open(out / "prompts.jsonl", "w") as f:
        for a in range(PROMPTS):
            b = (3 * a + 1) % 10
            f.write(json.dumps({"input": f"Q: {a % 10} + {b} = ? A:", "label": str(a % 10 + b)}) + "\n")
    (out / "reward_func.py").write_text(
        "import torch\n\n\n"
        "def reward_func(queries, prompts, labels):\n"
        "    # binary and roughly balanced for a random model, so groups have spread (SALT, GeoAlign pairs, flips)\n"
        "    r = torch.tensor([float(sum(map(ord, q[len(p):])) % 2) for q, p in zip(queries, prompts)])\n"
        "    return {'rewards': r, 'scores': r, 'extra_logs': {}}\n"
    )


def read_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every TensorBoard run under the folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in sorted(tensorboard_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def run_condition(name, flags, out: Path, assets: Path, env) -> dict:
    """One `openrlhf-geo train-ppo-ray` process; its log goes to out/<name>/train.log."""
    run = out / name
    run.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "openrlhf_geo.cli", "train-ppo-ray", *COMMON,
        "--actor.model_name_or_path", str(assets / "model"),
        "--data.prompt_dataset", str(assets / "prompts.jsonl"),
        "--reward.remote_url", str(assets / "reward_func.py"),
        "--logger.tensorboard_dir", str(run / "tensorboard"),
        "--ckpt.output_dir", str(run / "final"), *flags,
    ]  # fmt: skip
    start = time.time()
    with open(run / "train.log", "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run, start_new_session=True
        )
        try:
            code = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)  # its own process group: the driver and what it spawned
            proc.wait()
            raise
    return {"returncode": code, "wall_s": round(time.time() - start, 1), "command": command}


def summarize(result, run: Path, prefixes) -> dict:
    scalars = read_scalars(run / "tensorboard") if (run / "tensorboard").is_dir() else {}
    steps = sorted({s for values in scalars.values() for s in values if True})
    problems = []
    if result["returncode"] != 0:
        problems.append(f"exit code {result['returncode']} (see {run / 'train.log'})")
    for prefix in prefixes:
        tags = [t for t in scalars if t.startswith(f"train/{prefix}")]
        if not tags:
            problems.append(f"no train/{prefix}* metric logged")
        for tag in tags:
            bad = {s: v for s, v in scalars[tag].items() if not math.isfinite(v)}
            if bad:
                problems.append(f"{tag} not finite at steps {sorted(bad)}")
    last = {t: v[max(v)] for t, v in scalars.items() if v and t.startswith("train/")}
    return {
        "ok": not problems,
        "problems": problems,
        "steps": len(steps),
        "wall_s": result["wall_s"],
        "last_step": last,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated subset")
    args = parser.parse_args(argv)
    names = [c for c in args.conditions.split(",") if c]
    unknown = [c for c in names if c not in CONDITIONS]
    if unknown:
        parser.error(f"unknown --conditions {unknown}; known: {', '.join(CONDITIONS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets = out / "assets"
    build_assets(assets)

    import ray

    # One local head for every condition, on loopback, with GPU slots declared for upstream's placement groups.
    ray.init(num_cpus=16, num_gpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    summary = {}
    try:
        env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, DS_ACCELERATOR="cpu")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for name in names:
            flags, prefixes = CONDITIONS[name]
            result = run_condition(name, flags, out, assets, env)
            summary[name] = summarize(result, out / name, prefixes)
            print(f"{name}: {'ok' if summary[name]['ok'] else 'FAILED'} in {result['wall_s']} s "
                  f"{'; '.join(summary[name]['problems'])}", flush=True)  # fmt: skip
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        ray.shutdown()
    failed = [n for n, s in summary.items() if not s["ok"]]
    print(f"smoke_cpu: {len(summary) - len(failed)}/{len(names)} conditions passed; summary in {out / 'summary.json'}")
    return 1 if failed or len(summary) != len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
