"""ArmoRM reward on a tiny local stand-in with the same remote-code interface: scoring, batching, HTTP, parsing."""

import copy
import importlib.util
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from openrlhf_geo.rewards import armorm

_spec = importlib.util.spec_from_file_location(
    "armorm_standin_build", Path(__file__).parent / "fixtures" / "armorm_standin" / "build.py"
)
_builder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_builder)
build_standin = _builder.build  # the stand-in, shared with the CPU smoke's reward-model condition

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there!"}],
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}],
    [{"role": "user", "content": "tell me a joke"}, {"role": "assistant", "content": "no."}],
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "how do i bake bread at home, step by step?"},
        {"role": "assistant", "content": "mix flour, water, yeast and salt; knead; let it rise; bake at 230 c."},
    ],
    [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2, longer this time"},
        {"role": "assistant", "content": "a2"},
    ],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    [{"role": "user", "content": "why is the sky blue?"}, {"role": "assistant", "content": "rayleigh scattering."}],
]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """A saved tiny model with ArmoRM's loading interface: config.json auto_map -> remote code, chat template."""
    path = tmp_path_factory.mktemp("armorm_standin")
    weights = build_standin(path)
    assert json.loads((path / "config.json").read_text())["auto_map"]
    return path, weights


@pytest.fixture(scope="module")
def scorer(standin):
    return armorm.ArmoRMScorer(str(standin[0]), device="cpu", batch_size=3)


def _model_card_scores(scorer, conversations):
    """The model card's recipe, one conversation at a time: chat template -> input_ids -> model(...).score."""
    out = []
    with torch.no_grad():
        for messages in conversations:
            ids = scorer.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
            out.append(scorer.model(ids["input_ids"]).score.float().item())
    return torch.tensor(out)


def test_scorer_loads_remote_code_and_matches_model_card_scoring(scorer, standin):
    assert type(scorer.model).__name__ == "StandInRewardModel"  # trust_remote_code path, not a value head
    loaded = scorer.model.state_dict()
    assert loaded.keys() == standin[1].keys() and all(torch.equal(loaded[k], v) for k, v in standin[1].items())
    expected = _model_card_scores(scorer, CONVERSATIONS)
    assert expected.std() > 0  # distinct scores, so a row mix-up would show
    torch.testing.assert_close(scorer(CONVERSATIONS), expected, rtol=1e-5, atol=1e-6)


def test_batched_scores_equal_one_at_a_time_in_any_order(scorer):
    one_at_a_time = torch.stack([scorer([c])[0] for c in CONVERSATIONS])
    reversed_batch = scorer(CONVERSATIONS[::-1]).flip(0)
    torch.testing.assert_close(reversed_batch, one_at_a_time, rtol=1e-5, atol=1e-6)


def test_long_conversations_keep_bos_and_tail(standin):
    short = armorm.ArmoRMScorer(str(standin[0]), device="cpu", max_length=24)
    ids = short.tokenize(CONVERSATIONS[3:4])[0]
    full = short.tokenizer.apply_chat_template(CONVERSATIONS[3], tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) == 24 and ids[0] == full[0] and ids[1:] == full[-23:] and short.truncated == 1


QWEN_PROMPT = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHow do I boil an egg?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
LLAMA3_PROMPT = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
HH_PROMPT = "\n\nHuman: Can you help me move?\n\nAssistant: Sure, when?\n\nHuman: Tomorrow.\n\nAssistant:"


