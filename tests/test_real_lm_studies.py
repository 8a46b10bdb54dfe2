"""The real-LM task and studies' machinery (local.word_task, studies.real_lm and the real-lm-* studies): each piece
against an independent direct computation, on a tiny random Llama (the studies' real SmolLM2 runs are the studies)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from openrlhf_geo.lab import word_task
from openrlhf_geo.lab.studies import real_lm, real_lm_geoalign, real_lm_geometry, real_lm_proxy, real_lm_rl

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "studies" / "results"


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                         eos_token_id=2, pad_token_id=2, bos_token_id=1, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _rollouts(seed=0, prompts=3, samples=4):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(3, 61, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(prompts)]  # fmt: skip
    response_ids = []
    for i in range(prompts * samples):
        n = int(torch.randint(1, 13, (1,), generator=g))
        ids = torch.randint(3, 61, (n,), generator=g).tolist()
        response_ids.append(ids + [2] if i % 3 else ids)  # some end with EOS, some run to the limit
    return prompt_ids, response_ids


# ---------------------------------------------------------------- the task


def test_word_problems_are_distinct_correct_and_never_the_demonstrations():
    rows = word_task.word_problems(300, 5)
    assert len({q for q, _ in rows}) == 300
    for q, a in rows:
        x, y = (int(w) for w in q.split() if w.isdigit())
        assert int(a) == x + y and (x, y) != word_task.DEMO_OPERANDS
        assert word_task.LOW <= x <= word_task.HIGH and word_task.LOW <= y <= word_task.HIGH
    held = word_task.word_problems(50, 6, exclude={q for q, _ in rows})
    assert not {q for q, _ in held} & {q for q, _ in rows}


def test_the_prompt_is_the_chat_template_over_instruction_demonstration_and_question():
    class Template:  # records the messages; the real template is exercised by tests/test_real_lm.py
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return messages

    messages = word_task.chat_prompt(Template(), "Q?")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == "Q?" and "\\boxed{15}" in messages[2]["content"]


def test_math_verify_pays_the_demonstrations_answer_format():
    from openrlhf_geo.local.reward import CachedMathVerify

    verify = CachedMathVerify()
    demo = word_task.DEMONSTRATION[1]
    assert verify(["", ""], [demo, demo.replace("{15}", "{16}")], ["15", "15"]).tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- studies.real_lm


def test_segments_tile_the_caps_and_cap_mask_keeps_the_first_tokens():
    assert real_lm._segments((32, 64, 128)) == [(0, 32), (32, 64), (64, 128)]
    mask = real_lm.cap_mask(torch.tensor([3, 10, 0]), 5, 8)
    assert mask.sum(1).tolist() == [3, 5, 0] and mask[1, :5].all() and not mask[1, 5:].any()


def _shared_prefix_rollouts():
    """Prompts with a common prefix (one of them one token longer than it, two identical), an empty response."""
    prompt_ids, response_ids = _rollouts(seed=1)
    common = [5, 9, 14, 3, 27, 8]
    prompt_ids = [common + prompt_ids[0], common + [40], common + prompt_ids[0]]
    response_ids[5] = []
    return prompt_ids, response_ids


@pytest.fixture(scope="module")
def tiny_windowed():
    """A tiny Mistral whose sliding window (4 tokens) is shorter than its sequences."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                           tie_word_embeddings=True, eos_token_id=2, pad_token_id=2, bos_token_id=1,
                           max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize(("model", "shared_prefix"), [("tiny_llama", False), ("tiny_llama", True),
                                                      ("tiny_windowed", True)])  # fmt: skip
