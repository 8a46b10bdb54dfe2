"""The method registries: a new estimator, curation, adjustment or policy loss is one function plus one
registration, and runs through the pipeline and the local engine; the fork's refusals and the flag choices come from
the registries; a stage reads its inputs and its own state, never the pipeline."""

import argparse
import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from openrlhf_geo import options, registry
from openrlhf_geo.baselines import BaselineConfig
from openrlhf_geo.lab.task import build_model, build_tokenizer
from openrlhf_geo.local.engine import Rollouts, Trainer
from openrlhf_geo.local.flags import parse_args
from openrlhf_geo.pipeline import GeometryConfig, GeometryPipeline
from openrlhf_geo.salt import VARIANTS, SaltConfig, Variant, salt_advantages
from openrlhf_geo.stages import CurationPlan

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def drop_last_plan(config, state, batch, rewards, hidden):
    """Toy curation: each prompt's last rollout leaves the batch."""
    plan = CurationPlan.identity(len(rewards))
    last = torch.ones_like(plan.keep)
    last[:-1] = batch.group_ids[1:] != batch.group_ids[:-1]
    plan.keep[last], plan.weight[last], plan.flagged[last] = False, 0.0, True
    return plan, {"toy/dropped_frac": float(last.double().mean())}


def unclipped_loss(config, log_probs, old_log_probs, advantages, mask, clip_low, clip_high, generator):
    """Toy policy loss: the surrogate -A r without a ratio clip."""
    ratio = torch.exp(log_probs - old_log_probs)
    return torch.where(mask, -advantages * ratio, 0.0), {"toy_loss/ratio_mean": float(ratio.detach()[mask].mean())}


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(registry.CURATIONS, "toy", registry.Curation("toy", drop_last_plan, drops=lambda c: True))
    monkeypatch.setitem(registry.POLICY_LOSSES, "toy_loss", registry.PolicyLoss("toy_loss", unclipped_loss))


def test_a_registered_curation_runs_through_the_pipeline(toys):
    pipeline = GeometryPipeline(GeometryConfig(baseline=BaselineConfig(curation="toy")))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    step = pipeline.start(group_ids)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    assert torch.equal(step.curate(rewards, None), rewards)  # nothing replaced
    assert step.kept.tolist() == [True, True, False, True, True, False]
    _, multiplicity = step.rows(torch.ones(6))
    assert multiplicity.tolist() == [1, 1, 0, 1, 1, 0]
    assert step.metrics["baseline/toy/dropped_frac"].tolist() == [pytest.approx(1 / 3)] * 6


def test_a_registered_curation_and_policy_loss_train_on_the_local_engine(toys):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    args = parse_args(
        ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused"]
        + ["--baseline.curation", "toy", "--baseline.policy_loss", "toy_loss", "--actor.adam.lr", "1e-2"]
    )
    prompts, responses = ["1+2="] * 3 + ["2+2="] * 3, ["\\boxed{3}", "5", "\\boxed{3}", "\\boxed{4}", "1", "2"]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    before = [p.detach().clone() for p in model.parameters()]
    metrics = Trainer(args, model, tokenizer, [], None).learn(hand_batch(tokenizer, prompts, responses, rewards))
    assert metrics["baseline/toy/dropped_frac"] == pytest.approx(1 / 3)
    assert metrics["baseline/toy_loss/ratio_mean"] == pytest.approx(1.0)  # one epoch: the old policy's ratios
    assert metrics["clip_frac"] == 0.0  # registered without a ratio clip
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def halve_first(config, state, batch, advantages, *, responses):
    """Toy adjustment: halves the advantage of each prompt's first slot, reading the responses it was given."""
    first = torch.ones(batch.size, dtype=torch.bool)
    first[1:] = batch.group_ids[1:] != batch.group_ids[:-1]
    return torch.where(first, advantages / 2, advantages), {"toy_adjust/responses": float(len(responses()))}


