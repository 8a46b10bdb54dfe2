"""LoRA (`--ds.lora.rank`) in the fork: upstream's Actor wraps the model in PEFT, whose LoRA layers leave the LM head
out and frozen. SALT's Eq. 19 features and GeoAlign's hidden states come from the adapted forward as without LoRA,
and the weight sync sends vLLM the adapted policy under the base model's names (fork_hooks.VllmWeights)."""

from contextlib import contextmanager
from types import SimpleNamespace as NS

import pytest
import torch
from fork_helpers import hf_reference, toy_batch

from openrlhf_geo.fork import hooks as fork_hooks

pytestmark = pytest.mark.fork


def lora_actor(up, tiny_path, target_modules="all-linear", seed=0):
    """upstream's Actor with LoRA as PolicyModelActor builds it (rank 4, alpha 8; upstream's default targets every
    linear layer), fp32, its B matrices random (PEFT starts them at 0: the adapted model would be the base model)."""
    actor = up.Actor(tiny_path, attn_implementation="eager", param_dtype="bf16", lora_rank=4, lora_alpha=8,
                     target_modules=target_modules)  # fmt: skip
    actor.model.float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in actor.model.named_parameters():
        if ".lora_B." in name:
            p.data = 0.3 * torch.randn(p.shape, generator=g)
    return actor