def test_forward_geometry_equals_a_direct_forward_of_each_cut_rollout(request, model, shared_prefix, monkeypatch):
    """The prompts' common prefix run once, a prompt's samples packed into one sequence with the prompt (no padding;
    at most PACKED_TOKENS response tokens a forward; one sample a forward under a sliding window, which a packed
    mask would lose) and each token sketched once per segment == one forward per rollout cut at the cap, through
    `features.response_geometry` as the engines call it. An empty response (none is sampled with max_new_tokens
    >= 1) has a zero feature and the hidden state of an EOS after its prompt."""
    from openrlhf_geo.features import GeometrySpec, lm_head_input, response_geometry
    from openrlhf_geo.salt import SaltConfig

    lm = request.getfixturevalue(model)
    prompt_ids, response_ids = _shared_prefix_rollouts() if shared_prefix else _rollouts()
    if shared_prefix:
        monkeypatch.setattr(real_lm, "PACKED_TOKENS", 10)  # some micro-batches end at the token budget
        assert real_lm._shared_prefix(prompt_ids) == 6
    caps, temperature = (4, 8, 13), 0.7
    fast = real_lm.forward_geometry(lm, prompt_ids, response_ids, 4, caps, temperature, micro_batch=3)
    config = SaltConfig()
    spec = GeometrySpec(features=config.features, dim=config.dim, seed=config.seed, hidden=True)
    for cap in caps:
        feats, hidden = [], []
        for i, response in enumerate(response_ids):
            prompt, y = prompt_ids[i // 4], response[:cap]
            if not y:
                width = min(config.dim, lm.config.vocab_size * lm.config.hidden_size)  # V·d <= D: exact
                feats.append(torch.zeros(width, dtype=torch.float64))
                with torch.no_grad():
                    out = lm(input_ids=torch.tensor([prompt + [2]]), output_hidden_states=True)
                hidden.append(out.hidden_states[-1][0, -1])
                continue
            seq = torch.tensor([prompt + y])
            with torch.no_grad(), lm_head_input(lm) as captured:
                logits = lm(input_ids=seq).logits
            producing = torch.zeros_like(seq, dtype=torch.bool)
            producing[:, len(prompt) - 1 : len(prompt) - 1 + len(y)] = True
            response_mask = producing.roll(1, dims=1)
            geo = response_geometry(spec, logits / temperature, captured.hidden, seq.roll(-1, 1), producing,
                                    response_mask, temperature)  # fmt: skip
            feats.append(geo["features"][0].double())
            hidden.append(geo["hidden"][0])
        F = torch.stack(feats)
        torch.testing.assert_close(fast[cap]["gram"], F @ F.T, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(fast[cap]["hidden"], torch.stack(hidden), rtol=1e-4, atol=1e-5)
        assert fast[cap]["lengths"].tolist() == [min(len(r), cap) for r in response_ids]


def test_forward_geometry_runs_the_lm_head_once_per_response_token_and_the_body_once_per_token(tiny_llama):
    """No padding and no prompt logits are computed: the body sees the common prefix once, then each prompt's rest
    and its samples' tokens; the LM head only the positions that produce a response token (and the prefix's last)."""
    prompt_ids, response_ids = _shared_prefix_rollouts()
    response_ids[5] = [7]
    seen = {"body": 0, "head": 0}

    def count(part):
        return lambda module, args, out: seen.__setitem__(part, seen[part] + args[0].shape[:2].numel())

    hooks = [tiny_llama.model.embed_tokens.register_forward_hook(count("body")),
             tiny_llama.lm_head.register_forward_hook(count("head"))]  # fmt: skip
    try:
        real_lm.forward_geometry(tiny_llama, prompt_ids, response_ids, 4, (13,), 0.7)
    finally:
        for hook in hooks:
            hook.remove()
    tokens = sum(map(len, response_ids))
    assert seen["head"] == tokens + 1
    assert seen["body"] == 6 + sum(len(p) - 6 for p in prompt_ids) + tokens


def test_hf_sampling_runs_the_common_prefix_once_and_samples_the_same_tokens(tiny_llama):
    """`_sample_hf` starts each prompt's `generate` from the common prefix's KV cache: the rollouts of the seeded
    sampler are those of `generate` on the whole prompts, and the prefix is embedded once, not once per sample."""
    from transformers import GenerationConfig

    prompt_ids, _ = _shared_prefix_rollouts()
    collection = real_lm.Collection(prompts=3, samples=4, temperature=0.7, max_tokens=6, caps=(6,), generator="hf")
    embedded = []
    hook = tiny_llama.model.embed_tokens.register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    try:
        rollouts = real_lm._sample_hf(None, prompt_ids, collection, model=tiny_llama)
        with_prefix, embedded[:] = sum(embedded), []
        torch.manual_seed(collection.seed)
        config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=6,
                                  eos_token_id=2, pad_token_id=2)  # fmt: skip
        whole = []
        for ids in prompt_ids:
            x = torch.tensor([ids] * 4)
            with torch.no_grad():
                seq = tiny_llama.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config)
            whole += [row[: row.index(2) + 1] if 2 in row else row for row in seq[:, len(ids) :].tolist()]
    finally:
        hook.remove()
    assert rollouts == whole
    assert with_prefix == sum(embedded) - 3 * 4 * 6 + 6  # the 6-token prefix: once instead of 12 times
    assert real_lm._sample_hf(None, [], collection, model=tiny_llama) == []


def test_collection_key_changes_with_every_setting():
    base = real_lm.Collection()
    keys = {real_lm.Collection(**{**base.__dict__, **change}).key("/nonexistent") for change in
            ({}, {"prompts": 32}, {"samples": 8}, {"temperature": 1.0}, {"seed": 1}, {"generator": "hf"},
             {"max_tokens": 128, "caps": (32, 128)}, {"problem_offset": 64})}  # fmt: skip
    assert len(keys) == 8
    with pytest.raises(ValueError, match="caps must be increasing and end at max_tokens"):
        real_lm.Collection(caps=(32, 64))
    with pytest.raises(ValueError, match="generator must be vllm or hf"):
        real_lm.Collection(generator="sglang")


def test_vllm_missing_is_one_line_naming_the_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    with pytest.raises(RuntimeError, match=r"setup_cpu\.sh engines.*--generator hf"):
        real_lm._sample_vllm("/m", [[1, 2]], real_lm.Collection(), 2, tmp_path)


def test_a_collection_with_committed_rollouts_is_computed_from_them_not_sampled(tmp_path, monkeypatch):
    """collect: a collection whose key ROLLOUTS_DIR holds (a committed study's rollouts) is scored and run through
    the forward from those token ids, nothing sampled, to the same numbers; a file whose prompts are not the task's
    as the tokenizer reads them is refused. On the real LM, 2 prompts x 2 samples of 8 tokens."""
    collection = real_lm.Collection(prompts=2, samples=2, max_tokens=8, caps=(4, 8), generator="hf")
    sampled = real_lm.collect(collection, tmp_path / "cache", log=lambda *a: None)
    path = real_lm.write_rollouts(sampled, tmp_path / "study")
    assert sampled["rollouts"] == "sampled" and path.name == f"{sampled['key']}.npz"

    def no_sampling(*a, **k):
        raise AssertionError("sampled")

    monkeypatch.setattr(real_lm, "ROLLOUTS_DIR", path.parent)
    monkeypatch.setattr(real_lm, "_sample_hf", no_sampling)
    monkeypatch.setattr(real_lm, "_sample_vllm", no_sampling)
    again = real_lm.collect(collection, tmp_path / "fresh", log=lambda *a: None)
    assert again["rollouts"] == "committed" and again["response_ids"] == sampled["response_ids"]
    for cap in collection.caps:
        assert torch.equal(again["rewards"][cap], sampled["rewards"][cap])
        for name in ("gram", "hidden", "lengths"):
            assert torch.equal(again["geometry"][cap][name], sampled["geometry"][cap][name]), (cap, name)
    prompts, responses, meta = real_lm.load_rollouts(path)
    real_lm.save_rollouts(path, [prompts[0][:-1], prompts[1]], responses, meta)
    with pytest.raises(ValueError, match="its prompts are not the task's prompts as this tokenizer reads them"):
        real_lm.collect(collection, tmp_path / "tampered", log=lambda *a: None)


