"""HH pairwise judge (GeoAlign arXiv 2606.26917 App. B.2): verdict parsing, the swap/tie rule, bootstrap CIs, and
end-to-end runs against a deterministic OpenAI-compatible stand-in server on 127.0.0.1."""

import email.utils
import itertools
import json
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo.eval import judge
from openrlhf_geo.rewards import armorm

# ----------------------------------------------------------------------------------------------- verdict parsing


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"overall_winner": "model_a", "model_a_score": 0.8, "model_b_score": 0.3}', ("model_a", 0.8, 0.3)),
        (
            '```json\n{"overall_winner": "model_b",\n "model_a_score": 0.2, "model_b_score": 0.9}\n```',
            ("model_b", 0.2, 0.9),
        ),
        ("{“overall_winner”: “Model B”, “model_a_score”: 0.1, “model_b_score”: 0.7}", ("model_b", 0.1, 0.7)),
        (
            'Both are fine.\n{"overall_winner": "TIE", "model_a_score": "0.5", "model_b_score": "0.5"} Done.',
            ("tie", 0.5, 0.5),
        ),
        ("{'overall_winner': 'A', 'model_a_score': 1, 'model_b_score': 0}", ("model_a", 1.0, 0.0)),
        (
            '<think>maybe {"overall_winner": "model_a", "model_a_score": 0.9, "model_b_score": 0.1}</think>'
            '{"overall_winner": "model_b", "model_a_score": 0.4, "model_b_score": 0.6}',
            ("model_b", 0.4, 0.6),
        ),
        ("**overall_winner**: Model A\n**model_a_score**: 0.75\n**model_b_score**: 0.25", ("model_a", 0.75, 0.25)),
        ('{"overall_winner": "response_b", "model_a_score": 0.3, "model_b_score": 0.35}', ("model_b", 0.3, 0.35)),
    ],
)
def test_parse_verdict_tolerates_formatting(text, expected):
    verdict = judge.parse_verdict(text)
    assert (verdict.winner, verdict.model_a_score, verdict.model_b_score) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "overall_winner"),
        ('{"overall_winner": "model_a", "model_a_score": 0.8}', "model_b_score"),
        ('{"overall_winner": "model_c", "model_a_score": 0.8, "model_b_score": 0.1}', "model_c"),
        ('{"overall_winner": "model_a", "model_a_score": 8, "model_b_score": 3}', r"outside \[0, 1\]"),
        ('{"overall_winner": "model_a", "model_a_score": "high", "model_b_score": 0.1}', "not a number"),
    ],
)
def test_parse_verdict_rejects_answers_without_a_verdict(text, message):
    with pytest.raises(ValueError, match=message):
        judge.parse_verdict(text)


def test_score_conflict_flags_a_winner_without_the_higher_score():
    assert judge.Verdict("model_a", 0.4, 0.6).score_conflict
    assert judge.Verdict("model_b", 0.5, 0.5).score_conflict
    assert not judge.Verdict("model_a", 0.6, 0.4).score_conflict and not judge.Verdict("tie", 0.3, 0.6).score_conflict


# ------------------------------------------------------------------------------------------------- the tie rule


def test_swap_rule_win_needs_both_orders_and_contradictions_tie():
    # App. B.2: contradictory swapped decisions are a tie; a decisive verdict plus a tie is a tie too (documented).
    expected = {(1, 1): "win", (-1, -1): "loss", (1, -1): "tie", (-1, 1): "tie", (0, 0): "tie"}
    expected |= {(1, 0): "tie", (0, 1): "tie", (-1, 0): "tie", (0, -1): "tie"}
    for (first, second), outcome in expected.items():
        assert judge.combine(first, second) == outcome


@settings(max_examples=30)
@given(st.lists(st.sampled_from([-1, 0, 1]), min_size=2, max_size=2))
def test_swapping_candidate_and_baseline_mirrors_the_outcome(prefers):
    mirror = {"win": "loss", "loss": "win", "tie": "tie"}
    assert judge.combine(*(-p for p in prefers)) == mirror[judge.combine(*prefers)]


