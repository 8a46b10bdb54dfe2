"""ArmoRM (RLHFlow/ArmoRM-Llama3-8B-v0.1) rewards, scored the way its model card does.

ArmoRM is a Llama-3 backbone with 19 regression heads mixed by a prompt-conditioned gating network; its remote code
returns the preference score as ``output.score``. OpenRLHF's value-head loader reads a single linear head instead
and mis-scores it. Here: ``AutoModelForSequenceClassification`` with ``trust_remote_code=True``, the RM's own
chat template over ``[user, assistant]`` messages, ``output.score``.

ArmoRM's remote code imports ``LLAMA_INPUTS_DOCSTRING``, which transformers 5 removed; loading restores that
constant (an empty docstring) first, so the unmodified checkpoint loads on transformers 5.15.

Batching is exact: ArmoRM scores the token before the first ``config.pad_token_id``, so batches are RIGHT-padded
with that id (causal attention leaves real tokens untouched) and equal one-at-a-time scoring.

Two ways to use it with upstream OpenRLHF 0.11.2 (``--reward.remote_url``):

* HTTP (recommended; the RM gets its own GPU): ``openrlhf-geo serve-rm --model PATH --port 5000`` then
  ``--reward.remote_url http://HOST:5000/get_reward``. Concurrent requests are merged into batches. The server
  listens on 127.0.0.1 unless ``--host`` says otherwise (``--host 0.0.0.0`` for trainers on other nodes; then
  also set ``--auth-token``, which upstream's client sends when the URL carries it:
  ``http://:TOKEN@HOST:5000/get_reward``; without one, such a host needs ``--allow-unauthenticated``). Past
  ``--max-pending`` requests (or ``--max-pending-bytes`` of bodies) in flight it answers 503 with Retry-After.
* reward-function file, loaded inside every vLLM engine actor (budget its GPU memory next to vLLM's):
  ``--reward.remote_url $(python -c "import openrlhf_geo.rewards.armorm as m; print(m.__file__)")`` with
  OPENRLHF_GEO_ARMORM_MODEL (path or hub id, required), OPENRLHF_GEO_ARMORM_DEVICE (default cuda if available),
  OPENRLHF_GEO_ARMORM_DTYPE (bf16 | fp16 | fp32) and OPENRLHF_GEO_ARMORM_BATCH_SIZE in the Ray job's env_vars.

Upstream sends ``query`` = decoded prompt + response (the POLICY's chat template) and ``prompts``; the policy's
template is parsed back into messages (ChatML, Llama-3 headers, ``Human:``/``Assistant:``, else one user turn) and
re-rendered with ArmoRM's own template.
"""

import argparse
import base64
import binascii
import contextlib
import copy
import hmac
import ipaddress
import json
import logging
import os
import queue
import re
import socket
import sys
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openrlhf_geo.rewards import split_query