def test_the_committed_rollouts_are_the_committed_studies_collections():
    """ROLLOUTS_DIR holds one file per collection of the committed real-lm-geometry run (real-lm-geoalign reads its
    T = 0.6 one) under the key `collect` looks for: 64 prompts x 16 samples of at most 256 tokens, the task's prompts
    (examples/data/word_problems.jsonl's, as text), and the key the committed real-lm-geoalign summary names."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_lm.model_dir())
    committed = json.loads((COMMITTED / "real-lm-geoalign" / "summary.json").read_text())["setup"]["collection"]
    examples = COMMITTED.parents[2] / "examples" / "data"
    shipped = [json.loads(line) for line in (examples / "word_problems.jsonl").open()]
    keys = set()
    for T, collection in real_lm_geometry.study_collections(real_lm_geometry.FULL).items():
        key = collection.key(real_lm.model_dir())
        prompts, responses, meta = real_lm.load_rollouts(real_lm.ROLLOUTS_DIR / f"{key}.npz")
        assert meta["key"] == key and meta["collection"]["temperature"] == T
        assert prompts == [tokenizer(word_task.chat_prompt(tokenizer, q)).input_ids
                           for q, _ in real_lm.problems(collection)]  # fmt: skip
        assert prompts == [tokenizer(row["prompt"]).input_ids for row in shipped]  # what `inspect --rollouts` reads
        assert len(responses) == 64 * 16 and max(map(len, responses)) <= 256
        keys.add(key)
    assert committed in keys and {p.stem for p in real_lm.ROLLOUTS_DIR.glob("*.npz")} == keys


# ---------------------------------------------------------------- real-lm-geometry


@given(st.sampled_from([4, 8, 16]))
def test_replicates_partition_the_collection_into_disjoint_prompt_grouped_batches(G):
    batches = real_lm_geometry.replicates(64, 16, G, 256)
    assert len(batches) == 4 and all(len(b) == 256 for b in batches)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(64 * 16))
    for b in batches:  # consecutive blocks of G rows share one prompt
        prompts = b // 16
        assert (prompts.reshape(-1, G) == prompts.reshape(-1, G)[:, :1]).all()


@given(st.integers(2, 12), st.integers(1, 30), st.integers(0, 2**16))
def test_salt_on_the_gram_factor_equals_salt_on_the_features(m, dim, seed):
    from openrlhf_geo.salt import salt_advantages

    g = torch.Generator().manual_seed(seed)
    features = torch.randn(m, dim, generator=g, dtype=torch.float64)
    a = torch.randn(m, generator=g, dtype=torch.float64)
    factor = real_lm_geometry.gram_factor(features @ features.T)
    torch.testing.assert_close(factor @ factor.T, features @ features.T, rtol=1e-9, atol=1e-9)
    new_f, stats_f = salt_advantages(a, features)
    new_k, stats_k = salt_advantages(a, factor)
    assert stats_f["k"] == stats_k["k"]
    if stats_f["gap"] > 1e-6:  # P_k unique: the same projector, so the same a'
        torch.testing.assert_close(new_k, new_f, rtol=1e-6, atol=1e-8)
    for key in ("pr", "n_eff_in", "alpha"):
        assert math.isclose(stats_f[key], stats_k[key], rel_tol=1e-7, abs_tol=1e-9)


def test_analyse_batch_measures_grpo_cancellation_and_leaves_tied_batches_undefined():
    from openrlhf_geo import diagnostics
    from openrlhf_geo.estimators import group_norm

    g = torch.Generator().manual_seed(3)
    features = torch.randn(16, 40, generator=g, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1])
    lengths = torch.randint(5, 30, (16,), generator=g)
    record = real_lm_geometry.analyse_batch(rewards, features @ features.T, lengths, 4)
    a = group_norm(rewards.double(), torch.arange(16) // 4)
    direct = diagnostics.effective_sample_size(a, diagnostics.gram(features), 0.0)
    assert math.isclose(record["n_eff"], direct, rel_tol=1e-6) and record["signal"] == 1.0
    assert record["mixed"] == 0.75 and record["accuracy"] == rewards.mean().item()
    tied = real_lm_geometry.analyse_batch(torch.ones(16), features @ features.T, lengths, 4)
    assert tied["signal"] == 0.0 and math.isnan(tied["n_eff"]) and math.isnan(tied["alpha"])


def test_regime_rule_reads_the_ci_of_n_eff():
    rule = real_lm_geometry.regime
    assert rule({"n": 4, "low": 0.2, "high": 0.9}).startswith("in SALT's regime")
    assert rule({"n": 4, "low": 1.1, "high": 1.9}).startswith("outside")
    assert rule({"n": 4, "low": 0.8, "high": 1.2}).startswith("not decided")
    assert rule({"n": 1, "low": math.nan, "high": math.nan}).startswith("no verdict")


# ---------------------------------------------------------------- real-lm-geoalign


def test_raw_spread_is_one_when_every_winner_sits_on_one_side():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 1e-9], [2.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = real_lm_geoalign.raw_spread(hidden, rewards, torch.tensor([0, 0, 1, 1]))
    assert out["raw_cos_gt_0.8"] == 1.0 and math.isclose(out["raw_consensus"], 1.0, rel_tol=1e-6)


def test_pair_count_is_the_number_of_same_prompt_rollouts_with_another_reward():
    rewards, groups = torch.tensor([1.0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 0, 1, 1, 1])
    assert real_lm_geoalign.pair_count(rewards, groups).tolist() == [2, 1, 1, 0, 0, 0]


def test_geoalign_analysis_reports_detection_against_the_reward_only_score():
    g = torch.Generator().manual_seed(0)
    groups = torch.arange(64) // 16
    rewards = (torch.rand(64, generator=g) < 0.5).float()
    hidden = torch.randn(64, 24, generator=g) + rewards[:, None] * torch.linspace(0, 2, 24)  # a reward direction
    rec = real_lm_geoalign.analyse_batch(hidden, rewards, groups, 0.1, torch.Generator().manual_seed(1))
    assert rec["corrupted"] > 0 and 0 <= rec["auroc"] <= 1 and 0 <= rec["pair_count_auroc"] <= 1
    assert math.isclose(rec["auroc_gain"], rec["auroc"] - rec["pair_count_auroc"])
    clean = real_lm_geoalign.analyse_batch(hidden, rewards, groups, 0.0, None)
    assert "auroc" not in clean and 0 <= clean["val_acc"] <= 1


# ---------------------------------------------------------------- real-lm-proxy


def test_countsketched_gradient_grams_are_unbiased_within_their_stated_error(tiny_llama):
    """The reference Gram: CountSketched per-sample gradients against the exact gradients of the same objective."""
    prompt_ids, response_ids = _rollouts(1, prompts=2, samples=3)
    model = tiny_llama.train(False)
    rows = list(range(6))
    dim = 1 << 14
    tables = real_lm_proxy.countsketch_tables(model, dim, 0)
    sketches, norms, whole = real_lm_proxy.sketched_gradients(model, prompt_ids, response_ids, rows, 3, 0.8, tables)
    exact = []
    for i in rows:
        model.zero_grad(set_to_none=True)
        real_lm_proxy.response_objective(model, prompt_ids[i // 3], response_ids[i], 0.8).backward()
        exact.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    E = torch.stack(exact)
    K, R = E @ E.T, (sketches["full"] @ sketches["full"].T).double()
    torch.testing.assert_close(norms["full"], K.diagonal(), rtol=1e-4, atol=0)
    bound = (2 * K.diagonal()[:, None] * K.diagonal()[None, :] / dim).sqrt()  # sd of a CountSketch inner product
    assert bool(((R - K).abs() <= 6 * bound + 1e-9).all())
    torch.testing.assert_close(torch.stack(whole)[:, :10].double(), E[: real_lm_proxy.EXACT_PAIRS, :10])
    assert sketches["last_block"].abs().sum() > 0 and norms["first_block"].gt(0).all()


def test_the_exact_proxy_gram_is_eq19s_lm_head_gradient_gram(tiny_llama):
    """`proxy_grams`' exact Gram == the Gram of vec ∇_W ℓ_i computed by autograd on the LM head (tied: the output
    projection's use only, through a detached copy)."""
    prompt_ids, response_ids = _rollouts(2, prompts=2, samples=2)
    model, temperature = tiny_llama, 0.7
    exact, kron = real_lm_proxy.proxy_grams(model, prompt_ids, response_ids, [0, 1, 2, 3], 2, temperature)
    grads = []
    for i in range(4):
        prompt, y = prompt_ids[i // 2], response_ids[i]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt + y]), output_hidden_states=True)
        h = out.hidden_states[-1][0, len(prompt) - 1 : len(prompt) - 1 + len(y)]
        W = model.get_output_embeddings().weight.detach().clone().requires_grad_(True)
        logp = torch.log_softmax((h @ W.T) / temperature, -1).gather(-1, torch.tensor(y)[:, None]).mean()
        (grad,) = torch.autograd.grad(logp, W)
        grads.append(grad.reshape(-1).double())
    G = torch.stack(grads)
    torch.testing.assert_close(exact, G @ G.T, rtol=1e-4, atol=1e-8)
    assert kron.shape == (4, 4) and bool(torch.isfinite(kron).all())


def test_the_noise_null_is_the_gram_of_gaussian_rows():
    G = real_lm_proxy.wishart_gram(6, 10_000, 0)
    assert G.shape == (6, 6) and torch.allclose(G, G.T)
    assert float((G.diagonal() / 10_000 - 1).abs().max()) < 0.1
    assert float((G / 10_000 - torch.eye(6, dtype=G.dtype)).abs().max()) < 0.1


PROXY_RESULTS = COMMITTED / "real-lm-proxy"


def _resummarized(tmp_path, files=("block0.json",)):
    """The committed real-lm-proxy outputs `files` copied to a directory, re-summarized there by the CLI."""
    from openrlhf_geo import cli

    out = tmp_path / "proxy"
    out.mkdir(parents=True)
    for name in files:
        (out / name).write_bytes((PROXY_RESULTS / name).read_bytes())
    assert cli.main(["study", "real-lm-proxy", "--resummarize", str(out)]) == 0
    return out, json.loads((out / "summary.json").read_text())


def test_resummarizing_the_committed_block_reproduces_the_committed_results(tmp_path):
    """Third amendment, item 1: the committed block0.json (split at m = 32, its batches named "m64-s") re-derived by
    the current code: rows keyed m32, the first run's numbers unchanged, and the committed summary and report are
    exactly what the code writes from it. Bit for bit on any CPU: the summary is means, fixed-order sums and scipy's
    percentile bootstrap of the recorded floats, no BLAS (the same bytes with numpy's AVX dispatch and OpenBLAS's
    kernels switched off)."""
    out, summary = _resummarized(tmp_path, ("block0.json", "summary.json"))
    assert (out / "summary.json").read_text() == (PROXY_RESULTS / "summary.json").read_text()
    assert (out / "report.md").read_text() == (PROXY_RESULTS / "report.md").read_text()
    assert (out / "block0.json").read_bytes() == (PROXY_RESULTS / "block0.json").read_bytes()
    # the first run's summary (rows keyed m64, holding m = 32): its numbers, now under m32
    table, versus = summary["table"], summary["versus_nulls"]
    assert {name.split(" ")[0] for name in table} == {"m256", "m32"}
    assert table["m32 exact/full"]["batches"] == 8 and table["m256 exact/full"]["batches"] == 1
    assert table["m32 exact/full"]["rho"]["mean"] == 0.6348832634246695
    assert table["m32 exact/full"]["subspace"]["mean"] == 0.7886731167776111
    assert table["m32 exact/full"]["subspace"]["low"] == 0.7359849428838102
    assert versus["m32 exact/full - noise a_cos"] == {"gain": -0.014508726903176589, "low": -0.06460621126913471,
                                                      "high": 0.040011427449455, "n": 8}  # fmt: skip
    assert [v["failed"] for v in summary["verdicts"].values()] == [["(A) a_cos vs noise null",
                                                                    "(A) k_match vs noise null"]] * 3  # fmt: skip
    setup = summary["setup"]
    assert (setup["block_m"], setup["split_m"], setup["wall_s"]) == (256, 32, 7427.239318746)
    assert "Verdicts at m = 32" in (out / "report.md").read_text()
    # without the run's summary.json: the same numbers, the setup from the blocks
    alone_out, alone = _resummarized(tmp_path / "alone")
    assert alone["table"] == table and alone["gaps"] == summary["gaps"] and "wall_s" not in alone["setup"]
    assert "Wall time not recorded" in (alone_out / "report.md").read_text()


RESULTS = PROXY_RESULTS.parent
# what each real-LM study's result directory holds besides summary.json and report.md: what --resummarize reads
RECORDS = {
    "real-lm-proxy": ("block0.json",),
    "real-lm-geometry": ("records.json",),
    "real-lm-geoalign": ("records.json",),
    "real-lm-rl": tuple(f"{name}.metrics.jsonl" for name in real_lm_rl.CONDITIONS),
}


def _committed_copy(tmp_path, name):
    """The committed result files of study `name` (records and summary) in a fresh directory."""
    out = tmp_path / name
    out.mkdir()
    for file in (*RECORDS[name], "summary.json"):
        (out / file).write_bytes((RESULTS / name / file).read_bytes())
    return out


def test_every_real_lm_study_takes_resummarize():
    from openrlhf_geo.lab.studies.registry import REGISTRY

    assert {name for name in REGISTRY if name.startswith("real-lm")} == set(RECORDS)
    assert all("resummarize" in REGISTRY[name].options for name in RECORDS)


@pytest.mark.parametrize("name", ["real-lm-geometry", "real-lm-rl"])
def test_resummarizing_the_committed_records_rewrites_the_committed_summary_byte_for_byte(name, tmp_path):
    """Their summaries are sorting, numpy's elementwise arithmetic and fixed-order sums and scipy's percentile
    bootstrap (real-lm-rl: copies of the logged values): no BLAS reduction, nothing that depends on the CPU, so the
    committed bytes are what any machine writes. real-lm-geometry keeps its CIs over prompts from summary.json and
    re-derives everything else, its verdicts included, from records.json."""
    from openrlhf_geo import cli

    out = _committed_copy(tmp_path, name)
    assert cli.main(["study", name, "--resummarize", str(out)]) == 0
    for file in ("summary.json", "report.md", *RECORDS[name]):
        assert (out / file).read_bytes() == (RESULTS / name / file).read_bytes(), file
    if name == "real-lm-geometry":
        assert (out / "geometry_by_cap.png").stat().st_size > 0


def _assert_close_json(got, want, path="summary"):
    """Equal structure, strings and integers; floats within rel 1e-10 / abs 1e-12 (null for NaN on both sides)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for key in want:
            _assert_close_json(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (x, y) in enumerate(zip(got, want)):
            _assert_close_json(x, y, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-10, abs_tol=1e-12), path
    else:
        assert got == want, path


def test_resummarizing_the_committed_geoalign_records_rewrites_its_summary(tmp_path):
    """records.json keeps NaN as null (strict_json): read back as NaN, the summary is re-derived. Its prompt CIs are
    ratios of BLAS dot products (weighted counts over at most a few thousand rollouts, whose summation order the CPU's
    kernel chooses: relative error below ~1e-13), so the numbers are compared within 1e-10 and the report is checked
    as the render of the committed summary."""
    from openrlhf_geo import cli

    out = _committed_copy(tmp_path, "real-lm-geoalign")
    committed = RESULTS / "real-lm-geoalign"
    assert cli.main(["study", "real-lm-geoalign", "--resummarize", str(out)]) == 0
    _assert_close_json(
        json.loads((out / "summary.json").read_text()), json.loads((committed / "summary.json").read_text())
    )
    assert (
        real_lm_geoalign.render(json.loads((committed / "summary.json").read_text()))
        == (committed / "report.md").read_text()
    )
    assert "## Verdicts, amended" in (out / "report.md").read_text()
    assert (out / "records.json").read_bytes() == (committed / "records.json").read_bytes()


@pytest.mark.parametrize("name", list(RECORDS))
def test_resummarize_refuses_a_directory_a_run_is_writing_and_one_without_its_records(name, tmp_path, capsys):
    from openrlhf_geo import cli
    from openrlhf_geo.local import rundir

    out = _committed_copy(tmp_path, name)
    with rundir.locked(out):  # as a run holds its --out
        assert cli.main(["study", name, "--resummarize", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"openrlhf-geo study: error: --resummarize {out}: a run is writing it; wait for it to finish"
    assert (out / "summary.json").read_bytes() == (RESULTS / name / "summary.json").read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["study", name, "--resummarize", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"openrlhf-geo study: error: --resummarize {empty}")
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("name", ["real-lm-geometry", "real-lm-geoalign"])
def test_resummarize_refuses_a_result_of_the_first_analysis_in_one_line_and_writes_nothing(name, tmp_path, capsys):
    """The first runs' results (first-run/, kept as run, before the amendments): the current code cannot derive their
    summary or report; nothing there is rewritten."""
    from openrlhf_geo import cli

    out = tmp_path / name
    out.mkdir()
    first = RESULTS / name / "first-run"
    for file in ("records.json", "summary.json", "report.md"):
        (out / file).write_bytes((first / file).read_bytes())
    assert cli.main(["study", name, "--resummarize", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"openrlhf-geo study: error: --resummarize {out}: not a {name} result of the amended")
    assert sorted(p.name for p in out.iterdir()) == ["records.json", "report.md", "summary.json"]
    for file in ("summary.json", "report.md"):
        assert (out / file).read_bytes() == (first / file).read_bytes(), file


def test_the_gaps_are_proxy_minus_null_per_minibatch_beside_chance_and_salts_gap(tmp_path):
    """Third amendment, item 2, against numpy on the committed block's records: each gap is the mean over the
    mini-batches of proxy − null, chance is the mean of the full gradient's k_t/m (from its PR/k_t record), SALT's gap
    is Table 1's full-gradient row minus its null's (0.78 − 0.18 = 0.60 for the subspace)."""
    from openrlhf_geo.lab.studies.salt_proxy import PAPER_TABLE5

    block = json.loads((PROXY_RESULTS / "block0.json").read_text())
    _, summary = _resummarized(tmp_path)
    for size in (32, 256):
        rows = [r for r in block["records"] if r["m"] == size and r["signal"]]
        assert len(rows) == (8 if size == 32 else 1)
        for proxy in real_lm_proxy.PROXIES:
            cells = summary["gaps"][f"m{size}"][f"{proxy}/full"]
            for metric in ("rho", "sign", "pr_err", "k_match", "subspace", "a_cos"):
                x = np.array([r["pairs"][f"{proxy}/full"][metric] for r in rows], dtype=np.float64)
                for null in ("permutation", "noise"):
                    y = np.array([r["pairs"][f"{null}/full"][metric] for r in rows], dtype=np.float64)
                    row = cells[metric][f"minus_{null}"]
                    assert row["n"] == len(rows) and math.isclose(row["gain"], float(np.mean(x - y)), abs_tol=1e-12)
                    assert math.isclose(cells[metric][null], float(np.mean(y)), abs_tol=1e-12)
                    if size == 32:
                        assert row["low"] <= row["gain"] <= row["high"]
                    else:  # one mini-batch: the values, no CI
                        assert row["low"] is None and cells[metric][f"level_{null}"] is None
                assert math.isclose(cells[metric][proxy], float(np.mean(x)), abs_tol=1e-12)
            chance = np.mean([r["sets"]["full"]["k"] / r["m"] for r in rows])
            assert math.isclose(cells["subspace"]["chance"]["mean"], float(chance), abs_tol=1e-12)
    assert summary["gaps"]["m32"]["exact/full"]["subspace"]["paper_minus_permutation"] == 0.60
    # Table 1 (ρ, PR err., subspace) and Table 5 print the same full-gradient and null rows
    for row, values in real_lm_proxy.PAPER_TABLE1.items():
        assert values == {m: PAPER_TABLE5[row][m][0] for m in values}
    subspace = summary["gaps"]["m32"]["exact/full"]["subspace"]
    assert subspace["level_permutation"] == "below Table 1's level"  # +0.416 [0.352, 0.489] against 0.60


@pytest.mark.parametrize("low, high, metric, level", [
    (0.5, 0.7, "subspace", "at"), (0.61, 0.7, "subspace", "above"), (0.3, 0.59, "subspace", "below"),
    (-0.5, -0.4, "pr_err", "above"), (-0.3, -0.1, "pr_err", "below"), (-0.7, -0.2, "pr_err", "at"),
])  # fmt: skip
def test_a_gap_is_at_table_1s_level_only_when_its_ci_contains_salts_gap(low, high, metric, level):
    paper = 0.60 if metric == "subspace" else -0.38  # PR rel. err.: lower is better, a more negative gap the better
    row = {"gain": (low + high) / 2, "low": low, "high": high, "n": 8}
    assert real_lm_proxy.gap_level(row, paper, metric) == f"{level} Table 1's level"
    assert real_lm_proxy.gap_level({**row, "n": 1, "low": math.nan, "high": math.nan}, paper, metric) is None


def test_blocks_split_at_different_sizes_or_disagreeing_with_their_record_are_refused():
    block = json.loads((PROXY_RESULTS / "block0.json").read_text())
    assert real_lm_proxy.block_split(block) == (256, 32)  # read from the records: this block predates split_m
    with pytest.raises(ValueError, match="records split_m 64 but its mini-batches hold m = 32"):
        real_lm_proxy.block_split({**block, "split_m": 64})
    other = {**block, "records": [{**r, "m": 64 if r["m"] == 32 else r["m"], "block": 1} for r in block["records"]]}
    with pytest.raises(ValueError, match=r"split differently \(m = 256 into m = 32, m = 256 into m = 64\); summarize"):
        real_lm_proxy.summarize([block, other], {})


def test_a_block_records_its_split_and_names_its_batches_by_their_m(tiny_llama):
    """analyse_block on a tiny model: batches named and keyed by the m they hold, the split recorded in the block,
    and one small mini-batch (the block itself) analysed once."""
    prompt_ids, response_ids = _rollouts(3, prompts=2, samples=4)
    cap = 256
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    gram = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    data = {"collection": {"samples": 4, "caps": [cap]}, "prompt_ids": prompt_ids, "response_ids": response_ids,
            "geometry": {cap: {"gram": gram @ gram.T}}, "rewards": {cap: rewards}}  # fmt: skip
    tables = real_lm_proxy.countsketch_tables(tiny_llama, real_lm_proxy.REF_DIM, 0)
    for small, names in ((2, ["m8", "m4-0", "m4-1"]), (1, ["m8"])):
        sizes = {"blocks": 1, "prompts": 2, "samples": 4, "small": small}
        block = real_lm_proxy.analyse_block(data, tiny_llama, 0, sizes, tables)
        assert [r["batch"] for r in block["records"]] == names
        assert all(r["batch"].split("-")[0] == f"m{r['m']}" for r in block["records"])
        assert block["split_m"] == 8 // small and real_lm_proxy.block_split(block) == (8, 8 // small)


# ---------------------------------------------------------------- real-lm-rl


def test_real_lm_rl_conditions_parse_as_train_commands(tmp_path):
    from openrlhf_geo.local.flags import parse_args

    for name in real_lm_rl.CONDITIONS:
        argv = real_lm_rl.train_argv(tmp_path / "model", tmp_path, tmp_path / name, real_lm_rl.FULL, name)
        args = parse_args(argv)
        assert args.rollout.temperature == word_task.TEMPERATURE and args.actor.adam.lr == real_lm_rl.LR
        assert (args.algo.advantage.estimator == "salt") == (name == "salt") or args.salt.enable == (name == "salt")
        assert args.geoalign.enable == (name == "geoalign_flip")
        assert (args.reward.noise.type == "flip") == name.endswith("_flip")


# ---------------------------------------------------------------- the vLLM child process

FAKE_VLLM = '''
"""A stand-in for vLLM: LLM() starts an engine process that, as vLLM's EngineCore, does not watch its parent; generate
never returns."""
import multiprocessing, os, time
from pathlib import Path


class SamplingParams:
    def __init__(self, **kwargs):
        pass


def TokensPrompt(prompt_token_ids):
    return prompt_token_ids


def _engine():
    time.sleep(600)


class LLM:
    def __init__(self, *args, **kwargs):
        engine = multiprocessing.get_context("fork").Process(target=_engine)
        engine.start()
        pids = Path(os.environ["FAKE_VLLM_PIDS"])
        pids.with_suffix(".tmp").write_text(f"{os.getpid()} {engine.pid}")
        os.replace(pids.with_suffix(".tmp"), pids)

    def generate(self, prompts, params):
        time.sleep(600)
'''


def _alive(pid):
    """Whether `pid` runs (a zombie left to an init that does not reap counts as gone)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_vllm_child_and_its_engine_die_with_a_killed_study(tmp_path):
    """kill -9 of the study while vLLM samples: its child process (own session) and the engine processes vLLM started
    are gone within seconds, not left sampling for up to VLLM_TIMEOUT_S."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    pids_file = tmp_path / "pids"
    code = ("import sys; from pathlib import Path; from openrlhf_geo.lab.studies import real_lm; "
            "real_lm._sample_vllm('/model', [[1, 2]], real_lm.Collection(), 2, Path(sys.argv[1]))")  # fmt: skip
    path = os.pathsep.join(p for p in (str(tmp_path / "fake"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "FAKE_VLLM_PIDS": str(pids_file)}
    study = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "work")], env=env, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists():
            assert study.poll() is None, f"the stand-in study exited {study.returncode}"
            assert time.monotonic() < deadline, "the vLLM stand-in did not start"
            time.sleep(0.2)
        pids = [int(p) for p in pids_file.read_text().split()]  # the child, its engine
        os.kill(study.pid, signal.SIGKILL)
        study.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)], "the vLLM child or its engine outlived the killed study"
    finally:
        for pid in [study.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        study.wait()


# ---------------------------------------------------------------- the command line: --seeds, Ctrl-C


def _fake_real_lm_rl(monkeypatch, tmp_path, train):
    """real-lm-rl with `train` in place of `openrlhf-geo train`'s run (no model, no data)."""
    import transformers

    from openrlhf_geo.local import training

    monkeypatch.setattr(real_lm, "model_dir", lambda: tmp_path / "model")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: None)
    monkeypatch.setattr(real_lm_rl, "write_data", lambda out, sizes, tokenizer: Path(out) / "data")
    monkeypatch.setattr(training, "train", train)


