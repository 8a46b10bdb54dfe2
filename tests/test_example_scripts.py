"""examples/scripts/: every launch script parses, every flag it passes is accepted by the parser that reads it, and
the recipes are the papers' (SALT arXiv 2606.05800 Table 4 / §4.1 / App. C.2; GeoAlign arXiv 2606.26917 §5, App. B).

The scripts run for real under bash with `ray`, `deepspeed`, `python`/`python3` and `openrlhf-geo` replaced by
stubs that record their argv, so bash's own variable and array expansion is what gets checked. A `ray job submit`
call goes through Ray's own CLI parser, and its entrypoint is replayed through `/bin/sh` the way Ray's job
supervisor runs it (argv joined by `subprocess.list2cmdline`, executed with `shell=True`). The resulting
train-ppo-ray argv goes through the patched upstream parser (`parse` of fork_helpers.py: upstream
train_ppo_ray as __main__ through `openrlhf-geo train-ppo-ray`, stopped where training starts), an `eval` argv
through `openrlhf-geo eval`'s parser, the SFT argv through DeepSpeed's launcher and upstream train_sft's parser,
and the ArmoRM server's through `openrlhf-geo serve-rm`'s.
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
from fork_helpers import parse
from hypothesis import given
from hypothesis import strategies as st

from openrlhf_geo import options
from openrlhf_geo.eval import harness
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
# SALT App. I / Table 4's entropy-control baselines: the GRPO recipe with these deviations (check_salt_table4)
SALT_BASELINE_RECIPES = {
    "train_math_clip_cov.sh": {"eps": (1.0, 1.0)},  # Table 4's Clip-Covariance clip ratios
    "train_math_kl_cov.sh": {},
    "train_math_entropy_bonus.sh": {"entropy_coef": 0.001},  # lambda_ENT: not in the text (the script says so)
}
# GeoAlign App. B.5's baselines the fork runs, in train_math_geoalign.sh's recipe (PODS and PAR: local engine only)
GEOALIGN_BASELINE_SCRIPTS = ("train_math_pf_ppo.sh", "train_math_seed_grpo.sh")
SALT_SCRIPTS = (
    "train_math_grpo.sh",
    "train_math_dapo.sh",
    "sweep_rollout_scaling.sh",
    "sweep_fixed_alpha.sh",
    *SALT_BASELINE_RECIPES,
)
GEOALIGN_SCRIPTS = ("train_math_geoalign.sh", "train_hh_sft.sh", "train_hh_rl.sh", *GEOALIGN_BASELINE_SCRIPTS)
SALT_SEEDS = ("2025", "2026", "2027", "2028", "2029")  # SALT App. H
G_VALUES = (2, 4, 8, 16, 32, 64, 128, 256)  # SALT §4.4
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)  # SALT Fig. 4(b)
SALT_BENCHMARKS = {"aime24", "aime25", "gsm8k", "math500", "gpqa_diamond"}  # SALT §4.1
# The environment variables each script is run with: its defaults and every switch it documents.
VARIANTS = {
    "train_math_grpo.sh": [
        {},
        {"SALT": "1"},
        {"SALT": "1", "MODEL_SIZE": "7B", "DATASET": "dapo_math_17k", "SEED": "2029", "NUM_NODES": "2"},
        {"EVAL": "0"},
    ],
    "train_math_dapo.sh": [{}, {"SALT": "1"}, {"SALT": "1", "MODEL_SIZE": "7B", "DATASET": "math_train"}],
    "train_math_geoalign.sh": [
        {},
        {"GEOALIGN": "1"},
        {"NOISE_RATE": "0.05"},
        {"GEOALIGN": "1", "NOISE_RATE": "0.1", "MODEL_SIZE": "4B"},
    ],
    "train_hh_sft.sh": [{}, {"MODEL_SIZE": "4B"}],
    "train_hh_rl.sh": [
        {},
        {"GEOALIGN": "1"},
        {"NOISE_RATE": "0.05"},
        {"GEOALIGN": "1", "NOISE_RATE": "0.1", "MODEL_SIZE": "4B", "RM_URL": "http://rm-host:5000/get_reward"},
    ],
    "serve_armorm.sh": [{"RM_TOKEN": "secret"}, {"RM_ALLOW_UNAUTHENTICATED": "1"}],
    "smoke_cpu.sh": [{}],
    "sweep_rollout_scaling.sh": [{}],
    "sweep_fixed_alpha.sh": [{}],
    FORK_HELPERS_SCRIPT: [{}],
    "train_math_clip_cov.sh": [{}, {"MODEL_SIZE": "7B", "DATASET": "dapo_math_17k", "SEED": "2026"}],
    "train_math_kl_cov.sh": [{}, {"EVAL": "0"}],
    "train_math_entropy_bonus.sh": [{}, {"ENTROPY_COEF": "0.005", "MODEL_SIZE": "7B"}],
    "train_math_pf_ppo.sh": [
        {},
        {"PF_PPO_MODE": "bw"},
        {"PF_PPO_MODE": "bw", "NOISE_RATE": "0.1", "MODEL_SIZE": "4B"},
    ],
    "train_math_seed_grpo.sh": [{}, {"NOISE_RATE": "0.05"}, {"SEED_GRPO_ALPHA": "1.0", "MODEL_SIZE": "4B"}],
}
CASES = [(script, env) for script, envs in VARIANTS.items() for env in envs]


def case_id(script, env):
    return f"{script}[{' '.join(f'{k}={v}' for k, v in env.items()) or 'defaults'}]"


# Switch -> the flags it may change (besides run names and output folders).
SWITCHES = [
    ("train_math_grpo.sh", {"SALT": "1"}, ("salt.",)),
    ("train_math_dapo.sh", {"SALT": "1"}, ("salt.",)),
    ("train_math_geoalign.sh", {"GEOALIGN": "1"}, ("geoalign.",)),
    ("train_math_geoalign.sh", {"NOISE_RATE": "0.05"}, ("reward.noise.",)),
    ("train_hh_rl.sh", {"GEOALIGN": "1"}, ("geoalign.",)),
    ("train_hh_rl.sh", {"NOISE_RATE": "0.05"}, ("reward.noise.",)),
    ("train_math_pf_ppo.sh", {"PF_PPO_MODE": "bw"}, ("baseline.curation",)),
    ("train_math_seed_grpo.sh", {"NOISE_RATE": "0.05"}, ("reward.noise.",)),
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
    """The files the scripts look for before they would call a prepare_*.py script."""
    row = '{"prompt": [], "prompt_text": "", "answer": "1", "datasource": "x"}\n'
    for name in ("math_train", "dapo_math_17k", "aime24", "aime25"):
        (data_dir / f"{name}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (data_dir / f"{name}.jsonl").write_text(row)
    for model in ("Qwen3-1.7B", "Qwen3-4B"):
        for name in ("dapo_math_17k", "geoalign_eval"):
            (data_dir / f"{model}_no-thinking" / f"{name}.jsonl").parent.mkdir(parents=True, exist_ok=True)
            (data_dir / f"{model}_no-thinking" / f"{name}.jsonl").write_text(row)
    (data_dir / "hh").mkdir(parents=True, exist_ok=True)
    for name in ("hh_sft", "hh_rl", "hh_test"):
        (data_dir / "hh" / f"{name}.jsonl").write_text('{"prompt": "\\n\\nHuman: hi\\n\\nAssistant:"}\n')


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    make_data(home / "openrlhf-geo" / "data")
    # the models and data the stubbed steps would write, which the fork's parser checks exist: train_hh_sft.sh's
    # output (train_hh_rl.sh's policy) and smoke_cpu.py's assets (smoke_salt_geoalign_1gpu.sh's)
    for size in ("1.7b", "4b"):
        (home / "openrlhf-geo" / "runs" / f"qwen3-{size}-base_hh_sft" / "final").mkdir(parents=True)
    smoke_assets = home / "runs" / "smoke_salt_geoalign_1gpu" / "assets"
    (smoke_assets / "model").mkdir(parents=True)
    (smoke_assets / "prompts.jsonl").write_text('{"input": "", "label": ""}\n')
    return home


@pytest.fixture(scope="module")
def runs(home):
    """(script, variant id) -> (CompletedProcess, argv of every stubbed call the script made)."""
    return {case_id(script, env): run_script(script, env, home) for script, env in CASES}


@pytest.fixture(scope="module")
def calls(runs):
    return {key: made for key, (_, made) in runs.items()}


def ray_submit(argv):
    """`ray job submit ...` parsed by Ray's own CLI -> its parameters (entrypoint as a list)."""
    from ray.dashboard.modules.job.cli import submit

    assert argv[:3] == ["ray", "job", "submit"], argv[:6]
    params = submit.make_context("submit", argv[3:]).params
    return {**params, "entrypoint": list(params["entrypoint"])}


