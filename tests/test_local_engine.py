"""The local engine: masking, advantages, the clipped surrogate, one hand-checkable update, features, resume."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from openrlhf_geo.features import last_token_hidden, lm_head_features
from openrlhf_geo.local import engine
from openrlhf_geo.local.engine import Rollouts, Trainer
from openrlhf_geo.local.task import addition_problems, build_model, build_tokenizer, reference_response
from openrlhf_geo.local.train import parse_args


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tiny_model(tokenizer, seed=0):
    return build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=seed)


def make_args(*extra):
    return parse_args(["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused", *extra])


def hand_batch(tokenizer, prompts, responses, rewards):
    """Rollouts laid out like `generate_rollouts` (left-padded prompts, responses padded after EOS), built by hand."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    p_ids = [tokenizer(p)["input_ids"] for p in prompts]
    r_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [eos] for r in responses]
    P, R = max(map(len, p_ids)), max(map(len, r_ids))
    seq = torch.tensor([[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(p_ids, r_ids)])
    att = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + R) for p in p_ids])
    mask = torch.tensor([[True] * len(r) + [False] * (R - len(r)) for r in r_ids])
    _, group = np.unique(prompts, return_inverse=True)
    return Rollouts(
        sequences=seq,
        attention_mask=att,
        mask=mask,
        group_ids=torch.as_tensor(group),
        prompts=list(prompts),
        responses=list(responses),
        answers=[""] * len(prompts),
        prompt_width=P,
        rewards=torch.tensor(rewards, dtype=torch.float32),
    )


def unpadded_logprobs(model, tokenizer, prompt, response):
    """(T,) log-probs of response tokens + EOS from a forward on that one sequence alone (no padding at all)."""
    p = tokenizer(prompt)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)


# ---------------------------------------------------------------- masking and padding


@settings(max_examples=150)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=7), min_size=1, max_size=5), st.integers(0, 4))
def test_mask_counts_tokens_through_first_eos(rows, eos):
    width = max(map(len, rows))
    responses = torch.tensor([r + [eos] * (width - len(r)) for r in rows])  # padded with EOS itself (pad == eos)
    mask = engine.response_mask(responses, eos)
    for row, m in zip(responses.tolist(), mask.tolist()):
        first = row.index(eos) if eos in row else len(row) - 1
        assert m == [t <= first for t in range(len(row))]


def test_generated_rollouts_mask_after_eos_and_left_pad_prompts(tokenizer):
    torch.manual_seed(0)
    model = tiny_model(tokenizer)
    batch = engine.generate_rollouts(model, tokenizer, ["1+2=", "12+34="], ["3", "46"], 3, max_new_tokens=6)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    responses = batch.sequences[:, batch.prompt_width :]
    for row, mask, text in zip(responses.tolist(), batch.mask.tolist(), batch.responses):
        n = sum(mask)
        assert mask == [True] * n + [False] * (len(row) - n)  # a prefix
        if tokenizer.eos_token_id in row:
            assert row.index(tokenizer.eos_token_id) == n - 1  # EOS itself counts, nothing after it
        assert text == tokenizer.decode(row[:n], skip_special_tokens=True)
    # the shorter prompt is left-padded, and its padding is not attended
    assert batch.attention_mask[:3, :2].sum() == 0 and batch.attention_mask[3:].all()


def test_padded_batch_logprobs_equal_unpadded_forward(tokenizer):
    model = tiny_model(tokenizer)
    prompts, responses = ["1+2=", "12+34=", "5+5="], ["\\boxed{3}", "\\boxed{46}", "7"]
    batch = hand_batch(tokenizer, prompts, responses, [0.0, 0.0, 0.0])
    with torch.no_grad():
        logprobs, _, _ = engine.response_forward(model, batch.sequences, batch.attention_mask, batch.prompt_width)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            expected = unpadded_logprobs(model, tokenizer, p, r)
            assert_close(logprobs[i, : len(expected)], expected, rtol=1e-5, atol=1e-5)
            assert batch.mask[i].sum() == len(expected)


