"""`openrlhf-geo eval`: avg@n and unbiased pass@k (SALT Eq. 54) on math benchmarks.

Data comes from local files: ``--data-dir DIR`` holding ``<benchmark>.jsonl|.json|.parquet`` or
``--data NAME=PATH``; ``--from-hub`` loads BENCHMARKS[name].hub with ``datasets`` instead (never required).
Generation uses vLLM when importable and a GPU is present, HF ``generate`` otherwise (``--backend`` to force).
Every sample is scored with the boxed-answer math-verify reward (GPQA: the boxed letter choice).

Writes to ``--output-dir`` as each benchmark finishes: ``<benchmark>.jsonl`` (one record per problem: prompt,
responses, extracted answers, verdicts, pass@k) and ``summary.json`` (config, per-benchmark metrics of the
benchmarks finished so far, and a flat ``metrics`` map such as ``{"math500/avg@16": ..., "math500/pass@1": ...}``
that ``openrlhf-geo report`` reads). The model loads once for all benchmarks.

Bad input fails before any generation with a one-line ``openrlhf-geo eval: error: ...`` naming the flag, file
(and line) or value, and exit status 2: out-of-range flags, a local-looking ``--model`` path that does not exist,
an ``--output-dir`` that cannot be created or written, malformed JSON or non-UTF-8 data files.
"""

import argparse
import importlib.util
import json
import math
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openrlhf_geo.eval.metrics import avg_at_n, mean_pass_at_k, pass_at_k
from openrlhf_geo.jsonl import read_jsonl
from openrlhf_geo.options import check_local_path, check_model_source
from openrlhf_geo.rewards.math_verify import MathVerifyReward, Verdict, extract_last_boxed

# The papers' instruction (the standard one for R1-distilled and Qwen math models); --system-prompt overrides it.
# SALT App. C.2: "For all experiments, we applied a unified system prompt", GPQA's multiple choice included; the
# choice verdict reads the letter in the last box. --choice-prompt gives multiple choice its own instruction.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark lives on the hub and which record fields hold the problem and the answer.

    ``problem_keys``/``answer_keys``: the first key present in a record is used. ``kind``: ``math`` (math-verify)
    or ``choice`` (records give ``choices`` + ``answer`` letter/index, or GPQA's ``Correct Answer`` and
    ``Incorrect Answer 1..3``, shuffled per problem with ``--seed``).
    """

    hub: str
    split: str
    problem_keys: tuple
    answer_keys: tuple
    hub_config: str | None = None
    kind: str = "math"


BENCHMARKS = {
    "aime24": Benchmark("HuggingFaceH4/aime_2024", "train", ("problem",), ("answer",)),
    "aime25": Benchmark("math-ai/aime25", "test", ("problem",), ("answer",)),
    "amc23": Benchmark("math-ai/amc23", "test", ("question", "problem"), ("answer",)),
    "math500": Benchmark("HuggingFaceH4/MATH-500", "test", ("problem",), ("answer",)),
    "gsm8k": Benchmark("openai/gsm8k", "test", ("question",), ("answer",), hub_config="main"),
    "gpqa_diamond": Benchmark(
        "Idavidrein/gpqa", "train", ("Question", "question", "problem"), ("answer",), "gpqa_diamond", "choice"
    ),
    "minerva": Benchmark("math-ai/minervamath", "test", ("question", "problem"), ("answer",)),
    "olympiadbench": Benchmark("math-ai/olympiadbench", "test", ("question", "problem"), ("final_answer", "answer")),
}


@dataclass(frozen=True)
class Problem:
    index: int
    question: str  # what the user turn shows (choices included for multiple choice)
    answer: str  # math: LaTeX gold; choice: the correct letter
    kind: str
    num_choices: int = 0


def _decode_utf8(data, path, line_offset=0):
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = line_offset + data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({error.reason} at byte {error.start})") from None


def load_records(path):
    """Records (dicts) of a ``.jsonl``, ``.json`` (a list, or ``{"data": [...]}``) or ``.parquet`` file.

    Malformed JSON, invalid UTF-8 or a record that is not an object raise ValueError naming ``path:line``.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return [record for _, record in read_jsonl(path)]
    if path.suffix == ".json":
        try:
            data = json.loads(_decode_utf8(path.read_bytes(), path))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno})") from None
        records = data["data"] if isinstance(data, dict) and "data" in data else data
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError(f'{path}: expected a list of JSON objects (or {{"data": [...]}})')
        return records
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to .jsonl)") from None
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported data file (use .jsonl, .json or .parquet)")


def _field(record, keys, what, name):
    for key in keys:
        if key in record and record[key] is not None:
            return record[key]
    raise ValueError(f"{name}: no {what} field {list(keys)} in record (fields: {sorted(record)})")


