"""SALT's two k_t rules (--salt.k_rule, --salt.rho): the paper's Eq. 14 (default) and the released code's
(Chang-pw/SALT, verl/verl/trainer/gradient/advantage_decomposition.py, AdvantageDecomposer.compute_adaptive_k),
against an independent float64 numpy computation, and their flags in both engines."""

import argparse
import math

import numpy as np
import pytest
import torch
from fork_helpers import parse as fork_parse
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from openrlhf_geo import options
from openrlhf_geo.local import flags as local_flags
from openrlhf_geo.pipeline import GeometryConfig, GeometryPipeline
from openrlhf_geo.salt import CODE_K_MAX, CODE_RHO, SaltConfig, _subspace_dim, salt_advantages

RULES = [("paper", None), ("code", None), ("code", 0.5), ("code", 1.7)]


def reference(a, F, k_rule, rho):
    """(a', k, α_t) written out in float64 numpy: a full eigendecomposition and explicit m×m projectors."""
    m = len(a)
    K = F @ F.T / m  # Eq. 4
    lam, V = np.linalg.eigh(K)
    V = V[:, ::-1]
    pr = np.trace(K) ** 2 / np.sum(K * K)  # Eq. 5
    if k_rule == "paper":
        k = int(min(max(math.floor(pr + 0.5), 1), m))  # Eq. 14, ties half up
    else:  # the code: round() (ties to even) of rho * PR, k_min 1, k_max 64, at most B - 1
        k = max(1, min(round((CODE_RHO if rho is None else rho) * pr), 64, m - 1))
    P = V[:, :k] @ V[:, :k].T  # Eq. 15
    u = a[:, None] * F
    n_eff = np.sum(u.sum(0) ** 2) / np.sum(u**2)  # Eq. 6
    alpha = max(0.0, 1.0 - n_eff)  # Eq. 17
    return P @ a + alpha * (np.eye(m) - P) @ np.maximum(a, 0), k, alpha, lam[::-1]