# ------------------------------------------------------------------------------------------------- bootstrap CI


def test_bootstrap_mean_matches_the_exact_bootstrap_distribution():
    values = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # per-prompt win indicators
    resamples = values[np.array(list(itertools.product(range(6), repeat=6)))].mean(1)  # all 6^6 resamples
    low, high = np.percentile(resamples, [2.5, 97.5])
    stat = judge.bootstrap_mean(values, n_resamples=20000, seed=0)
    assert stat["value"] == pytest.approx(4 / 6) and stat["n"] == 6
    assert stat["low"] == pytest.approx(low, abs=0.04) and stat["high"] == pytest.approx(high, abs=0.04)


def test_bootstrap_mean_degenerate_cases():
    assert judge.bootstrap_mean([1.0, 1.0, 1.0]) == {"value": 1.0, "low": 1.0, "high": 1.0, "n": 3}
    one = judge.bootstrap_mean([0.3])
    assert one["value"] == 0.3 and np.isnan(one["low"]) and np.isnan(one["high"])
    assert np.isnan(judge.bootstrap_mean([])["value"])


# ------------------------------------------------------------------------------------------ the stand-in server

_RESPONSE = re.compile(r"\[Model ([AB]) response\]\nquality=(\d+)")
_FORMATS = [
    '{{"overall_winner": "{w}", "model_a_score": {a}, "model_b_score": {b}}}',
    '```json\n{{"overall_winner": "{w}", "model_a_score": {a}, "model_b_score": {b}}}\n```',
    "Verdict follows.\n{{“overall_winner”: “{w}”, “model_a_score”: {a}, “model_b_score”: {b}}}",
    '<think>compare</think>{{"overall_winner": "{w}", "model_a_score": "{a}", "model_b_score": "{b}"}}',
]


HANG_S = 120  # longer than any test waits for a judge run: a request that "never" gets its answer


class StandIn:
    """A deterministic judge behind /v1/chat/completions. Responses read "quality=<q> ..."; ``policy``:

    quality: the higher quality wins (tie if equal); first: always model_a (pure position bias);
    biased: model_a unless model_b is better by >= 3 (position bias on top of quality).
    """

    def __init__(self):
        self.policy, self.key, self.delay = "quality", None, 0.0
        self.fail_first = self.slow_first = self.requests = self.inflight = self.max_inflight = 0
        self.garbage_for, self.refuse_after = set(), None
        self.truncate_first = 0  # these first requests get a body cut short: Content-Length 1000, 6 bytes, close
        self.retry_after = None  # (requests, Retry-After value): the first requests get HTTP 429 with it
        self.hang_after = None  # requests after this many get no answer for HANG_S
        self.lock = threading.Lock()

    def answer(self, user):
        q = {label: int(v) for label, v in _RESPONSE.findall(user)}
        if self.policy == "quality":
            winner = "tie" if q["A"] == q["B"] else ("model_a" if q["A"] > q["B"] else "model_b")
            a, b = q["A"] / 10, q["B"] / 10
        elif self.policy == "first":
            winner, a, b = "model_a", 0.9, 0.1
        else:
            winner = "model_b" if q["B"] - q["A"] >= 3 else "model_a"
            a, b = (0.9, 0.1) if winner == "model_a" else (0.1, 0.9)
        if any(marker in user for marker in self.garbage_for):
            return "I prefer the first one."
        return _FORMATS[self.requests % len(_FORMATS)].format(w=winner, a=a, b=b)


