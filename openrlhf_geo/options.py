"""The `--salt.*`, `--geoalign.*` and `--reward.noise.*` flags, shared by the fork and the local engine.

Both engines call `add_args(parser)` on their own argparse parser (the fork: upstream's train_ppo_ray parser,
via patches/), then `validate(args)` on the nested namespace (`args.salt.variant`, `args.geoalign.alpha`, ...).
Every new flag defaults to None so `validate` can tell "given" from "default" and reject flags that would be
silently ignored (e.g. `--salt.variant` without `--advantage_estimator salt`).
"""

import argparse
import math
from dataclasses import fields
from types import SimpleNamespace

from openrlhf_geo.geoalign import GDI_KINDS, MODES, PRESETS, PROTOTYPES, GeoAlignConfig
from openrlhf_geo.salt import GRAMS, VARIANTS

SALT_BASES = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")
SALT_DEFAULTS = {
    "base": "group_norm",
    "variant": "full",
    "features": "sketch",
    "dim": 4096,
    "seed": 0,
    "group_prompts": 0,
    "alpha": None,
}
NOISE_TYPES = ("none", "flip", "swap")
# flag suffix under --geoalign.projector.* -> GeoAlignConfig field
PROJECTOR_FIELDS = ("hidden_sizes", "out_dim", "steps", "lr", "val_acc", "val_frac", "warm_start")


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fork's flags. The advantage-estimator flag itself belongs to the engine's parser."""
    salt = parser.add_argument_group("SALT (arXiv 2606.05800): enable with --advantage_estimator salt")
    salt.add_argument(
        "--salt.base",
        choices=SALT_BASES,
        default=None,
        help="group-relative estimator whose sequence advantages SALT reweights (default group_norm)",
    )
    salt.add_argument(
        "--salt.variant", choices=VARIANTS, default=None, help="full SALT or an App. F.3 ablation (default full)"
    )
    salt.add_argument(
        "--salt.features",
        choices=("sketch", "exact"),
        default=None,
        help="LM-head-gradient proxy: Kronecker sketch (default) or exact V*d gradient (tiny models)",
    )
    salt.add_argument(
        "--salt.dim", type=int, default=None, help="sketch dimension D = k*k, a perfect square >= 16 (default 4096)"
    )
    salt.add_argument("--salt.seed", type=int, default=None, help="seed of the fixed sketch projections (default 0)")
    salt.add_argument(
        "--salt.gram",
        choices=GRAMS,
        default=None,
        help="Gram estimate: shrink = noise-aware (debiased PR, SURE-thresholded off-diagonal; default with sketch "
        "features) or raw F F^T/m (default with, and the only choice for, exact features)",
    )
    salt.add_argument(
        "--salt.group_prompts",
        type=int,
        default=None,
        help="prompts per SALT partition of the rollout batch; 0 = the whole batch (default)",
    )
    salt.add_argument(
        "--salt.alpha", type=float, default=None, help="fixed alpha_t, only with --salt.variant fixed-alpha"
    )

    geo = parser.add_argument_group("GeoAlign (arXiv 2606.26917)")
    geo.add_argument("--geoalign.enable", action="store_true", default=False, help="curate rollouts with GeoAlign")
    geo.add_argument(
        "--geoalign.preset",
        choices=sorted(PRESETS),
        default=None,
        help="paper defaults: math (alpha 0.05, val acc 0.95) or rlhf (alpha 0.12, val acc 0.85)",
    )
    geo.add_argument(
        "--geoalign.alpha",
        type=float,
        default=None,
        help="flag rollouts whose GDI density < alpha * peak on the high tail (preset default)",
    )
    geo.add_argument("--geoalign.mode", choices=MODES, default=None, help="rectification (default replace)")
    geo.add_argument("--geoalign.gdi", choices=GDI_KINDS, default=None, help="GDI aggregation (default cumulative)")
    geo.add_argument(
        "--geoalign.prototype",
        choices=PROTOTYPES,
        default=None,
        help="margin-weighted prototype (Eq. 5, default) or plain mean",
    )
    geo.add_argument("--geoalign.max_flag_frac", type=float, default=None, help="cap on flagged fraction (0.2)")
    geo.add_argument("--geoalign.min_scores", type=int, default=None, help="fewer GDI scores -> flag nothing (100)")
    geo.add_argument(
        "--geoalign.max_pairs_per_side",
        type=int,
        default=None,
        help="per prompt pair only the top-m winners with the bottom-m losers; 0 = all pairs",
    )
    geo.add_argument("--geoalign.device", type=str, default=None, help="device of the projector (default cpu)")
    geo.add_argument(
        "--geoalign.projector.hidden_sizes",
        type=int,
        nargs="+",
        default=None,
        help="hidden widths of the projector MLP (default 512 512)",
    )
    geo.add_argument("--geoalign.projector.out_dim", type=int, default=None, help="projector output width (128)")
    geo.add_argument("--geoalign.projector.steps", type=int, default=None, help="Adam steps per batch (50)")
    geo.add_argument("--geoalign.projector.lr", type=float, default=None, help="peak LR, cosine decay (1e-3)")
    geo.add_argument(
        "--geoalign.projector.val_acc",
        type=float,
        default=None,
        help="early-stop validation accuracy (preset default)",
    )
    geo.add_argument(
        "--geoalign.projector.val_frac",
        type=float,
        default=None,
        help="fraction of prompts held out for validation (0.2)",
    )
    geo.add_argument(
        "--geoalign.projector.no_warm_start",
        dest="geoalign.projector.warm_start",
        action="store_const",
        const=False,
        default=None,
        help="re-initialise the projector every step instead of keeping it",
    )

    noise = parser.add_argument_group("reward-noise injection (robustness experiments)")
    noise.add_argument(
        "--reward.noise.type",
        choices=NOISE_TYPES,
        default="none",
        help="flip: binary flips of a fraction of each prompt's rollouts; swap: HH-style swap-to-extremes",
    )
    noise.add_argument("--reward.noise.rate", type=float, default=0.0, help="fraction of rollouts corrupted")
    noise.add_argument(
        "--reward.noise.levels",
        type=float,
        nargs=2,
        default=None,
        metavar=("LOW", "HIGH"),
        help="the two reward values flip swaps: 0 1 (default; GRPO) or -1 1 (DAPO)",
    )
    noise.add_argument("--reward.noise.seed", type=int, default=0, help="seed of the corruption draw")
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


def _given(ns) -> list[str]:
    """Flags of a group that were set on the command line (all default to None)."""
    return [k for k, v in vars(ns).items() if v is not None and k != "enable" and not isinstance(v, SimpleNamespace)]


def validate(args) -> None:
    """Check flag combinations and fill defaults, in place; raise ValueError naming the flag.

    Afterwards `args.salt.enable` tells whether SALT runs, and `args.algo.advantage.estimator` holds the base
    estimator (`salt` means `--salt.base` + SALT, so every upstream code path for that base stays unchanged).
    """
    estimator = args.algo.advantage.estimator
    salt = args.salt
    if estimator == "salt":
        for key, default in SALT_DEFAULTS.items():
            if getattr(salt, key) is None:
                setattr(salt, key, default)
        if salt.gram is None:
            salt.gram = "shrink" if salt.features == "sketch" else "raw"
        if salt.gram == "shrink" and salt.features != "sketch":
            raise ValueError("--salt.gram shrink needs --salt.features sketch (exact features carry no sketch noise)")
        if salt.features == "sketch":
            side = math.isqrt(max(salt.dim, 0))
            if salt.dim < 16 or side * side != salt.dim:
                raise ValueError(f"--salt.dim must be a perfect square >= 16 (got {salt.dim})")
        if salt.group_prompts < 0:
            raise ValueError(
                f"--salt.group_prompts must be >= 0, 0 meaning the whole batch (got {salt.group_prompts})"
            )
        if (salt.variant == "fixed-alpha") != (salt.alpha is not None):
            raise ValueError("--salt.alpha is required by, and only used with, --salt.variant fixed-alpha")
        if salt.alpha is not None and not (salt.alpha >= 0 and math.isfinite(salt.alpha)):
            raise ValueError(f"--salt.alpha must be a finite number >= 0 (got {salt.alpha})")
        salt.enable = True
        args.algo.advantage.estimator = salt.base
    else:
        given = _given(salt)
        if given:
            raise ValueError(f"--salt.{given[0]} only applies with --advantage_estimator salt (got {estimator!r})")
        salt.enable = False

    geo = args.geoalign
    if geo.enable:
        cfg = geoalign_config(args)
        checks = [
            (0 < cfg.alpha < 1, "--geoalign.alpha must be in (0, 1)", cfg.alpha),
            (0 < cfg.max_flag_frac <= 1, "--geoalign.max_flag_frac must be in (0, 1]", cfg.max_flag_frac),
            (cfg.min_scores >= 2, "--geoalign.min_scores must be >= 2 (a KDE needs two scores)", cfg.min_scores),
            (cfg.max_pairs_per_side >= 0, "--geoalign.max_pairs_per_side must be >= 0", cfg.max_pairs_per_side),
            (cfg.steps >= 1, "--geoalign.projector.steps must be >= 1", cfg.steps),
            (cfg.lr > 0, "--geoalign.projector.lr must be > 0", cfg.lr),
            (0 < cfg.val_acc <= 1, "--geoalign.projector.val_acc must be in (0, 1]", cfg.val_acc),
            (0 < cfg.val_frac < 1, "--geoalign.projector.val_frac must be in (0, 1)", cfg.val_frac),
            (
                cfg.out_dim >= 1 and all(w >= 1 for w in cfg.hidden_sizes),
                "--geoalign.projector widths must be >= 1",
                (*cfg.hidden_sizes, cfg.out_dim),
            ),
        ]
        for ok, message, value in checks:
            if not ok:
                raise ValueError(f"{message} (got {value})")
    else:
        given = _given(geo) + [f"projector.{k}" for k in _given(geo.projector)]
        if given:
            raise ValueError(f"--geoalign.{given[0]} only applies with --geoalign.enable")

    noise = args.reward.noise
    if noise.type == "none" and noise.rate != 0:
        raise ValueError(f"--reward.noise.rate {noise.rate} needs --reward.noise.type flip or swap")
    if noise.type != "none" and not 0 < noise.rate < 1:
        raise ValueError(f"--reward.noise.rate must be in (0, 1) with --reward.noise.type {noise.type}")
    if noise.type != "flip" and noise.levels is not None:
        raise ValueError("--reward.noise.levels only applies with --reward.noise.type flip")
    if noise.type == "flip":
        noise.levels = tuple(noise.levels or (0.0, 1.0))
        if noise.levels not in ((0.0, 1.0), (-1.0, 1.0)):
            raise ValueError(f"--reward.noise.levels must be 0 1 or -1 1 (got {' '.join(map(str, noise.levels))})")


def geoalign_config(args) -> GeoAlignConfig:
    """GeoAlignConfig from the preset plus every `--geoalign.*` flag that was given."""
    geo = args.geoalign
    overrides = {
        f.name: getattr(geo, f.name) for f in fields(GeoAlignConfig) if getattr(geo, f.name, None) is not None
    }
    for key in PROJECTOR_FIELDS:
        value = getattr(geo.projector, key, None)
        if value is not None:
            overrides[key] = tuple(value) if key == "hidden_sizes" else value
    return GeoAlignConfig.preset(geo.preset or "math", **overrides)
