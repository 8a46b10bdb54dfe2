"""The fork's mechanics (openrlhf_geo/fork.py + patches/): verification, materialization, activation, Ray workers.

Works on temp copies of the installed distribution; never touches the venv's files.
"""

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_geo import fork

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
    assert fork.main_fork(["verify", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok") and "FAILED" not in out
    lines = out.splitlines()
    for patch in fork.load_patches():  # one line per patched file
        assert any(line.startswith(patch.target) and line.endswith(" ok") for line in lines)


def test_verify_fails_clearly_on_a_modified_file(site_copy, tmp_path, capsys):
    actor = site_copy / "openrlhf/models/actor.py"
    actor.write_text(actor.read_text().replace("Returns action log probs", "Returns log probs"))
    code = fork.main_fork(["verify", "--site-packages", str(site_copy), "--cache-dir", str(tmp_path)])
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
    assert fork.main_fork(["verify", "--site-packages", str(site_copy), "--cache-dir", str(tmp_path)]) == 1
    assert "installed openrlhf is 0.11.3; the fork's patches are for 0.11.2" in capsys.readouterr().out


def test_path_prints_the_materialized_copy(fork_root, capsys):
    assert fork.main_fork(["path", "--cache-dir", str(fork_root.parents[1])]) == 0
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


def test_activation_after_an_unpatched_import_is_refused(fork_root):
    done = run_python(
        "import openrlhf\nfrom openrlhf_geo import fork\n"
        f"try:\n    fork.activate({str(fork_root)!r})\nexcept fork.ForkError as e:\n    print('REFUSED', e)\n"
    )
    assert "REFUSED openrlhf was already imported from" in done.stdout, done.stderr


def test_worker_check_rejects_a_shadowing_unpatched_openrlhf(fork_root, tmp_path):
    stray = tmp_path / "stray"
    (stray / "openrlhf").mkdir(parents=True)
    (stray / "openrlhf/__init__.py").write_text("")
    # A worker whose sys.path has a stray folder ahead of the shipped fork:
    path = os.pathsep.join([str(stray), str(fork_root), str(REPO)])
    done = run_python("from openrlhf_geo import fork\nfork.check_worker()", {"PYTHONPATH": path})
    assert done.returncode != 0
    assert f"imported openrlhf from {stray / 'openrlhf'}, which is not the openrlhf-geo fork" in done.stderr
    ok = run_python("from openrlhf_geo import fork\nfork.check_worker()", {"PYTHONPATH": f"{fork_root}:{REPO}"})
    assert ok.returncode == 0, ok.stderr


def test_train_entry_reports_a_mismatch_once_before_ray_starts(site_copy, tmp_path, monkeypatch, capsys):
    for name in ("models/actor.py", "trainer/ppo_trainer.py"):
        path = site_copy / "openrlhf" / name
        path.write_text(path.read_text() + "\n# local edit\n")
    modified = fork.upstream_distribution(site_copy)
    monkeypatch.setattr(fork, "upstream_distribution", lambda site_packages=None: modified)
    monkeypatch.setenv(fork.CACHE_ENV, str(tmp_path))
    assert fork.main(["--advantage_estimator", "salt"]) == 1
    err = capsys.readouterr().err
    assert err.count("openrlhf-geo:") == 1 and err.count("differs from openrlhf==0.11.2") == 2
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.mark.slow
def test_upstream_test_suite_passes_on_the_patched_copy(fork_root):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fork_root), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "tests"],
        cwd=fork_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


RAY_PROBE = """
import json, sys
from openrlhf_geo import fork
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
    assert fork_id == fork.FORK_ID and hook == "openrlhf_geo.fork.check_worker"
    # shipped as py_modules (Ray's package cache), not imported from the venv or the source tree
    assert "py_modules_files" in openrlhf_file and "site-packages" not in openrlhf_file
    assert "py_modules_files" in geo_file