def ray_shell_round_trip(entrypoint):
    """The argv the job's process receives: Ray joins the entrypoint with list2cmdline and runs it via /bin/sh."""
    line = "printf '%s\\0' " + subprocess.list2cmdline(entrypoint)
    done = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True)
    return done.stdout.split("\0")[:-1]


def cli_argv(argv, command):
    """The arguments of an `openrlhf_geo.cli COMMAND` call (a ray job or a direct `python -m` call), or None."""
    if argv[0] == "ray":
        argv = ray_shell_round_trip(ray_submit(argv)["entrypoint"])
    if argv[0] in ("python", "python3") and argv[1:4] == ["-m", "openrlhf_geo.cli", command]:
        return argv[4:]
    return None


def train_ppo_ray_argv(argv):
    return cli_argv(argv, "train-ppo-ray")


def flatten(ns, prefix=""):
    """Nested namespaces -> {"a.b.c": value}, the flags only (not `geometry`: the configuration options.validate
    derives from them)."""
    flat = {}
    for key, value in vars(ns).items():
        if not prefix and key == "geometry":
            continue
        if isinstance(value, SimpleNamespace):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ── the scripts as files ──


@pytest.mark.parametrize("script", sorted(p.relative_to(SCRIPTS).as_posix() for p in SCRIPTS.rglob("*.sh")))
def test_script_passes_bash_n(script):  # the scripts and the library they source (lib/common.sh)
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
    # Every value is either the paper's (with its table/section) or marked as not checkable; no stale markers.
    assert "NOT verified" not in text
    if script in SALT_SCRIPTS:
        assert "Table 4" in header and "arXiv 2606.05800" in header
    if script in GEOALIGN_SCRIPTS:
        assert "arXiv 2606.26917" in header and "NOT in the text (Table 6" in header


def test_readme_lists_every_script():
    readme = (REPO / "examples" / "README.md").read_text()
    for script in (*VARIANTS, "prepare_math_data.py", "prepare_hh_data.py"):
        assert f"`{script}`" in readme, script
    assert "NOT verified" not in readme


def test_scripts_hold_no_secrets():
    secret = re.compile(r"hf_[A-Za-z0-9]{30,}|\b[0-9a-f]{40}\b|sk-[A-Za-z0-9]{20,}|(api_key|token)\s*=\s*['\"]?\w{8,}")
    for path in SCRIPTS.rglob("*.sh"):
        assert not secret.search(path.read_text()), path.name


# ── what the scripts launch ──


@pytest.mark.parametrize("script,env", CASES, ids=[case_id(s, e) for s, e in CASES])
def test_script_runs_to_its_launch(runs, script, env):
    done, made = runs[case_id(script, env)]
    assert done.returncode == 0 and made, done.stderr


def test_every_launch_is_recorded(calls):
    tools = {key: [argv[0] for argv in made] for key, made in calls.items()}
    assert tools[case_id("train_hh_sft.sh", {})] == ["deepspeed"]
    assert tools[case_id("serve_armorm.sh", {"RM_TOKEN": "secret"})] == ["openrlhf-geo"]
    assert tools[case_id("smoke_cpu.sh", {})] == ["python"] * 3  # import checks, then smoke_cpu.py
    # train + eval per run: 8 G x 4 methods, 5 alphas
    assert tools[case_id("sweep_rollout_scaling.sh", {})] == ["ray"] * 2 * 8 * 4
    assert tools[case_id("sweep_fixed_alpha.sh", {})] == ["ray"] * 2 * 5
    for script, env in CASES:
        if script in ("train_math_grpo.sh", "train_math_dapo.sh"):
            assert tools[case_id(script, env)] == ["ray"] * (1 if env.get("EVAL") == "0" else 2)
        if script in ("train_math_geoalign.sh", "train_hh_rl.sh"):
            assert tools[case_id(script, env)] == ["ray"], case_id(script, env)