@st.composite
def batches(draw, max_m=48):
    """GRPO advantages of groups of 4 with 0/1 rewards and low-rank-plus-noise or grouped features (float64)."""
    m = 4 * draw(st.integers(1, max_m // 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    D = draw(st.integers(4, 64))
    noise = draw(st.sampled_from([0.05, 0.3, 1.0]))
    if draw(st.booleans()):
        F = rng.standard_normal((m, 3)) @ rng.standard_normal((3, D)) + noise * rng.standard_normal((m, D))
    else:
        F = np.repeat(rng.standard_normal((m // 4, D)), 4, axis=0) + noise * rng.standard_normal((m, D))
    r = rng.integers(0, 2, m).reshape(-1, 4).astype(float)
    a = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    assume(np.linalg.norm(a) > 0)
    return a, F


@pytest.mark.parametrize("k_rule, rho", RULES)
@settings(max_examples=25, deadline=None)
@given(data=batches())
def test_each_k_rule_matches_brute_force(k_rule, rho, data):
    a, F = data
    expected, k, alpha, lam = reference(a, F, k_rule, rho)
    assume(k == len(a) or (lam[k - 1] - lam[k]) > 1e-6 * lam[0])  # P_k unique
    out, stats = salt_advantages(torch.tensor(a), torch.tensor(F), k_rule=k_rule, rho=rho)
    assert stats["k"] == k and stats["alpha"] == pytest.approx(alpha, abs=1e-9)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-8 * max(1.0, np.abs(a).max()))


def test_the_code_rule_caps_k_at_64_where_the_paper_takes_pr():
    """Near-isotropic features at m = 160: PR ≈ 130, so Eq. 14 gives k ≈ 130 and the code 64 (Lanczos path)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(160)
    F = rng.standard_normal((160, 4000))
    paper, paper_stats = salt_advantages(torch.tensor(a), torch.tensor(F))
    code, code_stats = salt_advantages(torch.tensor(a), torch.tensor(F), k_rule="code")
    assert paper_stats["k"] > 100 and code_stats["k"] == CODE_K_MAX == 64
    expected, k, _, _ = reference(a, F, "code", None)
    assert k == 64
    np.testing.assert_allclose(code.numpy(), expected, atol=1e-8)
    assert not np.allclose(paper.numpy(), code.numpy(), atol=1e-3)


def test_the_code_rule_keeps_a_residual_channel_where_the_paper_projects_on_everything():
    """m = 4 near-orthogonal features: PR ≈ 4, Eq. 14's k = m gives P_k = I (a' = a); the code's cap m − 1 = 3
    leaves the smallest direction to the exploration channel."""
    a = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    F = torch.diag(torch.tensor([1.0, 1.01, 1.02, 1.03], dtype=torch.float64))
    paper, paper_stats = salt_advantages(a, F)
    code, code_stats = salt_advantages(a, F, k_rule="code")
    assert (paper_stats["k"], code_stats["k"]) == (4, 3)
    torch.testing.assert_close(paper, a)
    expected, _, _, _ = reference(a.numpy(), F.numpy(), "code", None)
    np.testing.assert_allclose(code.numpy(), expected, atol=1e-12)
    assert not np.allclose(expected, a.numpy())


@pytest.mark.parametrize(
    "pr, m, k_rule, rho, k",
    [
        (2.5, 10, "paper", None, 3),  # Eq. 14's nearest integer, ties half up
        (2.5, 10, "code", None, 2),  # Python's round: ties to even
        (3.5, 10, "code", None, 4),
        (5.0, 10, "code", 0.5, 2),  # round(2.5) = 2
        (0.2, 10, "paper", None, 1),
        (0.2, 10, "code", None, 1),  # k_min
        (9.8, 10, "paper", None, 10),
        (9.8, 10, "code", None, 9),  # B − 1
        (1.0, 1, "code", None, 1),  # m = 1: k_min wins over m − 1 = 0, as in the code
        (300.0, 1000, "code", 2.0, 64),  # k_max
        (4.5 + 2e-14, 10, "code", None, 4),  # a computed PR an ulp or so off a tie is the tie
        (4.5 - 2e-14, 10, "paper", None, 5),
        (9.0 + 4e-14, 20, "code", 0.5, 4),
        (4.5 + 1e-9, 10, "code", None, 5),  # outside TIE_RTOL: an ordinary value
        (4.5 - 1e-9, 10, "paper", None, 4),
    ],
)
def test_rounding_and_clipping_of_each_rule(pr, m, k_rule, rho, k):
    assert _subspace_dim(pr, m, k_rule, rho) == k


@pytest.mark.parametrize("seed", range(8))
def test_an_input_whose_exact_pr_is_a_tie_gets_each_rules_tie_convention(seed):
    """48 rows on 5 orthogonal ±1 Hadamard directions, 16 on one and 8 on each other (entries exact in float32, rows
    and columns shuffled): PR = 48² / (16² + 4·8²) = 4.5 exactly, computed an ulp or so either side of it. The paper's
    rule takes 5 (half up), the code's 4 (half to even), whatever that ulp."""
    import scipy.linalg

    rng = np.random.default_rng(seed)
    directions = scipy.linalg.hadamard(64)[rng.permutation(64)[:5]]
    F = np.repeat(directions, [16, 8, 8, 8, 8], axis=0) * rng.choice([-1, 1], (48, 1)) * (1, 3, 5, 7)[seed % 4]
    F = torch.tensor(F[rng.permutation(48)][:, rng.permutation(64)], dtype=torch.float32)
    a = torch.tensor(rng.standard_normal(48))
    paper, code = (salt_advantages(a, F, k_rule=rule)[1] for rule in ("paper", "code"))
    assert paper["pr"] == pytest.approx(4.5, rel=1e-13)
    assert (paper["k"], code["k"]) == (5, 4)


@settings(max_examples=300)
@given(
    m=st.integers(1, 600),
    fraction=st.floats(0, 1),
    rho=st.one_of(st.none(), st.floats(1e-6, 2.0)),
)
def test_k_lies_between_one_and_each_rules_cap(m, fraction, rho):
    pr = fraction * m  # 0 <= PR <= m for a PSD Gram
    paper = _subspace_dim(pr, m, "paper", None)
    code = _subspace_dim(pr, m, "code", rho)
    assert 1 <= paper <= m and abs(paper - pr) <= 0.5 + (paper == 1)
    assert 1 <= code <= max(1, min(CODE_K_MAX, m - 1))
    scaled = (CODE_RHO if rho is None else rho) * pr
    if 1 < code < min(CODE_K_MAX, m - 1):  # unclipped: the nearest integer to rho * PR
        assert abs(code - scaled) <= 0.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k_rule": "verl"}, r"--salt.k_rule must be one of paper, code \(got 'verl'\)"),
        ({"rho": 0.5}, r"--salt.rho only applies with --salt.k_rule code \(got --salt.k_rule paper\)"),
        ({"k_rule": "code", "rho": 0.0}, r"--salt.rho must be a number in \(0, 2\], .*\(got 0.0\)"),
        ({"k_rule": "code", "rho": 2.5}, r"--salt.rho must be a number in \(0, 2\]"),
        ({"k_rule": "code", "rho": math.nan}, r"--salt.rho must be a number in \(0, 2\]"),
        ({"k_rule": "code", "rho": True}, r"--salt.rho must be a number in \(0, 2\]"),
    ],
)
def test_salt_config_rejects_bad_k_rule_flags_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SaltConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k_rule": "verl"}, r"k_rule must be one of paper, code \(got 'verl'\)"),
        ({"rho": 0.5}, r"rho only applies with k_rule code \(got k_rule paper\)"),
        ({"k_rule": "code", "rho": -1.0}, r"rho must be a number in \(0, 2\]"),
    ],
)
def test_salt_advantages_rejects_bad_k_rule_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        salt_advantages(torch.randn(4), torch.randn(4, 3), **kwargs)


