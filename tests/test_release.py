"""The release files work outside the checkout: `bash scripts/build.sh` builds the sdist and, from it, the wheel; the
wheel is installed into a fresh venv and `openrlhf-geo fork verify` and `openrlhf-geo demo --quick` run from that
venv, with the working directory outside the checkout, importing the wheel's `openrlhf_geo` (with its package data:
the fork's diffs as `openrlhf_geo.fork.patches`, the demo's shipped SFT warm-up), not this checkout's.

The fresh venv gets a real install of the locked base set, as `scripts/setup_cpu.sh` installs it: `torch==2.13.0`,
`requirements/lock/base.txt` (`--no-deps`, with the lock's hashes where they apply), then the wheel (`--no-deps`);
`pip check` confirms that the lock meets the wheel's declared requirements; then upstream's `openrlhf==0.11.2` from the
lock (`--no-deps`: `fork verify` reads its files and RECORD, it does not import it). The installs take about 15 s on
a 2-core VM from the local package mirror, the whole test 1-1.2 min (the demo about 40 s of it: it byte-compiles as
it imports). The alternative, a `.pth` file lending this venv's site-packages to the new one, would save those 15 s
but hide a module that imports something only the test or engine set-ups install (pytest, Ray, DeepSpeed) and hand
`fork verify` this venv's openrlhf, so the real install was kept. pip is this venv's (the locked one), run with
`--python` on the new venv, which is made without pip. The fork's patched copy is built under tmp_path."""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import openrlhf_geo

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock"

LOCK_HASHES_APPLY = sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] == (3, 11)

pytestmark = pytest.mark.slow

# run by the fresh venv's python: where its openrlhf_geo and the package data the product reads come from
PROBE = """
import hashlib, json, sys
import openrlhf_geo
from openrlhf_geo.fork.install import patch_dir
from openrlhf_geo.lab.recipe import SHIPPED_SFT
sft = json.loads((SHIPPED_SFT / "sft.json").read_text())
print(json.dumps({
    "file": openrlhf_geo.__file__,
    "version": openrlhf_geo.__version__,
    "checkout_on_path": any(p.startswith(sys.argv[1]) for p in sys.path),
    "patches": str(patch_dir()),
    "diffs": len(list(patch_dir().glob("*.diff"))),
    "cpu_diffs": len(list((patch_dir() / "cpu").glob("*.diff"))),
    "sft": str(SHIPPED_SFT),
    "sft_sha256_ok": hashlib.sha256((SHIPPED_SFT / "model.safetensors").read_bytes()).hexdigest() == sft["sha256"],
}))
"""


def run(cmd, cwd, env=None, timeout=900):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def locked(lines, path):
    """pip arguments installing `lines` of a lock file, written to `path`: with their hashes where the lock's hashes
    apply (Linux x86-64 CPython 3.11), else the same versions without them, as scripts/setup_cpu.sh does."""
    lines = [" ".join(line.split("#")[0].split()) for line in lines]
    if LOCK_HASHES_APPLY:
        path.write_text("\n".join(lines) + "\n")
        return ["--require-hashes", "-r", str(path)]
    path.write_text("\n".join(line.split(" --hash=")[0] for line in lines) + "\n")
    return ["-r", str(path)]


def lock_lines(name, names=None):
    """The requirement lines of requirements/lock/NAME.txt (continuation lines joined), or only those of `names`."""
    text = (LOCK / f"{name}.txt").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "==" in line.split("#")[0]]
    return [line for line in lines if names is None or line.split("==")[0] in names]


