"""What varies between methods, registered once: rollout curations, policy losses and reward / advantage
adjustments. SALT's variants are rows of `salt.VARIANTS`.

Each entry carries its function, the config that holds its settings, what each engine cannot run (`fork` returns why
the fork refuses a setting; every method runs on the local engine) and the namespace of its logged metrics. The
pipeline and both engines dispatch through these tables, `options.validate` asks them which engine refuses what, and
the `--baseline.curation` / `--baseline.policy_loss` choices are their names. A new method is one function plus one
registration (docs/architecture.md, "How to add ...").
"""

from collections.abc import Callable
from dataclasses import dataclass

ENGINES = ("local", "fork")
# the estimators whose sequence advantages come from each prompt's own rollouts, without batch whitening: a method that
# reads or rearranges a prompt's group (`needs_groups`) runs only on these (both engines; the local engine's are the
# first two)
GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo")


def _runs_everywhere(settings) -> str | None:
    """No objection (the default `fork` and `check` of an entry)."""
    return None


class Registry(dict):
    """name -> entry, in registration order; an unknown name is a ValueError listing the registered ones."""

    def __init__(self, flag: str):
        super().__init__()
        self.flag = flag

    def register(self, entry):
        if entry.name in self:
            raise ValueError(f"{self.flag} {entry.name!r} is registered twice")
        self[entry.name] = entry
        return entry

    def __missing__(self, name):
        raise ValueError(f"{self.flag} must be one of {', '.join(self)} (got {name!r})")


@dataclass(frozen=True)
class Curation:
    """Picks which rollout fills each slot of the batch, between the rewards and the group statistics.

    plan     (step, rewards (N,) CPU, hidden (N, d) | None) -> (geoalign.CurationPlan, stats); `step` is the
             pipeline's GeometryStep (group_ids, corrupted, owner: configs, generators, projector)
    config   the GeometryConfig field holding its settings ("baseline": chosen by --baseline.curation <name>;
             "geoalign": --geoalign.enable)
    metrics  the namespace its stats are logged under (<metrics>/<stat key>)
    drops    (settings) -> whether the plan can drop rollouts (keep False; only the local engine takes that)
    fork     (settings) -> why the fork cannot run it with these settings, None when it can
    check    (settings) -> what is wrong with its settings (BaselineConfig's validation calls it), None when fine
    needs_hidden  the plan reads the last-token hidden states (the fork gathers them only then)
    needs_groups  it picks among each prompt's rollouts: the estimator must be one of GROUP_ESTIMATORS
    """

    name: str
    plan: Callable
    config: str = "baseline"
    metrics: str = "baseline"
    drops: Callable = lambda settings: False
    fork: Callable = _runs_everywhere
    check: Callable = _runs_everywhere
    needs_hidden: bool = False
    needs_groups: bool = True


@dataclass(frozen=True)
class PolicyLoss:
    """The per-token policy loss (--baseline.policy_loss <name>), with its settings in BaselineConfig.

    loss       (config, log_probs, old_log_probs, advantages (N, T), mask, clip_low, clip_high, generator)
               -> (per-token loss (N, T), stats); None: the engine's own PPO clipped surrogate (the local engine's
               `clipped_surrogate`, the fork's upstream PolicyLoss)
    clip_frac  the stats key of the share of valid tokens the PPO ratio clip cuts off (logged as clip_frac);
               None: no ratio clip, clip_frac 0
    check      (config, eps_low) -> why the engine's PPO clip ratios do not fit this loss, None when they do
    metrics    the namespace its stats are logged under (<metrics>/<stat key>)
    """

    name: str
    loss: Callable | None
    clip_frac: str | None = None
    check: Callable = lambda config, eps_low: None
    metrics: str = "baseline"


