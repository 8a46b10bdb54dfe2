"""The shared --salt.* / --geoalign.* / --reward.noise.* flags: defaults, mapping and parse-time rejection."""

import argparse

import pytest

from openrlhf_geo import options
from openrlhf_geo.features import DEFAULT_DIM
from openrlhf_geo.geoalign import GeoAlignConfig
from openrlhf_geo.salt import SaltConfig


def parse(argv):
    """A minimal engine parser: the estimator flag (as both engines spell it) plus the shared flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--algo.advantage.estimator",
        "--advantage_estimator",
        default="group_norm",
        choices=["group_norm", "salt"],
    )
    parser.add_argument("--train.seed", type=int, default=0)
    options.add_args(parser)
    args = options.nest(parser.parse_args(argv))
    options.validate(args)
    return args


def test_defaults_leave_both_methods_off():
    args = parse([])
    assert args.salt.enable is False and args.geoalign.enable is False
    assert args.algo.advantage.estimator == "group_norm"
    assert args.reward.noise.type == "none"


def test_salt_estimator_maps_to_its_base_and_the_config_defaults():
    args = parse(["--advantage_estimator", "salt", "--salt.base", "dr_grpo"])
    assert args.salt.enable is True
    assert args.algo.advantage.estimator == "dr_grpo"
    config = options.salt_config(args)
    assert config == SaltConfig()  # every default comes from the config, none from the flags module
    assert (config.variant, config.features, config.dim, config.gram, config.group_prompts, config.apply) == (
        "full",
        "sketch",
        DEFAULT_DIM,
        "raw",
        None,  # None: the optimizer mini-batch's prompts (SALT §3.1), resolved by each engine
        True,
    )


def test_salt_gram_is_raw_unless_shrink_is_asked_for():
    assert options.salt_config(parse(["--advantage_estimator", "salt"])).gram == "raw"
    argv = ["--advantage_estimator", "salt", "--salt.features", "kronecker", "--salt.gram", "shrink"]
    assert options.salt_config(parse(argv)).gram == "shrink"


def test_salt_diagnostics_measure_without_changing_the_estimator():
    args = parse(["--salt.diagnostics", "--salt.features", "exact"])
    assert args.salt.enable is False and args.algo.advantage.estimator == "group_norm"
    assert options.salt_config(args) == SaltConfig(features="exact", apply=False)
    assert options.geometry_config(args).spec.features == "exact"
    assert options.salt_config(parse([])) is None and options.geometry_config(parse([])).spec is None


def test_flat_alias_and_hierarchical_flag_are_the_same_option():
    assert parse(["--algo.advantage.estimator", "salt"]).salt.enable
    assert parse(["--advantage_estimator", "salt"]).salt.enable


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--salt.variant", "only-main"], "--salt.variant only applies with --advantage_estimator salt"),
        (["--salt.dim", "256"], "--salt.dim only applies with --advantage_estimator salt or --salt.diagnostics"),
        (["--salt.diagnostics", "--salt.alpha", "0.5"], "--salt.alpha only applies with --advantage_estimator salt"),
        (["--advantage_estimator", "salt", "--salt.diagnostics"], "--salt.diagnostics is for runs without SALT"),
        (["--advantage_estimator", "salt", "--salt.dim", "1000"], "--salt.dim"),
        (["--advantage_estimator", "salt", "--salt.dim", "9"], "--salt.dim"),
        (["--advantage_estimator", "salt", "--salt.variant", "fixed-alpha"], "--salt.alpha"),
        (["--advantage_estimator", "salt", "--salt.alpha", "0.5"], "--salt.alpha"),
        (["--advantage_estimator", "salt", "--salt.variant", "fixed-alpha", "--salt.alpha", "1.5"], "--salt.alpha"),
        (["--advantage_estimator", "salt", "--salt.group_prompts", "-2"], "--salt.group_prompts"),
        (["--advantage_estimator", "salt", "--salt.features", "exact", "--salt.gram", "shrink"], "--salt.gram"),
        (["--geoalign.alpha", "0.1"], "--geoalign.alpha only applies with --geoalign.enable"),
        (["--geoalign.projector.steps", "5"], "--geoalign.projector.steps only applies"),
        (["--geoalign.rule", "threshold"], "--geoalign.rule only applies"),
        (["--geoalign.enable", "--geoalign.projector.pair_batch", "-1"], "--geoalign.projector.pair_batch"),
        (["--geoalign.enable", "--geoalign.alpha", "1.5"], "(0, 1) (got 1.5)"),
        (["--geoalign.enable", "--geoalign.max_flag_frac", "1.5"], "--geoalign.max_flag_frac"),
        (["--geoalign.enable", "--geoalign.min_scores", "-1"], "--geoalign.min_scores"),
        (["--geoalign.enable", "--geoalign.projector.steps", "0"], "--geoalign.projector.steps"),
        (["--geoalign.enable", "--geoalign.projector.val_frac", "1"], "--geoalign.projector.val_frac"),
        (["--geoalign.enable", "--geoalign.projector.hidden_sizes", "64", "0"], "--geoalign.projector.hidden_sizes"),
        (["--reward.noise.rate", "0.1"], "needs --reward.noise.type flip or swap"),
        (["--reward.noise.type", "flip"], "--reward.noise.rate must be in (0, 1)"),
        (["--reward.noise.type", "swap", "--reward.noise.rate", "0.1", "--reward.noise.levels", "0", "1"], "only"),
        (["--reward.noise.type", "flip", "--reward.noise.rate", "0.1", "--reward.noise.levels", "0", "2"], "0 1 or"),
    ],
)
def test_invalid_combinations_name_the_flag(argv, message):
    with pytest.raises(ValueError) as err:
        parse(argv)
    assert message in str(err.value)


def test_geoalign_config_starts_from_the_preset_and_applies_given_flags():
    args = parse(["--geoalign.enable", "--geoalign.preset", "rlhf", "--geoalign.mode", "zero"])
    cfg = options.geoalign_config(args)
    assert cfg == GeoAlignConfig.preset("rlhf", mode="zero")
    assert (cfg.alpha, cfg.val_acc) == (0.12, 0.85)

    args = parse(
        [
            "--geoalign.enable",
            "--geoalign.alpha",
            "0.07",
            "--geoalign.projector.hidden_sizes",
            "64",
            "32",
            "--geoalign.projector.no_warm_start",
            "--geoalign.projector.steps",
            "7",
        ]
    )
    cfg = options.geoalign_config(args)
    assert (cfg.alpha, cfg.val_acc, cfg.hidden_sizes, cfg.warm_start, cfg.steps) == (0.07, 0.95, (64, 32), False, 7)
    cfg = options.geoalign_config(
        parse(["--geoalign.enable", "--geoalign.rule", "threshold", "--geoalign.projector.pair_batch", "0"])
    )
    assert (cfg.rule, cfg.pair_batch) == ("threshold", 0)
    assert options.geoalign_config(parse(["--geoalign.enable"])).rule == "pointwise"  # the paper's rule by default


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="unknown GeoAlign preset 'chat'"):
        GeoAlignConfig.preset("chat")


def test_nest_builds_attributes_from_dotted_dests():
    ns = options.nest(argparse.Namespace(**{"a.b.c": 1, "a.d": 2, "e": 3}))
    assert (ns.a.b.c, ns.a.d, ns.e) == (1, 2, 3)


def test_flip_noise_levels_default_to_zero_one_and_accept_dapo_levels():
    args = parse(["--reward.noise.type", "flip", "--reward.noise.rate", "0.1"])
    assert options.geometry_config(args).noise.levels == (0.0, 1.0)
    args = parse(["--reward.noise.type", "flip", "--reward.noise.rate", "0.1", "--reward.noise.levels", "-1", "1"])
    assert options.geometry_config(args).noise.levels == (-1.0, 1.0)


def test_baselines_are_off_by_default_and_their_defaults_are_salt_table_4():
    from openrlhf_geo.baselines import BaselineConfig

    assert options.baseline_config(parse([])) is None and not options.geometry_config(parse([])).active
    config = options.baseline_config(parse(["--baseline.policy_loss", "clip_cov"]))
    # SALT Table 4: clip covariance ratio 0.0002, lb 1.0, ub 5.0; KL covariance ratio 0.002, PPO KL coefficient 1
    assert (config.clip_cov_ratio, config.clip_cov_lb, config.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (config.kl_cov_ratio, config.kl_cov_coef) == (2e-3, 1.0)
    assert config == BaselineConfig(policy_loss="clip_cov")
    assert not options.geometry_config(
        parse(["--baseline.policy_loss", "kl_cov"])
    ).active  # the loss, not the pipeline


def test_every_baseline_flag_reaches_its_config():
    argv = "--baseline.policy_loss kl_cov --baseline.kl_cov_ratio 0.01 --baseline.kl_cov_coef 0.5 "
    argv += "--baseline.curation pf_ppo_bw --baseline.pf_ppo_keep_count --baseline.seed_grpo_alpha 0.3 "
    argv += "--baseline.par_references 2"
    config = options.geometry_config(parse(argv.split())).baseline
    assert (config.policy_loss, config.kl_cov_ratio, config.kl_cov_coef) == ("kl_cov", 0.01, 0.5)
    assert (config.curation, config.pf_ppo_keep_count, config.seed_grpo_alpha, config.par_references) == (
        "pf_ppo_bw",
        True,
        0.3,
        2,
    )
    assert not config.drops_rollouts and config.in_pipeline
    pods = options.baseline_config(parse(["--baseline.curation", "pods", "--baseline.pods_m", "4"]))
    assert pods.pods_m == 4 and pods.drops_rollouts
    assert options.baseline_config(parse(["--baseline.curation", "pf_ppo_br"])).drops_rollouts


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--baseline.clip_cov_ratio 0.01",
            "--baseline.clip_cov_ratio only applies with --baseline.policy_loss clip_cov",
        ),
        ("--baseline.policy_loss clip_cov --baseline.kl_cov_coef 2", "--baseline.kl_cov_coef only applies with"),
        ("--baseline.policy_loss clip_cov --baseline.clip_cov_ratio 0", "--baseline.clip_cov_ratio must be in (0, 1]"),
        ("--baseline.policy_loss kl_cov --baseline.kl_cov_ratio 1.5", "--baseline.kl_cov_ratio must be in (0, 1]"),
        ("--baseline.policy_loss kl_cov --baseline.kl_cov_coef -1", "--baseline.kl_cov_coef must be"),
        ("--baseline.policy_loss clip_cov --baseline.clip_cov_lb 6", "--baseline.clip_cov_lb must be <="),
        ("--baseline.curation pods", "--baseline.curation pods needs --baseline.pods_m"),
        ("--baseline.pods_m 2", "--baseline.pods_m only applies"),
        ("--baseline.curation pods --baseline.pods_m 0", "--baseline.pods_m must be an integer >= 1"),
        ("--baseline.pf_ppo_keep_count", "--baseline.pf_ppo_keep_count only applies"),
        ("--baseline.curation pf_ppo_br --geoalign.enable", "use one of them"),
        ("--baseline.seed_grpo_alpha 1.5", "--baseline.seed_grpo_alpha must be in [0, 1]"),
        ("--baseline.par_references -1", "--baseline.par_references must be an integer >= 0"),
    ],
)
def test_invalid_baseline_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError) as err:
        parse(argv.split())
    assert message in str(err.value)
