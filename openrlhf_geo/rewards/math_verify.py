"""Boxed-answer math reward scored by the `math-verify` library, safe to call from any thread.

The answer of a response is the content of its LAST top-level ``\\boxed{...}`` (or ``\\fbox{...}``), braces
matched, ``\\{``/``\\}`` skipped. A response without a complete box is incorrect: an unclosed last box (a
truncated response) does not fall back to an earlier one. Gold answers may be given with or without ``\\boxed``.
Equivalence is math-verify's ``parse`` + ``verify`` (fractions, ``\\dfrac``, decimals, percent, units, sets,
intervals, ...); nothing here decides equivalence by hand.

Rewards: mode ``grpo`` gives 1 / 0, mode ``dapo`` gives +1 / -1 (correct / anything else).

Timeouts: math-verify's own timeouts use ``signal.alarm``, which only works in the main thread, while OpenRLHF
calls reward functions from worker threads (``asyncio.to_thread``) inside Ray actors. So the caller does only
bounded, linear work (type checks, the MAX_RESPONSE_CHARS cap, box extraction) and hands ``parse`` + ``verify``
to a small pool of worker processes, waiting at most ``timeout`` seconds per item; a worker that overruns is
killed and replaced in the background (about a second to restart), and the item scores as incorrect with status
``timeout``.

Bad input is a per-item verdict with a ``reason`` (and a logged warning), never an exception for the batch: a
response that is not a string or is longer than MAX_RESPONSE_CHARS is ``error``; a gold answer that is NaN/inf,
neither string nor number, longer than MAX_RESPONSE_CHARS, that math-verify cannot parse into any expression
(``\\frac{``; plain ``2**3`` is read by its expression grammar) or that holds a power of more than
MAX_POWER_DIGITS digits (``9**9**9**9``) is ``bad_gold``, never a silent ``wrong``. A missing gold (None) still raises:
that is a configuration error (``--data.label_key``), not a bad item.

Use with upstream OpenRLHF 0.11.2 (``openrlhf.utils.agent.SingleTurnAgentExecutor`` loads
``reward_func(queries, prompts, labels)`` from the file given to ``--reward.remote_url``)::

    --reward.remote_url $(python -c "import openrlhf_geo.rewards.math_verify as m; print(m.__file__)")
    --data.label_key answer

Options for that path come from environment variables (pass them to Ray workers with
``ray job submit --runtime-env-json '{"env_vars": {...}}'``):

    OPENRLHF_GEO_MATH_MODE     grpo (1/0, default) | dapo (+1/-1)
    OPENRLHF_GEO_MATH_TIMEOUT  seconds per item (default 5)
    OPENRLHF_GEO_MATH_WORKERS  worker processes (default min(8, CPU count))
"""

import logging
import math
import numbers
import os
import queue
import re
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

logger = logging.getLogger(__name__)

MODES = {"grpo": (1.0, 0.0), "dapo": (1.0, -1.0)}
STATUSES = ("correct", "wrong", "no_box", "bad_gold", "timeout", "error")
PROBLEMS = ("no_box", "bad_gold", "timeout", "error")  # the statuses the engines log as math_verify/<status> shares
BOX_COMMANDS = ("\\boxed", "\\fbox")
ENV_MODE, ENV_TIMEOUT, ENV_WORKERS = "OPENRLHF_GEO_MATH_MODE", "OPENRLHF_GEO_MATH_TIMEOUT", "OPENRLHF_GEO_MATH_WORKERS"
# A new worker imports sympy/antlr (about a second); give it this long before declaring the pool broken.
WORKER_START_TIMEOUT = 120.0
# Longest response (and gold) scored, in characters: about 4x a 64k-token generation budget at ~4 characters per
# token. Longer input scores 0 with status error/bad_gold before any parsing; extracting the box of a response this
# long takes milliseconds in the caller.
MAX_RESPONSE_CHARS = 1_000_000
# Largest power a gold answer may hold, in decimal digits: 10^1000000 compares in 0.4 s; 9**9**9**9 (about
# 10^(3.7e8) digits in its exponent alone) would exhaust the memory long before a timeout stops it.
MAX_POWER_DIGITS = 1_000_000
_BOX_START = re.compile("(?:" + "|".join(re.escape(cmd) for cmd in BOX_COMMANDS) + r")[ \t]*\{")
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.S)  # an escape pair (``\{``, ``\\``, ``\frac``...) or a brace


