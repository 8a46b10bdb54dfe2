"""The demo's task: two-digit addition answered in `\\boxed{}`, a character tokenizer and a tiny Qwen2.

Everything is built locally (nothing is downloaded): the tokenizer with the `tokenizers` library, the model from a
`Qwen2Config`. A problem is a prompt such as ``"37+48="`` and an answer ``"85"``; the reference response is
``"\\boxed{85}"`` followed by EOS, so a rollout is a handful of tokens and the reward is the shipped math-verify
check of the boxed answer.
"""

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# one token per character, plus `\boxed{` as a single token so a response is ~5 tokens
VOCAB = (*SPECIAL_TOKENS, *"0123456789", "+", "-", "*", "=", " ", "\\boxed{", "}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level WordLevel tokenizer over VOCAB that prepends <bos>; left padding (as for generation)."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|."), behavior="isolated")
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


def build_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=0) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-style causal LM sized for CPU (default 2 x 64: ~0.13M parameters)."""
    import torch

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def addition_problems(n, seed, max_operand=99, exclude=()):
    """`n` distinct problems {"prompt": "a+b=", "answer": "a+b"} with 0 <= a, b <= max_operand, none in `exclude`."""
    pool = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    excluded = set(exclude)
    pool = [(a, b) for a, b in pool if f"{a}+{b}=" not in excluded]
    if n > len(pool):
        raise ValueError(f"asked for {n} problems but only {len(pool)} exist with max_operand={max_operand}")
    picked = random.Random(seed).sample(pool, n)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in picked]


def reference_response(answer: str) -> str:
    """The SFT target for an answer: `\\boxed{answer}` (EOS is appended by the engine)."""
    return f"\\boxed{{{answer}}}"


def write_jsonl(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path, input_key="prompt", label_key="answer"):
    """Rows of a jsonl file as {"prompt", "answer"} dicts; a missing key raises ValueError naming file and line."""
    rows = []
    with Path(path).open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [key for key in (input_key, label_key) if key not in row]
            if missing:
                raise ValueError(f"{path}:{line_no}: missing key {missing[0]!r} (have {sorted(row)})")
            rows.append({"prompt": str(row[input_key]), "answer": str(row[label_key])})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows
