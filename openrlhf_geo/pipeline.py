"""The geometry pipeline: the one definition of every per-step quantity, shared by the fork and the local engine.

Both engines hand it plain tensors of one rollout batch in prompt order (N rollouts; `group_ids` (N,) prompt ids)
and call, in this order:

    rewards, corrupted = pipeline.corrupt(rewards, group_ids)    --reward.noise.*  reward noise
    step = pipeline.start(group_ids, corrupted)
    rewards = step.adjust("reward", rewards, references=...)     --baseline.par_references  PAR (local engine)
    slot_rewards = step.curate(rewards, hidden)                  --geoalign.*      GeoAlign Eq. 3-8 (plan), or
                                                                 --baseline.curation  PF-PPO / PODS (plan): the
                                                                 registered curation (registry.CURATIONS)
    (the engine's group statistics on the slot rewards -> sequence advantages a (N,))
    a = step.adjust("advantage", a, responses=..., verifier=...)  --baseline.seed_grpo_alpha  Seed-GRPO: the
                                                                 registered adjustments (registry.ADJUSTMENTS)
    a_slot = step.reweight(a, features, entropy, lengths)        --salt.*          SALT Eq. 12-18 per partition
    value, multiplicity = step.rows(a_slot)                       what each rollout's row carries into the loss
    step.metrics                                                   {"salt/pr": (N,), "geo/flag_frac": (N,), ...}

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

`SignalGuard` (one per engine, whatever the flags) checks each rollout batch for learning signal: it logs
`signal/truncated` and `signal/tied_groups` and warns (`LearningSignalWarning`) when most responses hit the length
limit or when every prompt's rollouts have had equal rewards for several steps in a row.
"""

import copy
import math
import warnings
from dataclasses import dataclass

import torch

from openrlhf_geo import GeoWarning, diagnostics
from openrlhf_geo.baselines import BaselineConfig
from openrlhf_geo.features import GeometrySpec
from openrlhf_geo.geoalign import CurationPlan, GeoAlignConfig, Projector
from openrlhf_geo.registry import active_adjustments, active_curation
from openrlhf_geo.rewards.noise import NoiseConfig, corrupt
from openrlhf_geo.salt import SaltConfig, entropy_alpha, salt_advantages

# What --salt.diagnostics logs of SALT's stats (the rest describe the a' that is not applied): the geometry of the
# batch (PR, k_t, eigengap), n_eff(a) and the α_t that SALT would use.
DIAGNOSTIC_KEYS = ("pr", "k", "gap", "n_eff_in", "alpha", "m")
# App. D.1 / B group statistics that depend on the coefficients (the rest describe the features only): with SALT
# applied they are also logged for a' as salt/<key>_applied (a' need not vanish on a tied group).
APPLIED_GROUP_KEYS = ("n_eff_group", "n_eff_group_left_out", "n_eff_means", "g_norm")
# SALT stats that are ratios over the coefficients a: undefined (0/0) on a partition whose groups are all tied (a = 0,
# no GRPO update). `salt_advantages` returns its documented fill values there (n_eff 0, α_t 1, D_a 0, U⊥ gain 1);
# logged as such, a study's mean over steps would count each such partition as perfect cancellation. They are
# logged NaN instead (the batch value is the nanmean over the partitions with signal), with salt/no_signal = 1.
UNDEFINED_WITHOUT_SIGNAL = ("n_eff_in", "n_eff_out", "alpha", "D_a", "D_g", "U_perp_gain")

