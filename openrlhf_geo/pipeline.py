"""The geometry pipeline: the one definition of every per-step quantity, shared by the fork and the local engine.

Both engines hand it plain tensors of one rollout batch in prompt order (N rollouts; `group_ids` (N,) prompt ids)
and call, in this order:

    rewards, corrupted = pipeline.corrupt(rewards, group_ids)    --reward.noise.*  reward noise
    step = pipeline.start(group_ids, corrupted, actions)         actions (N,): each rollout's action tokens
    rewards = step.adjust("reward", rewards, references=...)     the reward adjustments: --baseline.par_references
                                                                 PAR (local engine)
    slot_rewards = step.curate(rewards, hidden)                  the curation (registry.CURATIONS): --geoalign.*
                                                                 GeoAlign Eq. 3-8, or --baseline.curation PF-PPO /
                                                                 PODS; a plan of which rollout fills each slot
    (the engine's estimator, registry.ESTIMATORS, on the slot rewards -> sequence advantages a (N,))
    a_slot = step.adjust("advantage", a, responses=..., verifier=...,
                         features=..., entropy=..., lengths=..., partition_prompts=...)
                                                                 the advantage adjustments: --baseline.seed_grpo_alpha
                                                                 Seed-GRPO, then --salt.* SALT Eq. 12-18 per
                                                                 partition (salt_stage.reweight)
    value, multiplicity = step.rows(a_slot)                       what each rollout's row carries into the loss
    step.metrics                                                   {"salt/pr": (N,), "geo/flag_frac": (N,), ...}

Each `adjust` is a loop over the registered adjustments (registry.ADJUSTMENTS) of its stage that the run's
GeometryConfig turns on, in order, and `curate` runs the one registered curation it turns on. The engine's estimator
sits between the curation and the advantage adjustments (in the fork it is upstream's
compute_advantages_and_returns), which is why there are three calls and not one.

Replacement semantics (GeoAlign `replace`/`amplify`/`zero`/`drop`): slot i of the batch holds a copy of rollout
`plan.source[i]` with loss weight `plan.weight[i]`. Every rollout keeps its own row: (1) slot i gets the reward of
source[i] before the group statistics, (2) SALT runs on the slots (a replaced slot uses its source's features),
(3) row r's sequence advantage becomes the mean a' of the slots it fills and its token advantages are multiplied by
its multiplicity m_r = Σ_{i: source[i] = r} weight[i] (0 for a replaced rollout). PPO's per-token surrogate (clip,
dual-clip, IS correction) is positively homogeneous in the advantage, so for the policy loss this equals physically
duplicating the donors under seq-mean-token-mean, and under token-mean up to the positive scalar
(Σ_r m_r T_r)/(Σ_r T_r) per optimizer step (the token normalizer counts each row once); KL-loss terms keep the
original rollouts. `drop` (GeoAlign App. C.5's ablation) also removes the slot from the group statistics and from
SALT (`step.kept`); only the local engine supports it.

Metrics are per-slot (N,) float tensors: batch-level values are broadcast to the slots they describe, so a
sample-weighted mean (upstream's `info` logging; the local engine's `nanmean`) is the batch value, partition-size
weighted for SALT. String stats (`geo/skipped_reason`) live in `step.text_metrics`. The baselines' stats are
`baseline/<name>/<stat>`. When SALT applies, `salt/out_of_regime` flags steps far outside SALT Table 10's regime
(`SaltRegimeWarning`, docs/salt_regime.md).

Each stage is a function of its settings, its State, a `stages.Batch` and tensors; what one remembers across steps is
its own State (reward noise and PF-PPO: a random stream; GeoAlign: its stream and projector; SALT: its stream,
entropy-alpha's range and the warning clock), built once per run by its registration and held in
`GeometryPipeline.states` by stage name, which is all the pipeline checkpoints (format 2; a format-1 state of the
snapshots before 0.1.0 loads).

`SignalGuard` (one per engine, whatever the flags) checks each rollout batch for learning signal: it logs
`signal/truncated` and `signal/tied_groups` and warns (`LearningSignalWarning`) when most responses hit the length
limit or when every prompt's rollouts have had equal rewards for several steps in a row.
"""

