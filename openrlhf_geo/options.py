"""The `--salt.*`, `--geoalign.*`, `--reward.noise.*`, `--baseline.*` flags and `--reward.timeout_s`, shared by the
fork and the local engine.

Both engines call `add_args(parser)` on their own argparse parser (the fork: upstream's train_ppo_ray parser,
via patches/), then `validate(args)` on the nested namespace (`args.salt.variant`, `args.geoalign.alpha`, ...),
which builds the run's typed configuration once, as `args.geometry` (`geometry_config`): both engines and the
pipeline read it. The flags are generated from the configs' fields (config_flags: name, help, choices and the
default --help shows). Values are validated in one place, the
configs' `__post_init__` (SaltConfig, GeoAlignConfig, NoiseConfig, BaselineConfig, GeometryConfig); this module
checks which flags go together and asks the registries what an engine cannot run. Every config flag but the
reward-noise ones defaults to None so `validate` can tell "given" from "default" and reject flags that would be
silently ignored (e.g. `--salt.variant` without `--advantage_estimator salt`).
"""

import argparse
import dataclasses
import math
import os
import socket
import threading
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from openrlhf_geo import registry
from openrlhf_geo.baselines import BaselineConfig
from openrlhf_geo.config_flags import add_flags, flag_fields
from openrlhf_geo.geoalign import PRESETS, GeoAlignConfig
from openrlhf_geo.pipeline import GeometryConfig
from openrlhf_geo.rewards.noise import NoiseConfig
from openrlhf_geo.salt import SaltConfig

REWARD_TIMEOUT_S = 300.0  # --reward.timeout_s's default: a verifier taking minutes per call is stuck, not slow


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fork's flags: the configs' fields (config_flags.setting) plus the switches that choose which configs
    are built. The advantage-estimator flag itself belongs to the engine's parser."""
    salt = parser.add_argument_group("SALT (arXiv 2606.05800): enable with --advantage_estimator salt")
    salt.add_argument(
        "--salt.base",
        choices=tuple(registry.ESTIMATORS),  # the whitened ones too, so that the error can say why they are refused
        default=None,
        help="group-relative estimator whose sequence advantages SALT reweights (default group_norm)",
    )
    salt.add_argument(
        "--salt.diagnostics",
        action="store_true",
        default=False,
        help="without --advantage_estimator salt: compute SALT's geometry (PR, n_eff, r, ...) on the unchanged "
        "advantages and log it as salt/* (the backbone rows of SALT Table 10); advantages are not modified",
    )
    add_flags(salt, SaltConfig)

    geo = parser.add_argument_group("GeoAlign (arXiv 2606.26917)")
    geo.add_argument("--geoalign.enable", action="store_true", default=False, help="curate rollouts with GeoAlign")
    geo.add_argument(
        "--geoalign.preset",
        choices=tuple(PRESETS),
        default=None,
        help="paper defaults: math (alpha 0.05, val acc 0.95) or rlhf (alpha 0.12, val acc 0.85) (default math)",
    )
    add_flags(geo, GeoAlignConfig, presets=PRESETS)

    noise = parser.add_argument_group("reward-noise injection (robustness experiments)")
    add_flags(noise, NoiseConfig, given_only=False)  # the config is built from every one of them
    parser.add_argument(
        "--reward.timeout_s",
        type=float,
        default=REWARD_TIMEOUT_S,
        help="seconds one call of a .py reward_func may take; past it the run stops with an error naming the "
        f"function and its file (default {REWARD_TIMEOUT_S:g}; 0 = no limit)",
    )

    base = parser.add_argument_group(
        "comparison baselines (SALT arXiv 2606.05800 App. I / Table 4; GeoAlign arXiv 2606.26917 App. B.5)"
    )
    add_flags(base, BaselineConfig)
    return parser


def nest(namespace: argparse.Namespace) -> SimpleNamespace:
    """Turn dotted argparse dests ("salt.variant") into attributes (args.salt.variant)."""
    root = SimpleNamespace()
    for key, value in vars(namespace).items():
        node, *path = [root, *key.split(".")]
        for part in path[:-1]:
            if not hasattr(node, part):
                setattr(node, part, SimpleNamespace())
            node = getattr(node, part)
        setattr(node, path[-1], value)
    return root


def _given(ns, skip=("enable", "diagnostics")) -> list[str]:
    """Flags of a group that were set on the command line (all default to None)."""
    return [k for k, v in vars(ns).items() if v is not None and k not in skip and not isinstance(v, SimpleNamespace)]


