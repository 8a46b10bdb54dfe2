"""Faults inside a fork run, on the CPU fork (tiny Qwen2, real Ray + vLLM-CPU + DeepSpeed; the assets and flags of
examples/scripts/smoke_cpu.py). Each test is a row of the fault table in docs/architecture.md and asserts what a user
needs: the run finishes or stops with one line naming the actor and the cause, leaves no process of its session behind,
and `--ckpt.load_enable` resumes from the last complete checkpoint with that checkpoint's pipeline state (GeoAlign's
projector, the RNG streams, the entropy range), never from a half-written one.

The faults: SIGKILL of the driver mid-step and mid-checkpoint-save (tests/fixtures/fault_inject stalls the save once
DeepSpeed has written the tag's files, before `latest` names it); SIGKILL of the vLLM engine's actor and of the policy
actor mid-step (found in the run's own session by Ray's process title); a full disk (a small tmpfs where the test may
mount one, else ENOSPC injected at the same point) and a read-only checkpoint folder. About 12 min on an idle 2-core
VM with OPENRLHF_GEO_FAULTS=full (or OPENRLHF_GEO_FULL=1), about 2.5 min without (FULL below). Needs the CPU engines
(scripts/setup_cpu.sh test); without them the module is skipped, except in CI.
"""

import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import smoke_helpers as SMOKE  # the smoke's script and its checks, shared with test_smoke_cpu.py
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = SMOKE.SCRIPT
FAULTS = REPO / "tests/fixtures/fault_inject"
pytestmark = [pytest.mark.fork, pytest.mark.slow, pytest.mark.engines]
# SALT (entropy-alpha: the entropy range is state) + GeoAlign + flips: every piece of pipeline state a resume restores;
# a checkpoint after every step (8 prompts x 4 per step, 2 steps per episode), only the newest one kept
STATEFUL = [*SCRIPT.RESUMED, "--ckpt.save_steps", "1", "--ckpt.max_num", "1"]
# the README's test command runs the faults whose paths nothing else exercises, within CI's budget (about 2.5 min on
# an idle 2-core VM): the driver killed mid-save and the resume, the read-only folder; OPENRLHF_GEO_FAULTS=full adds
# the driver killed mid-step before them (its resume is the mid-save run), the vLLM engine actor and the policy actor
# killed, and the full disk (about 12 min)
FULL = os.environ.get("OPENRLHF_GEO_FAULTS") == "full"
full_only = pytest.mark.skipif(not FULL, reason="runs with OPENRLHF_GEO_FAULTS=full")
WAIT_S = 600  # for a step or a marker on a loaded 2-core VM (a tiny-model step takes ~10 s idle)
STOP_S = 90  # from the fault to the end of the run: Ray's error or the fork's watchdog (ActorWatchdog, ~12 s)
# A SIGKILLed driver takes its Ray head's GCS and raylet with it at once; Ray's dashboard and runtime-env agents exit
# on their own once their GCS client gives up reconnecting (Ray's 60 s default): 70 s measured
AGENTS_S = 120
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # their process titles: they outlive a SIGKILLed driver


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    missing = SMOKE._engines_missing()
    if missing and not os.environ.get("CI"):
        pytest.skip(f"the CPU engines are not installed ({', '.join(missing)}): bash scripts/setup_cpu.sh test")
    out = tmp_path_factory.mktemp("faults")
    SCRIPT.build_assets(out / "assets")
    return out


class Run:
    """One `train-ppo-ray` of the smoke's set-up in its own session, polled by the test."""

    def __init__(self, out: Path, name: str, ckpt: Path, flags, env=None):
        self.dir = out / name
        self.dir.mkdir()
        assets = out / "assets"
        command = SCRIPT.train_command(
            self.dir, ckpt, flags, assets / "model", assets / "prompts.jsonl", str(assets / "reward_func.py")
        )
        run_env = SCRIPT.run_env(self.dir)
        run_env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), run_env["PYTHONPATH"]])
        run_env.update(env or {})
        self.log = self.dir / "train.log"
        self.agents = None  # kill_driver's future
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=run_env, cwd=self.dir, start_new_session=True
            )

    def wait_for(self, what, condition, timeout=WAIT_S):
        deadline = time.time() + timeout
        while not condition():
            assert self.proc.poll() is None, (
                f"the run ended (exit {self.proc.returncode}) before {what}:\n{self.tail()}"
            )
            assert time.time() < deadline, f"no {what} after {timeout} s:\n{self.tail()}"
            time.sleep(0.5)

    def steps(self) -> list[int]:
        return sorted(int(p.stem[4:]) for p in (self.dir / "dump").glob("step*.pt"))

    def actor_pid(self, title) -> int:
        """The pid of the run's Ray actor process titled `ray::<title>` (its own session only)."""
        for p in psutil.process_iter(["cmdline"]):
            cmdline = p.info["cmdline"] or []
            if SCRIPT._sid(p.pid) == self.proc.pid and cmdline and cmdline[0].startswith(f"ray::{title}"):
                return p.pid
        raise AssertionError(f"no ray::{title} process in the run's group")

    def finish(self, timeout) -> tuple[int, list[str], float]:
        """(exit code, what of the session was left and then stopped, seconds to exit)."""
        start = time.time()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        took = time.time() - start
        left = SCRIPT.stop_session(self.proc.pid, grace=60)  # Ray's processes exit on their own, in seconds
        return code, left, took

    def kill_driver(self) -> Future:
        """SIGKILL of the driver, once nothing of its session but Ray's agents is left (its actors, which write the
        checkpoints, are gone); -> a future of what was still running AGENTS_S later (then stopped). The agents hold
        no checkpoint, so the next run need not wait the minute they take to give up on the dead GCS."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        start = time.time()
        while time.time() < start + STOP_S and any(
            not any(agent in " ".join(p.info["cmdline"] or []) for agent in RAY_AGENTS)
            for p in psutil.process_iter(["cmdline"])
            if SCRIPT._sid(p.pid) == self.proc.pid
        ):
            time.sleep(0.5)

        def wait_agents():
            left = SCRIPT.stop_session(self.proc.pid, grace=AGENTS_S)
            report(f"{self.dir.name}: session empty {time.time() - start:.0f} s after the driver's SIGKILL")
            return left

        self.agents = ThreadPoolExecutor(1).submit(wait_agents)
        return self.agents

    def fork_lines(self) -> list[str]:
        return [x for x in self.log.read_text().splitlines() if x.startswith("openrlhf-geo: ")]

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.is_file() else ""

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.agents is None:  # else kill_driver's waiter stops what is left at AGENTS_S
            SCRIPT.stop_session(self.proc.pid, grace=10)


@contextmanager
def running(*args, **kwargs):
    run = Run(*args, **kwargs)
    try:
        yield run
    finally:  # whatever the assertion, nothing of the run outlives the test
        run.stop()


def report(line: str) -> None:
    """A measurement for the fault table (shown with pytest -s)."""
    print(f"\nfault: {line}", flush=True)


def latest(ckpt: Path) -> str | None:
    path = ckpt / "_actor" / "latest"
    return path.read_text().strip() if path.is_file() else None


def dumps(run: Run) -> dict:
    return {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted((run.dir / "dump").glob("step*.pt"))}


def test_driver_killed_mid_step_then_mid_save_resumes_from_the_last_complete_checkpoint(assets):
    ckpt = assets / "chain_ckpt"
    resumed = []  # the kill mid-save's run: a resume of the kill mid-step's checkpoint with FULL, else a fresh run
    if FULL:
        # 1. SIGKILL of the driver in step 2 (its optimizer step stalled), after step 1's checkpoint
        stall = {"OPENRLHF_GEO_TEST_FAULT": f"step:2:stall:{assets / 'stepping'}"}
        with running(assets, "kill_mid_step", ckpt, STATEFUL, stall) as first:
            first.wait_for("the stalled optimizer step 2", (assets / "stepping").is_file)
            assert latest(ckpt) == "global_step1"
            first_left = first.kill_driver()
        assert latest(ckpt) == "global_step1"
        saved = dumps(first)[1]["state_after"]
        resumed = ["--ckpt.load_enable"]

    # 2. SIGKILL of the driver while step 2's checkpoint is written (its files are, `latest` is not);
    # --ckpt.max_num 1: the rotation must not have deleted global_step1 before global_step2 was complete
    stall = {"OPENRLHF_GEO_TEST_FAULT": f"save:global_step2:stall:{assets / 'saving'}"}
    with running(assets, "kill_mid_save", ckpt, [*STATEFUL, *resumed], stall) as second:
        second.wait_for("the stalled save of global_step2", (assets / "saving").is_file)
        assert (ckpt / "_actor" / "global_step2").is_dir() and (ckpt / "_actor" / "global_step1").is_dir()
        # another run into the checkpoints being written, --ckpt.overwrite and all: refused before Ray starts (it
        # exited 0 after replacing them), nothing deleted
        rival = assets / "rival"
        rival.mkdir()
        again = SCRIPT.train_command(
            rival, ckpt, [*STATEFUL, "--ckpt.overwrite"], assets / "assets/model", assets / "assets/prompts.jsonl",
            str(assets / "assets/reward_func.py"),
        )  # fmt: skip
        done = subprocess.run(again, env=SCRIPT.run_env(rival), cwd=rival, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and "Started a local Ray instance" not in done.stderr, done.stderr[-3000:]
        assert f"error: --ckpt.path {ckpt}: another run is writing it (pid " in done.stderr, done.stderr[-3000:]
        assert (ckpt / "_actor" / "global_step2").is_dir() and (ckpt / "_actor" / "global_step1").is_dir()
        second_left = second.kill_driver()
    assert latest(ckpt) == "global_step1", "a resume would read a half-written checkpoint"
    second_dumps = dumps(second)
    if not FULL:
        saved = second_dumps[1]["state_after"]  # what global_step1 holds
    stages = saved["stages"]  # there is state to restore:
    assert stages["geoalign"]["projector"] is not None and stages["salt"]["entropy_range"] is not None
    SMOKE._assert_state_equal(second_dumps[2]["state"], saved)
    SMOKE.assert_steps_replay("kill_mid_save", second_dumps)

    # 3. resumed again: from global_step1 with its pipeline state, to the end
    with running(assets, "resume", ckpt, [*STATEFUL, "--ckpt.load_enable"]) as third:
        code, left, _ = third.finish(WAIT_S)
        assert code == 0, third.tail()
    assert left == []
    # a clean exit: no traceback of Ray's shutdown SIGTERM in the actors' teardown (launch.await_actor_exits)
    assert "Traceback" not in third.log.read_text(), third.tail()
    assert third.steps() == [2], "the resumed run continues at step 2, after the last complete checkpoint"
    third_dumps = dumps(third)
    SMOKE._assert_state_equal(third_dumps[2]["state"], saved)
    SMOKE.assert_steps_replay("resume", third_dumps)  # the restored pipeline computes what the real step did
    assert latest(ckpt) == "global_step2"
    # global_step1 was kept while global_step2 was written (--ckpt.max_num 1 + 1); the next save rotates it out
    assert sorted(p.name for p in (ckpt / "_actor").iterdir() if p.is_dir()) == ["global_step1", "global_step2"]
    assert (third.dir / "final" / "model.safetensors").is_file()
    # the same run again without --ckpt.load_enable would write over it: refused before Ray starts, nothing changed
    outputs = {p: p.stat().st_mtime_ns for p in [*ckpt.rglob("*"), *(third.dir / "final").rglob("*")]}
    again = SCRIPT.train_command(
        third.dir, ckpt, STATEFUL, assets / "assets/model", assets / "assets/prompts.jsonl",
        str(assets / "assets/reward_func.py"),
    )  # fmt: skip
    done = subprocess.run(
        again, env=SCRIPT.run_env(third.dir), cwd=third.dir, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Started a local Ray instance" not in done.stderr, done.stderr[-3000:]
    assert f"error: --ckpt.output_dir {third.dir / 'final'} already holds a run (" in done.stderr
    assert "resume it with --ckpt.load_enable, replace it with --ckpt.overwrite" in done.stderr
    assert {p: p.stat().st_mtime_ns for p in outputs} == outputs
    # meanwhile Ray's agents of the killed drivers exited on their own
    if FULL:
        left = first_left.result()
        assert left == [], f"left running after the driver's SIGKILL: {left}"
    left = second_left.result()
    assert left == [], f"left running after the driver's SIGKILL mid-save: {left}"


@pytest.mark.parametrize(
    "title", [pytest.param(title, marks=full_only) for title in ("RolloutRayActor", "PolicyModelActor")]
)
def test_an_actor_killed_mid_step_ends_the_run_in_one_line_naming_it(assets, title):
    # 10 steps of about a second each: step 2 is under way when step 1's line is logged
    flags = ["--advantage_estimator", "group_norm", "--train.num_episodes", "5"]
    with running(assets, f"kill_{title}", assets / f"ckpt_{title}", flags) as run:
        run.wait_for("step 1", lambda: "Global step 1:" in run.log.read_text(errors="replace"))
        os.kill(run.actor_pid(title), signal.SIGKILL)
        code, left, took = run.finish(STOP_S)
        report(f"{title} SIGKILL: exit {code} after {took:.0f} s: {run.fork_lines()}")
        assert code not in (0, None), f"exit {code} {took:.0f} s after the actor's SIGKILL:\n{run.tail()}"
        lines = run.fork_lines()
    assert left == [], f"left running: {left}"
    assert len(lines) == 1 and f"Ray actor {title} (pid " in lines[0] and "died" in lines[0], lines


def _mount_tmpfs(path: Path, size: str, *options) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    opts = ",".join([f"size={size}", *options])
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


def _umount(path: Path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@full_only
def test_a_full_disk_at_a_save_ends_in_one_line_and_the_run_resumes_once_there_is_space(assets):
    """One checkpoint of the tiny model is ~6 MB: a 10 MB tmpfs takes step 1's and fails step 2's."""
    ckpt = assets / "full_ckpt"
    mounted = _mount_tmpfs(ckpt, "10m")
    flags = [*STATEFUL[:-2], "--ckpt.max_num", "3"]  # keep step 1's checkpoint: only the disk limits
    env = {} if mounted else {"OPENRLHF_GEO_TEST_FAULT": "save:global_step2:enospc"}
    try:
        with running(assets, "disk_full", ckpt, flags, env) as run:
            code, left, took = run.finish(WAIT_S)
            lines = run.fork_lines()
            report(f"disk full ({'tmpfs' if mounted else 'injected'}): exit {code}: {lines}")
        assert code not in (0, None), run.tail()
        assert left == []
        assert len(lines) == 1 and "No space left on device: checkpoint global_step2" in lines[0], lines
        assert latest(ckpt) == "global_step1"
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], check=True)
        with running(assets, "disk_full_resume", ckpt, [*flags, "--ckpt.load_enable"]) as resumed:
            code, left, _ = resumed.finish(WAIT_S)
            assert code == 0, resumed.tail()
        assert resumed.steps() == [2] and latest(ckpt) == "global_step2" and left == []
        SMOKE._assert_state_equal(dumps(resumed)[2]["state"], dumps(run)[1]["state_after"])
    finally:
        if mounted:
            _umount(ckpt)


def test_a_read_only_checkpoint_folder_is_refused_before_ray_starts(assets):
    ckpt = assets / "ro_ckpt"
    if not _mount_tmpfs(ckpt, "1m", "ro"):
        pytest.skip("this machine does not let the test mount a read-only tmpfs (the check: test_fork_parse)")
    try:
        with running(assets, "read_only", ckpt, ["--ckpt.save_steps", "1"]) as run:
            code, left, took = run.finish(120)
            text = run.log.read_text()
            report(f"read-only --ckpt.path: exit {code} after {took:.0f} s: {text.strip().splitlines()[-1:]}")
        assert code == 2 and left == [] and "--ckpt.path" in text and "Read-only file system" in text, text
        assert took < 60 and "Started a local Ray instance" not in text  # refused at parse time
    finally:
        _umount(ckpt)