import warnings
from dataclasses import dataclass
from typing import cast

import torch

from openrlhf_geo import GeoWarning, estimators, salt_stage  # noqa: F401  (register the estimators and SALT)
from openrlhf_geo.baselines import BaselineConfig
from openrlhf_geo.features import GeometrySpec
from openrlhf_geo.geoalign import GeoAlignConfig
from openrlhf_geo.groups import group_index, tied_groups
from openrlhf_geo.registry import ESTIMATORS, active_adjustments, active_curation, group_estimators
from openrlhf_geo.rewards.noise import NoiseConfig, corrupt
from openrlhf_geo.salt import SaltConfig
from openrlhf_geo.stages import Batch, CurationPlan, State, Stream, record

# The learning-signal guard. A response cut at the length limit has no final answer for a verifier to pay, and a
# prompt whose rollouts all got the same reward has zero group advantages: a run where that holds everywhere trains on
# nothing, and still exits 0. "Most" responses: above half; "several" steps: a streak of SIGNAL_FLAT_STEPS, so that a
# step or two of an all-right or all-wrong batch (common on easy or hard tasks) stays quiet.
SIGNAL_MAX_TRUNCATED = 0.5
SIGNAL_FLAT_STEPS = 3
SIGNAL_WARN_EVERY = 50  # steps between two warnings of one kind (the metrics are logged every step)


class LearningSignalWarning(GeoWarning):
    """The rollouts give the policy little or nothing to learn from (cut responses, or all rewards tied per prompt)."""


class SignalGuard:
    """Per rollout batch: `check(rewards, group_ids, truncated)` -> {"signal/truncated": share of responses that hit
    the length limit (when `truncated` (N,) bool is given), "signal/tied_groups": share of prompts whose rollouts all
    got the same reward}, warning at most once per SIGNAL_WARN_EVERY steps for each kind when the truncated share is
    above SIGNAL_MAX_TRUNCATED, or when every prompt has been tied for SIGNAL_FLAT_STEPS steps in a row.
    `max_new_tokens` (the engine's limit) is named in the warning. `state_dict`/`load_state_dict` keep the streak and
    the warning windows across a resume."""

    def __init__(self, max_new_tokens=None):
        self.max_new_tokens = max_new_tokens
        self.steps, self.flat_steps = 0, 0
        self.last_warning = {"truncated": None, "flat": None}  # step of each kind's last warning

    def check(self, rewards, group_ids, truncated=None) -> dict:
        self.steps += 1
        rewards = rewards.detach().cpu().double()
        group, n_groups = group_index(group_ids.detach())
        tied = float(tied_groups(rewards, group, n_groups).double().mean()) if n_groups else 0.0
        metrics = {"signal/tied_groups": tied}
        cut = None
        if truncated is not None:
            cut = float(truncated.detach().cpu().double().mean()) if truncated.numel() else 0.0
            metrics["signal/truncated"] = cut
            if cut > SIGNAL_MAX_TRUNCATED and self._due("truncated"):
                limit = f" ({self.max_new_tokens} new tokens)" if self.max_new_tokens is not None else ""
                counts = f"{int(truncated.sum())} of {truncated.numel()}"
                self._warn(
                    f"step {self.steps}: {100 * cut:.0f} % of the responses ({counts}) hit the length limit{limit} "
                    "without ending; a reward that needs the final answer pays them "
                    "nothing. If the task's answers are longer, raise --rollout.max_new_tokens"
                )
        self.flat_steps = self.flat_steps + 1 if n_groups and tied == 1.0 else 0
        if self.flat_steps >= SIGNAL_FLAT_STEPS and self._due("flat"):
            why = f"; {100 * cut:.0f} % of the responses were cut at the length limit" if cut else ""
            self._warn(
                f"steps {self.steps - self.flat_steps + 1}-{self.steps}: every prompt's rollouts got the same reward "
                f"(mean {float(rewards.mean()):g}, {n_groups} prompts of this step){why}: every group advantage is 0, "
                "no learning signal. Make the task fit the model (neither always right nor always wrong), or raise "
                "--rollout.n_samples_per_prompt (or --rollout.max_new_tokens when responses are cut)"
            )
        return metrics

    def _due(self, kind):
        last = self.last_warning[kind]
        if last is not None and self.steps - last < SIGNAL_WARN_EVERY:
            return False
        self.last_warning[kind] = self.steps
        return True

    def _warn(self, message):
        warnings.warn(
            f"{message} (signal/* is logged every step, this warning at most once per {SIGNAL_WARN_EVERY} steps).",
            LearningSignalWarning,
            stacklevel=3,
        )

    def state_dict(self) -> dict:
        return {"steps": self.steps, "flat_steps": self.flat_steps, "last_warning": dict(self.last_warning)}

    def load_state_dict(self, state) -> None:
        self.steps, self.flat_steps = state["steps"], state["flat_steps"]
        self.last_warning = dict(state["last_warning"])


