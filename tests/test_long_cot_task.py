"""The long chain-of-thought task (a repeated-addition trace "a+b*k=", `task.chain_*`): every worked step is true,
counted and adds b to the previous result, the box is a + b·k (read here independently, and scored by math-verify),
lengths are 100-400 tokens, the carry-dropping shortcut is marked and wrong on every problem, problems are distinct and
disjoint from exclusions, SFT rows mix both at the rate."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.lab.long_cot_task import MAX_POSITIONS, N_TRAIN_PER_K, max_new_tokens, prepare_data, problems
from openrlhf_geo.lab.task import (
    build_tokenizer,
    chain_operands,
    chain_problems,
    chain_sft_rows,
    chain_shortcut_answer,
    chain_shortcut_solution,
    chain_solution,
    shortcut_stats,
    uses_shortcut,
)
from openrlhf_geo.rewards.math_verify import extract_last_boxed, score_answer

EQUATION = re.compile(r"(\d+(?:\+\d+)+)=(\d+)")
# a step: "<counter> <x>+<y> " ... "so <result>"
STEP = re.compile(r"(?:^|quick |; |then )(\d) (\d+)\+(\d+) .*?so (\d+)")
problem = st.tuples(st.integers(10, 99), st.integers(10, 99), st.integers(1, 9))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def read_steps(text):
    """Independent reading: (counter, x, y, result) per step, in order."""
    return [tuple(map(int, m)) for m in STEP.findall(text)]


@settings(max_examples=200)
@given(problem, st.integers(0, 2**32 - 1))
def test_chain_solution_steps_are_true_counted_and_box_the_value(abk, seed):
    a, b, k = abk
    text = chain_solution(f"{a}+{b}*{k}=", random.Random(seed))
    for lhs, rhs in EQUATION.findall(text):
        assert sum(int(x) for x in lhs.split("+")) == int(rhs), (lhs, rhs, text)
    steps = read_steps(text)
    assert [counter for counter, *_ in steps] == list(range(k, 0, -1)), text
    running = a
    for _, x, y, result in steps:
        assert sorted((x, y)) == sorted((running, b)), text  # each step adds b to the previous result
        running += b
        assert result == running, text
    for (_, x, y, _), carry in zip(steps, re.findall(r"carry (\d)", text)):
        assert int(carry) == (x % 10 + y % 10) // 10, text
    assert extract_last_boxed(text) == str(a + b * k)
    assert not uses_shortcut(text)


@settings(max_examples=200)
@given(problem, st.integers(0, 2**32 - 1))
def test_chain_shortcut_drops_every_carry_and_is_marked(abk, seed):
    a, b, k = abk
    prompt = f"{a}+{b}*{k}="
    text = chain_shortcut_solution(prompt, random.Random(seed))
    assert uses_shortcut(text) and text.startswith("quick ")
    assert "carry" not in text
    for lhs, rhs in EQUATION.findall(text):  # each written equation is true; the flaw is the dropped carry
        assert sum(int(x) for x in lhs.split("+")) == int(rhs), text
    running, carried = a, False  # the carry-less sum, computed digit-wise here as strings
    for _ in range(k):
        carried |= running % 10 + b % 10 >= 10
        ones = str(running % 10 + b % 10)[-1]
        running = int(str(running // 10 + b // 10) + ones)
    assert len(read_steps(text)) == k
    assert extract_last_boxed(text) == str(running) == chain_shortcut_answer(prompt)
    assert (running == a + b * k) == (not carried)


def test_worked_example_by_hand():
    text = chain_solution("37+48*2=", random.Random(0))
    assert extract_last_boxed(text) == "133"
    assert chain_shortcut_answer("37+48*2=") == "113"  # 37+48 -> 75 (carry dropped), 75+48 -> 113 (dropped again)
    assert chain_shortcut_answer("37+48*1=") == "75"
    assert chain_shortcut_answer("11+22*3=") == "77"  # no carry anywhere: the shortcut is right
    assert chain_operands("37+48*2=") == (37, 48, 2)
    for bad in ("37+48", "37+48+26=", "37+48*0=", "37+48*10="):
        with pytest.raises(ValueError):
            chain_operands(bad)


@pytest.mark.parametrize("k", [2, 3, 5, 7, 9])
def test_math_verify_accepts_solutions_and_rejects_the_shortcut(k):
    for p in chain_problems(15, seed=k, steps=k):
        rng = random.Random(1)
        good, bad = chain_solution(p["prompt"], rng), chain_shortcut_solution(p["prompt"], rng)
        assert score_answer(good, p["answer"]).correct, good
        assert not score_answer(bad, p["answer"]).correct, bad


@pytest.mark.parametrize("k", [3, 5, 7, 9])
def test_lengths_are_100_to_400_tokens_and_fit_the_flags(tokenizer, k):
    rng = random.Random(0)
    for p in chain_problems(200, seed=0, steps=k):
        prompt_ids = tokenizer(p["prompt"])["input_ids"]
        assert tokenizer.unk_token_id not in prompt_ids
        assert len(prompt_ids) + max_new_tokens(k) <= MAX_POSITIONS
        for flawed in (False, True):
            text = (chain_shortcut_solution if flawed else chain_solution)(p["prompt"], rng)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text
            assert len(ids) + 1 <= max_new_tokens(k)  # + EOS fits --rollout.max_new_tokens
            if not flawed:
                assert 100 <= len(ids) <= 400, (k, len(ids))


def test_problems_are_distinct_disjoint_and_all_carry():
    train = chain_problems(500, seed=0, steps=4)
    prompts = {p["prompt"] for p in train}
    assert len(prompts) == 500
    for p in train:
        a, rest = p["prompt"][:-1].split("+")
        b, k = rest.split("*")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and k == "4"
        assert p["answer"] == str(int(a) + 4 * int(b)) != chain_shortcut_answer(p["prompt"])
    held_out = chain_problems(100, seed=1, steps=4, exclude=prompts)
    assert not {p["prompt"] for p in held_out} & prompts
    assert chain_problems(500, seed=0, steps=4) == train  # seeded
    for bad in (1, 10):
        with pytest.raises(ValueError):
            chain_problems(5, seed=0, steps=bad)
    with pytest.raises(ValueError, match="only"):
        chain_problems(8101, seed=0, steps=4)


def test_sft_rows_mix_the_shortcut_at_its_rate_and_shortcut_stats_count_it():
    problems = chain_problems(200, seed=0, steps=3)
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


def test_length_data_is_written_disjoint_and_of_one_length(tmp_path):
    train_path, eval_path = prepare_data(tmp_path, 5)
    train = [line for line in train_path.read_text().splitlines() if line]
    held_out = [line for line in eval_path.read_text().splitlines() if line]
    assert len(train) == N_TRAIN_PER_K and len(held_out) == 256
    assert not set(train) & set(held_out)
    assert all('*5="' in line for line in train + held_out)
    assert problems(5)[0][:3] == problems(5)[0][:3] and problems(3)[0][0]["prompt"].endswith("*3=")