def _math_answer(value, name):
    if isinstance(value, list):  # OlympiadBench: final_answer is a list of LaTeX strings
        value = ", ".join(str(v) for v in value)
    value = str(value)
    if name == "gsm8k" and "####" in value:  # GSM8K: worked solution, then "#### 72"
        value = value.rsplit("####", 1)[1].replace(",", "")
    return value.strip()


def to_problems(records, name, seed=0):
    """Problems of a benchmark's records (see Benchmark for the fields each kind needs)."""
    spec = BENCHMARKS[name]
    problems = []
    for i, record in enumerate(records):
        question = str(_field(record, spec.problem_keys, "problem", f"{name} record {i}")).strip()
        if spec.kind == "math":
            answer = _math_answer(_field(record, spec.answer_keys, "answer", f"{name} record {i}"), name)
            problems.append(Problem(i, question, answer, "math"))
            continue
        if "choices" in record:
            choices, answer = list(record["choices"]), record["answer"]
            answer = LETTERS[answer] if isinstance(answer, int) else str(answer).strip().strip("()").upper()
        else:  # GPQA's raw layout: shuffle the correct answer among the incorrect ones, reproducibly per problem
            correct = str(record["Correct Answer"]).strip()
            choices = [correct] + [str(record[f"Incorrect Answer {j}"]).strip() for j in (1, 2, 3)]
            random.Random(f"{seed}:{i}").shuffle(choices)
            answer = LETTERS[choices.index(correct)]
        if answer not in LETTERS[: len(choices)]:
            raise ValueError(f"{name}: problem {i} has answer {answer!r} outside its {len(choices)} choices")
        listing = "\n".join(f"{LETTERS[j]}) {c}" for j, c in enumerate(choices))
        problems.append(Problem(i, f"{question}\n\n{listing}", answer, "choice", len(choices)))
    return problems


def load_benchmark(name, data_paths, data_dir, from_hub, seed=0):
    """Problems of ``name`` from --data NAME=PATH, then --data-dir, then (--from-hub) ``datasets``."""
    if name in data_paths:
        return to_problems(load_records(data_paths[name]), name, seed)
    if data_dir is not None:
        for suffix in (".jsonl", ".json", ".parquet"):
            if (Path(data_dir) / f"{name}{suffix}").exists():
                return to_problems(load_records(Path(data_dir) / f"{name}{suffix}"), name, seed)
    if from_hub:
        import datasets

        spec = BENCHMARKS[name]
        return to_problems(list(datasets.load_dataset(spec.hub, spec.hub_config, split=spec.split)), name, seed)
    looked = f"{data_dir}/{name}.{{jsonl,json,parquet}}" if data_dir else "no --data-dir given"
    raise FileNotFoundError(f"no data for benchmark {name!r}: pass --data {name}=PATH ({looked}) or --from-hub")


def choice_verdict(response, gold_letter, num_choices=4):
    """Verdict for a multiple-choice response: the letter in the last box (``B``, ``(B)``, ``\\text{B}``, ``B) x``)."""
    box = extract_last_boxed(response)
    if box is None:
        return Verdict(False, "no_box")
    content = box.strip()
    while (m := re.fullmatch(r"\\(?:text|textbf|mathrm|mathbf)\{(.*)\}", content, re.S)) is not None:
        content = m.group(1).strip()
    m = re.match(rf"\(?([{LETTERS[:num_choices]}])\)?(?:[\s.:)]|$)", content.strip("$ "))
    if m is None:
        return Verdict(False, "wrong", box)
    return Verdict(m.group(1) == gold_letter, "correct" if m.group(1) == gold_letter else "wrong", box)


def render_prompt(tokenizer, question, instruction, placement="system", template_kwargs=None):
    """Prompt text: the tokenizer's chat template over [system: instruction, user: question] (``placement=user``
    appends the instruction to the user turn instead); tokenizers without a template get plain text.

    template_kwargs: extra variables for the chat template, e.g. {"enable_thinking": False} for Qwen3 with thinking
    disabled, as GeoAlign evaluates (arXiv 2606.26917 App. B.3).
    """
    if placement == "system":
        messages = [{"role": "system", "content": instruction}, {"role": "user", "content": question}]
    else:
        messages = [{"role": "user", "content": f"{question}\n{instruction}"}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    return "\n\n".join(m["content"] for m in messages) + "\n"


def _needs_special_tokens(tokenizer):
    # A chat template already contains BOS and friends; plain-text prompts get the tokenizer's usual specials.
    return not getattr(tokenizer, "chat_template", None)


def vllm_generator(model, args):
    """``generate(prompts) -> (texts, truncated)``, each (P, n), with vLLM; the model loads once, here."""
    from vllm import LLM, SamplingParams

    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, "auto")
    llm = LLM(model=model, tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, dtype=dtype)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens, seed=args.seed
    )
    tokenizer = llm.get_tokenizer()

    def generate(prompts):
        # Token ids, not text: vLLM would add a second BOS in front of a chat template that already has one.
        ids = tokenizer(prompts, add_special_tokens=_needs_special_tokens(tokenizer))["input_ids"]
        outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params)
        texts = [[o.text for o in out.outputs] for out in outputs]
        truncated = [[o.finish_reason == "length" for o in out.outputs] for out in outputs]
        return texts, truncated

    return generate


