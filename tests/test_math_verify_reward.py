"""Boxed-answer math-verify reward: a table of real-looking cases, timeouts, threads, upstream's entry point."""

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.rewards import math_verify as mv
from openrlhf_geo.rewards import split_query

LONG_REASONING = "Let me think about this carefully. " * 6000  # ~200k characters before the answer
PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the power tower: hangs without a timeout
MANY_BOXES = 100_000  # the bad-input probe: 100k `\boxed{1}` took about a minute to extract (quadratic scan)

# (response, gold, correct, status)
CASES = [
    # fractions and their spellings
    ("The answer is \\boxed{\\frac{1}{2}}.", "1/2", True, "correct"),
    ("So we get $\\boxed{\\dfrac{1}{2}}$", "\\frac12", True, "correct"),
    ("\\boxed{\\tfrac{3}{4}}", "0.75", True, "correct"),
    ("\\boxed{0.5}", "\\frac{1}{2}", True, "correct"),
    ("\\boxed{\\frac{1}{2}}", "0.5", True, "correct"),
    ("\\boxed{0.333}", "\\frac13", False, "wrong"),
    ("\\boxed{1/3}", "0.3333333", True, "correct"),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True, "correct"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True, "correct"),
    # integers, signs, decimals, separators
    ("Thus \\boxed{42}", "42", True, "correct"),
    ("\\boxed{-3}", "-3", True, "correct"),
    ("\\boxed{-3}", "3", False, "wrong"),
    ("\\boxed{3.0}", "3", True, "correct"),
    ("\\boxed{1,000}", "1000", True, "correct"),
    ("\\boxed{1{,}000}", "1000", True, "correct"),
    ("\\boxed{10^{10}}", "10000000000", True, "correct"),
    ("\\boxed{10}", "12", False, "wrong"),
    # LaTeX spacing and formatting
    ("\\boxed{ 7 }", "7", True, "correct"),
    ("\\boxed {7}", "7", True, "correct"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", True, "correct"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True, "correct"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True, "correct"),
    ("\\boxed{\\mathbf{5}}", "5", True, "correct"),
    # units, text, degrees, currency, percent
    ("\\boxed{5\\text{ cm}}", "5", True, "correct"),
    ("\\boxed{6.0\\,\\text{m/s}}", "6", True, "correct"),
    ("\\boxed{20^\\circ}", "20", True, "correct"),
    ("\\boxed{\\$20}", "20", True, "correct"),
    ("\\boxed{50\\%}", "50", True, "correct"),
    ("\\boxed{50\\%}", "0.5", True, "correct"),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True, "correct"),
    ("\\boxed{x = 5}", "5", True, "correct"),
    # sets, intervals, tuples
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}", True, "correct"),
    ("\\boxed{(1, 2]}", "(1,2]", True, "correct"),
    ("\\boxed{[1,2]}", "(1,2)", False, "wrong"),
    ("\\boxed{[2, 5)}", "x \\in [2,5)", True, "correct"),
    ("\\boxed{2, 3}", "3, 2", True, "correct"),
    # gold given with a box, or with $...$
    ("\\boxed{12}", "The answer is \\boxed{12}", True, "correct"),
    ("\\boxed{\\frac{1}{2}}", "$\\frac{1}{2}$", True, "correct"),
    # no box, empty box, multiple boxes, nesting, truncation
    ("The answer is 42.", "42", False, "no_box"),
    ("", "1", False, "no_box"),
    ("\\boxed{}", "1", False, "wrong"),
    ("First \\boxed{3}, on reflection \\boxed{4}.", "4", True, "correct"),
    ("First \\boxed{4}, on reflection \\boxed{3}.", "4", False, "wrong"),
    ("\\boxed{\\boxed{5}}", "5", True, "correct"),
    ("\\boxed{2} then \\fbox{7}", "7", True, "correct"),
    ("Earlier \\boxed{4}; finally \\boxed{\\frac{4", "4", False, "no_box"),
    ("\\boxedtext{4} is not a box", "4", False, "no_box"),
    (LONG_REASONING + "\\boxed{17}", "17", True, "correct"),
    (LONG_REASONING + "no final answer", "17", False, "no_box"),
    # unusable gold
    ("\\boxed{3}", "", False, "bad_gold"),
    ("\\boxed{3}", "\\boxed{", False, "bad_gold"),
    ("\\boxed{5}", "\\frac{", False, "bad_gold"),  # math-verify parses nothing of it: not a silent "wrong"
    ("\\boxed{10^{}}", "10^{", False, "bad_gold"),
]


