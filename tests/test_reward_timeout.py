"""--reward.timeout_s, both engines: a .py reward_func that does not return ends the run with one line naming the
function and its file (it stalled `openrlhf-geo train` and the fork forever)."""

import asyncio
import pickle
import signal
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import pytest
import torch
from fork_helpers import parse

from openrlhf_geo import cli
from openrlhf_geo.fork import hooks as fork_hooks
from openrlhf_geo.fork import launch
from openrlhf_geo.lab.task import addition_problems, build_model, build_tokenizer, write_jsonl
from openrlhf_geo.local.reward import RewardTimeout, load_python_reward

SLEEPS = """import time

def reward_func(queries, prompts, labels):
    time.sleep(60)
    return [1.0] * len(queries)
"""
# a function that swallows the interrupt and goes on waiting cannot be stopped from inside the process
DEAF = """import time

def reward_func(queries, prompts, labels):
    while True:
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            pass
"""


def message(flag, path, seconds):
    return f"{flag} {path}: reward_func did not return within {seconds} s (--reward.timeout_s; 0 = no limit)"


# ── the local engine ──


@pytest.fixture
def setup(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2).config.save_pretrained(tmp_path / "cfg")
    write_jsonl(tmp_path / "train.jsonl", addition_problems(6, seed=0))
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    return tmp_path


