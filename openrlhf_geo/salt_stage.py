"""SALT as a pipeline stage: `reweight`, registered as the last "advantage" adjustment (registry.ADJUSTMENTS), runs
SALT Eq. 12-18 (`salt.salt_advantages`) on each partition of one rollout batch's slot advantages, with the App. B /
D.1 diagnostics and SALT's regime guard, from explicit inputs plus its own `SaltState` (its random stream,
entropy-alpha's running range of H_t, the regime warning's clock). It is on whenever GeometryConfig.salt is set
(--advantage_estimator salt, or --salt.diagnostics: SaltConfig.apply False, a' = a with the geometry logged).
SALT's partitions, for both engines: `salt_partition_prompts` (prompts per partition), `minibatch_partitions` and
`minibatch_order` (when and how each optimizer mini-batch trains on exactly one partition).

Its stats are per-slot (N,) float tensors, logged as `salt/<key>`: a partition's stats on its slots (partition-size
weighted when averaged over the batch). `salt/out_of_regime` flags steps far outside SALT Table 10's regime
(`SaltRegimeWarning`, docs/salt_regime.md).
"""

import math
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from openrlhf_geo import GeoWarning, diagnostics
from openrlhf_geo.groups import group_index
from openrlhf_geo.registry import register_adjustment
from openrlhf_geo.salt import InnerProducts, SaltConfig, entropy_alpha, salt_advantages
from openrlhf_geo.stages import Batch, record, stream

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


class GramSource(Protocol):
    """SALT's features where they are not in this process (the fork's policy ranks: `fork.hooks.RankGrams`), given
    to `reweight` in place of F (N, D): asked once per batch for every partition's rows, it answers each with
    salt.InnerProducts(G = F[rows] F[rows]ᵀ, eigh(G)), all SALT reads of F under --salt.gram raw."""

    def grams(self, rows: list[torch.Tensor]) -> list[InnerProducts]: ...


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