@pytest.mark.parametrize(
    "prompt, response, expected",
    [
        (
            QWEN_PROMPT,
            "Put it in boiling water for 9 minutes.<|im_end|>",
            [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "How do I boil an egg?"},
                {"role": "assistant", "content": "Put it in boiling water for 9 minutes."},
            ],
        ),
        (
            LLAMA3_PROMPT,
            "Blue.<|eot_id|>",
            [
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "Blue."},
            ],
        ),
        (
            HH_PROMPT,
            " I can come at noon.</s>",
            [
                {"role": "user", "content": "Can you help me move?"},
                {"role": "assistant", "content": "Sure, when?"},
                {"role": "user", "content": "Tomorrow."},
                {"role": "assistant", "content": "I can come at noon."},
            ],
        ),
        (
            "Write a haiku about rain.\n",
            "Soft rain on the roof<|endoftext|>",
            [
                {"role": "user", "content": "Write a haiku about rain."},
                {"role": "assistant", "content": "Soft rain on the roof"},
            ],
        ),
    ],
    ids=["chatml", "llama3", "hh-rlhf", "plain"],
)
def test_upstream_query_splits_into_prompt_turns_and_response(prompt, response, expected):
    assert armorm.conversation_from_query(prompt + response, prompt) == expected
    if not prompt.startswith("Write"):  # a templated query also parses alone (requests without "prompts")
        assert armorm.conversation_from_query(prompt + response) == expected


def test_query_without_assistant_turn_and_without_prompt_is_rejected():
    with pytest.raises(ValueError, match="send `prompts`"):
        armorm.conversation_from_query("just a user message")


def _post(url, payload):
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"] == "application/json"  # upstream's aiohttp client insists
        return json.loads(response.read())