def train_argv(tmp, *extra):
    return [
        "train", "--actor.config", str(tmp / "cfg" / "config.json"), "--actor.tokenizer", str(tmp / "tok"),
        "--data.prompt_dataset", str(tmp / "train.jsonl"), "--reward.func", str(tmp / "sleeps.py"),
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "3",
        "--train.steps", "1", "--train.threads", "1", "--ckpt.output_dir", str(tmp / "out"), *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_local_a_reward_that_does_not_return_stops_the_run_in_one_line(setup, sigint):
    """As users run it, in a process of its own, also one started with SIGINT ignored (`openrlhf-geo train ... &` in
    a script: the shell ignores SIGINT for background jobs, so Python installs no handler; the deadline's SIGINT then
    could not land, and the process exited without the one-line error)."""
    start = time.time()
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    done = subprocess.run([sys.executable, "-m", "openrlhf_geo.cli", *train_argv(setup, "--reward.timeout_s", "1")],
                          capture_output=True, text=True, timeout=300, preexec_fn=ignore)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.time() - start < 90
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "openrlhf-geo train: " + message("--reward.func", setup / "sleeps.py", 1)


def test_local_the_timeout_flag_is_checked(setup, capsys):
    for value in ("-1", "nan"):
        assert cli.main(train_argv(setup, "--reward.timeout_s", value)) == 2
        assert "--reward.timeout_s must be" in capsys.readouterr().err
    # math-verify has its own per-answer timeout: a limit it would ignore is refused
    argv = train_argv(setup, "--reward.timeout_s", "5")
    argv[argv.index("--reward.func") + 1] = "math_verify"
    assert cli.main(argv) == 2
    assert "--reward.timeout_s 5 bounds the calls of a .py reward_func" in capsys.readouterr().err


def test_local_a_timeout_longer_than_a_thread_can_wait_is_refused_at_parse(setup, capsys):
    """1e10 s passed the check; the deadline thread's wait raised OverflowError at every call and died, so the limit
    was never enforced. Now one line at parse time (0 is the way to ask for no limit)."""
    (setup / "ok.py").write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    argv = train_argv(setup, "--reward.timeout_s", "1e10")
    argv[argv.index("--reward.func") + 1] = str(setup / "ok.py")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reward.timeout_s must be a number of seconds in [0, 9.22e+09]" in err, err
    assert "got 1e+10" in err and not (setup / "out").exists()


def test_local_a_reward_that_ignores_the_interrupt_ends_the_process(tmp_path):
    """A Python thread cannot be stopped: the process prints the line and exits (status 1)."""
    (tmp_path / "deaf.py").write_text(DEAF)
    code = (
        "from openrlhf_geo.local import reward\n"
        "reward.Deadline.GRACE_S = 0.5\n"
        f"reward.load_python_reward({str(tmp_path / 'deaf.py')!r}, 0.5)(['p'], ['r'], ['a'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    line = message("--reward.func", tmp_path / "deaf.py", 0.5)
    assert done.stderr.strip().splitlines()[-1] == f"openrlhf-geo: {line} (it could not be interrupted: exiting)"


def test_local_a_reward_within_the_limit_and_ctrl_c_are_unchanged(tmp_path):
    (tmp_path / "quick.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.5] * len(queries)\n")
    assert load_python_reward(tmp_path / "quick.py", 5)(["p"], ["r"], ["a"]).tolist() == [0.5]
    (tmp_path / "ctrl_c.py").write_text("def reward_func(queries, prompts, labels):\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt, match="in --reward.func .*ctrl_c.py: reward_func"):
        load_python_reward(tmp_path / "ctrl_c.py", 5)(["p"], ["r"], ["a"])


# ── the fork: upstream's utils/agent.py on the patched copy, with fakes for the tokenizer and the vLLM engine ──


class Tokenizer:
    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": torch.tensor([[1, 2]])}

    def decode(self, ids, skip_special_tokens=False):
        return "Q: 1 + 2 = ? A: 3"


class Engine:
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        return NS(outputs=[NS(token_ids=[3], finish_reason="stop", logprobs=None)])


def rollout(up, monkeypatch, path, timeout):
    """One sample through SingleTurnAgentExecutor.execute, the call the vLLM engine actor makes per sample."""
    import openrlhf.utils.agent as agent

    monkeypatch.setenv(fork_hooks.REWARD_TIMEOUT_ENV, str(timeout))  # set by the driver for every worker
    executor = agent.SingleTurnAgentExecutor(str(path))
    params = NS(max_tokens=4, logprobs=None)
    return asyncio.run(executor.execute("Q: 1 + 2 = ? A:", "3", params, 64, Tokenizer(), Engine()))


@pytest.mark.fork
def test_fork_a_reward_that_does_not_return_ends_the_rollout_with_the_error(up, monkeypatch, tmp_path):
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    start = time.time()
    with pytest.raises(RewardTimeout) as caught:
        rollout(up, monkeypatch, tmp_path / "sleeps.py", 0.5)
    assert time.time() - start < 10
    assert str(caught.value) == message("--reward.remote_url", tmp_path / "sleeps.py", 0.5)


@pytest.mark.fork
def test_fork_other_reward_errors_and_returns_are_upstreams(up, monkeypatch, tmp_path):
    (tmp_path / "ok.py").write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': 1.0}\n")
    assert rollout(up, monkeypatch, tmp_path / "ok.py", 5)["reward"] == 1.0
    (tmp_path / "raises.py").write_text("def reward_func(queries, prompts, labels):\n    return 1 / 0\n")
    assert rollout(up, monkeypatch, tmp_path / "raises.py", 5)["reward"] is None  # upstream logs and goes on
    assert rollout(up, monkeypatch, tmp_path / "ok.py", 0)["reward"] == 1.0  # 0: no limit


@pytest.mark.fork
def test_fork_a_timeout_longer_than_a_thread_can_wait_is_refused_at_parse(up, monkeypatch, capsys, tmp_path):
    (tmp_path / "ok.py").write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    argv = ["--advantage_estimator", "group_norm", "--reward.remote_url", str(tmp_path / "ok.py")]
    with pytest.raises(SystemExit) as caught:
        parse(up, monkeypatch, [*argv, "--reward.timeout_s", "1e10"])
    assert caught.value.code == 2
    assert "--reward.timeout_s must be a number of seconds in [0, 9.22e+09]" in capsys.readouterr().err


@pytest.mark.fork
def test_fork_the_driver_reports_the_timeout_in_one_line():
    """Ray pickles the error from the vLLM actor through the trainer to the driver (`launch.ray_failure`)."""
    from ray.exceptions import RayTaskError

    error = pickle.loads(pickle.dumps(RewardTimeout("--reward.remote_url", "/r/reward_func.py", 300.0)))

    def raised(function, cause):
        return RayTaskError(function, f"{function} (pid=1)\nTraceback ...", cause).as_instanceof_cause()

    failed = raised("ray::PPOTrainer.fit()", raised("ray::RolloutRayActor.generate_responses()", error))
    assert launch.ray_failure(failed) == (
        "ray::RolloutRayActor.generate_responses() failed: RewardTimeout: "
        + message("--reward.remote_url", "/r/reward_func.py", 300)
    )


# ── the fork's agent (--train.agent_func_path): upstream's MultiTurnAgentExecutor on the patched copy ──

AGENT = """import asyncio

import torch
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        await asyncio.sleep({sleep})
        return {{"rewards": torch.tensor(1.0), "environment_feedback": "", "done": True}}
"""


class AgentEngine:
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        return NS(outputs=[NS(token_ids=[3], text=" 3", finish_reason="stop", logprobs=None)])


def agent_rollout(up, monkeypatch, path, timeout):
    """One sample through MultiTurnAgentExecutor.execute with the AgentInstance of `path`, loaded as upstream's
    vllm_engine loads --train.agent_func_path."""
    import importlib.util

    import openrlhf.utils.agent as agent

    monkeypatch.setenv(fork_hooks.REWARD_TIMEOUT_ENV, str(timeout))  # set by the driver for every worker
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    executor = agent.MultiTurnAgentExecutor(module.AgentInstance)
    params = NS(max_tokens=4, logprobs=None)
    return asyncio.run(executor.execute("Q: 1 + 2 = ? A:", "3", params, 64, Tokenizer(), AgentEngine()))


@pytest.mark.fork
def test_fork_an_agent_step_that_does_not_return_ends_the_rollout_with_the_error(up, monkeypatch, tmp_path):
    (tmp_path / "slow_agent.py").write_text(AGENT.format(sleep=600))
    with pytest.raises(fork_hooks.AgentTimeout) as caught:
        agent_rollout(up, monkeypatch, tmp_path / "slow_agent.py", 0.5)
    assert str(caught.value) == (
        f"--train.agent_func_path {tmp_path / 'slow_agent.py'}: the agent's step() did not return within 0.5 s "
        "(--reward.timeout_s; 0 = no limit)"
    )
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)  # Ray's way to the driver
    (tmp_path / "agent.py").write_text(AGENT.format(sleep=0))
    assert agent_rollout(up, monkeypatch, tmp_path / "agent.py", 5)["reward"] == 1.0
    assert agent_rollout(up, monkeypatch, tmp_path / "agent.py", 0)["reward"] == 1.0  # 0: no limit


@pytest.mark.fork
def test_fork_an_explicit_timeout_with_an_agent_parses(up, monkeypatch, tmp_path):
    """Upstream makes the agent the run's reward after the fork's check, which reads --train.agent_func_path."""
    (tmp_path / "agent.py").write_text(AGENT.format(sleep=0))
    argv = ["--advantage_estimator", "group_norm", "--train.agent_func_path", str(tmp_path / "agent.py")]
    args = parse(up, monkeypatch, [*argv, "--reward.timeout_s", "30"])
    assert args.reward.timeout_s == 30 and args.reward.remote_url == ["agent"]