def test_jobs_set_only_working_dir_and_env_vars(calls):
    """Job-level runtime env: the fork adds py_modules itself, and upstream's ray.init sets three env vars, so the
    same field or env var at job level would be a hard error in Ray. Eval jobs reserve one GPU for the entrypoint."""
    upstream_env = {"TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"}
    jobs = [argv for made in calls.values() for argv in made if argv[0] == "ray"]
    # + the SALT baselines (train + eval, KL-Cov's EVAL=0: train only) and the GeoAlign baselines (train only)
    assert len(jobs) == (4 * 2 - 1) + 3 * 2 + 4 + 4 + 64 + 10 + (2 * 2 + 3 + 2 * 2) + (3 + 3)
    for argv in jobs:
        job = ray_submit(argv)
        is_eval = cli_argv(argv, "eval") is not None
        assert job["entrypoint_num_gpus"] == (1 if is_eval else None)
        assert job["address"] == "http://127.0.0.1:8265" and not job["no_wait"]
        assert (job["runtime_env"], job["working_dir"], job["entrypoint_num_cpus"]) == (None, None, None)
        env = json.loads(job["runtime_env_json"])
        assert set(env) == {"working_dir", "env_vars"}
        assert Path(env["working_dir"]) == REPO
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env["env_vars"].items())
        assert not set(env["env_vars"]) & upstream_env
        assert all(k.startswith("OPENRLHF_GEO_") for k in env["env_vars"])


def test_job_entrypoints_survive_rays_shell(calls):
    for key, made in calls.items():
        for argv in made:
            if argv[0] == "ray":
                entrypoint = ray_submit(argv)["entrypoint"]
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


def test_math_reward_mode_follows_the_algorithm(calls):
    """SALT App. C.2: GRPO rewards 1 / 0, DAPO +1 / -1 (OPENRLHF_GEO_MATH_MODE); GeoAlign App. B.3: 1.0 / 0.0."""
    for key, made in calls.items():
        for argv in made:
            args = train_ppo_ray_argv(argv)
            if args and argv[0] == "ray" and "math_verify" in args[args.index("--reward.remote_url") + 1]:
                mode = json.loads(ray_submit(argv)["runtime_env_json"])["env_vars"]["OPENRLHF_GEO_MATH_MODE"]
                assert mode == ("dapo" if "--algo.dynamic_filtering_enable" in args else "grpo"), key


def test_wandb_logging_follows_wandb_api_key(home):
    _, without = run_script("train_math_grpo.sh", {}, home)
    assert not any(a.startswith("--logger.wandb") for argv in without for a in argv)
    _, with_key = run_script("train_math_grpo.sh", {}, home, {"WANDB_API_KEY": "test-key-not-a-secret"})
    args = train_ppo_ray_argv(with_key[0])
    assert args[args.index("--logger.wandb.key") + 1] == "test-key-not-a-secret"
    assert args[args.index("--logger.wandb.group") + 1] == "r1-distill-qwen-1.5B_math_train_grpo"
    assert args[args.index("--logger.wandb.run_name") + 1] == "r1-distill-qwen-1.5B_math_train_grpo_seed2025"


@pytest.mark.parametrize(
    "script,env,variable",
    [
        ("train_math_grpo.sh", {"SALT": "yes"}, "SALT"),
        ("train_math_grpo.sh", {"EVAL": "yes"}, "EVAL"),
        ("train_math_dapo.sh", {"MODEL_SIZE": "3B"}, "MODEL_SIZE"),
        ("train_math_grpo.sh", {"DATASET": "gsm8k"}, "DATASET"),
        ("train_math_geoalign.sh", {"GEOALIGN": "2"}, "GEOALIGN"),
        ("train_math_geoalign.sh", {"NOISE_RATE": "0.2"}, "NOISE_RATE"),
        ("train_hh_rl.sh", {"GEOALIGN": "on"}, "GEOALIGN"),
        ("train_hh_rl.sh", {"MODEL_SIZE": "8B"}, "MODEL_SIZE"),
        ("train_hh_sft.sh", {"MODEL_SIZE": "8B"}, "MODEL_SIZE"),
        ("sweep_rollout_scaling.sh", {"G_LIST": "2 3"}, "G=3"),
        ("sweep_rollout_scaling.sh", {"METHODS": "ppo"}, "METHODS"),
        ("sweep_fixed_alpha.sh", {"ALPHAS": "0.5 2"}, "ALPHAS"),
        ("train_math_entropy_bonus.sh", {"ENTROPY_COEF": "0"}, "ENTROPY_COEF"),
        ("train_math_pf_ppo.sh", {"PF_PPO_MODE": "best"}, "PF_PPO_MODE"),
        ("train_math_seed_grpo.sh", {"SEED_GRPO_ALPHA": "1.5"}, "SEED_GRPO_ALPHA"),
        ("train_math_clip_cov.sh", {"MODEL_SIZE": "3B"}, "MODEL_SIZE"),
    ],
)
def test_bad_switch_values_fail_before_submitting_anything(home, script, env, variable):
    done, made = run_script(script, env, home)
    assert done.returncode == 2 and variable in done.stderr
    # the sweep checks each G as it reaches it: G=2 (4 methods, train + eval) went first
    assert made == [] or (script.startswith("sweep_") and variable == "G=3" and len(made) == 8)


def test_missing_math_data_is_prepared_before_the_job(home, tmp_path):
    done, made = run_script("train_math_dapo.sh", {"DATA_DIR": str(tmp_path)}, home)
    assert done.returncode == 0, done.stderr
    prep, job, evaluation = made
    assert prep[:2] == ["python3", str(SCRIPTS / "prepare_math_data.py")]
    assert prep[2:] == ["--out", str(tmp_path), "dapo_math_17k", "aime24", "aime25"]
    assert job[0] == evaluation[0] == "ray"