@pytest.fixture(scope="module")
def scorer():
    with mv.MathVerifyReward(mode="grpo", timeout=30.0, workers=2) as reward:
        yield reward


def test_case_table_has_at_least_40_real_looking_cases():
    assert len(CASES) >= 40
    assert {status for *_, status in CASES} >= {"correct", "wrong", "no_box", "bad_gold"}


def test_case_table_verdicts(scorer):
    responses, golds, correct, statuses = zip(*CASES)
    got = [(v.correct, v.status) for v in scorer.verdicts(responses, golds)]
    mismatches = [
        (CASES[i][0][-60:], CASES[i][1], got[i]) for i in range(len(CASES)) if got[i] != (correct[i], statuses[i])
    ]
    assert not mismatches


def test_grpo_rewards_one_zero_and_stats_count_statuses(scorer):
    rewards, stats = scorer(["\\boxed{2}", "\\boxed{3}", "no box", "\\boxed{2}"], ["2", "2", "2", ""])
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert (stats["correct"], stats["wrong"], stats["no_box"], stats["bad_gold"], stats["timeout"]) == (1, 1, 1, 1, 0)
    assert stats["accuracy"] == 0.25


def test_an_unparseable_gold_is_a_bad_gold_verdict_with_a_reason(scorer, caplog):
    with caplog.at_level(logging.WARNING, logger=mv.__name__):
        (verdict,) = scorer.verdicts(["\\boxed{5}"], ["\\frac{"])
    assert (verdict.correct, verdict.status, verdict.answer) == (False, "bad_gold", "5")
    assert "cannot parse the gold answer" in verdict.reason and "\\frac{" in verdict.reason
    assert any("bad_gold" in r.getMessage() for r in caplog.records)
    rewards, stats = scorer(["\\boxed{5}", "\\boxed{5}"], ["\\frac{", "5"])
    assert rewards.tolist() == [0.0, 1.0] and stats["bad_gold"] == 1


def test_a_gold_with_python_powers_scores_and_a_pathological_power_is_refused_at_once():
    """`2**3` was bad_gold (math-verify's LaTeX grammar has no `**`), so a correct response scored 0."""
    cases = [
        ("\\boxed{8}", "2**3", True, "correct"),
        ("\\boxed{2**3}", "2**3", True, "correct"),
        ("\\boxed{2^3}", "2**3", True, "correct"),
        ("\\boxed{9}", "2**3", False, "wrong"),
        ("\\boxed{8}", "10^{1000000}", False, "wrong"),  # large, not refused
        ("\\boxed{8}", "9**9**9**9", False, "bad_gold"),
        ("\\boxed{8}", "0**(9**9**9)", False, "bad_gold"),  # the exponent alone is the tower
    ]
    responses, golds, correct, statuses = zip(*cases)
    start = time.perf_counter()
    with mv.MathVerifyReward(timeout=20.0, workers=1) as reward:  # an evaluated tower would run into this
        verdicts = reward.verdicts(responses, golds)
    assert [(v.correct, v.status) for v in verdicts] == list(zip(correct, statuses))
    assert f"'9**9**9**9' holds a power of more than {mv.MAX_POWER_DIGITS} digits" in verdicts[-2].reason
    assert time.perf_counter() - start < 15  # worker start-up included: nothing waited for the timeout