@dataclass(frozen=True)
class GeometryConfig:
    """Everything the pipeline runs, built once at parse time (`options.validate` -> `args.geometry`), read by both
    engines and the pipeline.

    salt None: SALT off (SaltConfig.apply False: diagnostics only); geoalign None: GeoAlign off; baseline None: no
    --baseline.* flag (its policy loss is the engines', the rest runs here). `salt_base` (--salt.base) is the
    group-relative estimator whose sequence advantages SALT reweights; the engines run it as their advantage
    estimator. `seed` seeds the pipeline's random streams (the run's --train.seed). `estimator`: in the fork, a
    registered estimator upstream has no branch for (registry.Estimator.upstream False), which the pipeline computes
    in place of upstream's (options.validate); None otherwise.
    """

    salt: SaltConfig | None = None
    geoalign: GeoAlignConfig | None = None
    noise: NoiseConfig = NoiseConfig()
    baseline: BaselineConfig | None = None
    salt_base: str = "group_norm"
    seed: int = 0
    estimator: str | None = None

    def __post_init__(self):
        bases = group_estimators()
        entry = ESTIMATORS.get(self.salt_base)
        if entry is not None and entry.whitens is not None:
            raise ValueError(f"--salt.base {self.salt_base}: {entry.whitens}; use {', '.join(bases)}")
        if self.salt_base not in bases:
            raise ValueError(f"--salt.base must be one of {', '.join(bases)} (got {self.salt_base!r})")
        if self.geoalign is not None and self.baseline is not None and self.baseline.curation is not None:
            raise ValueError(
                f"--baseline.curation {self.baseline.curation} and --geoalign.enable both choose which rollouts to "
                "train on: use one of them"
            )

    @property
    def active(self) -> bool:
        baseline = self.baseline is not None and self.baseline.in_pipeline
        methods = self.salt is not None or self.geoalign is not None or self.estimator is not None
        return methods or self.noise.enabled or baseline

    @property
    def spec(self) -> GeometrySpec | None:
        """What the experience forward must return per response (None: nothing beyond log-probs)."""
        if self.salt is None:
            return GeometrySpec(hidden=True) if self.geoalign is not None else None
        return GeometrySpec(
            self.salt.features, self.salt.dim, self.salt.seed, self.salt.needs_entropy, self.geoalign is not None
        )


def check_finite(name: str, values: torch.Tensor, group_ids: torch.Tensor, step: int) -> None:
    """Raise a ValueError naming the step, the prompt and the value when `values` (N,) holds NaN/inf.

    Both engines call it on rewards and advantages before anything reaches an optimizer step or a checkpoint.
    """
    if values.dim() != 1 or values.shape != group_ids.shape:
        raise ValueError(f"step {step}: {name}s must have shape {tuple(group_ids.shape)}, got {tuple(values.shape)}")
    bad = ~torch.isfinite(values.detach().double())
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"step {step}: {name} of rollout {i} (prompt {int(group_ids[i])}) is {float(values[i])}; "
            f"{int(bad.sum())} of {values.numel()} are non-finite. Stopped before any optimizer step or checkpoint."
        )