@dataclass(frozen=True)
class Verdict:
    """Outcome for one (response, gold) pair: ``status`` is one of STATUSES; ``answer`` the extracted box content;
    ``reason`` says what was wrong with the input or the worker (None for a plain verdict)."""

    correct: bool
    status: str
    answer: str | None = None
    reason: str | None = None


def extract_last_boxed(text):
    """Content of the last top-level ``\\boxed{...}``/``\\fbox{...}`` in ``text``; None if absent or unclosed.

    Nested boxes count as part of their enclosing box (``\\boxed{\\boxed{5}}`` gives ``\\boxed{5}``). A backslash
    escapes the next character, so ``\\{`` and ``\\}`` do not count as braces. One left-to-right pass: linear in
    ``len(text)`` (each character is looked at by one regex scan).
    """
    last, i = None, 0
    while (start := _BOX_START.search(text, i)) is not None:
        depth = 0
        for token in _BRACE_OR_ESCAPE.finditer(text, start.end() - 1):
            if token.group() == "{":
                depth += 1
            elif token.group() == "}":
                depth -= 1
                if depth == 0:
                    last, i = text[start.end() : token.start()], token.end()
                    break
        else:
            return None  # the last box is unclosed (truncated response): no answer
    return last


def gold_expression(gold):
    """Gold answer as LaTeX: the last box's content if ``gold`` contains one, else ``gold`` without ``$...$``."""
    gold = str(gold).strip()
    if any(cmd in gold for cmd in BOX_COMMANDS):
        gold = (extract_last_boxed(gold) or "").strip()
    while len(gold) >= 2 and gold[0] == gold[-1] == "$" and gold[-2] != "\\":  # math delimiters, not \$
        gold = gold[1:-1].strip()
    return gold


def prepare(response, gold):
    """The bounded, linear part of scoring (run in the caller): a final Verdict, or ``(answer, gold_latex)`` for
    ``verify_answer``. Checks types and the MAX_RESPONSE_CHARS cap before any parsing."""
    if isinstance(gold, numbers.Real) and not math.isfinite(gold):
        return Verdict(False, "bad_gold", reason=f"gold answer is {gold!r}")
    if not isinstance(gold, (str, numbers.Number)):
        return Verdict(False, "bad_gold", reason=f"gold answer is a {type(gold).__name__}, not a string or number")
    gold = str(gold)
    if len(gold) > MAX_RESPONSE_CHARS:
        return Verdict(False, "bad_gold", reason=f"gold answer has {len(gold)} characters > {MAX_RESPONSE_CHARS}")
    if not isinstance(response, str):
        return Verdict(False, "error", reason=f"response is a {type(response).__name__}, not a string")
    if len(response) > MAX_RESPONSE_CHARS:
        return Verdict(False, "error", reason=f"response has {len(response)} characters > {MAX_RESPONSE_CHARS}")
    answer = extract_last_boxed(response)
    if answer is None:
        return Verdict(False, "no_box")
    gold_latex = gold_expression(gold)
    if not gold_latex:
        return Verdict(False, "bad_gold", answer)
    return answer, gold_latex


