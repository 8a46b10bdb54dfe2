"""`openrlhf-geo train-ppo-ray ARGS`: upstream openrlhf.cli.train_ppo_ray as __main__ on the patched copy
(`install.materialize`, `install.activate`), and what bounds a Ray run's failures.

    main(argv)       the command: `--fork.device cpu` (or OPENRLHF_GEO_DEVICE=cpu) adds the CPU overlay (patches/cpu/);
                     RAY_ADDRESS / RAY_GCS_SERVER_PORT checked before Ray is imported (`check_ray_start`).
    ActorWatchdog    ends the driver, in one line naming the actor, when an actor of its job dies unasked.
    ray_failure      Ray's error of a failed run as one line naming the dead actor and its cause.
    RunProcesses     stops what the run started (the Ray head, its workers, vLLM's engine processes) by PID when
                     it ends, fails or is interrupted, and waits until they are gone (bounded).

docs/architecture.md §3.2 has the fault table these implement.
"""

import ctypes
import importlib.metadata
import os
import re
import runpy
import signal
import socket
import sys
import threading
import time

from openrlhf_geo.fork import install

GCS_PROBE_S = 10.0  # a running Ray cluster's GCS completes a gRPC handshake in milliseconds


def check_ray_start() -> None:
    """ForkError, before anything imports Ray, for what would make ray.init hang or fail late: RAY_ADDRESS naming a
    host:port where no Ray GCS answers (ray.init retries it every 30 s forever, deaf to SIGTERM), or, when this driver
    starts its own head, RAY_GCS_SERVER_PORT already taken (Ray's RuntimeError, as a traceback after ~80 s)."""
    address = os.environ.get("RAY_ADDRESS", "")
    if re.fullmatch(r"[\w.\-]+:\d+", address):  # not "auto", "local" or a ray:// client address
        try:
            import grpc  # Ray's own transport (a dependency of ray)
        except ModuleNotFoundError:
            return
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=GCS_PROBE_S)
        except grpc.FutureTimeoutError:
            raise install.ForkError(
                f"RAY_ADDRESS {address}: no Ray cluster answered there within {GCS_PROBE_S:.0f} s (start one with "
                "`ray start --head`, or unset RAY_ADDRESS to have the run start its own)"
            ) from None
        finally:
            channel.close()
    port = os.environ.get("RAY_GCS_SERVER_PORT")
    if not address and port:
        with socket.socket() as sock:
            try:
                sock.bind(("", int(port)))
            except (OSError, ValueError) as e:
                reason = getattr(e, "strerror", None) or str(e)
                raise install.ForkError(
                    f"RAY_GCS_SERVER_PORT {port}: the run's Ray head cannot listen there ({reason})"
                ) from None


def check_cpu_engines() -> None:
    """The CPU mode needs Ray, DeepSpeed and vLLM's CPU build importable here: one ForkError naming what to install."""
    missing = []
    for distribution in install.CPU_ENGINES:
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            missing.append(distribution)
    if missing:
        raise install.ForkError(f"--fork.device cpu needs {', '.join(missing)} (CPU builds): {install.CPU_INSTALL}")


