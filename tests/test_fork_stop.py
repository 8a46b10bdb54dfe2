"""`openrlhf-geo train-ppo-ray` leaves no process of its run behind (`fork.launch.RunProcesses`): a driver whose
upstream main is a stand-in that starts a process tree shaped like a Ray head's, run in its own session; once it
returns, nothing of that session is left, whether the run returned, failed, or got Ctrl-C or SIGTERM."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreapers and /proc: Linux")

# A process of the stand-in's tree: says it is ready (its signal handling set) by creating READY/NAME, then sleeps.
SLEEPER = """
import os, signal, subprocess, sys, time
ready, name, *options = sys.argv[1:]
if "--ignore-term" in options:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--spawn" in options:
    group = 0 if "--own-group" in options else None
    subprocess.Popen([sys.executable, __file__, ready, options[options.index("--spawn") + 1]], process_group=group)
open(os.path.join(ready, name), "w").close()
if "--exit" not in options:
    time.sleep(600)
"""

# The stand-in for upstream's train_ppo_ray, a tree shaped like a Ray head's: a "raylet" with a "worker" in its own
# process group (Ray's RAY_process_group_cleanup_enabled); a "launcher" that starts an "agent" and exits at once, so
# the agent is orphaned (without a subreaper it would leave the driver's tree); an "engine" that ignores SIGTERM
# (only SIGKILL ends it). Once all five are ready it returns, raises, or waits for the test's signal.
FAKE_UPSTREAM = """
import os, subprocess, sys, time
ready, sleeper = os.environ["FAKE_READY"], os.path.join(os.path.dirname(__file__), "sleeper.py")

def start(*args):
    return subprocess.Popen([sys.executable, sleeper, ready, *args])

start("raylet", "--spawn", "worker", "--own-group")
start("launcher", "--spawn", "agent", "--exit").wait()
start("engine", "--ignore-term")
deadline = time.time() + 120
while len(os.listdir(ready)) < 5 and time.time() < deadline:
    time.sleep(0.05)
print("tree ready", flush=True)
if os.environ["FAKE_MODE"] == "raise":
    raise RuntimeError("upstream failed")
if os.environ["FAKE_MODE"] == "wait":
    time.sleep(600)
"""

DRIVER = """
import sys
from openrlhf_geo.fork import install, launch
install.materialize = lambda device: None
install.activate = lambda root: None
install.UPSTREAM_MAIN = "fake_upstream"
launch.RunProcesses.RAY_EXIT_S, launch.RunProcesses.TERM_S = 1.0, 1.0  # the engine's SIGKILL comes sooner
sys.exit(launch.main([]))
"""


def session(sid):
    """PIDs of the processes whose session is `sid` (zombies included)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


@pytest.mark.parametrize("mode", ["return", "raise", "ctrl-c", "sigterm"])
def test_no_process_of_the_run_is_left_when_the_driver_returns(tmp_path, mode):
    (tmp_path / "fake_upstream.py").write_text(FAKE_UPSTREAM)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT", "OPENRLHF_GEO_DEVICE")
    }
    env.update(FAKE_READY=str(ready), FAKE_MODE="wait" if mode in ("ctrl-c", "sigterm") else mode)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == "tree ready"
        assert len(session(driver.pid)) == 5  # the driver, raylet, worker, agent, engine
        if mode != "return" and mode != "raise":
            os.kill(driver.pid, signal.SIGINT if mode == "ctrl-c" else signal.SIGTERM)
        out, _ = driver.communicate(timeout=120)
        left = session(driver.pid)
        assert left == [], (left, out)
        expected = {"return": 0, "raise": 1, "ctrl-c": 1, "sigterm": 128 + signal.SIGTERM}[mode]
        assert driver.returncode in (expected, -signal.SIGINT if mode == "ctrl-c" else expected), out
    finally:
        for pid in session(driver.pid):  # what a failed check left: ours, by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if driver.returncode is None:
            driver.wait(timeout=30)


def test_a_process_that_was_running_before_the_run_is_not_the_runs(tmp_path, monkeypatch):
    """`main` called inside another program (pytest here) stops only what started during the run."""
    from openrlhf_geo.fork import launch

    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        time.sleep(0.05)  # a boot tick (10 ms) passes: the run starts after it
        run = launch.RunProcesses()
        during = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        monkeypatch.setattr(launch.RunProcesses, "RAY_EXIT_S", 0.2)
        assert run.stop() == []
        assert not Path(f"/proc/{during.pid}").exists()  # stopped and reaped (its Popen then reads returncode 0)
        assert before.poll() is None
    finally:
        before.kill()
        before.wait()


def test_the_watchdogs_stop_from_its_own_thread_does_not_raise(monkeypatch):
    """ActorWatchdog stops the run from its own thread when the driver does not stop: Python sets signal handlers in
    the main thread only, so `stop` there must leave them (it raised ValueError, and the driver then hung)."""
    from openrlhf_geo.fork import launch

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(launch.RunProcesses, "RAY_EXIT_S", 0.1)
    errors = []

    def stop():
        try:
            run.stop()
        except Exception as e:  # what the watchdog's thread died of
            errors.append(e)

    try:
        run = launch.RunProcesses()
        thread = threading.Thread(target=stop)
        thread.start()
        thread.join(30)
        assert not thread.is_alive() and errors == []
    finally:
        signal.signal(signal.SIGTERM, before)