def _power_digits(expr) -> float:
    """An upper bound on the decimal digits of the largest power in sympy `expr` (0 without one), from the tree
    alone: math-verify leaves powers unevaluated, and `verify` evaluating 9**(9**(9**9)) would fill the memory."""
    largest = 0.0

    def log10_bound(node):  # of |value|, counting numbers and powers; any other node: the sum of its arguments + 1
        nonlocal largest
        if node.is_Rational:
            return math.log10(max(abs(node.p), node.q))
        if node.is_Number:
            value = abs(float(node))
            return math.log10(value) if value > 1 else 0.0
        if node.is_Pow:
            base, exponent = log10_bound(node.base), log10_bound(node.exp)
            bound = 0.0 if base == 0 else base * 10**exponent if exponent < 300 else math.inf
            largest = max(largest, bound)
            return bound
        return sum(log10_bound(arg) for arg in node.args) + 1.0

    log10_bound(expr)
    return largest


def verify_answer(answer, gold_latex):
    """math-verify's verdict on an extracted answer, no timeout of its own (callers bound it). Both sides are
    parsed as ``\\boxed{x}``."""
    from math_verify import ExprExtractionConfig, parse, verify  # only the workers need sympy/antlr (~0.5 s)

    gold_parsed = parse("\\boxed{" + gold_latex + "}", parsing_timeout=None)
    if all(isinstance(item, str) for item in gold_parsed):
        # math-verify's LaTeX grammar has no `**`; its plain-expression one reads `2**3` (unevaluated). Only when
        # it reads the whole gold: it also picks a number out of text (`10^{` gives 10).
        expression = parse(gold_latex, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
        if expression and expression[-1] == gold_latex:
            gold_parsed = expression
    if all(isinstance(item, str) for item in gold_parsed):  # only the raw text came back: the gold holds no math
        return Verdict(False, "bad_gold", answer, f"math-verify cannot parse the gold answer {gold_latex[:200]!r}")
    digits = max(_power_digits(item) for item in gold_parsed if not isinstance(item, str))
    if digits > MAX_POWER_DIGITS:
        return Verdict(
            False,
            "bad_gold",
            answer,
            f"gold answer {gold_latex[:200]!r} holds a power of more than {MAX_POWER_DIGITS} digits "
            f"(bound {digits:.3g})",
        )
    pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    correct = bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None)
    return Verdict(correct, "correct" if correct else "wrong", answer)


def score_answer(response, gold):
    """Verdict for one pair in this thread, no timeout (``prepare`` then ``verify_answer``)."""
    prepared = prepare(response, gold)
    return prepared if isinstance(prepared, Verdict) else verify_answer(*prepared)


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once that its own timeout is off; here the caller enforces the timeout instead.
    def filter(self, record):
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _safe_verify(answer, gold_latex):
    try:
        return verify_answer(answer, gold_latex)
    except Exception as error:  # a sympy/antlr failure on one item must not take down the batch
        return Verdict(False, "error", answer, f"math-verify raised {type(error).__name__}: {error}"[:500])