@pytest.mark.parametrize("size", ["1.7B", "4B"])
def test_geoalign_prompts_are_rendered_with_thinking_off(home, tmp_path, size):
    """GeoAlign App. B.3: enable_thinking=False for Qwen3, applied by the model's own chat template once."""
    done, made = run_script("train_math_geoalign.sh", {"DATA_DIR": str(tmp_path), "MODEL_SIZE": size}, home)
    assert done.returncode == 0, done.stderr
    (prep, job) = made
    out = tmp_path / f"Qwen3-{size}_no-thinking"
    assert prep[:2] == ["python3", str(SCRIPTS / "prepare_math_data.py")]
    kwargs = prep[prep.index("--chat-template-kwargs") + 1]
    assert json.loads(kwargs) == {"enable_thinking": False}
    assert prep[2:] == [
        *("--out", str(out), "--render-with", f"Qwen/Qwen3-{size}", "--chat-template-kwargs", kwargs),
        *("dapo_math_17k", "geoalign_eval"),
    ]
    args = train_ppo_ray_argv(job)
    assert args[args.index("--data.prompt_dataset") + 1] == str(out / "dapo_math_17k.jsonl")
    assert args[args.index("--eval.dataset") + 1] == str(out / "geoalign_eval.jsonl")


def test_missing_hh_data_is_prepared_before_the_job(home, tmp_path):
    for script in ("train_hh_sft.sh", "train_hh_rl.sh"):
        done, made = run_script(script, {"DATA_DIR": str(tmp_path)}, home)
        assert done.returncode == 0, done.stderr
        assert made[0] == ["python3", str(SCRIPTS / "prepare_hh_data.py"), "--out", str(tmp_path / "hh")]
        assert len(made) == 2


# ── the real parsers ──


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


@pytest.fixture(scope="module")
def evals(calls):
    """(script, variant id) -> the args of `openrlhf-geo eval`'s parser for each eval job."""
    return {
        key: [harness.build_parser().parse_args(a) for a in (cli_argv(argv, "eval") for argv in made) if a is not None]
        for key, made in calls.items()
    }


def accepted(launches):
    for args in launches:
        assert not isinstance(args, str), args
    return launches


def eval_files(args):
    return [Path(p) for p in args.eval.dataset.split(",")]


def check_salt_table4(args, eps=(0.2, 0.2), entropy_coef=0):
    """SALT Table 4's shared block (and §4.1) in 0.11.2's units: batch sizes in prompts (rollout) and samples; `eps`
    and `entropy_coef` are the GRPO values a baseline's block replaces (SALT_BASELINE_RECIPES)."""
    assert args.rollout.n_samples_per_prompt in (8, *G_VALUES)  # 8 except in the rollout-scaling sweep
    assert args.rollout.temperature == args.eval.temperature == 0.6 and args.rollout.top_p == 1.0
    assert args.actor.adam.lr == 1e-6 and (args.actor.lr_scheduler, args.actor.lr_warmup_ratio) == ("constant", 0)
    assert args.actor.entropy_coef == entropy_coef
    assert args.algo.kl.use_loss and args.algo.kl.init_coef == 0.001 and args.algo.kl.estimator == "k3"
    assert args.rollout.max_new_tokens == 8192 and args.data.max_len == 1024 + 8192
    assert args.train.batch_size == 32 * 8  # mini-batch 32 prompts x 8 (the sweep keeps the samples fixed)
    assert args.train.max_epochs == 1
    assert args.eval.n_samples_per_prompt == 8  # "the same sampling configuration for validation"
    assert [p.name for p in eval_files(args)] == ["aime24.jsonl", "aime25.jsonl"]
    assert args.actor.model_name_or_path.startswith("deepseek-ai/DeepSeek-R1-Distill-Qwen-")
    assert args.data.input_key == "prompt" and args.data.label_key == "answer" and args.data.apply_chat_template
    if args.algo.dynamic_filtering_enable:  # DAPO block
        assert tuple(args.actor.eps_clip_low_high) == (0.2, 0.28) and args.actor.loss_agg_mode == "token-mean"
        assert tuple(args.algo.dynamic_filtering_range) == (0, 1)
    else:  # GRPO, Eq. 3
        assert tuple(args.actor.eps_clip_low_high) == eps
        assert args.actor.loss_agg_mode == "seq-mean-token-mean"
    assert args.reward.overlong_buffer_len is None  # App. C.2: no overlong shaping
    assert args.salt.diagnostics != args.salt.enable  # baselines log SALT's geometry too


