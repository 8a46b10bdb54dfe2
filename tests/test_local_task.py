"""The demo's task: worked solutions are true, rewarded, diverse and tokenize losslessly; the carry-dropping shortcut
is wrong exactly when a carry is needed; carry-only problems; SFT rows mixing both; the tokenizer; the SFT
warm-up."""

import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.lab.task import (
    STRATEGIES,
    addition_problems,
    build_model,
    build_tokenizer,
    needs_carry,
    reference_response,
    sft,
    sft_rows,
    shortcut_solution,
    shortcut_stats,
    uses_shortcut,
    worked_solution,
)
from openrlhf_geo.local.engine import distinct_fraction
from openrlhf_geo.rewards.math_verify import extract_last_boxed

STEP = re.compile(r"(\d+(?:\+\d+)+)=(\d+)")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def check_solution(text, a, b):
    """Independent reading of a worked solution: every equation true, the carry right, the box = a + b."""
    equations = STEP.findall(text)
    assert equations, text
    for lhs, rhs in equations:
        assert sum(int(x) for x in lhs.split("+")) == int(rhs), (lhs, rhs, text)
    carry = re.search(r"carry (\d)", text)
    if carry:
        assert int(carry[1]) == (a % 10 + b % 10) // 10, text
    assert extract_last_boxed(text) == str(a + b), text
    assert text.endswith(f"\\boxed{{{a + b}}}")


@settings(max_examples=300)
@given(st.integers(0, 99), st.integers(0, 99), st.integers(0, 2**32 - 1), st.sampled_from([None, *STRATEGIES]))
def test_worked_solution_steps_are_true_and_box_the_sum(a, b, seed, strategy):
    check_solution(worked_solution(f"{a}+{b}=", random.Random(seed), strategy), a, b)


@settings(max_examples=100)
@given(st.integers(0, 99), st.integers(0, 99), st.integers(0, 2**32 - 1), st.booleans())
def test_solutions_round_trip_through_the_tokenizer_without_unknowns(tokenizer, a, b, seed, flawed):
    draw = shortcut_solution if flawed else worked_solution
    text = draw(f"{a}+{b}=", random.Random(seed))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert len(ids) + 1 <= 48  # + EOS fits the demo's --rollout.max_new_tokens


@settings(max_examples=300)
@given(st.integers(0, 99), st.integers(0, 99), st.integers(0, 2**32 - 1))
def test_shortcut_is_wrong_exactly_when_a_carry_is_needed(a, b, seed):
    """The quick procedure writes the tens-digit sum, then the last digit of the ones sum (string concatenation here),
    so its box is a + b exactly when the ones digits sum to less than 10."""
    text = shortcut_solution(f"{a}+{b}=", random.Random(seed))
    assert uses_shortcut(text) and text.startswith("quick ")
    equations = STEP.findall(text)
    assert len(equations) == 2
    for lhs, rhs in equations:  # each written step is a true equation; the flaw is the dropped carry
        assert sum(int(x) for x in lhs.split("+")) == int(rhs), text
    ones, tens = a % 10 + b % 10, a // 10 + b // 10
    boxed = extract_last_boxed(text)
    assert boxed == str(int(str(tens) + str(ones)[-1]))
    carry = ones >= 10
    assert needs_carry(f"{a}+{b}=") == carry
    assert (boxed == str(a + b)) == (not carry)
    assert not uses_shortcut(worked_solution(f"{a}+{b}=", random.Random(seed)))


def test_carry_only_problems_all_need_a_carry_and_respect_exclusions():
    problems = addition_problems(300, seed=3, carry_only=True)
    assert all(needs_carry(p["prompt"]) for p in problems)
    assert len({p["prompt"] for p in problems}) == 300
    held_out = addition_problems(50, seed=4, exclude={p["prompt"] for p in problems}, carry_only=True)
    assert not {p["prompt"] for p in held_out} & {p["prompt"] for p in problems}
    # 45 of the 100 ones-digit pairs carry: 4500 two-digit problems in all
    assert len(addition_problems(4500, seed=0, carry_only=True)) == 4500
    with pytest.raises(ValueError, match="only 4500 exist.*carry_only"):
        addition_problems(4501, seed=0, carry_only=True)