def _worker_main(read_fd, write_fd):
    """Worker process loop: receive (answer, gold_latex), send a Verdict back; exit when the parent goes away."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    verify_answer("1", "1")  # math-verify builds its parsers lazily; keep that out of the first item's time
    outbox.send("ready")
    while True:
        try:
            item = inbox.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        outbox.send(_safe_verify(*item))


class _Worker:
    """One scoring subprocess speaking over two pipes.

    A plain subprocess rather than multiprocessing: the caller may be a multi-threaded Ray actor (no fork) and
    spawn/forkserver would re-import the caller's ``__main__`` in every worker.
    """

    def __init__(self):
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        # SIGINT ignored first: a Ctrl-C reaches the whole process group, and the caller reports it on one line (a
        # worker would print its own KeyboardInterrupt traceback); a worker exits when its pipe closes
        code = (
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"from openrlhf_geo.rewards.math_verify import _worker_main; _worker_main({from_parent}, {to_parent})"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, env=env
        )
        os.close(from_parent)
        os.close(to_parent)
        self.outbox, self.inbox = Connection(to_child, readable=False), Connection(from_child, writable=False)

    def wait_ready(self):
        if not self.inbox.poll(WORKER_START_TIMEOUT) or self.inbox.recv() != "ready":
            self.kill()
            raise RuntimeError(f"math-verify worker did not start within {WORKER_START_TIMEOUT:.0f} s")
        return self

    def kill(self):
        self.process.kill()
        self.process.wait()
        self.outbox.close()
        self.inbox.close()


def _shutdown(workers):
    for worker in workers:
        worker.kill()


class MathVerifyReward:
    """Batch scorer: ``reward(responses, golds) -> (rewards (B,) float32, stats)``.

    Args:
        mode: ``grpo`` (1/0) or ``dapo`` (+1/-1).
        timeout: seconds allowed per item (measured from hand-off to a worker, queueing excluded); the caller's
            own work per item (checks, box extraction) is linear and capped by MAX_RESPONSE_CHARS.
        workers: worker processes (default min(8, CPU count)); items beyond that queue for a free worker.
    Thread-safe; the pool starts on first use and stops on ``close()``, garbage collection or interpreter exit.
    """

    def __init__(self, mode="grpo", timeout=5.0, workers=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)} (got {mode!r})")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds (got {timeout!r})")
        workers = min(8, os.cpu_count() or 1) if workers is None else workers
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers must be an integer >= 1 (got {workers!r})")
        self.mode, self.timeout, self.workers = mode, float(timeout), workers
        self._lock = threading.Lock()
        self._idle = None  # queue of idle _Worker, created on first use
        self._all = []
        self._threads = None

    def _start(self):
        with self._lock:
            if self._idle is None:
                idle = queue.SimpleQueue()
                self._all = [_Worker() for _ in range(self.workers)]  # start all, then wait: imports overlap
                self._finalizer = weakref.finalize(self, _shutdown, self._all)
                for worker in self._all:
                    idle.put(worker.wait_ready())
                self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="math-verify")
                self._idle = idle

    def _score_in_worker(self, response, gold):
        prepared = prepare(response, gold)
        if isinstance(prepared, Verdict):
            return prepared
        idle = self._idle
        worker = idle.get()
        if isinstance(worker, Exception):  # a replacement failed to start: tell every caller, do not hang
            idle.put(worker)
            raise RuntimeError(f"math-verify worker pool is broken: {worker}") from worker
        try:
            worker.outbox.send(prepared)
            if worker.inbox.poll(self.timeout):
                verdict = worker.inbox.recv()
                idle.put(worker)
                return verdict
            status, reason = "timeout", None
        except (EOFError, OSError) as error:  # the worker died (e.g. out of memory)
            status, reason = "error", f"math-verify worker died ({type(error).__name__})"
        worker.kill()
        # Restart in the background: this item's caller returns now, the next one waits for a free worker.
        threading.Thread(target=self._replace, args=(worker, idle), name="math-verify-restart", daemon=True).start()
        return Verdict(False, status, prepared[0], reason)

    def _replace(self, dead, idle):
        try:
            replacement = _Worker().wait_ready()
        except (RuntimeError, OSError) as error:
            idle.put(error)
            return
        with self._lock:
            if self._idle is not idle:  # the pool was closed meanwhile
                replacement.kill()
                return
            self._all.remove(dead)
            self._all.append(replacement)
        idle.put(replacement)

    def verdicts(self, responses, golds):
        """One Verdict per (response, gold); ``golds`` entries may be strings or numbers, not None. Items with bad
        input (see the module docstring) get a verdict with a ``reason``, logged as a warning."""
        responses, golds = list(responses), list(golds)
        if len(responses) != len(golds):
            raise ValueError(f"responses and golds differ in length ({len(responses)} vs {len(golds)})")
        for i, gold in enumerate(golds):
            if gold is None:
                raise ValueError(
                    f"golds[{i}] is None: every response needs a gold answer (upstream: --data.label_key)"
                )
        self._start()
        if len(responses) == 1:  # upstream's path: one item per call from many threads
            verdicts = [self._score_in_worker(responses[0], golds[0])]
        else:
            verdicts = list(self._threads.map(self._score_in_worker, responses, golds))
        for i, verdict in enumerate(verdicts):
            if verdict.reason is not None:
                logger.warning("math-verify item %d scored %s: %s", i, verdict.status, verdict.reason)
        return verdicts

    def __call__(self, responses, golds):
        """Rewards (B,) float32 (mode's values) and stats: ``accuracy`` plus a count per status in STATUSES."""
        import torch

        verdicts = self.verdicts(responses, golds)
        hit, miss = MODES[self.mode]
        rewards = torch.tensor([hit if v.correct else miss for v in verdicts], dtype=torch.float32)
        stats = {status: float(sum(v.status == status for v in verdicts)) for status in STATUSES}
        stats["accuracy"] = stats["correct"] / max(len(verdicts), 1)
        return rewards, stats

    def reward_func(self, queries, prompts, labels):
        """Upstream 0.11.2 reward-function signature; see the module-level ``reward_func``."""
        import torch

        from openrlhf_geo.rewards import split_query

        responses = [split_query(q, p) for q, p in zip(queries, prompts)]
        verdicts = self.verdicts(responses, labels)
        hit, miss = MODES[self.mode]
        correct = torch.tensor([float(v.correct) for v in verdicts])
        per_status = {
            f"math_verify/{status}": torch.tensor([float(v.status == status) for v in verdicts]) for status in PROBLEMS
        }
        return {"rewards": torch.where(correct > 0, hit, miss), "scores": correct, "extra_logs": per_status}

    def close(self):
        """Stop the worker processes (idempotent); the next call starts a fresh pool."""
        with self._lock:
            if self._idle is not None:
                self._threads.shutdown(wait=True)
                self._finalizer()
                self._all, self._idle, self._threads = [], None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def reward_from_env():
    """A MathVerifyReward configured by OPENRLHF_GEO_MATH_{MODE,TIMEOUT,WORKERS} (see the module docstring)."""
    mode = os.environ.get(ENV_MODE, "grpo").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE} must be one of {sorted(MODES)} (got {mode!r})")
    kwargs = {"mode": mode}
    for env, key, cast in ((ENV_TIMEOUT, "timeout", float), (ENV_WORKERS, "workers", int)):
        if os.environ.get(env):
            try:
                kwargs[key] = cast(os.environ[env])
            except ValueError:
                raise ValueError(f"{env} must be a {cast.__name__} (got {os.environ[env]!r})") from None
    return MathVerifyReward(**kwargs)


_default = None
_default_lock = threading.Lock()


def reward_func(queries, prompts, labels):
    """OpenRLHF 0.11.2 ``--reward.remote_url file.py`` entry point.

    Args: ``queries`` decoded prompt+response texts, ``prompts`` the prompt strings, ``labels`` gold answers
    (``--data.label_key``); upstream passes one of each per call, from worker threads.
    Returns ``{"rewards": (B,), "scores": (B,) 0/1 correctness (dynamic filtering), "extra_logs": {key: (B,)}}``,
    extra_logs flagging ``math_verify/{no_box,bad_gold,timeout,error}`` per sample (upstream logs their means).
    """
    global _default
    if __name__ != "openrlhf_geo.rewards.math_verify":
        # Upstream loads this file by path under another module name; the worker processes must import the
        # package module, so delegate to it (one pool per process).
        from openrlhf_geo.rewards.math_verify import reward_func as package_reward_func

        return package_reward_func(queries, prompts, labels)
    with _default_lock:
        if _default is None:
            _default = reward_from_env()
    return _default.reward_func(queries, prompts, labels)