@pytest.fixture
def server():
    state = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, payload, headers=()):
            body = json.dumps(payload).encode()
            self.send_response(code)
            for header in headers:
                self.send_header(*header)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests += 1
                number = state.requests
                state.inflight += 1
                state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                reply = self._reply(body, number)
            finally:  # before the reply goes out: once it has it, the client may send its next request at once
                with state.lock:
                    state.inflight -= 1
            if number <= state.truncate_first:
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b'{"choi')
                self.close_connection = True
                return
            self._send(*reply)

        def _reply(self, body, number):
            """(status, payload, headers) of one request."""
            if self.path != "/v1/chat/completions" or body["messages"][0]["content"] != judge.JUDGE_INSTRUCTION:
                return 404, {"error": "unexpected request"}
            if state.key and self.headers.get("Authorization") != f"Bearer {state.key}":
                return 401, {"error": "bad key"}
            if state.refuse_after is not None and number > state.refuse_after:
                return 403, {"error": "quota exceeded"}
            if number <= state.fail_first:
                return 503, {"error": "overloaded"}, [("Retry-After", "0")]
            if state.retry_after is not None and number <= state.retry_after[0]:
                return 429, {"error": "rate limited"}, [("Retry-After", state.retry_after[1])]
            if state.hang_after is not None and number > state.hang_after:
                time.sleep(HANG_S)
            time.sleep(1.0 if number <= state.slow_first else state.delay)
            content = state.answer(body["messages"][1]["content"])
            return 200, {"choices": [{"message": {"role": "assistant", "content": content}}]}

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.handle_error = lambda request, address: None  # a client that timed out closed its socket
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    yield state
    httpd.shutdown()
    httpd.server_close()


CANDIDATE_Q = [5, 6, 7, 8, 5, 9, 2, 3]
BASELINE_Q = [4, 4, 4, 4, 5, 4, 6, 1]  # differences +1 +2 +3 +4 0 +5 -4 +2


def _prompt(i):
    return f"\n\nHuman: question number {i}?\n\nAssistant:"


def _write(path, qualities, order=None, extra=None):
    order = order or range(len(qualities))
    rows = [{"prompt": _prompt(i), "response": f" quality={qualities[i]} answer {i}<|im_end|>"} for i in order]
    rows += extra or []
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    # The baseline file lists the prompts in another order: records are matched by prompt.
    cand = _write(tmp_path / "cand.jsonl", CANDIDATE_Q)
    base = _write(tmp_path / "base.jsonl", BASELINE_Q, order=[7, 3, 0, 1, 2, 6, 5, 4])
    return cand, base, tmp_path / "out"


def _argv(server, files, *extra):
    cand, base, out = files
    return [
        *("--judge.url", server.url, "--judge.model", "stand-in", "--candidates", str(cand), "--baseline", str(base)),
        *("--out", str(out), "--n-resamples", "999", "--judge.backoff", "0.01", *extra),
    ]


