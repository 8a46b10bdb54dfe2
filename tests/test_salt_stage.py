"""SALT's stage (`salt_stage.reweight`) on batches with rollouts that have no action token (SALT Eq. 4, 12, 19)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import salt_stage
from openrlhf_geo.pipeline import GeometryConfig, GeometryPipeline
from openrlhf_geo.salt import InnerProducts, SaltConfig, salt_advantages
from openrlhf_geo.stages import Batch

G = 4  # rollouts per prompt


def salt_on(a, features, lengths, group_ids, partition_prompts=0, config=None):
    """The pipeline's advantage stage (SALT alone) on one batch, inputs given as the engines give them."""
    pipe = GeometryPipeline(GeometryConfig(salt=config or SaltConfig(features="exact")))
    step = pipe.start(group_ids, None, lengths)
    inputs = {"features": features, "entropy": None, "lengths": lengths, "partition_prompts": partition_prompts}
    out = step.adjust("advantage", a, **{name: (lambda value=value: value) for name, value in inputs.items()})
    return out, step.metrics


def reweight_slots(features, a, group_ids, source, lengths, per, config=None):
    """`salt_stage.reweight` as the engines call it (every slot kept, step 1), on per-rollout features and lengths."""
    return salt_stage.reweight(
        config or SaltConfig(features="exact"),
        salt_stage.SaltState(torch.Generator().manual_seed(0)),
        Batch(group_ids, None, source, torch.ones(len(a), dtype=torch.bool), 1),
        a,
        features=lambda: features,
        entropy=lambda: None,
        lengths=lambda: lengths,
        partition_prompts=lambda: per,
    )


def batch(data, n_prompts):
    n = n_prompts * G
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    features = torch.randn(n, 10, generator=g, dtype=torch.float64) * (lengths > 0)[:, None]  # the engines' zero rows
    return torch.randn(n, generator=g, dtype=torch.float64), features, lengths, torch.arange(n) // G


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n_prompts=st.integers(1, 4), per=st.integers(0, 2))
def test_a_rollout_without_action_tokens_is_left_out_of_its_partitions_gram_and_keeps_its_advantage(
    data, n_prompts, per
):
    """Independently: each partition's SALT (`salt_advantages`, Eq. 12-18) on its slots that have a token only."""
    a, features, lengths, group_ids = batch(data, n_prompts)
    out, metrics = salt_on(a, features, lengths, group_ids, per)
    empty = lengths == 0
    expected, m = a.clone(), torch.full_like(a, math.nan)
    step = (per or n_prompts) * G
    for start in range(0, len(a), step):
        rows = torch.arange(start, min(start + step, len(a)))
        rows = rows[~empty[rows]]
        if len(rows):
            expected[rows], stats = salt_advantages(a[rows], features[rows])
            m[rows] = stats["m"]
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
    assert torch.equal(out[empty], a[empty])  # no token carries it: the base estimator's value, unchanged
    logged_m = metrics.get("salt/m", torch.full_like(m, math.nan).float())  # absent: no partition had a slot
    torch.testing.assert_close(logged_m, m.float(), equal_nan=True)  # m counts the responses with a token
    assert metrics["salt/zero_action_rollouts"].tolist() == [float(empty.sum())] * len(a)