def test_pathological_answer_times_out_and_pool_recovers():
    with mv.MathVerifyReward(timeout=3.0, workers=1) as reward:
        verdicts = reward.verdicts([PATHOLOGICAL, "\\boxed{2}"], ["1", "2"])
    assert [(v.correct, v.status) for v in verdicts] == [(False, "timeout"), (True, "correct")]
    assert verdicts[0].answer == "9^{9^{9^{9}}}"


def test_scoring_from_non_main_threads_matches_main_thread(scorer):
    responses = [f"\\boxed{{{i}}}" for i in range(12)]
    golds = [str(i if i % 3 else i + 1) for i in range(12)]
    expected, _ = scorer(responses, golds)
    results = {}

    def one(i):
        assert threading.current_thread() is not threading.main_thread()
        return scorer([responses[i]], [golds[i]])[0]

    with ThreadPoolExecutor(6) as pool:
        for i, reward in zip(range(12), pool.map(one, range(12))):
            results[i] = reward
    torch.testing.assert_close(torch.cat([results[i] for i in range(12)]), expected)


def _load_like_upstream():
    """What openrlhf.utils.agent.SingleTurnAgentExecutor does with `--reward.remote_url file.py`."""
    spec = importlib.util.spec_from_file_location("reward_func", mv.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


@pytest.fixture
def env_reward(monkeypatch):
    monkeypatch.setenv(mv.ENV_MODE, "dapo")
    monkeypatch.setenv(mv.ENV_TIMEOUT, "30")
    monkeypatch.setenv(mv.ENV_WORKERS, "1")
    monkeypatch.setattr(mv, "_default", None)
    yield
    if mv._default is not None:
        mv._default.close()


def test_upstream_entry_point_called_like_upstream_with_dapo_mode_from_env(env_reward):
    reward_func = _load_like_upstream()
    prompt = "<|im_start|>user\nWhat is 1+1? Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    queries = [prompt + "1+1 = \\boxed{2}<|im_end|>", prompt + "\\boxed{3}<|im_end|>", prompt + "two<|im_end|>"]

    async def fetch():  # upstream: asyncio.to_thread(reward_func, queries[i:i+1], prompts[i:i+1], labels[i:i+1])
        calls = [asyncio.to_thread(reward_func, [q], [prompt], ["2"]) for q in queries]
        return await asyncio.gather(*calls)

    infos = asyncio.run(fetch())
    # upstream: rewards=torch.tensor([info["rewards"]]), scores likewise, extra_logs values .flatten()[0].item()
    rewards = torch.cat([torch.tensor([info["rewards"]]) for info in infos])
    scores = torch.cat([torch.tensor([info["scores"]]) for info in infos])
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0, -1.0]))  # OPENRLHF_GEO_MATH_MODE=dapo
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 0.0]))
    no_box = [info["extra_logs"]["math_verify/no_box"].flatten()[0].item() for info in infos]
    assert no_box == [0.0, 0.0, 1.0]
    assert mv._default is not None and mv._default.mode == "dapo"  # the path-loaded copy delegated to the package


def test_bad_options_raise_naming_the_option(monkeypatch):
    with pytest.raises(ValueError, match="mode"):
        mv.MathVerifyReward(mode="ppo")
    with pytest.raises(ValueError, match="timeout"):
        mv.MathVerifyReward(timeout=0)
    with pytest.raises(ValueError, match="workers"):
        mv.MathVerifyReward(workers=0)
    monkeypatch.setenv(mv.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match=mv.ENV_TIMEOUT):
        mv.reward_from_env()
    with pytest.raises(ValueError, match=r"golds\[1\] is None"):
        mv.MathVerifyReward().verdicts(["\\boxed{1}", "\\boxed{2}"], ["1", None])


# Text without backslashes or braces: any box inside it would be ours.
_plain = st.text(alphabet=st.characters(blacklist_characters="\\{}", blacklist_categories=("Cs",)), max_size=30)


