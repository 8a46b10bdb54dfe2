"""Test-only import shims so the real openrlhf 0.11.2 modules import on a CPU machine without flash_attn / vllm.

Never used at run time: GPU nodes have the real packages. The flash_attn functions are pure-torch equivalents of
the padding helpers openrlhf's packed-sample path calls (`unpad_input`, `pad_input`, `index_first_axis`); vllm
provides only the names imported at module level. A module that really exists is never replaced.
"""

import importlib.machinery
import importlib.util
import sys
import types

from openrlhf_geo.fork.cpu import all_gather, index_first_axis, pad_input, rearrange, unpad_input

_INSTALLED = []


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() must work on it
    module.__path__ = []  # a package: missing submodules raise ModuleNotFoundError (caught where upstream expects)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    _INSTALLED.append(name)
    return module


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def install():
    """Register the shims for whichever of flash_attn / vllm is not importable."""
    if importlib.util.find_spec("flash_attn") is None:
        _module("flash_attn", __version__="0+cpu-shim")
        _module(
            "flash_attn.bert_padding",
            index_first_axis=index_first_axis,
            pad_input=pad_input,
            rearrange=rearrange,
            unpad_input=unpad_input,
        )
        _module("flash_attn.utils")
        _module("flash_attn.utils.distributed", all_gather=all_gather)
    if importlib.util.find_spec("vllm") is None:
        import uuid

        _module("vllm", __version__="0+cpu-shim", SamplingParams=SamplingParams)
        _module("vllm.inputs", TokensPrompt=dict)
        _module("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)


def uninstall():
    """Remove the shims again (modules that imported them keep their references)."""
    while _INSTALLED:
        sys.modules.pop(_INSTALLED.pop(), None)
