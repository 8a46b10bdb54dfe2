"""The real-LM task: one-step addition word problems in the model's chat template, answered with its own chain of
thought and a `\\boxed{}` answer that math-verify checks.

A problem is "Tom has 7 apples. Tom gets 5 more apples. How many apples does Tom have now?" with answer "12"
(operands 2-20, names and items from small lists). The prompt is the chat template of SmolLM2-135M-Instruct
(`openrlhf_geo.real_lm`) rendered over a system instruction and one worked demonstration turn, then the question; the
model writes its own reasoning. Calibrated on the converted model (docs/real-lm.md, "Task"): without the
demonstration it rarely writes `\\boxed{}` (0 of 64 single-digit responses boxed); with it, at temperature 0.7,
accuracy was 0.52 on 8 prompts x 8 and 0.34 on 16 x 8 (12 of 16 groups with mixed rewards), responses of 29-153
tokens (mean 50). The studies sample at SALT Table 4's 0.6 and report the accuracy they measure. Harder variants
were measured and rejected (two-digit bare additions 0.14-0.16, a worked tens-and-ones demonstration 0.0, two-step
problems 0.06, a mix with "gives away" subtractions 0.15).

The prompts are rendered once into the dataset (text, not messages), so both engines see the same tokens: the local
engine reads `--data.input_key` as is, and the fork's upstream dataset does too without `--data.apply_chat_template`.
"""

import random

SYSTEM = "You are a careful math tutor. Solve the problem step by step, then give the final answer as \\boxed{number}."
NAMES = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "coins", "cards")
LOW, HIGH = 2, 20  # operand range (inclusive)
TEMPERATURE = 0.6  # SALT Table 4's rollout temperature (the calibration above was measured at 0.7)
DEMO_OPERANDS = (6, 9)
DEMONSTRATION = (
    "Ben has 6 marbles. Ben gets 9 more marbles. How many marbles does Ben have now?",
    "Ben starts with 6 marbles. He gets 9 more, so we add: 6 + 9 = 15. Ben has 15 marbles now. "
    "The final answer is \\boxed{15}.",
)


def question(name: str, item: str, a: int, b: int) -> str:
    return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"


def word_problems(n: int, seed: int, exclude=()) -> list[tuple[str, str]]:
    """`n` distinct (question, answer) pairs drawn with `random.Random(seed)`, none in `exclude` (questions) and none
    with the demonstration's operands (6 + 9), whose worked answer the prompt shows."""
    rng = random.Random(seed)
    taken = set(exclude)
    space = len(NAMES) * len(ITEMS) * ((HIGH - LOW + 1) ** 2 - 1)
    if n > space - len(taken):
        raise ValueError(f"{n} word problems requested; only {space - len(taken)} distinct ones remain")
    out = []
    while len(out) < n:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        if (a, b) == DEMO_OPERANDS:
            continue
        q = question(rng.choice(NAMES), rng.choice(ITEMS), a, b)
        if q not in taken:
            taken.add(q)
            out.append((q, str(a + b)))
    return out


def chat_prompt(tokenizer, text: str) -> str:
    """The model's chat template over the system instruction, the demonstration turn and `text`, ending where the
    assistant's answer starts."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": DEMONSTRATION[0]},
        {"role": "assistant", "content": DEMONSTRATION[1]},
        {"role": "user", "content": text},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def dataset_rows(tokenizer, problems) -> list[dict]:
    """jsonl rows {"prompt", "answer", "question"} (the engines read `prompt` and `answer`)."""
    return [{"prompt": chat_prompt(tokenizer, q), "answer": a, "question": q} for q, a in problems]
