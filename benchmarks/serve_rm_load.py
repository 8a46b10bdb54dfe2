"""Load test of `openrlhf-geo serve-rm`'s HTTP server next to FastAPI + uvicorn over the same scoring code.

Both servers run as subprocesses on free 127.0.0.1 ports with the same batcher (``armorm.BatchingScorer`` with
serve-rm's defaults: batches of up to 64 conversations gathered for 10 ms) and the same request parsing
(``armorm._conversations_from_payload``); only the HTTP layer differs:

  ours     ``armorm.make_server``: ThreadingHTTPServer, a thread per connection, body / query / character caps,
           read deadlines, backpressure (503 + Retry-After); no token here.
  fastapi  an ``async def`` FastAPI route awaiting the batcher's future, served by uvicorn with its defaults
           (uvloop and httptools when installed); no caps, deadlines or backpressure.

Scorers: ``standin`` is ArmoRMScorer on the tests' tiny stand-in model (tests/fixtures/armorm_standin; char-level
tokenizer, 2-layer Llama, CPU, 1 thread): real tokenizing and forwards, so the HTTP layer's share is what it is
next to a (very small) model. ``constant`` returns zeros: what is left is the HTTP layer and the parsing.

Clients are upstream's (``openrlhf.utils.agent``): aiohttp, one query per request ({"query": [q], "prompts": [p],
"labels": [None]}), a new connection per request, all in one asyncio process with C requests in flight for a
fixed time per phase. Per phase: requests/s, p50 / p99 latency of the answered ones, errors (503s apart), and the
server process's peak RSS, threads and CPU per answered request (psutil, sampled every 20 ms), and the client
process's CPU per request sent (it shares the cores). The two servers alternate within each concurrency level;
ratios are fastapi / ours. ``--max-pending N`` lowers our server's admission cap to show its 503s under load.

Usage: python benchmarks/serve_rm_load.py [--quick] [--scorers standin constant] [--concurrency 8 32 64]
                                         [--max-pending N]
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("ours", "fastapi")


def make_batcher(scorer, model):
    from openrlhf_geo.rewards import armorm

    if scorer == "constant":
        import numpy as np

        return armorm.BatchingScorer(lambda c: np.zeros(len(c), dtype=np.float32), max_batch=64, max_wait_s=0.01)
    return armorm.BatchingScorer(
        armorm.ArmoRMScorer(model, device="cpu", batch_size=16), max_batch=64, max_wait_s=0.01
    )


def serve(kind, scorer, model, max_pending):
    """A server's subprocess: binds 127.0.0.1:0, prints ``PORT n`` and serves until terminated."""
    from openrlhf_geo.rewards import armorm

    batcher = make_batcher(scorer, model)
    if kind == "ours":
        server = armorm.make_server(batcher, "127.0.0.1", 0, max_pending=max_pending)
        print(f"PORT {server.server_address[1]}", flush=True)
        server.serve_forever()
        return
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        try:
            conversations = armorm._conversations_from_payload(json.loads(await request.body()))
        except OverflowError as error:
            return JSONResponse({"error": str(error)}, 413)
        except ValueError as error:
            return JSONResponse({"error": str(error)}, 400)
        scores = (await asyncio.wrap_future(batcher.submit(conversations))).tolist()
        return JSONResponse({"rewards": scores, "scores": scores, "extra_logs": {}})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def start(kind, scorer, model, max_pending, log, procs):
    """(Popen, base URL) of a server subprocess (appended to ``procs`` at once), once its /health answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, __file__, "--serve", kind, "--scorers", scorer, "--max-pending", str(max_pending)]
    command += ["--model", model or ""]
    # its own session: a Ctrl-C here reaches only this process, whose finally stops the server by its PID
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=env, text=True, start_new_session=True)
    procs.append(proc)
    line = proc.stdout.readline()  # blocks until the port or the process's end
    if not line.startswith("PORT "):
        proc.wait(10)
        log.seek(0)
        raise RuntimeError(f"{kind} server exited ({proc.returncode}) before listening: {log.read()[-2000:]}")
    url = f"http://127.0.0.1:{int(line.split()[1])}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not answer /health") from None
            time.sleep(0.1)


def stop(proc):
    """Stop one server subprocess by its own PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def payloads(n, response_chars, seed=0):
    """Upstream-shaped one-query requests: a ChatML prompt (system + user) and a response of about
    ``response_chars`` characters, different in every request."""
    rng = random.Random(seed)
    words = "the of and to in is that for it as with was on be by this are or at from an not have which".split()
    out = []
    for i in range(n):
        user = " ".join(rng.choices(words, k=30))
        prompt = f"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n{i} {user}<|im_end|>\n"
        prompt += "<|im_start|>assistant\n"
        response = " ".join(rng.choices(words, k=response_chars // 4))[:response_chars] + "<|im_end|>"
        out.append(json.dumps({"query": [prompt + response], "prompts": [prompt], "labels": [None]}).encode())
    return out


class Sampler(threading.Thread):
    """Peak RSS and thread count of a process, sampled every 20 ms until ``done`` is set."""

    def __init__(self, pid):
        import psutil

        super().__init__(daemon=True)
        self.process, self.done = psutil.Process(pid), threading.Event()
        self.peak_rss = self.peak_threads = 0

    def run(self):
        while not self.done.wait(0.02):
            with self.process.oneshot():
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
                self.peak_threads = max(self.peak_threads, self.process.num_threads())


async def load(url, bodies, concurrency, duration):
    """C clients posting for ``duration`` seconds: (latencies of 200s, 503 count, error count, elapsed)."""
    import aiohttp

    latencies, busy, errors, sent = [], 0, 0, 0
    timeout = aiohttp.ClientTimeout(total=30)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(force_close=True, limit=0)
    ) as session:

        async def client(offset):
            nonlocal busy, errors, sent
            i = offset
            while time.monotonic() < stop_at:
                sent += 1
                start = time.perf_counter()
                try:
                    async with session.post(url + "/get_reward", data=bodies[i % len(bodies)], headers=headers) as r:
                        reply = await r.json()
                        if r.status == 200 and len(reply["rewards"]) == 1:
                            latencies.append(time.perf_counter() - start)
                        elif r.status == 503 and r.headers.get("Retry-After"):
                            busy += 1
                        else:
                            errors += 1
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    errors += 1
                i += concurrency

        began = time.monotonic()
        stop_at = began + duration
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return latencies, busy, errors, time.monotonic() - began


def phase(proc, url, bodies, concurrency, duration):
    import psutil

    asyncio.run(load(url, bodies, concurrency, min(0.3, duration)))  # warm-up: connections, batcher, caches
    cpu, client_cpu = psutil.Process(proc.pid).cpu_times(), time.process_time()
    sampler = Sampler(proc.pid)
    sampler.start()
    try:
        latencies, busy, errors, elapsed = asyncio.run(load(url, bodies, concurrency, duration))
    finally:
        sampler.done.set()
        sampler.join()
    after, client_cpu = psutil.Process(proc.pid).cpu_times(), time.process_time() - client_cpu
    ok = len(latencies)
    q = statistics.quantiles(latencies, n=100) if ok >= 2 else [float("nan")] * 99
    return {
        "rps": ok / elapsed,
        "p50_ms": 1e3 * q[49],
        "p99_ms": 1e3 * q[98],
        "ok": ok,
        "busy": busy,
        "errors": errors,
        "rss_mib": sampler.peak_rss / 2**20,
        "threads": sampler.peak_threads,
        "cpu_ms_per_req": 1e3 * (after.user + after.system - cpu.user - cpu.system) / max(ok, 1),
        "client_cpu_ms_per_req": 1e3 * client_cpu / max(ok + busy + errors, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 s per phase (a few seconds in all per scorer)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of load per phase")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--scorers", nargs="+", choices=["standin", "constant"], default=["standin", "constant"])
    parser.add_argument("--response-chars", type=int, default=400, help="characters per response")
    parser.add_argument("--max-pending", type=int, default=None, help="our server's admission cap (503 beyond)")
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)  # a server subprocess
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.scorers[0], args.model, args.max_pending)
        return
    duration = 1.0 if args.quick else args.duration
    from openrlhf_geo.rewards.armorm import MAX_PENDING

    args.max_pending = args.max_pending or MAX_PENDING
    import fastapi
    import psutil
    import uvicorn

    print(f"python {sys.version.split()[0]}, fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}")
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{duration:g} s of load per phase after a warm-up; our max_pending {args.max_pending}; "
        "ratios are fastapi / ours\n"
    )
    bodies = payloads(512, args.response_chars)
    procs = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as log:
        try:
            model = None
            if "standin" in args.scorers:
                spec = importlib.util.spec_from_file_location(
                    "armorm_standin_build", ROOT / "tests" / "fixtures" / "armorm_standin" / "build.py"
                )
                builder = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(builder)
                builder.build(tmp)
                model = tmp
            for scorer in args.scorers:
                servers = {}
                for kind in SERVERS:
                    servers[kind] = start(kind, scorer, model, args.max_pending, log, procs)
                idle = {k: psutil.Process(p.pid).memory_info().rss / 2**20 for k, (p, _) in servers.items()}
                print(f"scorer {scorer}: idle RSS ours {idle['ours']:.0f} MiB, fastapi {idle['fastapi']:.0f} MiB")
                header = "  C  server   req/s   p50 ms   p99 ms  503s errors  peak RSS MiB threads  CPU ms/req  client"
                print(header)
                for n, concurrency in enumerate(args.concurrency):
                    rows = {}
                    for kind in SERVERS if n % 2 == 0 else SERVERS[::-1]:  # alternate who goes first
                        rows[kind] = phase(*servers[kind], bodies, concurrency, duration)
                    for kind in SERVERS:
                        r = rows[kind]
                        print(
                            f"{concurrency:>3}  {kind:<7} {r['rps']:>7.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                            f"{r['busy']:>5} {r['errors']:>6} {r['rss_mib']:>13.0f} {r['threads']:>7} "
                            f"{r['cpu_ms_per_req']:>11.2f} {r['client_cpu_ms_per_req']:>7.2f}"
                        )
                    ratio = {k: rows["fastapi"][k] / rows["ours"][k] if rows["ours"][k] else float("nan") for k in r}
                    print(
                        f"{concurrency:>3}  ratio   {ratio['rps']:>7.2f} {ratio['p50_ms']:>8.2f} "
                        f"{ratio['p99_ms']:>8.2f} {'':>5} {'':>6} {ratio['rss_mib']:>13.2f} {'':>7} "
                        f"{ratio['cpu_ms_per_req']:>11.2f}"
                    )
                for kind in SERVERS:
                    stop(servers[kind][0])
                print()
        finally:
            for proc in procs:  # also on Ctrl-C or a failed start
                stop(proc)


if __name__ == "__main__":
    main()