def test_tokens_after_eos_change_nothing(tokenizer):
    """Garbage after EOS (instead of padding) leaves the loss gradient unchanged: it is masked out."""
    args = make_args("--actor.adam.lr", "1e-3", "--actor.max_norm", "1e9")
    grads = []
    for garbage in (False, True):
        model = tiny_model(tokenizer)
        batch = hand_batch(tokenizer, ["1+2=", "1+2="], ["\\boxed{3}", "\\boxed{12}"], [1.0, 0.0])
        if garbage:
            tail = batch.sequences[:, batch.prompt_width :]
            tail[~batch.mask] = tokenizer.convert_tokens_to_ids("9")
        Trainer(args, model, tokenizer, [], None).learn(batch)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b, rtol=0, atol=1e-7)


# ---------------------------------------------------------------- advantages and losses vs numpy


@settings(max_examples=150)
@given(
    st.lists(st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0]), min_size=2, max_size=6), min_size=1, max_size=5),
    st.sampled_from(["group_norm", "dr_grpo"]),
)
def test_group_advantages_match_numpy(groups, estimator):
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float32)
    ids = torch.tensor([10 * i for i, g in enumerate(groups) for _ in g])  # non-contiguous prompt ids
    got = engine.group_advantages(rewards, ids, estimator)
    expected = []
    for g in groups:
        g = np.array(g, dtype=np.float64)
        centred = g - g.mean()
        expected += list(centred if estimator == "dr_grpo" else centred / (g.std(ddof=1) + 1e-9))
    assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-5)


@settings(max_examples=100)
@given(st.integers(0, 10_000), st.sampled_from([(0.2, 0.2), (0.2, 0.28)]))
def test_clipped_surrogate_matches_numpy(seed, eps):
    g = torch.Generator().manual_seed(seed)
    logprobs, old = (
        -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3,
        -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3,
    )
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    loss, clipped = engine.clipped_surrogate(logprobs, old, adv, *eps)
    ratio = np.exp(logprobs.numpy() - old.numpy())
    a = adv.numpy()[:, None]
    unclipped, clip = ratio * a, np.clip(ratio, 1 - eps[0], 1 + eps[1]) * a
    assert_close(loss, torch.from_numpy(-np.minimum(unclipped, clip)))
    assert np.array_equal(clipped.numpy(), clip < unclipped)


