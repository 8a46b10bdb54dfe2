"""The demo's task: two-digit addition with a worked solution ending in `\\boxed{}`, a tokenizer, a tiny Qwen2 and
its SFT warm-up (`sft`).

Everything is built locally (nothing is downloaded): the tokenizer with the `tokenizers` library, the model from a
`Qwen2Config`. A problem is a prompt such as ``"37+48="`` and an answer ``"85"``; the reward is the shipped
math-verify check of the last boxed answer.

The SFT targets are worked solutions drawn at random among many valid ones (`worked_solution`): one of four
strategies, each addition's operands in either order, varied connectives, e.g.
``"30+40=70, 8+7=15 then 70+15=85 so \\boxed{85}"`` or ``"7+8=15 carry 1; 3+4+1=8 \\boxed{85}"``. Sampling the
warmed-up model at T = 1 then gives different correct responses to one prompt, as an LLM's reasoning does; with a
single target string (`reference_response`) every correct rollout of a prompt is the same token sequence, with the
same LM-head gradient and the same last hidden state, which is not the regime SALT and GeoAlign are built for.

A corpus may also hold a flawed procedure with its own wording (`shortcut_solution`): ``"quick 7+8=15, 3+4=7 so
\\boxed{75}"``, digit-wise addition that drops the carry, wrong exactly when the ones digits sum to 10 or more
(`needs_carry`). Trained on such a mix, the model's wrong answers are mostly the shortcut rather than random slips,
the regime GeoAlign's premise is about (wrong answers share a recognisable cause that the last hidden state can
encode); `uses_shortcut` tells from the text which procedure a response followed. `ShortcutPayer` is a verifier
misspecified in that same direction: on a fixed share of prompts it also pays the shortcut's answer.
"""

import hashlib
import json
import math
import random
import re
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
WORDS = ("so", "then", "and", "carry", "quick")
# one token per character, `\boxed{` and the connective words as single tokens (new tokens go last: ids stay stable)
VOCAB = (*SPECIAL_TOKENS, *"0123456789", "+", "-", "*", "=", " ", "\\boxed{", "}", ",", ";", *WORDS)

