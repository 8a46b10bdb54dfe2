"""What varies between methods, registered once: advantage estimators, rollout curations, policy losses and reward /
advantage adjustments (SALT is the last advantage adjustment; its variants are rows of `salt.VARIANTS`).

Each entry carries its function, the config that holds its settings, what each engine cannot run (`fork` returns why
the fork refuses a setting; every method runs on the local engine) and the namespace of its logged metrics. An entry
is a pure function of explicit inputs (a `stages.Batch`, tensors) plus, where it remembers something across steps,
its own State (`state`: built once per run, checkpointed by the pipeline under the entry's name). The pipeline and
both engines dispatch through these tables, `options.validate` asks them which engine refuses what, and the
`--advantage_estimator`, `--baseline.curation` and `--baseline.policy_loss` choices are their names. A new method is
one function plus one registration (docs/architecture.md, "How to add ...").
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

ENGINES = ("local", "fork")

_F = TypeVar("_F")  # a registered function (an estimator's may be None: the fork only)
_E = TypeVar("_E", bound="Estimator | Curation | PolicyLoss | Adjustment")  # a registry's entry


def _runs_everywhere(settings) -> str | None:
    """No objection (the default `fork` and `check` of an entry)."""
    return None


def _stateless(settings, seed):
    """No State (the default `state` of an entry)."""
    return None


class Registry(dict):
    """name -> entry, in registration order; an unknown name is a ValueError listing the registered ones."""

    def __init__(self, flag: str):
        super().__init__()
        self.flag = flag

    def register(self, entry: _E) -> _E:
        if entry.name in self:
            raise ValueError(f"{self.flag} {entry.name!r} is registered twice")
        self[entry.name] = entry
        return entry

    def __missing__(self, name):
        raise ValueError(f"{self.flag} must be one of {', '.join(self)} (got {name!r})")


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator (--advantage_estimator <name>; `salt` is SALT on one of these, its --salt.base).

    advantages  (rewards (N,), group_ids (N,)) -> sequence advantages (N,): the local engine's computation; None:
                the fork only
    upstream    the fork runs upstream's own branch of this name (OpenRLHF 0.11.2's compute_advantages_and_returns);
                False: upstream's dr_grpo path runs and the fork's pipeline replaces its advantages with `advantages`
    whitens     None for an estimator whose advantages come from each prompt's own rollouts, without batch whitening
                (SALT's bases, and what a method that reads a prompt's group needs); else why it is not one
    """

    name: str
    advantages: Callable | None
    upstream: bool = False
    whitens: str | None = None

    def __post_init__(self) -> None:
        if self.advantages is None and not self.upstream:
            raise ValueError(f"estimator {self.name!r}: no function and no upstream branch computes it")


@dataclass(frozen=True)
class Curation:
    """Picks which rollout fills each slot of the batch, between the rewards and the group statistics.

    plan     (settings, state, batch: stages.Batch, rewards (N,) CPU, hidden (N, d) | None)
             -> (stages.CurationPlan, stats)
    state    (settings, seed) -> its State (None: it remembers nothing across steps); seed: the run's --train.seed
    config   the GeometryConfig field holding its settings ("baseline": chosen by --baseline.curation <name>;
             "geoalign": --geoalign.enable)
    metrics  the namespace its stats are logged under (<metrics>/<stat key>)
    record   the name its plan's per-rollout `score` has in the local engine's curation records (None: not recorded)
    drops    (settings) -> whether the plan can drop rollouts (keep False; only the local engine takes that)
    fork     (settings) -> why the fork cannot run it with these settings, None when it can
    check    (settings) -> what is wrong with its settings (BaselineConfig's validation calls it), None when fine
    needs_hidden  the plan reads the last-token hidden states (the fork gathers them only then)
    needs_groups  it picks among each prompt's rollouts: the estimator must be a group one (`group_estimators`)
    """

    name: str
    plan: Callable
    state: Callable = _stateless
    config: str = "baseline"
    metrics: str = "baseline"
    record: str | None = None
    drops: Callable = lambda settings: False
    fork: Callable = _runs_everywhere
    check: Callable = _runs_everywhere
    needs_hidden: bool = False
    needs_groups: bool = True


@dataclass(frozen=True)
class PolicyLoss:
    """The per-token policy loss (--baseline.policy_loss <name>), with its settings in BaselineConfig.

    loss       (config, log_probs, old_log_probs, advantages (N, T), mask, clip_low, clip_high, generator)
               -> (per-token loss (N, T), stats)
    upstream   the fork keeps upstream's PolicyLoss (the same loss, with its own options); False: the fork calls `loss`
    clip_frac  the stats key of the share of valid tokens the PPO ratio clip cuts off (logged as clip_frac);
               None: no ratio clip, clip_frac 0
    check      (config, eps_low) -> why the engine's PPO clip ratios do not fit this loss, None when they do
    metrics    the namespace its stats are logged under (<metrics>/<stat key>; None: not logged)
    """

    name: str
    loss: Callable
    upstream: bool = False
    clip_frac: str | None = None
    check: Callable = lambda config, eps_low: None
    metrics: str | None = "baseline"


