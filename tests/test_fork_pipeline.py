"""The REAL patched openrlhf 0.11.2 modules, imported from the materialized fork (CPU, test-only import shims).

Covers: hub ids and local model paths passing upstream's parser, and `train` shipping the fork to Ray workers
(the other parse tests: test_fork_parse.py); Actor.forward (padded and packed) returning upstream's log-probs plus
correct features / hidden states; PolicyModelActor.forward's return value; the experience maker's SALT advantages
against `salt_advantages`; GeoAlign rectification on micro-batched Experiences; PolicyLoss gradients under
replacement against an explicitly duplicated batch; metrics through `info` and the replay-buffer split/merge;
GeoAlign state in checkpoints; multi-turn agents' rollouts (every action span in SALT's and GeoAlign's inputs).
"""

import copy
import dataclasses
import itertools
import math
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from fork_helpers import BASE_ARGV, V, hf_reference, parse, toy_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_geo import geoalign, pipeline
from openrlhf_geo.fork import hooks as fork_hooks
from openrlhf_geo.salt import salt_advantages
from openrlhf_geo.stages import CurationPlan

pytestmark = pytest.mark.fork


def load_actor(up, tiny_path, packing=False, temperature=1.0):
    actor = up.Actor(
        tiny_path, attn_implementation="eager", param_dtype="bf16", packing_samples=packing, temperature=temperature
    )
    actor.model.float().eval()  # param_dtype takes bf16/fp16 only; fp32 for CPU numerics
    return actor


# ── parsing with the tiny model, and the launch up to ray.init (the other parse tests: test_fork_parse.py) ──


def test_hub_ids_and_existing_model_paths_pass_parsing(up, tiny_path, monkeypatch):
    """Only a value that reads as a local path must exist; `name` and `org/name` are hub ids, loaded later."""
    argv = ["--advantage_estimator", "group_norm", "--reward.model_name_or_path", f"org/rm,{tiny_path}"]
    args = parse(up, monkeypatch, [*argv, "--actor.model_name_or_path", "Qwen/Qwen2.5-0.5B"])
    assert args.actor.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    local = parse(up, monkeypatch, [*argv, "--actor.model_name_or_path", tiny_path])
    assert local.actor.model_name_or_path == tiny_path


def test_ray_init_ships_the_fork_to_workers(up, monkeypatch):
    import ray

    class Init(Exception):
        pass

    def init(**kwargs):
        raise Init(kwargs)

    args = parse(up, monkeypatch, ["--advantage_estimator", "salt"])
    module = runpy.run_module("openrlhf.cli.train_ppo_ray")  # the module body only; `train` as upstream wrote it
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Init) as caught:
        module["train"](args)
    env = caught.value.args[0]["runtime_env"]
    import openrlhf

    import openrlhf_geo

    assert env["py_modules"] == [str(Path(openrlhf.__file__).parent), str(Path(openrlhf_geo.__file__).parent)]
    assert env["worker_process_setup_hook"] == "openrlhf_geo.fork.install.check_worker"
    assert set(env["env_vars"]) == {
        "TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", fork_hooks.REWARD_TIMEOUT_ENV
    }  # fmt: skip
    assert env["env_vars"][fork_hooks.REWARD_TIMEOUT_ENV] == "300.0"  # --reward.timeout_s, read by the vLLM actors


