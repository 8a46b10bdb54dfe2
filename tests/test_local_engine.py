"""The local engine: masking, advantages, the clipped surrogate, one hand-checkable update, features, resume."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from openrlhf_geo.features import last_token_hidden, lm_head_features
from openrlhf_geo.lab.task import addition_problems, build_model, build_tokenizer, reference_response
from openrlhf_geo.local import engine, rundir
from openrlhf_geo.local.engine import Rollouts, Trainer
from openrlhf_geo.local.flags import parse_args
from openrlhf_geo.losses import clipped_surrogate
from openrlhf_geo.registry import ESTIMATORS


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
def test_registered_estimators_match_numpy(groups, estimator):
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float32)
    ids = torch.tensor([10 * i for i, g in enumerate(groups) for _ in g])  # non-contiguous prompt ids
    got = ESTIMATORS[estimator].advantages(rewards, ids)
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
    loss, clipped = clipped_surrogate(logprobs, old, adv, *eps)
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
                     "--rollout.temperature", "0.7", "--geoalign.enable")  # fmt: skip
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
            # GeoAlign's input: the hidden state at the response's last token (the fork's definition too)
            held = slice(len(ids), len(ids) + len(resp))
            assert_close(batch.hidden[i : i + 1], last_token_hidden(hidden[:, held], mask), rtol=1e-5, atol=1e-6)
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
    assert (
        first.pipeline.states["geoalign"].projector is not None
    )  # GeoAlign ran, so its projector is part of the state
    rundir.save_checkpoint(tmp_path, first.state_dict())
    torch.manual_seed(1234)  # a different global RNG state must not matter after loading
    resumed = Trainer(args, tiny_model(tokenizer, seed=7), tokenizer, rows, contains_five)
    resumed.load_state_dict(rundir.load_checkpoint(tmp_path)["state"])
    got = resumed.step()

    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(
        straight.pipeline.states["geoalign"].projector.parameters(),
        resumed.pipeline.states["geoalign"].projector.parameters(),
    ):
        assert torch.equal(a, b)
    timing = {k for k in expected if k.startswith("time/") or k == "geo/time_s" or k == "salt/solve_ms"}
    same = {k: v for k, v in expected.items() if k not in timing}
    assert {k: got[k] for k in same} == pytest.approx(same, nan_ok=True)


def test_select_copies_rows_with_their_content(tokenizer):
    batch = hand_batch(tokenizer, ["1+2="] * 3, ["\\boxed{3}", "4", "\\boxed{12}"], [1.0, 0.0, 1.0])
    copied = batch.select(torch.tensor([0, 0, 2]))  # DAPO's filter (and any row selection) keeps rows whole
    assert copied.responses == ["\\boxed{3}", "\\boxed{3}", "\\boxed{12}"]
    assert torch.equal(copied.sequences[1], batch.sequences[0]) and copied.rewards.tolist() == [1.0, 1.0, 1.0]
    assert copied.group_ids.tolist() == [0, 0, 0]


def test_reference_response_is_rewarded_by_math_verify():
    from openrlhf_geo.local.reward import CachedMathVerify

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


# ---------------------------------------------------------------- comparison baselines (SALT App. I, GeoAlign B.5)

BASELINE_PROMPTS = ["1+2="] * 4 + ["4+4="] * 4
BASELINE_RESPONSES = [
    "\\boxed{3}",
    "\\boxed{12}",
    "3",
    "\\boxed{3.0}",
    "\\boxed{8}",
    "\\boxed{9}",
    "\\boxed{8}",
    "\\boxed{7}",
]


def capture_advantages(trainer, run_update=False):
    """Replace (or wrap) the trainer's update to record the final per-row advantages it receives."""
    captured, update = [], trainer._update
    trainer._update = lambda batch, advantages: (
        captured.append(advantages.clone()) or (update(batch, advantages) if run_update else {})
    )
    return captured


def np_group_norm(values, groups):
    values, groups = np.asarray(values, dtype=np.float64), np.asarray(groups)
    out = np.zeros_like(values)
    for g in np.unique(groups):
        v = values[groups == g]
        out[groups == g] = (v - v.mean()) / (v.std(ddof=1) + 1e-9)
    return out