ESTIMATOR_SPELLINGS = "estimator_spellings"  # namespace key: ((option string, value), ...) as given


class EstimatorFlag(argparse._StoreAction):
    """The store action of --algo.advantage.estimator and its flat alias --advantage_estimator, in both engines.
    argparse keeps the last value given, so `--advantage_estimator salt ... --algo.advantage.estimator group_norm`
    would train GRPO under a SALT label: each spelling's value is kept too, and `validate` refuses two."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = (*getattr(namespace, ESTIMATOR_SPELLINGS, ()), (option_string, values))  # a tuple: hierarchize and
        setattr(namespace, ESTIMATOR_SPELLINGS, given)  # nest would turn a dict into a namespace
        super().__call__(parser, namespace, values, option_string)

    @staticmethod
    def check(args) -> None:
        """ValueError naming both when the two spellings were given different values (`validate`, first)."""
        spellings = dict(vars(args).pop(ESTIMATOR_SPELLINGS, ()))  # each spelling's last value
        if len(set(spellings.values())) > 1:
            given = " and ".join(f"{flag} {value}" for flag, value in spellings.items())
            raise ValueError(f"{given}: one setting given two values (the last would silently win); give it once")


def validate(args, engine="local") -> None:
    """Check which flags go together, in place; raise ValueError naming the flag. Values are checked by building
    the configs (`geometry_config`), once: the result is `args.geometry`, the run's one configuration; then the
    registries say what `engine` ("local" or "fork") cannot run, and whether the engine's PPO clip ratios
    (`args.actor`, absent from parsers without engine flags) fit the policy loss.

    Afterwards `args.geometry` is the GeometryConfig both engines and the pipeline read, `args.salt.enable` tells
    whether SALT changes the advantages, and `args.algo.advantage.estimator` holds the base estimator (`salt` means
    `--salt.base` + SALT, so every upstream code path for that base stays unchanged).
    """
    EstimatorFlag.check(args)
    timeout = args.reward.timeout_s
    if not (math.isfinite(timeout) and 0 <= timeout <= threading.TIMEOUT_MAX):
        # past TIMEOUT_MAX (about 292 years) a thread's wait raises OverflowError: the deadline would never fire
        raise ValueError(
            f"--reward.timeout_s must be a number of seconds in [0, {threading.TIMEOUT_MAX:.3g}], 0 for no limit "
            f"(got {timeout:g})"
        )
    # it bounds a .py reward_func only (--reward.func in the local engine, --reward.remote_url in the fork, or the
    # fork's agent, whose reward upstream sets after this check): math-verify has its own per-answer timeout, an HTTP
    # reward upstream's; another value would be silently ignored
    agent = getattr(getattr(args, "train", None), "agent_func_path", None)
    source = getattr(args.reward, "func", None) or agent or getattr(args.reward, "remote_url", None) or ""
    if timeout != REWARD_TIMEOUT_S and not any(part.strip().endswith(".py") for part in str(source).split(",")):
        raise ValueError(
            f"--reward.timeout_s {timeout:g} bounds the calls of a .py reward_func (--reward.func in `openrlhf-geo "
            f"train`, --reward.remote_url or --train.agent_func_path in the fork); this run's reward is "
            f"{source or 'a reward model'}: drop the flag"
        )
    estimator = args.algo.advantage.estimator
    salt = args.salt
    if estimator == "salt":
        if salt.diagnostics:
            raise ValueError(
                "--salt.diagnostics is for runs without SALT; with --advantage_estimator salt the "
                "geometry is logged anyway"
            )
        salt.enable = True
    else:
        salt_only = ("base", "variant", "alpha")  # diagnostics measure the plain coefficients: no variant
        given = [k for k in _given(salt) if k in salt_only or not salt.diagnostics]
        if given:
            needs = "--advantage_estimator salt" + ("" if given[0] in salt_only else " or --salt.diagnostics")
            raise ValueError(f"--salt.{given[0]} only applies with {needs} (got {estimator!r})")
        salt.enable = False

    geo = args.geoalign
    if not geo.enable:
        given = _given(geo) + [f"projector.{k}" for k in _given(geo.projector)]
        if given:
            raise ValueError(f"--geoalign.{given[0]} only applies with --geoalign.enable")

    baseline = args.baseline
    for f in fields(BaselineConfig):
        loss = f.metadata.get("policy_loss")
        if loss is not None and getattr(baseline, f.name) is not None and baseline.policy_loss != loss:
            raise ValueError(f"--baseline.{f.name} only applies with --baseline.policy_loss {loss}")
    # the run's one configuration, built here once (the configs check their values) and read by the engines and the
    # pipeline from args.geometry
    config = args.geometry = geometry_config(args)
    if salt.enable:
        args.algo.advantage.estimator = config.salt_base  # upstream's code path for that base, unchanged
    refused = registry.refusals(config, engine, args.algo.advantage.estimator)
    if refused:
        raise ValueError(refused[0])
    entry = registry.ESTIMATORS.get(args.algo.advantage.estimator)
    if engine == "fork" and entry is not None and not entry.upstream:
        # upstream 0.11.2 has no branch for it: its dr_grpo path runs (no std, no whitening, gamma 1), then the
        # pipeline replaces those sequence advantages with the registered estimator's (fork.hooks.GeometryBatch.salt)
        config = args.geometry = dataclasses.replace(config, estimator=entry.name)
        args.algo.advantage.estimator = "dr_grpo"
    # SALT's default partition is the optimizer mini-batch's prompts (salt_stage.salt_partition_prompts): a mini-batch
    # of part of a prompt's rollouts is no partition, and cuts partitions across optimizer steps in both engines
    batch = getattr(getattr(args, "train", None), "batch_size", None)
    n = getattr(getattr(args, "rollout", None), "n_samples_per_prompt", None)
    if config.salt is not None and config.salt.group_prompts is None and batch and n and batch % n:
        flag = "--advantage_estimator salt" if salt.enable else "--salt.diagnostics"
        raise ValueError(
            f"--train.batch_size {batch} is not a multiple of --rollout.n_samples_per_prompt {n}: {flag} partitions "
            "rollouts by whole prompts, one partition per optimizer step, so a partition cannot be one step's "
            f"rollouts; use --train.batch_size {' or '.join(str(k * n) for k in (batch // n, batch // n + 1) if k)}, "
            "or set --salt.group_prompts"
        )
    actor = getattr(args, "actor", None)
    if actor is not None:
        eps_low = (actor.eps_clip_low_high or (actor.eps_clip,))[0]
        loss = config.baseline or BaselineConfig()
        message = registry.POLICY_LOSSES[loss.policy_loss].check(loss, eps_low)
        if message is not None:
            raise ValueError(message)
        # the local engine's entropy bonus is SALT Eq. 71's lambda_ENT >= 0 (baselines.entropy_bonus_loss); the
        # fork's --actor.entropy_coef is upstream's own term, with upstream's range
        if engine == "local" and actor.entropy_coef is not None and not actor.entropy_coef >= 0:
            raise ValueError(f"--actor.entropy_coef must be >= 0 (got {actor.entropy_coef})")


def check_local_path(flag: str, value: str | None) -> None:
    """ValueError when a model flag's `value` reads as a local path and does not exist: both engines, before anything
    loads (never a hub download of a typo, nor, in the fork, an error from a Ray actor minutes later).

    Hub ids are `name` or `org/name` (huggingface_hub refuses anything else), so `Qwen/Qwen2.5-0.5B` passes. A value
    starting with `.`, `/` or `~` (as given: transformers does not expand `~`), with a backslash or more than one `/`,
    ending in .json, or whose parent directory exists here is a local path.
    """
    if value is None or Path(value).exists():
        return
    if value.startswith((".", "/", "~")) or "\\" in value or value.count("/") > 1 or value.endswith(".json"):
        raise ValueError(f"{flag} {value}: no such file or directory")
    if "/" in value and Path(value).parent.is_dir():
        raise ValueError(
            f"{flag} {value}: no such file or directory (read as a local path, not a hub id: "
            f"{Path(value).parent}/ exists here)"
        )


HUB_PROBE_S = 5.0  # how long `check_model_source` waits to reach the hub


def check_model_source(flag: str, value: str) -> None:
    """ValueError, at once, when a model flag's `value` cannot load: a missing local path (`check_local_path`), or a
    hub id (`name`, `org/name`) that is not in the hub cache while the hub is out of reach (HF_HUB_OFFLINE, no
    network): transformers would retry the hub for over a minute and then raise. Nothing is downloaded here."""
    check_local_path(flag, value)
    if Path(value).exists():
        return
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(value, "config.json"), str):
            return
    except ValueError as error:  # huggingface_hub's HFValidationError: not a hub id either
        detail = str(error).splitlines()[0]
        raise ValueError(f"{flag} {value}: no such local path, and not a hub id ({detail})") from None
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if offline:
        raise ValueError(f"{flag} {value}: no such local path, and not in the hub cache (HF_HUB_OFFLINE is set)")
    hub = urlsplit(constants.ENDPOINT)
    try:
        port = hub.port or (80 if hub.scheme == "http" else 443)
        socket.create_connection((hub.hostname, port), timeout=HUB_PROBE_S).close()
    except (OSError, ValueError) as error:  # ValueError: a malformed HF_ENDPOINT
        raise ValueError(
            f"{flag} {value}: no such local path, not in the hub cache, and the hub {constants.ENDPOINT} cannot be "
            f"reached ({getattr(error, 'strerror', None) or error})"
        ) from None


def salt_config(args) -> SaltConfig | None:
    """SaltConfig from the `--salt.*` flags that were given (None when SALT is neither on nor in diagnostics)."""
    salt = args.salt
    if not (salt.enable or salt.diagnostics):
        return None
    given = {f.name: getattr(salt, f.name, None) for f in fields(SaltConfig) if "help" in f.metadata}
    return SaltConfig(**{k: v for k, v in given.items() if v is not None}, apply=salt.enable)


def geoalign_config(args) -> GeoAlignConfig | None:
    """GeoAlignConfig from the preset plus every `--geoalign.*` flag that was given (None when GeoAlign is off)."""
    geo = args.geoalign
    if not geo.enable:
        return None
    overrides = {
        f.name: getattr(geo, f.name) for f in fields(GeoAlignConfig) if getattr(geo, f.name, None) is not None
    }
    for f in fields(GeoAlignConfig):
        value = getattr(geo.projector, f.name, None)
        if value is not None:
            overrides[f.name] = tuple(value) if isinstance(value, list) else value
    return GeoAlignConfig.preset(geo.preset or "math", **overrides)


def baseline_config(args) -> BaselineConfig | None:
    """BaselineConfig from the `--baseline.*` flags that were given (None when none was)."""
    given = {k: v for k, v in vars(args.baseline).items() if v is not None}
    return BaselineConfig(**given) if given else None


def geometry_config(args) -> GeometryConfig:
    """The pipeline's typed configuration, built from the validated flags (`args.train.seed` seeds its streams)."""
    noise = args.reward.noise
    return GeometryConfig(
        salt=salt_config(args),
        geoalign=geoalign_config(args),
        baseline=baseline_config(args),
        salt_base=args.salt.base or "group_norm",
        noise=NoiseConfig(
            noise.type, noise.rate, tuple(noise.levels) if noise.levels is not None else None, noise.seed
        ),
        seed=args.train.seed,
    )