def test_loss_aggregation_modes_match_numpy():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert engine.aggregate(per_token, mask, "token-mean", mask.sum()).item() == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)
    seq = engine.aggregate(per_token, mask, "seq-mean-token-mean", 2).item()
    assert seq == pytest.approx(((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)


def test_kl_estimators_match_closed_forms():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    log_r = lp - ref
    assert_close(engine.approx_kl(lp, ref, "k1"), log_r)
    assert_close(engine.approx_kl(lp, ref, "k2"), log_r**2 / 2)
    assert_close(engine.approx_kl(lp, ref, "k3"), torch.exp(-log_r) - 1 + log_r)


def test_dynamic_filter_keeps_only_mixed_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, -1.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert engine.dynamic_filter(rewards, ids).tolist() == [False, False, True, True, False, False, False, False]


# ---------------------------------------------------------------- one update, checked by hand


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_update_gradient_equals_hand_computed_policy_gradient(tokenizer, agg):
    """On-policy (ratio 1, no clipping): grad = -sum_i A_i sum_t grad log p(y_it) / normalizer, A from numpy."""
    args = make_args("--actor.adam.lr", "1e-3", "--actor.max_norm", "1e9", "--actor.loss_agg_mode", agg)
    prompts = ["1+2=", "1+2=", "1+2=", "4+4="]
    responses = ["\\boxed{3}", "\\boxed{12}", "\\boxed{4}", "\\boxed{8}"]
    rewards = [1.0, 0.0, 0.0, 1.0]  # the last prompt's group is all-correct: advantage 0
    model = tiny_model(tokenizer)
    reference = tiny_model(tokenizer)  # same init, its own graph for the hand computation
    Trainer(args, model, tokenizer, [], None).learn(hand_batch(tokenizer, prompts, responses, rewards))

    r = np.array(rewards[:3])
    adv = list((r - r.mean()) / (r.std(ddof=1) + 1e-9)) + [0.0]
    logps = [unpadded_logprobs(reference, tokenizer, p, y) for p, y in zip(prompts, responses)]
    if agg == "token-mean":
        objective = sum(a * lp.sum() for a, lp in zip(adv, logps)) / sum(len(lp) for lp in logps)
    else:
        objective = sum(a * lp.mean() for a, lp in zip(adv, logps)) / len(logps)
    (-objective).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_one_step_raises_rewarded_and_lowers_unrewarded_logprob(tokenizer):
    args = make_args("--actor.adam.lr", "1e-3")
    model = tiny_model(tokenizer)
    good, bad = "\\boxed{3}", "\\boxed{12}"
    with torch.no_grad():
        before = [unpadded_logprobs(model, tokenizer, "1+2=", y).sum() for y in (good, bad)]
    Trainer(args, model, tokenizer, [], None).learn(hand_batch(tokenizer, ["1+2="] * 2, [good, bad], [1.0, 0.0]))
    with torch.no_grad():
        after = [unpadded_logprobs(model, tokenizer, "1+2=", y).sum() for y in (good, bad)]
    assert after[0] > before[0] and after[1] < before[1]


def test_micro_batches_accumulate_to_the_full_batch_gradient(tokenizer):
    prompts, responses = (
        ["1+2="] * 3 + ["4+4="] * 3,
        ["\\boxed{3}", "1", "\\boxed{12}", "\\boxed{8}", "8", "\\boxed{9}"],
    )
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    grads = []
    for micro in ("0", "2"):
        args = make_args("--actor.max_norm", "1e9", "--train.micro_batch_size", micro)
        model = tiny_model(tokenizer)
        Trainer(args, model, tokenizer, [], None).learn(hand_batch(tokenizer, prompts, responses, rewards))
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_kl_to_an_identical_reference_is_zero_with_zero_gradient(tokenizer):
    args = make_args("--actor.max_norm", "1e9", "--algo.kl.init_coef", "0.5")
    model = tiny_model(tokenizer)
    trainer = Trainer(args, model, tokenizer, [], None)
    metrics = trainer.learn(hand_batch(tokenizer, ["1+2="] * 2, ["\\boxed{3}", "4"], [1.0, 1.0]))  # advantages 0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    assert max(p.grad.abs().max().item() for p in model.parameters()) < 1e-6


# ---------------------------------------------------------------- features from the engine's forward


@pytest.mark.parametrize("method", ["exact", "sketch"])
def test_engine_features_equal_lm_head_features_of_a_separate_forward(tokenizer, method):
    args = make_args("--advantage_estimator", "salt", "--salt.features", method, "--salt.dim", "64",
                     "--rollout.temperature", "0.7")  # fmt: skip
    model = tiny_model(tokenizer)
    prompts, responses = ["1+2=", "12+34=", "12+34="], ["\\boxed{3}", "\\boxed{46}", "4"]
    batch = hand_batch(tokenizer, prompts, responses, [1.0, 1.0, 0.0])
    Trainer(args, model, tokenizer, [], None)._old_policy_forward(batch)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = tokenizer(p)["input_ids"]
            resp = tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            hidden = model.model(input_ids=torch.tensor([ids + resp])).last_hidden_state  # post-norm lm_head input
            logits = model.lm_head(hidden)
            cols = slice(len(ids) - 1, len(ids) - 1 + len(resp))
            mask = torch.ones(1, len(resp), dtype=torch.bool)
            expected = lm_head_features(
                logits[:, cols], hidden[:, cols], torch.tensor([resp]), mask, method, 64, 0, temperature=0.7
            )
            assert_close(batch.features[i : i + 1], expected, rtol=1e-4, atol=1e-6)
            assert_close(batch.hidden[i : i + 1], last_token_hidden(hidden[:, cols], mask), rtol=1e-5, atol=1e-6)
            lp = torch.log_softmax(logits[0, cols] / 0.7, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
            assert_close(batch.old_logprobs[i, : len(resp)], lp, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- checkpoint / resume


def contains_five(prompts, responses, answers):
    """A reward that random tiny models get right about half the time, so groups are mixed."""
    return torch.tensor([float("5" in r) for r in responses])


RESUME_FLAGS = [
    "--advantage_estimator", "salt", "--salt.features", "exact",
    "--geoalign.enable", "--geoalign.min_scores", "8", "--geoalign.projector.hidden_sizes", "16",
    "--geoalign.projector.out_dim", "8", "--geoalign.projector.steps", "5",
    "--reward.noise.type", "flip", "--reward.noise.rate", "0.25",
    "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "6", "--rollout.max_new_tokens", "6",
    "--train.batch_size", "12", "--train.max_epochs", "2", "--actor.adam.lr", "1e-2",
]  # fmt: skip


def test_resume_reproduces_the_next_step(tokenizer, tmp_path):
    rows = addition_problems(20, seed=0)
    args = make_args(*RESUME_FLAGS)

    straight = Trainer(args, tiny_model(tokenizer), tokenizer, rows, contains_five)
    straight.step()
    expected = straight.step()

    first = Trainer(args, tiny_model(tokenizer), tokenizer, rows, contains_five)
    first.step()
    assert first.projector is not None  # GeoAlign ran, so its projector is part of the state
    first.save_checkpoint(tmp_path / "checkpoint.pt")
    torch.manual_seed(1234)  # a different global RNG state must not matter after loading
    resumed = Trainer(args, tiny_model(tokenizer, seed=7), tokenizer, rows, contains_five)
    resumed.load_checkpoint(tmp_path / "checkpoint.pt")
    got = resumed.step()

    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.projector.parameters(), resumed.projector.parameters()):
        assert torch.equal(a, b)
    timing = {k for k in expected if k.startswith("time/") or k == "geo/time_s" or k == "salt/solve_ms"}
    same = {k: v for k, v in expected.items() if k not in timing}
    assert {k: got[k] for k in same} == pytest.approx(same, nan_ok=True)


def test_replacement_fills_slots_with_donor_content(tokenizer):
    batch = hand_batch(tokenizer, ["1+2="] * 3, ["\\boxed{3}", "4", "\\boxed{12}"], [1.0, 0.0, 1.0])
    copied = batch.select(torch.tensor([0, 0, 2]))  # slot 1 replaced by rollout 0 (Best-Random donor)
    assert copied.responses == ["\\boxed{3}", "\\boxed{3}", "\\boxed{12}"]
    assert torch.equal(copied.sequences[1], batch.sequences[0]) and copied.rewards.tolist() == [1.0, 1.0, 1.0]
    assert copied.group_ids.tolist() == [0, 0, 0]


def test_reference_response_is_rewarded_by_math_verify():
    from openrlhf_geo.local.train import CachedMathVerify

    reward = CachedMathVerify()
    rows = addition_problems(5, seed=3)
    responses = [reference_response(r["answer"]) for r in rows] + ["\\boxed{-1}", "no box"]
    answers = [r["answer"] for r in rows] + ["3", "3"]
    got = reward([""] * len(answers), responses, answers)
    assert got.tolist() == [1.0] * 5 + [0.0, 0.0]
    assert math.isclose(float(reward([""], ["\\boxed{3}"], ["3"])), 1.0)


# ---------------------------------------------------------------- DAPO switches


def even_first_operand_always_right(prompts, responses, answers):
    """All-correct groups for prompts whose first operand is even, mixed ones otherwise."""
    return torch.tensor(
        [1.0 if int(p.split("+")[0]) % 2 == 0 else float("5" in r) for p, r in zip(prompts, responses)]
    )


def test_dynamic_filtering_refills_the_batch_with_mixed_groups(tokenizer):
    rows = addition_problems(40, seed=1)
    args = make_args("--algo.dynamic_filtering_enable", "--reward.pm1", "--rollout.batch_size", "6",
                     "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "5")  # fmt: skip
    seen = []

    def count_rollouts(prompts, responses, correct):  # a rollout_stats hook: called once per generation round
        seen.append(len(responses))
        return {"count/rollouts": len(responses), "count/correct": float(sum(correct))}

    trainer = Trainer(
        args, tiny_model(tokenizer), tokenizer, rows, even_first_operand_always_right, rollout_stats=count_rollouts
    )
    batch, stats = trainer._collect()
    assert set(batch.rewards.tolist()) <= {-1.0, 1.0}  # DAPO's ±1 rewards
    assert 0 < stats["filter/pass_rate"] < 1
    groups = batch.group_ids.unique()
    assert len(groups) <= 6 and len(batch) == 4 * len(groups)
    for g in groups:
        assert len(set(batch.rewards[batch.group_ids == g].tolist())) == 2  # every kept group is informative
    # rows from different generation rounds were re-padded consistently: each decodes to its prompt + response
    for i in range(len(batch)):
        text = tokenizer.decode(batch.sequences[i][batch.attention_mask[i].bool()], skip_special_tokens=True)
        assert text.startswith(batch.prompts[i]) and batch.responses[i] in text[len(batch.prompts[i]) :]
        assert batch.attention_mask[i, batch.prompt_width - 1] == 1  # prompts end at the same column
    assert set(stats) == {"accuracy", "distinct_responses", "filter/pass_rate", "count/rollouts", "count/correct"}
    # the hook's counts are summed over every generation round, like `accuracy` (over everything generated)
    generated_prompts = round(len(groups) / stats["filter/pass_rate"])
    assert stats["count/rollouts"] == sum(seen) == 4 * generated_prompts
    assert stats["count/correct"] == pytest.approx(stats["accuracy"] * sum(seen))


def test_dapo_step_with_clip_higher_runs_and_logs(tokenizer):
    rows = addition_problems(40, seed=1)
    args = make_args(
        "--algo.dynamic_filtering_enable", "--reward.pm1", "--actor.eps_clip_low_high", "0.2", "0.28",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "5",
        "--train.batch_size", "4", "--reward.noise.type", "flip", "--reward.noise.rate", "0.2",
    )  # fmt: skip
    metrics = Trainer(args, tiny_model(tokenizer), tokenizer, rows, even_first_operand_always_right).step()
    assert math.isfinite(metrics["loss"]) and 0 <= metrics["clip_frac"] <= 1
    assert metrics["reward"] >= -1 and metrics["accuracy"] <= 1


# ---------------------------------------------------------------- SALT in the engine


@pytest.mark.parametrize("group_prompts", ["0", "2"])
def test_engine_salt_equals_salt_advantages_per_prompt_partition(tokenizer, group_prompts):
    """The engine hands each partition of --salt.group_prompts prompts (0 = the batch) to salt_advantages."""
    from openrlhf_geo import salt

    args = make_args(
        "--advantage_estimator", "salt", "--salt.features", "exact", "--salt.group_prompts", group_prompts
    )
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    g = torch.Generator().manual_seed(0)
    group_ids = torch.tensor([5, 5, 5, 9, 9, 9, 2, 2, 2])  # prompts in batch order: 5, 9, 2 (unique sorts them)
    batch = hand_batch(tokenizer, ["1+1="] * 9, ["1"] * 9, [0.0] * 9)
    batch.group_ids, batch.features = group_ids, torch.randn(9, 12, generator=g)
    advantages = torch.randn(9, generator=g)
    got, stats = trainer._salt(advantages, batch)
    parts = [torch.arange(9)] if group_prompts == "0" else [torch.tensor([6, 7, 8, 0, 1, 2]), torch.tensor([3, 4, 5])]
    expected = torch.empty(9)
    for rows in parts:
        expected[rows] = salt.salt_advantages(advantages[rows], batch.features[rows])[0]
    assert_close(got, expected)
    assert stats["n_eff_out"] > 0 and "alpha" in stats
    if group_prompts == "0":  # the weight diagnostics are those of the partition's own a, a', K and lengths
        from openrlhf_geo import diagnostics

        k = int(stats["k"])
        weights = engine.salt_weight_stats(
            advantages, expected, diagnostics.gram(batch.features), k, batch.mask.sum(1)
        )
        for key, value in weights.items():
            assert stats[key] == pytest.approx(value, nan_ok=True), key


def brute_weight_stats(a, new, K, k, lengths):
    """numpy float64 reading of salt_weight_stats: eigenvectors, ranks and shares computed directly."""
    from scipy.stats import rankdata

    _, vecs = np.linalg.eigh(K)
    top_vecs = vecs[:, ::-1][:, :k]
    diag_p = np.array([sum(top_vecs[i, j] ** 2 for j in range(k)) for i in range(len(a))])

    def spearman(x, y):
        return np.corrcoef(rankdata(x), rankdata(y))[0, 1]

    order = sorted(range(len(a)), key=lambda i: -K[i, i])[:k]
    moving = [i for i in range(len(a)) if a[i] != 0]
    return {
        "pk_rho_norm": spearman(diag_p, np.diag(K)),
        "pk_rho_inv_len": spearman(diag_p, 1 / lengths),
        "topnorm_share": sum(new[i] ** 2 for i in order) / sum(x**2 for x in new),
        "kept": sum(x**2 for x in new) / sum(x**2 for x in a),
        "sign_flip": sum(np.sign(new[i]) != np.sign(a[i]) for i in moving) / len(moving),
    }


@settings(max_examples=60)
@given(st.integers(3, 12), st.integers(0, 2**31 - 1), st.data())
def test_salt_weight_stats_match_a_numpy_reading(m, seed, data):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((m, 2 * m)) * rng.uniform(0.2, 3.0, size=(m, 1))  # distinct norms
    K = features @ features.T / m
    a = rng.standard_normal(m)
    a[rng.random(m) < 0.2] = 0.0
    a[0] = 1.0  # at least one nonzero advantage
    new = a + rng.standard_normal(m)
    k = data.draw(st.integers(1, m - 1))
    lengths = rng.integers(1, 40, size=m).astype(float)
    got = engine.salt_weight_stats(torch.tensor(a), torch.tensor(new), torch.tensor(K), k, torch.tensor(lengths))
    expected = brute_weight_stats(a, new, K, k, lengths)
    for key, value in expected.items():
        if key == "pk_rho_inv_len" and np.ptp(lengths) == 0:
            assert math.isnan(got[key])
        else:
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_diagonal_gram_puts_all_of_p_k_a_on_the_largest_norm_rollouts():
    """Near-orthogonal features (diagonal K): the top-k eigenvectors are the k largest-norm coordinates, so P_k a is a
    restricted to those rollouts; diag(P_k) ranks with the norms."""
    norms = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0], dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5], dtype=torch.float64)
    top = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # the 3 largest norms
    stats = engine.salt_weight_stats(a, top * a, torch.diag(norms), 3, torch.tensor([4, 20, 8, 16, 12]))
    assert stats["topnorm_share"] == pytest.approx(1.0)
    assert stats["kept"] == pytest.approx((1 + 0.25 + 0.25) / (1 + 1 + 0.25 + 4 + 0.25))
    assert stats["sign_flip"] == pytest.approx(2 / 5)  # the two dropped advantages become 0
    # diag(P_k) = [1, 0, 1, 0, 1]: ranks [4, 1.5, 4, 1.5, 4] against the norms' [5, 1, 4, 2, 3] (and 1/T's, the same)
    assert stats["pk_rho_norm"] == pytest.approx(7.5 / math.sqrt(7.5 * 10))
    assert stats["pk_rho_inv_len"] == pytest.approx(7.5 / math.sqrt(7.5 * 10))
    with pytest.raises(ValueError, match="k must be in"):
        engine.salt_weight_stats(a, a, torch.diag(norms), 0, torch.ones(5))


# ---------------------------------------------------------------- SFT warm-up


def test_sft_loss_is_cross_entropy_of_response_tokens_and_eos_only(tokenizer):
    """The first SFT loss (before any update) equals the hand-computed mean -log p over response tokens + EOS."""
    model = tiny_model(tokenizer)
    prompt, response = "37+48=", "7+8=15 carry 1, 3+4+1=8 so \\boxed{85}"
    with torch.no_grad():
        expected = -unpadded_logprobs(model, tokenizer, prompt, response).mean().item()
    losses = engine.sft(model, tokenizer, [{"prompt": prompt, "response": response}], steps=2, batch_size=1)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[1] < losses[0]  # one AdamW step on the same row lowers its loss


def test_sft_rejects_an_empty_corpus(tokenizer):
    with pytest.raises(ValueError, match="at least one"):
        engine.sft(tiny_model(tokenizer), tokenizer, [], steps=1)


@pytest.mark.parametrize("final_lr_ratio", [None, 0.05])
def test_sft_learning_rate_warms_up_then_stays_or_decays_to_the_final_ratio(tokenizer, monkeypatch, final_lr_ratio):
    recorded = []
    adamw_step = torch.optim.AdamW.step

    def record(self, *args, **kwargs):
        recorded.append(self.param_groups[0]["lr"])
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    rows = [{"prompt": "1+2=", "response": "\\boxed{3}"}]
    lr, warmup, steps = 1e-3, 4, 11
    engine.sft(tiny_model(tokenizer), tokenizer, rows, steps, 1, lr, warmup, final_lr_ratio=final_lr_ratio)
    ramp = np.minimum(1.0, (np.arange(steps) + 1) / warmup)
    if final_lr_ratio is None:
        expected = lr * ramp
    else:  # cos from 0 to pi over steps 0..10: 1 at the first step, the final ratio at the last
        angles = np.linspace(0.0, np.pi, steps)
        expected = lr * ramp * (final_lr_ratio + (1 - final_lr_ratio) * (1 + np.cos(angles)) / 2)
        assert recorded[-1] == pytest.approx(lr * final_lr_ratio)
    assert recorded == pytest.approx(expected.tolist(), rel=1e-12)
    with pytest.raises(ValueError, match="final_lr_ratio must be in"):
        engine.sft(tiny_model(tokenizer), tokenizer, rows, 1, final_lr_ratio=1.5)
