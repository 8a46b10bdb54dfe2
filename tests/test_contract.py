"""docs/CONTRACT.md against the code: every backquoted name exists, every backquoted signature lists the real
parameters in order with their defaults, and its value, key, registry and CLI claims hold."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import openrlhf_geo.pipeline  # noqa: F401  (registers every method)
from openrlhf_geo import cli, registry
from openrlhf_geo.local import rundir
from openrlhf_geo.pipeline import STATE_FORMAT, SignalGuard
from openrlhf_geo.salt import salt_advantages

CONTRACT = Path(__file__).resolve().parents[1] / "docs" / "CONTRACT.md"
SPAN = re.compile(r"`([^`]+)`")
NAME = re.compile(r"[A-Za-z_][\w.]*")
CALL = re.compile(r"([A-Za-z_][\w.]*)\((.*)\)", re.DOTALL)


def bullets(text):
    """[(module the bullet is under or None, the bullet's text joined into one line)] of the file's list items."""
    items, module = [], None
    for line in text.splitlines():
        if line.startswith("- ") or line.lstrip().startswith("- "):
            if line.startswith("- "):  # a top-level bullet opens with its module, or with a full path
                first = SPAN.match(line[2:])
                module = first[1] if first and _is_module(first[1]) else None
            items.append([module, line.strip()[2:]])
        elif items and line.startswith(" "):
            items[-1][1] += " " + line.strip()
    return [tuple(item) for item in items]


def _is_module(path):
    try:
        importlib.import_module(path)
    except ImportError:
        return False
    return True


def resolve(path, module):
    """The object `path` names: a full openrlhf_geo path (the longest importable prefix, then attributes), or an
    attribute path in `module`."""
    parts = path.split(".")
    if parts[0] == "openrlhf_geo":
        cut = max(i for i in range(1, len(parts) + 1) if _is_module(".".join(parts[:i])))
        obj, rest = importlib.import_module(".".join(parts[:cut])), parts[cut:]
    else:
        assert module is not None, f"`{path}` is under no module"
        obj, rest = importlib.import_module(module), parts
    for part in rest:
        assert hasattr(obj, part), f"`{path}`: {obj!r} has no {part!r}"
        obj = getattr(obj, part)
    return obj


def split_params(text):
    """A parameter list at its top-level commas (brackets and quotes respected)."""
    out, depth, quote, current = [], 0, None, ""
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            out.append(current.strip())
            current = ""
            continue
        current += char
    return [p for p in [*out, current.strip()] if p]


def check_signature(path, params, module):
    obj = resolve(path, module)
    actual = list(inspect.signature(obj).parameters.values())
    if actual and actual[0].name == "self":
        actual = actual[1:]
    namespace = vars(inspect.getmodule(obj) or importlib.import_module(module))
    keyword_only, i = False, 0
    for item in split_params(params):
        if item == "...":
            return
        if item == "*":
            keyword_only = True
            continue
        assert i < len(actual), f"`{path}`: the contract lists {item!r} beyond the real parameters"
        real = actual[i]
        i += 1
        name, _, default = item.partition("=")
        if name.startswith("**"):
            assert real.kind is real.VAR_KEYWORD and real.name == name[2:], f"`{path}`: {item!r} is {real}"
            continue
        assert real.name == name, f"`{path}`: parameter {i} is {real.name!r}, the contract says {name!r}"
        want = real.KEYWORD_ONLY if keyword_only else real.POSITIONAL_OR_KEYWORD
        assert real.kind is want, f"`{path}`: {name!r} is {real.kind.description}, the contract says otherwise"
        if not default:
            assert real.default is real.empty, f"`{path}`: {name!r} has a default ({real.default!r})"
        elif default != "...":
            assert real.default == eval(default, dict(namespace)), f"`{path}`: {name}={real.default!r}, not {default}"
        else:
            assert real.default is not real.empty, f"`{path}`: {name!r} has no default"
    assert i == len(actual), f"`{path}`: the contract leaves out {[p.name for p in actual[i:]]}"


def spans():
    return [(module, span) for module, text in bullets(CONTRACT.read_text()) for span in SPAN.findall(text)]


def test_every_name_and_signature_in_the_contract_is_the_codes():
    checked = 0
    for module, span in spans():
        if call := CALL.fullmatch(span):
            check_signature(call[1], call[2], module)
        elif NAME.fullmatch(span):
            resolve(span, module)
        else:
            continue
        checked += 1
    assert checked > 100  # the file is read: a parsing slip cannot pass silently


def test_the_values_the_contract_states_are_the_codes():
    checked = 0
    for module, text in bullets(CONTRACT.read_text()):
        for name, value in re.findall(r"`(\w+)` = (\d+|\([^)]*\))", text):
            assert resolve(name, module) == ast.literal_eval(value), f"`{name}` = {value}"
            checked += 1
    assert checked == 3  # METHODS, DEFAULT_DIM, K_RULES


def _listed(text, after, until):
    return [key.strip() for key in text.split(after, 1)[1].split(until, 1)[0].split(",")]


def test_salt_advantages_returns_the_stats_keys_the_contract_lists():
    text = " ".join(CONTRACT.read_text().split())
    keys = _listed(text, "salt/<key>): ", " (+")
    shrink = _listed(text, "solve_ms (+ ", " under gram")
    a = torch.tensor([1.0, -1.0, 0.5, -0.5])
    F = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    assert list(salt_advantages(a, F)[1]) == keys
    assert list(salt_advantages(a, F, gram="shrink")[1]) == keys + shrink
    out = salt_advantages(a, F, return_basis=True)
    assert len(out) == 3 and out[2]._fields == ("basis", "is_top", "gram")


def test_the_registries_hold_the_names_the_contract_lists():
    text = " ".join(CONTRACT.read_text().split())
    tables = {"estimators": registry.ESTIMATORS, "curations": registry.CURATIONS,
              "policy losses": registry.POLICY_LOSSES, "adjustments": registry.ADJUSTMENTS}  # fmt: skip
    for label, table in tables.items():
        listed = re.search(rf'{label} ((?:"\w+"(?:, )?)+)', text)
        assert listed, label
        # as sets: registration follows import order, which an earlier test in the same process may change
        assert sorted(re.findall(r'"(\w+)"', listed[1])) == sorted(table), label
    advantage = [entry for entry in registry.ADJUSTMENTS.values() if entry.stage == "advantage"]
    assert max(advantage, key=lambda entry: entry.order).name == "salt"  # SALT the last "advantage" one


def test_the_pipeline_guard_rundir_and_cli_claims():
    assert STATE_FORMAT == 2
    rewards, group_ids = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    assert set(SignalGuard().check(rewards, group_ids)) == {"signal/tied_groups"}
    truncated = torch.tensor([False, True, False, False])
    assert set(SignalGuard().check(rewards, group_ids, truncated)) == {"signal/tied_groups", "signal/truncated"}
    assert issubclass(rundir.OutputClaimed, ValueError)
    for name, (module, _) in cli.COMMANDS.items():
        main = importlib.import_module(module).main
        assert list(inspect.signature(main).parameters)[:1] == ["argv"], name


@pytest.mark.parametrize("wrong, message", [
    ("`salt_advantages(advantages, features, variant=\"full\")`", "the contract leaves out"),
    ("`salt_advantages(advantages, features, variant=\"half\", ...)`", "variant='full', not \"half\""),
    ("`salt_advantages(advantages, feature, ...)`", "parameter 2 is 'features'"),
    ("`no_such_function(x)`", "has no 'no_such_function'"),
])  # fmt: skip
def test_the_checker_refuses_a_wrong_claim(wrong, message):
    (module, text), *_ = [b for b in bullets(CONTRACT.read_text()) if b[0] == "openrlhf_geo.salt"]
    span = SPAN.fullmatch(wrong)[1]
    call = CALL.fullmatch(span)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_signature(call[1], call[2], module)
