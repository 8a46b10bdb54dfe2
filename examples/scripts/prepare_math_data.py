"""Write the math prompt sets the example scripts train and evaluate on, as jsonl for `--data.prompt_dataset` /
`--eval.dataset`.

    python examples/scripts/prepare_math_data.py --out DATA_DIR [NAME ...]
    python examples/scripts/prepare_math_data.py --out DATA_DIR/Qwen3-1.7B_no-thinking \\
        --render-with Qwen/Qwen3-1.7B --chat-template-kwargs '{"enable_thinking": false}' dapo_math_17k geoalign_eval

Each line is ``{"prompt": [chat messages], "answer": gold, "datasource": set name}``: with ``--data.input_key prompt
--data.label_key answer --data.apply_chat_template`` the policy's own chat template renders the prompt, and the
boxed-answer math-verify reward (openrlhf_geo/rewards/math_verify.py) scores the response against ``answer``;
upstream's in-training eval reports ``eval_<datasource>_pass1`` per set. The instruction is `openrlhf-geo eval`'s
(``SYSTEM_PROMPT``: SALT App. C.2, GeoAlign App. B.3) as a system turn (``--placement user`` appends it to the
question as the eval harness's ``--prompt-placement user`` does), so training and evaluation prompts agree.

OpenRLHF 0.11.2 calls ``apply_chat_template(chat, tokenize=False, add_generation_prompt=True)`` with no further
arguments and has no flag for any, so a template argument such as Qwen3's ``enable_thinking=False`` (GeoAlign App.
B.3) is applied here instead: ``--render-with MODEL`` adds ``prompt_text``, the prompt rendered once by MODEL's
chat template with ``--chat-template-kwargs``; the scripts then pass ``--data.input_key prompt_text`` without
``--data.apply_chat_template`` and upstream uses that text as is (the string its own rendering would produce).

Sets: the training sets ``math_train`` (MATH-Train-7.5k) and ``dapo_math_17k`` (deduplicated: DAPO-Math-17k ships
each problem many times); the eval benchmarks of `openrlhf-geo eval` that math-verify scores (same hub sources and
fields); and ``geoalign_eval``, GeoAlign's in-training eval suite (App. B.2), in which each AIME problem appears 8
times and each AMC23 problem 4 times, so that upstream's per-set mean at ``--eval.n_samples_per_prompt 1`` is avg@8
/ avg@4 (upstream has one sample count for all eval sets).

Needs the `datasets` library (and `transformers` for ``--render-with``) and access to the Hugging Face hub (run it
once where both exist; the folder must be visible to every Ray node).
"""

import argparse
import json
import sys
from pathlib import Path

from openrlhf_geo.eval.harness import BENCHMARKS, SYSTEM_PROMPT, to_problems
from openrlhf_geo.rewards.math_verify import extract_last_boxed

# DAPO-Math-17k wraps each problem in an "Answer: $Answer" instruction for its own reward; a boxed-answer reward
# needs the bare problem, so both ends are cut off (and must be there: a changed format must not slip through).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def math_example(record):
    """MATH (DigitalLearningGmbH/MATH-lighteval): ``problem``, gold = last ``\\boxed{}`` of ``solution``."""
    answer = extract_last_boxed(record["solution"])
    if not answer:
        raise ValueError(f"MATH record without a boxed answer in its solution: {record['solution'][-200:]!r}")
    return record["problem"].strip(), answer.strip()


def dapo_example(record):
    """DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k): the user turn without DAPO's instruction; gold from
    ``reward_model.ground_truth``."""
    content = record["prompt"][0]["content"]
    if not (content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX)):
        raise ValueError(
            "DAPO-Math-17k prompt does not have the expected 'Answer: $Answer' instruction around the problem "
            f"(the dataset's format changed?); update DAPO_PREFIX/DAPO_SUFFIX in {Path(__file__).name}: "
            f"{content[:160]!r}"
        )
    problem = content[len(DAPO_PREFIX) : len(content) - len(DAPO_SUFFIX)]
    return problem.strip(), str(record["reward_model"]["ground_truth"]).strip()


