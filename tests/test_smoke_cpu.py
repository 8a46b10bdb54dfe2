"""The fork end to end on CPU: real Ray actors, a vLLM CPU engine, DeepSpeed (CPU accelerator), weight sync, resume.

Runs examples/scripts/smoke_cpu.py once and checks what the real runs left. By default the condition of the methods'
core path (SALT + GeoAlign + noise checkpointed at step 2: about 2 min on an idle 2-core VM;
tests/test_fork_faults.py resumes those flags' checkpoint; tests/test_smoke_multirank.py runs SALT with Table 4's KL
loss on 2 ranks); OPENRLHF_GEO_SMOKE=full runs them all, the recipes' flag sets included (about 1.5 h summed), as
`bash examples/scripts/smoke_cpu.sh` does. Checked:
the script's own checks (exit codes, finite metrics at every step, weights changed, vLLM's log-probs equal the
actor's after each weight sync, no process left behind), then, here, that each step's geometry dumped from inside
the real experience maker is what `openrlhf_geo.pipeline` computes from the same rewards, hidden states and features,
and that a resumed run continues from the checkpoint's pipeline state (with OPENRLHF_GEO_SMOKE=full; the README's
test command checks a resume in tests/test_fork_faults.py).

Needs the CPU engines (scripts/setup_cpu.sh test installs them). Without them the module is skipped, except in CI,
where a missing engine is a failure.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from smoke_helpers import SCRIPT, _assert_state_equal, _engines_missing, assert_steps_replay

REPO = Path(__file__).resolve().parents[1]
# scripts/test.sh runs pytest-xdist with --dist loadfile: one worker takes this whole module, so the smoke runs once
pytestmark = [pytest.mark.fork, pytest.mark.slow, pytest.mark.engines]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    missing = _engines_missing()
    if missing and not os.environ.get("CI"):
        pytest.skip(f"the CPU engines are not installed ({', '.join(missing)}): bash scripts/setup_cpu.sh test")
    out = tmp_path_factory.mktemp("smoke_cpu")
    done = subprocess.run(
        [sys.executable, str(REPO / "examples/scripts/smoke_cpu.py"), str(out), "--conditions", ",".join(RUN)],
        capture_output=True,
        text=True,
        timeout=3600,  # each run is also bounded by the script (SMOKE_CPU_RUN_TIMEOUT_S)
    )
    summary_path = out / "summary.json"
    assert summary_path.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads(summary_path.read_text()), done


CONDITIONS = SCRIPT.CONDITIONS
# the CI set: the methods' core path; every condition with OPENRLHF_GEO_SMOKE=full. The resume conditions run there:
# the README's test command resumes the same flags' checkpoint in tests/test_fork_faults.py (after a SIGKILL mid-save).
# `salt` (SALT's default variant, the KL loss, 2 partitions per step) is left to the full set: the README's test
# command runs the same with 2 ranks in tests/test_smoke_multirank.py
CORE = ["salt_geoalign_flip"]
# the multi-rank conditions run in tests/test_smoke_multirank.py (those of one rank, here)
FULL = [name for name, spec in CONDITIONS.items() if spec.get("ranks", 1) == 1]
RUN = FULL if os.environ.get("OPENRLHF_GEO_SMOKE") == "full" else CORE


def _ran(name):
    if name not in RUN:
        pytest.skip(f"condition {name} runs with OPENRLHF_GEO_SMOKE=full (bash examples/scripts/smoke_cpu.sh)")


def test_every_condition_ran_and_passed(smoke):
    out, summary, done = smoke
    assert list(summary) == RUN, done.stdout[-3000:]
    failed = {name: result["problems"] for name, result in summary.items() if not result["ok"]}
    assert not failed, failed
    assert done.returncode == 0
    for name in RUN:
        spec = CONDITIONS[name]
        if "fails" in spec:
            continue
        result = summary[name]
        assert result["steps"] == 2, (name, result["steps"])  # two rollout steps per episode
        assert result["weight_change"] > 0
        synced = {int(s): g for s, g in result["sync_gap"].items() if int(s) > result["first_step"]}
        if spec.get("sync", True) and not spec.get("stale"):
            assert synced and max(synced.values()) < 0.1, (name, result["sync_gap"])


def test_the_resumed_run_continues_at_step_3(smoke):
    _ran("resume")
    out, summary, _ = smoke
    assert summary["salt_geoalign_flip"]["first_step"] == 1 and summary["resume"]["first_step"] == 3


def test_a_resume_with_a_changed_flag_is_refused_in_one_line(smoke):
    _ran("resume_changed_flags")
    out, summary, _ = smoke
    from openrlhf_geo.salt import DEFAULT_DIM

    error = summary["resume_changed_flags"]["error"]
    assert error.startswith("train_ppo_ray.py: error: --ckpt.load_enable: ")  # at parse time, before Ray starts
    assert f"--salt.dim {DEFAULT_DIM} -> 1024" in error  # the checkpoint's run used the default


def _dumps(out, name):
    paths = sorted((out / name / "dump").glob("step*.pt"))
    assert paths, f"{name} dumped no step"
    return {int(p.stem[4:]): torch.load(p, weights_only=False) for p in paths}


def test_the_resumed_run_starts_from_the_checkpoints_pipeline_state(smoke):
    _ran("resume")
    out, _, _ = smoke
    before, after = _dumps(out, "salt_geoalign_flip"), _dumps(out, "resume")
    assert sorted(before) == [1, 2] and sorted(after) == [3, 4]
    saved = before[2]["state_after"]
    stages = saved["stages"]  # there was state to restore:
    assert stages["geoalign"]["projector"] is not None and stages["salt"]["entropy_range"] is not None
    _assert_state_equal(after[3]["state"], saved)


@pytest.mark.parametrize(
    "name",
    ["grpo_diagnostics", "salt", "geoalign_flip", "salt_geoalign_flip", "resume", "pf_ppo_br", "dapo_salt",
     "dapo_geoalign_flip", "gspo_salt_geoalign", "recipe_engine", "recipe_math_salt", "recipe_math_geoalign",
     "recipe_math_dapo_salt", "recipe_math_clip_cov", "recipe_math_kl_cov", "recipe_math_entropy_bonus",
     "recipe_math_pf_ppo_bw", "recipe_math_seed_grpo", "recipe_hh_geoalign", "async_salt_geoalign",
     "partial_rollout_salt_geoalign", "lora_salt_geoalign"],
)  # fmt: skip
def test_each_real_step_is_what_the_pipeline_computes_from_the_same_inputs(smoke, name):
    _ran(name)
    out, _, _ = smoke
    assert_steps_replay(name, _dumps(out, name))


@pytest.mark.parametrize("name", ["async_salt_geoalign", "partial_rollout_salt_geoalign"])
def test_the_async_trainer_trains_each_salt_partition_in_one_optimizer_step(smoke, name):
    """Upstream's asynchronous trainer (and its partial rollouts): each rollout step's 2 SALT partitions are its 2
    optimizer steps, one each (smoke_cpu.check_ranks at one rank), as in the synchronous trainer."""
    _ran(name)
    _, summary, _ = smoke
    ranks = summary[name]["ranks"]
    assert ranks["optimizer_steps_per_rollout_step"] == 2
    assert all(sorted(order) == [0, 1] for order in ranks["partition_order"].values()), ranks["partition_order"]


def test_the_multi_turn_agents_rollouts_have_both_turns_and_each_step_replays(smoke):
    _ran("agent_salt_geoalign")
    out, summary, _ = smoke
    assert summary["agent_salt_geoalign"]["action_spans"] == [{"min": 2, "max": 2}] * 2  # smoke_cpu.check_turns
    assert_steps_replay("agent_salt_geoalign", _dumps(out, "agent_salt_geoalign"))


def test_the_turns_check_fails_on_a_rollout_of_one_span_or_no_record(tmp_path):
    spec = CONDITIONS["agent_salt_geoalign"]
    dump = tmp_path / "dump"
    dump.mkdir()
    assert SCRIPT.check_turns(spec, dump, {})  # nothing recorded
    for step, spans in ((1, [2, 2, 2]), (2, [2, 1, 2])):
        torch.save({"spans": torch.tensor(spans)}, dump / f"step{step:04d}.pt")
    result = {}
    assert SCRIPT.check_turns(spec, dump, result)
    assert result["action_spans"] == [{"min": 2, "max": 2}, {"min": 1, "max": 2}]
    torch.save({"spans": torch.tensor([2, 2, 2])}, dump / "step0002.pt")
    assert SCRIPT.check_turns(spec, dump, result) == [] and SCRIPT.check_turns(CONDITIONS["salt"], dump, {}) == []


def _sync_problems(run, spec, gaps):
    (run / "dump").mkdir(parents=True, exist_ok=True)
    for step, gap in gaps.items():
        torch.save({"logprob_gap": torch.tensor([gap / 2, gap])}, run / "dump" / f"step{step:04d}.pt")
    result = SCRIPT.check_run("x", spec, run, 0, [], run, run)
    return [p for p in result["problems"] if "weight sync" in p]


def test_a_stale_runs_sync_check_compares_the_first_step_only(tmp_path):
    stale = CONDITIONS["async_salt_geoalign"]
    assert not _sync_problems(tmp_path / "a", stale, {1: 0.01, 2: 0.9})  # step 2 sampled one update behind
    assert _sync_problems(tmp_path / "b", stale, {1: 0.9, 2: 0.01})  # the same weights, different log-probs
    assert _sync_problems(tmp_path / "c", CONDITIONS["salt"], {1: 0.01, 2: 0.9})


def test_the_real_lm_sync_check_is_relative_to_the_gap_with_the_same_weights(tmp_path):
    real = SCRIPT.SMOLLM2_CONDITIONS["smollm2_salt_geoalign_flip"]
    assert not _sync_problems(tmp_path / "a", real, {1: 0.49, 2: 0.42})  # the measured run
    assert _sync_problems(tmp_path / "b", real, {1: 0.49, 2: 0.9})  # the sync widened the gap
    assert _sync_problems(tmp_path / "c", CONDITIONS["salt"], {1: 0.0, 2: 0.42})  # the tiny model: absolute


def test_the_script_refuses_a_condition_of_the_other_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        SCRIPT.main([str(tmp_path), "--model", "smollm2", "--conditions", "salt"])
    assert "unknown --conditions ['salt'] for --model smollm2" in capsys.readouterr().err


def test_the_real_lm_condition_runs_with_its_flags_reward_threads_and_limit(tmp_path, monkeypatch):
    seen = {}

    def run_group(cmd, log, env, cwd, timeout, grace):
        seen.update(locals())
        return 1, []

    monkeypatch.setattr(SCRIPT, "run_group", run_group)
    name = "smollm2_salt_geoalign_flip"
    SCRIPT.run_condition(name, SCRIPT.SMOLLM2_CONDITIONS[name], tmp_path, tmp_path / "assets", "smollm2")
    cmd = seen["cmd"]
    assert cmd[cmd.index("--reward.remote_url") + 1].endswith("openrlhf_geo/rewards/math_verify.py")
    assert cmd[len(cmd) - cmd[::-1].index("--data.max_samples")] == "8"  # the last value is argparse's
    assert seen["env"]["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)
    assert seen["timeout"] == SCRIPT.SMOLLM2_RUN_TIMEOUT_S
    assert seen["grace"] == 3  # nothing of the run may be left 3 s after its driver returned
    SCRIPT.run_condition("salt", CONDITIONS["salt"], tmp_path, tmp_path / "assets")
    assert seen["timeout"] == SCRIPT.RUN_TIMEOUT_S and "--data.label_key" in seen["cmd"]
    assert seen["cmd"][seen["cmd"].index("--reward.remote_url") + 1] == str(tmp_path / "assets" / "reward_func.py")


def test_the_hh_sft_runs_this_interpreters_deepspeed_on_the_fork_with_the_conditions_sft_flags(tmp_path, monkeypatch):
    """`python smoke_cpu.py` without the venv's bin on PATH: the SFT's launcher is the one beside the interpreter
    (a bare `deepspeed` was not found, and the HH conditions failed before their SFT)."""
    seen = {}
    fork = subprocess.CompletedProcess([], 0, stdout="/fork-copy\n")
    monkeypatch.setattr(SCRIPT.subprocess, "run", lambda *args, **kwargs: fork)
    monkeypatch.setattr(SCRIPT, "run_group", lambda cmd, log, env, cwd: seen.update(cmd=cmd, env=env) or (0, []))
    spec = CONDITIONS["recipe_hh_geoalign"]
    SCRIPT.sft(tmp_path / "assets", tmp_path, {"PATH": "/usr/bin"}, spec["sft"])
    assert seen["cmd"][0] == str(Path(sys.executable).parent / "deepspeed")
    assert seen["cmd"][-len(spec["sft"]) :] == spec["sft"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == "/fork-copy"


def recipe_flags(recipe, tmp_path):
    """The flags a condition's "recipe" stands for, as bash expands them: lib/common.sh's engine_args (ZeRO-3, the
    math recipes' vLLM memory share), or the train-ppo-ray flags a script submits ("train_math_grpo.sh SALT=1": its
    `ray` a stub that records its argv, the data it looks for in place, EVAL=0), or train_sft's flags
    (train_hh_sft.sh: its `deepspeed` a stub alike)."""
    scripts = REPO / "examples/scripts"
    if recipe == "engine_args":
        line = (
            'SCRIPT_DIR=$1; source "$SCRIPT_DIR/lib/common.sh"; engine_args 3 0.6; printf "%s\\0" "${ENGINE_ARGS[@]}"'
        )
        done = subprocess.run(["bash", "-c", line, "x", scripts], capture_output=True, text=True, check=True)
        return done.stdout.split("\0")[:-1]
    script, *switches = recipe.split()
    (tmp_path / "bin").mkdir()
    for stub in ("ray", "deepspeed"):
        (tmp_path / "bin" / stub).write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$HOME/argv"\n')
        (tmp_path / "bin" / stub).chmod(0o755)
    data = tmp_path / "openrlhf-geo/data"
    for name in ("math_train", "dapo_math_17k", "aime24", "aime25", "Qwen3-1.7B_no-thinking/dapo_math_17k",
                 "Qwen3-1.7B_no-thinking/geoalign_eval", "hh/hh_sft", "hh/hh_rl", "hh/hh_test"):  # fmt: skip
        (data / f"{name}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (data / f"{name}.jsonl").write_text("{}\n")
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "EVAL": "0"}
    env.update(switch.split("=") for switch in switches)
    subprocess.run(["bash", scripts / script], env=env, capture_output=True, check=True)
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    entry = "openrlhf.cli.train_sft" if "openrlhf.cli.train_sft" in argv else "train-ppo-ray"
    return argv[argv.index(entry) + 1 :]


def recipe_problems(recipe, spec, sft=False):
    """How a condition's run (its SFT's with sft) differs from a recipe's flags beyond its size (SCRIPT.SIZE_FLAGS) and
    task and the flags it names as dropped: a recipe flag missing or with another value, a dropped one still on."""
    if sft:
        ran, dropped_flags = spec["sft"], spec.get("sft_dropped", {})
        size, task = SCRIPT.SFT_SIZE_FLAGS, SCRIPT.SFT_TASK_FLAGS
    else:
        ran, dropped_flags = [*SCRIPT.COMMON, *spec["flags"]], spec.get("dropped", {})
        size, task = SCRIPT.SIZE_FLAGS, SCRIPT.TASK_FLAGS
    dropped = {key.split()[0]: key for key in dropped_flags}
    problems = []
    for i, flag in enumerate(recipe):
        if not flag.startswith("--"):
            continue
        value = recipe[i + 1] if i + 1 < len(recipe) and not recipe[i + 1].startswith("--") else None
        if flag in dropped:
            if (flag in ran) if value is None else SCRIPT.flag_value(ran, flag) == value:
                problems.append(f"{dropped[flag]} is named as dropped but runs")
        elif flag in task:
            continue  # the smoke's task (train_command, sft)
        elif flag not in ran:
            problems.append(f"{flag} of the recipe does not run")
        elif value is not None and flag not in size and SCRIPT.flag_value(ran, flag) != value:
            problems.append(f"{flag} runs with {SCRIPT.flag_value(ran, flag)}, the recipe's is {value}")
    return problems


RECIPES = [name for name, spec in CONDITIONS.items() if "recipe" in spec]


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_condition_runs_its_recipe_but_for_size_task_and_what_it_names_dropped(name, tmp_path):
    spec = CONDITIONS[name]
    recipe = recipe_flags(spec["recipe"], tmp_path)
    assert "--train.colocate_all" in recipe and "--ds.packing_samples" in recipe  # the recipes' engine
    assert recipe_problems(recipe, spec) == []
    for key, why in spec["dropped"].items():
        assert why.startswith("needs CUDA: ") and key.split()[0] in recipe


SFT_RECIPES = [name for name, spec in CONDITIONS.items() if "sft_recipe" in spec]


@pytest.mark.parametrize("name", SFT_RECIPES)
def test_an_sft_recipe_condition_runs_its_sft_recipe_but_for_size_task_and_what_it_names_dropped(name, tmp_path):
    spec = CONDITIONS[name]
    recipe = recipe_flags(spec["sft_recipe"], tmp_path)
    assert "--ds.packing_samples" in recipe and "--model.gradient_checkpointing_enable" in recipe
    assert spec["hh"] and recipe_problems(recipe, spec, sft=True) == []
    for key, why in spec["sft_dropped"].items():
        assert why.startswith("needs CUDA: ") and key.split()[0] in recipe
    packed = {**spec, "sft": [f for f in spec["sft"] if f != "--ds.packing_samples"]}
    assert recipe_problems(recipe, packed, sft=True) == ["--ds.packing_samples of the recipe does not run"]
    flash = {**spec, "sft": [*spec["sft"], "--ds.attn_implementation", "flash_attention_2"]}
    assert recipe_problems(recipe, flash, sft=True) == [
        "--ds.attn_implementation flash_attention_2 is named as dropped but runs"
    ]


def test_the_recipe_check_catches_a_flag_left_out_and_a_dropped_one_left_on(tmp_path):
    spec = CONDITIONS["recipe_engine"]
    recipe = recipe_flags(spec["recipe"], tmp_path)
    less = {**spec, "flags": [f for f in spec["flags"] if f != "--ds.packing_samples"]}
    assert recipe_problems(recipe, less) == ["--ds.packing_samples of the recipe does not run"]
    more = {**spec, "flags": [*spec["flags"], "--vllm.enable_sleep"]}
    assert recipe_problems(recipe, more) == ["--vllm.enable_sleep is named as dropped but runs"]
    other = {**spec, "flags": [*spec["flags"], "--ds.zero_stage", "2"]}
    assert recipe_problems(recipe, other) == ["--ds.zero_stage runs with 2, the recipe's is 3"]


def test_the_cpu_copy_runs_deepspeeds_sleep_and_packed_samples_without_cuda(tmp_path):
    """recipe_engine's two fixes, read in the CPU copy: --ds.enable_sleep's offload and reload synchronize through
    DeepSpeed's accelerator (torch.cuda.synchronize raises without CUDA), and --ds.packing_samples keeps the given
    attention implementation (upstream's flash_attention_2 needs flash-attn's CUDA kernels)."""
    from openrlhf_geo.fork import install

    root = install.materialize(cache_dir=tmp_path, device="cpu")
    sleep = (root / "openrlhf/utils/deepspeed/deepspeed_utils.py").read_text()
    assert "torch.cuda.synchronize()" not in sleep and sleep.count("get_accelerator().synchronize()") == 2
    assert (
        'args.ds.attn_implementation = "flash_attention_2"' not in (root / "openrlhf/cli/train_ppo_ray.py").read_text()
    )
    gpu = install.materialize(cache_dir=tmp_path)  # the GPU fork keeps upstream's
    assert 'args.ds.attn_implementation = "flash_attention_2"' in (gpu / "openrlhf/cli/train_ppo_ray.py").read_text()


def test_the_cpu_copy_runs_upstreams_sft_on_packed_samples_without_flash_attention(tmp_path):
    """recipe_hh_geoalign's SFT (train_hh_sft.sh's --ds.packing_samples): the CPU copy's train_sft keeps the given
    attention implementation (upstream's flash_attention_2 needs flash-attn's CUDA kernels); the GPU fork keeps
    upstream's."""
    from openrlhf_geo.fork import install

    forced = 'args.ds.attn_implementation = "flash_attention_2"'
    cpu = install.materialize(cache_dir=tmp_path, device="cpu")
    assert forced not in (cpu / "openrlhf/cli/train_sft.py").read_text()
    assert forced in (install.materialize(cache_dir=tmp_path) / "openrlhf/cli/train_sft.py").read_text()