def test_defaults_are_the_papers_rule():
    config = SaltConfig()
    assert (config.k_rule, config.rho) == ("paper", None)
    assert CODE_RHO == 1.0  # actor.yaml's and the README's rho


def parse_shared(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo.advantage.estimator", "--advantage_estimator", default="group_norm")
    parser.add_argument("--train.seed", type=int, default=0)
    options.add_args(parser)
    args = options.nest(parser.parse_args(argv))
    options.validate(args)
    return args


def test_the_shared_flags_reach_the_config_and_are_checked_at_parse_time():
    config = options.salt_config(parse_shared(["--advantage_estimator", "salt", "--salt.k_rule", "code"]))
    assert (config.k_rule, config.rho) == ("code", None)
    argv = ["--salt.diagnostics", "--salt.k_rule", "code", "--salt.rho", "0.5"]  # diagnostics log k_t and P_k too
    assert options.salt_config(parse_shared(argv)) == SaltConfig(k_rule="code", rho=0.5, apply=False)
    for argv, message in [
        (["--advantage_estimator", "salt", "--salt.rho", "0.5"], "--salt.rho only applies with --salt.k_rule code"),
        (["--salt.k_rule", "code"], "--salt.k_rule only applies with --advantage_estimator salt or --salt.diag"),
        (["--advantage_estimator", "salt", "--salt.k_rule", "code", "--salt.rho", "3"], "--salt.rho must be"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_shared(argv)
    with pytest.raises(SystemExit):  # argparse's choices
        parse_shared(["--advantage_estimator", "salt", "--salt.k_rule", "verl"])


def test_the_local_engine_parses_the_code_rule():
    base = ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused", "--advantage_estimator", "salt"]
    args = local_flags.parse_args([*base, "--salt.k_rule", "code", "--salt.rho", "0.5"])
    assert (args.geometry.salt.k_rule, args.geometry.salt.rho) == ("code", 0.5)
    with pytest.raises(ValueError, match="--salt.rho only applies with --salt.k_rule code"):
        local_flags.parse_args([*base, "--salt.rho", "0.5"])


@pytest.mark.filterwarnings("ignore:.*coefficients are far outside")  # Gaussian a and F
def test_the_pipeline_runs_the_configured_rule():
    g = torch.Generator().manual_seed(0)
    F = torch.randn(16, 64, generator=g, dtype=torch.float64)
    a = torch.randn(16, generator=g, dtype=torch.float64)
    group_ids = torch.arange(16) // 4
    outs = {}
    for rule, rho in (("paper", None), ("code", 0.5)):
        pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact", k_rule=rule, rho=rho)))
        step = pipe.start(group_ids)
        inputs = {"features": F, "entropy": None, "lengths": torch.full((16,), 3.0), "partition_prompts": 0}
        outs[rule] = step.adjust("advantage", a, **{k: (lambda v=v: v) for k, v in inputs.items()})
        expected, stats = salt_advantages(a, F, k_rule=rule, rho=rho)
        torch.testing.assert_close(outs[rule], expected)
        assert float(step.metrics["salt/k"][0]) == stats["k"]
    assert not torch.allclose(outs["paper"], outs["code"])


@pytest.mark.fork
def test_the_fork_parses_the_code_rule_into_its_pipeline(up, monkeypatch):
    from openrlhf_geo.fork import hooks as fork_hooks

    args = fork_parse(up, monkeypatch, "--advantage_estimator salt --salt.k_rule code --salt.rho 0.5".split())
    salt = fork_hooks.ExperienceGeometry(args).pipeline.config.salt
    assert (salt.k_rule, salt.rho) == ("code", 0.5)