def _results(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_end_to_end_rates_scores_and_per_prompt_records(server, files):
    assert judge.main(_argv(server, files)) == 0
    out = files[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_prompts"] == summary["n_judged"] == 8 and summary["n_failed"] == 0
    assert summary["win_rate"]["value"] == pytest.approx(6 / 8)
    assert summary["tie_rate"]["value"] == pytest.approx(1 / 8) and summary["loss_rate"]["value"] == pytest.approx(
        1 / 8
    )
    assert summary["win_rate"]["low"] < 6 / 8 < summary["win_rate"]["high"]
    # Average score: the judge scores quality/10 in both orders.
    assert summary["candidate_score"]["value"] == pytest.approx(np.mean(CANDIDATE_Q) / 10)
    assert summary["baseline_score"]["value"] == pytest.approx(np.mean(BASELINE_Q) / 10)
    assert summary["metrics"]["judge/win_rate"] == pytest.approx(0.75) and server.requests == 16
    records = {r["key"]: r for r in _results(out)}
    assert len(records) == 8
    for i, (c, b) in enumerate(zip(CANDIDATE_Q, BASELINE_Q)):
        record = records[_prompt(i)]
        assert record["outcome"] == ("win" if c > b else "loss" if c < b else "tie")
        assert [j["candidate_as"] for j in record["judgments"]] == ["model_a", "model_b"]
        assert record["candidate"] == f"quality={c} answer {i}"  # end-of-turn marker stripped


def test_position_swap_cancels_a_position_biased_judge(server, files):
    server.policy = "first"
    assert judge.main(_argv(server, files)) == 0
    summary = json.loads((files[2] / "summary.json").read_text())
    # Asked once with the candidate first, this judge would report a 100 % win rate.
    assert all(r["judgments"][0]["winner"] == "model_a" for r in _results(files[2]))
    assert summary["tie_rate"]["value"] == 1.0 and summary["win_rate"]["value"] == 0.0
    assert summary["model_a_win_fraction"] == 1.0


def test_position_bias_on_top_of_quality_only_turns_wins_into_ties(server, files):
    server.policy = "biased"  # model_a unless model_b is better by >= 3
    assert judge.main(_argv(server, files)) == 0
    outcomes = {r["key"]: r["outcome"] for r in _results(files[2])}
    for i, (c, b) in enumerate(zip(CANDIDATE_Q, BASELINE_Q)):
        assert outcomes[_prompt(i)] == ("win" if c - b >= 3 else "loss" if b - c >= 3 else "tie")


def test_retries_transient_errors_and_timeouts_and_bounds_concurrency(server, files):
    server.fail_first, server.delay = 3, 0.05
    assert judge.main(_argv(server, files, "--judge.concurrency", "3")) == 0
    assert server.requests == 16 + 3 and 2 <= server.max_inflight <= 3
    server.fail_first, server.slow_first, server.requests = 0, 1, 0
    out = files[2]
    (out / "results.jsonl").unlink()
    argv = _argv(server, files, "--judge.concurrency", "1", "--judge.timeout", "0.3")
    assert judge.main(argv) == 0 and server.requests == 17  # the timed-out request was asked again


def test_a_response_cut_short_is_retried_and_one_that_stays_cut_is_one_line(server, files, capsys):
    server.truncate_first = 3  # Content-Length 1000, then 6 bytes and a close: http.client.IncompleteRead
    assert judge.main(_argv(server, files, "--judge.concurrency", "1")) == 0
    assert server.requests == 16 + 3
    capsys.readouterr()
    server.truncate_first, server.requests = 10**6, 0
    (files[2] / "results.jsonl").unlink()
    assert judge.main(_argv(server, files, "--judge.max_retries", "1")) == 2
    line = _error(capsys, after_start=True)
    assert "no answer after 2 attempts" in line and "IncompleteRead" in line


def test_a_server_asking_for_a_long_wait_is_given_up_on_in_one_line(server, files, capsys, monkeypatch):
    waits = []
    # nothing here may wait for real (time.sleep is patched for all: the stand-in's own sleeps of 0 s are skipped)
    monkeypatch.setattr(judge.time, "sleep", lambda seconds: seconds and waits.append(seconds))
    server.retry_after = (10**6, "100000")
    assert judge.main(_argv(server, files, "--judge.concurrency", "1")) == 2
    line = _error(capsys, after_start=True)
    assert "Retry-After" in line and "100000" in line and "--judge.max_retry_wait 60" in line
    assert not waits  # the default cap gives up at once, without sleeping
    # a wait under the cap is honoured; an HTTP date is understood too; exponential backoff is capped as well
    server.retry_after, server.requests = (2, "3"), 0
    assert judge.main(_argv(server, files, "--judge.concurrency", "1", "--judge.max_retry_wait", "5")) == 0
    assert len(waits) == 2 and all(1.5 <= w <= 3 for w in waits) and server.requests == 16 + 2
    (files[2] / "results.jsonl").unlink()
    waits.clear()
    server.fail_first, server.retry_after, server.requests = 4, None, 0
    argv = _argv(server, files, "--judge.concurrency", "1", "--judge.backoff", "10", "--judge.max_retry_wait", "4")
    assert judge.main(argv) == 0 and len(waits) == 4 and max(waits) <= 4
    client = judge.ChatClient("http://x", "m", backoff=0.5, max_retry_wait=60)
    assert client.retry_wait(0, "Wed, 21 Oct 2015 07:28:00 GMT") == 0.5  # a date in the past: the backoff
    assert client.retry_wait(0, email.utils.formatdate(time.time() + 3600, usegmt=True)) is None
    assert client.retry_wait(0, "soon") == 0.5 and client.retry_wait(9) == 60  # unreadable: ignored; capped


def test_unparseable_verdicts_are_recorded_and_judged_again_on_rerun(server, files, capsys):
    server.garbage_for = {"answer 4"}  # this judge never gives a verdict for prompt 4
    assert judge.main(_argv(server, files, "--judge.parse_retries", "1")) == 1
    assert "1 prompts got no parseable verdict" in capsys.readouterr().err
    failed = [r for r in _results(files[2]) if r["outcome"] is None]
    assert len(failed) == 1 and failed[0]["key"] == _prompt(4) and "overall_winner" in failed[0]["error"]
    server.garbage_for, server.requests = set(), 0
    assert judge.main(_argv(server, files)) == 0
    assert server.requests == 2  # only prompt 4, both orders
    assert json.loads((files[2] / "summary.json").read_text())["tie_rate"]["value"] == pytest.approx(1 / 8)


def test_results_are_written_as_they_finish_and_a_refusal_stops_the_run(server, files, capsys):
    server.refuse_after = 4  # two prompts (four requests), then HTTP 403
    assert judge.main(_argv(server, files, "--judge.concurrency", "1")) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "HTTP 403" in err and "Traceback" not in err
    assert [r["outcome"] for r in _results(files[2])] == ["win", "win"]


def test_api_key_is_sent_from_the_named_environment_variable(server, files, monkeypatch, capsys):
    server.key = "sekrit"
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    assert judge.main(_argv(server, files, "--judge.api_key_env", "JUDGE_KEY")) == 2
    assert "--judge.api_key_env JUDGE_KEY" in capsys.readouterr().err
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    assert judge.main(_argv(server, files, "--judge.api_key_env", "JUDGE_KEY")) == 2
    assert "HTTP 401" in capsys.readouterr().err
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    assert judge.main(_argv(server, files, "--judge.api_key_env", "JUDGE_KEY")) == 0


def _error(capsys, after_start=False):
    """The one error line on stderr (`after_start`: after the "judging N prompts" line)."""
    err = capsys.readouterr().err.strip().splitlines()[1 if after_start else 0 :]
    assert len(err) == 1 and err[0].startswith("openrlhf-geo judge: error:"), err
    return err[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--judge.url", "127.0.0.1:8000/v1"], "--judge.url 127.0.0.1:8000/v1: expected an http:// or https://"),
        (["--n-resamples", "1"], "--n-resamples must be >= 40 at --confidence 0.95 (got 1)"),
        (["--out", "FILE"], "is a file: give a directory"),
    ],
    ids=["url-without-scheme", "one-resample", "out-is-a-file"],
)
def test_bad_flags_are_one_line_before_any_request(server, files, capsys, flags, message):
    """A URL without a scheme was retried 6 times over 45 s, --n-resamples 1 gave a zero-width CI, an --out that is a
    file a FileExistsError traceback."""
    (files[2].parent / "FILE").write_text("mine\n")
    flags = [str(files[2].parent / "FILE") if flag == "FILE" else flag for flag in flags]
    assert judge.main([*_argv(server, files), *flags]) == 2
    assert message in _error(capsys)
    assert server.requests == 0 and (files[2].parent / "FILE").read_text() == "mine\n"


def test_ctrl_c_is_one_line_exit_130_and_keeps_whole_result_lines(server, files):
    """Ctrl-C waited out the requests in flight (85 s), then printed a traceback."""
    server.hang_after = 4  # two prompts are judged, then the judge stops answering
    argv = [*_argv(server, files), "--judge.concurrency", "1", "--judge.timeout", str(2 * HANG_S)]
    process = subprocess.Popen([sys.executable, "-m", "openrlhf_geo.cli", "judge", *argv], stderr=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        results = files[2] / "results.jsonl"
        for _ in range(600):  # until both prompts are written (a guard, not a timing)
            if results.exists() and results.read_text().count("\n") == 2 and server.inflight == 1:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=HANG_S / 2)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"openrlhf-geo judge: interrupted; the verdicts in {results} are kept: rerun with the same --out to judge "
        "the rest"
    )
    assert [r["outcome"] for r in _results(files[2])] == ["win", "win"] and not (files[2] / "summary.json").exists()