@pytest.fixture
def server(scorer):
    batcher = armorm.BatchingScorer(scorer, max_batch=16, max_wait_s=0.05)
    server = armorm.make_server(batcher, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", batcher
    server.shutdown()
    server.server_close()


def test_http_round_trip_speaks_upstream_protocol_concurrently(server, scorer):
    url, batcher = server
    prompts = ["<|im_start|>user\n" + c[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n" for c in CONVERSATIONS]
    queries = [p + c[-1]["content"] + "<|im_end|>" for p, c in zip(prompts, CONVERSATIONS)]
    conversations = [armorm.conversation_from_query(q, p) for q, p in zip(queries, prompts)]
    expected = scorer(conversations).tolist()

    def one(i):  # upstream's client: one query per request, many requests in flight
        return _post(url + "/get_reward", {"query": [queries[i]], "prompts": [prompts[i]], "labels": [None]})

    with ThreadPoolExecutor(len(queries)) as pool:
        replies = list(pool.map(one, range(len(queries))))
    for reply, want in zip(replies, expected):
        assert reply["rewards"] == pytest.approx([want], rel=1e-5, abs=1e-6)
        assert reply["scores"] == reply["rewards"] and reply["extra_logs"] == {}
    assert batcher.conversations == len(queries)
    batch = _post(url + "/get_reward", {"query": queries, "prompts": prompts, "labels": [None] * len(queries)})
    assert batch["rewards"] == pytest.approx(expected, rel=1e-5, abs=1e-6)

    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    with pytest.raises(urllib.error.HTTPError) as error:
        _post(url + "/get_reward", {"query": [queries[0]], "prompts": prompts})
    assert error.value.code == 400 and "differ in length" in json.loads(error.value.read())["error"]


def test_batcher_merges_requests_that_arrive_while_scoring():
    calls, release, busy = [], threading.Event(), threading.Event()

    def slow_scorer(conversations):
        calls.append(len(conversations))
        if len(calls) == 1:
            busy.set()
            release.wait(30)
        return torch.arange(len(conversations), dtype=torch.float32)

    batcher = armorm.BatchingScorer(slow_scorer, max_batch=64, max_wait_s=0.0)
    first = batcher.submit([["a"]])
    busy.wait(30)
    later = [batcher.submit([["b"]] * n) for n in (1, 2, 3)]  # queued while the first call runs
    release.set()
    assert first.result(30).tolist() == [0.0]
    assert [f.result(30).tolist() for f in later] == [[0.0], [1.0, 2.0], [3.0, 4.0, 5.0]]
    assert calls == [1, 6] and (batcher.calls, batcher.conversations) == (2, 7)


def test_reward_function_file_loaded_like_upstream(standin, scorer, monkeypatch):
    monkeypatch.setenv(armorm.ENV_MODEL, str(standin[0]))
    monkeypatch.setenv(armorm.ENV_DEVICE, "cpu")
    monkeypatch.setattr(armorm, "_default", None)
    spec = importlib.util.spec_from_file_location("reward_func", armorm.__file__)  # what upstream does
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt = "<|im_start|>user\nwhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    info = module.reward_func([prompt + "rayleigh scattering.<|im_end|>"], [prompt], [None])
    expected = scorer([CONVERSATIONS[-1]])
    torch.testing.assert_close(info["rewards"], expected, rtol=1e-5, atol=1e-6)
    assert torch.tensor([info["rewards"]]).shape == (1,)  # upstream wraps it: torch.tensor([reward])


def test_reward_function_without_model_path_says_which_variable(monkeypatch):
    monkeypatch.delenv(armorm.ENV_MODEL, raising=False)
    monkeypatch.setattr(armorm, "_default", None)
    with pytest.raises(ValueError, match=armorm.ENV_MODEL):
        armorm.reward_func(["q a"], ["q "], [None])


def _fake_scores(conversations):
    return torch.arange(len(conversations), dtype=torch.float32)


@pytest.fixture
def serve():
    """Start a server with a stand-in scorer on 127.0.0.1:<ephemeral>; returns its base URL."""
    servers = []

    def start(**options):
        server = armorm.make_server(armorm.BatchingScorer(_fake_scores, max_wait_s=0.0), "127.0.0.1", 0, **options)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _post_raw(url, body, headers=()):
    """(status, JSON reply) of a POST with a raw body; HTTP errors are returned, not raised."""
    request = urllib.request.Request(url + "/get_reward", body, {"Content-Type": "application/json", **dict(headers)})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


GOOD = json.dumps({"query": ["hi there", "hi you"], "prompts": ["hi ", "hi "]}).encode()


def test_serve_rm_cli_binds_localhost_by_default_and_reads_the_token_from_env(monkeypatch):
    bound = {}

    def record_and_stop(server, *args, **kwargs):
        bound["address"] = server.server_address
        raise KeyboardInterrupt

    monkeypatch.setattr(armorm, "ArmoRMScorer", lambda *args, **kwargs: _fake_scores)
    monkeypatch.setattr(armorm._Server, "serve_forever", record_and_stop)
    monkeypatch.setenv(armorm.ENV_AUTH_TOKEN, "from-env")
    made = []
    real_make_server = armorm.make_server
    monkeypatch.setattr(armorm, "make_server", lambda *a, **k: made.append(k) or real_make_server(*a, **k))
    assert armorm.main(["--model", "unused", "--port", "0", "--read-timeout", "7"]) == 0
    assert bound["address"][0] == "127.0.0.1"
    assert (made[0]["auth_token"], made[0]["read_timeout"]) == ("from-env", 7)
    assert (made[0]["max_body_bytes"], made[0]["max_queries"]) == (armorm.MAX_BODY_BYTES, armorm.MAX_QUERIES)
    assert armorm.main(["--model", "unused", "--port", "0", "--auth_token", "from-flag"]) == 0
    assert made[1]["auth_token"] == "from-flag"
    with pytest.raises(SystemExit):
        armorm.main(["--model", "unused", "--max-queries", "0"])
    assert made[0]["max_query_chars"] == armorm.MAX_QUERY_CHARS


def test_serve_rm_refuses_other_machines_without_a_token_unless_told_to(monkeypatch, capsys):
    """--host 0.0.0.0 without --auth-token started silently; now a one-line error, unless --allow-unauthenticated."""
    made = []

    class Recorded:  # nothing binds: a test server listens on 127.0.0.1 only
        server_address = ("0.0.0.0", 5000)

        def serve_forever(self):
            raise KeyboardInterrupt

        def server_close(self):
            pass

    monkeypatch.setattr(armorm, "ArmoRMScorer", lambda *args, **kwargs: _fake_scores)
    monkeypatch.setattr(armorm, "make_server", lambda *a, **k: made.append((a, k)) or Recorded())
    monkeypatch.delenv(armorm.ENV_AUTH_TOKEN, raising=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "rm.example.org"):
        assert armorm.main(["--model", "unused", "--host", host]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--host {host}" in err[0] and "--allow-unauthenticated" in err[0], err
    assert not made  # refused before the model loads or anything binds
    for host in ("127.0.0.1", "localhost", "::1"):
        assert armorm.main(["--model", "unused", "--host", host]) == 0
    assert armorm.main(["--model", "unused", "--host", "0.0.0.0", "--allow-unauthenticated"]) == 0
    assert armorm.main(["--model", "unused", "--host", "0.0.0.0", "--auth-token", "t"]) == 0
    assert [a[1] for a, _ in made] == ["127.0.0.1", "localhost", "::1", "0.0.0.0", "0.0.0.0"]


def test_a_query_or_prompt_over_the_character_cap_gets_413_before_it_is_tokenized(scorer):
    """One 60 MiB query (under the 64 MiB body cap) drove the server to 21 GB while tokenizing; the character cap
    refuses it first. The real stand-in scorer: without the cap, this query would be scored (200)."""
    server = armorm.make_server(armorm.BatchingScorer(scorer, max_wait_s=0.0), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        long = "a" * armorm.MAX_QUERY_CHARS
        status, reply = _post_raw(url, json.dumps({"query": ["hi " + long], "prompts": ["hi "]}).encode())
        assert status == 413 and f"{armorm.MAX_QUERY_CHARS + 3} characters" in reply["error"]
        assert "query 0" in reply["error"] and "--max-query-chars" in reply["error"]
        status, reply = _post_raw(url, json.dumps({"query": ["hi there"], "prompts": ["hi " + long]}).encode())
        assert status == 413 and "prompt 0" in reply["error"]
        assert _post_raw(url, json.dumps({"query": ["hi " + long[:1000]], "prompts": ["hi "]}).encode())[0] == 200
    finally:
        server.shutdown()
        server.server_close()
    assert armorm.MAX_QUERY_CHARS * 64 <= armorm.MAX_BODY_BYTES  # the body cap alone let a query this long through


def test_a_long_conversation_is_truncated_while_it_is_tokenized(standin):
    """The tokenizer keeps only the tail (and the first token) as it encodes: no Python list of every token."""
    short = armorm.ArmoRMScorer(str(standin[0]), device="cpu", max_length=30)
    calls = []
    real = short.tokenizer.__class__.__call__

    def spy(self, text, **kwargs):
        calls.append(kwargs)
        return real(self, text, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(short.tokenizer.__class__, "__call__", spy)
        ids = short.tokenize([CONVERSATIONS[3], CONVERSATIONS[5]])
    full, whole = (
        short.tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]
        for c in (CONVERSATIONS[3], CONVERSATIONS[5])
    )
    assert ids == [full[:1] + full[-29:], whole] and short.truncated == 1 and len(whole) < 30
    assert calls and all(
        c.get("truncation") is True and c.get("max_length", 10**9) <= 30 + armorm.TAIL_MARGIN for c in calls
    )


def test_oversized_body_and_batch_get_413(serve):
    url = serve(max_body_bytes=len(GOOD) + 10, max_queries=2)
    assert _post_raw(url, GOOD) == (200, {"rewards": [0.0, 1.0], "scores": [0.0, 1.0], "extra_logs": {}})
    status, reply = _post_raw(url, GOOD + b" " * 4096)  # whitespace is valid JSON padding: only the size is wrong
    assert status == 413 and str(len(GOOD) + 10) in reply["error"]
    three = json.dumps({"query": ["hi a", "hi b", "hi c"], "prompts": ["hi "] * 3}).encode()
    assert len(three) <= len(GOOD) + 10
    status, reply = _post_raw(url, three)
    assert status == 413 and "3 entries" in reply["error"]


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"query": [], "prompts": []}', "empty"),
        (b'{"query": ["hi a"', "Expecting"),
        (b'{"query": ["hi \xff"], "prompts": ["hi "]}', "decode"),
        (b"[1, 2]", "object"),
        (b'{"query": ["hi a"], "prompts": [3]}', "prompts"),
        (b'{"query": "hi a", "prompts": ["hi ", "hi "]}', "differ in length"),
    ],
    ids=["empty-query", "truncated-json", "bad-utf8", "json-list", "non-string-prompt", "length-mismatch"],
)
def test_malformed_requests_get_400_not_500(serve, body, message):
    status, reply = _post_raw(serve(), body)
    assert status == 400 and message in reply["error"]


def test_auth_token_bearer_or_url_credentials_else_401(serve):
    import asyncio

    import aiohttp

    url = serve(auth_token="s3cret")
    status, reply = _post_raw(url, GOOD)
    assert status == 401 and "token" in reply["error"]
    assert _post_raw(url, GOOD, {"Authorization": "Bearer wrong"})[0] == 401
    assert _post_raw(url, GOOD, {"Authorization": "Basic !!notbase64"})[0] == 401
    assert _post_raw(url, GOOD, {"Authorization": "Bearer s3cret"})[0] == 200
    with urllib.request.urlopen(url + "/health", timeout=10) as response:  # health checks need no token
        assert response.status == 200

    async def upstream_client(target):  # openrlhf.utils.agent's request, with the token in the URL
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(target, json=json.loads(GOOD)) as response:
                return response.status, await response.json()

    port = url.rsplit(":", 1)[1]
    assert asyncio.run(upstream_client(f"http://:s3cret@127.0.0.1:{port}/get_reward"))[0] == 200
    assert asyncio.run(upstream_client(f"http://127.0.0.1:{port}/get_reward"))[0] == 401


def _read_until_closed(sock):
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_or_lying_clients_are_cut_off_at_the_read_deadline(serve):
    import socket

    url = serve(read_timeout=0.5)
    port = int(url.rsplit(":", 1)[1])
    # Lying client: announces 1000 body bytes, sends 10, then waits for the reply.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as lying:
        lying.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
        reply = _read_until_closed(lying)  # before: the handler thread waited forever for the other 990 bytes
    assert reply.startswith(b"HTTP/1.0 408") and b"got 10 of 1000" in reply
    # Stalled client: the headers never end.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as stalled:
        stalled.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\n")
        reply = _read_until_closed(stalled)
    assert reply.startswith(b"HTTP/1.0 408") and b"headers not received" in reply
    # Trickling client: one header byte every 20 ms never trips a per-read timeout; the request deadline does.
    request = b"POST /get_reward HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * 2000
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        sent = 0
        try:
            for byte in request:
                slow.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.02)
        except OSError:  # the server closed the connection while we were still sending
            pass
    assert sent < len(request)  # cut off well before the 40 s this client would take
    # Meanwhile the server still answers others.
    assert _post_raw(url, GOOD)[0] == 200


def test_tokenizing_a_window_of_the_end_equals_tokenizing_the_whole_text(standin):
    """tokenize encodes only a text's end (widening the window when its tokens are long); the ids are those of
    the whole text: BOS plus its last max_length - 1."""
    short = armorm.ArmoRMScorer(str(standin[0]), device="cpu", max_length=30)
    words = " ".join(f"word{i}" for i in range(400))  # ~3000 characters: the first window (240) is cut
    specials = "<|eot_id|>" * 300 + "end"  # ten characters per token: the window must widen to hold 94 tokens
    conversations = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": c}] for c in (words, specials)
    ]
    for conversation, ids in zip(conversations, short.tokenize(conversations)):
        full = short.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
        assert ids == full[:1] + full[-29:]
    assert short.truncated == 2