@st.composite
def _balanced(draw, depth=0):
    """LaTeX-ish content with balanced braces, escaped braces and nested boxes."""
    parts = draw(st.lists(_plain, min_size=1, max_size=3))
    out = parts[0]
    for part in parts[1:]:
        kind = draw(st.sampled_from(["group", "escaped", "box", "text"] if depth < 2 else ["escaped", "text"]))
        if kind == "group":
            out += "{" + draw(_balanced(depth + 1)) + "}"
        elif kind == "escaped":
            out += "\\{" + part + "\\}"
        elif kind == "box":
            out += "\\boxed{" + draw(_balanced(depth + 1)) + "}"
        out += part
    return out


@settings(max_examples=100)
@given(_balanced(), _balanced(), _plain)
def test_extract_last_boxed_returns_the_last_top_level_box(earlier, content, tail):
    text = "Reasoning \\boxed{" + earlier + "} more " + "\\boxed{" + content + "}" + tail
    assert mv.extract_last_boxed(text) == content
    assert mv.extract_last_boxed(text[: -len(tail) - 1] if tail else text[:-1]) is None  # unclosed last box


@settings(max_examples=100)
@given(_plain, _plain, st.text(alphabet="ab \n", max_size=400), st.integers(0, 300))
def test_split_query_recovers_the_response(prompt, response, template, cut):
    assert split_query(prompt + response, prompt) == response
    # Upstream left-truncates long prompts: the query starts with a suffix of the prompt (repetitive on purpose).
    long_prompt = "ab " * 40 + template
    cut = min(cut, len(long_prompt) - 16)
    assert split_query(long_prompt[cut:] + "Z" + response, long_prompt) == "Z" + response


def test_split_query_refuses_to_guess():
    with pytest.raises(ValueError, match="cannot locate the prompt"):
        split_query("completely different text", "the prompt")


def _reference_extract_last_boxed(text):
    """Character-by-character reference (the original quadratic scan): the answer extract_last_boxed must give."""
    last, i = None, 0
    while True:
        starts = [(pos, cmd) for cmd in mv.BOX_COMMANDS if (pos := text.find(cmd, i)) >= 0]
        if not starts:
            return last
        pos, cmd = min(starts)
        j = pos + len(cmd)
        while j < len(text) and text[j] in " \t":
            j += 1
        if j >= len(text) or text[j] != "{":
            i = pos + len(cmd)
            continue
        depth, k = 0, j
        while k < len(text):
            if text[k] == "\\":
                k += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                break
            k += 1
        if depth != 0 or k >= len(text):
            return None
        last, i = text[j + 1 : k], k + 1


@settings(max_examples=300)
@given(st.lists(st.sampled_from(["\\boxed", "\\fbox", "\\", "{", "}", " ", "\t", "x", "boxed", "\\{"]), max_size=40))
def test_extract_last_boxed_matches_the_character_by_character_reference(pieces):
    text = "".join(pieces)
    assert mv.extract_last_boxed(text) == _reference_extract_last_boxed(text)


class _CountingPattern:
    """A compiled regex that counts the characters its scans pass over (from where a scan starts to where its match
    ends, or to the end of the text)."""

    def __init__(self, pattern):
        self.pattern, self.chars = pattern, 0

    def search(self, text, pos=0):
        match = self.pattern.search(text, pos)
        self.chars += (match.end() if match else len(text)) - pos
        return match

    def finditer(self, text, pos=0):
        for match in self.pattern.finditer(text, pos):
            self.chars += match.end() - pos
            pos = match.end()
            yield match


