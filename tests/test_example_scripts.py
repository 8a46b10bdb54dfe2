"""examples/scripts/: every launch script parses, and every flag it passes is accepted by the parser that reads it.

The scripts run for real under bash with `ray`, `deepspeed`, `python`/`python3` and `openrlhf-geo` replaced by
stubs that record their argv, so bash's own variable and array expansion is what gets checked. A `ray job submit`
entrypoint is then replayed through `/bin/sh` the way Ray's job supervisor runs it (argv joined by
`subprocess.list2cmdline`, executed with `shell=True`). The resulting train-ppo-ray argv goes through the patched
upstream parser (`parse` of test_fork_pipeline.py: upstream train_ppo_ray as __main__ through `openrlhf-geo
train-ppo-ray`, stopped where training starts), the SFT argv through DeepSpeed's launcher and upstream train_sft's
parser, and the ArmoRM server's through `openrlhf-geo serve-rm`'s.
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from openrlhf_geo import options
from openrlhf_geo.eval.harness import SYSTEM_PROMPT

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "examples" / "scripts"
FORK_HELPERS_SCRIPT = "smoke_salt_geoalign_1gpu.sh"  # not launched through ray; own header convention
STUBBED = ("ray", "deepspeed", "python", "python3", "openrlhf-geo")
# Records its argv (NUL-separated, one file per call, in call order); swallows a heredoc passed as `-`.
STUB = """#!/usr/bin/env bash
n=$(ls "$STUB_OUT" | wc -l)
printf '%s\\0' "$(basename "$0")" "$@" > "$STUB_OUT/$(printf %04d "$n")"
if [[ "${1:-}" == - ]]; then cat > /dev/null; fi
"""
# The environment variables each script is run with: its defaults and every switch it documents.
VARIANTS = {
    "train_math_grpo.sh": [
        {},
        {"SALT": "1"},
        {"SALT": "1", "MODEL_SIZE": "7B", "DATASET": "dapo_math_17k", "SEED": "3", "NUM_NODES": "2"},
    ],
    "train_math_dapo.sh": [{}, {"SALT": "1"}, {"SALT": "1", "MODEL_SIZE": "7B", "DATASET": "math_train"}],
    "train_math_geoalign.sh": [
        {},
        {"GEOALIGN": "1"},
        {"NOISE_RATE": "0.1"},
        {"GEOALIGN": "1", "NOISE_RATE": "0.1", "MODEL_SIZE": "4B"},
    ],
    "train_hh_sft.sh": [{}],
    "train_hh_rl.sh": [
        {},
        {"GEOALIGN": "1"},
        {"GEOALIGN": "1", "NOISE_RATE": "0.1", "RM_URL": "http://rm-host:5000/get_reward"},
    ],
    "serve_armorm.sh": [{}],
    "sweep_rollout_scaling.sh": [{}],
    FORK_HELPERS_SCRIPT: [{}],
}
CASES = [(script, env) for script, envs in VARIANTS.items() for env in envs]


def case_id(script, env):
    return f"{script}[{' '.join(f'{k}={v}' for k, v in env.items()) or 'defaults'}]"


# Switch -> the flags it may change (besides run names and output folders).
SWITCHES = [
    ("train_math_grpo.sh", {"SALT": "1"}, ("salt.",)),
    ("train_math_dapo.sh", {"SALT": "1"}, ("salt.",)),
    ("train_math_geoalign.sh", {"GEOALIGN": "1"}, ("geoalign.",)),
    ("train_math_geoalign.sh", {"NOISE_RATE": "0.1"}, ("reward.noise.",)),
    ("train_hh_rl.sh", {"GEOALIGN": "1"}, ("geoalign.",)),
]


def run_script(script, env, home, extra=None):
    """Run `script` with the stubs first on PATH; -> (CompletedProcess, [argv of each stubbed call, in order])."""
    stubs, out = home / "stubs", home / f"calls-{len(list(home.glob('calls-*')))}"
    out.mkdir()
    if not stubs.exists():
        stubs.mkdir()
        for name in STUBBED:
            (stubs / name).write_text(STUB)
            (stubs / name).chmod(0o755)
    environ = {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),  # scripts default DATA_DIR / SAVE_ROOT under $HOME
        "STUB_OUT": str(out),
        **env,
        **(extra or {}),
    }
    done = subprocess.run(
        ["bash", str(SCRIPTS / script)], env=environ, cwd=home, capture_output=True, text=True, timeout=60
    )
    calls = [f.read_bytes().decode().split("\0")[:-1] for f in sorted(out.iterdir())]
    return done, calls


def make_data(data_dir):
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in ("math_train", "dapo_math_17k", "aime24"):
        (data_dir / f"{name}.jsonl").write_text('{"prompt": [], "answer": "1"}\n')


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    make_data(home / "openrlhf-geo" / "data")
    return home


@pytest.fixture(scope="module")
def runs(home):
    """(script, variant id) -> (CompletedProcess, argv of every stubbed call the script made)."""
    return {case_id(script, env): run_script(script, env, home) for script, env in CASES}


@pytest.fixture(scope="module")
def calls(runs):
    return {key: made for key, (_, made) in runs.items()}


def job_parts(argv):
    """`ray job submit OPTIONS -- ENTRYPOINT...` -> (options, entrypoint)."""
    assert argv[:3] == ["ray", "job", "submit"] and "--" in argv, argv[:6]
    cut = argv.index("--")
    return argv[3:cut], argv[cut + 1 :]


def ray_shell_round_trip(entrypoint):
    """The argv the job's process receives: Ray joins the entrypoint with list2cmdline and runs it via /bin/sh."""
    line = "printf '%s\\0' " + subprocess.list2cmdline(entrypoint)
    done = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True)
    return done.stdout.split("\0")[:-1]