# Checkpoints before 0.1.0 (format 1) kept every stage's memory in one flat dict; `_from_format_1` maps it onto the
# stages' own state dicts (format 2: {"format", "steps", "stages": {stage name: its State's state_dict}}).
STATE_FORMAT = 2


def _from_format_1(state: dict) -> dict:
    streams = state["generators"]
    stages = {
        "noise": {"generator": streams["noise"]},
        "salt": {
            "generator": streams["salt"],
            "entropy_range": state["entropy_range"],
            "last_regime_warning": state.get("last_regime_warning"),
        },
        "geoalign": {
            "generator": streams["geoalign"],
            "projector": state["projector"],
            "in_dim": state["projector_in_dim"],
        },
        # the baseline stream was PF-PPO's (PODS draws nothing)
        **{name: {"generator": streams["baseline"]} for name in ("pf_ppo_br", "pf_ppo_bw")},
    }
    return {"format": STATE_FORMAT, "steps": state["steps"], "stages": stages}


class GeometryPipeline:
    """One run's stages, in the order they run, and their states: reward noise, then the registered stages the
    config turns on: the reward adjustments (`adjustments["reward"]`), the curation, (the engine's estimator), the
    advantage adjustments with SALT last (`adjustments["advantage"]`). Each stage that remembers something across
    steps owns its State (`states`, by stage name); `state_dict`/`load_state_dict` checkpoint them all."""

    def __init__(self, config: GeometryConfig):
        self.config = config
        self.curation = active_curation(config)  # the registered Curation, or None
        self.adjustments = {stage: active_adjustments(config, stage) for stage in ("reward", "advantage")}
        # Independent streams: switching one method on never shifts another's random draws.
        self.states: dict[str, State] = {"noise": Stream(torch.Generator().manual_seed(config.noise.seed))}
        curation = [] if self.curation is None else [self.curation]
        for entry in (*self.adjustments["reward"], *curation, *self.adjustments["advantage"]):
            if (state := entry.state(getattr(config, entry.config), config.seed)) is not None:
                self.states[entry.name] = state
        self.steps = 0

    @property
    def active(self) -> bool:
        return self.config.active

    def corrupt(self, rewards, group_ids, paid=None) -> tuple[torch.Tensor, torch.Tensor]:
        """--reward.noise.*: (rewards (N,), group_ids (N,)) -> (rewards the trainer sees, corrupted (N,) bool).
        paid (N,) bool: the rollouts a misspecified verifier pays (type misspecified only; the engine's task hook)."""
        check_finite("reward", rewards, group_ids, self.steps + 1)
        noise = cast(Stream, self.states["noise"])  # the Stream __init__ built (load_state_dict only refills it)
        return corrupt(rewards, group_ids, self.config.noise, noise.generator, paid)

    def start(self, group_ids, corrupted=None, actions=None) -> "GeometryStep":
        """Begin one rollout batch of N = len(group_ids) rollouts in prompt order; actions (N,): each rollout's
        action tokens (a curation leaves a rollout without one out: GeoAlign, `geoalign.curate`)."""
        self.steps += 1
        actions = None if actions is None else actions.detach().cpu().long()
        return GeometryStep(self, group_ids.detach().cpu().long(), corrupted, actions)

    def state_dict(self) -> dict:
        stages = {name: state.state_dict() for name, state in self.states.items()}
        return {"format": STATE_FORMAT, "steps": self.steps, "stages": stages}

    def load_state_dict(self, state) -> None:
        """A checkpoint's pipeline state (either format); a stage the checkpoint has no state for starts fresh."""
        if "format" not in state:
            state = _from_format_1(state)
        for name, stage_state in self.states.items():
            if name in state["stages"]:
                stage_state.load_state_dict(state["stages"][name])
        self.steps = state["steps"]