def test_worked_solutions_of_one_prompt_are_diverse():
    rng = random.Random(0)
    texts = [worked_solution("37+48=", rng) for _ in range(64)]
    assert len(set(texts)) >= 48  # most draws differ, as sampled LLM solutions do
    # the first equation's operands (either order) reveal the strategy: all four are drawn
    firsts = {tuple(sorted(map(int, t.split("=")[0].split("+")))) for t in texts}
    assert firsts == {(30, 40), (7, 8), (37, 40), (30, 48)}


def test_every_strategy_is_drawn_and_named_ones_follow_their_recipe():
    rng = random.Random(1)
    assert re.fullmatch(r"(37\+40|40\+37)=77.*(77\+8|8\+77)=85.*", worked_solution("37+48=", rng, "split_b"))
    assert re.fullmatch(r"(48\+30|30\+48)=78.*(78\+7|7\+78)=85.*", worked_solution("37+48=", rng, "split_a"))
    assert re.fullmatch(r"(7\+8|8\+7)=15.*carry 1.*3\+4\+1=8.*\\boxed\{85\}", worked_solution("37+48=", rng, "digits"))
    tens = worked_solution("37+48=", rng, "tens")
    assert "70" in tens and "15" in tens and re.search(r"(70\+15|15\+70)=85", tens)


def test_worked_solution_handles_one_digit_operands_and_three_digit_sums():
    rng = random.Random(2)
    for prompt, (a, b) in (("0+0=", (0, 0)), ("5+9=", (5, 9)), ("99+99=", (99, 99)), ("9+91=", (9, 91))):
        for strategy in STRATEGIES:
            check_solution(worked_solution(prompt, rng, strategy), a, b)


@pytest.mark.parametrize("prompt", ["37-48=", "37+48", "a+b=", "-3+4=", "1+2+3="])
def test_worked_solution_rejects_prompts_that_are_not_a_plus_b(prompt):
    with pytest.raises(ValueError, match="a\\+b="):
        worked_solution(prompt, random.Random(0))


def test_worked_solution_rejects_unknown_strategy_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown strategy 'carry'.*tens"):
        worked_solution("1+2=", random.Random(0), "carry")


def test_sft_rows_draw_per_prompt_solutions_reproducibly():
    problems = addition_problems(5, seed=0)
    rows = sft_rows(problems, per_prompt=3, seed=7)
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in problems for _ in range(3)]
    for row, problem in zip(rows, [p for p in problems for _ in range(3)]):
        a, b = map(int, problem["prompt"][:-1].split("+"))
        check_solution(row["response"], a, b)
    assert rows == sft_rows(problems, per_prompt=3, seed=7)
    assert rows != sft_rows(problems, per_prompt=3, seed=8)
    with pytest.raises(ValueError, match="per_prompt must be >= 1"):
        sft_rows(problems, per_prompt=0, seed=0)


def test_sft_rows_mix_the_shortcut_at_its_rate_with_the_given_strategies():
    problems = addition_problems(200, seed=0, carry_only=True)
    rows = sft_rows(problems, per_prompt=4, seed=1, strategies=["digits"], shortcut_rate=0.3)
    flawed = [uses_shortcut(r["response"]) for r in rows]
    # 800 Bernoulli(0.3) draws: within 5 standard deviations (sd = 0.016)
    assert abs(sum(flawed) / len(rows) - 0.3) < 5 * (0.3 * 0.7 / len(rows)) ** 0.5
    for row, is_flawed in zip(rows, flawed):
        a, b = map(int, row["prompt"][:-1].split("+"))
        if is_flawed:
            assert extract_last_boxed(row["response"]) != str(a + b)  # every problem here needs a carry
        else:
            check_solution(row["response"], a, b)
            assert "carry" in row["response"]  # the "digits" strategy, the only one allowed
    assert not any(uses_shortcut(r["response"]) for r in sft_rows(problems, 2, seed=1))  # default: no shortcut
    for kwargs, message in (
        ({"shortcut_rate": 1.5}, "shortcut_rate must be in"),
        ({"strategies": ["carry"]}, "strategies must be a non-empty subset"),
        ({"strategies": []}, "strategies must be a non-empty subset"),
    ):
        with pytest.raises(ValueError, match=message):
            sft_rows(problems, 1, seed=0, **kwargs)