def train_ppo_ray_argv(argv):
    """The train-ppo-ray arguments of a recorded call (a ray job or a direct `python -m` call), or None."""
    if argv[0] == "ray":
        argv = ray_shell_round_trip(job_parts(argv)[1])
    if argv[0] in ("python", "python3") and argv[1:4] == ["-m", "openrlhf_geo.cli", "train-ppo-ray"]:
        return argv[4:]
    return None


def flatten(ns, prefix=""):
    """Nested namespaces -> {"a.b.c": value}."""
    flat = {}
    for key, value in vars(ns).items():
        if isinstance(value, SimpleNamespace):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ── the scripts as files ──


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_script_passes_bash_n(script):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_script_is_run_by_this_test():
    assert {p.name for p in SCRIPTS.glob("*.sh")} == set(VARIANTS)


@pytest.mark.parametrize("script", sorted(set(VARIANTS) - {FORK_HELPERS_SCRIPT}))
def test_script_has_strict_mode_and_the_documented_header(script):
    text = (SCRIPTS / script).read_text()
    header = text.split("\nset -euo pipefail\n")[0]
    assert header != text, "set -euo pipefail missing"
    for field in ("Hardware", "Wall time", "Usage", "Edit"):
        assert re.search(rf"^# {field} ", header, re.M), f"header lacks '{field}'"
    assert re.search(r"^# (Model|Models) ", header, re.M)
    # Unverified hyperparameters must say so in the header (SALT Table 4 / GeoAlign paper were not available).
    if script.startswith(("train_", "sweep_")):
        assert "NOT verified" in header


def test_readme_lists_every_script():
    readme = (REPO / "examples" / "README.md").read_text()
    for script in VARIANTS:
        assert f"`{script}`" in readme, script


def test_scripts_hold_no_secrets():
    secret = re.compile(r"hf_[A-Za-z0-9]{30,}|\b[0-9a-f]{40}\b|sk-[A-Za-z0-9]{20,}|(api_key|token)\s*=\s*['\"]?\w{8,}")
    for path in SCRIPTS.glob("*.sh"):
        assert not secret.search(path.read_text()), path.name


# ── what the scripts launch ──


@pytest.mark.parametrize("script,env", CASES, ids=[case_id(s, e) for s, e in CASES])
def test_script_runs_to_its_launch(runs, script, env):
    done, made = runs[case_id(script, env)]
    assert done.returncode == 0 and made, done.stderr


def test_every_launch_is_recorded(calls):
    tools = {key: [argv[0] for argv in made] for key, made in calls.items()}
    assert tools[case_id("train_hh_sft.sh", {})] == ["deepspeed"]
    assert tools[case_id("serve_armorm.sh", {})] == ["openrlhf-geo"]
    assert tools[case_id("sweep_rollout_scaling.sh", {})] == ["ray"] * 16
    for script, env in CASES:
        if script.startswith("train_math_") or script == "train_hh_rl.sh":
            assert tools[case_id(script, env)] == ["ray"], case_id(script, env)