def flag_config(args) -> dict[str, Any]:
    """The nested argparse namespace as {"group.flag": plain value} (tuples as lists), for storing and comparing."""
    out: dict[str, Any] = {}

    def visit(prefix, value):
        if isinstance(value, SimpleNamespace):
            value = vars(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else key, item)
        elif isinstance(value, (list, tuple)):
            out[prefix] = [v if isinstance(v, (bool, int, float, str, type(None))) else repr(v) for v in value]
        else:
            out[prefix] = value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)

    visit("", {k: v for k, v in vars(args).items() if k != "geometry"})  # derived from the flags, not one of them
    return out


def settled(flags: dict[str, Any]) -> dict[str, Any]:
    """`flags` (as `flag_config` gives them, {"section.flag": value}) with every --salt.*, --geoalign.* and
    --baseline.* setting replaced by the value its config uses, for a resume's comparison: a default spelled out
    (`--salt.k_rule paper`, `--geoalign.preset math`) is no change from the flag left out. Flags that build no
    config (another version's, or a partial set) come back unchanged."""
    out = dict(flags)
    try:
        args = nest(argparse.Namespace(**flags))
        configs = [
            (SaltConfig, salt_config(args)),
            (GeoAlignConfig, geoalign_config(args)),
            (BaselineConfig, baseline_config(args) or BaselineConfig()),  # no --baseline.* flag: the defaults
        ]
        if args.salt.enable:
            out["salt.base"] = args.salt.base or "group_norm"
        if args.geoalign.enable:
            out["geoalign.preset"] = args.geoalign.preset or "math"
    except (AttributeError, TypeError, ValueError):
        return dict(flags)
    for config_type, config in configs:
        for f, _, dest in flag_fields(config_type):
            if config is not None and dest in out:
                out[dest] = flag_config(SimpleNamespace(value=getattr(config, f.name)))["value"]  # stored form
    return out