@pytest.mark.parametrize("boxes", [MANY_BOXES // 4, MANY_BOXES])
def test_extraction_is_linear_in_the_number_of_boxes(monkeypatch, boxes):
    """Each character is passed over by one regex scan (the quadratic scan rescanned every box's tail: ~16x longer
    for 4x the boxes); counted, not timed."""
    counters = {name: _CountingPattern(getattr(mv, name)) for name in ("_BOX_START", "_BRACE_OR_ESCAPE")}
    for name, counter in counters.items():
        monkeypatch.setattr(mv, name, counter)
    text = "\\boxed{1}" * (boxes - 1) + "\\boxed{2}"
    assert mv.extract_last_boxed(text) == "2" and len(text) < mv.MAX_RESPONSE_CHARS
    # every character once, and each box's opening brace twice (its brace scan starts on it)
    assert sum(counter.chars for counter in counters.values()) <= len(text) + boxes


def test_pathological_batch_returns_within_its_per_item_timeouts():
    """200 items, 5 of them 100k boxes ending in a power tower: those time out, the rest score, nothing waits on
    extraction or on worker restarts outside the per-item timeout. 3 s: a good item took over 1 s on a loaded 2-core CI
    machine (a replacement worker's imports compete for the cores)."""
    timeout, workers = 3.0, 2
    bad = "\\boxed{1}" * MANY_BOXES + PATHOLOGICAL
    responses = [bad if i % 40 == 7 else f"so \\boxed{{{i}}}" for i in range(200)]
    with mv.MathVerifyReward(timeout=timeout, workers=workers) as reward:
        reward.verdicts(["\\boxed{1}"], ["1"])  # start the pool outside the measured time
        start = time.perf_counter()
        verdicts = reward.verdicts(responses, [str(i) for i in range(200)])
        elapsed = time.perf_counter() - start
    statuses = [v.status for v in verdicts]
    assert statuses.count("timeout") == 5 and statuses.count("correct") == 195
    assert all(v.answer == "9^{9^{9^{9}}}" for v in verdicts if v.status == "timeout")
    # 5 timeouts on 2 workers block about 3 timeouts plus background restarts; the quadratic scan took minutes here.
    assert elapsed < 5 * timeout + 40, elapsed


def test_bad_items_get_an_error_verdict_with_a_reason_not_an_exception(scorer, caplog):
    import numpy as np

    too_long = "x" * mv.MAX_RESPONSE_CHARS + "\\boxed{1}"
    responses = [None, 7, b"\\boxed{1}", too_long, "\\boxed{nan}", "\\boxed{nan}", "\\boxed{1}", "\\boxed{1}"]
    golds = ["1", "1", "1", "1", float("nan"), np.float32("nan"), float("inf"), ["1"]]
    with caplog.at_level(logging.WARNING, logger=mv.__name__):
        rewards, stats = scorer(responses, golds)
        verdicts = scorer.verdicts(responses, golds)
    torch.testing.assert_close(rewards, torch.zeros(len(responses)))
    assert [v.status for v in verdicts] == ["error"] * 4 + ["bad_gold"] * 4
    assert stats["error"] == 4 and stats["bad_gold"] == 4 and stats["correct"] == 0
    reasons = [v.reason for v in verdicts]
    assert "NoneType" in reasons[0] and "int" in reasons[1] and "bytes" in reasons[2]
    assert str(mv.MAX_RESPONSE_CHARS) in reasons[3]
    assert "nan" in reasons[4] and "nan" in reasons[5] and "inf" in reasons[6] and "list" in reasons[7]
    assert sum("math-verify item" in r.getMessage() for r in caplog.records) == 2 * len(responses)
    assert scorer.verdicts(["\\boxed{2}"], [2])[0].status == "correct"  # numbers are fine golds


CTRL_C_SCRIPT = """
import sys, time
from openrlhf_geo.rewards.math_verify import MathVerifyReward

scorer = MathVerifyReward(workers=2)
scorer.verdicts(["\\\\boxed{2}"], ["2"])  # the pool is up
try:  # "ready" inside: the test's SIGINT may come as soon as it is printed
    print("ready", flush=True)
    time.sleep(600)
except KeyboardInterrupt:
    print(scorer.verdicts(["\\\\boxed{3}"], ["3"])[0].status, flush=True)  # the workers are still serving
    scorer.close()
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


def test_ctrl_c_reaches_the_caller_not_the_workers(tmp_path):
    """Ctrl-C signals the whole process group: each worker printed a KeyboardInterrupt traceback before `train`'s
    one-line message. The workers ignore SIGINT; the caller reports it and closes them."""
    process = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        assert process.stdout.readline() == "ready\n"
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the caller and its workers
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130 and out == "correct\n", (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and err.splitlines()[-1] == "interrupted", err