def check_recipe(script, env, args):
    """What each script's header promises, read back from the parsed args."""
    colocated_gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    assert args.vllm.num_engines * args.vllm.tensor_parallel_size == colocated_gpus  # train() asserts it later
    rollouts = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    assert rollouts % args.train.batch_size == 0  # whole optimizer steps per rollout step
    assert args.actor.num_nodes == int(env.get("NUM_NODES", 1))
    assert Path(args.data.prompt_dataset).is_file() and all(p.is_file() for p in eval_files(args))
    if script in SALT_SCRIPTS:
        recipe = dict(SALT_BASELINE_RECIPES.get(script, {}))
        if "ENTROPY_COEF" in env:  # the entropy-bonus script's lambda_ENT switch
            recipe["entropy_coef"] = float(env["ENTROPY_COEF"])
        check_salt_table4(args, **recipe)
        assert str(args.train.seed) == env.get("SEED", "2025") and env.get("SEED", "2025") in SALT_SEEDS
    if script in ("train_math_grpo.sh", "train_math_dapo.sh"):
        assert args.salt.enable == (env.get("SALT") == "1")
        assert (args.rollout.batch_size, args.train.num_episodes) == (64, 2)  # train batch 64 prompts, 2 epochs
        size = env.get("MODEL_SIZE", "1.5B")
        assert args.actor.model_name_or_path == f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{size}"
        dataset = env.get("DATASET", "math_train" if script == "train_math_grpo.sh" else "dapo_math_17k")
        assert Path(args.data.prompt_dataset).name == f"{dataset}.jsonl"
        assert args.algo.dynamic_filtering_enable == (script == "train_math_dapo.sh")
    if script in ("train_math_geoalign.sh", "train_hh_rl.sh"):
        assert args.algo.advantage.estimator == "group_norm" and not args.salt.enable  # GRPO, GeoAlign App. B.4
        assert args.geoalign.enable == (env.get("GEOALIGN") == "1")
        noise = {"train_math_geoalign.sh": "flip", "train_hh_rl.sh": "swap"}[script]
        rate = float(env.get("NOISE_RATE", 0))
        assert (args.reward.noise.type, args.reward.noise.rate) == ((noise, rate) if rate else ("none", 0.0))
    if script == "train_math_geoalign.sh":
        assert args.rollout.n_samples_per_prompt == 16
        assert args.actor.model_name_or_path == f"Qwen/Qwen3-{env.get('MODEL_SIZE', '1.7B')}"
        # thinking off: the prompts are pre-rendered text, not rendered again by upstream
        assert args.data.input_key == "prompt_text" and not args.data.apply_chat_template
        assert (args.eval.temperature, args.eval.n_samples_per_prompt, args.eval.steps) == (1.0, 1, 10)
        assert [p.name for p in eval_files(args)] == ["geoalign_eval.jsonl"]
        if args.geoalign.enable:
            assert options.geoalign_config(args).alpha == 0.05
    if script in SALT_BASELINE_RECIPES:  # GRPO's flags (train_math_grpo.sh), then Table 4's Clip-/KL-Covariance block
        assert (args.rollout.batch_size, args.train.num_episodes, args.algo.advantage.estimator) == (
            64,
            2,
            "group_norm",
        )
        assert args.actor.model_name_or_path.endswith(env.get("MODEL_SIZE", "1.5B"))
        assert Path(args.data.prompt_dataset).name == f"{env.get('DATASET', 'math_train')}.jsonl"
        baseline = options.baseline_config(args)
        loss = {"train_math_clip_cov.sh": "clip_cov", "train_math_kl_cov.sh": "kl_cov"}.get(script, "ppo")
        assert (baseline.policy_loss if baseline else "ppo") == loss
        assert baseline is None or not baseline.in_pipeline  # a loss-level baseline: the advantages are GRPO's
        if loss == "clip_cov":
            assert (baseline.clip_cov_ratio, baseline.clip_cov_lb, baseline.clip_cov_ub) == (2e-4, 1.0, 5.0)
        if loss == "kl_cov":
            assert (baseline.kl_cov_ratio, baseline.kl_cov_coef) == (2e-3, 1.0)
        if script == "train_math_entropy_bonus.sh":
            assert args.actor.entropy_coef == float(env.get("ENTROPY_COEF", 0.001)) > 0
    if script in GEOALIGN_BASELINE_SCRIPTS:  # train_math_geoalign.sh's GRPO recipe plus one baseline
        assert args.algo.advantage.estimator == "group_norm" and not args.salt.enable and not args.geoalign.enable
        rate = float(env.get("NOISE_RATE", 0))
        assert (args.reward.noise.type, args.reward.noise.rate) == (("flip", rate) if rate else ("none", 0.0))
        assert args.rollout.n_samples_per_prompt == 16 and args.data.input_key == "prompt_text"
        assert args.actor.model_name_or_path == f"Qwen/Qwen3-{env.get('MODEL_SIZE', '1.7B')}"
        assert (args.eval.temperature, args.eval.n_samples_per_prompt, args.eval.steps) == (1.0, 1, 10)
        assert args.actor.loss_agg_mode == "seq-mean-token-mean"  # PF-PPO's keep_count equivalence needs it
        baseline = options.baseline_config(args)
        if script == "train_math_pf_ppo.sh":
            assert baseline.curation == f"pf_ppo_{env.get('PF_PPO_MODE', 'br')}" and baseline.pf_ppo_keep_count
            assert baseline.seed_grpo_alpha is None
        else:
            assert baseline.seed_grpo_alpha == float(env.get("SEED_GRPO_ALPHA", 0.5)) and baseline.curation is None
    if script == "train_hh_rl.sh":
        assert args.rollout.n_samples_per_prompt == 8
        assert args.data.input_key == "prompt" and not args.data.apply_chat_template  # HH's raw text
        assert Path(args.data.prompt_dataset).name == "hh_rl.jsonl" and args.data.max_samples >= 17_226
        assert [p.name for p in eval_files(args)] == ["hh_test.jsonl"]
        assert args.reward.remote_url == [env.get("RM_URL", "openrlhf_geo/rewards/armorm.py")]
        assert args.actor.model_name_or_path.endswith(
            f"qwen3-{env.get('MODEL_SIZE', '1.7B').lower()}-base_hh_sft/final"
        )
        if args.geoalign.enable:
            config = options.geoalign_config(args)
            assert (config.alpha, config.val_acc) == (0.12, 0.85)