def hf_generator(model, args):
    """``generate(prompts) -> (texts, truncated)``, each (P, n), with HF ``generate`` (left padding, batches of
    prompts); the model loads once, here, without transformers' "Loading weights" progress bar."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype or "")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else {}
    eos = lm.generation_config.eos_token_id
    stops = {tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])} - {None}
    special = _needs_special_tokens(tokenizer)
    torch.manual_seed(args.seed)

    def generate(prompts):
        texts, truncated = [], []
        for start in tqdm(range(0, len(prompts), args.batch_size), desc="generate", unit="batch", file=sys.stderr):
            batch = prompts[start : start + args.batch_size]
            inputs = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=special).to(device)
            with torch.no_grad():
                out = lm.generate(
                    **inputs,
                    max_new_tokens=args.max_new_tokens,
                    num_return_sequences=args.n,
                    pad_token_id=tokenizer.pad_token_id,
                    do_sample=bool(sampling),
                    **sampling,
                )
            new = out[:, inputs["input_ids"].shape[1] :].cpu()
            for p in range(len(batch)):
                rows = new[p * args.n : (p + 1) * args.n]
                texts.append([tokenizer.decode(r, skip_special_tokens=True) for r in rows])
                truncated.append([not any(int(t) in stops for t in r) for r in rows])
        return texts, truncated

    return generate


def evaluate(problems, texts, truncated, ks, scorer):
    """Per-problem records and the benchmark's metrics for (P, n) responses."""
    n = len(texts[0])
    if problems[0].kind == "math":
        verdicts = scorer.verdicts([t for row in texts for t in row], [p.answer for p in problems for _ in range(n)])
    else:
        verdicts = [choice_verdict(t, p.answer, p.num_choices) for p, row in zip(problems, texts) for t in row]
    records, correct = [], np.zeros((len(problems), n), dtype=bool)
    for i, problem in enumerate(problems):
        row = verdicts[i * n : (i + 1) * n]
        correct[i] = [v.correct for v in row]
        c = int(correct[i].sum())
        records.append(
            {
                "index": problem.index,
                "problem": problem.question,
                "answer": problem.answer,
                "responses": texts[i],
                "extracted": [v.answer for v in row],
                "correct": correct[i].tolist(),
                "status": [v.status for v in row],
                "truncated": truncated[i],
                "num_correct": c,
                "n": n,
                **{f"pass@{k}": pass_at_k(n, c, k) for k in ks},
            }
        )
    statuses = [v.status for v in verdicts]
    metrics = {
        "problems": len(problems),
        "n": n,
        f"avg@{n}": avg_at_n(correct),
        **{f"pass@{k}": mean_pass_at_k(correct.sum(1), n, k) for k in ks},
        "no_box_rate": statuses.count("no_box") / len(statuses),
        "timeout_rate": statuses.count("timeout") / len(statuses),
        "bad_gold_rate": statuses.count("bad_gold") / len(statuses),  # a gold math-verify cannot parse scores 0
        "truncated_rate": float(np.mean(truncated)),
    }
    return records, metrics


def build_parser():
    parser = argparse.ArgumentParser(prog="openrlhf-geo eval", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model path or hub id")
    parser.add_argument("--benchmarks", default="math500", help=f"comma-separated, from {sorted(BENCHMARKS)}")
    parser.add_argument("--data-dir", default=None, help="directory with <benchmark>.jsonl|.json|.parquet")
    parser.add_argument("--data", action="append", default=[], metavar="NAME=PATH", help="a benchmark's file")
    parser.add_argument("--from-hub", action="store_true", help="load missing benchmarks with `datasets`")
    parser.add_argument("--n", type=int, default=1, help="samples per problem")
    parser.add_argument("--k", type=int, nargs="+", default=[1], help="pass@k values (each <= --n)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-new-tokens", type=int, default=32768)
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (and GPQA choice order)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--system-prompt", default=SYSTEM_PROMPT, help="instruction for every benchmark")
    parser.add_argument(
        "--choice-prompt",
        default=None,
        help="instruction for multiple choice (default: --system-prompt, SALT App. C.2)",
    )
    parser.add_argument("--prompt-placement", choices=("system", "user"), default="system")
    parser.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="extra chat-template variables, e.g. '{\"enable_thinking\": false}' (Qwen3 with thinking off, as "
        "GeoAlign evaluates)",
    )
    parser.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM only")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per HF generate call (x n sequences)")
    parser.add_argument("--verify-timeout", type=float, default=5.0, help="math-verify seconds per sample")
    return parser