def _metrics_run(seen):
    def train(args):
        seen.append((args.train.seed, args.reward.noise.seed))
        run = Path(args.ckpt.output_dir)
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "accuracy": 0.5, "eval/accuracy": 0.5}) + "\n")
        return 0

    return train


@pytest.mark.parametrize("seeds, seed, flag", [([], 0, ""), (["--seeds", "7"], 7, " --seeds 7")])
def test_real_lm_rl_runs_the_seed_given_and_its_out_records_it(tmp_path, monkeypatch, seeds, seed, flag):
    from openrlhf_geo import cli

    seen = []
    _fake_real_lm_rl(monkeypatch, tmp_path, _metrics_run(seen))
    out = tmp_path / "out"
    assert cli.main(["study", "real-lm-rl", "--quick", *seeds, "--out", str(out)]) == 0
    assert seen == [(seed, seed)] * len(real_lm_rl.CONDITIONS)
    assert json.loads((out / "command.json").read_text())["command"] == f"openrlhf-geo study real-lm-rl{flag} --quick"
    assert json.loads((out / "summary.json").read_text())["setup"]["seed"] == seed


@pytest.mark.parametrize("name", ["real-lm-geometry", "real-lm-geoalign", "real-lm-proxy"])
def test_the_collection_studies_sample_with_the_seed_given_and_their_out_records_it(name, tmp_path, monkeypatch):
    from openrlhf_geo import cli

    class Collected(Exception):
        pass

    for seeds, seed, flag in (([], 0, ""), (["--seeds", "7"], 7, " --seeds 7")):
        out = tmp_path / f"out{seed}"

        def collect(collection, cache=None, log=print, out=out):
            raise Collected(collection, json.loads((out / "command.json").read_text())["command"])

        monkeypatch.setattr(real_lm, "cached", lambda collection, cache=None: False)
        monkeypatch.setattr(real_lm, "collect", collect)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # real-lm-proxy's, for this test process
        with pytest.raises(Collected) as collected:
            cli.main(["study", name, "--quick", *seeds, "--out", str(out)])
        assert collected.value.args == (collected.value.args[0], f"openrlhf-geo study {name}{flag} --quick")
        assert collected.value.args[0].seed == seed


