"""Parsing through the real patched upstream parser, shared by test_fork_pipeline.py and test_example_scripts.py
(the `up` fixture they pass in is in conftest.py); the tiny Qwen2 and the micro-batches of the experience-forward
tests, shared by test_fork_pipeline.py and test_fork_lora.py (their `tiny_path` fixture is in conftest.py)."""

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

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


# ── a tiny Qwen2 and 0.11.2-shaped micro-batches (the experience forward) ──

V = 48  # tiny vocabulary


def toy_batch(seed, left_pad=False):
    """(sequences, attention_mask, action_mask) like 0.11.2 micro-batches: right padding, action_mask (B, S-1);
    `left_pad`: left-padded prompts with an action_mask covering only the last A < S-1 columns."""
    g = torch.Generator().manual_seed(seed)
    if left_pad:
        attn = torch.tensor(
            [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]]
        )
        action = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # last A=5 action columns
    else:
        lengths, prompts = [10, 7, 8], [4, 3, 5]
        attn = torch.zeros(3, 10, dtype=torch.long)
        action = torch.zeros(3, 9, dtype=torch.long)
        for b, (n, p) in enumerate(zip(lengths, prompts)):
            attn[b, :n] = 1
            action[b, p - 1 : n - 1] = 1
    seq = torch.randint(1, V, attn.shape, generator=g) * attn
    return seq, attn, action.bool()


def hf_reference(actor, seq, attn, action, temperature):
    """Independent of Actor.forward: HF forward with hidden states -> per-token log-probs, logits, final hidden."""
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = actor.model(seq, attention_mask=attn, position_ids=position_ids, output_hidden_states=True)
    logits = out.logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, seq[:, 1:, None])[..., 0]
    width = action.shape[1]
    return logp[:, -width:] * action, logits, out.hidden_states[-1]