def _backend(choice):
    if choice != "auto":
        return choice
    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"


def check_args(args):
    """Flag values, the model path and the output directory, checked before anything loads; ValueError names the
    flag and value. Creates ``--output-dir`` and proves it writable. Returns (benchmark names, {name: data path})."""
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown or not names:
        raise ValueError(f"--benchmarks {args.benchmarks!r}: unknown {unknown}; choose from {sorted(BENCHMARKS)}")
    data_paths = {}
    for item in args.data:
        name, sep, path = item.partition("=")
        if not sep or name not in BENCHMARKS:
            raise ValueError(f"--data expects NAME=PATH with NAME in {sorted(BENCHMARKS)} (got {item!r})")
        data_paths[name] = path
    if args.n < 1:
        raise ValueError(f"--n (samples per problem) must be >= 1 (got {args.n})")
    if args.chat_template_kwargs is not None and not isinstance(args.chat_template_kwargs, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object (got {args.chat_template_kwargs!r})")
    if any(not 1 <= k <= args.n for k in args.k):
        raise ValueError(f"--k values must lie in [1, --n={args.n}] (got {args.k})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0, 0 meaning greedy (got {args.temperature})")
    if args.temperature == 0 and args.n > 1:
        raise ValueError(f"--temperature 0 is greedy: --n {args.n} samples would be identical; use --n 1")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must lie in (0, 1] (got {args.top_p})")
    if not (math.isfinite(args.verify_timeout) and args.verify_timeout > 0):
        raise ValueError(f"--verify-timeout must be a finite number of seconds > 0 (got {args.verify_timeout})")
    for flag, value in (
        ("--max-new-tokens", args.max_new_tokens),
        ("--batch-size", args.batch_size),
        ("--tensor-parallel-size", args.tensor_parallel_size),
        ("--limit", 1 if args.limit is None else args.limit),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1 (got {value})")
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm: vllm is not installed (pip install vllm, or --backend hf)")
    check_local_path("--model", args.model)  # the hub is asked only once the benchmarks load (main)
    out = Path(args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ValueError(f"--output-dir {out}: cannot create or write there ({error.strerror or error})") from None
    return names, data_paths


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        names, data_paths = check_args(args)
        problems = {b: load_benchmark(b, data_paths, args.data_dir, args.from_hub, args.seed) for b in names}
        problems = {b: p[: args.limit] if args.limit else p for b, p in problems.items()}
        empty = [b for b, p in problems.items() if not p]
        if empty:
            raise ValueError(f"--benchmarks: no problems in {empty}")

        from transformers import AutoTokenizer

        check_model_source("--model", args.model)  # not in the hub cache, and the hub unreachable: at once
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except OSError as error:
            raise ValueError(f"--model {args.model}: {error}") from None
    except (ValueError, OSError) as error:  # bad input: one line, no traceback
        print("openrlhf-geo eval: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2

    backend = _backend(args.backend)
    generate = (vllm_generator if backend == "vllm" else hf_generator)(args.model, args)
    out = Path(args.output_dir)
    summary = {"model": args.model, "backend": backend, "config": vars(args), "benchmarks": {}, "metrics": {}}
    with MathVerifyReward(timeout=args.verify_timeout) as scorer:
        for b in names:
            prompts = [
                render_prompt(
                    tokenizer,
                    p.question,
                    args.choice_prompt if p.kind == "choice" and args.choice_prompt else args.system_prompt,
                    args.prompt_placement,
                    args.chat_template_kwargs,
                )
                for p in problems[b]
            ]
            texts, truncated = generate(prompts)
            records, metrics = evaluate(problems[b], texts, truncated, args.k, scorer)
            with open(out / f"{b}.jsonl", "w") as f:
                for record, prompt in zip(records, prompts):
                    f.write(json.dumps({**record, "prompt": prompt}) + "\n")
            summary["benchmarks"][b] = metrics
            summary["metrics"].update(
                {f"{b}/{key}": value for key, value in metrics.items() if key.startswith(("avg@", "pass@"))}
            )
            # Rewritten after every benchmark, atomically: a reader never sees a half-written summary.
            (out / "summary.json.partial").write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(out / "summary.json.partial", out / "summary.json")
            print(f"{b}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    print(f"wrote {out / 'summary.json'}")
    return 0
