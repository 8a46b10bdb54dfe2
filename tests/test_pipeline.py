"""The geometry pipeline shared by both engines: multiplicities, partitions, entropy-alpha state, checks, state.

The fork-vs-local-engine equivalence on real patched upstream modules is in test_fork_pipeline.py.
"""

import dataclasses
import io
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import geoalign, pipeline, salt_stage
from openrlhf_geo.geoalign import GeoAlignConfig
from openrlhf_geo.pipeline import GeometryConfig, GeometryPipeline, check_finite
from openrlhf_geo.rewards.noise import NoiseConfig, corrupt
from openrlhf_geo.salt import SaltConfig, entropy_alpha, salt_advantages
from openrlhf_geo.stages import CurationPlan


def salt_step(step, a, features, entropy, lengths, partition_prompts=0):
    """The step's advantage adjustments (SALT alone here) on a (N,), given SALT's inputs as the engines give them."""
    inputs = {"features": features, "entropy": entropy, "lengths": lengths, "partition_prompts": partition_prompts}
    return step.adjust("advantage", a, **{name: (lambda value=value: value) for name, value in inputs.items()})


def fixed_plan(source, weight=None, keep=None):
    """A `curate` stand-in returning a fixed plan (the pipeline's wiring under test, not GeoAlign's detector)."""

    def curate(hidden, rewards, group_ids, config, generator=None, *, projector=None, corrupted=None, actions=None):
        n = len(rewards)
        plan = dataclasses.replace(
            CurationPlan.identity(n),
            source=torch.as_tensor(source),
            weight=torch.ones(n) if weight is None else torch.as_tensor(weight, dtype=torch.float),
            keep=torch.ones(n, dtype=torch.bool) if keep is None else torch.as_tensor(keep),
        )
        return plan, {"flag_frac": 0.25, "skipped_reason": ""}

    return curate


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(1, 12))
def test_row_values_and_multiplicities_equal_an_explicit_slot_sum(data, n):
    source = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n)))
    weight = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)))
    slot = torch.tensor(data.draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n)), dtype=torch.float64)
    step = GeometryPipeline(GeometryConfig()).start(torch.zeros(n, dtype=torch.long))
    step.plan = dataclasses.replace(CurationPlan.identity(n), source=source, weight=weight)
    value, multiplicity = step.rows(slot)
    for r in range(n):  # brute force: the slots rollout r fills, with their weights
        fills = [i for i in range(n) if int(source[i]) == r]
        m = sum(float(weight[i]) for i in fills)
        assert float(multiplicity[r]) == pytest.approx(m)
        # what reaches the loss: value x multiplicity = the weighted sum of the slots' a'
        assert float(value[r] * multiplicity[r]) == pytest.approx(sum(float(weight[i] * slot[i]) for i in fills))


