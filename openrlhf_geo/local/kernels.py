"""One set of CPU kernels for the demo and the studies, so that their per-seed results depend on the CPU as little as
the libraries allow.

torch, MKL and numpy's OpenBLAS each pick their code per CPU (ATen's default / AVX2 / AVX-512 kernels, MKL's branch
per processor, OpenBLAS's per-core kernels); the picks round differently (~1e-7 in float32), and training amplifies
any difference: the demo's SFT warm-up grows one of ~1e-16 (float64) to 2 % of the weights within 200 steps, so no
precision is enough, only the same arithmetic (docs/results.md). `pin` fixes the picks to code that
every x86-64 CPU with AVX2 and FMA (Intel since 2013, AMD since 2015) runs alike: ATen's AVX2 kernels, MKL's
COMPATIBLE branch (the one branch MKL keeps on other vendors' processors), OpenBLAS's Haswell kernels, oneDNN at AVX2,
one thread each (ATen's default kernels would reach older CPUs too, at a higher cost; the pin's cost:
benchmarks/demo_walltime.py). Measured, that is not every CPU: AMD EPYC VMs with AVX-512 BF16 compute GeoAlign's
demo runs and the SFT warm-up differently from the Intel VMs under the same pin (docs/results.md, "Same seeds, same
numbers"), so `environment` records the CPU next to the versions. `pin` sets the variables for this process and
every process it starts; each library reads them when it first computes, so `pin` runs before any tensor is computed
(`cli.main`, for `openrlhf-geo demo` and `study`).
"""

import importlib.metadata
import os
import platform
import warnings
from pathlib import Path

from openrlhf_geo import GeoWarning

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "OPENBLAS_CORETYPE": "Haswell",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
NEEDS = {"avx2", "fma"}  # CPU flags the pinned kernels run on
# the libraries whose arithmetic a run's numbers depend on (math-verify and sympy: the reward's verdicts)
COMPUTING = ("torch", "numpy", "scipy", "transformers", "tokenizers", "safetensors", "math-verify", "sympy")


def cpuinfo():
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set(cpuinfo().get("flags", "").split())


def environment():
    """What a run's numbers depend on besides the code and the kernels: {"versions": {library: version or None},
    "python", "libc", "cpu": {"vendor", "model", "family", "model_number", "simd" flags}} (recorded in summary.json and
    sft.json; requirements/lock/ fixes the versions, docs/results.md says where the numbers were measured)."""
    versions = {}
    for name in COMPUTING:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info = cpuinfo()
    cpu = {
        "vendor": info.get("vendor_id"),
        "model": info.get("model name", platform.processor() or platform.machine()),
        "family": info.get("cpu family"),
        "model_number": info.get("model"),
        "simd": sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "fma", "amx", "f16c"))),
    }
    return {
        "versions": versions,
        "python": platform.python_version(),
        "libc": " ".join(platform.libc_ver()),
        "cpu": cpu,
    }


def pin():
    """Set PINNED in os.environ (this process and its children), replacing other values of those variables. On a
    CPU without AVX2 and FMA nothing is set (OpenBLAS would stop at its first Haswell instruction): `active` tells."""
    if NEEDS <= cpu_flags():
        os.environ.update(PINNED)


def active():
    """{"aten": the capability torch's kernels run with, "pinned": whether it and the environment are PINNED's}.

    Imports torch (and so fixes its capability): call after `pin`, to record what a run used."""
    import torch

    aten = torch.backends.cpu.get_cpu_capability()
    env = all(os.environ.get(k) == v for k, v in PINNED.items())
    return {"aten": aten, "pinned": env and aten == PINNED["ATEN_CPU_CAPABILITY"].upper()}


def check(prog):
    """The CPU kernels this process computes with (`active`); a warning when they are not the pinned ones
    (the demo or a study called from Python after torch computed): its per-seed results are then this CPU's."""
    used = active()
    if not used["pinned"]:
        warnings.warn(
            f"{prog}: CPU kernels not pinned ({used['aten']}; `openrlhf-geo` runs local.kernels.pin before torch "
            "computes): per-seed results may differ from other machines'",
            GeoWarning,
            stacklevel=2,
        )
    return used