# SALT's regime guard. SALT Table 10 (App. F.5, DeepSeek-R1-Distill-Qwen-7B / MATH-TRAIN, mean ± sd over 5 seeds of
# the last 20 % of checkpoints): GRPO + SALT has D_a = 0.24 ± 0.04, D_g = 0.16 ± 0.03, n_eff 0.31 -> 0.80.
# REGIME_MAX_D_A = 0.6 is 2.5x that D_a (9 sd above it). Sign flips are not in the paper, but bounded by D_a: a
# flipped a_i moves by at least |a_i|, so D_a^2 >= (share of ||a||^2 on flipped rollouts); at Table 10's D_a that share
# is <= 0.24^2 ~ 0.06, and a flipped fraction of 0.25 among equal-magnitude a_i (binary rewards) forces D_a >= 0.5.
REGIME_MAX_D_A = 0.6
REGIME_MAX_SIGN_FLIP = 0.25
REGIME_WARN_EVERY = 50  # steps between two warnings (the metric salt/out_of_regime is logged every step)


class SaltRegimeWarning(GeoWarning):
    """SALT's a' departs from a far more than in SALT Table 10 (see docs/salt_regime.md)."""


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
        rewards, group_ids = rewards.detach().cpu().double(), group_ids.detach().cpu()
        _, group = torch.unique(group_ids, return_inverse=True)
        n_groups = int(group.max()) + 1 if group.numel() else 0
        low = torch.full((n_groups,), math.inf, dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
        high = torch.full((n_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
        tied = float((low == high).double().mean()) if n_groups else 0.0
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


# reinforce_baseline is listed so the error can say why it is refused: upstream whitens the whole batch after the
# group statistics, which would re-centre and rescale SALT's a' (SALT §3 feeds a' to the loss unchanged).
SALT_BASES = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


# Every seeded random stream of a run, as an offset from its --train.seed: one torch.Generator per consumer, so
# switching one method on never shifts another's draws (the reward noise has its own --reward.noise.seed). Changing a
# value changes every seeded result, the committed ones included.
STREAM_OFFSETS = {
    "geoalign": 1,  # GeoAlign: projector initialisation and training order, pair subsampling, Best-Random donors
    "salt": 2,  # SALT
    "minibatch": 3,  # local engine: the optimizer mini-batch order
    "baseline": 4,  # PF-PPO / PODS draws
    "loss": 5,  # local engine: Clip-Cov's token draw
}
# The fork's per-step streams: seed * FORK_STEP_STRIDE + step (rank_batches' partition order after rollout step
# `step`, PartitionSampler's order at ppo_train call `step`), and Clip-Cov's seed + rank (one stream per rank).
FORK_STEP_STRIDE = 1_000_003


def stream(seed: int, name: str) -> torch.Generator:
    """The CPU generator of stream `name` (STREAM_OFFSETS) for a run seeded with `seed`."""
    return torch.Generator().manual_seed(seed + STREAM_OFFSETS[name])


@dataclass(frozen=True)
class GeometryConfig:
    """Everything the pipeline runs, built once at parse time (`options.validate` -> `args.geometry`), read by both
    engines and the pipeline.

    salt None: SALT off (SaltConfig.apply False: diagnostics only); geoalign None: GeoAlign off; baseline None: no
    --baseline.* flag (its policy loss is the engines', the rest runs here). `salt_base` (--salt.base) is the
    group-relative estimator whose sequence advantages SALT reweights; the engines run it as their advantage
    estimator. `seed` seeds the pipeline's random streams (the run's --train.seed).
    """

    salt: SaltConfig | None = None
    geoalign: GeoAlignConfig | None = None
    noise: NoiseConfig = NoiseConfig()
    baseline: BaselineConfig | None = None
    salt_base: str = "group_norm"
    seed: int = 0

    def __post_init__(self):
        if self.salt_base == "reinforce_baseline":
            raise ValueError(
                "--salt.base reinforce_baseline: upstream whitens the whole batch after the group statistics, which "
                "would re-centre and rescale SALT's a' (the loss must consume a' unchanged); use group_norm, dr_grpo "
                "or rloo"
            )
        if self.salt_base not in SALT_BASES:
            raise ValueError(f"--salt.base must be one of {', '.join(SALT_BASES[:-1])} (got {self.salt_base!r})")
        if self.geoalign is not None and self.baseline is not None and self.baseline.curation is not None:
            raise ValueError(
                f"--baseline.curation {self.baseline.curation} and --geoalign.enable both choose which rollouts to "
                "train on: use one of them"
            )

    @property
    def active(self) -> bool:
        baseline = self.baseline is not None and self.baseline.in_pipeline
        return self.salt is not None or self.geoalign is not None or self.noise.enabled or baseline

    @property
    def spec(self) -> GeometrySpec | None:
        """What the experience forward must return per response (None: nothing beyond log-probs)."""
        if self.salt is None:
            return GeometrySpec(hidden=True) if self.geoalign is not None else None
        return GeometrySpec(
            self.salt.features, self.salt.dim, self.salt.seed, self.salt.needs_entropy, self.geoalign is not None
        )


def salt_partition_prompts(salt: SaltConfig | None, train_batch_size: int, n_samples: int) -> int:
    """Prompts per SALT partition, for both engines: --salt.group_prompts, else the optimizer mini-batch's prompts
    (SALT §3.1 computes every quantity "from mini-batch statistics" of "the current mini-batch", m = BG; Table 4:
    32 prompts × 8; --train.batch_size counts rollouts), at least one; 0 = the whole rollout batch (also the local
    engine's --train.batch_size 0, one mini-batch per step)."""
    if salt is not None and salt.group_prompts is not None:
        return salt.group_prompts
    return max(train_batch_size // n_samples, 1) if train_batch_size else 0


def minibatch_partitions(salt: SaltConfig | None, train_batch_size: int, n_samples: int) -> int:
    """Prompts per partition when each optimizer mini-batch must train on exactly one SALT partition's rollouts (all
    G rollouts of its B prompts), else 0. That holds when SALT (or --salt.diagnostics) is on, a partition is as large
    as a mini-batch (the default --salt.group_prompts) and --salt.shuffle_minibatches is off. Both engines then
    shuffle the order of partitions and of rollouts inside one each epoch, never their membership; otherwise their
    mini-batches mix prompts, and a partition's geometry describes rollouts spread over several optimizer steps."""
    per = salt_partition_prompts(salt, train_batch_size, n_samples)
    if salt is None or salt.shuffle_minibatches or per == 0 or per * n_samples != train_batch_size:
        return 0
    return per


def minibatch_order(partition, generator) -> torch.Tensor:
    """One epoch's row order (N,): partitions in a random order, each one's rows shuffled, kept together.
    partition (N,) long: each row's partition id."""
    blocks = [torch.nonzero(partition == p)[:, 0] for p in torch.unique(partition).tolist()]
    order = torch.randperm(len(blocks), generator=generator).tolist()
    return torch.cat([blocks[b][torch.randperm(len(blocks[b]), generator=generator)] for b in order])


def check_finite(name, values, group_ids, step):
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


class GeometryPipeline:
    """The state that lives across steps: configs, GeoAlign's warm-started projector, the random streams and
    SALT entropy-alpha's running min/max of H_t. `state_dict`/`load_state_dict` checkpoint all of it."""

    def __init__(self, config: GeometryConfig):
        self.config = config
        self.salt, self.geoalign, self.noise = config.salt, config.geoalign, config.noise
        self.baseline = config.baseline
        # Independent streams: switching one method on never shifts another's random draws.
        self.generators = {
            "noise": torch.Generator().manual_seed(config.noise.seed),
            **{name: stream(config.seed, name) for name in ("geoalign", "salt", "baseline")},
        }
        self.projector = None  # created at the first curation (needs the hidden size)
        self.entropy_range = None  # (H_min, H_max) over the run so far (SALT entropy-alpha)
        self.last_regime_warning = None  # step of the last SaltRegimeWarning
        self.steps = 0

    @property
    def active(self) -> bool:
        return self.config.active

    @property
    def curation(self):
        """Who picks each slot's rollout: the registered Curation (GeoAlign or a --baseline.curation), or None (every
        rollout fills its own slot)."""
        return active_curation(self.config)

    def corrupt(self, rewards, group_ids, paid=None):
        """--reward.noise.*: (rewards (N,), group_ids (N,)) -> (rewards the trainer sees, corrupted (N,) bool).
        paid (N,) bool: the rollouts a misspecified verifier pays (type misspecified only; the engine's task hook)."""
        check_finite("reward", rewards, group_ids, self.steps + 1)
        return corrupt(rewards, group_ids, self.noise, self.generators["noise"], paid)

    def start(self, group_ids, corrupted=None):
        """Begin one rollout batch of N = len(group_ids) rollouts in prompt order."""
        self.steps += 1
        return GeometryStep(self, group_ids.detach().cpu().long(), corrupted)

    def projector_for(self, in_dim):
        """GeoAlign's projector, created at the first batch and trained in place afterwards (warm start)."""
        if self.projector is None:
            self.projector = Projector(in_dim, self.geoalign, self.generators["geoalign"])
        elif self.projector.layers[0].in_features != in_dim:
            raise RuntimeError(f"hidden size changed from {self.projector.layers[0].in_features} to {in_dim}")
        return self.projector

    def state_dict(self) -> dict:
        return {
            "generators": {k: g.get_state() for k, g in self.generators.items()},
            # copies: the live projector keeps training in place after the state is taken
            "projector": None if self.projector is None else copy.deepcopy(self.projector.state_dict()),
            "projector_in_dim": None if self.projector is None else self.projector.layers[0].in_features,
            "entropy_range": self.entropy_range,
            "last_regime_warning": self.last_regime_warning,
            "steps": self.steps,
        }

    def load_state_dict(self, state) -> None:
        if state["projector"] is not None and self.geoalign is not None:
            self.projector = Projector(state["projector_in_dim"], self.geoalign)
            self.projector.load_state_dict(state["projector"])
        # after building the projector: its init must not advance the restored stream
        for key, value in state["generators"].items():
            self.generators[key].set_state(value)
        self.entropy_range = state["entropy_range"]
        self.last_regime_warning = state.get("last_regime_warning")
        self.steps = state["steps"]


class GeometryStep:
    """One rollout batch's steps; see the module docstring for the order and the replacement semantics."""

    def __init__(self, owner, group_ids, corrupted):
        self.owner, self.group_ids, self.corrupted = owner, group_ids, corrupted
        self.size = group_ids.numel()
        self.plan = CurationPlan.identity(self.size)
        self.metrics = {}  # name -> (N,) float32 per slot
        self.text_metrics = {}  # name -> str
        self.batch_metrics = {}  # name -> float: stats of the whole batch before curation (reward adjustments)
        self.curation = None  # per-rollout GDI, corruption, flags, rewards, prompt ids (GeoAlign runs)
        if corrupted is not None and owner.noise.enabled:
            self.metrics["noise/corrupted"] = corrupted.detach().cpu().float()

    @property
    def kept(self):
        """(N,) bool: slots that take part in the group statistics and SALT (False only for plans that drop rollouts:
        GeoAlign `drop`, PODS, PF-PPO without keep_count; local engine only)."""
        return self.plan.keep

    def _record(self, prefix, stats, part=slice(None)):
        for key, value in stats.items():
            if isinstance(value, str):
                self.text_metrics[f"{prefix}/{key}"] = value
                continue
            values = self.metrics.setdefault(f"{prefix}/{key}", torch.full((self.size,), math.nan))
            values[part] = math.nan if value is None else float(value)

    def curate(self, rewards, hidden):
        """The registered curation (GeoAlign, PF-PPO, PODS, ...) between rewards and group statistics: rewards (N,)
        -> slot rewards rewards[source]. hidden (N, d): the input of a curation that `needs_hidden` (else None)."""
        curation = self.owner.curation
        if curation is None:
            return rewards
        plan, stats = curation.plan(self, rewards.detach().cpu(), hidden)
        self.plan = plan.to("cpu")
        self._record(curation.metrics, stats)
        return rewards[self.plan.source.to(rewards.device)]

    def adjust(self, stage, values, **inputs):
        """The registered adjustments (registry.ADJUSTMENTS) of `stage` that the run's --baseline.* flags turn on, in
        registration order: values (N,) -> adjusted (N,); the identity when none is on. "reward": PAR on the rewards
        before `curate`, its stats batch scalars (`batch_metrics`: they describe every rollout, before any slot
        exists); "advantage": Seed-GRPO on the slot advantages after the group statistics, before SALT, its stats on
        the kept slots. `inputs`: zero-arg callables an adjustment reads (Adjustment.inputs), called only by one
        that runs."""
        for entry in active_adjustments(self.owner.baseline, stage):
            missing = [name for name in entry.inputs if name not in inputs]
            if missing:
                raise ValueError(f"{entry.flag}: the engine passed no {', '.join(missing)} for {entry.name}")
            values, stats = entry.adjust(self, values, self.owner.baseline, **{k: inputs[k] for k in entry.inputs})
            if stage == "reward":
                self.batch_metrics.update({f"{entry.metrics}/{key}": value for key, value in stats.items()})
            else:
                self._record(entry.metrics, stats, self.kept)
        return values

    def reweight(self, advantages, features=None, entropy=None, lengths=None, partition_prompts=0):
        """SALT on the slots' sequence advantages a (N,) -> a' (N,) (dropped slots: 0).

        features (N, D) and entropy (N,) (normalized token-entropy sums) per ROLLOUT; a replaced slot uses its
        source's. lengths (N,) response tokens per rollout. Partitions of `partition_prompts` consecutive prompts
        (0: the whole batch; SALT §3.1's m = BG is the optimizer mini-batch, which the engines resolve) each get one
        `salt_advantages` call. Without SALT (or with SaltConfig.apply False) a' = a; the latter still logs the
        geometry of a.
        """
        salt = self.owner.salt
        check_finite("advantage", advantages, self.group_ids, self.owner.steps)
        if salt is None:
            return advantages
        a = advantages.detach().cpu().double()
        source = self.plan.source
        features = features.detach().cpu()[source]
        lengths = lengths.detach().cpu().double()
        alpha_input = None
        if salt.needs_entropy:
            alpha_input = self._entropy_alpha(entropy.detach().cpu().double(), lengths)
        new = torch.zeros_like(a)
        kept = torch.nonzero(self.kept)[:, 0]
        # prompts numbered over every slot, as the engines' mini-batches see them (a dropped slot is still a row)
        _, prompt = torch.unique(self.group_ids, return_inverse=True)
        n_prompts = int(prompt.max()) + 1 if kept.numel() else 0
        prompt = prompt[kept]
        per = partition_prompts or max(n_prompts, 1)
        for first in range(0, n_prompts, per):
            part = kept[(prompt >= first) & (prompt < first + per)]
            if part.numel() == 0:  # every slot of the partition dropped
                continue
            out, stats, (basis, is_top, gram) = salt_advantages(
                a[part],
                features[part],
                salt.variant,
                salt.alpha,
                self.owner.generators["salt"],
                entropy=alpha_input,
                gram=salt.gram,
                return_basis=True,
                k_rule=salt.k_rule,
                rho=salt.rho,
            )
            applied = out if salt.apply else a[part]
            if not salt.apply:  # diagnostics only: the geometry of the unchanged coefficients a (D_a = 0, ...)
                stats = {key: stats[key] for key in DIAGNOSTIC_KEYS}
                stats.update(n_eff_out=stats["n_eff_in"], D_a=0.0, D_g=0.0, U_perp_gain=1.0)
                stats["U_perp"] = diagnostics.residual_strength(a[part], gram, basis, is_top)
            stats.update(diagnostics.salt_weight_stats(a[part], applied, gram, basis, is_top, lengths[source][part]))
            # SALT App. D.1 (Eq. 37) weights each response by "the scalar coefficient used by the objective" and
            # calls it "the normalized advantage" Â: for a SALT run these differ (a vs a'). The plain keys use a,
            # comparable with the backbone's rows of Table 10; the coefficient-weighted ones are logged for a' too.
            stats.update(diagnostics.group_geometry(a[part], gram, self.group_ids[part], is_gram=True))
            if salt.apply:
                out_geometry = diagnostics.group_geometry(applied, gram, self.group_ids[part], is_gram=True)
                stats.update({f"{key}_applied": out_geometry[key] for key in APPLIED_GROUP_KEYS})
            no_signal = not bool(a[part].any())
            if no_signal:
                stats.update(dict.fromkeys(UNDEFINED_WITHOUT_SIGNAL, math.nan))
            stats["no_signal"] = float(no_signal)
            new[part] = applied
            self._record("salt", stats, part)
        if salt.apply:
            self._check_regime()
        return new.to(device=advantages.device, dtype=advantages.dtype)

    def _check_regime(self):
        """Log salt/out_of_regime (0/1) and, at most once per REGIME_WARN_EVERY steps, warn when this step's D_a or
        sign-flip share (partition-size weighted over the batch, as logged) is far above SALT Table 10's."""
        d_a, sign_flip = (float(self.metrics[f"salt/{key}"].nanmean()) for key in ("D_a", "sign_flip"))
        out = d_a > REGIME_MAX_D_A or sign_flip > REGIME_MAX_SIGN_FLIP  # NaN (no moving coefficient): in regime
        self.metrics["salt/out_of_regime"] = torch.full((self.size,), float(out))
        owner = self.owner
        if out and (owner.last_regime_warning is None or owner.steps - owner.last_regime_warning >= REGIME_WARN_EVERY):
            owner.last_regime_warning = owner.steps
            warnings.warn(
                f"step {owner.steps}: SALT's coefficients are far outside SALT Table 10's regime: D_a = {d_a:.2f} "
                f"(paper 0.24 ± 0.04; warns above {REGIME_MAX_D_A}), sign-flip share = {sign_flip:.2f} (warns above "
                f"{REGIME_MAX_SIGN_FLIP}). See docs/salt_regime.md for what to try; salt/out_of_regime is logged "
                f"every step, this warning at most once per {REGIME_WARN_EVERY} steps.",
                SaltRegimeWarning,
                stacklevel=3,
            )

    def _entropy_alpha(self, entropy, lengths):
        """SALT App. F.3 entropy-alpha's α_t from H_t, the token-weighted mean normalized entropy of this step's
        responses (every rollout, before curation), and the run's running min/max of H_t (including this step)."""
        h_t = float(entropy.sum() / lengths.sum().clamp(min=1))
        low, high = self.owner.entropy_range or (h_t, h_t)
        self.owner.entropy_range = (min(low, h_t), max(high, h_t))
        for key, value in zip(("H_t", "H_min", "H_max"), (h_t, *self.owner.entropy_range)):
            self.metrics[f"salt/{key}"] = torch.full((self.size,), value)
        return entropy_alpha(h_t, *self.owner.entropy_range)

    def rows(self, slot_advantages):
        """Per-slot a' (N,) -> (row value (N,), multiplicity (N,)): row r's sequence advantage is the mean a' of the
        slots it fills (identical copies agree up to solver rounding), its multiplicity the summed slot weights."""
        weight = (self.plan.weight * self.kept).to(slot_advantages.device, slot_advantages.dtype)
        source = self.plan.source.to(slot_advantages.device)
        count = torch.zeros_like(slot_advantages).index_add_(0, source, weight)
        total = torch.zeros_like(slot_advantages).index_add_(0, source, weight * slot_advantages)
        value = torch.where(count > 0, total / count.clamp(min=1e-12), slot_advantages)
        return value, count