def test_drop_removes_slots_from_group_statistics_salt_and_multiplicities(monkeypatch):
    monkeypatch.setattr(
        geoalign.plan, "curate", fixed_plan([0, 1, 2, 3, 4, 5], [1, 0, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1])
    )
    salt = SaltConfig(features="exact")
    pipe = GeometryPipeline(GeometryConfig(salt=salt, geoalign=GeoAlignConfig(mode="drop")))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    step = pipe.start(group_ids)
    step.curate(torch.tensor([1.0, 0, 0, 1, 0, 1]), torch.randn(6, 4))
    assert step.kept.tolist() == [True, False, True, True, True, True]
    features = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = torch.tensor([0.7, 0.0, -0.7, 0.5, -1.0, 0.5], dtype=torch.float64)
    new = salt_step(step, a, features, None, torch.full((6,), 4.0))
    kept = torch.tensor([0, 2, 3, 4, 5])
    expected, _ = salt_advantages(a[kept], features[kept], generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(new[kept], expected)
    assert float(new[1]) == 0.0 and math.isnan(float(step.metrics["salt/pr"][1]))  # the dropped slot: no stats
    _, multiplicity = step.rows(new)
    assert multiplicity.tolist() == [1, 0, 1, 1, 1, 1]


def test_partitions_follow_sorted_prompt_ids_and_each_gets_one_salt_call():
    pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact"), seed=5))
    group_ids = torch.tensor([5, 5, 5, 9, 9, 9, 2, 2, 2])  # unique() sorts: prompts 2, 5 then 9
    g = torch.Generator().manual_seed(0)
    features, a = (
        torch.randn(9, 12, generator=g, dtype=torch.float64),
        torch.randn(9, generator=g, dtype=torch.float64),
    )
    got = salt_step(pipe.start(group_ids), a, features, None, torch.full((9,), 3.0), partition_prompts=2)
    expected = torch.empty(9, dtype=torch.float64)
    for rows in (torch.tensor([0, 1, 2, 6, 7, 8]), torch.tensor([3, 4, 5])):
        expected[rows] = salt_advantages(a[rows], features[rows])[0]
    torch.testing.assert_close(got, expected)


def _np_coefficient_group_stats(c, F, groups):
    """SALT App. D.1 Eq. 50-53 / App. B g_norm, independently in float64 numpy: u_i = c_i g_i (Eq. 37)."""
    m, eps = len(c), 1e-8
    u = c[:, None] * F
    ids = sorted(set(groups))
    per_group = []  # Eq. 50 of the groups with some u_i ≠ 0: a tied group (Â = 0) is 0/0 and left out of Eq. 51
    for b in ids:
        rows = [i for i in range(m) if groups[i] == b]
        total = u[rows].sum(0)
        den = sum(float(u[i] @ u[i]) for i in rows) / m
        if den > 0:
            per_group.append(float(total @ total) / m / (den + eps))
    means = np.stack([u[[i for i in range(m) if groups[i] == b]].mean(0) for b in ids])
    w_total = means.sum(0)
    den = sum(float(x @ x) for x in means) / m + eps
    g_norm = np.mean([np.linalg.norm(u[[i for i in range(m) if groups[i] == b]].mean(0)) for b in ids])
    n_eff_group = np.mean(per_group) if per_group else math.nan
    left_out = len(ids) - len(per_group)
    n_eff_means = float(w_total @ w_total) / m / den
    return {"n_eff_group": n_eff_group, "n_eff_group_left_out": left_out, "n_eff_means": n_eff_means, "g_norm": g_norm}


def test_a_salt_run_logs_the_group_statistics_of_a_and_of_the_objectives_a_prime():
    """App. D.1's Â is "the scalar coefficient used by the objective": a' in a SALT run, logged as <key>_applied."""
    pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact"), seed=5))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    g = torch.Generator().manual_seed(3)
    features, a = torch.randn(6, 7, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    step = pipe.start(group_ids)
    new = salt_step(step, a, features, None, torch.full((6,), 3.0))
    groups, F = group_ids.tolist(), features.numpy()
    for key, coefficients in ((None, a), ("applied", new)):
        expected = _np_coefficient_group_stats(coefficients.numpy(), F, groups)
        for name in salt_stage.APPLIED_GROUP_KEYS:
            got = float(step.metrics[f"salt/{name}_{key}" if key else f"salt/{name}"][0])
            assert got == pytest.approx(expected[name], rel=1e-6), (name, key)  # metrics are float32


def test_the_logged_n_eff_group_leaves_tied_groups_out_and_counts_them():
    """salt/n_eff_group (both engines log step.metrics) is Eq. 51 over the groups with signal, not a tied group's 0."""
    pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact", apply=False), seed=5))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    g = torch.Generator().manual_seed(4)
    features, a = torch.randn(9, 7, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    a[3:6] = 0.0  # prompt 1's rollouts tied
    step = pipe.start(group_ids)
    salt_step(step, a, features, None, torch.full((9,), 3.0))
    expected = _np_coefficient_group_stats(a.numpy(), features.numpy(), group_ids.tolist())
    assert float(step.metrics["salt/n_eff_group"][0]) == pytest.approx(expected["n_eff_group"], rel=1e-6)
    assert float(step.metrics["salt/n_eff_group_left_out"][0]) == 1.0


def test_a_partition_without_signal_logs_its_ratio_stats_as_nan_and_the_batch_value_over_the_others():
    """On a partition whose groups are all tied (a = 0) Eq. 6, 17 and 59-61 are 0/0: salt/n_eff_in, alpha, D_a, ...
    are NaN there (not salt_advantages' fill values 0, 1, 0, 1), so the step's nanmean is over the partitions with
    signal."""
    pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact"), seed=5))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    g = torch.Generator().manual_seed(6)
    features = torch.randn(12, 7, generator=g, dtype=torch.float64)
    a = torch.randn(12, generator=g, dtype=torch.float64)
    a[6:] = 0.0  # the second partition (prompts 2 and 3) is tied
    step = pipe.start(group_ids)
    new = salt_step(step, a, features, None, torch.full((12,), 3.0), partition_prompts=2)
    assert bool((new[6:] == 0).all())
    F = features.numpy()
    u = a.numpy()[:6]
    K = F[:6] @ F[:6].T / 6
    n_eff = float(u @ K @ u) / float((u**2 * np.diag(K)).sum())  # Eq. 6 on the Gram, float64
    for key in salt_stage.UNDEFINED_WITHOUT_SIGNAL:
        values = step.metrics[f"salt/{key}"]
        assert bool(torch.isnan(values[6:]).all()) and bool(torch.isfinite(values[:6]).all()), key
    assert float(step.metrics["salt/n_eff_in"].nanmean()) == pytest.approx(n_eff, rel=1e-5)
    assert step.metrics["salt/no_signal"].tolist() == [0.0] * 6 + [1.0] * 6
    assert bool(torch.isfinite(step.metrics["salt/pr"]).all())  # the features' geometry is defined either way


def test_entropy_alpha_uses_the_token_weighted_step_entropy_and_the_running_range():
    """SALT App. F.3: α_t = clip((H_t − H_min)/(H_max − H_min), 0, 1), H_t the step's token-weighted mean entropy."""
    salt = SaltConfig(variant="entropy-alpha", features="exact")
    pipe = GeometryPipeline(GeometryConfig(salt=salt))
    group_ids = torch.tensor([0, 0, 1, 1])
    features = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    lengths = torch.tensor([2.0, 10.0, 4.0, 4.0])
    seen = []
    for sums in ([1.6, 3.0, 2.0, 2.0], [0.2, 1.0, 0.4, 0.4], [1.0, 2.0, 1.0, 1.0]):
        step = pipe.start(group_ids)
        salt_step(step, a, features, torch.tensor(sums), lengths)
        h_t = sum(sums) / float(lengths.sum())  # per token, not per response: 8.6 / 20, 2.0 / 20, 5.0 / 20
        seen.append(h_t)
        assert float(step.metrics["salt/H_t"][0]) == pytest.approx(h_t)
        assert pipe.states["salt"].entropy_range == pytest.approx((min(seen), max(seen)))
        alpha = entropy_alpha(h_t, min(seen), max(seen))
        assert float(step.metrics["salt/alpha"][0]) == pytest.approx(alpha)
    assert float(step.metrics["salt/alpha"][0]) == pytest.approx((0.25 - 0.1) / (0.43 - 0.1))


def test_state_dict_round_trips_streams_projector_and_running_statistics():
    config = GeometryConfig(
        salt=SaltConfig(variant="rand-proj", features="exact"),
        geoalign=GeoAlignConfig(hidden_sizes=(8,), out_dim=4, steps=2),
        noise=NoiseConfig("flip", 0.25),
        seed=3,
    )
    g = torch.Generator().manual_seed(0)
    group_ids = torch.arange(16) // 4
    rewards = (torch.rand(16, generator=g) > 0.5).float()
    hidden, features = torch.randn(16, 6, generator=g), torch.randn(16, 10, generator=g, dtype=torch.float64)

    def run(pipe):
        noisy, corrupted = pipe.corrupt(rewards, group_ids)
        step = pipe.start(group_ids, corrupted)
        slot_rewards = step.curate(noisy, hidden)
        a = (slot_rewards - 0.5).double()
        return noisy, salt_step(step, a, features, None, torch.full((16,), 3.0)), step.metrics

    first = GeometryPipeline(config)
    run(first)
    state = first.state_dict()
    expected = run(first)
    resumed = GeometryPipeline(config)
    resumed.load_state_dict(state)
    got = run(resumed)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for key, values in expected[2].items():
        if not key.endswith(("time_s", "solve_ms")):
            torch.testing.assert_close(got[2][key], values, equal_nan=True, msg=key)


@pytest.mark.parametrize("bad", [math.inf, math.nan, -math.inf])
def test_non_finite_rewards_stop_the_step_naming_step_prompt_and_value(bad):
    rewards = torch.tensor([1.0, 0.0, 1.0, bad])
    with pytest.raises(ValueError, match=rf"step 1: reward of rollout 3 \(prompt 1\) is {bad}"):
        GeometryPipeline(GeometryConfig()).corrupt(rewards, torch.tensor([0, 0, 1, 1]))


def test_a_reward_list_of_the_wrong_length_is_an_error_not_a_broadcast():
    with pytest.raises(ValueError, match=r"rewards must have shape \(4,\), got \(3,\)"):
        check_finite("reward", torch.ones(3), torch.zeros(4, dtype=torch.long), 7)


def test_noise_dispatch_is_the_identity_without_noise_and_matches_the_corruption_functions():
    rewards, groups = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    same, corrupted = corrupt(rewards, groups, NoiseConfig())
    assert same is rewards and not corrupted.any()
    flipped, corrupted = corrupt(rewards, groups, NoiseConfig("flip", 0.5), torch.Generator().manual_seed(0))
    assert torch.equal(flipped != rewards, corrupted) and int(corrupted.sum()) == 2
    assert np.allclose(flipped[corrupted].numpy(), 1 - rewards[corrupted].numpy())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"type": "flip"}, "--reward.noise.rate must be in (0, 1)"),
        ({"rate": 0.1}, "needs --reward.noise.type flip or swap"),
        ({"type": "swap", "rate": 0.1, "levels": (0, 1)}, "--reward.noise.levels only applies"),
        ({"type": "flip", "rate": 0.1, "levels": (0, 2)}, "must be 0 1 or -1 1"),
        ({"type": "bogus"}, "--reward.noise.type must be one of"),
    ],
)
def test_noise_config_validates_itself_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NoiseConfig(**kwargs)


