"""ArmoRM (RLHFlow/ArmoRM-Llama3-8B-v0.1) rewards, scored the way its model card does.

ArmoRM is a Llama-3 backbone with 19 regression heads mixed by a prompt-conditioned gating network; its remote code
returns the preference score as ``output.score``. OpenRLHF's value-head loader reads a single linear head instead
and mis-scores it (upstream issue #486). Here: ``AutoModelForSequenceClassification`` with
``trust_remote_code=True``, the RM's own chat template over ``[user, assistant]`` messages, ``output.score``.

ArmoRM's remote code imports ``LLAMA_INPUTS_DOCSTRING``, which transformers 5 removed; loading restores that
constant (an empty docstring) first, so the unmodified checkpoint loads on transformers 5.15.

Batching is exact: ArmoRM scores the token before the first ``config.pad_token_id``, so batches are RIGHT-padded
with that id (causal attention leaves real tokens untouched) and equal one-at-a-time scoring.

Two ways to use it with upstream OpenRLHF 0.11.2 (``--reward.remote_url``):

* HTTP (recommended; the RM gets its own GPU): ``openrlhf-geo serve-rm --model PATH --port 5000`` then
  ``--reward.remote_url http://HOST:5000/get_reward``. Concurrent requests are merged into batches.
* reward-function file, loaded inside every vLLM engine actor (budget its GPU memory next to vLLM's):
  ``--reward.remote_url $(python -c "import openrlhf_geo.rewards.armorm as m; print(m.__file__)")`` with
  OPENRLHF_GEO_ARMORM_MODEL (path or hub id, required), OPENRLHF_GEO_ARMORM_DEVICE (default cuda if available),
  OPENRLHF_GEO_ARMORM_DTYPE (bf16 | fp16 | fp32) and OPENRLHF_GEO_ARMORM_BATCH_SIZE in the Ray job's env_vars.

Upstream sends ``query`` = decoded prompt + response (the POLICY's chat template) and ``prompts``; the policy's
template is parsed back into messages (ChatML, Llama-3 headers, ``Human:``/``Assistant:``, else one user turn) and
re-rendered with ArmoRM's own template.
"""

import argparse
import json
import logging
import os
import queue
import re
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openrlhf_geo.rewards import split_query

logger = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ENV_MODEL, ENV_DEVICE = "OPENRLHF_GEO_ARMORM_MODEL", "OPENRLHF_GEO_ARMORM_DEVICE"
ENV_DTYPE, ENV_BATCH_SIZE = "OPENRLHF_GEO_ARMORM_DTYPE", "OPENRLHF_GEO_ARMORM_BATCH_SIZE"
# End-of-turn markers a policy's decoded response may end with (skip_special_tokens=False upstream).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>")
_CHATML = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?=<\|im_end\|>|<\|im_start\|>|\Z)", re.S)
_LLAMA3 = re.compile(
    r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)(?=<\|eot_id\|>|<\|start_header_id\|>|\Z)", re.S
)
_HH = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")


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
            so the response end that is scored survives; counted in ``self.truncated``.
    """

    def __init__(self, model_path, device=None, dtype=None, batch_size=8, max_length=8192):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (got {max_length})")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
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

    def tokenize(self, conversations):
        """Token ids (lists) of each conversation rendered with the RM's chat template (as the model card does)."""
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # the template already has BOS
        out = []
        for seq in ids:
            if len(seq) > self.max_length:
                self.truncated += 1
                seq = seq[:1] + seq[len(seq) - self.max_length + 1 :]
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


def _conversations_from_payload(payload):
    """Conversations of an upstream request ``{"query": [...], "prompts": [...], "labels": [...]}``."""
    queries = payload.get("query")
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('request JSON needs "query": a list of strings')
    prompts = payload.get("prompts")
    if prompts is None:
        return [conversation_from_query(q) for q in queries]
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) != len(queries):
        raise ValueError(f'"prompts" ({len(prompts)}) and "query" ({len(queries)}) differ in length')
    return [conversation_from_query(q, p) for q, p in zip(queries, prompts)]


def make_server(batcher, host="127.0.0.1", port=5000):
    """HTTP server speaking upstream's remote-RM protocol (``openrlhf.utils.agent``'s HTTP client).

    ``POST /get_reward`` (or ``/``) with ``{"query": [...], "prompts": [...], "labels": [...]}`` →
    ``{"rewards": [...], "scores": [...], "extra_logs": {}}``; ``GET /health`` → ``{"status": "ok"}``.
    Port 0 picks a free port (``server.server_address[1]``). Run with ``server.serve_forever()``.
    """

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")  # aiohttp's response.json() requires it
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": f"unknown path {self.path}; POST /get_reward"})

        def do_POST(self):
            if self.path.rstrip("/") not in ("", "/get_reward"):
                self._reply(404, {"error": f"unknown path {self.path}; POST /get_reward"})
                return
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                conversations = _conversations_from_payload(payload)
            except (ValueError, AttributeError) as error:
                self._reply(400, {"error": str(error)})
                return
            try:
                scores = batcher.submit(conversations).result().tolist()
            except Exception as error:
                logger.exception("scoring failed")
                self._reply(500, {"error": f"{type(error).__name__}: {error}"})
                return
            self._reply(200, {"rewards": scores, "scores": scores, "extra_logs": {}})

        def log_message(self, format, *args):
            logger.debug("%s " + format, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


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
                model, device=os.environ.get(ENV_DEVICE), dtype=os.environ.get(ENV_DTYPE), batch_size=int(batch_size)
            )
            _default = BatchingScorer(scorer, max_batch=scorer.batch_size)
    conversations = [conversation_from_query(q, p) for q, p in zip(queries, prompts)]
    scores = _default.submit(conversations).result()
    return {"rewards": scores, "scores": scores, "extra_logs": {}}


def main(argv=None):
    """``openrlhf-geo serve-rm --model PATH [--port 5000] ...``: serve ArmoRM scores for ``--reward.remote_url``."""
    parser = argparse.ArgumentParser(prog="openrlhf-geo serve-rm", description=main.__doc__)
    parser.add_argument("--model", required=True, help="ArmoRM path or hub id (RLHFlow/ArmoRM-Llama3-8B-v0.1)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
    parser.add_argument("--max-length", type=int, default=8192, help="tokens kept per conversation (BOS + tail)")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="how long to gather concurrent requests")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scorer = ArmoRMScorer(args.model, args.device, args.dtype, args.batch_size, args.max_length)
    batcher = BatchingScorer(scorer, max_batch=4 * args.batch_size, max_wait_s=args.max_wait_ms / 1000)
    server = make_server(batcher, args.host, args.port)
    logger.info("serving %s on http://%s:%d/get_reward", args.model, args.host, server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