def test_shortcut_stats_count_wrong_answers_by_cause():
    responses = ["quick 7+8=15, 3+4=7 \\boxed{75}", " quick 1+2=3 \\boxed{33}", "7+8=15 carry 1 \\boxed{85}", "junk"]
    stats = shortcut_stats(["37+48="] * 4, responses, [0.0, 1.0, 1.0, 0.0])
    assert stats == {"task/rollouts": 4.0, "task/shortcut": 2.0, "task/wrong": 2.0, "task/wrong_shortcut": 1.0}


def test_tokenizer_keeps_old_token_ids_and_isolates_words(tokenizer):
    # the original character vocabulary keeps its ids (saved models / fixtures stay valid)
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>", "0", "\\boxed{", "}"]) == [
        0,
        1,
        2,
        3,
        4,
        19,
        20,
    ]
    ids = tokenizer("7+8=15 carry 1, so \\boxed{85}", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "carry" in tokens and "so" in tokens and "\\boxed{" in tokens
    assert tokenizer.convert_ids_to_tokens(tokenizer("quick 7+8", add_special_tokens=False)["input_ids"])[0] == "quick"
    assert tokenizer("1+2=")["input_ids"][0] == tokenizer.bos_token_id
    assert reference_response("85") == "\\boxed{85}"


def test_distinct_fraction_counts_unique_responses_per_prompt():
    import torch

    responses = ["a", "a", "b", "c", "c", "c"]
    group_ids = torch.tensor([0, 0, 0, 5, 5, 5])
    assert distinct_fraction(responses, group_ids) == pytest.approx((2 / 3 + 1 / 3) / 2)


# ---------------------------------------------------------------- SFT warm-up


def tiny_model(tokenizer, seed=0):
    return build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=seed)


def test_sft_loss_is_cross_entropy_of_response_tokens_and_eos_only(tokenizer):
    """The first SFT loss (before any update) is the mean -log p over response tokens + EOS, from a forward on the
    unpadded sequence alone."""
    model = tiny_model(tokenizer)
    prompt, response = "37+48=", "7+8=15 carry 1, 3+4+1=8 so \\boxed{85}"
    p = tokenizer(prompt)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].double()
    expected = -torch.log_softmax(logits, -1)[torch.arange(len(r)), torch.tensor(r)].mean().item()
    losses = sft(model, tokenizer, [{"prompt": prompt, "response": response}], steps=2, batch_size=1)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[1] < losses[0]  # one AdamW step on the same row lowers its loss


def test_sft_rejects_an_empty_corpus(tokenizer):
    with pytest.raises(ValueError, match="at least one"):
        sft(tiny_model(tokenizer), tokenizer, [], steps=1)


@pytest.mark.parametrize("final_lr_ratio", [None, 0.05])
def test_sft_learning_rate_warms_up_then_stays_or_decays_to_the_final_ratio(tokenizer, monkeypatch, final_lr_ratio):
    recorded = []
    adamw_step = torch.optim.AdamW.step

    def record(self, *args, **kwargs):
        recorded.append(self.param_groups[0]["lr"])
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    rows = [{"prompt": "1+2=", "response": "\\boxed{3}"}]
    lr, warmup, steps = 1e-3, 4, 11
    sft(tiny_model(tokenizer), tokenizer, rows, steps, 1, lr, warmup, final_lr_ratio=final_lr_ratio)
    ramp = np.minimum(1.0, (np.arange(steps) + 1) / warmup)
    if final_lr_ratio is None:
        expected = lr * ramp
    else:  # cos from 0 to pi over steps 0..10: 1 at the first step, the final ratio at the last
        angles = np.linspace(0.0, np.pi, steps)
        expected = lr * ramp * (final_lr_ratio + (1 - final_lr_ratio) * (1 + np.cos(angles)) / 2)
        assert recorded[-1] == pytest.approx(lr * final_lr_ratio)
    assert recorded == pytest.approx(expected.tolist(), rel=1e-12)
    with pytest.raises(ValueError, match="final_lr_ratio must be in"):
        sft(tiny_model(tokenizer), tokenizer, rows, 1, final_lr_ratio=1.5)