def test_jobs_set_only_working_dir_and_env_vars(calls):
    """Job-level runtime env: the fork adds py_modules itself, and upstream's ray.init sets three env vars, so the
    same field or env var at job level would be a hard error in Ray."""
    upstream_env = {"TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"}
    jobs = [argv for made in calls.values() for argv in made if argv[0] == "ray"]
    assert len(jobs) == 3 + 3 + 4 + 3 + 16
    for argv in jobs:
        opts, _ = job_parts(argv)
        values = dict(opt.removeprefix("--").split("=", 1) for opt in opts)
        assert set(values) == {"address", "runtime-env-json"}, opts
        env = json.loads(values["runtime-env-json"])
        assert set(env) == {"working_dir", "env_vars"}
        assert Path(env["working_dir"]) == REPO
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env["env_vars"].items())
        assert not set(env["env_vars"]) & upstream_env
        assert all(k.startswith("OPENRLHF_GEO_") for k in env["env_vars"])


def test_job_entrypoints_survive_rays_shell(calls):
    for key, made in calls.items():
        for argv in made:
            if argv[0] == "ray":
                entrypoint = job_parts(argv)[1]
                assert ray_shell_round_trip(entrypoint) == entrypoint, key


def test_file_rewards_resolve_inside_the_working_dir(calls):
    """A reward-function path is relative to the job's working_dir (this repository), so it exists on every node."""
    seen = set()
    for made in calls.values():
        for argv in made:
            args = train_ppo_ray_argv(argv)
            if args and argv[0] == "ray":
                url = args[args.index("--reward.remote_url") + 1]
                if not url.startswith("http"):
                    assert not Path(url).is_absolute() and "def reward_func(" in (REPO / url).read_text()
                    seen.add(url)
    assert seen == {"openrlhf_geo/rewards/math_verify.py", "openrlhf_geo/rewards/armorm.py"}


def test_wandb_logging_follows_wandb_api_key(home):
    _, without = run_script("train_math_grpo.sh", {}, home)
    assert not any(a.startswith("--logger.wandb") for a in without[0])
    _, with_key = run_script("train_math_grpo.sh", {}, home, {"WANDB_API_KEY": "test-key-not-a-secret"})
    args = train_ppo_ray_argv(with_key[0])
    assert args[args.index("--logger.wandb.key") + 1] == "test-key-not-a-secret"
    assert args[args.index("--logger.wandb.group") + 1] == "r1-distill-qwen-1.5B_math_train_grpo"


@pytest.mark.parametrize(
    "script,env,variable",
    [
        ("train_math_grpo.sh", {"SALT": "yes"}, "SALT"),
        ("train_math_dapo.sh", {"MODEL_SIZE": "3B"}, "MODEL_SIZE"),
        ("train_math_grpo.sh", {"DATASET": "gsm8k"}, "DATASET"),
        ("train_math_geoalign.sh", {"GEOALIGN": "2"}, "GEOALIGN"),
        ("train_hh_rl.sh", {"GEOALIGN": "on"}, "GEOALIGN"),
        ("sweep_rollout_scaling.sh", {"G_LIST": "2 3"}, "G=3"),
        ("sweep_rollout_scaling.sh", {"METHODS": "ppo"}, "METHODS"),
    ],
)
def test_bad_switch_values_fail_before_submitting_anything(home, script, env, variable):
    done, made = run_script(script, env, home)
    assert done.returncode == 2 and variable in done.stderr
    assert made == [] or (script.startswith("sweep_") and variable == "G=3" and len(made) == 2)  # G=2 went first


def test_missing_data_is_prepared_before_the_job(home, tmp_path):
    done, made = run_script("train_math_dapo.sh", {"DATA_DIR": str(tmp_path)}, home)
    assert done.returncode == 0, done.stderr
    prep, job = made
    assert prep[:2] == ["python3", str(SCRIPTS / "prepare_math_data.py")]
    assert prep[2:] == ["--out", str(tmp_path), "dapo_math_17k", "aime24"]
    assert job[0] == "ray"


# ── the real parsers ──