# ── the comparison baselines through the pipeline (GeoAlign App. B.5) and SALT's regime guard ──


def test_pf_ppo_and_pods_plans_replace_geoalign_in_curate_with_their_own_stream():
    """--baseline.curation: the slot rewards are rewards[plan.source] of `pf_ppo_plan` / `pods_plan` drawn from the
    pipeline's baseline stream (--train.seed + 4); PODS drops slots from the group statistics (`kept`)."""
    from openrlhf_geo.baselines import BaselineConfig, pf_ppo_plan, pods_plan

    group_ids = torch.arange(12) // 4
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.3, 1.0, 0.0, 0.2, 0.7, 0.4, 0.4, 0.8, 0.6])
    for curation, keep_count in (("pf_ppo_br", True), ("pf_ppo_bw", False), ("pods", False)):
        config = BaselineConfig(
            curation=curation, pf_ppo_keep_count=keep_count, pods_m=2 if curation == "pods" else None
        )
        step = GeometryPipeline(GeometryConfig(baseline=config, seed=3)).start(group_ids)
        slot_rewards = step.curate(rewards, None)
        if curation == "pods":
            plan, stats = pods_plan(rewards, group_ids, 2)
        else:
            mode = {"pf_ppo_br": "best_random", "pf_ppo_bw": "best_worst"}[curation]
            plan, stats = pf_ppo_plan(
                rewards, group_ids, mode, torch.Generator().manual_seed(3 + 4), keep_count=keep_count
            )
        assert torch.equal(slot_rewards, rewards[plan.source]) and torch.equal(step.kept, plan.keep)
        assert not torch.equal(plan.source, torch.arange(12)) or not plan.keep.all()  # the plan changed something
        for key, value in stats.items():
            assert float(step.metrics[f"baseline/{key}"].nanmean()) == pytest.approx(value), key
    # PODS m = 2 keeps the max-variance pair of each prompt, e.g. (0.1, 0.9) of the first
    assert step.kept.tolist()[:4] == [True, False, True, False]