@pytest.mark.parametrize("argv, message", [
    (["salt-proxy", "--resummarize", "{d}"], "--resummarize only applies to real-lm-geometry and real-lm-geoalign and "
     "real-lm-proxy and real-lm-rl (got study salt-proxy)"),
    (["real-lm-proxy", "--resummarize", "{e}"], "--resummarize {e}: no block<b>.json files there"),
    (["real-lm-proxy", "--resummarize", "{m}"], "--resummarize {m}: no block<b>.json files there"),
    (["real-lm-proxy", "--resummarize", "{d}", "--out", "{e}"], "it takes no --out"),
    (["real-lm-proxy", "--resummarize", "{d}", "--quick", "--seeds", "3"], "it takes no --seeds or --quick"),
    (["real-lm-proxy", "--resummarize", "{e}/bad"], "--resummarize {e}/bad: its block files are not real-lm-proxy"),
])  # fmt: skip
def test_resummarize_is_refused_in_one_line_for_other_studies_flags_and_directories_without_blocks(
    argv, message, tmp_path, capsys
):
    from openrlhf_geo import cli

    paths = {"d": tmp_path / "done", "e": tmp_path / "empty", "m": tmp_path / "missing"}
    paths["d"].mkdir()
    paths["e"].mkdir()
    (paths["d"] / "block0.json").write_bytes((PROXY_RESULTS / "block0.json").read_bytes())
    (paths["e"] / "summary.json").write_text("{}")
    (paths["e"] / "bad").mkdir()
    (paths["e"] / "bad" / "block0.json").write_text("{}")
    assert cli.main(["study", *(a.format(**paths) for a in argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("openrlhf-geo study: error: ")
    assert message.format(**paths) in err
    assert sorted(p.name for p in paths["d"].iterdir()) == ["block0.json"]  # nothing written
    assert sorted(p.name for p in paths["e"].iterdir()) == ["bad", "summary.json"] and not paths["m"].exists()
    assert [p.name for p in (paths["e"] / "bad").iterdir()] == ["block0.json"]


@pytest.mark.parametrize("name", ["real-lm-geometry", "real-lm-geoalign", "real-lm-proxy", "real-lm-rl"])
def test_a_real_lm_study_refuses_several_seeds_naming_the_flag(name, tmp_path, monkeypatch, capsys):
    from openrlhf_geo import cli
    from openrlhf_geo.lab.studies import REGISTRY

    monkeypatch.setattr(REGISTRY[name], "run", lambda *args: pytest.fail(f"{name} ran with several seeds"))
    assert cli.main(["study", name, "--seeds", "1", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("openrlhf-geo study: error: --seeds") and "one seed" in err
    assert not (tmp_path / "o").exists()


def test_ctrl_c_in_real_lm_rl_is_one_line_naming_the_out_and_that_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    from openrlhf_geo import cli

    def train(args):
        raise KeyboardInterrupt

    _fake_real_lm_rl(monkeypatch, tmp_path, train)
    out = tmp_path / "out"
    assert cli.main(["study", "real-lm-rl", "--quick", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openrlhf-geo study: interrupted")
    assert f"--out {out}" in err[0] and "resumes" in err[0] and "train.log" not in err[0]
    # the rerun resumes: the same command is accepted in that --out and finishes
    seen = []
    _fake_real_lm_rl(monkeypatch, tmp_path, _metrics_run(seen))
    assert cli.main(["study", "real-lm-rl", "--quick", "--out", str(out)]) == 0 and len(seen) == 4


def test_ctrl_c_while_a_collection_is_sampled_is_one_line(tmp_path, monkeypatch, capsys):
    from openrlhf_geo import cli

    def collect(collection, cache=None, log=print):
        raise KeyboardInterrupt

    monkeypatch.setattr(real_lm, "cached", lambda collection, cache=None: False)
    monkeypatch.setattr(real_lm, "collect", collect)
    out = tmp_path / "out"
    assert cli.main(["study", "real-lm-geometry", "--quick", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openrlhf-geo study: interrupted") and f"--out {out}" in err[0]


def test_a_real_lm_rl_run_that_stops_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from openrlhf_geo import cli

    def train(args):
        raise ValueError("the weights are NaN after step 1")

    _fake_real_lm_rl(monkeypatch, tmp_path, train)
    out = tmp_path / "out"
    assert cli.main(["study", "real-lm-rl", "--quick", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"openrlhf-geo study: real-lm-rl: run grpo ({out / 'runs' / 'grpo'}) stopped: the weights are NaN "
                   "after step 1"]  # fmt: skip