def test_mismatched_inputs_are_clear_errors(server, tmp_path, capsys):
    out = tmp_path / "out"
    cand = _write(tmp_path / "c.jsonl", CANDIDATE_Q)
    base = _write(tmp_path / "b.jsonl", BASELINE_Q[:7])
    assert judge.main(_argv(server, (cand, base, out))) == 2
    assert "1 only in --candidates, 0 only in --baseline" in _error(capsys)
    dup = _write(tmp_path / "d.jsonl", BASELINE_Q, extra=[{"prompt": _prompt(2), "response": "again"}])
    assert judge.main(_argv(server, (cand, dup, out))) == 2
    assert "d.jsonl:9" in (line := _error(capsys)) and "repeats line 3" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p"}) + "\n")
    assert judge.main(_argv(server, (cand, bad, out))) == 2
    assert "--baseline" in (line := _error(capsys)) and "bad.jsonl:1" in line and "'response'" in line
    assert judge.main(_argv(server, (cand, tmp_path / "none.jsonl", out))) == 2
    assert "no such file" in _error(capsys).lower()
    # Matching by id: the prompts behind one id must agree.
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"id": 1, "prompt": "p", "response": "r"}) + "\n")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": 1, "prompt": "q", "response": "r"}) + "\n")
    assert judge.main(_argv(server, (ids, other, out), "--match-key", "id")) == 2
    assert "different prompts" in _error(capsys)
    assert server.requests == 0