logger = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ENV_MODEL, ENV_DEVICE = "OPENRLHF_GEO_ARMORM_MODEL", "OPENRLHF_GEO_ARMORM_DEVICE"
ENV_DTYPE, ENV_BATCH_SIZE = "OPENRLHF_GEO_ARMORM_DTYPE", "OPENRLHF_GEO_ARMORM_BATCH_SIZE"
ENV_AUTH_TOKEN = "OPENRLHF_GEO_RM_AUTH_TOKEN"
# serve-rm limits (flags override them). Upstream's rollouts send one query per request; a 64k-token query is
# ~0.3 MB of JSON, so these leave room for batch clients while bounding what one request can make the server hold.
MAX_BODY_BYTES = 64 * 2**20  # larger request bodies get 413 before being read
MAX_QUERIES = 4096  # more conversations in one request get 413
# Longest query (or prompt) in characters; longer ones get 413 before tokenizing (a 60 MiB query took the server to
# 21 GB). ArmoRM keeps --max-length (8192) tokens, ~32k characters, so this leaves 30x room for text whose head is
# cut off anyway; tokenizing encodes only the end (TAIL_*), so a query at the cap costs what an 8192-token one does
# (0.5 s on a 2-core CPU with the test stand-in) and the cap bounds only the linear parsing before it.
MAX_QUERY_CHARS = 2**20
# Backpressure: requests admitted at once (reading their body, parsed, queued or being scored) and the total of
# their Content-Lengths; a request past either gets 503 with Retry-After before its body is read, rather than
# more threads and memory. Upstream keeps one request per rollout sample in flight (thousands) and retries a
# failed one 5 times, 1 s apart, ignoring Retry-After, then drops that sample's reward: the count leaves room for
# that; the bytes bound what bodies and their parsed text (a few times the bytes) hold, about 1 GB.
MAX_PENDING = 4096
MAX_PENDING_BYTES = 256 * 2**20
RETRY_AFTER_S = 1
# ArmoRMScorer.tokenize encodes only a text's end: this many characters per kept token first (Llama-3 averages ~4
# on English), this many tokens beyond max_length (against a cut through a word), and the first HEAD_CHARS
# characters for the first token (ArmoRM's template starts with the BOS special token).
TAIL_CHARS_PER_TOKEN, TAIL_MARGIN, HEAD_CHARS = 8, 64, 1024
READ_TIMEOUT_S = 30.0  # a request's headers and body must arrive within this, or the connection is dropped
LINGER_S = 1.0  # after an early refusal, how long unread body bytes are drained so the client sees the reply
# End-of-turn markers a policy's decoded response may end with (skip_special_tokens=False upstream).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>")
_CHATML = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?=<\|im_end\|>|<\|im_start\|>|\Z)", re.S)
_LLAMA3 = re.compile(
    r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)(?=<\|eot_id\|>|<\|start_header_id\|>|\Z)", re.S
)
_HH = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")
_WORD_START = re.compile(r"(?<=\S) ")  # where a tokenizing window may start (ArmoRMScorer.tokenize)


def parse_chat(text):
    """Messages ``[{"role", "content"}]`` of a chat-formatted text.

    Recognizes ChatML (``<|im_start|>role``), Llama-3 headers and HH-RLHF's ``\\n\\nHuman: / \\n\\nAssistant:``;
    any other text is one user turn. Contents are stripped; a trailing empty assistant turn (the generation
    prompt) is dropped.
    """
    if "<|im_start|>" in text:
        messages = [{"role": r, "content": c} for r, c in _CHATML.findall(text)]
    elif "<|start_header_id|>" in text:
        messages = [{"role": r, "content": c} for r, c in _LLAMA3.findall(text)]
    elif _HH.search(text):
        parts = _HH.split(text)  # [preamble, role, content, role, content, ...]
        roles = {"Human": "user", "Assistant": "assistant"}
        messages = [{"role": roles[r], "content": c} for r, c in zip(parts[1::2], parts[2::2])]
    else:
        messages = [{"role": "user", "content": text}]
    messages = [{"role": m["role"], "content": m["content"].strip()} for m in messages]
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


def clean_response(response):
    """The response without trailing end-of-turn markers and surrounding whitespace."""
    response = response.strip()
    while response.endswith(END_MARKERS):
        response = response[: -len(next(m for m in END_MARKERS if response.endswith(m)))].rstrip()
    return response


def conversation_from_query(query, prompt=None):
    """[user, assistant] messages from upstream's (query, prompt): the prompt's turns plus the response.

    Without ``prompt`` the whole query is parsed and must end with an assistant turn. A prompt that ends inside
    an assistant turn (prefilled text) gets the response appended to that turn.
    """
    if prompt is None:
        messages = parse_chat(query)
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("a query without its prompt must end with an assistant turn; send `prompts` as well")
        messages[-1]["content"] = clean_response(messages[-1]["content"])
        return messages
    messages = parse_chat(prompt)
    response = clean_response(split_query(query, prompt))
    if messages and messages[-1]["role"] == "assistant":
        messages[-1]["content"] = (messages[-1]["content"] + " " + response).strip()
    else:
        messages.append({"role": "assistant", "content": response})
    return messages


