"""The local engine's reward functions: the memoised math-verify verdicts and a user's .py `reward_func`."""

import importlib.util
import reprlib
from pathlib import Path

import torch


def _first_line(error):
    """`Type: first line of the message` of an exception, for one-line errors."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def load_python_reward(path):
    """reward_fn from a .py file defining upstream's `reward_func(queries, prompts, labels)`.

    Whatever goes wrong in the user's file is a ValueError naming --reward.func, the file and what happened: it
    cannot be loaded (a syntax error, a failing import, sys.exit()), reward_func raises (SystemExit included), or it
    returns something other than one number per response (a list, tensor or upstream's {"rewards": ...}). A
    KeyboardInterrupt inside reward_func stays one, its message naming --reward.func."""
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
        try:
            out = module.reward_func([p + r for p, r in zip(prompts, responses)], list(prompts), list(answers))
        except KeyboardInterrupt:  # Ctrl-C or the function's own: still an interrupt, saying where it landed
            raise KeyboardInterrupt(f"in --reward.func {path}: reward_func") from None
        except (Exception, SystemExit) as error:  # a sys.exit() in the user's code is not the run's exit status
            raise ValueError(f"--reward.func {path}: reward_func raised {_first_line(error)}") from None
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


def make_reward_fn(spec):
    return CachedMathVerify() if spec == "math_verify" else load_python_reward(spec)


_SHARED = {}  # spec -> reward_fn: one math-verify scorer (and its worker process) per process, shared by its runs


def shared_reward_fn(spec):
    """`make_reward_fn(spec)`, made once per process: the demo's and the studies' runs in one process share it."""
    if spec not in _SHARED:
        _SHARED[spec] = make_reward_fn(spec)
    return _SHARED[spec]