@pytest.mark.parametrize(
    "curation, expected",
    [
        # PODS m = 2 (Xu et al., arXiv 2504.13818): the max-variance pair of each prompt, the rest dropped (0)
        (["pods", "--baseline.pods_m", "2"], [-1, 0, 1, 0, 1, -1, 0, 0]),
        # PF-PPO best-vs-worst (GeoAlign App. B.5): the best and the worst of each prompt
        (["pf_ppo_bw"], [-1, 0, 1, 0, 1, -1, 0, 0]),
    ],
    ids=["pods", "pf_ppo_bw"],
)
def test_rollout_selection_baselines_drop_rollouts_from_the_group_statistics(tokenizer, curation, expected):
    args = make_args("--baseline.curation", *curation)
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    captured = capture_advantages(trainer)
    rewards = [0.1, 0.5, 0.9, 0.3, 1.0, 0.0, 0.2, 0.7]
    metrics = trainer.learn(hand_batch(tokenizer, BASELINE_PROMPTS, BASELINE_RESPONSES, rewards))
    # a kept pair (r_lo, r_hi): group-normalized to -/+ (r_hi - r_lo)/2 / (|r_hi - r_lo| / sqrt 2) = -/+ 1/sqrt 2
    assert_close(captured[0], torch.tensor(expected, dtype=torch.float32) / math.sqrt(2), rtol=1e-5, atol=1e-6)
    name = "pods" if curation[0] == "pods" else "pf_ppo"
    assert metrics[f"baseline/{name}/kept_frac"] == pytest.approx(0.5)


