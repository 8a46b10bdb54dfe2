"""Wall time of `openrlhf-geo inspect`, per phase, with the machine's load beside it.

    python benchmarks/inspect_walltime.py OUT                      # the real LM on CPU: 64 word problems x 8
    python benchmarks/inspect_walltime.py OUT --gpu [--model DIR]  # one GPU, a 1.5B model

CPU (the issue's goal: <= 10 min on a 2-core CPU, sampling included): `--model smollm2` on
examples/data/word_problems.jsonl, G = 8, T = 0.6 (SALT Table 4), up to 256 new tokens, vLLM's CPU build
(`--generator hf` to compare). GPU: `--device cuda --generator vllm` on --model (a local HF directory, e.g.
Qwen2.5-Math-1.5B; without one a randomly initialised Qwen2-1.5B-shaped model from its config, whose responses run to
the cap, with a reward that is a hash of the response, so that groups have signal: a timing, not a measurement).
Runs the command as a user would, in a child process, and prints its phases (summary.json's setup.seconds), the wall
time, the 1-minute load average before, during (its range, read every 10 s) and after (`os.getloadavg`), and
OMP_NUM_THREADS: on a shared machine the load is the number's context, and two threads on two cores that other jobs
keep busy wait on each other (measured: the forward ~3.7x slower than one thread at load average 3.5).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "examples" / "data" / "word_problems.jsonl"
HASH_REWARD = """import hashlib


def reward_func(queries, prompts, labels):
    return [float(hashlib.sha256(q.encode()).digest()[0] % 2) for q in queries]
"""


def random_model(directory: Path) -> Path:
    """A randomly initialised Qwen2-1.5B-shaped model (Qwen2.5-1.5B's config) with the real LM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from openrlhf_geo import real_lm

    tokenizer = AutoTokenizer.from_pretrained(real_lm.convert())
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="a new directory: the inspect run's --out is OUT/inspect")
    p.add_argument("--gpu", action="store_true", help="one GPU, a 1.5B model (--model, else a random one)")
    p.add_argument("--model", default=None, help="default: smollm2 (CPU) / a random Qwen2-1.5B-shaped model (GPU)")
    p.add_argument("--generator", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=False)
    model = args.model or ("smollm2" if not args.gpu else str(random_model(args.out / "model")))
    command = [sys.executable, "-m", "openrlhf_geo.cli", "inspect", "--model", model, "--prompts", str(PROMPTS),
               "--out", str(args.out / "inspect"), "--data.max_samples", str(args.prompts),
               "--rollout.n_samples_per_prompt", str(args.samples), "--rollout.max_new_tokens",
               str(args.max_new_tokens), "--rollout.temperature", "0.6", "--generator", args.generator,
               "--device", "cuda" if args.gpu else "cpu"]  # fmt: skip
    if args.gpu and args.model is None:
        reward = Path(tempfile.mkdtemp(dir=args.out)) / "hash_reward.py"
        reward.write_text(HASH_REWARD)
        command += ["--reward.func", str(reward)]
    during, done = [], threading.Event()

    def watch_load():
        while not done.wait(10):
            during.append(os.getloadavg()[0])

    watcher = threading.Thread(target=watch_load, daemon=True)
    load_before, start = os.getloadavg(), time.perf_counter()
    watcher.start()
    code = subprocess.call(command, cwd=REPO)
    wall, load_after = time.perf_counter() - start, os.getloadavg()
    done.set()
    watcher.join()
    during = during or [load_after[0]]
    if code != 0:
        print(f"inspect_walltime: the command failed (exit {code}): {' '.join(command)}", file=sys.stderr)
        return code
    setup = json.loads((args.out / "inspect" / "summary.json").read_text())["setup"]
    result = {"command": command, "wall_s": wall, "phases_s": setup["seconds"], "device": setup["device"],
              "load_average": {"before": load_before, "during": [min(during), max(during)], "after": load_after},
              "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}  # fmt: skip
    (args.out / "walltime.json").write_text(json.dumps(result, indent=1) + "\n")
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in setup["seconds"].items())
    print(f"inspect: {wall / 60:.1f} min wall ({phases}); load average {load_before[0]:.1f} before, "
          f"{min(during):.1f}-{max(during):.1f} during, {load_after[0]:.1f} after; {os.cpu_count()} CPUs, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
