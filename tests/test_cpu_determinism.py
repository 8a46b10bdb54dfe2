"""`openrlhf-geo demo` gives the same per-seed results when the CPU kernels a machine would pick differ.

Machines differ in the kernels they run: ATen picks its default / AVX2 / AVX-512 code per CPU, MKL and numpy's
OpenBLAS pick their code paths per processor, glibc its libm variants (FMA or not), and the thread count varies. A
small demo (SFT warm-up long enough for non-zero accuracy, then a few steps of the four methods) runs in two
subprocesses: one with this CPU's own picks, one with every pick this CPU can change made differently. With
`local.kernels.pin` both compute the same; before it, the SFT model already diverged (held-out accuracy 0.0078 vs
0.0137 on the AVX-512 machine this was written on, then other sampled lengths from the first RL step on).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_geo.local import kernels

ROOT = Path(__file__).resolve().parents[1]
# the smallest demo that showed the divergence: 150 SFT steps reach non-zero accuracy (GRPO has rewards to learn
# from, the evaluations have something to count), then 4 RL steps of each method
DEMO = ["demo", "--quick", "--steps", "4", "--sft-steps", "150"]


def variants():
    """{name: environment}: this CPU's own picks; the other picks it can make (ATen's default kernels, MKL's AVX2
    branch, OpenBLAS's Sandybridge kernels, glibc's libm without FMA/AVX2, two threads)."""
    native = {k: v for k, v in os.environ.items() if k not in {*kernels.PINNED, "GLIBC_TUNABLES"}}
    other = {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_CBWR": "AVX2",
        "OPENBLAS_CORETYPE": "Sandybridge",
        "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F",
        "OMP_NUM_THREADS": "2",
    }
    return {"native": native, "other": {**native, **other}}


def start_demo(out, env):
    argv = [sys.executable, "-m", "openrlhf_geo.cli", *DEMO, "--out", str(out)]
    with open(f"{out}.log", "w") as log:  # a file, not a pipe: progress bars would fill a pipe and stall the run
        return subprocess.Popen(argv, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log)


def results(out, process):
    """(SFT held-out accuracy, {run: metric rows}) of a finished demo process."""
    assert process.wait() == 0, Path(f"{out}.log").read_text()[-3000:]
    runs = {}
    for path in sorted(Path(out).glob("runs/*/seed*/metrics.jsonl")):
        runs[f"{path.parent.parent.name}/{path.parent.name}"] = [json.loads(line) for line in path.open()]
    return json.loads((Path(out) / "sft" / "sft.json").read_text())["accuracy"], runs


def differences(a, b):
    """[(step, key, a, b)] where two runs' metric rows differ (wall times aside)."""
    found = []
    for row_a, row_b in zip(a, b, strict=True):
        for key in sorted(row_a.keys() | row_b.keys()):
            x, y = row_a.get(key), row_b.get(key)
            nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
            if x != y and not nan and not key.startswith(("time/", "salt/solve_ms", "geo/time_s")):
                found.append((row_a["step"], key, x, y))
    return found


@pytest.mark.slow
@pytest.mark.full  # two demos side by side, both cores for about 3 min on an idle 2-core VM
@pytest.mark.skipif(not kernels.NEEDS <= kernels.cpu_flags(), reason="the pinned kernels need a CPU with AVX2 and FMA")
def test_the_demo_gives_the_same_per_seed_results_under_other_cpu_kernels(tmp_path):
    # side by side, one core each (the demo computes on one thread)
    started = [(tmp_path / name, start_demo(tmp_path / name, env)) for name, env in variants().items()]
    (sft_a, runs_a), (sft_b, runs_b) = (results(out, process) for out, process in started)
    assert sft_a == sft_b > 0  # the SFT model's held-out accuracy
    methods = ("grpo", "salt", "grpo_noise", "geoalign_noise")
    assert sorted(runs_a) == sorted(runs_b) == sorted(f"{m}/seed0" for m in methods)
    found = {run: differences(runs_a[run], runs_b[run])[:5] for run in runs_a}
    assert found == dict.fromkeys(runs_a, [])