def _install_transformers5_shim():
    # ArmoRM's modeling_custom.py imports LLAMA_INPUTS_DOCSTRING, which transformers 5 removed; it only feeds a
    # docstring decorator, so an empty string restores the import.
    import transformers.models.llama.modeling_llama as llama

    if not hasattr(llama, "LLAMA_INPUTS_DOCSTRING"):
        llama.LLAMA_INPUTS_DOCSTRING = ""


class ArmoRMScorer:
    """``scorer(conversations) -> (B,) float32`` preference scores (``output.score``), batched exactly.

    Args:
        model_path: local directory or hub id of ArmoRM (or a model with the same remote-code interface).
        device: torch device (default: cuda if available, else cpu).
        dtype: ``bf16`` | ``fp16`` | ``fp32`` (default bf16 on GPU, fp32 on CPU).
        batch_size: sequences per forward.
        max_length: longer conversations keep their first token (BOS) and their last ``max_length - 1`` tokens,
            so the response end that is scored survives; counted in ``self.truncated``. Only a window of the
            text's end is encoded (``tokenize``), so time and memory per conversation follow ``max_length``, not
            the text's length, and no conversation becomes a Python list of more than ``max_length + TAIL_MARGIN``
            tokens.
        flag: what names `model_path` in errors (a missing local path, an unreachable hub: `check_model_source`).
    """

    def __init__(self, model_path, device=None, dtype=None, batch_size=8, max_length=8192, flag="model_path"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from openrlhf_geo.options import check_model_source

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (got {max_length})")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
        check_model_source(flag, str(model_path))  # a typo or an unreachable hub: at once, not minutes later
        _install_transformers5_shim()
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, trust_remote_code=True, dtype=getattr(torch, DTYPES[dtype])
        )
        self.model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=True)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{model_path}: the tokenizer has no chat template; ArmoRM scores chat-formatted text")
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.truncated = 0
        self._tail_tokenizer = copy.deepcopy(self.tokenizer)  # truncates on the left: keeps the scored end
        self._tail_tokenizer.truncation_side = "left"

    def tokenize(self, conversations):
        """Token ids (lists) of each conversation rendered with the RM's chat template (as the model card does),
        truncated to the first token and the last ``max_length - 1`` (see the class docstring).

        Only a window of each text's end is encoded: a fast tokenizer encodes its whole input before truncating
        and keeps the cut-off tokens as overflow encodings (one per ``max_length`` tokens), so a 2^20-character
        query took 10 s and 1.5 GB here (8 s and 1 GB of it the first token's encoding, ``max_length=1``: one
        overflow per token). The window starts at TAIL_CHARS_PER_TOKEN characters per kept token and widens 4x
        while it holds fewer than ``max_length + TAIL_MARGIN`` tokens. It starts at a space after a non-space,
        where the pre-tokenizers of byte-level BPE (Llama-3's regex) and SentencePiece (Metaspace) always split,
        so its tokens are the whole text's from there on (a cut through a run of digits, which Llama-3 groups by
        three from the run's start, would regroup all of it); in a text without such a space the margin keeps the
        tokens next to the cut out of the kept ones. The first token comes from the text's first HEAD_CHARS.
        """
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
        # the template already has BOS; more than max_length tokens tells a truncated text from a full one
        keep = self.max_length + TAIL_MARGIN
        tails, todo, width = [None] * len(texts), list(range(len(texts))), self.max_length * TAIL_CHARS_PER_TOKEN
        while todo:
            windows = []
            for i in todo:
                cut = max(0, len(texts[i]) - width)
                start = _WORD_START.search(texts[i], cut) if cut else None
                windows.append(texts[i][start.start() if start else cut :])
            encoded = self._tail_tokenizer(windows, add_special_tokens=False, truncation=True, max_length=keep)
            widen = []
            for i, seq in zip(todo, encoded["input_ids"]):
                if len(seq) < keep and len(texts[i]) > width:  # too few tokens in a cut window: widen it
                    widen.append(i)
                else:
                    tails[i] = seq
            todo, width = widen, 4 * width
        out = []
        for text, seq in zip(texts, tails):
            if len(seq) > self.max_length:
                self.truncated += 1
                head = self.tokenizer(text[:HEAD_CHARS], add_special_tokens=False, truncation=True, max_length=1)
                seq = head["input_ids"] + seq[len(seq) - self.max_length + 1 :]
            out.append(seq)
        return out

    def __call__(self, conversations):
        import torch

        ids = self.tokenize(conversations)
        pad = self.model.config.pad_token_id
        # The model finds each row's end by its first pad token: without one, it can only score one row at a time.
        batch_size = self.batch_size if pad is not None else 1
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
        scores = torch.empty(len(ids), dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                width = max(len(ids[i]) for i in rows)
                input_ids = torch.full((len(rows), width), pad if pad is not None else 0, dtype=torch.long)
                attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
                for r, i in enumerate(rows):  # right padding
                    input_ids[r, : len(ids[i])] = torch.tensor(ids[i])
                    attention_mask[r, : len(ids[i])] = 1
                output = self.model(input_ids.to(self.device), attention_mask=attention_mask.to(self.device))
                scores[rows] = output.score.float().reshape(len(rows)).cpu()
        return scores


class BatchingScorer:
    """Merges concurrent ``submit`` calls (HTTP requests, reward-function threads) into one scoring call.

    A daemon thread takes the first waiting request, gathers more for up to ``max_wait_s`` or until
    ``max_batch`` conversations, scores them together and resolves each request's Future.
    ``calls`` / ``conversations`` count scoring calls and conversations scored (batching = conversations/calls).
    """

    def __init__(self, scorer, max_batch=64, max_wait_s=0.01):
        self.scorer, self.max_batch, self.max_wait_s = scorer, max_batch, max_wait_s
        self.calls = self.conversations = 0
        self._queue = queue.Queue()
        threading.Thread(target=self._loop, name="armorm-batcher", daemon=True).start()

    def submit(self, conversations):
        """Future of the (B,) scores of ``conversations``."""
        future = Future()
        self._queue.put((list(conversations), future))
        return future

    def _loop(self):
        while True:
            pending = [self._queue.get()]
            size, deadline = len(pending[0][0]), time.monotonic() + self.max_wait_s
            while size < self.max_batch:
                try:
                    pending.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
                size += len(pending[-1][0])
            merged = [c for conversations, _ in pending for c in conversations]
            try:
                scores = self.scorer(merged) if merged else []
            except Exception as error:  # every waiting request learns why
                for _, future in pending:
                    future.set_exception(error)
                continue
            self.calls, self.conversations = self.calls + 1, self.conversations + len(merged)
            at = 0
            for conversations, future in pending:
                future.set_result(scores[at : at + len(conversations)])
                at += len(conversations)


def _conversations_from_payload(payload, max_queries=MAX_QUERIES, max_query_chars=MAX_QUERY_CHARS):
    """Conversations of an upstream request ``{"query": [...], "prompts": [...], "labels": [...]}``.

    Raises ValueError (the server's 400) for a malformed request and OverflowError (413) for more than
    ``max_queries`` queries or a query or prompt longer than ``max_query_chars`` characters.
    """
    if not isinstance(payload, dict):
        raise ValueError(f'request JSON must be an object with a "query" list (got a {type(payload).__name__})')
    queries, prompts = payload.get("query"), payload.get("prompts")
    if isinstance(queries, str):
        queries = [queries]
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('request JSON needs "query": a list of strings')
    if not queries:
        raise ValueError('"query" is empty: send at least one query')
    if len(queries) > max_queries:
        raise OverflowError(f'"query" has {len(queries)} entries, more than this server accepts ({max_queries})')
    for name, texts in (("query", queries), ("prompt", prompts if isinstance(prompts, list) else [])):
        for i, text in enumerate(texts):
            if isinstance(text, str) and len(text) > max_query_chars:
                raise OverflowError(
                    f"{name} {i} has {len(text)} characters, more than this server accepts per query "
                    f"({max_query_chars}; serve-rm --max-query-chars)"
                )
    if prompts is None:
        return [conversation_from_query(q) for q in queries]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError('"prompts" must be a list of strings')
    if len(prompts) != len(queries):
        raise ValueError(f'"prompts" ({len(prompts)}) and "query" ({len(queries)}) differ in length')
    return [conversation_from_query(q, p) for q, p in zip(queries, prompts)]


def _token_matches(header, token):
    """Whether an Authorization header carries ``token``: ``Bearer TOKEN``, or Basic with TOKEN as the password
    (what aiohttp, upstream's client, sends for a ``http://:TOKEN@host`` URL)."""
    scheme, _, value = (header or "").partition(" ")
    if scheme.lower() == "basic":
        try:
            value = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


class _Handler(BaseHTTPRequestHandler):
    """One connection of ``make_server``'s server; the batcher and limits are ``self.server``'s (``_Server``)."""

    def setup(self):
        # Per socket operation (bounds writes to a client that stops reading); longer than the read deadline
        # below, so reads end at that deadline, with a 408 reply, rather than at a silent per-read timeout.
        self.timeout = 2 * self.server.read_timeout
        super().setup()
        # A client that trickles its headers/body, or sends fewer bytes than its Content-Length, would hold
        # this thread; at the deadline reading stops (reads see end-of-file) and the request fails fast.
        self.expired = False
        self.deadline = threading.Timer(self.server.read_timeout, self._stop_reading)
        self.deadline.start()

    def _stop_reading(self):
        self.expired = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RD)

    def finish(self):
        self.deadline.cancel()
        super().finish()

    def _reply(self, code, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")  # aiohttp's response.json() requires it
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, code, message, headers=()):
        """Reply before reading the body, then close: unread bytes would turn the close into a reset that
        can hide the reply from the client, so drain them for up to LINGER_S first."""
        self.close_connection = True
        self._reply(code, {"error": message}, [("Connection", "close"), *headers])
        self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            stop = time.monotonic() + LINGER_S
            while time.monotonic() < stop and self.connection.recv(65536):
                pass

    def do_GET(self):
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path.rstrip("/") in ("", "/get_reward"):
            self._reply(405, {"error": f"{self.path} takes POST"}, [("Allow", "POST")])
        else:
            self._reply(404, {"error": f"unknown path {self.path}; POST /get_reward"})

    def do_POST(self):
        server = self.server
        length = self._content_length()
        if length is None:
            return
        if not server.admit(length):
            self._refuse(
                503,
                f"server busy ({server.max_pending} requests or {server.max_pending_bytes} body bytes in flight)"
                "; retry",
                [("Retry-After", str(RETRY_AFTER_S))],
            )
            return
        try:  # every admitted request is released, whichever way it ends
            conversations = self._read_conversations(length)  # the body is gone: only these wait for scoring
            if conversations is None:
                return
            try:
                scores = server.batcher.submit(conversations).result().tolist()
            except Exception as error:
                logger.exception("scoring failed")
                self._reply(500, {"error": f"{type(error).__name__}: {error}"})
                return
            self._reply(200, {"rewards": scores, "scores": scores, "extra_logs": {}})
        finally:
            server.release(length)

    def _content_length(self):
        """The request's Content-Length once its headers pass every check before the body; None once refused."""
        server = self.server
        if self.expired:  # the headers were cut off by the deadline
            self._refuse(408, f"request headers not received within {server.read_timeout:g} s")
            return None
        if self.path.rstrip("/") not in ("", "/get_reward"):
            self._refuse(404, f"unknown path {self.path}; POST /get_reward")
            return None
        if server.auth_token is not None and not _token_matches(self.headers.get("Authorization"), server.auth_token):
            self._refuse(
                401, "missing or wrong token: send 'Authorization: Bearer TOKEN'", [("WWW-Authenticate", "Bearer")]
            )
            return None
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self._refuse(411 if length is None else 400, f"need a valid Content-Length header (got {length!r})")
            return None
        if int(length) > server.max_body_bytes:
            self._refuse(413, f"request body of {length} bytes exceeds this server's {server.max_body_bytes}")
            return None
        return int(length)

    def _read_conversations(self, length):
        """The conversations of a ``length``-byte body; None once answered with an error (408, 413, 400)."""
        body = bytearray()
        with contextlib.suppress(TimeoutError):  # a stalled read; the deadline ends a trickling one
            while len(body) < length and (chunk := self.rfile.read1(length - len(body))):
                body += chunk
        self.deadline.cancel()
        if len(body) < length:
            self._refuse(408, f"got {len(body)} of {length} body bytes within {self.server.read_timeout:g} s")
            return None
        try:
            return _conversations_from_payload(json.loads(body), self.server.max_queries, self.server.max_query_chars)
        except OverflowError as error:
            self._reply(413, {"error": str(error)})
        except ValueError as error:  # bad JSON or UTF-8, or a malformed request
            self._reply(400, {"error": str(error)})
        return None

    def log_message(self, format, *args):
        logger.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    """``make_server``'s server: the batcher and limits its ``_Handler``s read, and the admitted requests' count."""

    daemon_threads = True
    request_queue_size = 1024  # upstream fires one request per rollout at once; the default backlog (5) drops them

    def __init__(
        self,
        address,
        batcher,
        *,
        max_body_bytes,
        max_queries,
        max_query_chars,
        read_timeout,
        auth_token,
        max_pending,
        max_pending_bytes,
    ):
        super().__init__(address, _Handler)
        self.batcher, self.auth_token, self.read_timeout = batcher, auth_token, read_timeout
        self.max_body_bytes, self.max_queries, self.max_query_chars = max_body_bytes, max_queries, max_query_chars
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.busy_refusals = 0
        self._pending_requests = self._pending_bytes = 0
        self._warned = 0.0
        self._pending_lock = threading.Lock()

    def admit(self, length):
        """Whether one more request with a ``length``-byte body fits the pending budget; if so it counts as
        pending until ``release(length)``, else it counts in ``busy_refusals``."""
        with self._pending_lock:
            if self._pending_requests < self.max_pending and self._pending_bytes + length <= self.max_pending_bytes:
                self._pending_requests, self._pending_bytes = self._pending_requests + 1, self._pending_bytes + length
                return True
            self.busy_refusals += 1
            warn = time.monotonic() - self._warned > 10  # at most one log line per 10 s of refusals
            self._warned = time.monotonic() if warn else self._warned
        if warn:
            logger.warning("busy: refusing requests with 503 (%d so far)", self.busy_refusals)
        return False

    def release(self, length):
        with self._pending_lock:
            self._pending_requests, self._pending_bytes = self._pending_requests - 1, self._pending_bytes - length

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], ConnectionError):  # the client hung up mid-reply: routine, no traceback
            logger.debug("client %s disconnected", client_address)
            return
        super().handle_error(request, client_address)