MATRIX_HEADER = "| feature | upstream flag | SALT | GeoAlign | evidence |"
KINDS = ("needs CUDA: ", "refused at parse: ", "not run")


def matrix_problems(text):
    """The problems of docs/usage.md's compatibility matrix against smoke_cpu.py's conditions and the tests: each row's
    evidence names conditions that exist and tests that exist (`tests/x.py::test_name`), or says "refused at parse:",
    "needs CUDA:" (with the nearest run named after "nearest run: ") or "not run"; every recipe condition is in it."""
    lines = text.splitlines()
    if MATRIX_HEADER not in lines:
        return ["no compatibility matrix"]
    problems, named = [], set()
    for line in lines[lines.index(MATRIX_HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != 5:
            problems.append(f"a matrix row needs 5 cells: {line}")
            continue
        evidence = cells[4]
        lists = re.findall(r"\bconditions? ((?:`\w+`(?:, | and )?)+)", evidence)
        conditions = [name for found in lists for name in re.findall(r"`(\w+)`", found)]
        tests = [ref for ref in re.findall(r"`([^`]+)`", evidence) if "::" in ref]
        named.update(conditions)
        problems += [f"{cells[0]}: no condition {name}" for name in conditions if name not in CONDITIONS]
        for ref in tests:
            path, test = ref.split("::")
            if not (REPO / path).is_file() or f"def {test}(" not in (REPO / path).read_text():
                problems.append(f"{cells[0]}: no test {ref}")
        run = conditions or tests
        nearest = evidence.partition("nearest run: ")[2]
        if evidence.startswith("needs CUDA: ") and not re.search(r"condition `\w+`|`tests/", nearest):
            problems.append(f"{cells[0]}: needs CUDA names no nearest run")
        if not run and not evidence.startswith(KINDS):
            problems.append(f"{cells[0]}: its evidence is no condition, test, refusal, 'needs CUDA' or 'not run'")
    problems += [f"recipe condition {name} is not in the matrix" for name in RECIPES if name not in named]
    return problems


def test_the_compatibility_matrix_names_only_conditions_and_tests_that_exist_and_every_recipe_condition():
    assert matrix_problems((REPO / "docs/usage.md").read_text()) == []


@pytest.mark.parametrize(
    "old,new,problem",
    [
        ("condition `recipe_engine` (", "condition `recipe_engin` (", "no condition recipe_engin"),
        ("condition `recipe_math_salt`", "condition `salt`", "recipe condition recipe_math_salt is not in the matrix"),
        ("agree_on_sketch_features`", "agree_on_sketches`", "no test tests/test_fork_pipeline.py::test_packed_and"),
        ("| condition `gspo_salt_geoalign` (", "| works (", "its evidence is no condition"),
        ("nearest run: 2 engines of TP 1 in condition `multirank`", "", "needs CUDA names no nearest run"),
    ],
)
def test_the_matrix_check_fails_on_a_broken_copy(old, new, problem):
    text = (REPO / "docs/usage.md").read_text()
    assert old in text
    problems = matrix_problems(text.replace(old, new, 1))
    assert any(problem in p for p in problems), problems


def test_a_condition_that_must_fail_passes_only_on_a_one_line_error_with_its_cause_not_on_a_hang(tmp_path):
    spec = CONDITIONS["vllm_tp2"]
    cause = f"(RolloutRayActor pid=9) {spec['cause']}\n"
    error = "openrlhf-geo: Ray actor RolloutRayActor (pid 9) died (creation_task_failure): ...\n"

    def ok(log, code):
        (tmp_path / "train.log").write_text(log)
        return SCRIPT.check_run("vllm_tp2", spec, tmp_path, code, [], tmp_path, tmp_path)["ok"]

    assert ok(cause + error, 1)
    assert not ok(cause + error, 124)  # the driver hung and was stopped at the run's limit
    assert not ok(cause + error, 0)
    assert not ok(error, 1)  # the actor's own error is not in the log
    assert not ok(cause + error + error, 1)