# Llama-3's pre-tokenizer split (its tokenizer.json); digits go in groups of up to three from a run's start.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_tokenizing_a_window_equals_the_whole_text_with_a_byte_level_bpe(standin):
    """The window starts where Llama-3-style pre-tokenizers split, so a cut through a digit run (regrouped by
    three from the cut) or a word does not change the kept ids. A small BPE trained here, Llama-3's layout."""
    import random

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    pieces = ["the", "rain", "falls", ",", ".", "12345678", "7" * 200, "\n\n", "  ", "don't", "x" * 40, "(a+b)"]
    texts = ["".join(rng.choice(pieces) + rng.choice([" ", "", "\n"]) for _ in range(600)) for _ in range(12)]
    texts += ["the rain " * 40 + "7" * (1000 + k) + " end" for k in range(3)]  # every cut lands in the digits
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=400, special_tokens=_builder.SPECIALS, initial_alphabet=alphabet)
    )
    bpe = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="[PAD]"
    )
    bpe.chat_template = _builder.LLAMA3_TEMPLATE
    short = armorm.ArmoRMScorer(str(standin[0]), device="cpu", max_length=30)
    short.tokenizer, short._tail_tokenizer = bpe, copy.deepcopy(bpe)
    short._tail_tokenizer.truncation_side = "left"
    conversations = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": t}] for t in texts]
    for conversation, ids in zip(conversations, short.tokenize(conversations)):
        full = bpe.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
        assert ids == full[:1] + full[-29:]