def make_server(
    batcher,
    host="127.0.0.1",
    port=5000,
    *,
    max_body_bytes=MAX_BODY_BYTES,
    max_queries=MAX_QUERIES,
    max_query_chars=MAX_QUERY_CHARS,
    read_timeout=READ_TIMEOUT_S,
    auth_token=None,
    max_pending=MAX_PENDING,
    max_pending_bytes=MAX_PENDING_BYTES,
):
    """HTTP server speaking upstream's remote-RM protocol (``openrlhf.utils.agent``'s HTTP client).

    ``POST /get_reward`` (or ``/``) with ``{"query": [...], "prompts": [...], "labels": [...]}`` →
    ``{"rewards": [...], "scores": [...], "extra_logs": {}}``; ``GET /health`` → ``{"status": "ok"}`` (no token).
    Errors are JSON ``{"error": ...}``: 400 malformed request (bad JSON, empty or ill-typed ``query``), 401 missing
    or wrong token (when ``auth_token`` is set), 405 with ``Allow: POST`` for a GET of ``/get_reward``, 408
    headers/body not received within ``read_timeout`` seconds (or fewer body bytes than Content-Length), 411 no
    Content-Length, 413 body over ``max_body_bytes``, more than ``max_queries`` queries or a query or prompt over
    ``max_query_chars`` characters, 500 scoring failed, 503 with ``Retry-After`` when ``max_pending`` requests (or
    ``max_pending_bytes`` of their bodies) are already admitted (``server.busy_refusals`` counts them).
    Port 0 picks a free port (``server.server_address[1]``). Run with ``server.serve_forever()``.

    Why the standard library rather than upstream's FastAPI/uvicorn: neither is a dependency of this package's
    base install (they come with vllm), the hardening needed here (a hard per-request read deadline, body/batch
    caps, a token, backpressure) is a few lines on ``ThreadingHTTPServer``, and one thread per connection suits
    a server whose work happens in the batcher thread anyway. Measured side by side over the same batcher
    (benchmarks/serve_rm_load.py, benchmarks/README.md): the scoring sets the pace, and with it removed this
    server answered as many requests per second at 8-64 connections, on about twice the CPU per request.
    """
    for name, value in (
        ("max_body_bytes", max_body_bytes),
        ("max_queries", max_queries),
        ("max_query_chars", max_query_chars),
        ("max_pending", max_pending),
        ("max_pending_bytes", max_pending_bytes),
    ):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    if max_pending_bytes < max_body_bytes:
        raise ValueError(f"max_pending_bytes ({max_pending_bytes}) must be >= max_body_bytes ({max_body_bytes})")
    if not read_timeout > 0:
        raise ValueError(f"read_timeout must be > 0 seconds (got {read_timeout!r})")
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token must be a non-empty string or None")
    return _Server(
        (host, port),
        batcher,
        max_body_bytes=max_body_bytes,
        max_queries=max_queries,
        max_query_chars=max_query_chars,
        read_timeout=read_timeout,
        auth_token=auth_token,
        max_pending=max_pending,
        max_pending_bytes=max_pending_bytes,
    )