@pytest.mark.fork
@pytest.mark.parametrize("script,env", CASES, ids=[case_id(s, e) for s, e in CASES])
def test_train_ppo_ray_accepts_every_flag(parsed, script, env):
    launches = parsed[case_id(script, env)]
    if script in ("train_hh_sft.sh", "serve_armorm.sh", "smoke_cpu.sh"):  # smoke_cpu: tests/test_smoke_cpu.py
        assert launches == []
        return
    expected = {"sweep_rollout_scaling.sh": 8 * 4, "sweep_fixed_alpha.sh": 5}.get(script, 1)
    assert len(accepted(launches)) == expected
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
def test_rollout_scaling_holds_the_budget_fixed_for_grpo_and_dapo(parsed):
    """SALT §4.4 / Fig. 4(c): G = 2 ... 256 at a fixed rollout budget, GRPO and DAPO, each ± SALT."""
    per_step, total, optimizer_steps, arms = set(), set(), set(), set()
    for args in accepted(parsed[case_id("sweep_rollout_scaling.sh", {})]):
        g = args.rollout.n_samples_per_prompt
        visits = args.data.max_samples * args.train.num_episodes
        per_step.add(args.rollout.batch_size * g)
        total.add(visits * g)
        optimizer_steps.add(visits * g // args.train.batch_size)  # upstream's max_steps for the LR schedule
        assert args.data.max_samples <= 4096  # the prompt pool (MATH-TRAIN has 7500)
        assert Path(args.data.prompt_dataset).name == "math_train.jsonl"
        arms.add((g, "dapo" if args.algo.dynamic_filtering_enable else "grpo", args.salt.enable))
    assert per_step == {512} and total == {512 * 128} and optimizer_steps == {256}
    assert arms == {(g, algo, salt) for g in G_VALUES for algo in ("grpo", "dapo") for salt in (False, True)}


@pytest.mark.fork
def test_fixed_alpha_sweep_is_salt_with_only_alpha_fixed(parsed):
    """SALT Fig. 4(b) / App. F.3.1: the alphas, and train_math_grpo.sh SALT=1 in every other flag."""
    (reference,) = accepted(parsed[case_id("train_math_grpo.sh", {"SALT": "1"})])
    reference = flatten(reference)
    alphas = []
    for args in accepted(parsed[case_id("sweep_fixed_alpha.sh", {})]):
        assert args.salt.enable and args.salt.variant == "fixed-alpha"
        alphas.append(args.salt.alpha)
        flat = flatten(args)
        changed = {k for k in flat.keys() | reference.keys() if flat.get(k) != reference.get(k)}
        assert {k for k in changed if not k.startswith(("ckpt.", "logger."))} == {"salt.variant", "salt.alpha"}
    assert alphas == list(ALPHAS)


def test_salt_runs_are_evaluated_as_the_paper_reports(calls, evals):
    """SALT §4.1 / App. D.2: ACC (pass@1) and Pass@8 from 8 samples at T = 0.6 on the five benchmarks, the final
    model of the run just trained, the summary next to its training outputs (openrlhf-geo report's layout)."""
    seen = 0
    for script, env in CASES:
        key = case_id(script, env)
        jobs = [a for a in map(train_ppo_ray_argv, calls[key]) if a is not None]
        if script not in SALT_SCRIPTS:
            assert evals[key] == [], key
            continue
        assert len(evals[key]) == (0 if env.get("EVAL") == "0" else len(jobs))
        for train, args in zip(jobs, evals[key]):
            final = Path(train[train.index("--ckpt.output_dir") + 1])
            assert Path(args.model) == final and Path(args.output_dir) == final.parent
            assert re.fullmatch(r"seed20(2[5-9])", final.parent.name)
            assert set(args.benchmarks.split(",")) == SALT_BENCHMARKS
            assert (args.n, args.k, args.temperature, args.top_p) == (8, [1, 8], 0.6, 1.0)
            assert args.max_new_tokens == 8192 and args.prompt_placement == "system" and args.from_hub
            assert args.system_prompt == SYSTEM_PROMPT  # SALT App. C.2
            seen += 1
    assert seen == 3 + 3 + 32 + 5 + 5  # train_math_grpo (EVAL=0 has none), train_math_dapo, the two sweeps, the
    # SALT baselines (KL-Cov's EVAL=0 has none)


class Parsed(Exception):
    pass


@pytest.mark.fork
@pytest.mark.parametrize("size", ["1.7B", "4B"])
def test_train_sft_accepts_the_sft_flags(calls, up, monkeypatch, size):
    import deepspeed.launcher.runner

    sizes = {"1.7B": {}, "4B": {"MODEL_SIZE": "4B"}}
    (argv,) = calls[case_id("train_hh_sft.sh", sizes[size])]
    launcher = deepspeed.launcher.runner.parse_args(argv[1:])
    assert launcher.module and launcher.user_script == "openrlhf.cli.train_sft" and launcher.num_gpus == 8

    def stop(args):
        raise Parsed(args)

    monkeypatch.setattr(up.utils, "get_strategy", stop)  # train()'s first call
    monkeypatch.setattr(sys, "argv", ["openrlhf.cli.train_sft", *launcher.user_args])
    with pytest.raises(Parsed) as caught:
        runpy.run_module("openrlhf.cli.train_sft", run_name="__main__", alter_sys=True)
    args = caught.value.args[0]
    assert args.model.model_name_or_path == f"Qwen/Qwen3-{size}-Base"  # GeoAlign App. B.3
    assert Path(args.data.dataset).name == "hh_sft.jsonl"
    assert (args.data.input_key, args.data.output_key, args.data.input_template) == ("prompt", "chosen", "{}")
    # The SFT output is the RL script's default policy for the same size; SFT and RL data come from one split.
    rl_env = {"1.7B": {}, "4B": {"GEOALIGN": "1", "NOISE_RATE": "0.1", "MODEL_SIZE": "4B"}}[size]
    rl_env = next(env for script, env in CASES if script == "train_hh_rl.sh" and rl_env.items() <= env.items())
    (rl,) = calls[case_id("train_hh_rl.sh", rl_env)]
    rl_args = train_ppo_ray_argv(rl)
    assert rl_args[rl_args.index("--actor.model_name_or_path") + 1] == args.ckpt.output_dir
    assert Path(rl_args[rl_args.index("--data.prompt_dataset") + 1]).parent == Path(args.data.dataset).parent


def test_serve_rm_accepts_the_server_flags(calls, monkeypatch):
    from openrlhf_geo.rewards import armorm

    def scorer(*args, **kwargs):
        raise Parsed(args)

    class Server:  # the script binds 0.0.0.0: no test listens there
        def server_close(self):
            pass

    monkeypatch.setattr(armorm, "ArmoRMScorer", scorer)
    monkeypatch.setattr(armorm, "make_server", lambda *args, **kwargs: Server())
    for env in VARIANTS["serve_armorm.sh"]:
        (argv,) = calls[case_id("serve_armorm.sh", env)]
        assert argv[:2] == ["openrlhf-geo", "serve-rm"]
        assert ("--allow-unauthenticated" in argv) == ("RM_TOKEN" not in env)
        if "RM_TOKEN" in env:  # the script hands the token over in the environment
            monkeypatch.setenv(armorm.ENV_AUTH_TOKEN, env["RM_TOKEN"])
        else:
            monkeypatch.delenv(armorm.ENV_AUTH_TOKEN, raising=False)
        with pytest.raises(Parsed) as caught:
            armorm.main(argv[2:])
        assert caught.value.args[0] == ("RLHFlow/ArmoRM-Llama3-8B-v0.1", "cuda", "bf16", 16, 4096)


def test_serve_armorm_without_a_token_refuses_to_listen_on_every_interface(tmp_path):
    done, made = run_script("serve_armorm.sh", {}, tmp_path)
    assert done.returncode == 1 and made == []
    assert "set RM_TOKEN" in done.stderr


# ── prepare_math_data.py ──


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _load_script("prepare_math_data")
prepare_hh = _load_script("prepare_hh_data")


def dapo_record(problem, answer):
    content = prepare.DAPO_PREFIX + problem + prepare.DAPO_SUFFIX
    return {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": answer}}


def test_dapo_problems_lose_their_answer_line_instruction_and_duplicates():
    records = [dapo_record("Find $x$ if $2x = 6$.", "3"), dapo_record("Find $x$ if $2x = 6$.", "3")]
    records.append(dapo_record("What is $\\frac{1}{2} + \\frac{1}{3}$?", "5/6"))
    rows = prepare.convert(map(prepare.dapo_example, records), "dapo_math_17k")
    assert [r["answer"] for r in rows] == ["3", "5/6"]
    assert rows[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Find $x$ if $2x = 6$."},
    ]
    assert {r["datasource"] for r in rows} == {"dapo_math_17k"}
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

    (row,) = prepare.convert([("1+1?", "2")], "aime24", placement=placement)
    assert row["answer"] == "2"
    assert repr(row["prompt"]) == render_prompt(Template(), "1+1?", SYSTEM_PROMPT, placement)
    with pytest.raises(ValueError, match="--placement"):
        prepare.chat_prompt("1+1?", "assistant")


def test_geoalign_suite_repeats_aime_8_and_amc_4_times():
    """GeoAlign App. B.2: AIME24/25 avg@8, AMC23 avg@4, one sample for MATH500, Minerva, OlympiadBench."""
    assert dict(prepare.SUITES["geoalign_eval"]) == {
        "aime24": 8,
        "aime25": 8,
        "amc23": 4,
        "math500": 1,
        "minerva": 1,
        "olympiadbench": 1,
    }
    rows = prepare.convert([("p", "1"), ("q", "2"), ("p", "1")], "aime25", copies=8)
    assert [r["answer"] for r in rows] == ["1"] * 8 + ["2"] * 8 and {r["datasource"] for r in rows} == {"aime25"}
    rows[0]["answer"] = "changed"
    assert rows[1]["answer"] == "1"  # copies are distinct rows


def test_prepare_cli_writes_the_requested_sets_from_the_hub(tmp_path, monkeypatch, capsys):
    aime = [{"problem": "1+1?", "answer": 2}, {"problem": "2+2?", "answer": "4"}]
    amc = [{"question": "3+3?", "answer": 6.0}]
    hub = {"HuggingFaceH4/aime_2024": aime, "math-ai/aime25": aime, "math-ai/amc23": amc}
    for name in ("math500", "minerva", "olympiadbench"):
        spec = harness.BENCHMARKS[name]
        hub[spec.hub] = [{spec.problem_keys[0]: f"{name}?", spec.answer_keys[0]: "1"}]
    requested = []

    def load_dataset(name, config=None, split=None):
        requested.append((name, config, split))
        return hub[name]

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    assert prepare.main(["--out", str(tmp_path), "aime24", "geoalign_eval"]) == 0
    assert requested[0] == ("HuggingFaceH4/aime_2024", None, "train")
    rows = [json.loads(line) for line in (tmp_path / "aime24.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["2", "4"] and "aime24: 2 rows" in capsys.readouterr().out
    suite = [json.loads(line) for line in (tmp_path / "geoalign_eval.jsonl").read_text().splitlines()]
    counts = {}
    for row in suite:
        counts[row["datasource"]] = counts.get(row["datasource"], 0) + 1
    assert counts == {"aime24": 16, "aime25": 16, "amc23": 4, "math500": 1, "minerva": 1, "olympiadbench": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aime24.jsonl", "geoalign_eval.jsonl"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--chat-template-kwargs", '{"enable_thinking": false}', "aime24"], "only applies with --render-with"),
        (["--render-with", "m", "--chat-template-kwargs", "[1]", "aime24"], "must be a JSON object"),
        (["--render-with", "m", "--chat-template-kwargs", "{no", "aime24"], "must be a JSON object"),
        (["gpqa_diamond"], "unknown set 'gpqa_diamond'"),
    ],
)
def test_prepare_cli_rejects_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        prepare.main(["--out", str(tmp_path), *argv])
    assert caught.value.code == 2 and message in capsys.readouterr().err


# ChatML with Qwen3's generation-prompt clause: enable_thinking=False pre-fills an empty think block.
QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen3_like_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    return tokenizer


def test_render_passes_chat_template_arguments_to_the_real_template(qwen3_like_tokenizer):
    rows = prepare.convert([("1+1?", "2")], "aime24")
    (off,) = prepare.render([dict(r) for r in rows], qwen3_like_tokenizer, {"enable_thinking": False})
    (default,) = prepare.render([dict(r) for r in rows], qwen3_like_tokenizer, {})
    expected = (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert default["prompt_text"] == expected
    assert off["prompt_text"] == expected + "<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="no chat template"):
        prepare.render(rows, SimpleNamespace(chat_template=None), {})


@pytest.mark.fork
def test_prepared_rows_feed_upstreams_prompt_preprocessing(up, tmp_path, qwen3_like_tokenizer):
    from openrlhf.datasets.prompts_dataset import preprocess_data

    rows = prepare.render(prepare.convert([("1+1?", "2")], "aime24"), qwen3_like_tokenizer, {"enable_thinking": False})
    prepare.write_jsonl(rows, tmp_path / "a.jsonl")
    (row,) = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    seen = []

    def template(chat, tokenize, add_generation_prompt):
        seen.append((chat, tokenize, add_generation_prompt))
        return "RENDERED"

    # The SALT scripts: --data.input_key prompt --data.label_key answer --data.apply_chat_template
    prompt, label = preprocess_data(row, None, "prompt", "answer", apply_chat_template=template)
    assert (prompt, label) == ("RENDERED", "2")
    assert seen == [([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "1+1?"}], False, True)]
    # The GeoAlign math script: --data.input_key prompt_text without --data.apply_chat_template -> the text as is
    assert preprocess_data(row, None, "prompt_text", "answer", apply_chat_template=None) == (row["prompt_text"], "2")
    assert row["prompt_text"].endswith("<think>\n\n</think>\n\n")
    assert not list(tmp_path.glob("*.tmp"))


# ── prepare_hh_data.py ──


def test_hh_transcripts_split_at_the_last_assistant_turn():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine, thanks"
    assert prepare_hh.split_transcript(text) == (
        "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant:",
        " fine, thanks",
    )
    assert prepare_hh.split_transcript("\n\nHuman: hi") is None  # no answer to learn
    assert prepare_hh.split_transcript("\n\nHuman: hi\n\nAssistant:  ") is None  # an empty one neither


prompts_and_responses = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3)), min_size=1, max_size=80)