def test_rerun_refuses_results_of_other_responses_or_another_judge(server, files, tmp_path, capsys):
    assert judge.main(_argv(server, files)) == 0
    capsys.readouterr()
    changed = _write(tmp_path / "cand2.jsonl", [q + 1 for q in CANDIDATE_Q])
    assert judge.main(_argv(server, (changed, *files[1:]))) == 2
    assert "judged other responses" in _error(capsys)
    argv = _argv(server, files)
    argv[argv.index("stand-in")] = "other-judge"
    assert judge.main(argv) == 2
    assert "'stand-in'" in _error(capsys)
    # A crash mid-write leaves a truncated last line: dropped, and that prompt judged again.
    results = files[2] / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:30])
    server.requests = 0
    assert judge.main(_argv(server, files)) == 0 and server.requests == 2
    assert "truncated last line" in capsys.readouterr().err


def test_proxy_reward_scores_both_sets_with_armorm(server, files, monkeypatch):
    seen = []

    class FakeScorer:  # ArmoRM's interface: conversations -> (B,) scores
        truncated = 0

        def __init__(self, model_path, batch_size, flag):
            assert (model_path, batch_size, flag) == ("armorm-path", 8, "--proxy-rm")

        def __call__(self, conversations):
            import torch

            seen.extend(conversations)
            return torch.tensor([float(c[-1]["content"].split()[0].split("=")[1]) for c in conversations])

    monkeypatch.setattr(armorm, "ArmoRMScorer", FakeScorer)
    assert judge.main(_argv(server, files, "--proxy-rm", "armorm-path")) == 0
    proxy = json.loads((files[2] / "summary.json").read_text())["proxy_reward"]
    assert proxy["candidate"] == pytest.approx(np.mean(CANDIDATE_Q))
    assert proxy["baseline"] == pytest.approx(np.mean(BASELINE_Q))
    assert proxy["gain"] == pytest.approx(np.mean(CANDIDATE_Q) - np.mean(BASELINE_Q)) and proxy["n"] == 8
    assert seen[0] == [
        {"role": "user", "content": "question number 0?"},
        {"role": "assistant", "content": "quality=5 answer 0"},
    ]