def test_a_query_at_the_character_cap_is_scored_in_bounded_time(scorer):
    """One query of exactly MAX_QUERY_CHARS took 10-23 s and 1-1.5 GB: the tokenizer encoded all of it (the first
    token's encoding, truncated to 1 token, kept one overflow encoding per token). Now only the end is encoded."""
    seen = []
    real = scorer.tokenizer.__class__.__call__

    def spy(self, text, **kwargs):
        seen.append(max(map(len, [text] if isinstance(text, str) else text)))
        return real(self, text, **kwargs)

    server = armorm.make_server(armorm.BatchingScorer(scorer, max_wait_s=0.0), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    query = (prompt + "lorem ipsum " * (armorm.MAX_QUERY_CHARS // 12 + 1))[: armorm.MAX_QUERY_CHARS]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(scorer.tokenizer.__class__, "__call__", spy)
            start = time.monotonic()
            status, reply = _post_raw(
                f"http://127.0.0.1:{server.server_address[1]}",
                json.dumps({"query": [query], "prompts": [prompt]}).encode(),
            )
            elapsed = time.monotonic() - start
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200 and len(reply["rewards"]) == 1
    assert max(seen) <= scorer.max_length * armorm.TAIL_CHARS_PER_TOKEN  # not the 2^20 characters
    assert elapsed < 8  # 0.5 s on a 2-core VM; before, 10 s there and 23 s on a slower one


def test_a_full_server_answers_503_with_retry_after_and_never_hangs():
    """max_pending requests held in scoring: every other client gets 503 + Retry-After at once, without its body
    being read; when scoring resumes the held ones get their scores and the server admits again."""
    release = threading.Event()

    def held_scorer(conversations):
        assert release.wait(30)
        return torch.zeros(len(conversations))

    server = armorm.make_server(
        armorm.BatchingScorer(held_scorer, max_batch=1, max_wait_s=0.0), "127.0.0.1", 0, max_pending=4
    )
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def client(_):
        request = urllib.request.Request(url + "/get_reward", GOOD, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, None
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Retry-After")

    try:
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(client, i) for i in range(32)]
            deadline = time.monotonic() + 30
            while server.busy_refusals < 28 and time.monotonic() < deadline:  # 4 admitted, held by the scorer
                time.sleep(0.01)
            release.set()
            replies = Counter(f.result(30) for f in futures)  # a hang fails here, after 30 s
        assert replies == {(200, None): 4, (503, "1"): 28} and server.busy_refusals == 28
        assert _post_raw(url, GOOD)[0] == 200  # every admitted request's slot was released
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_the_pending_bytes_budget_refuses_with_503_and_must_hold_one_body():
    entered, release = threading.Event(), threading.Event()

    def held_scorer(conversations):
        entered.set()
        assert release.wait(30)
        return torch.zeros(len(conversations))

    server = armorm.make_server(
        armorm.BatchingScorer(held_scorer, max_wait_s=0.0),
        "127.0.0.1",
        0,
        max_body_bytes=len(GOOD),
        max_pending_bytes=len(GOOD) + 10,
    )
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_post_raw, url, GOOD)
            assert entered.wait(30)
            status, reply = _post_raw(url, GOOD)  # one request under max_pending, but its bytes do not fit
            assert status == 503 and "body bytes in flight" in reply["error"]
            release.set()
            assert held.result(30)[0] == 200
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="max_pending_bytes"):
        armorm.make_server(None, "127.0.0.1", 0, max_body_bytes=100, max_pending_bytes=99)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if serve-rm gets as far as loading a model or a tokenizer (a hub id would go to the hub)."""
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("loaded a model despite bad input")

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", forbidden)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", forbidden)


def _serve_rm_fails(capsys, *argv):
    assert armorm.main(["--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openrlhf-geo serve-rm: error: "), err
    return err[0]


def test_serve_rm_a_model_that_cannot_load_is_one_line_at_once(tmp_path, monkeypatch, capsys, no_model_load):
    """`--model sv/nosuch` retried the hub for 79 s, then a traceback; `./sv/nosuch` a traceback at once."""
    from huggingface_hub import constants

    from openrlhf_geo import options

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # an empty hub cache
    assert "./sv/nosuch: no such file or directory" in _serve_rm_fails(capsys, "--model", "./sv/nosuch")
    (tmp_path / "sv").mkdir()  # `sv/nosuch` is then a missing local path, never sent to the hub
    assert "--model sv/nosuch: no such file or directory (read as a local path" in _serve_rm_fails(
        capsys, "--model", "sv/nosuch"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "--model org/nosuch: no such local path, and not in the hub cache (HF_HUB_OFFLINE is set)" in (
        _serve_rm_fails(capsys, "--model", "org/nosuch")
    )
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(address, timeout=None):
        assert timeout == options.HUB_PROBE_S
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(options.socket, "create_connection", unreachable)
    assert "--model org/nosuch: no such local path, not in the hub cache, and the hub" in (
        line := _serve_rm_fails(capsys, "--model", "org/nosuch")
    )
    assert "cannot be reached (Network is unreachable)" in line


def test_serve_rm_a_port_in_use_or_an_empty_token_is_one_line_before_the_model_loads(monkeypatch, capsys):
    loads = []
    monkeypatch.setattr(armorm, "ArmoRMScorer", lambda *args, **kwargs: loads.append(args) or _fake_scores)
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _serve_rm_fails(capsys, "--model", "unused", "--port", str(port))
        assert f"--host 127.0.0.1 --port {port}: Address already in use" in line
    finally:
        taken.close()
    assert "--auth-token is empty" in _serve_rm_fails(capsys, "--model", "unused", "--auth-token", "")
    assert not loads


def test_get_on_the_reward_path_is_405_with_allow_post(serve):
    url = serve()
    for path in ("/get_reward", "/"):
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(url + path, timeout=30)
        assert error.value.code == 405 and error.value.headers["Allow"] == "POST", path
        assert "takes POST" in json.loads(error.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(url + "/nowhere", timeout=30)
    assert error.value.code == 404