def test_a_registered_adjustment_runs_through_the_pipeline_and_both_refusal_paths(monkeypatch):
    toy = registry.Adjustment(
        "toy_adjust", "advantage", "--baseline.seed_grpo_alpha", halve_first, lambda c: c.seed_grpo_alpha == 0.5,
        inputs=("responses",), fork=lambda c: "toy_adjust: no fork",
    )  # fmt: skip
    monkeypatch.setitem(registry.ADJUSTMENTS, "toy_adjust", toy)
    monkeypatch.delitem(registry.ADJUSTMENTS, "seed_grpo")  # the toy alone on its flag
    step = GeometryPipeline(GeometryConfig(baseline=BaselineConfig(seed_grpo_alpha=0.5))).start(
        torch.tensor([0, 0, 1, 1])
    )
    a = torch.tensor([1.0, -1.0, 2.0, -2.0])
    assert step.adjust("reward", a) is a  # another stage: the identity
    calls = []
    got = step.adjust("advantage", a, responses=lambda: calls.append(1) or ["x"] * 4)
    assert got.tolist() == [0.5, -1.0, 1.0, -2.0] and calls == [1]
    assert step.metrics["baseline/toy_adjust/responses"].tolist() == [4.0] * 4
    with pytest.raises(ValueError, match="passed no responses for toy_adjust"):
        step.adjust("advantage", a)
    off = GeometryPipeline(GeometryConfig(baseline=BaselineConfig(seed_grpo_alpha=0.1))).start(torch.zeros(2).long())
    assert off.adjust("advantage", a[:2], responses=lambda: pytest.fail("called")) is not None  # off: not called
    parse(["--baseline.seed_grpo_alpha", "0.5"])  # the local engine runs it
    with pytest.raises(ValueError, match="toy_adjust: no fork"):
        parse(["--baseline.seed_grpo_alpha", "0.5"], engine="fork")
    (refused,) = registry.refusals(GeometryConfig(baseline=BaselineConfig(seed_grpo_alpha=0.5)), "local", "rloo_x")
    assert refused.startswith("--baseline.seed_grpo_alpha needs a per-prompt group estimator")  # needs_groups


class Counter:
    """Toy State: counts the batches its curation saw."""

    def __init__(self, start):
        self.calls = start

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def counting_plan(config, state, batch, rewards, hidden):
    state.calls += 1
    return CurationPlan.identity(len(rewards)), {"calls": float(state.calls)}


def test_a_curation_owns_its_state_and_the_pipeline_checkpoints_it_under_the_curations_name(monkeypatch):
    toy = registry.Curation("toy", counting_plan, state=lambda config, seed: Counter(10 * seed))
    monkeypatch.setitem(registry.CURATIONS, "toy", toy)
    config = GeometryConfig(baseline=BaselineConfig(curation="toy"), seed=2)
    first = GeometryPipeline(config)
    for _ in range(2):
        first.start(torch.tensor([0, 0])).curate(torch.tensor([0.0, 1.0]), None)
    assert first.states["toy"].calls == 22  # built from the run's seed, updated by the stage alone
    state = first.state_dict()
    assert state["stages"]["toy"] == {"calls": 22}
    resumed = GeometryPipeline(config)
    resumed.load_state_dict(state)
    step = resumed.start(torch.tensor([0, 0]))
    step.curate(torch.tensor([0.0, 1.0]), None)
    assert step.metrics["baseline/calls"].tolist() == [23.0, 23.0]


def record_then_add(config, state, batch, advantages):
    """Toy advantage adjustment with a State: records the advantages it was given, adds its call count."""
    state.calls += 1
    state.seen.append(advantages.clone())
    return advantages + state.calls, {"calls": float(state.calls)}


class Seen(Counter):
    def __init__(self, start):
        super().__init__(start)
        self.seen = []