# Training sets: name -> (hub id, split, record -> (problem, answer))
TRAIN_SOURCES = {
    "math_train": ("DigitalLearningGmbH/MATH-lighteval", "train", math_example),
    "dapo_math_17k": ("BytedTsinghua-SIA/DAPO-Math-17k", "train", dapo_example),
}
# Eval sets: the harness's math benchmarks (GPQA's multiple choice is not a math-verify reward)
EVAL_SETS = tuple(name for name, spec in BENCHMARKS.items() if spec.kind == "math")
# Mixed eval suites: name -> ((benchmark, copies of each problem), ...)
SUITES = {
    # GeoAlign App. B.2: AIME24/25 avg@8, AMC23 avg@4, MATH500, Minerva, OlympiadBench
    "geoalign_eval": (
        ("aime24", 8),
        ("aime25", 8),
        ("amc23", 4),
        ("math500", 1),
        ("minerva", 1),
        ("olympiadbench", 1),
    ),
}
NAMES = (*TRAIN_SOURCES, *EVAL_SETS, *SUITES)


def chat_prompt(problem, placement="system"):
    """The eval harness's messages: [system: instruction, user: problem], or one user turn with both."""
    if placement == "system":
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    if placement == "user":
        return [{"role": "user", "content": f"{problem}\n{SYSTEM_PROMPT}"}]
    raise ValueError(f"--placement must be 'system' or 'user' (got {placement!r})")


def convert(pairs, datasource, placement="system", copies=1):
    """(problem, answer) pairs -> jsonl rows, first occurrence of each problem only, each written ``copies`` times."""
    rows, seen = [], set()
    for problem, answer in pairs:
        if problem in seen:
            continue
        seen.add(problem)
        row = {"prompt": chat_prompt(problem, placement), "answer": answer, "datasource": datasource}
        rows.extend(dict(row) for _ in range(copies))
    return rows


def render(rows, tokenizer, template_kwargs):
    """Add ``prompt_text``: each row's messages rendered by ``tokenizer``'s chat template with ``template_kwargs``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--render-with: the tokenizer has no chat template to render prompts with")
    for row in rows:
        row["prompt_text"] = tokenizer.apply_chat_template(
            row["prompt"], tokenize=False, add_generation_prompt=True, **template_kwargs
        )
    return rows


def load_pairs(name, load_dataset):
    """(problem, answer) pairs of a training set or an eval benchmark, from the hub."""
    if name in TRAIN_SOURCES:
        hub, split, example = TRAIN_SOURCES[name]
        return [example(record) for record in load_dataset(hub, split=split)]
    spec = BENCHMARKS[name]
    records = load_dataset(spec.hub, spec.hub_config, split=spec.split)
    return [(p.question, p.answer) for p in to_problems(list(records), name)]


def write_jsonl(rows, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.rename(path)  # a crashed run never leaves a truncated file the scripts would take as done


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"sets to write (default all): {' '.join(NAMES)}")
    parser.add_argument("--out", required=True, help="folder for <name>.jsonl")
    parser.add_argument("--placement", choices=("system", "user"), default="system", help="instruction turn")
    parser.add_argument("--render-with", default=None, metavar="MODEL", help="add prompt_text rendered by MODEL")
    parser.add_argument(
        "--chat-template-kwargs",
        default="{}",
        metavar="JSON",
        help="chat-template arguments for --render-with, e.g. '{\"enable_thinking\": false}'",
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        parser.error(f"unknown set {unknown[0]!r}; choose from {', '.join(NAMES)}")
    try:
        template_kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as e:
        parser.error(f"--chat-template-kwargs must be a JSON object (got {args.chat_template_kwargs!r}: {e})")
    if not isinstance(template_kwargs, dict):
        parser.error(f"--chat-template-kwargs must be a JSON object (got {args.chat_template_kwargs!r})")
    if template_kwargs and not args.render_with:
        parser.error("--chat-template-kwargs only applies with --render-with")
    import datasets

    tokenizer = None
    if args.render_with:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.render_with)
    for name in args.names or NAMES:
        if name in SUITES:
            rows = [
                row
                for bench, copies in SUITES[name]
                for row in convert(load_pairs(bench, datasets.load_dataset), bench, args.placement, copies)
            ]
        else:
            rows = convert(load_pairs(name, datasets.load_dataset), name, args.placement)
        if tokenizer is not None:
            render(rows, tokenizer, template_kwargs)
        write_jsonl(rows, Path(args.out) / f"{name}.jsonl")
        print(f"{name}: {len(rows)} rows -> {Path(args.out) / f'{name}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
