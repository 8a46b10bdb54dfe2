"""Evaluation: pass@k against brute-force enumeration, avg@n, benchmark loading, and a CPU end-to-end eval."""

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.eval import harness
from openrlhf_geo.eval.metrics import avg_at_n, mean_pass_at_k, pass_at_k
from openrlhf_geo.rewards.math_verify import STATUSES

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


def _pass_at_k_by_enumeration(n, c, k):
    """Fraction of the k-subsets of n samples (c of them correct) that contain a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@settings(max_examples=150)
@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_enumeration_over_all_k_subsets(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_by_enumeration(n, c, k)), abs=1e-12)


@settings(max_examples=60)
@given(st.integers(1, 1024).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_stable_for_large_n(nck):
    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # Python integers: no overflow, no rounding
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


@settings(max_examples=60)
@given(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=12))
def test_avg_at_n_is_mean_per_problem_accuracy_and_equals_pass_at_1(rows):
    per_problem = [sum(r) / len(r) for r in rows]
    assert avg_at_n(rows) == pytest.approx(sum(per_problem) / len(per_problem))
    assert mean_pass_at_k([sum(r) for r in rows], 4, 1) == pytest.approx(avg_at_n(rows))


@pytest.mark.parametrize(
    "n, c, k, message",
    [(4, 5, 1, "0 <= c <= n"), (4, 1, 5, "1 <= k <= n"), (4, 1, 0, "1 <= k <= n"), (4.0, 1, 1, "n")],
)
def test_pass_at_k_rejects_impossible_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_benchmark_fields_gsm8k_olympiad_and_choice_layouts():
    gsm = harness.to_problems([{"question": "2+2?", "answer": "Add them.\n#### 1,004"}], "gsm8k")
    assert gsm[0].answer == "1004"
    olympiad = harness.to_problems([{"question": "q", "final_answer": ["$\\frac{1}{2}$"]}], "olympiadbench")
    assert olympiad[0].answer == "$\\frac{1}{2}$"
    given_choices = harness.to_problems([{"question": "q", "choices": ["x", "y", "z"], "answer": 2}], "gpqa_diamond")
    assert given_choices[0].answer == "C" and given_choices[0].num_choices == 3
    with pytest.raises(ValueError, match="no problem field"):
        harness.to_problems([{"prompt": "q", "answer": "1"}], "math500")


def test_gpqa_choices_are_shuffled_reproducibly_and_gold_letter_points_at_correct_answer():
    records = harness.load_records(FIXTURES / "gpqa_diamond.jsonl")
    for seed in range(5):
        problems = harness.to_problems(records, "gpqa_diamond", seed=seed)
        assert problems == harness.to_problems(records, "gpqa_diamond", seed=seed)
        for problem, record in zip(problems, records):
            assert f"{problem.answer}) {record['Correct Answer']}" in problem.question.splitlines()
    letters = {p.answer for seed in range(20) for p in harness.to_problems(records, "gpqa_diamond", seed=seed)}
    assert len(letters) > 1  # the correct answer is not always in the same slot


@pytest.mark.parametrize(
    "response, correct, status",
    [
        ("... so \\boxed{B}", True, "correct"),
        ("\\boxed{(B)}", True, "correct"),
        ("\\boxed{\\text{B}}", True, "correct"),
        ("\\boxed{B) photon}", True, "correct"),
        ("\\boxed{A} no wait \\boxed{B}", True, "correct"),
        ("\\boxed{C}", False, "wrong"),
        ("\\boxed{E}", False, "wrong"),
        ("\\boxed{photon}", False, "wrong"),
        ("The answer is B", False, "no_box"),
    ],
)
def test_choice_verdict_reads_the_boxed_letter(response, correct, status):
    verdict = harness.choice_verdict(response, "B", num_choices=4)
    assert (verdict.correct, verdict.status) == (correct, status)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Qwen2 and a character-level ChatML tokenizer built with `tokenizers`."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tokenizer.save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    torch.manual_seed(0)
    config.save_pretrained(path)  # + safetensors directly: save_pretrained would import accelerate/deepspeed
    save_file(Qwen2ForCausalLM(config).state_dict(), path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_cpu_eval_end_to_end_writes_per_problem_and_summary_files(tiny_model, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["--model", str(tiny_model), "--benchmarks", "math500,gpqa_diamond", "--data-dir", str(FIXTURES)]
    argv += ["--n", "2", "--k", "1", "2", "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "3"]
    argv += ["--output-dir", str(out), "--backend", "hf", "--batch-size", "4"]
    assert harness.main(argv) == 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "hf" and summary["config"]["n"] == 2 and summary["config"]["k"] == [1, 2]
    assert set(summary["benchmarks"]) == {"math500", "gpqa_diamond"}
    assert set(summary["metrics"]) == {
        f"{b}/{m}" for b in ("math500", "gpqa_diamond") for m in ("avg@2", "pass@1", "pass@2")
    }
    for bench, size in (("math500", 5), ("gpqa_diamond", 2)):
        metrics = summary["benchmarks"][bench]
        assert metrics["problems"] == size and metrics["n"] == 2
        records = [json.loads(line) for line in (out / f"{bench}.jsonl").read_text().splitlines()]
        assert [r["index"] for r in records] == list(range(size))
        for r in records:
            assert set(r) >= {
                "prompt",
                "problem",
                "answer",
                "responses",
                "extracted",
                "correct",
                "status",
                "truncated",
            }
            assert len(r["responses"]) == len(r["correct"]) == len(r["status"]) == len(r["truncated"]) == 2
            assert all(isinstance(text, str) for text in r["responses"]) and set(r["status"]) <= set(STATUSES)
            assert r["num_correct"] == sum(r["correct"]) and r["pass@2"] == pass_at_k(2, r["num_correct"], 2)
            assert r["prompt"].startswith("<|im_start|>system\n" + harness.SYSTEM_PROMPT[:20])
        # the summary is recomputable from the per-problem file
        assert metrics["avg@2"] == pytest.approx(np.mean([r["correct"] for r in records]))
        assert metrics["pass@2"] == pytest.approx(np.mean([r["pass@2"] for r in records]))
    assert "math500:" in capsys.readouterr().out


def test_eval_rejects_k_larger_than_n_and_unknown_benchmarks(tmp_path):
    with pytest.raises(ValueError, match="--k"):
        harness.main(["--model", "m", "--n", "2", "--k", "4", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--benchmarks"):
        harness.main(["--model", "m", "--benchmarks", "aime2099", "--output-dir", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--from-hub"):
        harness.main(
            ["--model", "m", "--benchmarks", "aime24", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path)]
        )


def test_prompt_uses_chat_template_or_plain_text_and_placement(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    system = harness.render_prompt(tokenizer, "1+1?", harness.SYSTEM_PROMPT, "system")
    chatml_user = "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert system == f"<|im_start|>system\n{harness.SYSTEM_PROMPT}<|im_end|>\n" + chatml_user
    user = harness.render_prompt(tokenizer, "1+1?", harness.SYSTEM_PROMPT, "user")
    assert user == f"<|im_start|>user\n1+1?\n{harness.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = None  # a base model without a template: plain text
    assert harness.render_prompt(tokenizer, "1+1?", "Box it.", "system") == "Box it.\n\n1+1?\n"