def test_an_advantage_adjustment_owns_its_state_and_runs_before_or_after_salt_by_its_order(monkeypatch):
    """SALT is registered as the "advantage" adjustment of order 1: an entry of order 0 (registered after it) runs
    before it and one of order 2 after it; each one's State is built from the run's seed and checkpointed. (The toys
    read SaltConfig as their settings: on whenever SALT is.)"""
    for name, order in (("toy_before", 0), ("toy_after", 2)):
        toy = registry.Adjustment(
            name, "advantage", "--toy", record_then_add, lambda c: True, config="salt", order=order,
            state=lambda config, seed: Seen(100 * seed), metrics=name,
        )  # fmt: skip
        monkeypatch.setitem(registry.ADJUSTMENTS, name, toy)
    salt = SaltConfig(features="exact")
    config = GeometryConfig(salt=salt, seed=1)
    pipe = GeometryPipeline(config)
    assert [entry.name for entry in pipe.adjustments["advantage"]] == ["toy_before", "salt", "toy_after"]
    group_ids = torch.arange(8) // 4
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, generator=g, dtype=torch.float64)
    features = torch.randn(8, 12, generator=g, dtype=torch.float64)
    inputs = {"features": lambda: features, "entropy": lambda: None, "lengths": lambda: torch.full((8,), 3.0)}
    step = pipe.start(group_ids)
    out = step.adjust("advantage", a, partition_prompts=lambda: 0, **inputs)
    before, after = pipe.states["toy_before"], pipe.states["toy_after"]
    torch.testing.assert_close(before.seen[0], a)
    expected, _ = salt_advantages(a + 101, features)  # SALT on the first toy's output
    torch.testing.assert_close(after.seen[0], expected)
    torch.testing.assert_close(out, expected + 101)
    assert step.metrics["toy_after/calls"].tolist() == [101.0] * 8
    assert pipe.state_dict()["stages"]["toy_after"] == {"calls": 101}
    assert list(pipe.state_dict()["stages"]) == ["noise", "toy_before", "salt", "toy_after"]


def test_stages_never_read_the_pipeline():
    """What a registered stage is handed: its settings, its own state, a stages.Batch and tensors. None of the modules
    that register stages imports the pipeline, names its objects or reaches for an owner."""
    geoalign = sorted(f"geoalign/{path.stem}" for path in (ROOT / "openrlhf_geo" / "geoalign").glob("*.py"))
    for module in ("baselines", "estimators", *geoalign, "losses", "salt_stage"):
        tree = ast.parse((ROOT / "openrlhf_geo" / f"{module}.py").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {"pipeline", "openrlhf_geo.pipeline"} & imported, module
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert not {"GeometryStep", "GeometryPipeline"} & names, module
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "owner"], module


def leave_one_out_mean(rewards, group_ids):
    """Toy estimator: r_i minus the mean of its prompt's other rollouts (RLOO), computed here."""
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        rows = group_ids == g
        r = rewards[rows]
        out[rows] = r - (r.sum() - r) / max(len(r) - 1, 1)
    return out


def test_an_estimator_registered_after_the_flags_import_is_a_choice_and_a_salt_base(monkeypatch):
    """The train command's choices are read from the registry when its parser is built, not copied at import."""
    from openrlhf_geo.local import flags

    toy = registry.Estimator("toy_late", leave_one_out_mean, upstream=False)
    monkeypatch.setitem(registry.ESTIMATORS, "toy_late", toy)  # after openrlhf_geo.local.flags was imported
    base = ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused"]
    assert parse_args([*base, "--advantage_estimator", "toy_late"]).algo.advantage.estimator == "toy_late"
    salt = parse_args([*base, "--advantage_estimator", "salt", "--salt.base", "toy_late"])
    assert (salt.salt.enable, salt.geometry.salt_base) == (True, "toy_late")
    assert "toy_late" in flags.build_parser().format_help()
    monkeypatch.delitem(registry.ESTIMATORS, "toy_late")
    with pytest.raises(ValueError, match="invalid choice: 'toy_late'"):
        parse_args([*base, "--advantage_estimator", "toy_late"])