# worked-solution strategies for a+b (a = 10·a1 + a0, b = 10·b1 + b0), shown for 37+48:
STRATEGIES = (
    "tens",  # 30+40=70, 7+8=15, 70+15=85 (tens and ones sums in either order)
    "split_b",  # 37+40=77, 77+8=85
    "split_a",  # 48+30=78, 78+7=85
    "digits",  # 7+8=15 carry 1, 3+4+1=8 (digit-wise with the carry)
)
SEPARATORS = (" ", ", ", "; ", " then ", " and ")  # between steps
ENDINGS = (" so ", ", so ", " ")  # before the box
SHORTCUT = "quick"  # the flawed procedure's marker word, its first token
_PROMPT = re.compile(r"(\d+)\+(\d+)=")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """WordLevel tokenizer over VOCAB (characters, `\\boxed{`, WORDS) that prepends <bos>; left padding."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    pattern = "|".join(re.escape(t) for t in ("\\boxed{", *WORDS)) + "|."
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate tokens without separators
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=0, max_positions=128) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-style causal LM sized for CPU (default 2 x 64: ~0.1M parameters)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def addition_problems(n, seed, max_operand=99, exclude=(), carry_only=False):
    """`n` distinct problems {"prompt": "a+b=", "answer": "a+b"} with 0 <= a, b <= max_operand, none in `exclude`;
    `carry_only`: only problems whose ones digits sum to 10 or more (`needs_carry`)."""
    pool = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    excluded = set(exclude)
    pool = [(a, b) for a, b in pool if f"{a}+{b}=" not in excluded and (not carry_only or a % 10 + b % 10 >= 10)]
    if n > len(pool):
        raise ValueError(
            f"asked for {n} problems but only {len(pool)} exist with max_operand={max_operand}"
            + (" and carry_only" if carry_only else "")
        )
    picked = random.Random(seed).sample(pool, n)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in picked]


def reference_response(answer: str) -> str:
    """The shortest valid response, `\\boxed{answer}` (EOS is appended by the engine); `worked_solution` for SFT."""
    return f"\\boxed{{{answer}}}"


def _operands(prompt: str, caller: str) -> tuple[int, int]:
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"{caller} needs a prompt of the form 'a+b=' with a, b >= 0 (got {prompt!r})")
    return int(match[1]), int(match[2])


def needs_carry(prompt: str) -> bool:
    """Whether the ones digits of "a+b=" sum to 10 or more (where `shortcut_solution` is wrong)."""
    a, b = _operands(prompt, "needs_carry")
    return a % 10 + b % 10 >= 10


def worked_solution(prompt: str, rng: random.Random, strategy: str | None = None) -> str:
    """A worked solution of the problem `prompt` ("a+b=", a, b >= 0) ending in `\\boxed{a+b}`.

    The strategy (STRATEGIES; None = uniform), each step's operand order, the separators and the ending are drawn
    from `rng`; every step is a true equation. ValueError for a prompt that is not "a+b=" or an unknown strategy.
    """
    a, b = _operands(prompt, "worked_solution")
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    strategy = strategy or rng.choice(STRATEGIES)

    def add(*terms):  # one step; two-term sums in a random order (the carry step keeps its order)
        if len(terms) == 2 and rng.random() < 0.5:
            terms = terms[::-1]
        return "+".join(map(str, terms)) + f"={sum(terms)}"

    tens_a, ones_a, tens_b, ones_b = a - a % 10, a % 10, b - b % 10, b % 10
    if strategy == "tens":
        steps = [add(tens_a, tens_b), add(ones_a, ones_b)]
        if rng.random() < 0.5:
            steps.reverse()
        steps.append(add(tens_a + tens_b, ones_a + ones_b))
    elif strategy == "split_b":
        steps = [add(a, tens_b), add(a + tens_b, ones_b)]
    elif strategy == "split_a":
        steps = [add(b, tens_a), add(b + tens_a, ones_a)]
    else:  # digits: the ones digits, the carry, then the tens digits plus the carry (the hundreds come with them)
        carry = (ones_a + ones_b) // 10
        steps = [add(ones_a, ones_b), f"carry {carry}", add(a // 10, b // 10, carry)]
    body = steps[0] + "".join(rng.choice(SEPARATORS) + step for step in steps[1:])
    return f"{body}{rng.choice(ENDINGS)}\\boxed{{{a + b}}}"


def shortcut_solution(prompt: str, rng: random.Random) -> str:
    """The flawed "quick" procedure for "a+b=": add the ones digits, add the tens digits, write the tens sum followed
    by the last digit of the ones sum, dropping the carry, e.g. ``"quick 7+8=15, 3+4=7 so \\boxed{75}"`` for 37+48.

    Each written equation is true; the boxed answer is 10·(a1 + b1) + (a0 + b0) mod 10, which equals a + b exactly
    when no carry is needed. Operand order, separator and ending are drawn from `rng` as in `worked_solution`.
    """
    a, b = _operands(prompt, "shortcut_solution")

    def add(x, y):
        x, y = (y, x) if rng.random() < 0.5 else (x, y)
        return f"{x}+{y}={x + y}"

    ones, tens = (a % 10, b % 10), (a // 10, b // 10)
    body = add(*ones) + rng.choice(SEPARATORS) + add(*tens)
    return f"{SHORTCUT} {body}{rng.choice(ENDINGS)}\\boxed{{{10 * sum(tens) + sum(ones) % 10}}}"


def uses_shortcut(response: str) -> bool:
    """Whether a response follows the flawed procedure (`shortcut_solution`): it opens with the SHORTCUT word."""
    return response.lstrip().startswith(SHORTCUT)


def shortcut_answer(prompt: str) -> str:
    """The answer `shortcut_solution` boxes for "a+b=": 10·(a1 + b1) + (a0 + b0) mod 10, the sum with the carry of the
    ones column dropped (equal to a + b exactly when no carry is needed)."""
    a, b = _operands(prompt, "shortcut_answer")
    return str(10 * (a // 10 + b // 10) + (a % 10 + b % 10) % 10)


def misspecified_prompt(prompt: str, rate: float, seed: int) -> bool:
    """Whether `ShortcutPayer`'s verifier is misspecified on `prompt`: a fixed share `rate` of all prompts, chosen by
    a seeded SHA-256 of the prompt text, so the same prompts in every step, process and run with that seed."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1] (got {rate})")
    digest = hashlib.sha256(f"{seed}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < rate * 2**64


class ShortcutPayer:
    """A systematically misspecified verifier for this task: on a fixed share `rate` of the prompts
    (`misspecified_prompt` with `seed`) it also accepts the carry-dropping shortcut's answer (`shortcut_answer`), as a
    wrong entry in an answer key would. The misspecified reward is max(verdict, paid); the engine applies it as
    `--reward.noise.type misspecified` (`rewards.noise.pay_wrong`, which marks the wrong rollouts it pays as
    corrupted), so training accuracy, evaluation and GeoAlign's detection labels keep the true verdicts.

    Called as the engine's `misspecified_pay` hook: (prompts, responses, answers) -> (N,) bool, the rollouts whose last
    boxed answer `verifier` (the run's reward function, (prompts, responses, answers) -> verdicts) accepts as the
    shortcut's answer of a misspecified prompt. Whether they are also correct is not its business (the noise step only
    changes rewards that are not already 1).
    """

    def __init__(self, verifier, rate: float, seed: int):
        misspecified_prompt("0+0=", rate, seed)  # validates rate
        self.verifier, self.rate, self.seed = verifier, rate, seed

    def __call__(self, prompts, responses, answers) -> torch.Tensor:
        rows = [i for i, p in enumerate(prompts) if misspecified_prompt(p, self.rate, self.seed)]
        paid = torch.zeros(len(prompts), dtype=torch.bool)
        if rows:
            verdicts = self.verifier(
                [prompts[i] for i in rows], [responses[i] for i in rows], [shortcut_answer(prompts[i]) for i in rows]
            )
            paid[rows] = torch.as_tensor(verdicts, dtype=torch.float32) == 1
        return paid


def sft_rows(problems, per_prompt: int, seed: int, strategies=None, shortcut_rate: float = 0.0) -> list:
    """SFT rows {"prompt", "response"}: `per_prompt` independently drawn solutions for each problem.

    Each solution is, with probability `shortcut_rate`, the flawed `shortcut_solution`, else a `worked_solution`
    with a strategy drawn uniformly from `strategies` (None = all of STRATEGIES).
    """
    if per_prompt < 1:
        raise ValueError(f"per_prompt must be >= 1 (got {per_prompt})")
    if not 0.0 <= shortcut_rate <= 1.0:
        raise ValueError(f"shortcut_rate must be in [0, 1] (got {shortcut_rate})")
    strategies = tuple(strategies) if strategies is not None else STRATEGIES
    unknown = [s for s in strategies if s not in STRATEGIES]
    if not strategies or unknown:
        raise ValueError(f"strategies must be a non-empty subset of {STRATEGIES} (got {strategies})")
    rng = random.Random(seed)

    def draw(prompt):
        if rng.random() < shortcut_rate:
            return shortcut_solution(prompt, rng)
        return worked_solution(prompt, rng, rng.choice(strategies))

    return [{"prompt": p["prompt"], "response": draw(p["prompt"])} for p in problems for _ in range(per_prompt)]


def shortcut_stats(prompts, responses, correct) -> dict:
    """What a batch's wrong answers are made of, as counts (they add up over generation rounds and pool over steps).

    prompts / responses: N texts; correct (N,) 1/0 verdicts. -> {"task/rollouts": N, "task/shortcut": rollouts that
    follow the shortcut (`uses_shortcut`), "task/wrong": wrong rollouts, "task/wrong_shortcut": wrong rollouts that
    follow the shortcut}, floats.
    """
    shortcut = [uses_shortcut(r) for r in responses]
    wrong = [float(c) == 0.0 for c in correct]
    return {
        "task/rollouts": float(len(responses)),
        "task/shortcut": float(sum(shortcut)),
        "task/wrong": float(sum(wrong)),
        "task/wrong_shortcut": float(sum(s and w for s, w in zip(shortcut, wrong))),
    }


def write_jsonl(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def sft(model, tokenizer, rows, steps, batch_size=128, lr=3e-3, warmup=50, seed=0, callback=None, final_lr_ratio=None):
    """Supervised warm-up: response-only cross-entropy (token-mean) on prompt -> response rows -> losses.

    rows: dicts with "prompt" and "response"; the target is the response tokens plus EOS. AdamW; the learning rate
    at step s (0-based) is lr·min(1, (s+1)/warmup), times, when final_lr_ratio is given, a cosine decay
    r + (1 − r)·(1 + cos(π·s/(steps − 1)))/2 from 1 at the first step to r = final_lr_ratio at the last one;
    grad-norm clip 1.0; batches drawn with a seeded `random.Random` so the warm-up is reproducible. Stops after
    `steps` steps, or earlier when `callback(step, loss)` returns True.
    """
    device = next(model.parameters()).device
    rng = random.Random(seed)
    if not rows:
        raise ValueError("sft needs at least one {prompt, response} row (got none)")
    if final_lr_ratio is not None and not 0.0 <= final_lr_ratio <= 1.0:
        raise ValueError(f"final_lr_ratio must be in [0, 1] or None (got {final_lr_ratio})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def factor(step):
        ramp = min(1.0, (step + 1) / warmup)
        if final_lr_ratio is None:
            return ramp
        cosine = (1 + math.cos(math.pi * min(1.0, step / max(steps - 1, 1)))) / 2
        return ramp * (final_lr_ratio + (1 - final_lr_ratio) * cosine)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = tokenizer([row["prompt"] for row in rows])["input_ids"]
    responses = tokenizer([row["response"] for row in rows], add_special_tokens=False)["input_ids"]
    encoded = [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompts, responses)]
    losses = []
    model.train()
    for step in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (p, r) in enumerate(batch):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            attention[i, : len(p) + len(r)] = 1
        loss = model(input_ids=ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if callback is not None and callback(step + 1, loss.item()):
            break
    return losses


# ---------------------------------------------------------------- long chain-of-thought: a repeated-addition trace
#
# SALT's regime is long reasoning (arXiv 2606.05800 §2.2-2.3, Fig. 2: responses of thousands of tokens, many of them
# shared or near-deterministic, so that per-response LM-head gradients concentrate in a low-rank signed geometry and
# cancel inside a group). The demo's answers are ~28 tokens; this family is a short program trace: "a+b*k=" (a + b·k,
# two-digit a and b, k = 2-9) computed as k additions of b to a running sum, each written out digit by digit with its
# carry and preceded by a loop counter (the additions left), so a response is 100-400 tokens (~35 per addition) in
# the demo's vocabulary (no new token: the demo's model and numbers stay as they are):
#
#   "37+48*2=" -> "2 37+48 7+8=15 carry 1, 3+4+1=8 so 85; 1 85+48 5+8=13 carry 1, 8+4+1=13 so 133 \boxed{133}"
#
# A step: the counter, its head `s+b` (running sum and b, in either order), the ones digits' sum, the carry, the sum of
# everything above the ones digit plus the carry (the hundreds come with the tens, as the demo's "digits" strategy
# does), and `so <new running sum>`. Every operand is the previous step's result or the prompt's b, so a tiny model
# need not retrieve the k-th of k different terms (a first version with distinct terms was not learnt by the demo's
# 2 x 64 model in 600 SFT steps: held-out accuracy 0.002, most errors a wrong term copied). The flawed procedure
# (`chain_shortcut_solution`) opens with the SHORTCUT word and drops every carry, e.g.
# "quick 2 37+48 7+8=15, 3+4=7 so 75; 1 75+48 ...": each written equation is true, the running sum loses 10 at each
# step whose ones digits carry, and the error propagates.

CHAIN_LOW, CHAIN_HIGH = 10, 99  # a and b: two-digit numbers
CHAIN_MAX_STEPS = 9  # k: one digit (the loop counter is one token)
CHAIN_INNER = (", ", " ", " and ")  # between the ones and the tens of one step
CHAIN_STEPS = ("; ", " then ", "; then ")  # between steps
_CHAIN_PROMPT = re.compile(r"(\d+)\+(\d+)\*(\d)=")


def chain_operands(prompt: str) -> tuple[int, int, int]:
    """(a, b, k) of a repeated-addition prompt "a+b*k=" (1 <= k <= 9); ValueError for any other text."""
    match = _CHAIN_PROMPT.fullmatch(prompt)
    if match is None or not 1 <= int(match[3]) <= CHAIN_MAX_STEPS:
        raise ValueError(f"a repeated-addition prompt has the form 'a+b*k=' with 1 <= k <= 9 (got {prompt!r})")
    return int(match[1]), int(match[2]), int(match[3])


def chain_shortcut_answer(prompt: str) -> str:
    """The answer `chain_shortcut_solution` boxes: k times s <- 10·(s // 10 + b // 10) + (s % 10 + b % 10) mod 10
    from s = a (each addition with the carry of the ones column dropped)."""
    s, b, k = chain_operands(prompt)
    for _ in range(k):
        s = 10 * (s // 10 + b // 10) + (s % 10 + b % 10) % 10
    return str(s)


def chain_problems(n, seed, steps, exclude=()):
    """`n` distinct problems {"prompt": "a+b*k=", "answer": str(a + b·k)} with k = `steps` (2-9) and two-digit a, b
    (CHAIN_LOW..CHAIN_HIGH, a seeded `random.Random` sample), none in `exclude`, each with at least one carry, so that
    the shortcut's answer (`chain_shortcut_answer`) is wrong on every problem, as the demo's carry-only problems make
    its shortcut wrong."""
    if not 2 <= steps <= CHAIN_MAX_STEPS:
        raise ValueError(f"steps must be in 2..{CHAIN_MAX_STEPS} (got {steps})")
    excluded = set(exclude)
    pool = [f"{a}+{b}*{steps}=" for a in range(CHAIN_LOW, CHAIN_HIGH + 1) for b in range(CHAIN_LOW, CHAIN_HIGH + 1)]
    pool = [p for p in pool if p not in excluded]
    pool = [p for p in pool if chain_shortcut_answer(p) != str(_chain_value(p))]
    if n > len(pool):
        raise ValueError(f"asked for {n} problems but only {len(pool)} exist with steps={steps} outside `exclude`")
    return [{"prompt": p, "answer": str(_chain_value(p))} for p in random.Random(seed).sample(pool, n)]


def _chain_value(prompt):
    a, b, k = chain_operands(prompt)
    return a + b * k


def _chain_step(s, b, rng, carry=True):
    """One addition s + b: head, ones digits, (carry), the rest plus the carry, `so` the new running sum."""

    def pair(x, y):
        return (y, x) if rng.random() < 0.5 else (x, y)

    head = "+".join(map(str, pair(s, b)))
    o1, o2 = pair(s % 10, b % 10)
    h1, h2 = pair(s // 10, b // 10)
    if carry:
        c = (o1 + o2) // 10
        total = s + b
        body = f"{o1}+{o2}={o1 + o2} carry {c}{rng.choice(CHAIN_INNER)}{h1}+{h2}+{c}={h1 + h2 + c}"
    else:  # the shortcut: the carry is dropped
        total = 10 * (h1 + h2) + (o1 + o2) % 10
        body = f"{o1}+{o2}={o1 + o2}{rng.choice(CHAIN_INNER)}{h1}+{h2}={h1 + h2}"
    return f"{head} {body} so {total}", total


def _chain_text(prompt, rng, carry):
    s, b, k = chain_operands(prompt)
    steps = []
    for left in range(k, 0, -1):
        text, s = _chain_step(s, b, rng, carry)
        steps.append(f"{left} {text}")
    body = steps[0] + "".join(rng.choice(CHAIN_STEPS) + step for step in steps[1:])
    return f"{body}{rng.choice(ENDINGS)}\\boxed{{{s}}}"


def chain_solution(prompt: str, rng: random.Random) -> str:
    """A worked solution of "a+b*k=" ending in `\\boxed{a + b·k}`: k counted additions of b (see the section comment
    above), operand orders, separators and the ending drawn from `rng`; every written equation is true."""
    return _chain_text(prompt, rng, carry=True)


def chain_shortcut_solution(prompt: str, rng: random.Random) -> str:
    """The flawed "quick" procedure for "a+b*k=": the same steps without the carry (each written equation is true,
    the running sum loses 10 at every carry and the loss propagates), boxing `chain_shortcut_answer`. It opens with
    the SHORTCUT word, so `uses_shortcut` and `shortcut_stats` read it as the demo's shortcut."""
    return f"{SHORTCUT} {_chain_text(prompt, rng, carry=False)}"


def chain_sft_rows(problems, per_prompt: int, seed: int, shortcut_rate: float = 0.0) -> list:
    """SFT rows {"prompt", "response"} for repeated additions: `per_prompt` independent draws per problem, each the
    `chain_shortcut_solution` with probability `shortcut_rate`, else a `chain_solution` (as `sft_rows` does for
    the demo)."""
    if per_prompt < 1:
        raise ValueError(f"per_prompt must be >= 1 (got {per_prompt})")
    if not 0.0 <= shortcut_rate <= 1.0:
        raise ValueError(f"shortcut_rate must be in [0, 1] (got {shortcut_rate})")
    rng = random.Random(seed)

    def draw(prompt):
        if rng.random() < shortcut_rate:
            return chain_shortcut_solution(prompt, rng)
        return chain_solution(prompt, rng)

    return [{"prompt": p["prompt"], "response": draw(p["prompt"])} for p in problems for _ in range(per_prompt)]