@given(pairs=prompts_and_responses, rl_size=st.integers(1, 10), sft_size=st.integers(1, 100), seed=st.integers(0, 5))
def test_hh_sft_and_rl_prompts_are_disjoint(pairs, rl_size, sft_size, seed):
    """GeoAlign App. B.1: SFT and RL samples are disjoint; the RL set has exactly rl_size distinct prompts, the SFT
    set is every other (prompt, response) row in source order, capped at sft_size."""
    pairs = [(f"P{p}", f"R{r}") for p, r in pairs]
    distinct = len({p for p, _ in pairs})
    if distinct < rl_size:
        with pytest.raises(ValueError, match="distinct prompts"):
            prepare_hh.split_disjoint(pairs, rl_size, sft_size, seed)
        return
    sft, rl = prepare_hh.split_disjoint(pairs, rl_size, sft_size, seed)
    rl_prompts = [r["prompt"] for r in rl]
    assert len(rl_prompts) == len(set(rl_prompts)) == rl_size
    assert not {r["prompt"] for r in sft} & set(rl_prompts)
    rest = [{"prompt": p, "chosen": r} for p, r in pairs if p not in set(rl_prompts)]
    assert sft == rest[:sft_size]
    assert prepare_hh.split_disjoint(pairs, rl_size, sft_size, seed) == (sft, rl)  # reproducible