def test_seed_grpo_scales_each_prompts_kept_slots_by_its_answer_entropy(monkeypatch):
    """Seed-GRPO (arXiv 2505.12346): a_i * (1 - alpha SE(q) / log G), SE = -1/K sum_k log(|C_k|/G) over the answer
    clusters of the slots' responses (a replaced slot answers as its source), G = kept slots of the prompt."""
    from openrlhf_geo.baselines import BaselineConfig

    monkeypatch.setattr(geoalign.plan, "curate", fixed_plan([0, 0, 2, 3, 4, 5, 6, 7], keep=[1, 1, 1, 1, 1, 1, 1, 0]))
    config = GeometryConfig(geoalign=GeoAlignConfig(mode="drop"), baseline=BaselineConfig(seed_grpo_alpha=0.4))
    step = GeometryPipeline(config).start(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    step.curate(torch.zeros(8), torch.randn(8, 4))
    responses = [
        "\\boxed{2}",
        "\\boxed{5}",
        "\\boxed{2}",
        "\\boxed{1/2}",
        "\\boxed{0.5}",
        "\\boxed{3}",
        "x",
        "\\boxed{9}",
    ]
    a = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, 0.0], dtype=torch.float64)
    got = step.adjust("advantage", a, responses=lambda: responses, verifier=lambda: None)
    # prompt 0's slots answer 2, 2 (slot 1 holds rollout 0), 2, 1/2: clusters {3, 1}; prompt 1's kept slots answer
    # 0.5, 3, (no box): three clusters of one among G = 3 (slot 7 is dropped)
    se0, se1 = -(np.log(3 / 4) + np.log(1 / 4)) / 2, -np.log(1 / 3)
    scale = [1 - 0.4 * se0 / np.log(4)] * 4 + [1 - 0.4 * se1 / np.log(3)] * 3 + [1.0]
    torch.testing.assert_close(got, a * torch.tensor(scale, dtype=torch.float64))
    assert float(step.metrics["baseline/answer_clusters/clusters_per_prompt"][0]) == pytest.approx(2.5)
    assert math.isnan(float(step.metrics["baseline/seed_grpo/scale_min"][7]))  # the dropped slot has no stats
    off, two = GeometryPipeline(GeometryConfig()).start(torch.zeros(2, dtype=torch.long)), a[:2]
    assert off.adjust("advantage", two, responses=lambda: ["", ""]) is two  # off: the identity


