"""Parsing through the real patched upstream parser, shared by test_fork_pipeline.py and test_example_scripts.py
(the `up` fixture they pass in is in conftest.py)."""

import sys

import pytest

from openrlhf_geo.fork import install as fork
from openrlhf_geo.fork import launch

# ── upstream's parser (cli/train_ppo_ray.py run as __main__, `train` never reached) ──

BASE_ARGV = ["--actor.model_name_or_path", "tiny", "--rollout.n_samples_per_prompt", "4", "--train.seed", "7"]


class Parsed(Exception):
    pass


def parse(up, monkeypatch, argv):
    """`openrlhf-geo train-ppo-ray ARGV` (fork.main: upstream train_ppo_ray run as __main__ on the fork), stopped
    where train() starts: returns the args it receives, after upstream's own checks."""
    import ray

    def stop(args):
        raise Parsed(args)

    monkeypatch.setenv(fork.CACHE_ENV, str(up.cache))
    monkeypatch.setattr(up.utils, "get_strategy", stop)  # train()'s first call after ray.init
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    with pytest.raises(Parsed) as caught:
        launch.main([*BASE_ARGV, *argv])
    return caught.value.args[0]