class GeometryStep:
    """One rollout batch's steps; see the module docstring for the order and the replacement semantics."""

    def __init__(self, owner, group_ids, corrupted, actions=None):
        self.owner, self.group_ids, self.corrupted, self.actions = owner, group_ids, corrupted, actions
        self.size = group_ids.numel()
        self.plan = CurationPlan.identity(self.size)
        self.metrics = {}  # name -> (N,) float32 per slot
        self.text_metrics = {}  # name -> str
        self.batch_metrics = {}  # name -> float: stats of the whole batch before curation (reward adjustments)
        self.curation = None  # the curation's per-rollout record (`Curation.record`), e.g. GeoAlign's GDI
        if corrupted is not None and owner.config.noise.enabled:
            self.metrics["noise/corrupted"] = corrupted.detach().cpu().float()

    @property
    def kept(self) -> torch.Tensor:
        """(N,) bool: slots that take part in the group statistics and SALT (False only for plans that drop rollouts:
        GeoAlign `drop`, PODS, PF-PPO without keep_count; local engine only)."""
        return self.plan.keep

    def _batch(self) -> Batch:
        return Batch(self.group_ids, self.corrupted, self.plan.source, self.plan.keep, self.owner.steps, self.actions)

    def _record(self, prefix, stats, part=slice(None)):
        record(self.metrics, self.text_metrics, prefix, stats, self.size, part)

    def curate(self, rewards, hidden) -> torch.Tensor:
        """The registered curation (GeoAlign, PF-PPO, PODS, ...) between rewards and group statistics: rewards (N,)
        -> slot rewards rewards[source]. hidden (N, d): the input of a curation that `needs_hidden` (else None)."""
        entry = self.owner.curation
        if entry is None:
            return rewards
        settings = getattr(self.owner.config, entry.config)
        state = self.owner.states.get(entry.name)
        rewards_cpu = rewards.detach().cpu()
        plan, stats = entry.plan(settings, state, self._batch(), rewards_cpu, hidden)
        self.plan = plan.to("cpu")
        if entry.record is not None:
            self.curation = {
                entry.record: self.plan.score,
                "corrupted": self.corrupted,
                "flagged": self.plan.flagged,
                "rewards": rewards_cpu,  # the rewards the curation saw (the demo report's pair-count baseline)
                "group_ids": self.group_ids,
            }
        self._record(entry.metrics, stats)
        return rewards[self.plan.source.to(rewards.device)]

    def adjust(self, stage, values, **inputs) -> torch.Tensor:
        """The registered adjustments (registry.ADJUSTMENTS) of `stage` that the run's config turns on, in their
        order: values (N,) -> adjusted (N,); the identity when none is on. "reward": PAR on the rewards before
        `curate`, its stats batch scalars (`batch_metrics`: they describe every rollout, before any slot exists).
        "advantage": on the slot advantages after the engine's estimator, Seed-GRPO and then SALT (per partition,
        dropped slots 0), their stats per slot. `inputs`: zero-arg callables a stage reads (Adjustment.inputs),
        called only by one that runs; SALT's features(), entropy() and lengths() are per ROLLOUT (a slot reads its
        source's)."""
        check_finite(stage, values, self.group_ids, self.owner.steps)
        for entry in self.owner.adjustments[stage]:
            missing = [name for name in entry.inputs if name not in inputs]
            if missing:
                raise ValueError(f"{entry.flag}: the engine passed no {', '.join(missing)} for {entry.name}")
            settings, state = getattr(self.owner.config, entry.config), self.owner.states.get(entry.name)
            read = {name: inputs[name] for name in entry.inputs}
            values, stats = entry.adjust(settings, state, self._batch(), values, **read)
            if stage == "reward":
                self.batch_metrics.update({f"{entry.metrics}/{key}": value for key, value in stats.items()})
            else:
                self._record(entry.metrics, stats, self.kept)
        return values

    def rows(self, slot_advantages) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot a' (N,) -> (row value (N,), multiplicity (N,)): row r's sequence advantage is the mean a' of the
        slots it fills (identical copies agree up to solver rounding), its multiplicity the summed slot weights."""
        weight = (self.plan.weight * self.kept).to(slot_advantages.device, slot_advantages.dtype)
        source = self.plan.source.to(slot_advantages.device)
        count = torch.zeros_like(slot_advantages).index_add_(0, source, weight)
        total = torch.zeros_like(slot_advantages).index_add_(0, source, weight * slot_advantages)
        value = torch.where(count > 0, total / count.clamp(min=1e-12), slot_advantages)
        return value, count