def salt_regime_step(pipe, inside):
    """One SALT step on 4 prompts x 4 rollouts: orthonormal features (PR = m, so k = m and a' = a: D_a = 0) or
    random rank-4 ones (k <= 4 of 16 directions: P_k a keeps little of a, D_a > 0.6 on every seed used here)."""
    g = torch.Generator().manual_seed(pipe.steps)
    if inside:
        features = torch.eye(16, dtype=torch.float64)
    else:
        features = torch.randn(16, 4, generator=g, dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 1.0, -1.0] * 4, dtype=torch.float64) * (1 + torch.rand(16, generator=g))
    step = pipe.start(torch.arange(16) // 4)
    salt_step(step, a, features, None, torch.full((16,), 5.0))
    return step


@pytest.mark.parametrize("inside", [False, True], ids=["far-outside", "inside"])
def test_salt_regime_guard_warns_once_per_window_and_logs_every_step(inside):
    pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact")))
    flags = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(salt_stage.REGIME_WARN_EVERY):
            step = salt_regime_step(pipe, inside)
            d_a, flip = (float(step.metrics[f"salt/{k}"].nanmean()) for k in ("D_a", "sign_flip"))
            flags.append(float(step.metrics["salt/out_of_regime"][0]))
            far = d_a > salt_stage.REGIME_MAX_D_A or flip > salt_stage.REGIME_MAX_SIGN_FLIP
            assert far != inside, (d_a, flip)  # the synthetic batch is where the test says it is
        assert flags == [0.0 if inside else 1.0] * salt_stage.REGIME_WARN_EVERY
        regime = [str(w.message) for w in caught if issubclass(w.category, salt_stage.SaltRegimeWarning)]
        assert len(regime) == (0 if inside else 1)
        if inside:
            return
        assert regime[0].startswith("step 1: ") and "docs/salt_regime.md" in regime[0] and "D_a = " in regime[0]
        resumed = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact")))
        resumed.load_state_dict(pipe.state_dict())  # a resume keeps the window
        salt_regime_step(pipe, inside=False)
        salt_regime_step(resumed, inside=False)
    regime = [str(w.message) for w in caught if issubclass(w.category, salt_stage.SaltRegimeWarning)]
    assert len(regime) == 3 and regime[1].startswith("step 51: ") and regime[2].startswith("step 51: ")


def test_a_users_warnings_show_only_their_message(tmp_path):
    """What a run prints: `warning: <message>` for the project's warnings, without Python's file:line and the source
    line under it (`advantages = step.adjust(` after the regime warning); other warnings keep Python's format."""
    script = tmp_path / "run.py"
    script.write_text(
        "import warnings\n"
        "from openrlhf_geo import salt, salt_stage\n"
        "warnings.warn('step 1: far outside', salt_stage.SaltRegimeWarning)\n"
        "warnings.warn('ARPACK did not converge', salt.SaltSolverWarning)\n"
        "warnings.warn('not ours', DeprecationWarning)\n"
    )
    done = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True, check=True)
    lines = done.stderr.splitlines()
    assert lines[:2] == ["warning: step 1: far outside", "warning: ARPACK did not converge"]
    assert lines[2:] == [
        f"{script}:5: DeprecationWarning: not ours",
        "  warnings.warn('not ours', DeprecationWarning)",
    ]