def test_seed_grpo_scales_group_advantages_by_the_answer_entropy(tokenizer):
    args = make_args("--baseline.seed_grpo_alpha", "0.5")
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    assert trainer.verifier is None  # a plain reward function: answer pairs are checked in this process
    captured = capture_advantages(trainer)
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    metrics = trainer.learn(hand_batch(tokenizer, BASELINE_PROMPTS, BASELINE_RESPONSES, rewards))
    # prompt 0 answers 3, 12, (none), 3.0 -> clusters {3, 3.0}, {12}, {none}; prompt 1: 8, 9, 8, 7 -> {8, 8}, {9}, {7}
    se = -np.log(np.array([2, 1, 1]) / 4).mean()  # the same for both prompts
    expected = np_group_norm(rewards, [0] * 4 + [1] * 4) * (1 - 0.5 * se / np.log(4))
    assert_close(captured[0], torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert metrics["baseline/seed_grpo/semantic_entropy"] == pytest.approx(se)
    assert metrics["baseline/answer_clusters/clusters_per_prompt"] == pytest.approx(3.0)


def test_seed_grpo_uses_the_math_rewards_worker_pool():
    from openrlhf_geo.local.reward import CachedMathVerify
    from openrlhf_geo.local.training import make_trainer

    reward = CachedMathVerify()
    args = make_args("--baseline.seed_grpo_alpha", "0.5")
    assert make_trainer(args, tiny_model(build_tokenizer()), build_tokenizer(), [], reward).verifier is reward.scorer


def test_par_shapes_rewards_against_the_initial_policys_references(tokenizer):
    """PAR (Fu et al., arXiv 2502.18770): r -> mean_m sigmoid(r - r_ref,m) before the group statistics, the M
    references sampled from the frozen initial policy for each prompt and scored by the same reward function."""
    args = make_args("--baseline.par_references", "3", "--rollout.max_new_tokens", "4", "--actor.adam.lr", "1e-2")
    calls = []

    def reward_fn(prompts, responses, answers):
        calls.append(list(prompts))
        scores = torch.tensor([0.25 * len(r) for r in responses])  # a deterministic scalar reward
        calls.append(scores)
        return scores

    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], reward_fn)
    captured = capture_advantages(trainer, run_update=True)
    rewards = [1.0, 0.0, 0.5, 2.0, 1.0, 0.0, 1.5, 0.0]
    metrics = trainer.learn(hand_batch(tokenizer, BASELINE_PROMPTS, BASELINE_RESPONSES, rewards))
    prompts, scores = calls
    assert prompts == ["1+2="] * 3 + ["4+4="] * 3  # one reference pass: M = 3 per prompt
    refs = scores.double().numpy().reshape(2, 3)
    r = np.asarray(rewards)
    shaped = np.array([(1 / (1 + np.exp(-(r[i] - refs[i // 4])))).mean() for i in range(8)])
    expected = np_group_norm(shaped, [0] * 4 + [1] * 4)
    assert_close(captured[0], torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert metrics["baseline/par/reward_mean"] == pytest.approx(shaped.mean(), rel=1e-5)
    # the references come from the initial policy: the update moved the model, not the reference
    initial = tiny_model(tokenizer)
    for (name, ref), q in zip(trainer.reference.named_parameters(), initial.parameters()):
        assert torch.equal(ref, q), name
    assert any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), initial.parameters()))


def off_policy_update(tokenizer, *flags, advantages=None):
    """One `_update` over a hand batch whose old log-probs are the current ones shifted by a fixed 0.3 sin pattern
    (so the PPO ratio moves off 1) -> (trainer, batch, old log-probs, advantages, metrics)."""
    args = make_args("--actor.max_norm", "1e9", "--actor.loss_agg_mode", "seq-mean-token-mean", *flags)
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    batch = hand_batch(tokenizer, BASELINE_PROMPTS, BASELINE_RESPONSES, [0.0] * 8)
    temperature = args.rollout.temperature
    with torch.no_grad():
        logprobs, _, _ = engine.response_forward(
            trainer.model, batch.sequences, batch.attention_mask, batch.prompt_width, temperature
        )
    shift = 0.3 * torch.sin(1.7 * torch.arange(logprobs.numel(), dtype=torch.float32)).view_as(logprobs)
    batch.old_logprobs = logprobs + shift
    if advantages is None:
        advantages = torch.tensor([1.2, -0.4, -0.9, 0.1, 0.8, -1.1, 0.3, -0.2])
    metrics = trainer._update(batch, advantages)
    return trainer, batch, batch.old_logprobs, advantages, metrics


def hand_rows(model, tokenizer, temperature=1.0):
    """Per row, the response's (log-probs (T,), logits (T, V)) of an unpadded forward, with autograd."""
    rows = []
    for prompt, response in zip(BASELINE_PROMPTS, BASELINE_RESPONSES):
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float() / temperature
        rows.append((torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1), logits))
    return rows


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_cov_policy_losses_give_the_gradient_of_a_hand_computed_loss(tokenizer, loss):
    """SALT App. I / Table 4's Clip-Cov and KL-Cov (Cui et al., arXiv 2505.22617) in `_loss_backward`: the gradient
    equals that of the loss written out by hand (covariance over the valid tokens, seq-mean-token-mean)."""
    flags = {  # Clip-Cov with ratio 1 detaches EVERY candidate (cov in [0, 1e6], not PPO-clipped): deterministic
        "clip_cov": ["--baseline.clip_cov_ratio", "1", "--baseline.clip_cov_lb", "0", "--baseline.clip_cov_ub", "1e6"],
        "kl_cov": ["--baseline.kl_cov_ratio", "0.2", "--baseline.kl_cov_coef", "0.7"],
    }[loss]
    trainer, batch, old, advantages, metrics = off_policy_update(tokenizer, "--baseline.policy_loss", loss, *flags)
    reference = tiny_model(tokenizer)
    rows = hand_rows(reference, tokenizer)
    lengths = [len(lp) for lp, _ in rows]
    lp = torch.cat([lp for lp, _ in rows])
    old_flat = torch.cat([old[i, :n] for i, n in enumerate(lengths)]).double()
    adv = torch.cat([advantages[i].repeat(n) for i, n in enumerate(lengths)]).double()
    x = lp.detach().double().numpy()
    cov = (x - x.mean()) * (adv.numpy() - adv.numpy().mean())
    ratio = torch.exp(lp.double() - old_flat)
    if loss == "kl_cov":
        k = max(1, math.floor(0.2 * len(x)))
        selected = torch.zeros(len(x), dtype=torch.bool)
        selected[np.argsort(-cov, kind="stable")[:k]] = True
        per_token = -adv * ratio + 0.7 * (lp.double() - old_flat).abs() * selected
    else:
        surrogate, clipped = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)
        ppo_clipped = (clipped > surrogate).numpy()
        selected = torch.from_numpy(~ppo_clipped & (cov >= 0))
        per_token = torch.where(selected, 0.0, torch.maximum(surrogate, clipped))
        assert 0 < int(selected.sum()) < len(x) and ppo_clipped.any()  # both kinds of token occur
        assert metrics["baseline/clip_cov/selected_frac"] == pytest.approx(float(selected.double().mean()), rel=1e-5)
        assert metrics["clip_frac"] == pytest.approx(ppo_clipped.mean(), rel=1e-5)
    loss_value = sum(part.mean() for part in per_token.split(lengths)) / len(lengths)
    loss_value.backward()
    for (name, p), q in zip(trainer.model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad.to(p.grad.dtype), rtol=1e-4, atol=1e-7, msg=name)
    assert metrics["policy_loss"] == pytest.approx(float(loss_value.detach()), rel=1e-4)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_entropy_bonus_gradient_is_minus_coef_times_the_aggregated_entropy(tokenizer, agg):
    """SALT Eq. 70-71: J + lambda * 1/G sum_i 1/|o_i| sum_t H(s_it) (seq-mean-token-mean; token-mean averages all
    tokens), H of the temperature-scaled policy; zero advantages isolate the bonus's gradient."""
    flags = ["--actor.entropy_coef", "0.5", "--rollout.temperature", "0.7", "--actor.loss_agg_mode", agg]
    args = make_args("--actor.max_norm", "1e9", *flags)
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    batch = hand_batch(tokenizer, BASELINE_PROMPTS, BASELINE_RESPONSES, [0.0] * 8)
    with torch.no_grad():
        batch.old_logprobs, _, _ = engine.response_forward(
            trainer.model, batch.sequences, batch.attention_mask, batch.prompt_width, 0.7
        )
    metrics = trainer._update(batch, torch.zeros(8))
    reference = tiny_model(tokenizer)
    entropies = []
    for _, logits in hand_rows(reference, tokenizer, temperature=0.7):
        p = torch.softmax(logits.double(), -1)
        entropies.append(-(p * torch.log(p)).sum(-1))
    if agg == "seq-mean-token-mean":
        mean_entropy = sum(h.mean() for h in entropies) / len(entropies)
    else:
        mean_entropy = torch.cat(entropies).mean()
    (-0.5 * mean_entropy).backward()
    for (name, p), q in zip(trainer.model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad.to(p.grad.dtype), rtol=1e-4, atol=1e-7, msg=name)
    mean_entropy = float(mean_entropy.detach())
    assert metrics["entropy_loss"] == pytest.approx(mean_entropy, rel=1e-5)
    assert metrics["loss"] == pytest.approx(-0.5 * mean_entropy, rel=1e-5)


def test_token_entropy_matches_numpy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    got = engine.token_entropy(logits, prompt_width=2, temperature=0.5)
    z = logits[:, 1:-1].numpy() / 0.5
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert_close(got.double(), torch.from_numpy(-(p * np.log(p)).sum(-1)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--actor.entropy_coef", "-0.1"], "--actor.entropy_coef must be >= 0"),
        (["--baseline.policy_loss", "clip_cov", "--actor.eps_clip", "1.5"], "a low PPO clip ratio <= 1 \\(got 1.5\\)"),
    ],
)
def test_bad_baseline_settings_are_rejected_before_training(tokenizer, flags, message):
    with pytest.raises(ValueError, match=message):
        Trainer(make_args(*flags), tiny_model(tokenizer), tokenizer, [], None)


def test_reward_memo_that_overflows_mid_batch_still_scores_every_rollout():
    """A batch mixing memoised and new answers, where the new ones overflow the memo (which then clears), keeps the
    memoised verdicts it already had (a long study run hit a KeyError here)."""
    from openrlhf_geo.local.reward import CachedMathVerify

    reward = CachedMathVerify(max_entries=3)
    assert reward([""] * 2, ["\\boxed{3}", "\\boxed{4}"], ["3", "3"]).tolist() == [1.0, 0.0]
    got = reward([""] * 4, ["\\boxed{3}", "\\boxed{5}", "\\boxed{6}", "\\boxed{4}"], ["3", "5", "5", "3"])
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert len(reward.cache) <= 3


def test_reward_memo_scores_each_box_and_gold_once_with_the_verdicts_of_scoring_every_response():
    """The memo's key is math_verify.prepare's (last box's content, gold LaTeX): responses that word the same answer
    differently share one math-verify call, and every verdict is the unmemoised scorer's."""
    from openrlhf_geo.local.reward import CachedMathVerify

    reward = CachedMathVerify()
    scored = []
    verdicts = reward.scorer.verdicts
    reward.scorer.verdicts = lambda responses, golds: scored.append(list(responses)) or verdicts(responses, golds)
    responses = ["so \\boxed{12}", "12 it is: \\boxed{12}", "\\boxed{13}", "\\boxed{12}", "no box", "\\boxed{12}"]
    answers = ["12", "12", "12", "\\boxed{12}", "12", "13"]
    got = reward([""] * 6, responses, answers)
    expected = [1.0 if v.correct else 0.0 for v in verdicts(responses, answers)]
    assert got.tolist() == expected == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # one call per distinct key, in first-seen order: (12, 12), (13, 12), no box, (12, 13); "\\boxed{12}" as gold is 12
    assert scored == [["so \\boxed{12}", "\\boxed{13}", "no box", "\\boxed{12}"]]
    assert reward.last_statuses == ["correct", "correct", "wrong", "correct", "no_box", "wrong"]
    assert reward(["", ""], ["again \\boxed{13}", "\\boxed{12}"], ["12", "12"]).tolist() == [0.0, 1.0]
    assert len(scored) == 1  # both keys are memoised


class ReportingReward:
    """A reward that reports math-verify verdict kinds, as train.CachedMathVerify does: prompt "bad" has no gold."""

    def __call__(self, prompts, responses, answers):
        self.last_statuses = ["bad_gold" if p == "bad" else "wrong" for p in prompts]
        return torch.zeros(len(prompts))


def test_verdict_kinds_of_the_reward_are_logged_as_shares(tokenizer):
    rows = [{"prompt": "bad", "answer": "\\frac{"}, {"prompt": "1+2=", "answer": "3"}]
    args = make_args(*("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2"))
    metrics = Trainer(args, tiny_model(tokenizer), tokenizer, rows, ReportingReward()).step()
    assert metrics["math_verify/bad_gold"] == 0.5 and metrics["math_verify/no_box"] == 0.0


def test_cached_math_verify_reports_an_unparseable_gold_as_bad_gold():
    from openrlhf_geo.local.reward import CachedMathVerify

    reward = CachedMathVerify()
    for _ in range(2):  # the second call is answered from the memo, with the same statuses
        assert reward([""] * 3, ["\\boxed{5}", "\\boxed{5}", "5"], ["\\frac{", "5", "5"]).tolist() == [0.0, 1.0, 0.0]
        assert reward.last_statuses == ["bad_gold", "correct", "no_box"]


def test_a_run_without_learning_signal_warns_with_its_numbers(tokenizer):
    """One new token per response (none ends) and a reward that pays nothing: the engine logs signal/* every step
    and warns once about each, naming the numbers and the flag to change."""
    import warnings

    from openrlhf_geo import pipeline

    rows = addition_problems(8, seed=0)
    args = make_args(
        *("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "1")
    )
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, rows, lambda p, r, a: torch.zeros(len(r)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = [trainer.step() for _ in range(pipeline.SIGNAL_FLAT_STEPS + 1)]
    assert all(m["signal/tied_groups"] == 1.0 and m["signal/truncated"] >= 0.5 for m in metrics)
    found = [str(w.message) for w in caught if issubclass(w.category, pipeline.LearningSignalWarning)]
    assert len(found) == 2 and "hit the length limit (1 new tokens)" in found[0]
    assert found[1].startswith(f"steps 1-{pipeline.SIGNAL_FLAT_STEPS}: every prompt's rollouts got the same reward")


def _optimizer_step_rows(tokenizer, *flags, n_prompts=4):
    """Run one learn() step on `n_prompts` prompts x 3 rollouts; -> the set of batch rows each AdamW step trained on,
    and the batch's group ids."""
    prompts = [p for p in ("1+2=", "4+4=", "2+5=", "3+3=")[:n_prompts] for _ in range(3)]
    responses = (["\\boxed{3}", "1", "\\boxed{12}", "\\boxed{8}", "8", "\\boxed{9}"] * 2)[: len(prompts)]
    rewards = ([1.0, 0.0, 0.0, 1.0, 1.0, 0.0] * 2)[: len(prompts)]
    args = make_args("--rollout.n_samples_per_prompt", "3", "--train.micro_batch_size", "2", *flags)
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    steps, rows = [], []
    backward, step = trainer._loss_backward, trainer.optimizer.step

    def record_backward(batch, advantages, part, *rest):
        rows.extend(part.tolist())
        return backward(batch, advantages, part, *rest)

    def record_step(*a, **k):
        steps.append(frozenset(rows))
        rows.clear()
        return step(*a, **k)

    trainer._loss_backward, trainer.optimizer.step = record_backward, record_step
    batch = hand_batch(tokenizer, prompts, responses, rewards)
    trainer.learn(batch)
    return steps, batch.group_ids


@pytest.mark.parametrize("flags", [["--advantage_estimator", "salt"], ["--salt.diagnostics"]])
def test_each_adamw_step_trains_on_exactly_one_salt_partition(tokenizer, flags):
    """SALT §3.1: the geometry of "the current mini-batch": mini-batch = partition (2 prompts x G = 3 rollouts),
    over two epochs; the partitions' order and the rows inside them are reshuffled, never their membership."""
    steps, group_ids = _optimizer_step_rows(
        tokenizer, *flags, "--salt.features", "exact", "--train.batch_size", "6", "--train.max_epochs", "2"
    )
    _, prompt = torch.unique(group_ids, return_inverse=True)
    partitions = {frozenset(torch.nonzero(prompt // 2 == p)[:, 0].tolist()) for p in range(2)}
    assert len(steps) == 4 and set(steps) == partitions


def test_a_short_last_salt_partition_is_its_own_adamw_step(tokenizer):
    """3 prompts x G = 3 with 2 prompts per partition (a rollout batch of 3 prompts, or DAPO's filter leaving 3): the
    partitions are 6 and 3 rollouts, and every AdamW step still trains on exactly one of them, whatever their order."""
    flags = ["--advantage_estimator", "salt", "--salt.features", "exact", "--train.batch_size", "6"]
    steps, group_ids = _optimizer_step_rows(tokenizer, *flags, "--train.max_epochs", "4", n_prompts=3)
    _, prompt = torch.unique(group_ids, return_inverse=True)
    partitions = {frozenset(torch.nonzero(prompt // 2 == p)[:, 0].tolist()) for p in range(2)}
    assert len(steps) == 8 and set(steps) == partitions


def test_salt_refuses_a_train_batch_size_that_cuts_a_prompts_rollouts():
    """A SALT partition is whole prompts, by default one optimizer step's: --train.batch_size must be a multiple of G
    (both engines: options.validate), unless --salt.group_prompts sizes the partitions itself."""
    flags = ["--rollout.n_samples_per_prompt", "4", "--train.batch_size", "6"]
    for method in (["--advantage_estimator", "salt"], ["--salt.diagnostics"]):
        with pytest.raises(
            ValueError, match=r"--train.batch_size 6 is not a multiple of .* use --train.batch_size 4 or 8"
        ):
            make_args(*method, *flags)
    make_args("--advantage_estimator", "salt", "--salt.group_prompts", "1", *flags)
    make_args(*flags)  # without SALT nothing is partitioned


def test_shuffle_minibatches_mixes_partitions_as_before(tokenizer):
    flags = ["--advantage_estimator", "salt", "--salt.features", "exact", "--salt.shuffle_minibatches"]
    steps, group_ids = _optimizer_step_rows(tokenizer, *flags, "--train.batch_size", "6", "--train.max_epochs", "2")
    _, prompt = torch.unique(group_ids, return_inverse=True)
    assert len(steps) == 4 and any(len({int(prompt[r]) // 2 for r in rows}) > 1 for rows in steps)


def test_advantages_are_clamped_to_the_reward_clip_range_as_upstream_does(tokenizer):
    """Upstream's compute_reward clamps each rollout's sequence advantage to --reward.clip_range; the engine too."""
    prompts, responses = ["1+2="] * 4, ["\\boxed{3}", "1", "2", "4"]
    rewards = [1.0, 0.0, 0.0, 0.0]  # group-normalized: 1.5 for the right answer, -0.5 for the others
    args = make_args("--rollout.n_samples_per_prompt", "4", "--reward.clip_range", "-0.25", "1.0")
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, [], None)
    seen = []
    update = trainer._update
    trainer._update = lambda batch, advantages: seen.append(advantages.clone()) or update(batch, advantages)
    trainer.learn(hand_batch(tokenizer, prompts, responses, rewards))
    assert_close(seen[0].cpu(), torch.tensor([1.0, -0.25, -0.25, -0.25]))


def test_a_reversed_reward_clip_range_is_one_line():
    with pytest.raises(ValueError, match="--reward.clip_range must be LOW HIGH"):
        make_args("--reward.clip_range", "1", "-1")


def opposite_huge_rewards(prompts, responses, answers):
    """±3e38: in the fork, upstream's float32 group std of these is inf, every advantage 0 and the loss exactly 0."""
    return torch.tensor([3e38 if i % 2 else -3e38 for i in range(len(responses))])


def test_rewards_that_overflow_float32_group_statistics_are_refused_naming_the_source(tokenizer):
    args = make_args(
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "4"
    )
    trainer = Trainer(args, tiny_model(tokenizer), tokenizer, addition_problems(8, seed=0), opposite_huge_rewards)
    with pytest.raises(
        ValueError, match=r"^step 1: --reward.func \S+ gave rollout 0 \(prompt \d+\) the reward -3e\+38;"
    ):
        trainer.step()


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 64).flatmap(lambda n: st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n)))
def test_rewards_up_to_the_limit_keep_upstreams_float32_group_statistics_finite(signs):
    """Upstream's group_norm in float32 (the fork's path) stays finite for any rewards check_reward_scale lets by."""
    from openrlhf_geo.estimators import check_reward_scale, reward_limit

    n, limit = len(signs), reward_limit(len(signs))
    rewards = torch.tensor(signs, dtype=torch.float64) * limit
    check_reward_scale(rewards, torch.zeros(n, dtype=torch.long), 1, "test")  # at the limit: accepted
    r = rewards.float().view(1, -1)
    std = r.std(-1, keepdim=True)
    assert bool(torch.isfinite(std).all())
    advantages = (r - r.mean(-1, keepdim=True)) / (std + 1e-9)
    assert bool(torch.isfinite(advantages).all()) and (len(set(signs)) == 1 or bool(advantages.abs().max() > 0.1))
    with pytest.raises(ValueError, match=r"rewards lie beyond"):
        check_reward_scale(rewards * 1.001, torch.zeros(n, dtype=torch.long), 1, "test")


def test_both_counts_of_rollouts_without_action_tokens_reach_the_local_engines_metrics(tokenizer):
    """The local engine hands the pipeline each rollout's action tokens (its response mask): a rollout whose mask
    is empty is counted by SALT and GeoAlign (their tests: test_salt_stage.py, test_geoalign.py)."""
    flags = ["--advantage_estimator", "salt", "--salt.features", "exact", "--geoalign.enable"]
    flags += ["--geoalign.projector.steps", "3", "--geoalign.projector.hidden_sizes", "16"]
    trainer = Trainer(make_args(*flags), tiny_model(tokenizer), tokenizer, [], None)
    captured = capture_advantages(trainer)
    batch = hand_batch(tokenizer, BASELINE_PROMPTS, BASELINE_RESPONSES, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    batch.mask[2] = False
    metrics = trainer.learn(batch)
    assert metrics["salt/zero_action_rollouts"] == 1.0 and metrics["geo/zero_action_rollouts"] == 1.0
    assert metrics["salt/m"] == 7.0 and len(captured[0]) == 8