def test_the_sdist_and_the_wheel_ship_the_license_the_notice_and_the_committed_rollouts(tmp_path):
    """LICENSE (Apache-2.0, as setup.py declares) and NOTICE (crediting OpenRLHF, whose files patches/ changes), byte
    for byte, at the sdist's root and in the wheel's dist-info/licenses, and named by the wheel's metadata; the real-LM
    studies' committed rollouts (`studies.real_lm.ROLLOUTS_DIR`) byte for byte in both."""
    import tarfile
    import zipfile

    dist = tmp_path / "dist"
    run(["bash", str(ROOT / "scripts" / "build.sh"), str(dist)], cwd=tmp_path)
    version = openrlhf_geo.__version__
    license_text, notice = (ROOT / "LICENSE").read_bytes(), (ROOT / "NOTICE").read_bytes()
    assert license_text.lstrip().startswith(b"Apache License\n                           Version 2.0, January 2004")
    assert b"END OF TERMS AND CONDITIONS" in license_text
    assert b"OpenRLHF" in notice and b"patches/" in notice and b"Apache License, Version 2.0" in notice
    with tarfile.open(dist / f"openrlhf_geo-{version}.tar.gz") as sdist:
        for name, text in (("LICENSE", license_text), ("NOTICE", notice)):
            assert sdist.extractfile(f"openrlhf_geo-{version}/{name}").read() == text, name
    with zipfile.ZipFile(dist / f"openrlhf_geo-{version}-py3-none-any.whl") as wheel:
        info = f"openrlhf_geo-{version}.dist-info"
        for name, text in (("LICENSE", license_text), ("NOTICE", notice)):
            assert wheel.read(f"{info}/licenses/{name}") == text, name
        metadata = wheel.read(f"{info}/METADATA").decode()
        rollouts = sorted((ROOT / "openrlhf_geo" / "assets" / "real_lm_rollouts").glob("*.npz"))
        assert rollouts
        for path in rollouts:
            assert wheel.read(f"openrlhf_geo/assets/real_lm_rollouts/{path.name}") == path.read_bytes(), path.name
    with tarfile.open(dist / f"openrlhf_geo-{version}.tar.gz") as sdist:
        for path in rollouts:
            member = f"openrlhf_geo-{version}/openrlhf_geo/assets/real_lm_rollouts/{path.name}"
            assert sdist.extractfile(member).read() == path.read_bytes(), path.name
    assert {"License-Expression: Apache-2.0", "License-File: LICENSE", "License-File: NOTICE"} <= set(
        metadata.splitlines()
    )


@pytest.mark.full  # torch and the locked dependencies into a fresh venv, then the quick demo: about 2.5 min idle
def test_the_built_wheel_installs_into_a_fresh_venv_and_runs_outside_the_checkout(tmp_path):
    dist = tmp_path / "dist"
    run(["bash", str(ROOT / "scripts" / "build.sh"), str(dist)], cwd=tmp_path)
    version = openrlhf_geo.__version__
    wheel, sdist = dist / f"openrlhf_geo-{version}-py3-none-any.whl", dist / f"openrlhf_geo-{version}.tar.gz"
    assert sorted(dist.iterdir()) == sorted([wheel, sdist])

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    install = [*pip, "install", "-q", "--no-compile", "--no-deps"]
    run([*install, "torch==2.13.0"], cwd=ROOT)
    run([*install, *locked(lock_lines("base"), tmp_path / "base.txt")], cwd=ROOT)
    run([*install, str(wheel)], cwd=ROOT)
    run([*pip, "check"], cwd=ROOT)  # the lock meets the wheel's install_requires
    run([*install, *locked(lock_lines("engines", ["openrlhf"]), tmp_path / "openrlhf.txt")], cwd=ROOT)

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        OPENRLHF_GEO_CACHE=str(tmp_path / "cache"),  # the fork's patched copy, built here
        HF_HUB_OFFLINE="1",
    )
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    assert site.is_relative_to(venv) and site != Path(sysconfig.get_paths()["purelib"])
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    where = json.loads(run([python, probe, str(ROOT)], tmp_path, env))
    assert Path(where["file"]) == site / "openrlhf_geo" / "__init__.py", where
    assert where["version"] == version and not where["checkout_on_path"], where
    assert Path(where["patches"]) == site / "openrlhf_geo" / "fork" / "patches", where  # the wheel's, not patches/
    assert where["diffs"] == len(list((ROOT / "patches").glob("*.diff"))) > 0, where
    assert where["cpu_diffs"] == len(list((ROOT / "patches" / "cpu").glob("*.diff"))) > 0, where
    assert Path(where["sft"]) == site / "openrlhf_geo" / "assets" / "demo_sft" and where["sft_sha256_ok"], where

    verify = run([venv / "bin" / "openrlhf-geo", "fork", "verify"], tmp_path, env)
    assert verify.splitlines()[-1] == "ok", verify
    assert f"patches: {site / 'openrlhf_geo' / 'fork' / 'patches'}" in verify, verify
    assert f"openrlhf 0.11.2 at {site} " in verify, verify  # the fresh venv's upstream, not this venv's
    assert re.search(rf"patched copy: {re.escape(str(tmp_path / 'cache'))}/fork/openrlhf-0\.11\.2-", verify), verify

    out = tmp_path / "demo"
    run([venv / "bin" / "openrlhf-geo", "demo", "--quick", "--out", out], tmp_path, env)
    assert (out / "report.md").is_file() and (out / "summary.json").is_file()
    shutil.rmtree(venv)  # 1.1 GB, kept only when the test fails
