"""Boxed-answer math reward scored by the `math-verify` library, safe to call from any thread.

The answer of a response is the content of its LAST top-level ``\\boxed{...}`` (or ``\\fbox{...}``), braces
matched, ``\\{``/``\\}`` skipped. A response without a complete box is incorrect: an unclosed last box (a
truncated response) does not fall back to an earlier one. Gold answers may be given with or without ``\\boxed``.
Equivalence is math-verify's ``parse`` + ``verify`` (fractions, ``\\dfrac``, decimals, percent, units, sets,
intervals, ...); nothing here decides equivalence by hand.

Rewards: mode ``grpo`` gives 1 / 0, mode ``dapo`` gives +1 / -1 (correct / anything else).

Timeouts: math-verify's own timeouts use ``signal.alarm``, which only works in the main thread, while OpenRLHF
calls reward functions from worker threads (``asyncio.to_thread``) inside Ray actors. So each item runs in a
small pool of worker processes and the caller waits at most ``timeout`` seconds per item; a worker that
overruns is killed and replaced (about a second to restart), and the item scores as incorrect with status
``timeout``.

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
import os
import queue
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from math_verify import parse, verify

MODES = {"grpo": (1.0, 0.0), "dapo": (1.0, -1.0)}
STATUSES = ("correct", "wrong", "no_box", "bad_gold", "timeout", "error")
BOX_COMMANDS = ("\\boxed", "\\fbox")
ENV_MODE, ENV_TIMEOUT, ENV_WORKERS = "OPENRLHF_GEO_MATH_MODE", "OPENRLHF_GEO_MATH_TIMEOUT", "OPENRLHF_GEO_MATH_WORKERS"
# A new worker imports sympy/antlr (about a second); give it this long before declaring the pool broken.
WORKER_START_TIMEOUT = 120.0


@dataclass(frozen=True)
class Verdict:
    """Outcome for one (response, gold) pair: ``status`` is one of STATUSES; ``answer`` the extracted box content."""

    correct: bool
    status: str
    answer: str | None = None


def extract_last_boxed(text):
    """Content of the last top-level ``\\boxed{...}``/``\\fbox{...}`` in ``text``; None if absent or unclosed.

    Nested boxes count as part of their enclosing box (``\\boxed{\\boxed{5}}`` gives ``\\boxed{5}``). A backslash
    escapes the next character, so ``\\{`` and ``\\}`` do not count as braces.
    """
    last, i = None, 0
    while True:
        starts = [(text.find(cmd, i), cmd) for cmd in BOX_COMMANDS]
        starts = [(pos, cmd) for pos, cmd in starts if pos >= 0]
        if not starts:
            return last
        pos, cmd = min(starts)
        j = pos + len(cmd)
        while j < len(text) and text[j] in " \t":
            j += 1
        if j >= len(text) or text[j] != "{":
            i = pos + len(cmd)  # another macro (`\boxedtext`) or a brace-less box: not an answer
            continue
        depth, k = 0, j
        while k < len(text):
            ch = text[k]
            if ch == "\\":
                k += 2
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        if depth != 0 or k >= len(text):
            return None  # the last box is unclosed (truncated response): no answer
        last, i = text[j + 1 : k], k + 1


def gold_expression(gold):
    """Gold answer as LaTeX: the last box's content if ``gold`` contains one, else ``gold`` without ``$...$``."""
    gold = str(gold).strip()
    if any(cmd in gold for cmd in BOX_COMMANDS):
        gold = (extract_last_boxed(gold) or "").strip()
    while len(gold) >= 2 and gold[0] == gold[-1] == "$" and gold[-2] != "\\":  # math delimiters, not \$
        gold = gold[1:-1].strip()
    return gold


def score_answer(response, gold):
    """Verdict for one pair, no timeout of its own (callers bound it). Both sides are parsed as ``\\boxed{x}``."""
    answer = extract_last_boxed(response)
    if answer is None:
        return Verdict(False, "no_box")
    gold_latex = gold_expression(gold)
    gold_parsed = parse("\\boxed{" + gold_latex + "}", parsing_timeout=None) if gold_latex else []
    if not gold_parsed:
        return Verdict(False, "bad_gold", answer)
    pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    correct = bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None)
    return Verdict(correct, "correct" if correct else "wrong", answer)


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once that its own timeout is off; here the caller enforces the timeout instead.
    def filter(self, record):
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _safe_score(response, gold):
    try:
        return score_answer(response, gold)
    except Exception:  # a sympy/antlr failure on one item must not take down the batch
        return Verdict(False, "error", extract_last_boxed(response))


def _worker_main(read_fd, write_fd):
    """Worker process loop: receive (response, gold), send a Verdict back; exit when the parent goes away."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    score_answer("\\boxed{1}", "1")  # math-verify builds its parsers lazily; keep that out of the first item's time
    outbox.send("ready")
    while True:
        try:
            item = inbox.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        outbox.send(_safe_score(*item))


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
        code = f"from openrlhf_geo.rewards.math_verify import _worker_main; _worker_main({from_parent}, {to_parent})"
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
        timeout: seconds allowed per item (measured from hand-off to a worker, queueing excluded).
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
        worker = self._idle.get()
        try:
            worker.outbox.send((response, gold))
            if worker.inbox.poll(self.timeout):
                verdict = worker.inbox.recv()
                self._idle.put(worker)
                return verdict
            status = "timeout"
        except (EOFError, OSError):  # the worker died (e.g. out of memory)
            status = "error"
        worker.kill()
        replacement = _Worker().wait_ready()
        with self._lock:
            self._all.remove(worker)
            self._all.append(replacement)
        self._idle.put(replacement)
        return Verdict(False, status, extract_last_boxed(response))

    def verdicts(self, responses, golds):
        """One Verdict per (response, gold); ``golds`` entries may be strings or numbers, not None."""
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
            return [self._score_in_worker(responses[0], golds[0])]
        return list(self._threads.map(self._score_in_worker, responses, golds))

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
            f"math_verify/{status}": torch.tensor([float(v.status == status) for v in verdicts])
            for status in ("no_box", "bad_gold", "timeout", "error")
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
