"""The long chain-of-thought task (chained additions, `task.chain_*`): every worked step is true and the box is the
sum (read here independently, and scored by math-verify), lengths are 100-400 tokens, the carry-dropping shortcut is
marked and wrong on every problem, problems are distinct and disjoint from exclusions, SFT rows mix both at the
rate."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.local.long_cot import SETTINGS, prepare_data, setting
from openrlhf_geo.local.task import (
    build_tokenizer,
    chain_problems,
    chain_sft_rows,
    chain_shortcut_answer,
    chain_shortcut_solution,
    chain_solution,
    chain_terms,
    shortcut_stats,
    uses_shortcut,
)
from openrlhf_geo.rewards.math_verify import extract_last_boxed, score_answer

EQUATION = re.compile(r"(\d+(?:\+\d+)+)=(\d+)")
STEP_HEAD = re.compile(r"(?:^|; |then |quick )(\d+)\+(\d+) ")
terms_lists = st.lists(st.integers(10, 99), min_size=3, max_size=11)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def prompt_of(terms):
    return "+".join(map(str, terms)) + "="


def read_steps(text):
    """Independent reading: the (running sum, term) heads and the `so N` results, in order."""
    heads = [(int(a), int(b)) for a, b in STEP_HEAD.findall(text)]
    results = [int(x) for x in re.findall(r"so (\d+)(?=;| then| so| \\boxed| \Z|,)", text)]
    return heads, results


@settings(max_examples=200)
@given(terms_lists, st.integers(0, 2**32 - 1))
def test_chain_solution_steps_are_true_and_box_the_sum(terms, seed):
    text = chain_solution(prompt_of(terms), random.Random(seed))
    for lhs, rhs in EQUATION.findall(text):
        assert sum(int(x) for x in lhs.split("+")) == int(rhs), (lhs, rhs, text)
    heads, results = read_steps(text)
    assert len(heads) == len(terms) - 1 == len(results), text
    running = terms[0]
    for (x, y), result, term in zip(heads, results, terms[1:]):
        assert sorted((x, y)) == sorted((running, term)), text  # each step adds the next term to the running sum
        running += term
        assert result == running, text
    for (x, y), carry in zip(heads, re.findall(r"carry (\d)", text)):
        assert int(carry) == (x % 10 + y % 10) // 10, text
    assert extract_last_boxed(text) == str(sum(terms))
    assert not uses_shortcut(text)


@settings(max_examples=200)
@given(terms_lists, st.integers(0, 2**32 - 1))
def test_chain_shortcut_drops_every_carry_and_is_marked(terms, seed):
    text = chain_shortcut_solution(prompt_of(terms), random.Random(seed))
    assert uses_shortcut(text) and text.startswith("quick ")
    assert "carry" not in text
    for lhs, rhs in EQUATION.findall(text):  # each written equation is true; the flaw is the dropped carry
        assert sum(int(x) for x in lhs.split("+")) == int(rhs), text
    running = terms[0]  # the carry-less sum, computed digit-wise here as strings
    for term in terms[1:]:
        ones = str(running % 10 + term % 10)[-1]
        running = int(str(running // 10 + term // 10) + ones)
    assert extract_last_boxed(text) == str(running) == chain_shortcut_answer(prompt_of(terms))
    carries = any((s % 10 + t % 10) >= 10 for s, t in read_steps(text)[0])
    assert (running == sum(terms)) == (not carries)


def test_worked_example_by_hand():
    rng = random.Random(0)
    text = chain_solution("37+48+26=", rng)
    assert extract_last_boxed(text) == "111"
    assert chain_shortcut_answer("37+48+26=") == "91"  # 37+48 -> 75 (carry dropped), 75+26 -> 91 (no carry)
    assert chain_shortcut_answer("11+22+33=") == "66"  # no carry anywhere: the shortcut is right
    assert chain_terms("37+48+26=") == [37, 48, 26]
    with pytest.raises(ValueError):
        chain_terms("37+48")


@pytest.mark.parametrize("terms", [3, 4, 6, 8, 10])
def test_math_verify_accepts_solutions_and_rejects_the_shortcut(terms):
    for p in chain_problems(20, seed=terms, terms=terms):
        rng = random.Random(1)
        good, bad = chain_solution(p["prompt"], rng), chain_shortcut_solution(p["prompt"], rng)
        assert score_answer(good, p["answer"]).correct, good
        assert not score_answer(bad, p["answer"]).correct, bad


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_lengths_are_100_to_400_tokens_and_fit_the_setting(tokenizer, name):
    s = SETTINGS[name]
    rng = random.Random(0)
    problems = chain_problems(200, seed=0, terms=s.terms)
    for p in problems:
        for text in (chain_solution(p["prompt"], rng), chain_shortcut_solution(p["prompt"], rng)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text
            assert len(ids) + 1 <= s.max_new_tokens  # + EOS fits --rollout.max_new_tokens
            prompt_ids = tokenizer(p["prompt"])["input_ids"]
            assert len(prompt_ids) + s.max_new_tokens <= s.max_positions
        good = len(tokenizer(chain_solution(p["prompt"], rng), add_special_tokens=False)["input_ids"])
        assert 100 <= good <= 400, (name, good)


def test_problems_are_distinct_disjoint_and_all_carry():
    train = chain_problems(500, seed=0, terms=4)
    prompts = {p["prompt"] for p in train}
    assert len(prompts) == 500
    for p in train:
        terms = [int(t) for t in p["prompt"][:-1].split("+")]
        assert len(terms) == 4 and all(10 <= t <= 99 for t in terms)
        assert p["answer"] == str(sum(terms)) != chain_shortcut_answer(p["prompt"])
    held_out = chain_problems(100, seed=1, terms=4, exclude=prompts)
    assert not {p["prompt"] for p in held_out} & prompts
    assert chain_problems(50, seed=0, terms=4) == train[:50]  # seeded
    with pytest.raises(ValueError):
        chain_problems(5, seed=0, terms=2)


def test_sft_rows_mix_the_shortcut_at_its_rate_and_shortcut_stats_count_it():
    problems = chain_problems(200, seed=0, terms=4)
    rows = chain_sft_rows(problems, per_prompt=4, seed=3, shortcut_rate=0.5)
    assert len(rows) == 800 and rows == chain_sft_rows(problems, 4, 3, 0.5)
    share = sum(uses_shortcut(r["response"]) for r in rows) / len(rows)
    assert 0.44 < share < 0.56  # binomial(800, 0.5): sd 0.018
    assert not any(uses_shortcut(r["response"]) for r in chain_sft_rows(problems, 2, 3, 0.0))
    answers = {p["prompt"]: p["answer"] for p in problems}
    correct = [extract_last_boxed(r["response"]) == answers[r["prompt"]] for r in rows]
    stats = shortcut_stats([r["prompt"] for r in rows], [r["response"] for r in rows], correct)
    assert stats["task/wrong"] == stats["task/wrong_shortcut"] == stats["task/shortcut"] == share * 800
    with pytest.raises(ValueError):
        chain_sft_rows(problems, 0, 0)


def test_setting_data_is_written_and_settings_validate(tmp_path):
    s = setting("terms4")
    train, held_out = prepare_data(tmp_path, s)
    assert (tmp_path / "data" / "train.jsonl").read_text().count("\n") == len(train) == 3000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert setting("terms6", hidden_size=96).hidden_size == 96
    with pytest.raises(ValueError, match="unknown long-cot setting"):
        setting("terms5")
