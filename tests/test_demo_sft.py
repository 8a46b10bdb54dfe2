"""The demo's SFT warm-up shipped with the package (`recipe.SHIPPED_SFT`) is what `recipe.warm_up` trains.

The copy is used only where its configuration key is the run's (SFT, step budget, torch 2.13.0+cpu, the pinned
kernels), so these tests run `openrlhf-geo demo`, which pins the kernels before torch computes, in a subprocess.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from openrlhf_geo import GeoWarning
from openrlhf_geo.lab import recipe
from openrlhf_geo.local import kernels

ROOT = Path(__file__).resolve().parents[1]
needs_pin = pytest.mark.skipif(
    not kernels.NEEDS <= kernels.cpu_flags(), reason="the shipped warm-up is the pinned kernels' (AVX2 and FMA)"
)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def demo(out, *flags, timeout):
    """`openrlhf-geo demo` for seed 0 and one RL step into `out` -> (its sft.json, {method: step-0 eval accuracy},
    report.md)."""
    argv = ["demo", "--seeds", "1", "--steps", "1", "--workers", "1", "--out", str(out), *flags]
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINNED}  # the demo pins them itself
    done = subprocess.run(
        [sys.executable, "-m", "openrlhf_geo.cli", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    evals = {}
    for method in ("grpo", "salt", "grpo_noise", "geoalign_noise"):
        rows = [json.loads(line) for line in open(out / "runs" / method / "seed0" / "metrics.jsonl")]
        evals[method] = next(r["eval/accuracy"] for r in rows if r["step"] == 0)
    return json.loads((out / "sft" / "sft.json").read_text()), evals, (out / "report.md").read_text()


def test_the_shipped_files_match_their_manifest():
    info = json.loads((recipe.SHIPPED_SFT / "sft.json").read_text())
    assert sha256(recipe.SHIPPED_SFT / "model.safetensors") == info["sha256"]
    assert info["steps"] == recipe.FULL["sft_max_steps"] and info["config"]["max_steps"] == info["steps"]
    # a change to the recipe's SFT keys changes the key: the copy must then be retrained (the key test below fails)
    assert {k: info["config"][k] for k in recipe.SFT} == recipe.SFT
    assert info["config"]["torch"] == "2.13.0+cpu" and info["config"]["kernels"] == {"aten": "AVX2", "pinned": True}


@needs_pin
def test_the_demo_copies_the_shipped_warm_up_and_it_scores_its_recorded_accuracy(tmp_path):
    info, evals, report = demo(tmp_path / "demo", timeout=900)
    shipped = json.loads((recipe.SHIPPED_SFT / "sft.json").read_text())
    assert info["source"] == "shipped" and info["key"] == shipped["key"]  # this recipe's key is the copy's
    assert sha256(tmp_path / "demo" / "sft" / "model.safetensors") == shipped["sha256"]
    # every run's step-0 evaluation (256 prompts x 2 samples, seed 0) is one evaluation of the copied model: the same
    # here, and within 3 of the 512 verdicts of the held-out accuracy recorded on another CPU. A last-bit difference
    # (~1e-7) in the probabilities changes a sampled token only where its uniform draw lies that close to one of the
    # 27 boundaries of the cumulative probabilities: ~0.1 of the ~15k tokens drawn are expected to change.
    assert len(set(evals.values())) == 1
    assert evals["grpo"] == pytest.approx(shipped["accuracy"], abs=3 / 512)
    assert "The package's copy of this warm-up" in report


# What the pinned warm-up trains to, per CPU class where it was measured (docs/results.md, "Same seeds, same
# numbers"): the shipped bytes on Intel Xeon VMs with AVX-512 but without its BF16; other bytes, every time, on the
# AMD EPYC (family 25, model 17, AVX-512 BF16) VMs of 2026-12-04. Elsewhere (AMD family 26, say) nothing is promised
# and the test skips. Each class: (cpu fields, {simd flag: present}, sha256).
TRAINED_WARM_UP = [
    (
        {"vendor": "GenuineIntel"},
        {"avx512f": True, "avx512_bf16": False},
        "800425f3beefa5d4127bc9ca5c4fc7729ced3b0b25fe2c7e4a8a45a84ab1a068",
    ),
    (
        {"vendor": "AuthenticAMD", "family": "25", "model_number": "17"},
        {"avx512_bf16": True},
        "1007143a196910e641c73d736ecb5ad94ff81fdf8083b58d33227cb207012439",
    ),
]


def recorded_warm_up(cpu):
    """The sha256 recorded for `kernels.environment()["cpu"]`'s class, or None."""
    for fields, flags, digest in TRAINED_WARM_UP:
        if all(cpu.get(k) == v for k, v in fields.items()) and all(
            (flag in cpu["simd"]) == present for flag, present in flags.items()
        ):
            return digest
    return None