# ── the experience forward (models/actor.py, trainer/ray/ppo_actor.py) ──


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("left_pad,temperature", [(False, 1.0), (True, 0.7)], ids=["right-pad", "left-pad-tau"])
def test_actor_forward_returns_upstream_log_probs_plus_exact_geometry(up, tiny_path, packing, left_pad, temperature):
    actor = load_actor(up, tiny_path, packing, temperature)
    seq, attn, action = toy_batch(1, left_pad)
    spec = fork_hooks.GeometrySpec(features="exact", hidden=True, entropy=True)
    with torch.no_grad():
        plain = actor(seq, action, attn)
        lp, out = actor(seq, action, attn, return_output=True, geometry=spec)
    # the log-probs now come from the features' pass: upstream's values up to float32 rounding, 0 off the actions
    torch.testing.assert_close(lp, plain, atol=2e-6, rtol=1e-6)
    assert not lp[~action].any()
    geo = out.geometry
    batch, seqlen = seq.shape
    width = action.shape[1]
    assert geo["features"].shape == (batch, V * 32) and geo["hidden"].shape == (batch, 32)
    assert geo["entropy"].shape == (batch,) and all(t.device.type == "cpu" for t in geo.values())

    ref_lp, logits, hidden = hf_reference(actor, seq, attn, action, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    offset = seqlen - 1 - width
    for b in range(batch):
        cols = action[b].nonzero()[:, 0]
        # features (exact): autograd's gradient of the response's mean action log-prob w.r.t. lm_head.weight
        actor.model.zero_grad()
        grad_lp, *_ = hf_reference(actor, seq[b : b + 1], attn[b : b + 1], action[b : b + 1], temperature)
        (grad_lp[0, cols].sum() / len(cols)).backward()
        torch.testing.assert_close(geo["features"][b], actor.model.lm_head.weight.grad.flatten(), atol=2e-5, rtol=1e-4)
        # hidden: final hidden state at the response's last token (one right of its last producing position)
        torch.testing.assert_close(geo["hidden"][b], hidden[b, offset + cols[-1] + 1], atol=1e-5, rtol=1e-5)
        # entropy: sum over producing positions of H(softmax(z/tau)) / log V
        p = torch.softmax(logits[b, offset + cols], -1)
        entropy = -(p * p.log()).sum() / math.log(V)
        torch.testing.assert_close(geo["entropy"][b], entropy.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_salt_features_give_the_log_probs_in_one_pass_over_the_logits(up, tiny_path, packing, monkeypatch):
    """With SALT features Actor.forward skips log_probs_from_logits: the sketch's exp pass gave the log-probs."""
    actor = load_actor(up, tiny_path, packing, temperature=0.7)
    seq, attn, action = toy_batch(4, left_pad=True)
    actor_module = sys.modules[type(actor).__module__]
    calls, upstream = [], actor_module.log_probs_from_logits
    monkeypatch.setattr(actor_module, "log_probs_from_logits", lambda *a: calls.append(1) or upstream(*a))
    with torch.no_grad():
        plain = actor(seq, action, attn)
        hidden_only = actor(seq, action, attn, return_output=True, geometry=fork_hooks.GeometrySpec(hidden=True))[0]
        assert len(calls) == 2  # no features: upstream's own pass
        spec = fork_hooks.GeometrySpec(features="sketch", dim=64, seed=3)
        lp, out = actor(seq, action, attn, return_output=True, geometry=spec)
    assert torch.equal(hidden_only, plain)
    assert len(calls) == 2 and "log_probs" not in out.geometry  # consumed by forward, not sent on with the geometry
    ref_lp, *_ = hf_reference(actor, seq, attn, action, 0.7)  # float32 log_softmax of the same logits
    torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(lp, plain, atol=2e-6, rtol=1e-6)
    assert not lp[~action].any()


def test_packed_and_padded_forwards_agree_on_sketch_features(up, tiny_path):
    seq, attn, action = toy_batch(2)
    spec = fork_hooks.GeometrySpec(features="sketch", dim=64, seed=1, hidden=True)
    outs = []
    for packing in (False, True):
        with torch.no_grad():
            outs.append(load_actor(up, tiny_path, packing)(seq, action, attn, return_output=True, geometry=spec))
    (lp_pad, pad), (lp_pack, pack) = outs
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-5, rtol=1e-5)
    for key in ("features", "hidden"):
        torch.testing.assert_close(pack.geometry[key], pad.geometry[key], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_vlm_path(tmp_path_factory):
    """A tiny Qwen2-VL (what upstream's --data.image_key path loads: a config with vision_config), random weights.
    Token ids 1-3 are its <|vision_start|>, <|image_pad|>, <|vision_end|>."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64,
            rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]},  # head_dim 16: M-RoPE's t, h, w halves
        ),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=1, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        vision_start_token_id=1, image_token_id=2, vision_end_token_id=3, video_token_id=4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    return str(path)


def test_a_vlm_forward_gives_upstream_log_probs_and_geometry_of_the_image_it_was_given(up, tiny_vlm_path):
    """--data.image_key: Actor.forward passes the processor's pixel inputs to the model inside the lm_head hook, so
    SALT's features and GeoAlign's hidden states come from the forward that saw the image."""
    actor = load_actor(up, tiny_vlm_path)
    assert actor.is_vlm
    seq, attn, action = toy_batch(5, left_pad=True)
    seq[seq <= 4] = 5  # no stray image or video tokens; each prompt starts with one image (2x2 patches: 1 token)
    seq[0, 2:5] = seq[1, 0:3] = seq[2, 1:4] = torch.tensor([1, 2, 3])
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(3 * 4, 3 * 2 * 14 * 14, generator=g)  # 4 patches of 2 frames x 14 x 14 x RGB per image
    grid = torch.tensor([[1, 2, 2]] * 3)

    def forward(pixel_values, **kwargs):  # mm_inputs as upstream's merge_mm_train_inputs hands them to the actor
        with torch.no_grad():
            return actor(seq, action, attn, pixel_values=pixel_values, image_grid_thw=grid, **kwargs)

    spec = fork_hooks.GeometrySpec(features="exact", hidden=True)
    plain = forward(pixels)
    lp, out = forward(pixels, return_output=True, geometry=spec)
    torch.testing.assert_close(lp, plain, atol=2e-6, rtol=1e-6)  # upstream's log-probs, from the features' pass
    with torch.no_grad():  # the model's own forward with the image, independent of Actor.forward
        ref = actor.model(seq, attention_mask=attn, pixel_values=pixels, image_grid_thw=grid,
                          mm_token_type_ids=(seq == 2).int(), output_hidden_states=True)  # fmt: skip
    width = action.shape[1]
    for b in range(len(seq)):
        last = seq.shape[1] - width + int(action[b].nonzero()[-1])  # the response's last token
        torch.testing.assert_close(out.geometry["hidden"][b], ref.hidden_states[-1][b, last], atol=1e-5, rtol=1e-5)
    _, other = forward(-pixels, return_output=True, geometry=spec)  # another image, the same tokens
    for key in ("features", "hidden"):
        assert not torch.allclose(other.geometry[key], out.geometry[key], atol=1e-3), key


def policy_forward(up):
    """PolicyModelActor.forward as patched (a plain function; the Ray actor wrapper is bypassed)."""
    return up.ppo_actor.PolicyModelActor.__ray_metadata__.modified_class.forward


def test_policy_actor_returns_geometry_only_when_asked(up, tiny_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    actor = load_actor(up, tiny_path)
    seq, attn, action = toy_batch(3)
    forward = policy_forward(up)
    strategy = NS(ring_attn_group=None, args=None)
    plain = forward(NS(actor=actor, strategy=strategy, geometry=None), seq, action, attn)
    spec = fork_hooks.GeometrySpec(hidden=True)
    lp, geo = forward(NS(actor=actor, strategy=strategy, geometry=spec), seq, action, attn)
    assert isinstance(plain, torch.Tensor) and torch.equal(lp, plain)
    assert set(geo) == {"hidden"} and geo["hidden"].shape == (3, 32)


def test_actor_spec_follows_the_flags(up, monkeypatch):
    assert fork_hooks.actor_spec(parse(up, monkeypatch, ["--advantage_estimator", "group_norm"])) is None
    spec = fork_hooks.actor_spec(
        parse(up, monkeypatch, "--advantage_estimator salt --salt.variant entropy-alpha --salt.dim 64".split())
    )
    assert spec == fork_hooks.GeometrySpec(features="sketch", dim=64, seed=0, entropy=True, hidden=False)
    spec = fork_hooks.actor_spec(parse(up, monkeypatch, "--advantage_estimator group_norm --geoalign.enable".split()))
    assert spec == fork_hooks.GeometrySpec(hidden=True)


# ── the experience maker (trainer/ppo_utils/experience_maker.py) ──

N_PER_PROMPT = 4


def rollouts(up, n_prompts, seed, rewards=None):
    """Single-sample Experiences as 0.11.2's SamplesGenerator makes them (binary rewards unless given)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = torch.randint(1, V, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
        for j in range(N_PER_PROMPT):
            response = torch.randint(1, V, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
            seq = torch.cat([prompt, response])
            action = torch.zeros(len(seq) - 1, dtype=torch.long)
            action[len(prompt) - 1 :] = 1
            k = p * N_PER_PROMPT + j
            r = float(torch.randint(0, 2, (1,), generator=g)) if rewards is None else float(rewards[k])
            out.append(
                up.experience.Experience(
                    sequences=seq[None],
                    attention_mask=torch.ones(1, len(seq), dtype=torch.long),
                    action_mask=action[None],
                    rewards=torch.tensor([r]),
                    response_length=torch.tensor([len(response)]),
                    truncated=torch.tensor([False]),
                    total_length=torch.tensor([float(len(seq))]),
                    prompts=[f"prompt {p}"],
                    labels=[""],
                    info={"reward": torch.tensor([r])},
                )
            )
    return out


class AnswerTokenizer:
    """The experience maker's tokenizer stand-in: a response decodes to the boxed answer (sum of its tokens) % 3."""

    pad_token_id = 0

    def batch_decode(self, rows, skip_special_tokens=True):
        return [f"\\boxed{{{sum(row) % 3}}}" for row in rows]


class ActorGroup:
    """RayActorGroup stand-in: one 'rank' runs the patched PolicyModelActor.forward on every micro-batch; SALT's Gram
    rows are dealt to `ranks` stand-ins of the patched salt_grams (Ray's object store: `fake_object_store`)."""

    def __init__(self, up, actor, spec, args, ranks=2):
        self.forward = policy_forward(up)
        self.rank = NS(actor=actor, strategy=NS(ring_attn_group=None, args=args), geometry=spec)
        gram_rows = up.ppo_actor.PolicyModelActor.__ray_metadata__.modified_class.salt_grams
        self._actor_handlers = [NS(salt_grams=NS(remote=lambda items: gram_rows(None, items)))] * ranks

    def async_run_method_batch(self, method_name, sequences, action_mask, attention_mask, **_):
        return [[self.forward(self.rank, *x) for x in zip(sequences, action_mask, attention_mask)]]

    def async_run_method(self, method_name, **_):
        return [None]


def make_maker(up, tiny_path, monkeypatch, argv, micro_batch=3):
    """A RemoteExperienceMaker on args from upstream's parser, with the patched actor forward in-process."""
    args = parse(up, monkeypatch, [*argv, "--rollout.micro_batch_size", str(micro_batch)])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(up.experience_maker, "ray", NS(get=lambda x: x, put=lambda x: x))
    fake_object_store(monkeypatch)
    group = ActorGroup(up, load_actor(up, tiny_path), fork_hooks.actor_spec(args), args)
    kl = up.FixedKLController(0.0)
    return up.experience_maker.RemoteExperienceMaker(group, None, None, None, kl, NS(args=args), AnswerTokenizer())


def fake_object_store(monkeypatch):
    """Ray's put / get for in-process stand-ins of the ranks (what fork_hooks calls): an object is its reference."""
    import ray

    monkeypatch.setattr(ray, "put", lambda x: x)
    monkeypatch.setattr(ray, "get", lambda refs: refs)


def forward_batch(maker, samples):
    """make_experience_batch split in two, to read the per-response geometry before the advantage step (features
    kept on the ranks read from their stand-in object store)."""
    experiences = maker.make_experience(maker.split_rollout_samples(samples))
    indices = torch.tensor([i for e in experiences for i in e.index])
    geometry = {}
    for key in getattr(experiences[0], fork_hooks.SIDE_ATTR, {}):
        parts = [getattr(e, fork_hooks.SIDE_ATTR)[key] for e in experiences]
        rows = torch.cat([part.ref if isinstance(part, fork_hooks.RankFeatures) else part for part in parts])
        geometry[key] = torch.empty_like(rows).index_copy_(0, indices, rows)  # prompt order
    return experiences, geometry


def test_geometry_writes_each_micro_batch_into_prompt_order_as_concatenating_and_scattering_did():
    """`GeometryBatch._geometry` writes each micro-batch's rows straight into prompt order (no concatenated (N, D)
    copy): the same dtype and bits as the concatenation scattered by `indices`, with torch.cat's type promotion."""
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(10, generator=g)
    experiences = []
    for k, rows in enumerate(order.split(3)):
        side = {
            "features": torch.randn(len(rows), 5, generator=g, dtype=torch.float64 if k == 1 else torch.float32),
            "entropy": torch.rand(len(rows), generator=g),
        }
        experiences.append(NS(index=rows.tolist(), **{fork_hooks.SIDE_ATTR: side}))
    batch = fork_hooks.GeometryBatch.__new__(fork_hooks.GeometryBatch)  # only what `_geometry` reads
    batch.experiences, batch.indices = experiences, order
    for key in ("features", "entropy"):
        rows = torch.cat([getattr(e, fork_hooks.SIDE_ATTR)[key] for e in experiences])
        expected = torch.empty_like(rows).index_copy_(0, order, rows)
        got = batch._geometry(key)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("ranks", [1, 2, 5])
def test_the_ranks_answer_each_partitions_rows_with_their_gram_and_its_eigendecomposition(monkeypatch, ranks):
    """`RankGrams.grams` deals the partitions over the ranks, each rank fetches the rows it is asked for (repeats
    too: a replaced slot's source) from the micro-batches' features and answers G = F[rows] F[rows]ᵀ with eigh(G)
    (`rank_gram`, the patched salt_grams): against float64 numpy, micro-batches in a shuffled prompt order."""
    import numpy as np

    fake_object_store(monkeypatch)
    g = torch.Generator().manual_seed(ranks)
    F = torch.randn(24, 7, generator=g)
    order = torch.randperm(24, generator=g)
    parts = [fork_hooks.RankFeatures(F[rows], len(rows)) for rows in order.split(5)]
    calls = []

    def gram_rows(items):
        calls.append([p for p, _, _ in items])
        return fork_hooks.rank_gram(items)

    actors = [NS(salt_grams=NS(remote=gram_rows)) for _ in range(ranks)]
    source = fork_hooks.RankGrams(actors, parts, [rows.tolist() for rows in order.split(5)])
    rows = [torch.tensor([0, 1, 1, 3, 4, 6, 7]), torch.arange(8, 16), torch.tensor([23, 16, 17, 17])]
    answers = source.grams(rows)
    for wanted, answer in zip(rows, answers):
        f = F[wanted].double().numpy()
        np.testing.assert_allclose(answer.matrix.numpy(), f @ f.T, rtol=1e-5, atol=1e-5 * np.abs(f @ f.T).max())
        lam, vecs = answer.eigh
        np.testing.assert_allclose(lam.numpy(), np.linalg.eigvalsh(answer.matrix.numpy()), atol=1e-9, rtol=0)
        torch.testing.assert_close(vecs @ torch.diag(lam) @ vecs.T, answer.matrix)
    # spread over the ranks: partition p of 3 on rank p·R // 3, or all on the one rank
    assert sorted(p for call in calls for p in call) == [0, 1, 2] and len(calls) == min(ranks, 3)
    twice = [rows.tolist() for rows in order.split(5)]
    twice[1] = twice[0]  # a micro-batch's rows claimed twice: rollouts of another are missing
    with pytest.raises(RuntimeError, match="SALT: no features for 5 of the 24 rollouts"):
        fork_hooks.RankGrams(actors, parts, twice)

    def no_convergence(G):
        raise torch.linalg.LinAlgError("the algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", no_convergence)  # the trainer then solves from G itself
    (answer,) = source.grams(rows[:1])
    assert answer.eigh is None and torch.equal(answer.matrix, answers[0].matrix)
    a = torch.tensor([1.0, -1.0, 0.5, 0.5, -1.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(salt_advantages(a, answer)[0], salt_advantages(a, answers[0])[0])


def row_advantages(experiences, size):
    """(N,) prompt order: each row's advantage, checked constant over its action tokens (kl = 0, gamma = 1)."""
    out = torch.full((size,), math.nan)
    for e in experiences:
        for k, i in enumerate(e.index):
            values = e.advantages[k][e.action_mask[k]]
            torch.testing.assert_close(values, values[:1].expand_as(values))
            out[i] = values[0]
    return out


def group_norm(r):
    r = r.view(-1, N_PER_PROMPT)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)


@pytest.mark.parametrize("group_prompts", [0, 2])
@pytest.mark.parametrize("variant", ["full", "rand-proj", "entropy-alpha"])
def test_salt_advantages_equal_salt_core_on_the_same_inputs(up, tiny_path, monkeypatch, variant, group_prompts):
    from openrlhf_geo.salt import entropy_alpha, salt_advantages

    argv = f"--advantage_estimator salt --salt.variant {variant} --salt.dim 64 --salt.group_prompts {group_prompts}"
    maker = make_maker(up, tiny_path, monkeypatch, argv.split())
    samples = rollouts(up, 4, seed=11)
    rewards = torch.tensor([s.rewards.item() for s in samples])
    experiences, geometry = forward_batch(maker, samples)
    # --salt.gram raw: the features stayed on the ranks; SALT got each partition's Gram from them
    assert all(isinstance(getattr(e, fork_hooks.SIDE_ATTR)["features"], fork_hooks.RankFeatures) for e in experiences)
    result = maker.compute_advantages_and_returns(experiences)

    generator = torch.Generator().manual_seed(7 + 2)  # the pipeline's SALT stream: --train.seed + 2
    a, expected = group_norm(rewards), torch.empty(len(samples))
    tokens = torch.tensor([float(s.action_mask.sum()) for s in samples])
    h_t = float(geometry["entropy"].sum() / tokens.sum()) if variant == "entropy-alpha" else None
    step = group_prompts * N_PER_PROMPT or len(samples)
    for start in range(0, len(samples), step):
        part = slice(start, start + step)
        entropy = entropy_alpha(h_t, h_t, h_t) if variant == "entropy-alpha" else None  # first step: H_min = H_max
        expected[part], _ = salt_advantages(
            a[part].double(), geometry["features"][part], variant, None, generator, entropy=entropy
        )
    assert not torch.allclose(expected, a, atol=1e-3)  # SALT changed the advantages: the check is not vacuous
    torch.testing.assert_close(row_advantages(result, len(samples)), expected)
    assert all(not hasattr(e, fork_hooks.SIDE_ATTR) for e in result)
    for key in ("pr", "k", "n_eff_in", "n_eff_out", "alpha", "D_a", "D_g", "U_perp", "U_perp_gain", "sign_flip"):
        assert all(e.info[f"salt/{key}"].shape == e.rewards.shape for e in result)


def stub_curate(plan_source, weight=None, calls=None):
    """A `curate` returning a fixed plan (the wiring under test, not GeoAlign's detector)."""

    def curate(hidden, rewards, group_ids, config, generator=None, *, projector=None, corrupted=None, actions=None):
        n = len(rewards)
        if calls is not None:
            calls.append(
                NS(hidden=hidden, rewards=rewards.clone(), group_ids=group_ids, corrupted=corrupted, actions=actions)
            )
        source = torch.as_tensor(plan_source)
        plan = dataclasses.replace(
            CurationPlan.identity(n),
            source=source,
            weight=torch.ones(n) if weight is None else torch.as_tensor(weight, dtype=torch.float),
            flagged=source != torch.arange(n),
        )
        return plan, {"pairs": 12.0, "flag_frac": float(plan.flagged.float().mean()), "val_acc": 1.0}

    return curate


# prompt 0: slot 1 holds a copy of rollout 2; prompt 1: slots 4 and 6 hold copies of rollout 5
SOURCE = [0, 2, 2, 3, 5, 5, 5, 7, 8, 9, 10, 11]
MULTIPLICITY = torch.tensor([1, 0, 2, 1, 0, 3, 0, 1, 1, 1, 1, 1], dtype=torch.float)
REWARDS = torch.tensor([1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.float)


def test_geoalign_rectifies_a_micro_batched_experience_list(up, tiny_path, monkeypatch):
    calls = []
    monkeypatch.setattr(geoalign.plan, "curate", stub_curate(SOURCE, calls=calls))
    argv = "--advantage_estimator group_norm --geoalign.enable --reward.noise.type flip --reward.noise.rate 0.5"
    maker = make_maker(up, tiny_path, monkeypatch, argv.split(), micro_batch=5)
    samples = rollouts(up, 3, seed=5, rewards=REWARDS)
    experiences, geometry = forward_batch(maker, samples)
    assert [len(e.index) for e in experiences] == [5, 5, 2]  # micro-batches mix prompts
    result = maker.compute_advantages_and_returns(experiences)

    (call,) = calls
    torch.testing.assert_close(call.hidden, geometry["hidden"])  # prompt order, from the actor forward
    assert torch.equal(call.group_ids, torch.arange(12) // N_PER_PROMPT)
    noisy = call.rewards  # rewards after noise injection, which `corrupted` describes
    assert torch.equal(noisy != REWARDS, call.corrupted) and int(call.corrupted.sum()) == 6  # 2 of 4 per prompt
    expected = group_norm(noisy[torch.tensor(SOURCE)]) * MULTIPLICITY  # slot rewards, then multiplicities
    torch.testing.assert_close(row_advantages(result, 12), expected)
    for e in result:
        assert torch.equal(e.info["noise/clean_reward"], REWARDS[e.index])
        assert torch.equal(e.info["reward"], noisy[e.index])  # upstream logs the reward training used
        assert torch.equal(e.info["noise/corrupted"], call.corrupted[e.index].float())
        assert torch.equal(e.info["geo/pairs"], torch.full((len(e.index),), 12.0))
        assert not hasattr(e, fork_hooks.SIDE_ATTR)


def test_an_http_reward_models_per_sample_lists_give_the_same_advantages(up, tiny_path, monkeypatch):
    """An HTTP reward model answers a list per query, so upstream's rewards are (B, 1): found by the CPU smoke."""
    monkeypatch.setattr(geoalign.plan, "curate", stub_curate(SOURCE))
    argv = "--advantage_estimator salt --geoalign.enable --reward.noise.type flip --reward.noise.rate 0.5".split()
    results = []
    for shape in ((1,), (1, 1)):
        maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
        samples = rollouts(up, 3, seed=5, rewards=REWARDS)
        for sample in samples:
            sample.rewards = sample.rewards.reshape(shape)
        experiences, _ = forward_batch(maker, samples)
        results.append(maker.compute_advantages_and_returns(experiences))
    torch.testing.assert_close(row_advantages(results[1], 12), row_advantages(results[0], 12))
    assert results[1][0].rewards.shape[1:] == (1,)  # noisy rewards keep upstream's shape


def test_the_fork_warns_when_a_run_has_no_learning_signal_and_logs_signal_metrics(up, tiny_path, monkeypatch):
    """Plain GRPO (no fork method on) gets the learning-signal guard too; its state rides in checkpoints."""
    maker = make_maker(up, tiny_path, monkeypatch, ["--advantage_estimator", "group_norm"], micro_batch=5)
    with pytest.warns(pipeline.LearningSignalWarning, match=r"steps 1-3: every prompt's rollouts got the same"):
        for _ in range(pipeline.SIGNAL_FLAT_STEPS):
            samples = rollouts(up, 3, seed=5, rewards=torch.ones(12))
            for sample in samples[:9]:
                sample.truncated = torch.tensor([True])
            experiences, _ = forward_batch(maker, samples)
            result = maker.compute_advantages_and_returns(experiences)
    for e in result:
        assert torch.equal(e.info["signal/tied_groups"], torch.ones(len(e.index)))
        assert torch.equal(e.info["signal/truncated"], torch.full((len(e.index),), 0.75))
    trainer, states = NS(experience_maker=maker, args=maker.strategy.args), {}
    fork_hooks.save_geometry_state(trainer, states)
    assert states[fork_hooks.SIGNAL_KEY]["flat_steps"] == pipeline.SIGNAL_FLAT_STEPS
    fresh = make_maker(up, tiny_path, monkeypatch, ["--advantage_estimator", "group_norm"], micro_batch=5)
    fork_hooks.load_geometry_state(NS(experience_maker=fresh, args=fresh.strategy.args), states)
    assert fresh.geometry.signal.state_dict() == maker.geometry.signal.state_dict()


def test_metrics_survive_the_replay_buffer_split_and_merge(up, tiny_path, monkeypatch):
    monkeypatch.setattr(geoalign.plan, "curate", stub_curate(SOURCE))
    maker = make_maker(up, tiny_path, monkeypatch, "--advantage_estimator group_norm --geoalign.enable".split(), 5)
    result = maker.make_experience_batch(rollouts(up, 3, seed=5, rewards=REWARDS))
    ex = up.experience
    items = ex.remove_padding_in_sequences(list(itertools.chain.from_iterable(map(ex.split_experience_batch, result))))
    batch = ex.make_experience_batch(items)  # NaiveReplayBuffer.append + collate_fn
    # ActorPPOTrainer.training_step: per-sample lists become tensors, logged as sample means
    metric = torch.tensor(batch.info["geo/flag_frac"], dtype=torch.float)
    assert metric.shape == (12,) and metric.mean().item() == pytest.approx(3 / 12)
    assert ex.balance_experiences(
        result, parse(up, monkeypatch, ["--advantage_estimator", "rloo", "--actor.num_gpus_per_node", "2"])
    )


def loss_gradients(up, actor, batch, token_level, dual_clip=None):
    """PolicyLoss gradients w.r.t. the model, one optimizer step over `batch` with upstream's global normalizers."""
    actor.model.zero_grad()
    logp = actor(batch.sequences, batch.action_mask, batch.attention_mask)
    # old policy != current: a fixed per-token shift of the old log-probs (equal for a rollout and its copies)
    old = batch.action_log_probs + 0.4 * torch.sin(batch.sequences[:, 1:].float() * 1.7) * batch.action_mask
    loss_fn = up.PolicyLoss(token_level_loss=token_level, dual_clip=dual_clip)
    mask = batch.action_mask
    loss, *_ = loss_fn(
        logp, old, batch.advantages, action_mask=mask, batch_num_tokens=mask.sum(), global_batch_size=len(mask)
    )
    loss.backward()
    return torch.cat([p.grad.flatten() for p in actor.model.parameters()]), float(mask.sum())


def merged(up, experiences):
    ex = up.experience
    items = list(itertools.chain.from_iterable(map(ex.split_experience_batch, experiences)))
    return ex.make_experience_batch(ex.remove_padding_in_sequences(items))


@pytest.mark.parametrize("salt", [False, True], ids=["grpo", "salt"])
def test_replacement_gradients_equal_an_explicitly_duplicated_batch(up, tiny_path, monkeypatch, salt):
    estimator = "--advantage_estimator " + ("salt --salt.features exact" if salt else "group_norm")
    monkeypatch.setattr(geoalign.plan, "curate", stub_curate(SOURCE))
    fork_maker = make_maker(up, tiny_path, monkeypatch, [*estimator.split(), "--geoalign.enable"], micro_batch=5)
    samples = rollouts(up, 3, seed=9, rewards=REWARDS)
    weighted = merged(up, fork_maker.make_experience_batch(samples))

    dup_maker = make_maker(up, tiny_path, monkeypatch, estimator.split(), micro_batch=5)
    duplicated = merged(up, dup_maker.make_experience_batch([copy.deepcopy(samples[s]) for s in SOURCE]))
    actor = load_actor(up, tiny_path)
    for dual_clip in (None, 3.0):
        g_fork, _ = loss_gradients(up, actor, weighted, token_level=False, dual_clip=dual_clip)
        g_dup, _ = loss_gradients(up, actor, duplicated, token_level=False, dual_clip=dual_clip)
        torch.testing.assert_close(g_fork, g_dup, atol=1e-6, rtol=1e-4)  # seq-mean-token-mean: exact
    g_fork, n_fork = loss_gradients(up, actor, weighted, token_level=True)
    g_dup, n_dup = loss_gradients(up, actor, duplicated, token_level=True)
    assert n_fork != n_dup  # token-mean: same direction, scaled by the token-count ratio
    torch.testing.assert_close(g_fork * n_fork, g_dup * n_dup, atol=1e-6, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(2, 6),
    width=st.integers(1, 5),
    dual_clip=st.sampled_from([None, 2.0, 5.0]),
    is_correction=st.sampled_from(["off", "token-clip", "token-mask"]),
)
def test_multiplicity_rows_equal_duplicated_rows_for_the_policy_loss(up, data, rows, width, dual_clip, is_correction):
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    keep = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows).filter(any))
    donors = [r for r in range(rows) if keep[r]]
    source = torch.tensor([r if keep[r] else donors[data.draw(st.integers(0, len(donors) - 1))] for r in range(rows)])
    multiplicity = torch.bincount(source, minlength=rows).float()
    mask = torch.rand(rows, width, generator=g) < 0.8
    mask[:, 0] = True
    old = torch.randn(rows, width, generator=g) * 0.3
    rollout = old + torch.randn(rows, width, generator=g) * 0.3
    adv = torch.randn(rows, width, generator=g)
    level, mode = ("off", "mask") if is_correction == "off" else ("token", is_correction.split("-")[1])
    loss_fn = up.PolicyLoss(
        dual_clip=dual_clip, token_level_loss=False, is_correction_level=level, is_correction_mode=mode
    )

    def grad(index, advantages):
        logp = (old + torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 0.5).requires_grad_()
        m = mask[index]
        loss, *_ = loss_fn(
            logp[index], old[index], advantages, m, rollout[index], batch_num_tokens=m.sum(), global_batch_size=len(m)
        )
        loss.backward()
        return logp.grad

    duplicated = grad(source, adv[source])
    weighted = grad(torch.arange(rows), adv * multiplicity[:, None])
    torch.testing.assert_close(weighted, duplicated, atol=1e-6, rtol=1e-5)


def actor_trainer(up, monkeypatch, argv):
    """ActorPPOTrainer.__init__ as patched, on args from upstream's parser (no DeepSpeed, vLLM or process group)."""
    args = parse(up, monkeypatch, ["--advantage_estimator", "group_norm", *argv])
    monkeypatch.setattr(up.ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the replay buffer names its (unused) device
    return up.ppo_actor.ActorPPOTrainer(NS(args=args), None, None, None, None)


@pytest.mark.parametrize("token_level", [True, False], ids=["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_the_actor_trainers_baseline_loss_is_baselines_loss_with_upstreams_aggregation(
    up, monkeypatch, loss, token_level
):
    """SALT App. I's Clip-Cov / KL-Cov in the patched ActorPPOTrainer: actor_loss_fn, called as training_step calls
    it, returns baselines.py's per-token loss on the same tensors reduced as upstream's aggregate_loss reduces
    (global token count or sample count, x dp_size), with PolicyLoss's return tuple."""
    from openrlhf_geo import baselines

    agg = "token-mean" if token_level else "seq-mean-token-mean"
    flags = f"--baseline.policy_loss {loss} --actor.loss_agg_mode {agg} --actor.eps_clip_low_high 0.2 0.3"
    if loss == "clip_cov":
        flags += " --baseline.clip_cov_ratio 0.3 --baseline.clip_cov_lb -1 --baseline.clip_cov_ub 1"
    trainer = actor_trainer(up, monkeypatch, flags.split())
    assert isinstance(trainer.actor_loss_fn, fork_hooks.BaselinePolicyLoss)
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 6, generator=g) * 2
    new = old + 0.4 * torch.randn(5, 6, generator=g)
    adv = torch.randn(5, 1, generator=g).expand(5, 6).contiguous()
    mask = torch.rand(5, 6, generator=g) < 0.8
    mask[0] = False  # a row with no valid token
    info = {"dp_size": 2, "batch_num_tokens": torch.tensor(40.0), "global_batch_size": torch.tensor(9.0)}

    logp = new.clone().requires_grad_()
    got, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = trainer.actor_loss_fn(
        logp, old, adv, action_mask=mask, rollout_log_probs=None, **info
    )
    got.backward()
    expected_logp = new.clone().requires_grad_()
    if loss == "clip_cov":  # the trainer's Clip-Cov stream: --train.seed (7) + rank 0
        per_token, stats = baselines.clip_cov_policy_loss(
            expected_logp, old, adv, mask, ratio=0.3, cov_lb=-1.0, cov_ub=1.0, clip_low=0.2, clip_high=0.3,
            generator=torch.Generator().manual_seed(7),
        )  # fmt: skip
        assert stats["clip_cov/selected_frac"] > 0 and float(clip_ratio) == pytest.approx(
            stats["clip_cov/ppo_clip_frac"]
        )
    else:
        per_token, stats = baselines.kl_cov_policy_loss(expected_logp, old, adv, mask)  # SALT Table 4 defaults
        assert float(clip_ratio) == 0.0  # KL-Cov has no ratio clip
    m = mask.float()
    if token_level:
        expected = (per_token * m).sum() / 40.0 * 2
    else:
        rows = m.sum(1) > 0
        expected = ((per_token * m).sum(1)[rows] / m.sum(1)[rows]).sum() / 9.0 * 2
    expected.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(logp.grad, expected_logp.grad)
    torch.testing.assert_close(ppo_kl, ((old - new) * m).sum() / m.sum())
    assert vllm_kl is None and is_filter_ratio is None
    assert isinstance(actor_trainer(up, monkeypatch, []).actor_loss_fn, up.PolicyLoss)  # default: upstream's


# ── checkpoints (trainer/ppo_trainer.py) ──


def test_geoalign_state_rides_in_checkpoints_and_restores(up, tiny_path, monkeypatch):
    argv = (
        "--advantage_estimator group_norm --geoalign.enable --geoalign.min_scores 4 --geoalign.projector.steps 3 "
        "--reward.noise.type flip --reward.noise.rate 0.25"
    )
    maker = make_maker(up, tiny_path, monkeypatch, argv.split(), micro_batch=4)
    first = maker.make_experience_batch(rollouts(up, 4, seed=3))
    assert maker.geometry.pipeline.states["geoalign"].projector is not None  # created and trained in the first batch
    curate_keys = ("pairs", "flag_frac", "val_acc", "gdi_p50", "gdi_p95", "cos_gt_0.8", "cos_gt_0.8_val")
    for key in (*curate_keys, "precision", "recall"):
        assert all(e.info[f"geo/{key}"].shape == (len(e.index),) for e in first)  # real curate's metrics
    assert first[0].info["geo/pairs"][0] > 0 and "geo/auroc" in first[0].info

    trainer = up.ppo_trainer.BasePPOTrainer.__new__(up.ppo_trainer.BasePPOTrainer)
    trainer.args = NS(logger=NS(logging_steps=1), ckpt=NS(save_steps=1))
    trainer.actor_model_group = NS(async_run_method=lambda **kw: saved.append(kw) or [])
    trainer.critic_model_group = trainer.wandb_logger = trainer.tensorboard_logger = None
    trainer.best_eval_metric_key, trainer.best_eval_metric_value, trainer._latest_eval_metric_value = "", -1.0, None
    trainer.experience_maker = maker
    saved = []
    monkeypatch.setattr(up.ppo_trainer, "ray", NS(get=lambda x: x))
    trainer.save_logs_and_checkpoints(1, client_states={"global_step": 1})
    state = saved[0]["client_states"][fork_hooks.STATE_KEY]

    resumed_maker = make_maker(up, tiny_path, monkeypatch, argv.split(), micro_batch=4)
    resumed = up.ppo_trainer.BasePPOTrainer.__new__(up.ppo_trainer.BasePPOTrainer)
    resumed.experience_maker = resumed_maker
    resumed.best_eval_metric_key, resumed.best_eval_metric_value = "", -1.0
    resumed.restore_best_checkpoint_state(saved[0]["client_states"])
    projector = resumed_maker.geometry.pipeline.states["geoalign"].projector
    for a, b in zip(projector.state_dict().values(), state["stages"]["geoalign"]["projector"].values()):
        assert torch.equal(a, b)
    # same state => the next batch is processed identically
    batch = rollouts(up, 4, seed=4)
    after = maker.make_experience_batch(copy.deepcopy(batch))
    after_resume = resumed_maker.make_experience_batch(copy.deepcopy(batch))
    for x, y in zip(after, after_resume):
        assert torch.equal(x.advantages, y.advantages)
        assert x.info["geo/proj_loss"].tolist() == pytest.approx(y.info["geo/proj_loss"].tolist(), nan_ok=True)


def test_a_checkpoint_written_with_other_geometry_flags_is_refused_naming_each(up, tiny_path, monkeypatch):
    """What the CPU smoke's resume_changed_flags condition checks end to end, at the hook."""
    base = ["--advantage_estimator", "salt"]
    maker = make_maker(up, tiny_path, monkeypatch, base, micro_batch=4)
    states = {}
    fork_hooks.save_geometry_state(NS(experience_maker=maker, args=maker.strategy.args), states)
    assert fork_hooks.FLAGS_KEY in states
    changed = make_maker(up, tiny_path, monkeypatch, [*base, "--salt.dim", "1024"], micro_batch=4)
    from openrlhf_geo.salt import DEFAULT_DIM

    with pytest.raises(ValueError, match=rf"written with other flags: --salt.dim {DEFAULT_DIM} -> 1024\. Resume"):
        fork_hooks.load_geometry_state(NS(experience_maker=changed, args=changed.strategy.args), states)
    fork_hooks.load_geometry_state(NS(experience_maker=maker, args=maker.strategy.args), states)  # same flags


# ── one pipeline, two engines: the fork's experience maker and the local engine agree ──

# a high density factor so that 16 rollouts have anomalies to replace (the paper's 0.05 flags none this small)
GEO_FAST = (
    "--geoalign.alpha 0.9 --geoalign.projector.hidden_sizes 16 --geoalign.projector.out_dim 8 "
    "--geoalign.projector.steps 3"
)
NOISE = "--reward.noise.type flip --reward.noise.rate 0.25 --reward.noise.seed 3"


def _engine_cases():
    from openrlhf_geo.salt import VARIANTS

    cases = {"grpo+noise": f"--advantage_estimator group_norm {NOISE}"}
    cases["grpo+diagnostics"] = "--advantage_estimator group_norm --salt.diagnostics --salt.features exact"
    for variant in VARIANTS:
        alpha = " --salt.alpha 0.5" if variant == "fixed-alpha" else ""
        cases[f"salt-{variant}"] = f"--advantage_estimator salt --salt.variant {variant} --salt.features exact{alpha}"
    for mode in ("replace", "zero", "amplify"):
        cases[f"geoalign-{mode}+noise"] = f"--advantage_estimator group_norm --geoalign.enable --geoalign.mode {mode} "
        cases[f"geoalign-{mode}+noise"] += f"{GEO_FAST} {NOISE}"
    cases["salt+geoalign+noise"] = (
        f"--advantage_estimator salt --salt.features exact --salt.group_prompts 2 --geoalign.enable {GEO_FAST} {NOISE}"
    )
    # the fork-capable comparison baselines (GeoAlign App. B.5): PF-PPO keeping the slot count, Seed-GRPO
    keep = "--baseline.pf_ppo_keep_count"
    cases["pf_ppo_br+noise"] = f"--advantage_estimator group_norm --baseline.curation pf_ppo_br {keep} {NOISE}"
    cases["pf_ppo_bw+salt"] = f"--advantage_estimator salt --salt.features exact --baseline.curation pf_ppo_bw {keep}"
    cases["seed_grpo"] = "--advantage_estimator group_norm --baseline.seed_grpo_alpha 0.6"
    cases["seed_grpo+pf_ppo_bw+salt"] = (
        f"--advantage_estimator salt --salt.features exact --baseline.seed_grpo_alpha 0.6 --baseline.curation "
        f"pf_ppo_bw {keep}"
    )
    return cases


def local_rollouts(samples):
    """The same rollouts as one local-engine batch: prompts left-padded, responses right-padded (pad id 0)."""
    from openrlhf_geo.local.engine import Rollouts

    prompts, responses = [], []
    for s in samples:
        width = int(s.response_length)
        prompts.append(s.sequences[0, :-width])
        responses.append(s.sequences[0, -width:])
    texts = AnswerTokenizer().batch_decode([r.tolist() for r in responses])  # what the fork's tokenizer decodes
    p_width, r_width = max(map(len, prompts)), max(map(len, responses))
    n = len(samples)
    sequences = torch.zeros(n, p_width + r_width, dtype=torch.long)
    attention = torch.ones(n, p_width + r_width, dtype=torch.long)
    mask = torch.zeros(n, r_width, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        sequences[i, p_width - len(p) : p_width] = p
        attention[i, : p_width - len(p)] = 0
        sequences[i, p_width : p_width + len(r)] = r
        mask[i, : len(r)] = True
    return Rollouts(
        sequences=sequences,
        attention_mask=attention,
        mask=mask,
        group_ids=torch.arange(n) // N_PER_PROMPT,
        prompts=[""] * n,
        responses=texts,
        answers=[""] * n,
        prompt_width=p_width,
    )


class LocalTokenizer:
    """What the local engine's Trainer reads of a tokenizer when it is handed rollouts: its special ids, and the
    special tokens of an empty prompt (the prompt budget, `engine.prompt_budget`)."""

    pad_token_id, eos_token_id = 0, 1

    def __call__(self, text):
        return {"input_ids": []}


@pytest.mark.parametrize(
    "batch_size, n_samples, group_prompts, prompts",
    [(16, 4, None, 4), (4, 4, None, 1), (2, 4, 1, 1), (32, 4, 2, 2), (16, 4, 0, 0), (12, 4, None, 3)],
)
def test_both_engines_size_salt_partitions_by_one_rule(up, monkeypatch, batch_size, n_samples, group_prompts, prompts):
    """Prompts per SALT partition: --salt.group_prompts, else the optimizer mini-batch's prompts (--train.batch_size
    rollouts), at least one; 0 = the whole batch."""
    from openrlhf_geo.local import engine, flags

    argv = ["--advantage_estimator", "salt", "--train.batch_size", str(batch_size)]
    argv += ["--rollout.n_samples_per_prompt", str(n_samples)]
    argv += [] if group_prompts is None else ["--salt.group_prompts", str(group_prompts)]
    fork_args = parse(up, monkeypatch, argv)
    local_args = flags.parse_args([*BASE_ARGV, "--data.prompt_dataset", "unused.jsonl", *argv])
    model = torch.nn.Linear(2, 2)
    model.config = NS(max_position_embeddings=None)  # no position limit: no prompt budget to check
    trainer = engine.Trainer(local_args, model, LocalTokenizer(), [], None)
    assert fork_hooks.ExperienceGeometry(fork_args).partition_prompts == prompts
    assert trainer.partition_prompts == prompts


def local_step(model, argv, samples, rewards):
    """The local engine's step on `samples` -> (final advantages (N,), metrics): `_score` (reward noise), then
    `learn` up to the loss (the optimizer update is replaced by a probe)."""
    from openrlhf_geo.local import engine, flags

    args = flags.parse_args(
        [*BASE_ARGV, "--data.prompt_dataset", "unused.jsonl", "--actor.tokenizer", "unused", *argv]
    )
    reward_fn = lambda prompts, responses, answers: rewards.clone()  # noqa: E731
    trainer = engine.Trainer(args, model, LocalTokenizer(), [], reward_fn)
    captured = []
    trainer._update = lambda batch, advantages: captured.append(advantages.clone()) or {}
    batch = local_rollouts(samples)
    trainer.global_step = 1
    trainer._score(batch)
    metrics = trainer.learn(batch)
    return captured[0], metrics


@pytest.mark.parametrize("case", list(_engine_cases()))
def test_fork_and_local_engine_give_identical_advantages_and_metrics(up, tiny_path, monkeypatch, case):
    argv = _engine_cases()[case].split()
    monkeypatch.setenv("OPENRLHF_GEO_MATH_WORKERS", "1")  # the fork's Seed-GRPO checks answers in a worker pool
    samples = rollouts(up, 4, seed=21)
    rewards = torch.tensor([s.rewards.item() for s in samples])
    maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
    model = copy.deepcopy(maker.actor_model_group.rank.actor.model)  # the fork actor's exact weights
    result = maker.make_experience_batch(copy.deepcopy(samples))
    fork_advantages = row_advantages(result, len(samples))

    local_advantages, metrics = local_step(model, argv, samples, rewards)
    for key in ("geo/n_flagged", "salt/D_a", "noise/corrupted"):  # each method on in the case changed something
        # diagnostics change nothing by design; no-proj's a' = a + α_t [a]₊ is a here, where n_eff >= 1 gives α_t = 0
        assert metrics.get(key, 1.0) > 0 or case in ("grpo+diagnostics", "salt-no-proj"), key
    assert metrics.get("baseline/pf_ppo/filtered_frac", 1.0) > 0 and metrics.get("baseline/seed_grpo/scale_min", 0) < 1
    torch.testing.assert_close(local_advantages.float(), fork_advantages, atol=2e-5, rtol=1e-4)
    fork_keys = {
        k
        for k in result[0].info
        if k.split("/")[0] in ("salt", "geo", "noise", "baseline") and k != "noise/clean_reward"
    }
    assert fork_keys, "the case logs no geometry metric: nothing compared"
    assert fork_keys <= set(metrics)
    for key in sorted(fork_keys):
        fork_value = torch.cat([e.info[key] for e in result]).double()
        # upstream averages exp.info plainly: a slot without a value carries the batch's nanmean, or all are NaN
        assert bool(fork_value.isnan().all()) or not bool(fork_value.isnan().any()), key
        expected = float(fork_value.nanmean()) if bool(fork_value.isfinite().any()) else math.nan
        if key.endswith(("time_s", "solve_ms")):
            continue  # wall time
        assert metrics[key] == pytest.approx(expected, rel=1e-3, abs=1e-4, nan_ok=True), key


def _rank_steps(up, monkeypatch, args, batch, world, epochs):
    """One data-parallel rank: the patched ActorPPOTrainer.ppo_train over a real replay buffer holding `batch`,
    with training_step recording each micro-batch's rollout ids -> [ids of each optimizer step]."""
    import openrlhf.trainer.ppo_utils.replay_buffer as replay_buffer

    monkeypatch.setattr(up.ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the replay buffer names its (unused) device
    micro = args.train.micro_batch_size
    trainer = up.ppo_actor.ActorPPOTrainer(NS(args=args), None, None, None, None, micro_train_batch_size=micro)
    trainer.max_epochs = epochs
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the dynamic batching's count tensors
    reduce = NS(get_world_size=lambda group=None: world, all_reduce=lambda *a, **k: None, ReduceOp=NS(MIN=0, SUM=1))
    monkeypatch.setattr(replay_buffer, "dist", reduce)  # each rank alone: its own counts stand for the group's
    trainer.strategy = NS(
        args=args,
        ring_attn_group=None,
        accumulated_gradient=args.train.batch_size // args.train.micro_batch_size // world,
        ds_device_mesh={"dp": NS(get_group=lambda: None)},
        is_rank_0=lambda: True,
        all_reduce=lambda data, op="mean": data,
    )
    trainer.replay_buffer.append(batch)
    steps, current = [], []

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        current.extend(int(u) for u in experience.info["uid"])
        window = trainer.strategy.accumulated_gradient
        last = (
            trainer.replay_buffer.dynamic_optimizer_step[step]
            if args.train.dynamic_batch_enable
            else ((step + 1) % window == 0)
        )
        if last:
            steps.append(frozenset(current))
            current.clear()
        return {"metrics": {"policy_loss": 0.0}, "weights": {"policy_loss": None}, "num_action_tokens": 1,
                "num_samples": 1}  # fmt: skip

    trainer.training_step = training_step
    trainer.ppo_train(0.0)
    assert not current, "a trailing micro-batch outside any optimizer step"
    return steps


@pytest.mark.parametrize("mode", ["shuffled", "dynamic-batch", "async"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_optimizer_step_trains_on_exactly_one_salt_partition_on_every_rank(up, monkeypatch, world, mode):
    """SALT §3.1 computes everything on "the current mini-batch": with --train.batch_size = 2 prompts x G, optimizer
    step i on every data-parallel rank takes its share of SALT partition i, over two epochs, through the real
    patched PPOTrainer distribution, replay buffer and ppo_train loop; in upstream's asynchronous trainer too
    (--train.async_enable), whose TrainingActor trains through the same train_step and ppo_train."""
    argv = ["--advantage_estimator", "salt", "--rollout.batch_size", "8", "--train.batch_size", "8",
            "--train.micro_batch_size", "1", "--actor.num_gpus_per_node", str(world), "--ref.num_gpus_per_node",
            str(world), "--train.max_tokens_per_gpu", "64"]  # fmt: skip
    if mode == "dynamic-batch":
        argv += ["--train.dynamic_batch_enable", "--vllm.num_engines", "1"]  # (it packs samples, which needs vLLM)
    if mode == "async":
        from openrlhf.trainer import ppo_trainer_async

        argv += ["--train.async_enable"]
        classes = ppo_trainer_async.TrainingActor.__ray_metadata__.modified_class.__mro__[1:]  # past Ray's wrapper
        trains = next(vars(c)["train_step"] for c in classes if "train_step" in vars(c))
        assert "rank_batches" in trains.__code__.co_names  # BasePPOTrainer's, as the ppo_trainer diff patched it
    args = parse(up, monkeypatch, argv)
    samples = rollouts(up, 8, seed=3)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    experiences = []
    for k in order:  # the experience maker's micro-batches mix prompts
        samples[k].index = [k]
        samples[k].info["uid"] = torch.tensor([k])
        experiences.append(samples[k])
    partitions = {frozenset(range(p * 8, p * 8 + 8)) for p in range(4)}  # prompt order: 2 prompts x 4 per partition

    trainer = NS(args=args, experience_maker=NS(geometry=NS(pipeline=NS(steps=1))))
    batches = fork_hooks.rank_batches(trainer, experiences)
    assert len(batches) == world and {len(b.sequences) for b in batches} == {32 // world}
    ranks = [_rank_steps(up, monkeypatch, args, batch, world, epochs=2) for batch in batches]
    assert {len(steps) for steps in ranks} == {8}  # 4 partitions x 2 epochs, on every rank
    for i in range(8):
        step = frozenset().union(*(steps[i] for steps in ranks))
        assert step in partitions, f"optimizer step {i} mixes partitions: {sorted(step)}"
    for epoch in (slice(0, 4), slice(4, 8)):
        assert {frozenset().union(*(steps[i] for steps in ranks)) for i in range(8)[epoch]} == partitions


def test_shuffle_minibatches_keeps_upstreams_distribution(up, monkeypatch):
    args = parse(up, monkeypatch, ["--advantage_estimator", "salt", "--salt.shuffle_minibatches"])
    trainer = NS(args=args, experience_maker=NS(geometry=NS(pipeline=NS(steps=1))))
    assert fork_hooks.rank_batches(trainer, rollouts(up, 2, seed=3)) is None
    assert fork_hooks.minibatch_sampling(NS(args=args), True) == {"shuffle": True}


# ── checkpoints: rotation, `latest`, a full disk (patches/openrlhf.utils.deepspeed.deepspeed.diff) ──


class FakeEngine:
    """DeepSpeedEngine.save_checkpoint's effect on disk: the tag's files, then (save_latest) `latest`."""

    def __init__(self, fail=None):
        self.fail, self.calls = fail, []

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        self.calls.append((tag, save_latest))
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"partial" if self.fail else b"model")
        if self.fail:
            raise self.fail
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)


@pytest.fixture
def save_ckpt(up, monkeypatch):
    """The patched DeepspeedStrategy.save_ckpt on a one-rank strategy, with FakeEngine as DeepSpeed's engine."""
    import openrlhf.utils.deepspeed.deepspeed as ds
    import openrlhf.utils.distributed_util as distributed_util

    events = []
    monkeypatch.setattr(ds.deepspeed, "DeepSpeedEngine", FakeEngine)
    monkeypatch.setattr(ds, "torch_dist_barrier_and_cuda_sync", lambda: events.append("barrier"))
    monkeypatch.setattr(distributed_util, "torch_dist_barrier_and_cuda_sync", lambda: events.append("barrier"))
    strategy = object.__new__(ds.DeepspeedStrategy)
    strategy.is_rank_0, strategy.print = lambda: True, lambda *a: None

    def save(model, save_dir, tag, max_num=3):
        strategy.save_ckpt(model, str(save_dir), tag, max_num=max_num, max_mem=1000, client_state={})
        return events

    return save


def test_a_save_never_deletes_the_last_complete_checkpoint_before_its_replacement_is_written(save_ckpt, tmp_path):
    save_ckpt(FakeEngine(), tmp_path, "global_step1", max_num=1)
    assert fork_hooks.latest_tag(tmp_path) == "global_step1"
    # a save killed or failing half-way (upstream's rotation deleted global_step1 first: --ckpt.max_num 1 lost all)
    with pytest.raises(RuntimeError):
        save_ckpt(FakeEngine(fail=RuntimeError("killed")), tmp_path, "global_step2", max_num=1)
    assert fork_hooks.latest_tag(tmp_path) == "global_step1"
    assert (tmp_path / "global_step1" / "mp_rank_00_model_states.pt").read_bytes() == b"model"
    # the next complete save commits its tag and rotates back to max_num: the half-written one goes too
    model = FakeEngine()
    events = save_ckpt(model, tmp_path, "global_step3", max_num=1)
    assert model.calls == [("global_step3", False)]  # DeepSpeed does not write `latest`; the barrier, then rank 0
    assert events[-1] == "barrier" and fork_hooks.latest_tag(tmp_path) == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step1", "global_step3"]
    save_ckpt(FakeEngine(), tmp_path, "global_step4", max_num=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step3", "global_step4"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_dir()) == ["latest"]  # no temp file left


def test_latest_is_replaced_atomically(tmp_path, monkeypatch):
    fork_hooks.commit_latest(tmp_path, "global_step1")

    def crash(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fork_hooks.os, "replace", crash)
    with pytest.raises(OSError):
        fork_hooks.commit_latest(tmp_path, "global_step2")
    assert fork_hooks.latest_tag(tmp_path) == "global_step1" and [p.name for p in tmp_path.iterdir()] == ["latest"]
    assert fork_hooks.latest_tag(tmp_path / "none") is None


def test_a_save_on_a_full_disk_is_reported_as_no_space_left(save_ckpt, tmp_path, monkeypatch):
    save_ckpt(FakeEngine(), tmp_path, "global_step1")
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4672 vs 4566")
    monkeypatch.setattr(fork_hooks.shutil, "disk_usage", lambda path: NS(free=2**20))
    with pytest.raises(OSError) as caught:
        save_ckpt(FakeEngine(fail=torch_error), tmp_path, "global_step2")
    assert caught.value.errno == 28 and caught.value.__cause__ is torch_error
    assert str(caught.value).startswith(f"[Errno 28] No space left on device: checkpoint global_step2 in {tmp_path}")
    assert "(1.0 MiB free; --ckpt.load_enable resumes from global_step1)" in str(caught.value)
    # with space left the error is the save's own
    monkeypatch.setattr(fork_hooks.shutil, "disk_usage", lambda path: NS(free=2**40))
    with pytest.raises(RuntimeError) as caught:
        save_ckpt(FakeEngine(fail=torch_error), tmp_path, "global_step2")
    assert caught.value is torch_error


def test_a_recorded_step_replays_through_the_pipeline_and_nothing_is_recorded_without_the_variable(
    up, tiny_path, monkeypatch, tmp_path
):
    """OPENRLHF_GEO_DUMP_DIR: the experience maker's batch is `fork.hooks.RecordingBatch` (`fork.replay`), which
    writes each step's record, and the record replays through the pipeline bit for bit (what the CPU smoke checks on
    real runs)."""
    from smoke_helpers import assert_steps_replay

    argv = _engine_cases()["salt+geoalign+noise"].split()
    monkeypatch.setenv("OPENRLHF_GEO_DUMP_DIR", str(tmp_path))
    maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
    before = rollouts(up, 4, seed=21)
    recorded = maker.make_experience_batch(copy.deepcopy(before))
    dump = torch.load(tmp_path / "step0001.pt", weights_only=False)
    assert {"curate", "advantage", "salt_in", "labels", "state_after"} <= dump.keys()
    assert_steps_replay("salt+geoalign+noise", {1: dump})
    monkeypatch.delenv("OPENRLHF_GEO_DUMP_DIR")
    plain = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5).make_experience_batch(copy.deepcopy(before))
    torch.testing.assert_close(row_advantages(recorded, 16), row_advantages(plain, 16), rtol=0, atol=0)
    assert [p.name for p in tmp_path.glob("step*.pt")] == ["step0001.pt"]  # none from the run without the variable


def leave_one_out(rewards, group_ids):
    """Toy estimator for the registry: r_i minus the mean of its prompt's other rollouts (RLOO), float64, by hand."""
    r, out = rewards.double(), torch.zeros(len(rewards), dtype=torch.float64)
    for g in torch.unique(group_ids):
        rows = group_ids == g
        out[rows] = r[rows] - (r[rows].sum() - r[rows]) / (int(rows.sum()) - 1)
    return out.to(rewards.dtype)


@pytest.mark.parametrize("case", ["estimator", "salt-base"])
def test_a_registered_estimator_without_an_upstream_branch_runs_in_the_fork_as_on_the_local_engine(
    up, tiny_path, monkeypatch, case
):
    """registry.ESTIMATORS with upstream=False: the fork's --advantage_estimator takes it, upstream runs its dr_grpo
    path and the pipeline replaces those advantages with the estimator's (alone, or as SALT's --salt.base), giving
    what the local engine gives on the same rollouts."""
    from openrlhf_geo import registry

    toy = registry.Estimator("toy_rloo", leave_one_out, upstream=False)
    monkeypatch.setitem(registry.ESTIMATORS, "toy_rloo", toy)
    argv = {
        "estimator": "--advantage_estimator toy_rloo",
        "salt-base": "--advantage_estimator salt --salt.base toy_rloo --salt.features exact",
    }[case].split()
    samples = rollouts(up, 4, seed=21)
    rewards = torch.tensor([s.rewards.item() for s in samples])
    maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
    args = maker.strategy.args
    assert (args.algo.advantage.estimator, args.geometry.estimator) == ("dr_grpo", "toy_rloo")
    model = copy.deepcopy(maker.actor_model_group.rank.actor.model)
    fork_advantages = row_advantages(maker.make_experience_batch(copy.deepcopy(samples)), len(samples))
    local_advantages, metrics = local_step(model, argv, samples, rewards)
    torch.testing.assert_close(local_advantages.float(), fork_advantages, atol=2e-5, rtol=1e-4)
    if case == "estimator":
        group_ids = torch.arange(len(samples)) // args.rollout.n_samples_per_prompt
        torch.testing.assert_close(fork_advantages, leave_one_out(rewards, group_ids).float())
    else:
        assert metrics["salt/D_a"] > 0  # SALT reweighted the estimator's advantages in both engines


# ── rollouts without action tokens; a group a replacement ties (the experience maker's hooks) ──


def without_actions(samples, rows):
    """The experiences a prompt that filled the context window gives (upstream cuts its action mask to nothing)."""
    for row in rows:
        samples[row].action_mask = torch.zeros_like(samples[row].action_mask)
        samples[row].response_length = torch.tensor([0])
    return samples


def test_a_rollout_without_action_tokens_is_left_out_of_salt_and_handed_to_geoalign_as_such(
    up, tiny_path, monkeypatch
):
    calls = []
    monkeypatch.setattr(geoalign.plan, "curate", stub_curate(list(range(12)), calls=calls))
    argv = "--advantage_estimator salt --salt.features exact --salt.group_prompts 0 --geoalign.enable".split()
    maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
    samples = without_actions(rollouts(up, 3, seed=5, rewards=REWARDS), [5])
    experiences, geometry = forward_batch(maker, samples)
    result = maker.compute_advantages_and_returns(experiences)

    assert not geometry["features"][5].any() and not geometry["hidden"][5].any()  # the actor forward's zero rows
    (call,) = calls
    assert call.actions.tolist() == [int(s.action_mask.sum()) for s in samples] and int(call.actions[5]) == 0
    rows = torch.tensor([i for i in range(12) if i != 5])
    expected, stats = salt_advantages(group_norm(REWARDS)[rows].double(), geometry["features"][rows])
    got = row_advantages(result, 12)
    torch.testing.assert_close(got[rows], expected.float())
    assert stats["m"] == 11.0
    for e in result:
        assert torch.equal(e.info["salt/zero_action_rollouts"], torch.ones(len(e.index)))
        assert torch.equal(e.info["salt/m"], torch.full((len(e.index),), 11.0))  # the empty row's NaN: the batch's


def test_geoalign_in_the_fork_counts_rollouts_without_action_tokens(up, tiny_path, monkeypatch):
    argv = "--advantage_estimator group_norm --geoalign.enable --geoalign.projector.steps 3".split()
    argv += "--geoalign.projector.hidden_sizes 16 --geoalign.projector.out_dim 8".split()
    maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
    result = maker.make_experience_batch(without_actions(rollouts(up, 3, seed=5, rewards=REWARDS), [0, 7]))
    for e in result:
        assert torch.equal(e.info["geo/zero_action_rollouts"], torch.full((len(e.index),), 2.0))
        assert torch.isfinite(e.info["geo/pairs"]).all()


def test_a_group_a_replacement_ties_keeps_its_slots_with_zero_advantages_and_is_counted(up, tiny_path, monkeypatch):
    """Dynamic filtering ran before (upstream's SamplesGenerator): prompt 0's [1, 1, 1, 0] passed it. Best-Random
    replaces its flagged 0 by a 1: the prompt keeps its 4 rows, all with advantage 0, and is counted."""
    rewards = torch.tensor([1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.float)
    flagged = torch.zeros(12, dtype=torch.bool)
    flagged[3] = True

    def detect(hidden, rewards, group_ids, config, generator, projector, stats):
        return torch.full((len(rewards),), math.nan, dtype=torch.float64), flagged.clone(), ""

    monkeypatch.setattr(geoalign.plan, "_detect", detect)
    maker = make_maker(up, tiny_path, monkeypatch, "--advantage_estimator group_norm --geoalign.enable".split(), 5)
    result = maker.make_experience_batch(rollouts(up, 3, seed=5, rewards=rewards))
    assert sum(len(e.index) for e in result) == 12  # nothing dropped, no prompt refilled
    advantages = row_advantages(result, 12)
    assert advantages[:4].tolist() == [0.0] * 4  # the donor's row (multiplicity 2) too: 0 x 2
    torch.testing.assert_close(advantages[4:], group_norm(rewards)[4:])
    for e in result:
        assert torch.equal(e.info["geo/zero_variance_groups_after"], torch.ones(len(e.index)))


def test_rewards_that_overflow_upstreams_float32_group_std_are_refused(up, tiny_path, monkeypatch):
    """±3e38 rewards: upstream's float32 std was inf, so every advantage was 0 and the loss exactly 0, silently."""
    maker = make_maker(up, tiny_path, monkeypatch, ["--advantage_estimator", "group_norm"], micro_batch=5)
    experiences, _ = forward_batch(maker, rollouts(up, 3, seed=5, rewards=torch.tensor([3e38, -3e38] * 6)))
    with pytest.raises(
        ValueError, match=r"^step 1: the reward gave rollout 0 \(prompt 0\) the reward 3e\+38; 12 of 12"
    ):
        maker.compute_advantages_and_returns(experiences)


# ── multi-turn agents (--train.agent_func_path): every action span counts ──
# Upstream's MultiTurnAgentExecutor runs examples/agents/two_turns.py against a scripted engine, and upstream's
# SamplesGenerator turns each rollout into an Experience whose action mask has one span per turn, the environment's
# tokens between and after them. Checked against a float64 brute force over the positions the executor recorded
# (`action_ranges`), independent of the mask the fork reads.

AGENT_MAX_LEN = 64  # the tiny model's max_position_embeddings


class CharTokenizer:
    """One token per character (ids 1..V-1), as the executor tokenizes observations and feedback."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": torch.tensor([[1 + ord(c) % (V - 1) for c in text]])}


class ScriptedEngine:
    """The vLLM engine the executor awaits: each turn samples 1-11 random tokens, at most the turn's max_tokens."""

    def __init__(self, seed):
        self.generator, self.max_tokens = torch.Generator().manual_seed(seed), []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.max_tokens.append(sampling_params.max_tokens)
        n = min(int(torch.randint(1, 12, (1,), generator=self.generator)), sampling_params.max_tokens)
        ids = torch.randint(1, V, (n,), generator=self.generator).tolist()
        return NS(outputs=[NS(token_ids=ids, text="".join(chr(97 + i % 26) for i in ids), finish_reason="stop",
                              logprobs=None)])  # fmt: skip


def agent_rollouts(n_prompts, seed):
    """(Experiences as upstream's SamplesGenerator makes them, the executor's responses) of N_PER_PROMPT rollouts per
    prompt, the agent loaded as upstream's vllm_engine loads --train.agent_func_path."""
    import asyncio
    import importlib.util

    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    path = Path(__file__).resolve().parents[1] / "examples/agents/two_turns.py"
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    executor, engine = module.AgentExecutor(), ScriptedEngine(seed)
    responses = []
    for p in range(n_prompts * N_PER_PROMPT):
        run = executor.execute(f"Q{p // N_PER_PROMPT}: 1 + 1 = ? A:", "", NS(max_tokens=16, logprobs=None),
                               AGENT_MAX_LEN, CharTokenizer(), engine)  # fmt: skip
        responses.append(asyncio.run(run))
    assert max(engine.max_tokens) == module.TURN_TOKENS  # the example caps each turn
    assert all(len(r["action_ranges"]) == module.TURNS for r in responses)
    samples = [SamplesGenerator._process_response_into_experience(None, r, max_len=AGENT_MAX_LEN) for r in responses]
    return samples, responses


def agent_reference(actor, response):
    """Independent of Actor.forward: one rollout's raw logits and final (lm_head input) hidden states in float64,
    its tokens and the positions of its action tokens (every turn's)."""
    tokens = response["observation_tokens"]
    seq = torch.tensor(tokens)[None]
    with torch.no_grad():
        out = actor.model(seq, attention_mask=torch.ones_like(seq), output_hidden_states=True)
    positions = [t for start, end in response["action_ranges"] for t in range(start, end)]
    return out.logits[0].double(), out.hidden_states[-1][0].double(), tokens, positions


def eq19(logits, hidden, tokens, positions, temperature):
    """SALT Eq. 19 by brute force, float64: vec((1/T) Σ_t (onehot(y_t) − softmax(z_{t−1}/τ)) h_{t−1}ᵀ / τ) over the
    action tokens at `positions` of one sequence (token t is produced by the logits at t − 1)."""
    grad = torch.zeros(logits.shape[1], hidden.shape[1], dtype=torch.float64)
    for t in positions:
        e = -torch.softmax(logits[t - 1] / temperature, -1)
        e[tokens[t]] += 1
        grad += torch.outer(e, hidden[t - 1] / temperature)
    return (grad / len(positions)).flatten()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_salt_features_sum_over_every_turn_and_geoalign_reads_the_last_action_token(up, tiny_path, packing):
    """SALT's features (exact and the default sketch) sum over every action token of every turn, not the last span
    nor every token after the first action; GeoAlign's hidden state is the last action token's, the final generated
    token, not the environment's last token (docs/architecture.md §5)."""
    from openrlhf_geo.features import lm_head_features

    samples, responses = agent_rollouts(1, seed=5)
    batch = up.experience.Experience.concat_experiences(samples, pad_token_id=0)  # right-padded, (B, S-1) masks
    actor = load_actor(up, tiny_path, packing, temperature=0.7)
    outs = {}
    for method in ("exact", "sketch"):  # V·d = 1536 > 256: the sketch really sketches
        spec = fork_hooks.GeometrySpec(features=method, dim=256, seed=3, hidden=True)
        with torch.no_grad():
            outs[method] = actor(batch.sequences, batch.action_mask, batch.attention_mask, True, geometry=spec)[1]
    for b, response in enumerate(responses):
        logits, hidden, tokens, positions = agent_reference(actor, response)
        exact = outs["exact"].geometry["features"][b].double()
        torch.testing.assert_close(exact, eq19(logits, hidden, tokens, positions, 0.7), atol=2e-6, rtol=1e-4)
        (start, _), (last_start, end) = response["action_ranges"]
        for wrong in (range(last_start, end), range(start, end)):  # the last span; every token after the first action
            assert (exact - eq19(logits, hidden, tokens, wrong, 0.7)).abs().max() > 1e-3
        # the sketch of the same tokens (the sketch itself: tests/test_features.py)
        mask = torch.zeros(1, len(tokens), dtype=torch.bool)
        mask[0, [t - 1 for t in positions]] = True
        labels = torch.tensor(tokens[1:] + [0])[None]
        sketch = lm_head_features(logits[None].float(), hidden[None].float(), labels, mask, "sketch", 256, seed=3,
                                  temperature=0.7)  # fmt: skip
        torch.testing.assert_close(outs["sketch"].geometry["features"][b], sketch[0], atol=2e-6, rtol=1e-4)
        # GeoAlign: the final generated token's hidden state; the environment's tokens follow it
        assert positions[-1] == end - 1 < len(tokens) - 1
        for out in outs.values():
            torch.testing.assert_close(out.geometry["hidden"][b].double(), hidden[end - 1], atol=1e-5, rtol=1e-5)
            assert (out.geometry["hidden"][b].double() - hidden[-1]).abs().max() > 1e-2


def test_the_experience_maker_hands_salt_and_geoalign_every_turn(up, tiny_path, monkeypatch, tmp_path):
    """Through the patched experience maker (micro-batches of 5), as a real run's step record holds it: each
    rollout's two action spans, SALT's lengths and features over both turns' tokens, GeoAlign's hidden states at the
    last action token; the record replays through the pipeline."""
    from smoke_helpers import assert_steps_replay

    argv = f"--advantage_estimator salt --salt.features exact --geoalign.enable {GEO_FAST}".split()
    monkeypatch.setenv("OPENRLHF_GEO_DUMP_DIR", str(tmp_path))
    maker = make_maker(up, tiny_path, monkeypatch, argv, micro_batch=5)
    samples, responses = agent_rollouts(4, seed=9)
    maker.make_experience_batch(copy.deepcopy(samples))
    dump = torch.load(tmp_path / "step0001.pt", weights_only=False)
    assert dump["spans"].tolist() == [2] * 16
    inputs, hidden = dump["advantage"]["inputs"], dump["curate"]["hidden"]
    assert type(inputs["features"]).__name__ == "ServedGrams"  # SALT got the ranks' Grams; the record, the features
    actor = load_actor(up, tiny_path)
    for i, response in enumerate(responses):  # the samples are in prompt order
        logits, states, tokens, positions = agent_reference(actor, response)
        assert int(dump["actions"][i]) == int(inputs["lengths"][i]) == len(positions)
        expected = eq19(logits, states, tokens, positions, 1.0)
        torch.testing.assert_close(dump["features"][i].double(), expected, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(hidden[i].double(), states[positions[-1]], atol=1e-5, rtol=1e-5)
    assert_steps_replay("agent", {1: dump})
