"""The `--salt.*`, `--geoalign.*`, `--reward.noise.*`, `--baseline.*` flags, shared by the fork and the local engine.

Both engines call `add_args(parser)` on their own argparse parser (the fork: upstream's train_ppo_ray parser,
via patches/), then `validate(args)` on the nested namespace (`args.salt.variant`, `args.geoalign.alpha`, ...),
then `geometry_config(args)` for the typed configs the pipeline runs. Values are validated in one place, the
configs' `__post_init__` (SaltConfig, GeoAlignConfig, NoiseConfig, BaselineConfig); this module only checks which
flags go together. Every new flag defaults to None so `validate` can tell "given" from "default" and reject flags that
would be silently ignored (e.g. `--salt.variant` without `--advantage_estimator salt`).
"""

import argparse
import dataclasses
from dataclasses import fields
from types import SimpleNamespace

from openrlhf_geo.baselines import CURATIONS, POLICY_LOSSES, BaselineConfig
from openrlhf_geo.features import DEFAULT_DIM
from openrlhf_geo.features import METHODS as FEATURE_METHODS
from openrlhf_geo.geoalign import GDI_KINDS, MODES, PRESETS, PROTOTYPES, RULES, GeoAlignConfig
from openrlhf_geo.pipeline import GeometryConfig
from openrlhf_geo.rewards.noise import NOISE_TYPES, NoiseConfig
from openrlhf_geo.salt import GRAMS, VARIANTS, SaltConfig

# reinforce_baseline is listed so the error can say why it is refused: upstream whitens the whole batch after the
# group statistics, which would re-centre and rescale SALT's a' (SALT §3 feeds a' to the loss unchanged).
SALT_BASES = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")
# SaltConfig fields set by --salt.<field>; `base` and `diagnostics` are flags of this module, not of the config.
SALT_FIELDS = ("variant", "features", "dim", "seed", "gram", "group_prompts", "alpha", "shuffle_minibatches")
# --baseline.<flag> -> the --baseline.policy_loss it belongs to
LOSS_FLAGS = {
    "clip_cov_ratio": "clip_cov",
    "clip_cov_lb": "clip_cov",
    "clip_cov_ub": "clip_cov",
    "kl_cov_ratio": "kl_cov",
    "kl_cov_coef": "kl_cov",
}


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
        "--salt.variant",
        choices=tuple(VARIANTS),
        default=None,
        help="full SALT or an App. F.3 ablation (default full)",
    )
    salt.add_argument(
        "--salt.diagnostics",
        action="store_true",
        default=False,
        help="without --advantage_estimator salt: compute SALT's geometry (PR, n_eff, r, ...) on the unchanged "
        "advantages and log it as salt/* (the backbone rows of SALT Table 10); advantages are not modified",
    )
    salt.add_argument(
        "--salt.features",
        choices=FEATURE_METHODS,
        default=None,
        help="LM-head-gradient proxy (SALT Eq. 19): sketch = TensorSketch of the V*d gradient into --salt.dim "
        "columns, O(V) per token, exact when V*d <= D (default); kronecker = the k*k Kronecker sketch (the default "
        "before, with --salt.dim 4096; noisier at the same D); exact = the V*d gradient itself (tiny models)",
    )
    salt.add_argument(
        "--salt.dim",
        type=int,
        default=None,
        help=f"sketch dimension D, a perfect square >= 16 (kronecker: k*k; default {DEFAULT_DIM}: the sketch's Gram "
        "cosines carry noise of sd ~1/sqrt(D), its Gram costs O(m^2 D); see benchmarks/README.md)",
    )
    salt.add_argument(
        "--salt.seed", type=int, default=None, help="seed of the fixed sketch hashes / projections (default 0)"
    )
    salt.add_argument(
        "--salt.gram",
        choices=GRAMS,
        default=None,
        help="Gram estimate: raw F F^T/m (SALT Eq. 12; default) or shrink = noise-aware for --salt.features "
        "kronecker (debiased PR, SURE-thresholded off-diagonal; see benchmarks/README.md for when it helps)",
    )
    salt.add_argument(
        "--salt.group_prompts",
        type=int,
        default=None,
        help="prompts per SALT partition of the rollout batch (SALT's m = B*G); default: the optimizer mini-batch's "
        "prompts (--train.batch_size / --rollout.n_samples_per_prompt, SALT §3.1 / Table 4); 0 = the whole batch",
    )
    salt.add_argument(
        "--salt.shuffle_minibatches",
        action="store_true",
        default=None,
        help="optimizer mini-batches mix prompts as upstream draws them; by default each optimizer step trains on "
        "exactly the rollouts of one SALT partition (SALT §3.1's mini-batch)",
    )
    salt.add_argument(
        "--salt.alpha", type=float, default=None, help="fixed alpha_t in [0, 1], only with --salt.variant fixed-alpha"
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
    geo.add_argument(
        "--geoalign.rule",
        choices=RULES,
        default=None,
        help="anomaly rule: pointwise = the paper's (GDI right of the mode and its own density < alpha * peak; "
        "default) or threshold = the released code's (every score past the first crossing right of the mode)",
    )
    geo.add_argument("--geoalign.mode", choices=MODES, default=None, help="rectification (default replace)")
    geo.add_argument("--geoalign.gdi", choices=GDI_KINDS, default=None, help="GDI aggregation (default cumulative)")
    geo.add_argument(
        "--geoalign.prototype",
        choices=PROTOTYPES,
        default=None,
        help="margin-weighted prototype (Eq. 5, default) or plain mean",
    )
    geo.add_argument(
        "--geoalign.max_flag_frac",
        type=float,
        default=None,
        help="opt-in cap on the flagged fraction (not in the paper; the reference code uses 0.2)",
    )
    geo.add_argument(
        "--geoalign.min_scores",
        type=int,
        default=None,
        help="opt-in: fewer GDI scores -> flag nothing (not in the paper; the reference code uses 100)",
    )
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
        "--geoalign.projector.pair_batch",
        type=int,
        default=None,
        help="pairs per projector step (the released code's 1024, default); 0 = every pair of the batch",
    )
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
        help="fraction of prompts held out for validation (0.1)",
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
        help="flip: binary flips of a fraction of each prompt's rollouts; swap: HH-style swap-to-extremes; "
        "misspecified: the verifier also pays one wrong procedure on a fixed fraction of prompts (needs a task hook: "
        "`openrlhf-geo study geoalign-failure`)",
    )
    noise.add_argument(
        "--reward.noise.rate",
        type=float,
        default=0.0,
        help="fraction of each prompt's rollouts corrupted (flip, swap); of prompts misspecified (misspecified)",
    )
    noise.add_argument(
        "--reward.noise.levels",
        type=float,
        nargs=2,
        default=None,
        metavar=("LOW", "HIGH"),
        help="the two reward values flip swaps: 0 1 (default; GRPO) or -1 1 (DAPO)",
    )
    noise.add_argument("--reward.noise.seed", type=int, default=0, help="seed of the corruption draw")

    base = parser.add_argument_group(
        "comparison baselines (SALT arXiv 2606.05800 App. I / Table 4; GeoAlign arXiv 2606.26917 App. B.5)"
    )
    base.add_argument(
        "--baseline.policy_loss",
        choices=POLICY_LOSSES,
        default=None,
        help="per-token policy loss: ppo (default), clip_cov or kl_cov (Cui et al., arXiv 2505.22617)",
    )
    base.add_argument("--baseline.clip_cov_ratio", type=float, default=None, help="Clip-Cov token ratio (2e-4)")
    base.add_argument("--baseline.clip_cov_lb", type=float, default=None, help="Clip-Cov covariance lower bound (1)")
    base.add_argument("--baseline.clip_cov_ub", type=float, default=None, help="Clip-Cov covariance upper bound (5)")
    base.add_argument("--baseline.kl_cov_ratio", type=float, default=None, help="KL-Cov token ratio (2e-3)")
    base.add_argument("--baseline.kl_cov_coef", type=float, default=None, help="KL-Cov KL coefficient (1)")
    base.add_argument(
        "--baseline.curation",
        choices=tuple(CURATIONS),
        default=None,
        help="rollout selection instead of GeoAlign: PF-PPO best-vs-random / best-vs-worst, or PODS max-variance",
    )
    base.add_argument("--baseline.pods_m", type=int, default=None, help="PODS: rollouts kept per prompt (required)")
    base.add_argument(
        "--baseline.pf_ppo_keep_count",
        action="store_true",
        default=None,
        help="PF-PPO: the best and its partner refill the filtered slots instead of dropping them (the fork needs it)",
    )
    base.add_argument(
        "--baseline.seed_grpo_alpha",
        type=float,
        default=None,
        help="Seed-GRPO (arXiv 2505.12346): scale each prompt's advantages by 1 - alpha * SE / log G",
    )
    base.add_argument(
        "--baseline.par_references",
        type=int,
        default=None,
        help="PAR (arXiv 2502.18770): reference responses per prompt from the initial policy (local engine only)",
    )
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