def _fork_pipeline():
    """test_fork_pipeline.py's `up` fixture and `parse` helper: one mechanism for parsing through the fork."""
    spec = importlib.util.spec_from_file_location(
        "_fork_pipeline_helpers", Path(__file__).with_name("test_fork_pipeline.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_pipeline = _fork_pipeline()
up = _pipeline.up
parse = _pipeline.parse


def parse_or_reject(monkeypatch, up, argv):
    """Parsed args, or the parser's complaint as a string (so one bad script fails only its own cases)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(up, monkeypatch, argv)
    except (SystemExit, AssertionError) as e:  # argparse / fork validation, or upstream's post-parse asserts
        return f"rejected: {(err.getvalue().strip() or repr(e)).splitlines()[-1]}"


@pytest.fixture(scope="module")
def parsed(calls, up):
    """(script, variant id) -> for each of its train-ppo-ray launches, the args of the patched upstream parser."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        return {
            key: [parse_or_reject(monkeypatch, up, args) for args in map(train_ppo_ray_argv, made) if args is not None]
            for key, made in calls.items()
        }
    finally:
        monkeypatch.undo()


def accepted(launches):
    for args in launches:
        assert not isinstance(args, str), args
    return launches


def check_recipe(script, env, args):
    """What each script's header promises, read back from the parsed args."""
    colocated_gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    assert args.vllm.num_engines * args.vllm.tensor_parallel_size == colocated_gpus  # train() asserts it later
    rollouts = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    assert rollouts % args.train.batch_size == 0  # whole optimizer steps per rollout step
    assert args.actor.num_nodes == int(env.get("NUM_NODES", 1))
    if not script.startswith("sweep_"):  # the sweep runs both arms
        assert args.salt.enable == (env.get("SALT") == "1")
    if script.startswith("train_math_") or script.startswith("sweep_"):
        assert args.algo.advantage.estimator == "group_norm"
        assert args.data.input_key == "prompt" and args.data.label_key == "answer" and args.data.apply_chat_template
        assert Path(args.data.prompt_dataset).is_file() and Path(args.eval.dataset).is_file()
    if script in ("train_math_grpo.sh", "train_math_dapo.sh"):
        size = env.get("MODEL_SIZE", "1.5B")
        assert args.actor.model_name_or_path == f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{size}"
        dataset = env.get("DATASET", "math_train" if script == "train_math_grpo.sh" else "dapo_math_17k")
        assert Path(args.data.prompt_dataset).name == f"{dataset}.jsonl"
    if script == "train_math_grpo.sh":
        assert args.rollout.n_samples_per_prompt == 8 and args.algo.kl.use_loss and args.algo.kl.init_coef > 0
        assert args.actor.loss_agg_mode == "seq-mean-token-mean"
    if script == "train_math_dapo.sh":
        assert args.rollout.n_samples_per_prompt == 16 and args.algo.kl.init_coef == 0
        assert tuple(args.actor.eps_clip_low_high) == (0.2, 0.28) and args.actor.loss_agg_mode == "token-mean"
        assert args.algo.dynamic_filtering_enable and args.reward.overlong_buffer_len > 0
    if script in ("train_math_geoalign.sh", "train_hh_rl.sh"):
        assert args.geoalign.enable == (env.get("GEOALIGN") == "1")
        noise = {"train_math_geoalign.sh": "flip", "train_hh_rl.sh": "swap"}[script]
        assert (args.reward.noise.type, args.reward.noise.rate) == (
            (noise, 0.1) if env.get("NOISE_RATE") == "0.1" else ("none", 0.0)
        )
    if script == "train_math_geoalign.sh":
        assert args.rollout.n_samples_per_prompt == 16
        assert args.actor.model_name_or_path == f"Qwen/Qwen3-{env.get('MODEL_SIZE', '1.7B')}"
        if args.geoalign.enable:
            assert options.geoalign_config(args).alpha == 0.05
    if script == "train_hh_rl.sh":
        assert args.rollout.n_samples_per_prompt == 8
        assert args.reward.remote_url == [env.get("RM_URL", "openrlhf_geo/rewards/armorm.py")]
        if args.geoalign.enable:
            config = options.geoalign_config(args)
            assert (config.alpha, config.val_acc) == (0.12, 0.85)


@pytest.mark.fork
@pytest.mark.parametrize("script,env", CASES, ids=[case_id(s, e) for s, e in CASES])
def test_train_ppo_ray_accepts_every_flag(parsed, script, env):
    launches = parsed[case_id(script, env)]
    if script in ("train_hh_sft.sh", "serve_armorm.sh"):
        assert launches == []
        return
    assert len(accepted(launches)) == (16 if script.startswith("sweep_") else 1)
    if script != FORK_HELPERS_SCRIPT:  # parsed only: its recipe is the fork helper's
        for args in launches:
            check_recipe(script, env, args)


@pytest.mark.fork
@pytest.mark.parametrize("script,env,allowed", SWITCHES, ids=[case_id(s, e) for s, e, _ in SWITCHES])
def test_a_switch_changes_only_its_own_flags(parsed, script, env, allowed):
    """± SALT / ± GeoAlign / ± noise runs share every other hyperparameter: the comparison is like for like."""
    (base,), (switched,) = accepted(parsed[case_id(script, {})]), accepted(parsed[case_id(script, env)])
    base, switched = flatten(base), flatten(switched)
    changed = {k for k in base.keys() | switched.keys() if base.get(k) != switched.get(k)}
    assert changed, "the switch changed nothing"
    # Run names and output folders (ckpt.*, logger.*) differ by design.
    assert {k for k in changed if not k.startswith((*allowed, "ckpt.", "logger."))} == set()


@pytest.mark.fork
def test_sweep_holds_the_rollout_budget_fixed(parsed):
    per_step, total, optimizer_steps, arms = set(), set(), set(), set()
    for args in accepted(parsed[case_id("sweep_rollout_scaling.sh", {})]):
        g = args.rollout.n_samples_per_prompt
        visits = args.data.max_samples * args.train.num_episodes
        per_step.add(args.rollout.batch_size * g)
        total.add(visits * g)
        optimizer_steps.add(visits * g // args.train.batch_size)  # upstream's max_steps for the LR schedule
        assert args.data.max_samples <= 4096  # the prompt pool (MATH train has 7500)
        arms.add((g, args.salt.enable))
    assert per_step == {2048} and total == {2048 * 64} and optimizer_steps == {128}
    assert arms == {(g, salt) for g in (2, 4, 8, 16, 32, 64, 128, 256) for salt in (False, True)}


@pytest.mark.fork
def test_train_sft_accepts_the_sft_flags(calls, up, monkeypatch):
    import deepspeed.launcher.runner

    (argv,) = calls[case_id("train_hh_sft.sh", {})]
    launcher = deepspeed.launcher.runner.parse_args(argv[1:])
    assert launcher.module and launcher.user_script == "openrlhf.cli.train_sft" and launcher.num_gpus == 8

    class Parsed(Exception):
        pass

    def stop(args):
        raise Parsed(args)

    monkeypatch.setattr(up.utils, "get_strategy", stop)  # train()'s first call
    monkeypatch.setattr(sys, "argv", ["openrlhf.cli.train_sft", *launcher.user_args])
    with pytest.raises(Parsed) as caught:
        runpy.run_module("openrlhf.cli.train_sft", run_name="__main__", alter_sys=True)
    args = caught.value.args[0]
    assert args.model.model_name_or_path == "Qwen/Qwen3-1.7B-Base" and args.data.dataset == "Dahoas/full-hh-rlhf"
    assert (args.data.input_key, args.data.output_key, args.data.input_template) == ("prompt", "chosen", "{}")
    # The SFT output is the RL script's default policy.
    (rl,) = calls[case_id("train_hh_rl.sh", {})]
    rl_args = train_ppo_ray_argv(rl)
    assert rl_args[rl_args.index("--actor.model_name_or_path") + 1] == args.ckpt.output_dir


def test_serve_rm_accepts_the_server_flags(calls, monkeypatch):
    from openrlhf_geo.rewards import armorm

    class Parsed(Exception):
        pass

    def scorer(*args):
        raise Parsed(args)

    (argv,) = calls[case_id("serve_armorm.sh", {})]
    assert argv[:2] == ["openrlhf-geo", "serve-rm"]
    monkeypatch.setattr(armorm, "ArmoRMScorer", scorer)
    with pytest.raises(Parsed) as caught:
        armorm.main(argv[2:])
    assert caught.value.args[0] == ("RLHFlow/ArmoRM-Llama3-8B-v0.1", "cuda", "bf16", 16, 4096)


# ── prepare_math_data.py ──


def _prepare():
    spec = importlib.util.spec_from_file_location("prepare_math_data", SCRIPTS / "prepare_math_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _prepare()


def dapo_record(problem, answer):
    content = prepare.DAPO_PREFIX + problem + prepare.DAPO_SUFFIX
    return {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": answer}}


def test_dapo_problems_lose_their_answer_line_instruction_and_duplicates():
    records = [dapo_record("Find $x$ if $2x = 6$.", "3"), dapo_record("Find $x$ if $2x = 6$.", "3")]
    records.append(dapo_record("What is $\\frac{1}{2} + \\frac{1}{3}$?", "5/6"))
    rows = prepare.convert(records, prepare.dapo_example)
    assert [r["answer"] for r in rows] == ["3", "5/6"]
    assert rows[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Find $x$ if $2x = 6$."},
    ]
    assert not any("Answer:" in m["content"] for r in rows for m in r["prompt"])


def test_a_changed_dapo_format_is_refused():
    record = {"prompt": [{"role": "user", "content": "Solve: 1+1"}], "reward_model": {"ground_truth": "2"}}
    with pytest.raises(ValueError, match="DAPO_PREFIX/DAPO_SUFFIX"):
        prepare.dapo_example(record)


def test_math_gold_is_the_last_box_of_the_solution():
    solution = "Guessing $\\boxed{2}$ fails, since $2 \\cdot 2 \\ne 3$. So the answer is $\\boxed{\\frac{3}{4}}$."
    assert prepare.math_example({"problem": " Compute $x$. ", "solution": solution}) == (
        "Compute $x$.",
        "\\frac{3}{4}",
    )
    with pytest.raises(ValueError, match="without a boxed answer"):
        prepare.math_example({"problem": "p", "solution": "the answer is 4"})


@pytest.mark.parametrize("placement", ["system", "user"])
def test_training_prompts_are_the_eval_harness_prompts(placement):
    """What the policy's chat template renders in training equals what `openrlhf-geo eval` renders."""
    from openrlhf_geo.eval.harness import render_prompt

    class Template:  # renders a message list as its repr, like a chat template would render it as text
        chat_template = "stand-in"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return repr(messages)

    (row,) = prepare.convert([{"problem": "1+1?", "answer": 2}], prepare.aime_example, placement=placement)
    assert row["answer"] == "2"
    assert repr(row["prompt"]) == render_prompt(Template(), "1+1?", SYSTEM_PROMPT, placement)
    with pytest.raises(ValueError, match="--placement"):
        prepare.chat_prompt("1+1?", "assistant")


def test_prepare_cli_writes_the_requested_sets_from_the_hub(tmp_path, monkeypatch, capsys):
    hub = {"HuggingFaceH4/aime_2024": [{"problem": "1+1?", "answer": 2}, {"problem": "2+2?", "answer": "4"}]}
    requested = []

    def load_dataset(name, split):
        requested.append((name, split))
        return hub[name]

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    assert prepare.main(["--out", str(tmp_path), "aime24"]) == 0
    assert requested == [("HuggingFaceH4/aime_2024", "train")]
    rows = [json.loads(line) for line in (tmp_path / "aime24.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["2", "4"] and "aime24: 2 prompts" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aime24.jsonl"]


@pytest.mark.fork
def test_prepared_rows_feed_upstreams_prompt_preprocessing(up, tmp_path):
    from openrlhf.datasets.prompts_dataset import preprocess_data

    prepare.write_jsonl(
        prepare.convert([{"problem": "1+1?", "answer": 2}], prepare.aime_example), tmp_path / "a.jsonl"
    )
    (row,) = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    seen = []

    def template(chat, tokenize, add_generation_prompt):
        seen.append((chat, tokenize, add_generation_prompt))
        return "RENDERED"

    # The flags the math scripts pass: --data.input_key prompt --data.label_key answer --data.apply_chat_template
    prompt, label = preprocess_data(row, None, "prompt", "answer", apply_chat_template=template)
    assert (prompt, label) == ("RENDERED", "2")
    assert seen == [([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "1+1?"}], False, True)]
    assert not list(tmp_path.glob("*.tmp"))