@dataclass(frozen=True)
class Adjustment:
    """A stage that changes the rewards (stage "reward", before curation) or the slots' sequence advantages (stage
    "advantage", after the engine's estimator) without choosing rollouts: the --baseline.* adjustments (PAR,
    Seed-GRPO) and SALT.

    flag     the flag that turns it on (for messages)
    adjust   (settings, state, batch: stages.Batch, values (N,), **inputs) -> (adjusted values (N,), stats); each
             input a zero-arg callable the engine passes (`GeometryStep.adjust`), called only when the stage runs.
             stats: {key: float | None} (a "reward" stage's are batch scalars; an "advantage" stage's describe the
             kept slots) or {key: (N,) tensor} (already per slot: SALT's per-partition stats)
    enabled  (settings) -> whether its flag is on (asked only when its `config` field is set)
    inputs   the names of the inputs it reads ("references": PAR's reference rewards, "responses" and "verifier":
             the decoded responses and the math verifier, "features", "entropy", "lengths", "partition_prompts":
             SALT's); an engine that cannot provide one refuses it (`fork`)
    config   the GeometryConfig field holding its settings (None there: off)
    state    (settings, seed) -> its State (None: it remembers nothing across steps); seed: the run's --train.seed
    order    its place among its stage's entries (lower first; registration order among equals): SALT is 1, after
             the advantage baselines, because it reweights the final group advantages (SALT §3.1)
    fork     (settings) -> why the fork cannot run it, None when it can
    metrics  the namespace its stats are logged under (<metrics>/<stat key>)
    needs_groups  it reads each prompt's rollouts as a group: the engine's estimator must be per-prompt without
             batch whitening (`group_estimators`)
    """

    name: str
    stage: str
    flag: str
    adjust: Callable
    enabled: Callable
    inputs: tuple = ()
    config: str = "baseline"
    state: Callable = _stateless
    order: int = 0
    fork: Callable = _runs_everywhere
    metrics: str = "baseline"
    needs_groups: bool = True


ESTIMATORS = Registry("--advantage_estimator")
CURATIONS = Registry("--baseline.curation")
POLICY_LOSSES = Registry("--baseline.policy_loss")
ADJUSTMENTS = Registry("an adjustment (--baseline.*, SALT)")


def register_estimator(name: str, **info: Any) -> Callable[[_F], _F]:
    """Decorator: register `advantages` as estimator `name` (Estimator's fields as keywords)."""

    def add(advantages):
        ESTIMATORS.register(Estimator(name, advantages, **info))
        return advantages

    return add


def group_estimators() -> tuple:
    """The estimators whose sequence advantages come from each prompt's own rollouts, without batch whitening."""
    return tuple(name for name, entry in ESTIMATORS.items() if entry.whitens is None)


def local_estimators() -> tuple:
    """The estimators the local engine computes."""
    return tuple(name for name, entry in ESTIMATORS.items() if entry.advantages is not None)


def register_curation(name: str, **info: Any) -> Callable[[_F], _F]:
    """Decorator: register `plan` as curation `name` (Curation's fields as keywords)."""

    def add(plan):
        CURATIONS.register(Curation(name, plan, **info))
        return plan

    return add


def register_policy_loss(name: str, **info: Any) -> Callable[[_F], _F]:
    """Decorator: register `loss` as policy loss `name` (PolicyLoss's fields as keywords)."""

    def add(loss):
        POLICY_LOSSES.register(PolicyLoss(name, loss, **info))
        return loss

    return add


def register_adjustment(name: str, stage: str, flag: str, **info: Any) -> Callable[[_F], _F]:
    """Decorator: register `adjust` as adjustment `name` at `stage` ("reward" or "advantage"), on with `flag`
    (Adjustment's fields as keywords)."""

    def add(adjust):
        ADJUSTMENTS.register(Adjustment(name, stage, flag, adjust, **info))
        return adjust

    return add


def active_adjustments(config, stage: str | None = None) -> list:
    """The adjustments a GeometryConfig turns on, in the order they run (`order`, then registration); only `stage`'s
    when given."""
    entries = [
        entry
        for entry in ADJUSTMENTS.values()
        if (stage is None or entry.stage == stage)
        and (settings := getattr(config, entry.config)) is not None
        and entry.enabled(settings)
    ]
    return sorted(entries, key=lambda entry: entry.order)


def adjustment_inputs(config) -> set:
    """The inputs (Adjustment.inputs) the adjustments a GeometryConfig turns on read: what an engine must prepare
    before the first step (PAR's reference policy, Seed-GRPO's verifier)."""
    return {name for entry in active_adjustments(config) for name in entry.inputs}


def baseline_curations() -> tuple:
    """The --baseline.curation choices: every curation whose settings live in BaselineConfig."""
    return tuple(name for name, entry in CURATIONS.items() if entry.config == "baseline")


def active_curation(config) -> Curation | None:
    """The curation a GeometryConfig turns on (GeoAlign or a --baseline.curation), or None."""
    if config.geoalign is not None:
        return next(entry for entry in CURATIONS.values() if entry.config == "geoalign")
    if config.baseline is not None and config.baseline.curation is not None:
        return CURATIONS[config.baseline.curation]
    return None


def refusals(config, engine: str, estimator: str | None = None) -> list:
    """Why `engine` cannot run the methods a GeometryConfig turns on with advantage `estimator` (the base one, after
    `salt` is mapped to --salt.base; None: not checked), empty when it can, in pipeline order."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    curation = active_curation(config)
    entries = [(entry, entry.flag) for entry in active_adjustments(config, "reward")]
    if curation is not None:
        flag = "--geoalign.enable" if curation.config == "geoalign" else f"--baseline.curation {curation.name}"
        entries.append((curation, flag))
    entries += [(entry, entry.flag) for entry in active_adjustments(config, "advantage")]
    via = " (from --salt.base)" if config.salt is not None and config.salt.apply else ""
    out = []
    for entry, flag in entries:
        if engine == "fork":
            out.append(entry.fork(getattr(config, entry.config)))
        if entry.needs_groups and estimator is not None and estimator not in group_estimators():
            out.append(
                f"{flag} needs a per-prompt group estimator without batch whitening: {', '.join(group_estimators())} "
                f"or salt with one of them as --salt.base (got {estimator!r}{via})"
            )
    return [message for message in out if message is not None]
