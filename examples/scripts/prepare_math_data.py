"""Write the math RL prompt sets the example scripts train and evaluate on, as jsonl for `--data.prompt_dataset`.

    python examples/scripts/prepare_math_data.py --out DATA_DIR [math_train dapo_math_17k aime24]

Each line is ``{"prompt": [chat messages], "answer": gold}``: the scripts pass ``--data.input_key prompt
--data.label_key answer --data.apply_chat_template``, so the policy's own chat template renders the prompt, and
the boxed-answer math-verify reward (openrlhf_geo/rewards/math_verify.py) scores the response against ``answer``.
The instruction is `openrlhf-geo eval`'s (``SYSTEM_PROMPT``, system turn by default; ``--placement user``
appends it to the question as the eval harness's ``--prompt-placement user`` does), so training and evaluation
prompts agree. Problems are deduplicated (DAPO-Math-17k ships each one many times).

Needs the `datasets` library and access to the Hugging Face hub (run it once where both exist; the folder must be
visible to every Ray node).
"""

import argparse
import json
import sys
from pathlib import Path

from openrlhf_geo.eval.harness import SYSTEM_PROMPT
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


def aime_example(record):
    """AIME 2024 (HuggingFaceH4/aime_2024): ``problem``, ``answer``."""
    return record["problem"].strip(), str(record["answer"]).strip()


# name -> (hub id, split, record -> (problem, answer))
SOURCES = {
    "math_train": ("DigitalLearningGmbH/MATH-lighteval", "train", math_example),
    "dapo_math_17k": ("BytedTsinghua-SIA/DAPO-Math-17k", "train", dapo_example),
    "aime24": ("HuggingFaceH4/aime_2024", "train", aime_example),
}


def chat_prompt(problem, placement="system"):
    """The eval harness's messages: [system: instruction, user: problem], or one user turn with both."""
    if placement == "system":
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    if placement == "user":
        return [{"role": "user", "content": f"{problem}\n{SYSTEM_PROMPT}"}]
    raise ValueError(f"--placement must be 'system' or 'user' (got {placement!r})")


def convert(records, example, placement="system"):
    """Records -> jsonl rows ``{"prompt": messages, "answer": gold}``, first occurrence of each problem only."""
    rows, seen = [], set()
    for record in records:
        problem, answer = example(record)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"prompt": chat_prompt(problem, placement), "answer": answer})
    return rows


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
    parser.add_argument("names", nargs="*", help=f"sets to write (default all): {' '.join(SOURCES)}")
    parser.add_argument("--out", required=True, help="folder for <name>.jsonl")
    parser.add_argument("--placement", choices=("system", "user"), default="system", help="instruction turn")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SOURCES]
    if unknown:
        parser.error(f"unknown set {unknown[0]!r}; choose from {', '.join(SOURCES)}")
    import datasets

    for name in args.names or SOURCES:
        hub, split, example = SOURCES[name]
        rows = convert(datasets.load_dataset(hub, split=split), example, args.placement)
        write_jsonl(rows, Path(args.out) / f"{name}.jsonl")
        print(f"{name}: {len(rows)} prompts from {hub} -> {Path(args.out) / f'{name}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