_default = None
_default_lock = threading.Lock()


def reward_func(queries, prompts, labels):
    """OpenRLHF 0.11.2 ``--reward.remote_url file.py`` entry point: ``{"rewards", "scores", "extra_logs"}``.

    Scores (B,) float32 ArmoRM preference scores; ``labels`` are ignored. The model (OPENRLHF_GEO_ARMORM_*
    environment variables) loads on the first call; concurrent calls share batches.
    """
    global _default
    if __name__ != "openrlhf_geo.rewards.armorm":  # loaded by path under another name: share the package's model
        from openrlhf_geo.rewards.armorm import reward_func as package_reward_func

        return package_reward_func(queries, prompts, labels)
    with _default_lock:
        if _default is None:
            model = os.environ.get(ENV_MODEL)
            if not model:
                raise ValueError(f"set {ENV_MODEL} to ArmoRM's path or hub id to use the ArmoRM reward function")
            batch_size = os.environ.get(ENV_BATCH_SIZE, "8")
            if not batch_size.isdigit():
                raise ValueError(f"{ENV_BATCH_SIZE} must be a positive integer (got {batch_size!r})")
            scorer = ArmoRMScorer(
                model,
                device=os.environ.get(ENV_DEVICE),
                dtype=os.environ.get(ENV_DTYPE),
                batch_size=int(batch_size),
                flag=ENV_MODEL,
            )
            _default = BatchingScorer(scorer, max_batch=scorer.batch_size)
    conversations = [conversation_from_query(q, p) for q, p in zip(queries, prompts)]
    scores = _default.submit(conversations).result()
    return {"rewards": scores, "scores": scores, "extra_logs": {}}