def validate(args) -> None:
    """Check which flags go together, in place; raise ValueError naming the flag. Values are checked by building
    the configs (`geometry_config`), which this calls once so a bad value fails at parse time too.

    Afterwards `args.salt.enable` tells whether SALT changes the advantages, and `args.algo.advantage.estimator`
    holds the base estimator (`salt` means `--salt.base` + SALT, so every upstream code path for that base stays
    unchanged).
    """
    estimator = args.algo.advantage.estimator
    salt = args.salt
    if estimator == "salt":
        base = salt.base or "group_norm"
        if base == "reinforce_baseline":
            raise ValueError(
                "--salt.base reinforce_baseline: upstream whitens the whole batch after the group statistics, which "
                "would re-centre and rescale SALT's a' (the loss must consume a' unchanged); use group_norm, dr_grpo "
                "or rloo"
            )
        if salt.diagnostics:
            raise ValueError(
                "--salt.diagnostics is for runs without SALT; with --advantage_estimator salt the "
                "geometry is logged anyway"
            )
        salt.enable = True
        args.algo.advantage.estimator = base
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
    for flag, loss in LOSS_FLAGS.items():
        if getattr(baseline, flag) is not None and baseline.policy_loss != loss:
            raise ValueError(f"--baseline.{flag} only applies with --baseline.policy_loss {loss}")
    if baseline.curation is not None and geo.enable:
        raise ValueError(
            f"--baseline.curation {baseline.curation} and --geoalign.enable both choose which rollouts to train on: "
            "use one of them"
        )
    geometry_config(args)  # the configs' own checks, at parse time


def salt_config(args) -> SaltConfig | None:
    """SaltConfig from the `--salt.*` flags that were given (None when SALT is neither on nor in diagnostics)."""
    salt = args.salt
    if not (salt.enable or salt.diagnostics):
        return None
    given = {k: getattr(salt, k) for k in SALT_FIELDS if getattr(salt, k, None) is not None}
    return SaltConfig(**given, apply=salt.enable)


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
        noise=NoiseConfig(
            noise.type, noise.rate, tuple(noise.levels) if noise.levels is not None else None, noise.seed
        ),
        seed=args.train.seed,
    )


def flag_config(args):
    """The nested argparse namespace as {"group.flag": plain value} (tuples as lists), for storing and comparing."""
    out = {}

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

    visit("", args)
    return out