def test_salt_diagnostics_have_no_regime_guard():
    pipe = GeometryPipeline(GeometryConfig(salt=SaltConfig(features="exact", apply=False)))
    assert "salt/out_of_regime" not in salt_regime_step(pipe, inside=False).metrics


def signal_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, pipeline.LearningSignalWarning)]


def test_learning_signal_guard_warns_about_cut_responses_and_tied_groups_once_per_window():
    """The README's local-engine command cut every response at 16 tokens: reward, accuracy and every advantage were
    0 and the run exited 0 without a word. The guard logs both shares every step and warns, rate-limited."""
    guard = pipeline.SignalGuard(max_new_tokens=16)
    groups = torch.arange(8) // 4  # two prompts of four rollouts
    cut = torch.tensor([True] * 7 + [False])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [guard.check(torch.zeros(8), groups, cut) for _ in range(pipeline.SIGNAL_WARN_EVERY)]
    assert all(r == {"signal/truncated": 7 / 8, "signal/tied_groups": 1.0} for r in rows)
    cut_warning, tied_warning = signal_warnings(caught)  # one of each in the window, tied after the streak
    assert cut_warning.startswith("step 1: 88 % of the responses (7 of 8) hit the length limit (16 new tokens)")
    assert "raise --rollout.max_new_tokens" in cut_warning
    n = pipeline.SIGNAL_FLAT_STEPS
    assert tied_warning.startswith(f"steps 1-{n}: every prompt's rollouts got the same reward (mean 0, 2 prompts")
    assert "no learning signal" in tied_warning and "88 % of the responses were cut" in tied_warning
    with warnings.catch_warnings(record=True) as caught:  # the next windows; a resumed guard keeps them
        warnings.simplefilter("always")
        resumed = pipeline.SignalGuard(max_new_tokens=16)
        resumed.load_state_dict(guard.state_dict())
        for _ in range(n):
            resumed.check(torch.zeros(8), groups, cut)
    window = pipeline.SIGNAL_WARN_EVERY
    assert [w.split(":")[0] for w in signal_warnings(caught)] == [f"step {window + 1}", f"steps 1-{window + n}"]