@dataclass(frozen=True)
class Adjustment:
    """A baseline that changes the rewards (stage "reward", before curation) or the sequence advantages (stage
    "advantage", after the group statistics, before SALT) without choosing rollouts; settings in BaselineConfig.

    flag     the flag that turns it on (for messages)
    adjust   (step, values (N,), config, **inputs) -> (adjusted values (N,), stats); `step` is the pipeline's
             GeometryStep, each input a zero-arg callable the engine passes (`GeometryStep.adjust`), called only
             when the adjustment runs
    inputs   the names of the inputs it reads ("references": PAR's reference rewards, "responses" and "verifier":
             the decoded responses and the math verifier); an engine that cannot provide one refuses it (`fork`)
    enabled  (config) -> whether its flag is on
    fork     (config) -> why the fork cannot run it, None when it can
    needs_groups  it reads each prompt's rollouts as a group: the engine's estimator must be per-prompt without
             batch whitening (GROUP_ESTIMATORS)
    """

    name: str
    stage: str
    flag: str
    adjust: Callable
    enabled: Callable
    inputs: tuple = ()
    fork: Callable = _runs_everywhere
    metrics: str = "baseline"
    needs_groups: bool = True


CURATIONS = Registry("--baseline.curation")
POLICY_LOSSES = Registry("--baseline.policy_loss")
ADJUSTMENTS = Registry("a --baseline.* adjustment")


def register_curation(name, **info):
    """Decorator: register `plan` as curation `name` (Curation's fields as keywords)."""

    def add(plan):
        CURATIONS.register(Curation(name, plan, **info))
        return plan

    return add


def register_policy_loss(name, **info):
    """Decorator: register `loss` as policy loss `name` (PolicyLoss's fields as keywords)."""

    def add(loss):
        POLICY_LOSSES.register(PolicyLoss(name, loss, **info))
        return loss

    return add


def register_adjustment(name, stage, flag, **info):
    """Decorator: register `adjust` as adjustment `name` at `stage`, on with `flag` (Adjustment's fields as
    keywords)."""

    def add(adjust):
        ADJUSTMENTS.register(Adjustment(name, stage, flag, adjust, **info))
        return adjust

    return add


def active_adjustments(baseline, stage=None) -> list:
    """The adjustments a BaselineConfig (or None) turns on, in registration order; only `stage`'s when given."""
    if baseline is None:
        return []
    return [e for e in ADJUSTMENTS.values() if e.enabled(baseline) and (stage is None or e.stage == stage)]


def adjustment_inputs(baseline) -> set:
    """The inputs (Adjustment.inputs) the adjustments a BaselineConfig (or None) turns on read: what an engine must
    prepare before the first step (PAR's reference policy, Seed-GRPO's verifier)."""
    return {name for entry in active_adjustments(baseline) for name in entry.inputs}


def baseline_curations() -> tuple:
    """The --baseline.curation choices: every curation whose settings live in BaselineConfig."""
    return tuple(name for name, entry in CURATIONS.items() if entry.config == "baseline")


def active_curation(config):
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
    baseline, curation = config.baseline, active_curation(config)
    entries = [(entry, entry.flag, baseline) for entry in active_adjustments(baseline, "reward")]
    if curation is not None:
        flag = "--geoalign.enable" if curation.config == "geoalign" else f"--baseline.curation {curation.name}"
        entries.append((curation, flag, getattr(config, curation.config)))
    entries += [(entry, entry.flag, baseline) for entry in active_adjustments(baseline, "advantage")]
    via = " (from --salt.base)" if config.salt is not None and config.salt.apply else ""
    out = []
    for entry, flag, settings in entries:
        if engine == "fork":
            out.append(entry.fork(settings))
        if entry.needs_groups and estimator is not None and estimator not in GROUP_ESTIMATORS:
            out.append(
                f"{flag} needs a per-prompt group estimator without batch whitening: {', '.join(GROUP_ESTIMATORS)} "
                f"or salt with one of them as --salt.base (got {estimator!r}{via})"
            )
    return [message for message in out if message is not None]
