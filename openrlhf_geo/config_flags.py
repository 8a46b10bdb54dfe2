"""Command-line flags generated from the typed configs: each flag's name, help, choices and default live on its config
field (`setting`), and `add_flags` turns a config's fields into argparse flags (options.add_args).

A flag's --help shows the dataclass default (`shown`); its argparse default is None, so `options.validate` can tell
"given" from "default" (the reward-noise flags keep their real defaults: the config is built from every one).
"""

from dataclasses import MISSING, Field, field, fields
from typing import Any


def setting(default, help, *, flag=None, metadata=None, **argparse_kwargs) -> Any:
    """A config field that is also the flag --<prefix>[.<group>].<flag or field name>.

    help: what it does, without its default (--help adds the dataclass's); argparse_kwargs: `type`, `nargs`,
    `metavar`, `action`, `const`, and `choices` (a sequence, or a callable returning one when a registry fills it).
    A bool field without `action` is a store_true switch; an int / float / str default gives the argparse type.
    metadata: the field's other metadata (e.g. {"group": "projector"}).
    """
    # Any, as dataclasses.field is typed: the value stands in for the default of a field of any declared type
    return field(
        default=default, metadata={**(metadata or {}), "help": help, "flag": flag, "argparse": argparse_kwargs}
    )


def shown(value) -> str:
    """A default as --help shows it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return str(value)


def flag_fields(config) -> list[tuple[Field, str, str]]:
    """(field, option string, dest) of every field of `config` that is a flag."""
    out = []
    for f in fields(config):
        if "help" not in f.metadata:
            continue
        path = ".".join(part for part in (config.FLAG_PREFIX, f.metadata.get("group")) if part)
        out.append((f, f"--{path}.{f.metadata['flag'] or f.name}", f"{path}.{f.name}"))
    return out


def default_text(f, presets=None) -> str:
    """'(default X)' for a field, with the presets whose value differs ('; rlhf preset 0.12')."""
    default = f.default if f.default is not MISSING else f.default_factory()
    name = f.name if f.metadata["flag"] else None  # a flag named otherwise (--no_warm_start) names its field
    text = f"default {name + ' ' if name else ''}{shown(default)}"
    for preset, values in (presets or {}).items():
        if f.name in values and values[f.name] != default:
            text += f"; {preset} preset {shown(values[f.name])}"
    return f"({text})"


def add_flags(group, config, *, given_only=True, presets=None) -> None:
    """Add a flag for every `setting` field of the dataclass `config` (prefix `config.FLAG_PREFIX`) to the argparse
    group. given_only: argparse default None (unset = the config's default); else the config's default itself."""
    for f, option, dest in flag_fields(config):
        kwargs = dict(f.metadata["argparse"])
        if callable(kwargs.get("choices")):
            kwargs["choices"] = tuple(kwargs["choices"]())
        # a field without a default has a default_factory: dataclasses' invariant, which the stub cannot express
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
        if "action" not in kwargs and "type" not in kwargs:
            if isinstance(default, bool):
                kwargs["action"] = "store_true"
            elif isinstance(default, (int, float)):
                kwargs["type"] = type(default)
        help_text = f"{f.metadata['help']} {default_text(f, presets)}".replace("%", "%%")
        group.add_argument(option, dest=dest, default=None if given_only else default, help=help_text, **kwargs)


__all__ = ["add_flags", "default_text", "flag_fields", "setting", "shown"]