def test_learning_signal_guard_is_quiet_while_there_is_signal():
    guard = pipeline.SignalGuard()
    groups = torch.arange(8) // 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):  # half the responses cut, and one prompt tied in turn: below both limits
            tied = step % 2
            rewards = torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1]) if tied else torch.tensor([1.0, 0, 0, 0, 0, 1, 0, 0])
            row = guard.check(rewards, groups, torch.arange(8) < 4)
            assert row == {"signal/truncated": 0.5, "signal/tied_groups": 0.5 if tied else 0.0}
        for _ in range(pipeline.SIGNAL_FLAT_STEPS - 1):  # a tied streak shorter than SIGNAL_FLAT_STEPS
            guard.check(torch.ones(8), groups)
        guard.check(torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1]), groups)
        guard.check(torch.ones(8), groups)
    assert not signal_warnings(caught)
    assert guard.check(torch.ones(8), groups) == {"signal/tied_groups": 1.0}  # no mask: no truncation share


def _fixture_run(pipe, step):
    """The run `tests/fixtures/pipeline_state_v1.pt` recorded: rollout step `step`'s outputs on its fixed inputs."""
    g = torch.Generator().manual_seed(100 + step)
    rewards = (torch.rand(16, generator=g) > 0.5).float()
    hidden, features = torch.randn(16, 6, generator=g), torch.randn(16, 10, generator=g, dtype=torch.float64)
    entropy = torch.rand(16, generator=g) * 3
    group_ids = torch.arange(16) // 4
    noisy, corrupted = pipe.corrupt(rewards, group_ids)
    step = pipe.start(group_ids, corrupted)
    slot_rewards = step.curate(noisy, hidden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", salt_stage.SaltRegimeWarning)
        out = salt_step(step, (slot_rewards - 0.5).double(), features, entropy, torch.full((16,), 3.0))
    value, multiplicity = step.rows(out)
    metrics = {k: v for k, v in step.metrics.items() if not k.endswith(("time_s", "solve_ms"))}
    return {"rewards": noisy, "source": step.plan.source, "a": out, "value": value, "multiplicity": multiplicity,
            "metrics": metrics}  # fmt: skip


def _format_1_configs():
    from openrlhf_geo.baselines import BaselineConfig

    return {
        "geoalign+rand-proj+noise": GeometryConfig(
            salt=SaltConfig(variant="rand-proj", features="exact"),
            geoalign=GeoAlignConfig(hidden_sizes=(8,), out_dim=4, steps=2),
            noise=NoiseConfig("flip", 0.25),
            seed=3,
        ),
        "pf_ppo_br+entropy-alpha": GeometryConfig(
            salt=SaltConfig(variant="entropy-alpha", features="exact"),
            baseline=BaselineConfig(curation="pf_ppo_br"),
            seed=5,
        ),
    }


def _as_format_1(state):
    """A state (format 2) in the flat layout the pipeline wrote before 0.1.0 (format 1: the four streams, GeoAlign's
    projector, SALT's entropy range and regime clock in one dict): the inverse of `pipeline._from_format_1`. Format 1
    kept the stream of a stage that is off too; loading ignores it."""
    stages, unused = state["stages"], torch.Generator().get_state()
    salt, geoalign = stages.get("salt", {}), stages.get("geoalign", {})
    baseline = stages.get("pf_ppo_br", stages.get("pf_ppo_bw", {}))  # the baseline stream was PF-PPO's
    streams = {"noise": stages["noise"]["generator"], "geoalign": geoalign.get("generator", unused),
               "salt": salt.get("generator", unused), "baseline": baseline.get("generator", unused)}  # fmt: skip
    return {"generators": streams, "projector": geoalign.get("projector"), "projector_in_dim": geoalign.get("in_dim"),
            "entropy_range": salt.get("entropy_range"), "last_regime_warning": salt.get("last_regime_warning"),
            "steps": state["steps"]}  # fmt: skip


@pytest.mark.parametrize("name", ["geoalign+rand-proj+noise", "pf_ppo_br+entropy-alpha"])
def test_a_checkpoint_written_before_the_stages_owned_their_state_resumes_bit_for_bit(name):
    """A format-1 state (every stage's memory in one flat dict) of two steps, through torch.save/load into today's
    pipeline: the third step is the uninterrupted run's, bit for bit (every stream, the warm projector, the entropy
    range carried over), both computed here; the state it writes now is the stages' own (format 2)."""
    config = _format_1_configs()[name]
    uninterrupted = GeometryPipeline(config)
    for step in range(2):
        _fixture_run(uninterrupted, step)
    saved = io.BytesIO()
    torch.save(_as_format_1(uninterrupted.state_dict()), saved)
    saved.seek(0)
    resumed = GeometryPipeline(config)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    torch.testing.assert_close(
        _fixture_run(resumed, 2), _fixture_run(uninterrupted, 2), rtol=0, atol=0, equal_nan=True
    )
    state = resumed.state_dict()
    assert state["format"] == pipeline.STATE_FORMAT and "salt" in state["stages"] and state["steps"] == 3
    torch.testing.assert_close(state, uninterrupted.state_dict(), rtol=0, atol=0)


# Values recorded on another machine agree within rounding, not bit for bit. float64 (SALT's a', the rows): a 16 x 16
# eigensolve whose relative eigengap at k is 0.24-0.27 (the fixture's salt/gap) moves by ~1e-16 / gap with another
# BLAS/LAPACK kernel (5.6e-16 seen on AMD family 26); 1e-12 is far below what a state that loaded wrong moves (SALT's
# entropy range off by 1e-6 moves a' by 8e-8). float32 (the metrics, GeoAlign's projector after two Adam steps, the
# entropy range of float32 entropies): a few ulps (eps 1.2e-7); 1e-5, where a projector off by 1e-4 moves the
# metrics by 1.7e-4. Integers (streams, slots, counts): exactly.
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}
FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("name", ["geoalign+rand-proj+noise", "pf_ppo_br+entropy-alpha"])
def test_the_recorded_format_1_checkpoint_loads_to_this_runs_state_and_step(name):
    """tests/fixtures/pipeline_state_v1.pt, written by the pipeline as of 0.1.0.dev0 (state format 1) on another
    machine: the state after two `_fixture_run` steps and the third step's outputs. Its layout is `_as_format_1`'s;
    loaded, it is this machine's state after the same two steps, and its third step this machine's, within rounding."""
    config = _format_1_configs()[name]
    fixture = torch.load("tests/fixtures/pipeline_state_v1.pt", weights_only=True)[name]
    here = GeometryPipeline(config)
    for step in range(2):
        _fixture_run(here, step)

    def layout(value):
        if isinstance(value, dict):
            return {key: layout(v) for key, v in value.items()}
        return (value.dtype, value.shape) if isinstance(value, torch.Tensor) else type(value)

    assert layout(fixture["state"]) == layout(_as_format_1(here.state_dict()))
    loaded = GeometryPipeline(config)
    loaded.load_state_dict(fixture["state"])
    torch.testing.assert_close(loaded.state_dict(), here.state_dict(), **FLOAT32)
    got, recorded = _fixture_run(loaded, 2), fixture["next"]
    for key in ("rewards", "source", "multiplicity"):  # 0/1 rewards, slot indices, counts: exact on any CPU
        torch.testing.assert_close(got[key], recorded[key], rtol=0, atol=0)
    for key in ("a", "value"):
        torch.testing.assert_close(got[key], recorded[key], **FLOAT64, msg=key)
    metrics = {key: got["metrics"][key] for key in recorded["metrics"]}  # metrics added since are not in it
    torch.testing.assert_close(metrics, recorded["metrics"], **FLOAT32, equal_nan=True)