def test_hh_cli_writes_disjoint_sets_from_the_hub(tmp_path, monkeypatch, capsys):
    def transcript(i, j):
        return f"\n\nHuman: q{i}\n\nAssistant: a{j}"

    hub = {
        "train": [{"chosen": transcript(i, j), "rejected": "x"} for i in range(20) for j in range(2)],
        "test": [{"chosen": transcript(100 + i, 0), "rejected": "x"} for i in (0, 0, 1)],
    }

    def load_dataset(name, split):
        assert name == "Anthropic/hh-rlhf"
        return hub[split]

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    assert prepare_hh.main(["--out", str(tmp_path), "--rl-size", "5", "--sft-size", "100"]) == 0

    def read(name):
        return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    sft, rl, test = read("hh_sft"), read("hh_rl"), read("hh_test")
    assert len(rl) == 5 and len(sft) == 2 * 15 and len(test) == 2  # test prompts deduplicated
    assert not {r["prompt"] for r in sft} & {r["prompt"] for r in rl}
    assert all(r["prompt"].endswith("\n\nAssistant:") and r["chosen"].startswith(" a") for r in sft)
    assert "the SFT set has 30 < 100" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prepare_hh.main(["--out", str(tmp_path), "--rl-size", "0"])


def _smoke_script():
    """examples/scripts/smoke_cpu.py as a module (it lives outside the package)."""
    spec = importlib.util.spec_from_file_location("smoke_cpu", SCRIPTS / "smoke_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_writes_only_into_an_output_directory_it_wrote(tmp_path, monkeypatch, capsys):
    """An existing directory of other files had its summary.json and <condition>/train.log overwritten (exit 0); a
    file or a path under one was a FileExistsError / NotADirectoryError traceback. No condition runs here."""
    import openrlhf_geo.fork.launch

    smoke = _smoke_script()
    monkeypatch.setattr(openrlhf_geo.fork.launch, "check_cpu_engines", lambda: None)
    monkeypatch.setattr(smoke.signal, "signal", lambda *args: None)  # keep pytest's own SIGTERM handling
    ran = []
    monkeypatch.setattr(smoke, "build_assets", lambda assets: ran.append(assets))
    monkeypatch.setattr(smoke, "run_condition", lambda name, *args: ran.append(name) or {"ok": True, "wall_s": 0})

    def refused(argv):
        assert smoke.main([str(a) for a in argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("smoke_cpu: OUT_DIR "), err
        return err[0]

    other = tmp_path / "other"
    (other / "salt").mkdir(parents=True)
    (other / "summary.json").write_text("mine\n")
    (other / "salt" / "train.log").write_text("mine\n")
    line = refused([other, "--conditions", "salt"])
    assert line == (
        f"smoke_cpu: OUT_DIR {other} holds files not written by `examples/scripts/smoke_cpu.py --model tiny` "
        "(salt, summary.json); choose another OUT_DIR (an empty or new directory)"
    )
    refused(["--assets-only", other])
    assert (other / "summary.json").read_text() == (other / "salt" / "train.log").read_text() == "mine\n"
    assert not ran and not (other / "command.json").exists()
    file = tmp_path / "file"
    file.write_text("")
    assert refused([file]) == f"smoke_cpu: OUT_DIR {file}: File exists"
    assert refused([file / "sub"]) == f"smoke_cpu: OUT_DIR {file / 'sub'}: Not a directory"

    own = tmp_path / "own"  # its own directory: a rerun proceeds; another smoke command's is refused
    for _ in range(2):
        assert smoke.main([str(own), "--conditions", "salt"]) == 0
    assert ran == [own / "assets", "salt"] * 2 and json.loads((own / "summary.json").read_text())["salt"]["ok"]
    assert "holds the output of `examples/scripts/smoke_cpu.py --model tiny`" in refused(["--assets-only", own])