def test_a_registered_estimator_is_a_flag_choice_and_trains_on_the_local_engine(monkeypatch):
    monkeypatch.setitem(
        registry.ESTIMATORS, "toy_rloo", registry.Estimator("toy_rloo", leave_one_out_mean, upstream=False)
    )
    assert "toy_rloo" in registry.group_estimators()  # no whitening: SALT and the group methods may use it
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    args = parse_args(
        ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused", "--actor.adam.lr", "1e-2"]
        + ["--advantage_estimator", "toy_rloo"]
    )
    prompts, responses = ["1+2="] * 3 + ["2+2="] * 3, ["\\boxed{3}", "5", "\\boxed{3}", "\\boxed{4}", "1", "2"]
    trainer = Trainer(args, model, tokenizer, [], None)
    seen = []
    trainer._update = lambda batch, advantages: seen.append(advantages) or {}
    trainer.learn(hand_batch(tokenizer, prompts, responses, [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]))
    assert seen[0].tolist() == pytest.approx([0.5, -1.0, 0.5, 1.0, -0.5, -0.5])  # r - mean of the other two


def test_a_salt_variant_row_parses_and_trains_on_the_local_engine(monkeypatch):
    """A new row of salt.VARIANTS is the whole change: --salt.variant takes it, the engine runs it (no projection
    and no exploration channel: a' = a, so the applied advantages are GRPO's)."""
    monkeypatch.setitem(VARIANTS, "toy-identity", Variant(projector="none", explore=False))
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    args = parse_args(
        ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "unused", "--actor.adam.lr", "1e-2"]
        + ["--advantage_estimator", "salt", "--salt.variant", "toy-identity", "--salt.features", "exact"]
    )
    assert args.salt.variant == "toy-identity"
    prompts, responses = ["1+2="] * 3 + ["2+2="] * 3, ["\\boxed{3}", "5", "\\boxed{3}", "\\boxed{4}", "1", "2"]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    before = [p.detach().clone() for p in model.parameters()]
    metrics = Trainer(args, model, tokenizer, [], None).learn(hand_batch(tokenizer, prompts, responses, rewards))
    assert metrics["salt/D_a"] == 0.0 and metrics["salt/U_perp_gain"] == 1.0  # a' = a
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def hand_batch(tokenizer, prompts, responses, rewards):
    """Rollouts laid out like `generate_rollouts`, built by hand (each prompt's rollouts consecutive)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    p_ids = [tokenizer(p)["input_ids"] for p in prompts]
    r_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [eos] for r in responses]
    width, length = max(map(len, p_ids)), max(map(len, r_ids))
    names = list(dict.fromkeys(prompts))
    return Rollouts(
        sequences=torch.tensor(
            [[pad] * (width - len(p)) + p + r + [pad] * (length - len(r)) for p, r in zip(p_ids, r_ids)]
        ),
        attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + length) for p in p_ids]),
        mask=torch.tensor([[True] * len(r) + [False] * (length - len(r)) for r in r_ids]),
        group_ids=torch.tensor([names.index(p) for p in prompts]),
        prompts=list(prompts),
        responses=list(responses),
        answers=[""] * len(prompts),
        prompt_width=width,
        rewards=torch.tensor(rewards),
    )


def parse(argv, engine="local"):
    """The shared flags on a bare parser (no engine flags), validated for `engine`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo.advantage.estimator", "--advantage_estimator", default="group_norm")
    parser.add_argument("--train.seed", type=int, default=0)
    options.add_args(parser)
    args = options.nest(parser.parse_args(argv))
    options.validate(args, engine=engine)
    return args


def test_flag_choices_are_the_registered_names(toys):
    parse(["--baseline.curation", "toy", "--baseline.policy_loss", "toy_loss"])
    with pytest.raises(SystemExit):
        parse(["--baseline.curation", "geoalign"])  # GeoAlign is --geoalign.enable, not a --baseline.curation


