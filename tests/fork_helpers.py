"""Parsing through the real patched upstream parser, shared by test_fork_pipeline.py and test_example_scripts.py
(the `up` fixture they pass in is in conftest.py)."""

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from openrlhf_geo.fork import install as fork
from openrlhf_geo.fork import launch

# ── upstream's parser (cli/train_ppo_ray.py run as __main__, `train` never reached) ──

BASE_ARGV = ["--actor.model_name_or_path", "tiny", "--rollout.n_samples_per_prompt", "4", "--train.seed", "7"]


class Parsed(Exception):
    pass


def parse(up, monkeypatch, argv):
    """`openrlhf-geo train-ppo-ray ARGV` (fork.main: upstream train_ppo_ray run as __main__ on the fork), stopped
    where train() starts: returns the args it receives, after upstream's own checks. The output folders default to a
    temporary folder, not upstream's ./ckpt in the working directory: the driver locks them for the run
    (fork_hooks.claim_outputs), and test workers parsing at once would meet there. ARGV's own win."""
    import ray

    def stop(args):
        raise Parsed(args)

    monkeypatch.setenv(fork.CACHE_ENV, str(up.cache))
    monkeypatch.setattr(up.utils, "get_strategy", stop)  # train()'s first call after ray.init
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    outputs = Path(tempfile.mkdtemp(prefix="openrlhf-geo-parse-"))
    defaults = ["--ckpt.output_dir", str(outputs / "ckpt"), "--ckpt.path", str(outputs / "ckpt" / "checkpoints")]
    try:
        with pytest.raises(Parsed) as caught:
            launch.main([*BASE_ARGV, *defaults, *argv])
    finally:
        shutil.rmtree(outputs, ignore_errors=True)
    return caught.value.args[0]
