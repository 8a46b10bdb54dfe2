"""The shared --salt.* / --geoalign.* / --reward.noise.* flags: defaults, mapping and parse-time rejection."""

import argparse

import pytest

from openrlhf_geo import options
from openrlhf_geo.geoalign import GeoAlignConfig


def parse(argv):
    """A minimal engine parser: the estimator flag (as both engines spell it) plus the shared flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--algo.advantage.estimator", "--advantage_estimator", default="group_norm", choices=["group_norm", "salt"]
    )
    options.add_args(parser)
    args = options.nest(parser.parse_args(argv))
    options.validate(args)
    return args


def test_defaults_leave_both_methods_off():
    args = parse([])
    assert args.salt.enable is False and args.geoalign.enable is False
    assert args.algo.advantage.estimator == "group_norm"
    assert args.reward.noise.type == "none"


def test_salt_estimator_maps_to_its_base_with_defaults():
    args = parse(["--advantage_estimator", "salt", "--salt.base", "dr_grpo"])
    assert args.salt.enable is True
    assert args.algo.advantage.estimator == "dr_grpo"
    assert (args.salt.variant, args.salt.features, args.salt.dim, args.salt.group_prompts) == (
        "full",
        "sketch",
        4096,
        0,
    )


def test_salt_gram_defaults_to_shrink_for_sketch_features_and_raw_for_exact_ones():
    assert parse(["--advantage_estimator", "salt"]).salt.gram == "shrink"
    assert parse(["--advantage_estimator", "salt", "--salt.features", "exact"]).salt.gram == "raw"
    assert parse(["--advantage_estimator", "salt", "--salt.gram", "raw"]).salt.gram == "raw"


def test_flat_alias_and_hierarchical_flag_are_the_same_option():
    assert parse(["--algo.advantage.estimator", "salt"]).salt.enable
    assert parse(["--advantage_estimator", "salt"]).salt.enable


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--salt.variant", "only-main"], "--salt.variant only applies with --advantage_estimator salt"),
        (["--salt.dim", "256"], "--salt.dim only applies"),
        (["--advantage_estimator", "salt", "--salt.dim", "1000"], "perfect square >= 16 (got 1000)"),
        (["--advantage_estimator", "salt", "--salt.dim", "9"], "perfect square >= 16 (got 9)"),
        (["--advantage_estimator", "salt", "--salt.variant", "fixed-alpha"], "--salt.alpha is required"),
        (["--advantage_estimator", "salt", "--salt.alpha", "0.5"], "only used with, --salt.variant fixed-alpha"),
        (["--advantage_estimator", "salt", "--salt.variant", "fixed-alpha", "--salt.alpha", "-1"], "finite"),
        (["--advantage_estimator", "salt", "--salt.group_prompts", "-2"], "--salt.group_prompts must be >= 0"),
        (
            ["--advantage_estimator", "salt", "--salt.features", "exact", "--salt.gram", "shrink"],
            "needs --salt.features",
        ),
        (["--geoalign.alpha", "0.1"], "--geoalign.alpha only applies with --geoalign.enable"),
        (["--geoalign.projector.steps", "5"], "--geoalign.projector.steps only applies"),
        (["--geoalign.enable", "--geoalign.alpha", "1.5"], "--geoalign.alpha must be in (0, 1) (got 1.5)"),
        (["--geoalign.enable", "--geoalign.max_flag_frac", "0"], "--geoalign.max_flag_frac must be in (0, 1]"),
        (["--geoalign.enable", "--geoalign.min_scores", "1"], "--geoalign.min_scores must be >= 2"),
        (["--geoalign.enable", "--geoalign.projector.steps", "0"], "--geoalign.projector.steps must be >= 1"),
        (["--geoalign.enable", "--geoalign.projector.val_frac", "1"], "--geoalign.projector.val_frac"),
        (["--geoalign.enable", "--geoalign.projector.hidden_sizes", "64", "0"], "widths must be >= 1"),
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


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="unknown GeoAlign preset 'chat'"):
        GeoAlignConfig.preset("chat")


def test_nest_builds_attributes_from_dotted_dests():
    ns = options.nest(argparse.Namespace(**{"a.b.c": 1, "a.d": 2, "e": 3}))
    assert (ns.a.b.c, ns.a.d, ns.e) == (1, 2, 3)


def test_flip_noise_levels_default_to_zero_one_and_accept_dapo_levels():
    assert parse(["--reward.noise.type", "flip", "--reward.noise.rate", "0.1"]).reward.noise.levels == (0.0, 1.0)
    args = parse(["--reward.noise.type", "flip", "--reward.noise.rate", "0.1", "--reward.noise.levels", "-1", "1"])
    assert args.reward.noise.levels == (-1.0, 1.0)