def split_device(argv) -> tuple[str, list[str]]:
    """(device, argv without --fork.device): the flag wins over $OPENRLHF_GEO_DEVICE; upstream never sees it."""
    device, rest, i = os.environ.get(install.DEVICE_ENV) or "cuda", [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--fork.device":
            if i + 1 >= len(argv):
                raise install.ForkError(f"--fork.device needs a value: {' or '.join(install.DEVICES)}")
            device, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--fork.device="):
            device = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if device not in install.DEVICES:
        raise install.ForkError(f"--fork.device must be one of {', '.join(install.DEVICES)}, got {device!r}")
    return device, rest


def main(argv=None) -> int:
    """`openrlhf-geo train-ppo-ray ARGS`: upstream's train_ppo_ray, run as __main__ on the patched copy."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        device, argv = split_device(argv)
        check_ray_start()
        if device == "cpu":
            check_cpu_engines()
            # DeepSpeed picks its accelerator at import; Ray workers of a cluster this driver starts inherit it.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        install.activate(install.materialize(device=device))
    except install.ForkError as e:
        print(f"openrlhf-geo: {e}", file=sys.stderr)
        return 1
    sys.argv = [install.UPSTREAM_MAIN, *argv]
    # A worker killed unasked (the OOM killer, SIGKILL) takes its own children with it: vLLM's EngineCore and Worker
    # processes outlived their engine actor otherwise, holding its memory. Ray's per-worker process groups; read by
    # a Ray head this driver starts (on a `ray start` cluster, set it there: docs/architecture.md §3.2).
    os.environ.setdefault("RAY_process_group_cleanup_enabled", "true")
    run = RunProcesses()
    try:
        watchdog = ActorWatchdog(run)
        watchdog.start()
        try:
            try:
                runpy.run_module(install.UPSTREAM_MAIN, run_name="__main__", alter_sys=True)
            finally:
                watchdog.stop()
        except BaseException as e:
            # the watchdog's line names the dead actor; Ray's own error (a dead actor the driver waited on directly,
            # or an exception raised in one) is read by ray_failure
            line = watchdog.died or (ray_failure(e) if isinstance(e, Exception) else None)
            if line is None:
                raise
            if watchdog.died is None and "Ray actor " not in line:
                # a symptom of a death the watchdog had not read yet (a weight sync's "Connection closed by peer"):
                # name the dead actor first
                died = dead_actor_within(DEATH_READ_S)
                line = f"{died}; then {line}" if died else line
            # The workers' tracebacks are in the log above (Ray forwards them); a job on a running cluster loses its
            # actors with its driver.
            print(f"openrlhf-geo: {line}", file=sys.stderr)
            return 1
        return 0
    finally:
        run.stop()


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h


class RunProcesses:
    """The processes one run starts, stopped by PID when it ends, fails, is interrupted (Ctrl-C) or gets SIGTERM.

    Ray's shutdown (atexit, or ray.shutdown) signals the head it started and returns without waiting: on a CPU run
    the policy and trainer actors' workers and vLLM's Worker were still running 3 s after it (8 s: still there).
    Built before upstream's main runs, this makes the driver a child subreaper (Linux), so every process the run
    starts stays its descendant even when its parent exits first (raylet's workers and agents). `stop` then shuts
    Ray down if this run started it, waits RAY_EXIT_S for the run's processes to exit, sends SIGTERM to those left,
    SIGKILL after TERM_S, and waits KILL_S more (each wait ends once nothing of the run is left, zombies reaped);
    what is still there then is named on stderr. A run's processes are the driver's descendants started after this
    was built (a pytest process that calls `main` keeps its own children); a cluster the driver only joined
    (RAY_ADDRESS, `ray job submit`) is not among them. SIGINT and SIGTERM are ignored while `stop` runs (bounded).
    """

    # After ray.shutdown (its GCS and raylet SIGTERMed, 1.9 s on a CPU run) its actors' workers and vLLM's engine
    # processes were still running 8 s later: they get RAY_EXIT_S, then SIGTERM (vLLM's engine cleans up on it).
    RAY_EXIT_S, TERM_S, KILL_S = 2.0, 5.0, 2.0
    POLL_S = 0.1

    def __init__(self):
        ray = sys.modules.get("ray")
        self.ray_was_running = ray is not None and ray.is_initialized()
        self.since = _boot_ticks()  # in /proc's clock ticks since boot: a process started before is not the run's
        self.subreaper = _subreaper(True)
        self.sigterm = None
        if threading.current_thread() is threading.main_thread():
            # the default SIGTERM ends Python without unwinding; Ray's driver handler (ray.init) does the same as
            # this one, and restores nothing: `stop` puts back what was there before
            self.sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        self._stopped = threading.Lock()

    def stop(self) -> list[int]:
        """Stop the run's processes (see the class); -> the PIDs still there at the end (none normally). Runs once."""
        if not self._stopped.acquire(blocking=False):
            return []
        main = threading.current_thread() is threading.main_thread()
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            ray = sys.modules.get("ray")
            if not self.ray_was_running and ray is not None and ray.is_initialized():
                try:
                    ray.shutdown()
                except Exception:  # a half-started or already broken head: its processes are stopped below
                    pass
            left = self._wait(self.RAY_EXIT_S)
            for signum, wait_s in ((signal.SIGTERM, self.TERM_S), (signal.SIGKILL, self.KILL_S)):
                if not left:
                    break
                for pid in left:
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
                left = self._wait(wait_s)
            if left:
                names = ", ".join(f"{pid} ({_command(pid)})" for pid in left)
                print(f"openrlhf-geo: processes of this run still running after SIGKILL: {names}", file=sys.stderr)
            return left
        finally:
            _subreaper(self.subreaper)
            if main and self.sigterm is not None:  # only the main thread sets handlers (the watchdog's stop: not)
                signal.signal(signal.SIGTERM, self.sigterm)
            for signum, handler in held.items():
                if signum != signal.SIGTERM or self.sigterm is None:
                    signal.signal(signum, handler)

    def _wait(self, seconds) -> list[int]:
        """Reap the run's exited children until none of its processes is left, not even as a zombie, or `seconds`
        pass; -> those still running. (An exited process whose parent is gone is this subreaper's child to reap.)"""
        deadline = time.monotonic() + seconds
        while True:
            running, exited = [], []
            for pid, parent, state in _descendants(os.getpid(), self.since):
                if state != "Z":
                    running.append(pid)
                elif parent == os.getpid():
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:  # reaped by its Popen meanwhile
                        pass
                else:
                    exited.append(pid)  # its parent, still running, reaps it
            if not running and not exited or time.monotonic() > deadline:
                return running
            time.sleep(self.POLL_S)


def _subreaper(on: bool) -> bool:
    """Set this process's child-subreaper flag (Linux prctl); -> its value before (False where there is none)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        before = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
        return bool(before.value)
    except (OSError, AttributeError):
        return False


def _boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/<pid>/stat's start time counts (0 without /proc)."""
    try:
        with open("/proc/uptime") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except OSError:
        return 0


def _descendants(root, since) -> list[tuple[int, int, str]]:
    """(pid, parent pid, state) of every descendant of `root` started at or after `since` (boot ticks), from /proc."""
    children: dict[int, list[tuple[int, int, str]]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces
        parent, started = int(fields[1]), int(fields[19])
        children.setdefault(parent, []).append((int(entry), started, fields[0].decode()))
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        for pid, started, state in children.get(parent, ()):
            todo.append(pid)
            if started >= since:
                out.append((pid, parent, state))
    return out


def _command(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80] or "?"
    except OSError:
        return "gone"


class ActorWatchdog(threading.Thread):
    """Ends the driver when an actor of its Ray job dies unasked (its worker killed or crashed, out of memory, its node
    lost, its __init__ failed). Upstream waits on actors without a timeout, and a live actor blocked in a collective
    with the dead one (a weight sync to a killed vLLM engine) holds the driver until gloo's or NCCL's own timeout,
    30 min. Every POLL_S the job's actors are read from the GCS; after a death, GRACE_S for Ray's own error to reach
    the main thread (a wait on the dead actor itself), then the main thread gets a SIGINT (ray.get wakes for it) and,
    if it has not returned EXIT_S later, the process exits. Actors killed on purpose (ray.kill, out of scope) are
    not deaths here."""

    POLL_S, GRACE_S, EXIT_S = 2.0, 10.0, 60.0
    FATAL_REASONS = ("WORKER_DIED", "NODE_DIED", "OWNER_DIED")

    def __init__(self, run: "RunProcesses | None" = None):
        super().__init__(name="openrlhf-geo-actor-watchdog", daemon=True)
        self.run_processes = run  # stopped before the forced exit
        self.died: str | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(self.POLL_S):
            ray = sys.modules.get("ray")
            try:
                line = dead_actor(ray) if ray is not None and ray.is_initialized() else None
            except Exception:  # Ray starting or shutting down: the next poll reads it again
                continue
            if line is None:
                continue
            self.died = line
            if self._stopped.wait(self.GRACE_S):
                return
            with self._lock:
                if self._stopped.is_set():
                    return
                # a real SIGINT to the main thread: it interrupts a blocking wait (ray.get), _thread.interrupt_main not
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            if not self._stopped.wait(self.EXIT_S):
                message = f"openrlhf-geo: {line} (the driver did not stop in {self.EXIT_S:.0f} s: exiting)"
                print(message, file=sys.stderr, flush=True)
                if self.run_processes is not None:
                    self.run_processes.stop()
                os._exit(1)
            return


DEATH_READ_S = 3.0  # how long a failed run looks for the actor whose death caused it (GCS marks it dead in ~1 s)


def dead_actor_within(seconds) -> str | None:
    """dead_actor, read until one is found or `seconds` pass; None where Ray is not running here."""
    ray = sys.modules.get("ray")
    deadline = time.time() + seconds
    while ray is not None and ray.is_initialized():
        try:
            line = dead_actor(ray)
        except Exception:
            return None
        if line is not None or time.time() > deadline:
            return line
        time.sleep(0.5)
    return None


def dead_actor(ray) -> str | None:
    """One line for the first actor of this driver's job that died unasked (ActorWatchdog), None if none did."""
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    for actor in state.actors(job_id=job, actor_state_name="DEAD").values():
        cause = actor["DeathCause"]
        kind = cause.WhichOneof("context")
        if kind is None:
            continue
        context = getattr(cause, kind)
        if kind == "actor_died_error_context":
            reasons = context.DESCRIPTOR.fields_by_name["reason"].enum_type.values_by_number
            reason = reasons[context.reason].name
            if reason not in ActorWatchdog.FATAL_REASONS:
                continue
        else:
            reason = kind.removesuffix("_context")
        return death_line(actor["ActorClassName"], actor["Pid"], reason, getattr(context, "error_message", ""))
    return None


def ray_failure(error) -> str | None:
    """One line for an error raised inside a Ray actor: the innermost actor method and its cause; None otherwise."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    if ray_exceptions is None or not isinstance(error, ray_exceptions.RayError):
        return None
    where = None
    # A RayTaskError's text is the worker's traceback, headed "ray::Actor.method() (pid=...)"; its cause is what the
    # method raised (another actor's RayTaskError when it called one).
    while isinstance(error, ray_exceptions.RayTaskError) and getattr(error, "cause", None) is not None:
        found = re.search(r"ray::[\w.]+\(\)", str(error))
        where, error = found.group(0) if found else where, error.cause
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # a dead actor's own fields, as ActorDiedError lists them after its first line (also in the text of a RayError
    # standing for one: Ray cannot pickle an ActorDiedError's context through another actor's task)
    _, _, listed = str(error).partition("The actor died unexpectedly before finishing this task.")
    actor = re.search(r"^\s*class_name: (\S+)$", listed, re.M)
    if actor:
        pid = re.search(r"^\s*pid: (\d+)$", listed, re.M)
        fields = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")
        rest = " ".join(line.strip() for line in listed.splitlines() if not line.strip().startswith(fields))
        died = death_line(actor.group(1), pid.group(1) if pid else "?", None, rest)
        return f"{where} failed: {died}" if where else died
    return f"{where or 'a Ray actor'} failed: {type(error).__name__}: {lines[-1] if lines else ''}"


def death_line(class_name, pid, reason, message) -> str:
    """'Ray actor X (pid N) died (REASON): what Ray says', its advice on possible causes left out."""
    advice = r" (?:There are some potential root causes|Some common causes include)"
    message = re.split(advice, " ".join(message.split()))[0][:400]
    return f"Ray actor {class_name} (pid {pid}) died{f' ({reason})' if reason else ''}: {message}"