def test_the_fork_refuses_what_the_registry_says_and_the_local_engine_runs_everything(toys, monkeypatch):
    for argv in (["--baseline.curation", "pods", "--baseline.pods_m", "2"], ["--baseline.par_references", "1"]):
        parse(argv)  # local
        with pytest.raises(ValueError, match="local engine"):
            parse(argv, engine="fork")
    toy = registry.CURATIONS["toy"]
    monkeypatch.setitem(registry.CURATIONS, "toy", registry.Curation("toy", toy.plan, fork=lambda c: "toy: no fork"))
    with pytest.raises(ValueError, match="toy: no fork"):
        parse(["--baseline.curation", "toy"], engine="fork")
    parse(["--baseline.curation", "pf_ppo_br", "--baseline.pf_ppo_keep_count"], engine="fork")


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match="--baseline.policy_loss must be one of ppo, clip_cov, kl_cov"):
        registry.POLICY_LOSSES["bogus"]
    with pytest.raises(ValueError, match="--baseline.curation must be one of pf_ppo_br, pf_ppo_bw, pods"):
        BaselineConfig(curation="bogus")
    with pytest.raises(ValueError, match="registered twice"):
        registry.POLICY_LOSSES.register(registry.PolicyLoss("ppo", unclipped_loss))


def test_the_architecture_doc_names_every_registered_method():
    text = ARCHITECTURE.read_text()
    names = [*registry.CURATIONS, *registry.POLICY_LOSSES, *registry.ADJUSTMENTS, *VARIANTS]
    assert [name for name in names if f"`{name}`" not in text] == []


def test_every_path_and_name_in_the_architecture_doc_exists():
    """The flag paths and recipes name files (`openrlhf_geo/x.py`) and code (`module.name`): all must exist."""
    text = ARCHITECTURE.read_text()
    paths = set(re.findall(r"`((?:openrlhf_geo|tests|patches|docs)/[\w./-]+)`", text))
    paths = {p for p in paths if "NAME" not in p}  # placeholders of a recipe (docs/studies/NAME.md)
    assert paths and [p for p in sorted(paths) if not (ROOT / p).exists()] == []
    names = {n for n in re.findall(r"`([A-Za-z_]\w*(?:\.\w+)+)(?:\(\))?`", text) if not re.search(r"\.(py|md)$", n)}
    resolved, missing = 0, []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest prefix that is a module of the package
            try:
                obj = importlib.import_module(".".join(["openrlhf_geo", *parts[:cut]]))
            except ImportError:
                continue
            for part in parts[cut:]:
                obj = getattr(obj, part, None)
            resolved += 1
            if obj is None:
                missing.append(name)
            break
    assert resolved >= 30 and missing == []


def test_the_traced_flag_paths_list_the_files_their_code_lives_in():
    """docs/architecture.md §1 traces --salt.variant and --geoalign.alpha: the files it lists are those of the code it
    names there, and their count per engine is the one it states."""
    text = ARCHITECTURE.read_text()
    for flag in ("--salt.variant", "--geoalign.alpha"):
        item = re.search(rf"^- `{re.escape(flag)}`, (\d+) files: (.*?)\n(?=- |\n)", text, re.M | re.S)
        assert item is not None, flag
        listed = set(re.findall(r"`((?:\w+/)?\w+\.py)`", item[2]))
        named = set()
        for name in re.findall(r"`([a-z_]+(?:\.[A-Za-z_]\w*)+)`", item[2]):
            if name.endswith(".py"):
                continue
            parts = name.split(".")
            cut = next(c for c in range(len(parts), 0, -1) if _is_module("openrlhf_geo." + ".".join(parts[:c])))
            named.add("/".join(parts[:cut]) + ".py")
        assert named <= listed and listed - named <= {"config_flags.py"}, flag  # config_flags: the generated flag
        engines = {"local/engine.py", "fork/hooks.py"}
        assert engines <= listed and len(listed) - 1 == int(item[1]), flag  # one engine's adapter per run


def _is_module(name):
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