def test_the_zero_row_of_an_empty_response_was_counted_in_m_and_moved_its_advantage():
    """What leaving it in did: m = 8 and a'_i = α_t [a_i]_+ (its coordinate lies in P_k's complement), not a_i."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(8, 12, generator=g, dtype=torch.float64)
    features[3] = 0.0
    a = torch.tensor([0.5, -1.5, 0.5, 0.5, -0.5, -0.5, 1.5, -0.5], dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4, 0, 6, 2, 7, 3])
    out, metrics = salt_on(a, features, lengths, torch.arange(8) // G)
    left_in, stats = salt_advantages(a, features)
    assert stats["m"] == 8.0
    torch.testing.assert_close(float(left_in[3]), stats["alpha"] * 0.5)
    assert float(out[3]) == 0.5 and float(metrics["salt/m"].nanmean()) == 7.0  # the empty slot's stats are NaN


def test_a_partition_whose_rollouts_all_lack_action_tokens_keeps_a_and_logs_no_geometry():
    a = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    features = torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lengths = torch.tensor([0, 0, 0, 0, 2, 3, 4, 5])
    features[:4] = 0.0
    out, metrics = salt_on(a, features, lengths, torch.arange(8) // G, partition_prompts=1)
    assert torch.equal(out[:4], a[:4])
    torch.testing.assert_close(out[4:], salt_advantages(a[4:], features[4:])[0])
    assert all(math.isnan(v) for v in metrics["salt/pr"][:4].tolist())
    assert metrics["salt/zero_action_rollouts"].tolist() == [4.0] * 8


def test_salt_diagnostics_leave_them_out_too():
    a = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    features = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    features[2] = 0.0
    lengths = torch.tensor([3, 1, 0, 2])
    out, metrics = salt_on(a, features, lengths, torch.zeros(4, dtype=torch.long), config=SaltConfig(apply=False))
    assert torch.equal(out, a)
    assert metrics["salt/m"][[0, 1, 3]].tolist() == [3.0] * 3 and math.isnan(float(metrics["salt/m"][2]))
    assert metrics["salt/zero_action_rollouts"].tolist() == [1.0] * 4


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 16), (torch.float32, 10), (torch.float64, 13)])
def test_a_partitions_rows_read_in_place_give_the_bits_of_a_gathered_copy(dtype, dim, monkeypatch):
    """`reweight` indexes the (N, D) features per partition and passes consecutive rows at a 64-byte boundary as a
    view (no copy of m·D floats). a' and every metric equal, bit for bit, those from a copy of each partition's rows
    (the features given non-contiguous: every partition gathered) and from slots that hold the rollouts in another
    order. max |F| in [1, 2): `salt_advantages` then forms the Gram on the very rows it is given, where MKL's
    rounding depends on their alignment: each prompt's first rollout has no action token, so a partition's rows
    start one row in, off a 64-byte boundary for rows of 40 or 104 bytes (a view there changed the Gram's bits)."""
    n, per = 6 * G, 1
    g = torch.Generator().manual_seed(0)
    features = torch.randn(n, dim, generator=g, dtype=dtype)
    features *= 1.5 / features.abs().amax(1, keepdim=True)  # every partition: max |F| = 1.5
    a, group_ids = torch.randn(n, generator=g, dtype=torch.float64), torch.arange(n) // G
    lengths = torch.where(torch.arange(n) % G == 0, 0, 3)
    features[lengths == 0] = 0.0  # the engines' zero rows
    perm = torch.randperm(n, generator=g)
    permuted = torch.empty_like(features)
    permuted[perm] = features  # slot i holds rollout perm[i]: the same features per slot
    in_place = []

    def recording(a, rows, *args, **kwargs):
        in_place.append(rows.untyped_storage().data_ptr() == features.untyped_storage().data_ptr())
        return salt_advantages(a, rows, *args, **kwargs)

    monkeypatch.setattr(salt_stage, "salt_advantages", recording)

    def reweight(rollout_features, source):
        in_place.clear()
        out, metrics = reweight_slots(rollout_features, a, group_ids, source, lengths[source.argsort()], per)
        metrics.pop("solve_ms")  # wall time
        return out, metrics, list(in_place)

    out, metrics, viewed = reweight(features, torch.arange(n))
    row_bytes = dim * features.element_size()
    assert viewed == [(first + 1) * row_bytes % 64 == 0 for first in range(0, n, per * G)]
    for other, source in ((features.T.contiguous().T, torch.arange(n)), (permuted, perm)):
        other_out, other_metrics, viewed = reweight(other, source)
        assert not any(viewed)
        assert torch.equal(other_out, out) and other_metrics.keys() == metrics.keys()
        for key, values in metrics.items():
            torch.testing.assert_close(other_metrics[key], values, rtol=0, atol=0, equal_nan=True, msg=key)


class Grams:
    """A salt_stage.GramSource on features in this process (the fork's is on its ranks: fork.hooks.RankGrams)."""

    def __init__(self, features):
        self.features, self.asked = features, []

    def grams(self, rows):
        self.asked.append(rows)
        out = []
        for wanted in rows:
            G = self.features[wanted] @ self.features[wanted].T
            out.append(InnerProducts(G, torch.linalg.eigh(G)))
        return out


@settings(max_examples=30, deadline=None)
@given(data=st.data(), n_prompts=st.integers(1, 4), per=st.integers(0, 2))
def test_a_gram_source_in_place_of_the_features_gives_what_they_give(data, n_prompts, per):
    """A GramSource (each partition's G = F[rows] F[rows]ᵀ and its eigendecomposition, as the fork's policy ranks
    answer) in place of F: the same a' and stats, with slots that repeat their prompt's rollouts (a curation plan)
    and rollouts without action tokens; asked once per batch, for the rows of each partition that has a token."""
    a, features, lengths, group_ids = batch(data, n_prompts)
    n = len(a)
    picks = data.draw(st.lists(st.integers(0, G - 1), min_size=n, max_size=n))
    source = group_ids * G + torch.tensor(picks)  # slot i holds a rollout of its own prompt
    grams = Grams(features)
    out, metrics = reweight_slots(features, a, group_ids, source, lengths, per)
    out_g, metrics_g = reweight_slots(grams, a, group_ids, source, lengths, per)
    for m in (metrics, metrics_g):
        m.pop("solve_ms", None)  # wall time
    size = (per or n_prompts) * G
    slots = [torch.arange(f, min(f + size, n)) for f in range(0, n, size)]
    expected_rows = [source[part][lengths[source[part]] > 0] for part in slots]
    assert len(grams.asked) == 1 and all(map(torch.equal, grams.asked[0], [r for r in expected_rows if r.numel()]))
    torch.testing.assert_close(out_g, out, rtol=1e-7, atol=1e-9)
    assert metrics_g.keys() == metrics.keys()
    # U⊥ gain is x/0 := inf where U⊥ is 0 in one and rounding in the other (the rank statistics pk_rho_* hold: a
    # repeated rollout's copies, tied but for rounding, are ties there)
    if "U_perp" in metrics:  # absent when no partition had a slot with a token
        residual = (metrics["U_perp"] > 1e-9) | (metrics_g["U_perp"] > 1e-9)
        for m in (metrics, metrics_g):
            m["U_perp_gain"] = m["U_perp_gain"][residual]
    for key in metrics:
        torch.testing.assert_close(metrics_g[key], metrics[key], rtol=1e-6, atol=1e-9, equal_nan=True, msg=key)


def test_a_gram_source_stands_for_the_features_only_under_the_raw_gram():
    shrink = SaltConfig(features="kronecker", dim=4096, gram="shrink")
    with pytest.raises(ValueError, match="--salt.gram shrink reads the features' columns"):
        reweight_slots(Grams(torch.randn(8, 5, dtype=torch.float64)), torch.randn(8, dtype=torch.float64),
                       torch.arange(8) // G, torch.arange(8), torch.ones(8), 1, shrink)  # fmt: skip