class SaltState:
    """What SALT remembers across steps: its random stream (`generator`, the rand-proj / random-assign variants),
    entropy-alpha's running (H_min, H_max) of H_t over the run (`entropy_range`, None before the first step) and the
    step of the last SaltRegimeWarning (`last_regime_warning`)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.entropy_range: tuple[float, float] | None = None
        self.last_regime_warning: int | None = None

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "entropy_range": self.entropy_range,
            "last_regime_warning": self.last_regime_warning,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.entropy_range = state["entropy_range"]
        self.last_regime_warning = state["last_regime_warning"]


@register_adjustment(
    "salt",
    "advantage",
    "--advantage_estimator salt / --salt.diagnostics",
    enabled=lambda salt: True,
    inputs=("features", "entropy", "lengths", "partition_prompts"),
    config="salt",
    state=lambda salt, seed: SaltState(stream(seed, "salt")),
    order=1,
    metrics="salt",
    needs_groups=False,  # its own --salt.base check (GeometryConfig)
)
def reweight(
    salt: SaltConfig,
    state: SaltState,
    batch: Batch,
    advantages: torch.Tensor,
    *,
    features: Callable[[], torch.Tensor],
    entropy: Callable[[], torch.Tensor | None],
    lengths: Callable[[], torch.Tensor],
    partition_prompts: Callable[[], int],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SALT on the slots' sequence advantages a (N,) -> (a' (N,), dropped slots 0; per-slot stats (N,) by key).

    features() (N, D) or a GramSource (--salt.gram raw only), entropy() (N,) (normalized
    token-entropy sums; None unless SaltConfig.needs_entropy) and lengths() (N,) (response tokens) per ROLLOUT; slot i
    holds rollout batch.source[i]'s (the curation plan's); entropy-alpha's H_t is over every rollout. Partitions of
    partition_prompts() consecutive prompts (0: the whole batch; SALT §3.1's m = BG is the optimizer mini-batch, which
    the engines resolve) each get one `salt_advantages` call, in float64. With SaltConfig.apply False, a' = a and the
    stats describe the geometry of a.

    A slot whose rollout has no action token (lengths() 0: an empty response, a prompt that filled the context
    window, an agent turn without an action span) is left out of its partition's call. Eq. 19's G_i averages over
    the response's |o_i| tokens, so with none there is no feature (the engines pass a zero row), and its term
    u_i = Â_i ∇ log π (Eq. 6) is 0 whatever Â_i. So m, Eq. 4's number of features in K = GᵀG/m and Eq. 12's
    number of responses in a, counts the responses that have a token: such a slot is in no row of K, a, P_k (Eq.
    15) or the stats (salt/m counts the others). Its a' is a: no token carries it into the loss, so any value trains
    the same, and a keeps the base estimator's value in the row. Left in as a zero
    row it changed no other slot beyond rounding (K's spectrum gains a 0: PR, Eq. 5, is scale-free), but it was
    counted in m and got α_t [Â_i]_+ (Eq. 16-18: its coordinate lies in P_k^⊥). salt/zero_action_rollouts counts
    such slots of the batch (logged on every slot).
    """
    a, source = advantages.detach().cpu().double(), batch.source
    # rollout order, indexed per partition below: no (N, D) copy in slot order
    rollout_features, token_counts = features(), lengths().detach().cpu().double()
    if not isinstance(rollout_features, torch.Tensor):  # a GramSource
        if salt.gram != "raw":
            raise ValueError(
                f"--salt.gram {salt.gram} reads the features' columns; their Grams alone stand only for raw"
            )
    else:
        rollout_features = rollout_features.detach().cpu()
    size = a.numel()
    metrics: dict[str, torch.Tensor] = {}  # <key> -> (N,) per slot (logged as salt/<key>)
    text: dict[str, str] = {}
    alpha_input = None
    if salt.needs_entropy:
        h = entropy()
        assert h is not None  # the engines pass it whenever SALT needs it (GeometrySpec.entropy)
        alpha_input = _entropy_alpha(state, h.detach().cpu().double(), token_counts, metrics, size)
    new = torch.zeros_like(a)
    kept = torch.nonzero(batch.kept)[:, 0]
    # a slot whose rollout has no action token has no Eq. 19 feature: out of its partition's Gram and m, a' = a
    empty = token_counts[source] == 0
    new[batch.kept & empty] = a[batch.kept & empty]
    metrics["zero_action_rollouts"] = torch.full((size,), float((batch.kept & empty).sum()))
    # prompts numbered over every slot, as the engines' mini-batches see them (a dropped slot is still a row)
    prompt, n_prompts = group_index(batch.group_ids)
    n_prompts = n_prompts if kept.numel() else 0
    prompt = prompt[kept]
    per = partition_prompts() or max(n_prompts, 1)
    parts = [kept[(prompt >= first) & (prompt < first + per)] for first in range(0, n_prompts, per)]
    parts = [part for part in (part[~empty[part]] for part in parts) if part.numel()]  # else nothing to reweight
    grams = None if isinstance(rollout_features, torch.Tensor) else rollout_features.grams([source[p] for p in parts])
    for i, part in enumerate(parts):
        rows = source[part]
        if grams is not None:
            part_features = grams[i]
        else:
            first_row = int(rows[0])
            part_features = rollout_features[first_row : first_row + rows.numel()]
            # consecutive rows (no curation, no slot left out) are used in place, not copied (m·D floats), where they
            # are laid out as a fresh copy would be: MKL's matmul can round differently at another alignment
            in_place = part_features.is_contiguous() and part_features.data_ptr() % 64 == 0
            if not (in_place and torch.equal(rows, torch.arange(first_row, first_row + rows.numel()))):
                part_features = rollout_features[rows]
        out, stats, (basis, is_top, gram) = salt_advantages(
            a[part],
            part_features,
            salt.variant,
            salt.alpha,
            state.generator,
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
        stats.update(diagnostics.salt_weight_stats(a[part], applied, gram, basis, is_top, token_counts[rows]))
        # SALT App. D.1 (Eq. 37) weights each response by "the scalar coefficient used by the objective" and calls it
        # "the normalized advantage" Â: for a SALT run these differ (a vs a'). The plain keys use a, comparable with
        # the backbone's rows of Table 10; the coefficient-weighted ones are logged for a' too.
        stats.update(diagnostics.group_geometry(a[part], gram, batch.group_ids[part], is_gram=True))
        if salt.apply:
            out_geometry = diagnostics.group_geometry(applied, gram, batch.group_ids[part], is_gram=True)
            stats.update({f"{key}_applied": out_geometry[key] for key in APPLIED_GROUP_KEYS})
        no_signal = not bool(a[part].any())
        if no_signal:
            stats.update(dict.fromkeys(UNDEFINED_WITHOUT_SIGNAL, math.nan))
        stats["no_signal"] = float(no_signal)
        new[part] = applied
        record(metrics, text, "", stats, size, part)
    if salt.apply:
        metrics["out_of_regime"] = _check_regime(state, batch.step, metrics, size)
    return new.to(device=advantages.device, dtype=advantages.dtype), metrics


def _check_regime(state, step, metrics, size):
    """salt/out_of_regime (0/1 per slot); at most once per REGIME_WARN_EVERY steps, warn when this step's D_a or
    sign-flip share (partition-size weighted over the batch, as logged) is far above SALT Table 10's."""
    # absent when no partition had a slot to reweight (each dropped or without an action token)
    d_a, sign_flip = (float(metrics[key].nanmean()) if key in metrics else math.nan for key in ("D_a", "sign_flip"))
    out = d_a > REGIME_MAX_D_A or sign_flip > REGIME_MAX_SIGN_FLIP  # NaN (no moving coefficient): in regime
    last = state.last_regime_warning
    if out and (last is None or step - last >= REGIME_WARN_EVERY):
        state.last_regime_warning = step
        warnings.warn(
            f"step {step}: SALT's coefficients are far outside SALT Table 10's regime: D_a = {d_a:.2f} "
            f"(paper 0.24 ± 0.04; warns above {REGIME_MAX_D_A}), sign-flip share = {sign_flip:.2f} (warns above "
            f"{REGIME_MAX_SIGN_FLIP}). See docs/salt_regime.md for what to try; salt/out_of_regime is logged "
            f"every step, this warning at most once per {REGIME_WARN_EVERY} steps.",
            SaltRegimeWarning,
            stacklevel=4,
        )
    return torch.full((size,), float(out))


def _entropy_alpha(state, entropy, lengths, metrics, size):
    """SALT App. F.3 entropy-alpha's α_t from H_t, the token-weighted mean normalized entropy of this step's
    responses (every rollout, before curation), and the run's running min/max of H_t (including this step)."""
    h_t = float(entropy.sum() / lengths.sum().clamp(min=1))
    low, high = state.entropy_range or (h_t, h_t)
    state.entropy_range = (min(low, h_t), max(high, h_t))
    for key, value in zip(("H_t", "H_min", "H_max"), (h_t, *state.entropy_range)):
        metrics[key] = torch.full((size,), value)
    return entropy_alpha(h_t, *state.entropy_range)