def _is_loopback(host):
    """Whether ``host`` (an address or name) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


def main(argv=None):
    """``openrlhf-geo serve-rm --model PATH [--port 5000] ...``: serve ArmoRM scores for ``--reward.remote_url``."""
    parser = argparse.ArgumentParser(prog="openrlhf-geo serve-rm", description=main.__doc__)
    parser.add_argument("--model", required=True, help="ArmoRM path or hub id (RLHFlow/ArmoRM-Llama3-8B-v0.1)")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines (set --auth-token)")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
    parser.add_argument("--max-length", type=int, default=8192, help="tokens kept per conversation (BOS + tail)")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="how long to gather concurrent requests")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger requests get HTTP 413")
    parser.add_argument("--max-queries", type=int, default=MAX_QUERIES, help="more queries per request get 413")
    parser.add_argument(
        "--max-query-chars", type=int, default=MAX_QUERY_CHARS, help="longer queries or prompts get 413"
    )
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, help="seconds to receive a request")
    parser.add_argument(
        "--max-pending", type=int, default=MAX_PENDING, help="more requests in flight get 503 + Retry-After"
    )
    parser.add_argument(
        "--max-pending-bytes", type=int, default=MAX_PENDING_BYTES, help="more body bytes in flight get 503"
    )
    parser.add_argument(
        "--auth-token",
        "--auth_token",
        default=os.environ.get(ENV_AUTH_TOKEN) or None,
        help=f"require 'Authorization: Bearer TOKEN' (or http://:TOKEN@host URLs); default ${ENV_AUTH_TOKEN}",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a --host other machines reach without --auth-token (anyone there may use the RM)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must lie in [0, 65535] (got {args.port})")
    for flag, value in (
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-queries", args.max_queries),
        ("--max-query-chars", args.max_query_chars),
        ("--max-pending", args.max_pending),
        ("--max-pending-bytes", args.max_pending_bytes),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1 (got {value})")
    if args.max_pending_bytes < args.max_body_bytes:
        parser.error(
            f"--max-pending-bytes ({args.max_pending_bytes}) must be >= --max-body-bytes ({args.max_body_bytes})"
        )
    if not args.read_timeout > 0:
        parser.error(f"--read-timeout must be > 0 seconds (got {args.read_timeout})")
    if args.auth_token is not None and not args.auth_token.strip():
        print("openrlhf-geo serve-rm: error: --auth-token is empty: give a token, or leave the flag out on "
              "127.0.0.1", file=sys.stderr)  # fmt: skip
        return 2
    if not (args.auth_token or args.allow_unauthenticated or _is_loopback(args.host)):
        print(
            f"openrlhf-geo serve-rm: error: --host {args.host} lets other machines score with the RM: set "
            f"--auth-token (or ${ENV_AUTH_TOKEN}), or pass --allow-unauthenticated",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # the port first: a port in use fails before minutes of model loading
        server = make_server(
            None,  # the batcher, once the model is loaded; nothing is served before serve_forever
            args.host,
            args.port,
            max_body_bytes=args.max_body_bytes,
            max_queries=args.max_queries,
            max_query_chars=args.max_query_chars,
            read_timeout=args.read_timeout,
            auth_token=args.auth_token,
            max_pending=args.max_pending,
            max_pending_bytes=args.max_pending_bytes,
        )
    except OSError as error:
        print(f"openrlhf-geo serve-rm: error: --host {args.host} --port {args.port}: {error.strerror or error}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        scorer = ArmoRMScorer(args.model, args.device, args.dtype, args.batch_size, args.max_length, flag="--model")
    except (ValueError, OSError) as error:  # a missing path, an unreachable hub, not a model directory
        server.server_close()
        message = str(error) if isinstance(error, ValueError) else f"--model {args.model}: {error}"
        print(f"openrlhf-geo serve-rm: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    except BaseException:  # Ctrl-C while the model loads: the port is not left bound
        server.server_close()
        raise
    server.batcher = BatchingScorer(scorer, max_batch=4 * args.batch_size, max_wait_s=args.max_wait_ms / 1000)
    logger.info(
        "serving %s on http://%s:%d/get_reward (%s)",
        args.model,
        args.host,
        server.server_address[1],
        "token required" if args.auth_token else "no token",
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