def test_recorded_warm_ups_name_the_shipped_one_for_its_class():
    shipped = json.loads((recipe.SHIPPED_SFT / "sft.json").read_text())["sha256"]
    intel = {"vendor": "GenuineIntel", "family": "6", "model_number": "85", "simd": ["avx2", "avx512f", "fma"]}
    assert recorded_warm_up(intel) == shipped
    amd = {"vendor": "AuthenticAMD", "family": "25", "model_number": "17", "simd": ["avx2", "avx512_bf16", "fma"]}
    assert recorded_warm_up(amd) != shipped
    # an unmeasured class promises nothing: another AMD model or family (26, model 2: AMD EPYC VMs of 2026-12-07),
    # an Intel CPU without AVX-512
    assert recorded_warm_up({**amd, "model_number": "1"}) is None
    assert recorded_warm_up({**amd, "family": "26", "model_number": "2"}) is None
    assert recorded_warm_up({**intel, "simd": ["avx2", "fma"]}) is None


@pytest.mark.slow
@needs_pin
def test_training_the_warm_up_from_scratch_gives_this_cpu_class_its_recorded_bytes(tmp_path):
    """600 SFT steps on one thread (3-4 min on a 2-core VM): byte for byte what this CPU class was measured to train
    (the shipped copy on the classes that made it); skipped on a class with no measurement."""
    cpu = kernels.environment()["cpu"]
    recorded = recorded_warm_up(cpu)
    if recorded is None:
        pytest.skip(f"no trained warm-up is recorded for this CPU ({cpu['vendor']} family {cpu['family']} model "
                    f"{cpu['model_number']}): docs/results.md says where the bytes are promised")  # fmt: skip
    info, evals, report = demo(tmp_path / "demo", "--sft-from-scratch", timeout=1800)
    shipped = json.loads((recipe.SHIPPED_SFT / "sft.json").read_text())
    assert info["source"] == "trained" and info["key"] == shipped["key"]
    assert info["sha256"] == sha256(tmp_path / "demo" / "sft" / "model.safetensors")
    assert info["sha256"] == recorded
    if info["sha256"] == shipped["sha256"]:
        assert info["accuracy"] == shipped["accuracy"] and info["params"] == shipped["params"]
    assert info["environment"]["versions"]["torch"] == "2.13.0+cpu"
    assert "The package's copy" not in report


def small_warm_up(out, shipped):
    """A 2-step warm-up of the demo's model in this process (its key is not the shipped copy's)."""
    train, held_out = recipe.prepare_data(out)
    return recipe.warm_up(out, train, held_out[:8], max_steps=2, log=lambda line: None, shipped=shipped)


def fake_shipped(tmp_path, monkeypatch, damaged=False):
    """A shipped copy whose key is `small_warm_up`'s (trained once into tmp_path/source), optionally damaged."""
    small_warm_up(tmp_path / "source", shipped=False)
    copy = tmp_path / "shipped"
    copy.mkdir()
    for path in (tmp_path / "source" / "sft").iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    if damaged:
        data = bytearray((copy / "model.safetensors").read_bytes())
        data[-1] ^= 1  # one bit of the last weight
        (copy / "model.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(recipe, "SHIPPED_SFT", copy)
    return copy


def test_a_matching_copy_is_used_and_sft_from_scratch_retrains_it(tmp_path, monkeypatch):
    copy = fake_shipped(tmp_path, monkeypatch)
    info = small_warm_up(tmp_path / "run", shipped=True)
    assert info["source"] == "shipped"
    assert sha256(tmp_path / "run" / "sft" / "model.safetensors") == sha256(copy / "model.safetensors")
    assert small_warm_up(tmp_path / "run", shipped=True)["source"] == "shipped"  # the cached copy is reused
    retrained = small_warm_up(tmp_path / "run", shipped=False)  # a copied <out>/sft is not taken for a trained one
    assert retrained["source"] == "trained" and retrained["sha256"] == info["sha256"]  # same CPU, same bytes


def test_a_damaged_copy_warns_and_the_warm_up_is_trained(tmp_path, monkeypatch):
    copy = fake_shipped(tmp_path, monkeypatch, damaged=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = small_warm_up(tmp_path / "run", shipped=True)
    assert [str(w.message) for w in caught if issubclass(w.category, GeoWarning)] == [
        f"{copy / 'model.safetensors'} does not match its sha256 in sft.json (a damaged install?): training the SFT "
        "warm-up instead"
    ]
    assert info["source"] == "trained" and info["sha256"] != sha256(copy / "model.safetensors")


def test_the_wheel_ships_the_warm_up(tmp_path):
    """A non-editable install (pip install git+...) has the copy too: setup.py lists it as package data."""
    source = tmp_path / "source"  # a copy: the build leaves build/ and *.egg-info next to setup.py
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=source, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("openrlhf_geo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"openrlhf_geo/assets/demo_sft/{p.name}" for p in recipe.SHIPPED_SFT.iterdir()} <= names
