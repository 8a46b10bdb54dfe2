"""The local engine's reward functions: the memoised math-verify verdicts and a user's .py `reward_func`, each call
of the latter bounded by --reward.timeout_s (`RewardTimeout`, which the fork raises too)."""

import importlib.util
import os
import reprlib
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from openrlhf_geo.options import REWARD_TIMEOUT_S


class RewardTimeout(ValueError):
    """A call of a .py reward_func that did not return within --reward.timeout_s: the run stops (both engines)."""

    def __init__(self, flag, path, seconds):
        super().__init__(
            f"{flag} {path}: reward_func did not return within {seconds:g} s (--reward.timeout_s; 0 = no limit)"
        )
        self.flag, self.path, self.seconds = flag, path, seconds

    def __reduce__(self):  # Ray pickles it from the fork's vLLM actor to the driver
        return type(self), (self.flag, self.path, self.seconds)


class Deadline:
    """Ends a reward_func call on this process's main thread after `seconds` (0: never): a real SIGINT, which also
    wakes a blocking wait such as time.sleep, and which the caller reports as `error` when `fired`. The call stays on
    the main thread because reward functions may rely on it (math-verify's own timeouts use SIGALRM). A call that
    ignores the interrupt (a long C call, a bare except) for GRACE_S, or one that cannot get it (off the main
    thread, SIGINT handled by other code; an ignored SIGINT gets Python's handler during the call), cannot be
    stopped inside the process: `error`'s line is printed and the
    process exits with status 1."""

    GRACE_S = 10.0

    def __init__(self, seconds, error):
        self.seconds, self.error, self.fired = seconds, error, False
        self._lock, self._done = threading.Lock(), threading.Event()
        self._caller = threading.get_ident()

    def __enter__(self):
        self._ignored = False
        if self.seconds:
            # a process started with SIGINT ignored (`cmd &` in a script: the shell ignores it for background jobs)
            # has no Python handler for it; the call gets Python's own for its duration, so the deadline can end it
            if self._caller == threading.main_thread().ident and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                self._ignored = True
            threading.Thread(target=self._watch, name="openrlhf-geo-reward-deadline", daemon=True).start()
        return self

    def __exit__(self, *exc):
        try:  # the deadline's SIGINT may land while this waits for the lock: _done is set all the same
            with self._lock:
                self._done.set()
        finally:
            self._done.set()
            if self._ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        return False

    def _watch(self):
        if self._done.wait(self.seconds):
            return
        interruptible = (
            self._caller == threading.main_thread().ident
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        with self._lock:
            if self._done.is_set():
                return
            self.fired = True
            if interruptible:
                signal.pthread_kill(self._caller, signal.SIGINT)
        if not self._done.wait(self.GRACE_S if interruptible else 0):
            print(f"openrlhf-geo: {self.error} (it could not be interrupted: exiting)", file=sys.stderr, flush=True)
            os._exit(1)


def _first_line(error):
    """`Type: first line of the message` of an exception, for one-line errors."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def load_python_reward(path, timeout_s=REWARD_TIMEOUT_S):
    """reward_fn from a .py file defining upstream's `reward_func(queries, prompts, labels)`.

    Whatever goes wrong in the user's file is a ValueError naming --reward.func, the file and what happened: it
    cannot be loaded (a syntax error, a failing import, sys.exit()), reward_func raises (SystemExit included), does
    not return within `timeout_s` seconds (RewardTimeout, `Deadline`; 0 = no limit), or returns something other than
    one number per response (a list, tensor or upstream's {"rewards": ...}). A KeyboardInterrupt inside reward_func
    stays one, its message naming --reward.func."""
    spec = importlib.util.spec_from_file_location("openrlhf_geo_user_reward", path)
    if spec is None or not Path(path).is_file():
        raise ValueError(f"--reward.func {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # the user's code: any exception, SyntaxError and sys.exit() included
        raise ValueError(f"--reward.func {path}: cannot load it: {_first_line(error)}") from None
    if not hasattr(module, "reward_func"):
        raise ValueError(f"--reward.func {path}: defines no reward_func(queries, prompts, labels)")

    def reward_fn(prompts, responses, answers):
        deadline = Deadline(timeout_s, RewardTimeout("--reward.func", path, timeout_s))
        try:
            with deadline:
                out = module.reward_func([p + r for p, r in zip(prompts, responses)], list(prompts), list(answers))
            if deadline.fired:  # it returned just as the deadline fired: the SIGINT sent lands here
                time.sleep(1)
        except KeyboardInterrupt:  # Ctrl-C or the function's own: still an interrupt, saying where it landed
            if deadline.fired:
                raise deadline.error from None
            raise KeyboardInterrupt(f"in --reward.func {path}: reward_func") from None
        except (Exception, SystemExit) as error:  # a sys.exit() in the user's code is not the run's exit status
            if deadline.fired:  # what it raised on the interrupt
                raise deadline.error from None
            raise ValueError(f"--reward.func {path}: reward_func raised {_first_line(error)}") from None
        if deadline.fired:  # the function swallowed the interrupt
            raise deadline.error
        value = out.get("rewards") if isinstance(out, dict) else out
        try:
            rewards = torch.as_tensor(value, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError):  # strings, None, ragged lists: not numbers
            rewards = None
        if rewards is None:
            raise ValueError(
                f"--reward.func {path}: reward_func returned {reprlib.repr(out)}: expected {len(responses)} numbers, "
                "one per response (a list, a tensor or {'rewards': ...})"
            )
        if rewards.numel() != len(responses):
            raise ValueError(
                f"--reward.func {path}: reward_func returned {rewards.numel()} rewards for {len(responses)} responses"
            )
        return rewards

    return reward_fn


class CachedMathVerify:
    """math-verify verdicts (1/0) memoised per `math_verify.prepare` key: a verdict depends only on the last box's
    content and the gold LaTeX, so responses that differ elsewhere (a sharpening policy's many wordings of a few
    answers) share one math-verify call, and the verdicts are those of scoring every response.

    Timed-out or failed items score 0 and are not memoised (a retry may succeed); the memo is cleared when it
    exceeds `max_entries` so long runs with unique answers stay bounded in memory. `last_statuses`: the verdict
    status (math_verify.STATUSES) of each item of the last call, which the engine counts (math_verify/<status>).
    """

    def __init__(self, workers=1, timeout=5.0, max_entries=200_000):
        from openrlhf_geo.rewards.math_verify import MathVerifyReward

        self.scorer = MathVerifyReward(mode="grpo", timeout=timeout, workers=workers)
        self.cache, self.max_entries = {}, max_entries
        self.last_statuses = []

    def __call__(self, prompts, responses, answers):
        from openrlhf_geo.rewards.math_verify import prepare

        # (box content, gold LaTeX), or prepare's own Verdict for input it settles (no box, bad types): hashable
        keys = [prepare(r, a) for r, a in zip(responses, answers)]
        known = {k: self.cache[k] for k in keys if k in self.cache}  # taken before a clear below can drop them
        missing = {}  # key -> its first (response, answer), scored for all that share the key
        for key, pair in zip(keys, zip(responses, answers)):
            if key not in known:
                missing.setdefault(key, pair)
        if missing:
            verdicts = self.scorer.verdicts([r for r, _ in missing.values()], [a for _, a in missing.values()])
            fresh = {key: v.status for key, v in zip(missing, verdicts)}
            if len(self.cache) + len(fresh) > self.max_entries:
                self.cache.clear()
            self.cache.update({k: s for k, s in fresh.items() if s not in ("timeout", "error")})
            known.update(fresh)
        self.last_statuses = [known[k] for k in keys]
        return torch.tensor([float(status == "correct") for status in self.last_statuses])


def make_reward_fn(spec, timeout_s=REWARD_TIMEOUT_S):
    """math-verify's memo (its own per-answer timeout), or the .py file's reward_func bounded by `timeout_s`."""
    return CachedMathVerify() if spec == "math_verify" else load_python_reward(spec, timeout_s)


_SHARED = {}  # (spec, timeout) -> reward_fn: one math-verify scorer (and its worker process) per process


def shared_reward_fn(spec, timeout_s=REWARD_TIMEOUT_S):
    """`make_reward_fn(spec)`, made once per process: the demo's and the studies' runs in one process share it."""
    if (spec, timeout_s) not in _SHARED:
        _SHARED[spec, timeout_s] = make_reward_fn(spec, timeout_s)
    return _SHARED[spec, timeout_s]