@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "lm_head"]], ids=["default", "lm_head"])
def test_a_lora_actor_gives_eq19_features_of_its_lm_head_and_its_adapted_hidden_states(up, tiny_path, target_modules):
    """Eq. 19's G_i = (1/T_i) Σ_t e_t h_tᵀ of the adapted forward: the gradient the LM head's weight would get, frozen
    (PEFT's all-linear leaves the output layer out) or adapted (the gradient of its W + scale·B·A)."""
    actor = lora_actor(up, tiny_path, target_modules)
    head = actor.model.get_output_embeddings()
    weight = getattr(head, "base_layer", head).weight
    assert not weight.requires_grad and (target_modules == "all-linear") == isinstance(head, torch.nn.Linear)
    seq, attn, action = toy_batch(1)
    spec = fork_hooks.GeometrySpec(features="exact", hidden=True)
    with torch.no_grad():
        lp, out = actor(seq, action, attn, return_output=True, geometry=spec)
    ref_lp, _, hidden = hf_reference(actor, seq, attn, action, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    base = up.Actor(tiny_path, attn_implementation="eager", param_dtype="bf16")
    base.model.float().eval()
    with torch.no_grad():
        base_lp = base(seq, action, attn)
    assert (lp - base_lp).abs().max() > 1e-2  # the adapters are in the forward
    width = seq.shape[1] - 1 - action.shape[1]
    weight.requires_grad_(True)  # for autograd's reference only
    for b in range(seq.shape[0]):
        cols = action[b].nonzero()[:, 0]
        weight.grad = None
        grad_lp, *_ = hf_reference(actor, seq[b : b + 1], attn[b : b + 1], action[b : b + 1], 1.0)
        (grad_lp[0, cols].sum() / len(cols)).backward()
        torch.testing.assert_close(out.geometry["features"][b], weight.grad.flatten(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out.geometry["hidden"][b], hidden[b, width + cols[-1] + 1], atol=1e-5, rtol=1e-5)


class Gathers:
    """A stand-in for upstream's per-parameter gather (ZeRO-3): records which parameters are held at each moment."""

    def __init__(self):
        self.held = []

    @contextmanager
    def __call__(self, param):
        self.held.append(param)
        try:
            yield
        finally:
            self.held = [h for h in self.held if h is not param]


def merged_reference(actor):
    """PEFT's own merge (`merge_and_unload`) on a copy: the base model's (name, weight) pairs."""
    import copy

    return list(copy.deepcopy(actor.model).merge_and_unload().named_parameters())


def test_the_sync_sends_a_lora_actors_merged_weights_under_the_base_models_names(up, tiny_path):
    actor = lora_actor(up, tiny_path)
    model = actor.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gathers = Gathers()
    weights = fork_hooks.VllmWeights(model, list(model.named_parameters()), gathers)
    expected = merged_reference(actor)
    sent = []
    for name, tensor in weights:
        sent.append((name, tensor.clone()))
        if name.endswith("proj.weight"):  # an adapted layer: its base weight and both adapters held together
            assert len(gathers.held) == 3 and any(h.shape == tensor.shape for h in gathers.held)
        else:
            assert len(gathers.held) == 1 and gathers.held[0] is tensor
    assert not gathers.held
    assert len(weights) == len(sent)  # upstream marks the last one by this count
    assert [name for name, _ in sent] == [name for name, _ in expected]
    for (name, tensor), (_, reference) in zip(sent, expected):
        torch.testing.assert_close(tensor, reference, msg=name)
    for name, p in model.named_parameters():  # the actor's own weights untouched
        assert torch.equal(p, before[name]), name


def test_the_sync_sends_a_plain_actors_parameters_as_upstream(up, tiny_path):
    actor = up.Actor(tiny_path, attn_implementation="eager", param_dtype="bf16")
    params = list(actor.model.named_parameters())
    gathers = Gathers()
    sent = [
        (name, tensor, list(gathers.held)) for name, tensor in fork_hooks.VllmWeights(actor.model, params, gathers)
    ]
    assert [(name, tensor) for name, tensor, _ in sent] == params  # the same objects, in upstream's order
    assert all(held == [tensor] for _, tensor, held in sent)


def test_the_patched_broadcast_to_vllm_sends_base_names_and_marks_the_last(up, tiny_path, monkeypatch):
    """ActorPPOTrainer.broadcast_to_vllm as patched, rank 0, one engine whose update_weight records its calls."""
    ppo_actor = up.ppo_actor
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(ppo_actor.ray, "get", lambda refs: refs)
    calls, broadcast = [], []
    engine = NS(update_weight=NS(remote=lambda name, dtype, shape, empty_cache: calls.append((name, empty_cache))))
    actor = lora_actor(up, tiny_path)
    args = NS(vllm=NS(enable_prefix_caching=False, sync_with_ray=False), ds=NS(zero_stage=2, tensor_parallel_size=1))
    trainer = NS(
        strategy=NS(args=args),
        actor=NS(model=NS(module=actor.model)),
        vllm_engines=[engine],
        use_cuda_ipc=False,
        _model_update_group=NS(broadcast=lambda data, src, stream: broadcast.append(data.clone())),
    )
    ppo_actor.ActorPPOTrainer.broadcast_to_vllm(trainer)
    expected = merged_reference(actor)
    assert [name for name, _ in calls] == [name for name, _ in expected]
    assert [last for _, last in calls] == [False] * (len(expected) - 1) + [True]
    for data, (name, reference) in zip(broadcast, expected, strict=True):
        torch.testing.assert_close(data, reference, msg=name)


def test_the_smokes_weight_change_of_a_lora_run_is_that_of_its_merged_weights(up, tiny_path, tmp_path):
    """A LoRA run's final/ holds only its adapters (upstream saves PEFT's save_pretrained): the smoke's check merges
    them, max |W + scale·B·A - W|, PEFT's merge_and_unload against the base model."""
    from smoke_helpers import SCRIPT

    actor = lora_actor(up, tiny_path)
    actor.model.save_pretrained(tmp_path / "final")
    base = dict(up.Actor(tiny_path, attn_implementation="eager", param_dtype="bf16").model.float().named_parameters())
    merged = dict(merged_reference(actor))
    change = max(float((merged[k] - base[k]).detach().abs().max()) for k in base)
    assert change > 0
    torch.testing.assert_close(SCRIPT.weight_change(tiny_path, tmp_path / "final"), change, atol=0, rtol=1e-5)


def test_the_sync_sends_the_merged_layer_of_each_adapter_upstream_selects(up, tiny_path):
    """Upstream's vision-language actor syncs only its trainable parameters, with LoRA the adapters: each stands for
    its layer's merged weight, sent once (upstream sent the adapters themselves)."""
    actor = lora_actor(up, tiny_path)
    trainable = [(name, p) for name, p in actor.model.named_parameters() if p.requires_grad]
    sent = list(fork_hooks.VllmWeights(actor.model, trainable, Gathers()))
    expected = dict(merged_reference(actor))
    assert [name for name, _ in sent] == [name for name in expected if name.endswith("proj.weight")]
    for name, tensor in sent:
        torch.testing.assert_close(tensor, expected[name], msg=name)
