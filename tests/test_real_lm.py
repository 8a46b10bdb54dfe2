"""The real pretrained LM asset (openrlhf_geo.real_lm): SmolLM2-135M-Instruct from the registry wheel, converted once,
atomically, with the right special tokens; and one-line errors when it cannot be provided."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from openrlhf_geo import real_lm
from openrlhf_geo.real_lm import SMOLLM2, AssetError


@pytest.fixture(scope="session")
def smollm2():
    """The converted model in the user's cache (scripts/setup_cpu.sh test converts it; a no-op here then)."""
    return real_lm.convert()


def test_conversion_is_the_pinned_llama_with_its_chat_tokens(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (49152, 576, 30)
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (9, 64, 3)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    # the release's ids: the GGUF's own tokenizer said eos = <|im_start|> and had no pad
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_end|>" in text
    card = json.loads((smollm2 / real_lm.CARD_JSON).read_text())
    assert card["gguf_sha256"] == SMOLLM2.gguf_sha256 and card["parameters"] == SMOLLM2.parameters
    assert card["license"] == "Apache-2.0" and card["quantization"].startswith("Q4_1")
    assert card["conversion"] == real_lm.CONVERSION and not tokenizer.clean_up_tokenization_spaces
    assert "4-bit quantization of the release" in (smollm2 / real_lm.CARD_MD).read_text()


def test_converted_weights_are_a_pretrained_lm(smollm2):
    """English reads far likelier than the same tokens shuffled, and greedy decoding answers a chat turn and ends it
    with <|im_end|>: the weights are a trained model, not a random init of the same shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2.parameters
    ids = tokenizer("The capital of France is Paris. It is known for the Eiffel Tower.", return_tensors="pt").input_ids
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        nll = [model(input_ids=x, labels=x).loss.item() for x in (ids, shuffled)]
    assert nll[0] < 4.0 < nll[1] - 2.0, nll
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = out[0, prompt["input_ids"].shape[1] :]
    assert "5" in tokenizer.decode(answer, skip_special_tokens=True)
    assert tokenizer.eos_token_id in answer.tolist()


def test_a_finished_conversion_is_returned_without_rebuilding(smollm2, monkeypatch):
    monkeypatch.setattr(real_lm, "_build", lambda *a: pytest.fail("a finished conversion was rebuilt"))
    assert real_lm.convert() == smollm2
    assert real_lm.is_converted(smollm2)


def _fake_build(asset, gguf, target):
    """`_build`'s contract without the 25-60 s of a real one: write the files, return the card (`convert` adds the
    file list with digests and writes it)."""
    (target / "weights.bin").write_bytes(b"x" * 10)
    return {"gguf_sha256": asset.gguf_sha256, "conversion": real_lm.CONVERSION}


def test_interrupted_conversion_leaves_nothing_and_the_next_one_finishes(tmp_path, monkeypatch):
    out = tmp_path / "m"

    def interrupted(asset, gguf, target):
        (target / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(real_lm, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        real_lm.convert(out=out)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".m.tmp-4242").mkdir()  # what a SIGKILL-ed conversion leaves
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    assert real_lm.convert(out=out) == out and real_lm.is_converted(out)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no lock file, no temp directory


def test_a_lock_that_cannot_be_taken_is_named_by_the_out_directory(tmp_path, monkeypatch, capsys):
    """The refusal was Python's "[Errno 21] Is a directory: '<dir>/.m.lock'", naming only the lock file."""
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    (tmp_path / ".m.lock").mkdir()
    assert real_lm.main(["smollm2", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    reason = "cannot write there (its lock file .m.lock beside it: Is a directory)"
    assert err == f"openrlhf-geo model: {tmp_path / 'm'}: {reason}\n"


def test_concurrent_conversions_build_once_and_leave_no_lock_file(tmp_path, monkeypatch):
    """The lock file is removed after each conversion; a waiter on a removed one must not build beside the holder."""
    import threading

    out, building, builds = tmp_path / "m", [], []

    def slow(asset, gguf, target):
        building.append(target)
        builds.append(len(building))  # how many were building at once
        time.sleep(0.3)
        building.remove(target)
        return _fake_build(asset, gguf, target)

    monkeypatch.setattr(real_lm, "_build", slow)
    threads = [threading.Thread(target=real_lm.convert, kwargs={"out": out}) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert builds == [1] and real_lm.is_converted(out)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_sigkill_during_conversion_leaves_no_target(tmp_path):
    """A real conversion killed while it writes: the target never exists half-written."""
    out = tmp_path / "m"
    proc = subprocess.Popen(
        [sys.executable, "-m", "openrlhf_geo.real_lm", "smollm2", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600  # a loaded 2-core VM took over 120 s to reach the weights
        while not list(tmp_path.glob(".m.tmp-*/*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the weights are being written
        assert proc.poll() is None, "the conversion ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert list(tmp_path.glob(".m.tmp-*/*")), "killed before it wrote anything"
    assert not out.exists() and not real_lm.is_converted(out)


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_holding_other_files_is_refused_even_forced_and_nothing_is_created(tmp_path, monkeypatch, force):
    """--force replaces only what a conversion wrote: a user's files are named, never deleted; and a refusal
    creates nothing (no lock file beside --out, no temp directory)."""
    out = tmp_path / "m"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("user data")
    (out / "sub" / "x").write_text("more")
    before = _listing(tmp_path)
    monkeypatch.setattr(real_lm, "_build", lambda *a: pytest.fail("built over a user's directory"))
    with pytest.raises(AssetError, match=re.escape(f"{out} holds files a conversion did not write (keep.txt, sub/)")):
        real_lm.convert(out=out, force=force)
    assert _listing(tmp_path) == before and (out / "keep.txt").read_text() == "user data"


def test_force_replaces_a_conversion_and_an_empty_directory_needs_no_force(tmp_path, monkeypatch):
    out = tmp_path / "m"
    out.mkdir()
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    assert real_lm.convert(out=out) == out and real_lm.is_converted(out)  # nothing there to lose
    (out / "weights.bin").write_bytes(b"y" * 10)
    with pytest.raises(AssetError, match="not a finished conversion .*: pass --force"):
        real_lm.convert(out=out)
    assert real_lm.convert(out=out, force=True) == out and real_lm.is_converted(out)
    assert _listing(tmp_path) == ["m", "m/model_card.json", "m/weights.bin"]


def test_force_over_a_file_is_refused_and_leaves_nothing_beside_it(tmp_path, monkeypatch):
    out = tmp_path / "afile"
    out.write_text("user data")
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    with pytest.raises(AssetError, match=re.escape(f"{out} is a file, not a directory")):
        real_lm.convert(out=out, force=True)
    assert _listing(tmp_path) == ["afile"] and out.read_text() == "user data"


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys, out):
    """`--out ""` is not the working directory: with --force it replaced the directory the user stood in."""
    from openrlhf_geo import cli

    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("user data")
    monkeypatch.chdir(work)
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    assert cli.main(["model", "smollm2", "--out", out, "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openrlhf-geo model: --out ") and "empty" in err and len(err.splitlines()) == 1
    assert _listing(tmp_path) == ["work", "work/keep.txt"]


def test_an_earlier_conversion_of_the_same_gguf_is_rebuilt_without_force(tmp_path, monkeypatch):
    out = tmp_path / "m"
    out.mkdir()
    card = {"gguf_sha256": SMOLLM2.gguf_sha256, "conversion": real_lm.CONVERSION - 1, "files": {}}
    (out / real_lm.CARD_JSON).write_text(json.dumps(card))
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    assert real_lm.convert(out=out) == out and real_lm.is_converted(out)
    assert real_lm.read_card(out)["conversion"] == real_lm.CONVERSION


@pytest.mark.parametrize("damage", [b"x", b"y" * 10])
def test_a_truncated_or_changed_file_is_not_a_finished_conversion(tmp_path, monkeypatch, damage):
    out = tmp_path / "m"
    monkeypatch.setattr(real_lm, "_build", _fake_build)
    real_lm.convert(out=out)
    assert real_lm.is_converted(out)
    (out / "weights.bin").write_bytes(damage)
    assert not real_lm.is_converted(out)
    with pytest.raises(AssetError, match="not a finished conversion"):
        real_lm.convert(out=out)


def test_real_weights_changed_in_place_are_not_a_finished_conversion(smollm2, tmp_path):
    """Same size, other bytes (a dtype in the safetensors header, a weight): sizes alone took both as finished."""
    copy = tmp_path / "m"
    shutil.copytree(smollm2, copy)
    assert real_lm.is_converted(copy)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as f:
        header = f.read(1 << 16)
        at = header.index(b'"F32"') + 1
        f.seek(at)
        f.write(b"I")
    assert not real_lm.is_converted(copy)
    with open(weights, "r+b") as f:
        f.seek(at)
        f.write(b"F")
    assert real_lm.is_converted(copy)
    with open(weights, "r+b") as f:
        f.seek(-1000, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert not real_lm.is_converted(copy)


@pytest.mark.parametrize("error", ["safetensors", "oserror"])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, error):
    """What safetensors 0.8 raises when the weights hit ENOSPC (measured on a 1 MB tmpfs), and what the tokenizer's
    and the card's plain file writes raise."""
    from safetensors import SafetensorError

    out = tmp_path / "m"

    def full(asset, gguf, target):
        (target / "model.safetensors").write_bytes(b"half")
        if error == "safetensors":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target / "tokenizer.json"))

    monkeypatch.setattr(real_lm, "_build", full)
    from openrlhf_geo import cli

    assert cli.main(["model", "smollm2", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        f"openrlhf-geo model: {out}: no space left on device (ENOSPC)"
    )
    assert list(tmp_path.iterdir()) == []


_INTERRUPTIBLE = """
import signal, sys, time
from openrlhf_geo import real_lm

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever this test's parent ignores

def build(asset, gguf, target):
    (target / "model.safetensors").write_bytes(b"half")
    time.sleep(600)

real_lm._build = build
sys.exit(real_lm.main(sys.argv[1:]))
"""


def test_ctrl_c_during_conversion_is_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTIBLE, "smollm2", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".m.tmp-*/*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the build is writing
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert (proc.returncode, stdout, stderr) == (
        130,
        "",
        f"openrlhf-geo model: interrupted; nothing was written to {out}\n",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("not-installed", "is not installed: run `bash scripts/setup_cpu.sh real-lm`"),
        ("other-version", "0.0.9 is installed, 0.1.2 is pinned"),
        ("no-gguf-module", "needs gguf: run `bash scripts/setup_cpu.sh real-lm`"),
        ("wrong-hash", "pinned b179c952"),
    ],
)
def test_what_is_missing_is_named_with_the_command_that_installs_it(tmp_path, monkeypatch, breakage, message):
    import importlib.metadata
    import importlib.util

    real_find_spec = importlib.util.find_spec
    if breakage == "not-installed":

        def distribution(name):
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    elif breakage == "other-version":

        class Other:
            version = "0.0.9"

        monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Other())
    elif breakage == "no-gguf-module":
        monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "gguf" else real_find_spec(n))
    else:
        monkeypatch.setattr(real_lm, "sha256", lambda path: "0" * 64)
    monkeypatch.setattr(real_lm, "_build", lambda *a: pytest.fail("converted despite " + breakage))
    with pytest.raises(AssetError, match=re.escape(message)):
        real_lm.convert(out=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_model_command_prints_the_directory_or_one_line(tmp_path, smollm2, capsys):
    from openrlhf_geo import cli

    assert cli.main(["model", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("x")
    assert cli.main(["model", "smollm2", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("openrlhf-geo model: ") and "--force" in err and len(err.splitlines()) == 1
