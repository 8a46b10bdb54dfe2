"""Everything the fork's diffs (patches/) call into; the diffs themselves only wire these in.

One flag's path through the fork, by the upstream file whose diff makes the call:
    cli/train_ppo_ray.py      options.add_args(parser), validate_args(args)  -> args.salt / .geoalign / .reward.noise
    trainer/ray/ppo_actor.py  actor_spec(args) -> GeometrySpec: what the experience forward also returns
    models/actor.py           lm_head_input(), response_geometry(): features and hidden states of that same forward
    trainer/ppo_utils/experience_maker.py   (RemoteExperienceMaker, in the trainer process)
        ExperienceGeometry.take_actor_outputs   per-response geometry onto each micro-batch (side attribute)
        ExperienceGeometry.start_batch          reward noise (--reward.noise.*) where rewards are known
        GeometryBatch.curate                    GeoAlign, after rewards and before group statistics
        GeometryBatch.salt                      SALT a' on the group-normalized sequence advantages
        GeometryBatch.finish                    replacement multiplicities on advantage rows; metrics into `info`
    trainer/ppo_trainer.py    save_geometry_state / load_geometry_state: projector + RNG states in checkpoints

Replacement semantics (GeoAlign `replace`/`amplify`): slot i of the batch holds a copy of rollout source[i]. The
fork keeps every rollout's row and (1) gives slot i the reward of source[i] before the group statistics, (2) runs
SALT on the slots, (3) sets row r's sequence advantage to the mean a' of the slots it fills and multiplies row r's
token advantages by its multiplicity m_r = #slots filled (0 for a replaced rollout; `zero` mode: weight 0). PPO's
per-token surrogate (clip, dual-clip, IS correction) is positively homogeneous in the advantage, so this equals
physically duplicating the donor rollouts for the policy loss under `--actor.loss_agg_mode seq-mean-token-mean`
(the sample count is unchanged) when the rollout batch is one optimizer step; with several steps per batch the
donor's extra weight lands in the donor's step instead of the replaced rollout's, so the summed step gradients at
fixed parameters agree and only the order of updates differs. Under `token-mean` the token normalizer differs:
duplication counts sum_r m_r T_r tokens, the fork sum_r T_r, so the fork's gradient is the duplicated one times
(sum_r m_r T_r)/(sum_r T_r), a positive scalar per optimizer step. KL-loss and entropy terms are not advantage
weighted and keep the original rollouts. tests/test_fork_pipeline.py checks all of this against a duplicated batch.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from openrlhf_geo import options
from openrlhf_geo.features import last_token_hidden, lm_head_features
from openrlhf_geo.geoalign import CurationPlan, Projector, curate
from openrlhf_geo.rewards.noise import flip_binary, swap_to_extremes
from openrlhf_geo.salt import salt_advantages

# Estimators whose per-prompt sequence advantages reach the loss unchanged (no batch whitening afterwards), so
# GeoAlign's replacement can be expressed as multiplicities on advantage rows.
GEOALIGN_ESTIMATORS = ("group_norm", "dr_grpo", "rloo")
SIDE_ATTR = "_openrlhf_geo"  # per-response geometry on an Experience between make_experience and finish()
STATE_KEY = "openrlhf_geo"  # checkpoint client_states entry
ENTROPY_CHUNK = 256  # positions per chunk of the token-entropy pass (peak extra memory: chunk x V floats)


# ── parse time (cli/train_ppo_ray.py) ──


def validate_args(args) -> None:
    """`options.validate`, then what the fork cannot run; raises ValueError naming the flag (shown by parser.error)."""
    options.validate(args)
    salt, geo = args.salt, args.geoalign
    if (salt.enable or geo.enable) and args.ds.ring_attn_size > 1:
        raise ValueError(
            f"--ds.ring_attn_size {args.ds.ring_attn_size} splits each response across ranks, but SALT and GeoAlign "
            "read every response's features and last hidden state from one forward: use --ds.ring_attn_size 1"
        )
    if not geo.enable:
        return
    config = options.geoalign_config(args)
    if config.mode == "drop":
        raise ValueError(
            "--geoalign.mode drop changes per-prompt rollout counts, which OpenRLHF's fixed n_samples_per_prompt "
            "groups, micro-batches and DeepSpeed accumulation steps cannot take; in the fork use replace, amplify, "
            "or zero (removes a flagged rollout's gradient and keeps the batch shape)"
        )
    estimator = args.algo.advantage.estimator
    if estimator not in GEOALIGN_ESTIMATORS:
        via = " (from --salt.base)" if salt.enable else ""
        raise ValueError(
            "--geoalign.enable needs a per-prompt group estimator without batch whitening: "
            f"{', '.join(GEOALIGN_ESTIMATORS)} or salt with one of them as --salt.base (got {estimator!r}{via})"
        )
    if config.device != "cpu":
        raise ValueError(
            f"--geoalign.device {config.device}: the fork curates inside OpenRLHF's trainer actor, which Ray starts "
            "without a GPU; use cpu (the default)"
        )


# ── the experience forward (trainer/ray/ppo_actor.py, models/actor.py) ──


@dataclass(frozen=True)
class GeometrySpec:
    """What the experience forward returns per response besides log-probs."""

    features: str | None = None  # SALT proxy features, "sketch" | "exact"; None: not needed
    dim: int = 4096  # sketch dimension (k x k)
    seed: int = 0  # sketch projections
    entropy: bool = False  # normalized token-entropy sums (SALT --salt.variant entropy-alpha)
    hidden: bool = False  # last-response-token final hidden state (GeoAlign)


def actor_spec(args) -> GeometrySpec | None:
    """The policy actor's GeometrySpec from the flags (None: SALT and GeoAlign are off); checks this worker's fork."""
    from openrlhf_geo.fork import check_worker

    check_worker()
    salt, geo = _section(args, "salt"), _section(args, "geoalign")
    salt_on = salt is not None and salt.enable
    if not (salt_on or (geo is not None and geo.enable)):
        return None
    return GeometrySpec(
        features=salt.features if salt_on else None,
        dim=salt.dim if salt_on else 4096,
        seed=salt.seed if salt_on else 0,
        entropy=salt_on and salt.variant == "entropy-alpha",
        hidden=geo is not None and geo.enable,
    )


@contextmanager
def lm_head_input(model, enabled=True):
    """Capture the lm_head input (final post-norm hidden states) of the forward run inside the block.

    Yields a namespace whose `.hidden` is (B, S, d) padded or (1, T, d) packed after the forward. The hook sits on
    `get_output_embeddings()` of the unwrapped model (DeepSpeed engine / PEFT both forward to it).
    """
    captured = SimpleNamespace(hidden=None)
    if not enabled:
        yield captured
        return
    head = getattr(model, "module", model).get_output_embeddings()
    if head is None:
        raise RuntimeError(f"{type(model).__name__} has no output embeddings (lm_head) to read hidden states from")
    handle = head.register_forward_hook(lambda _module, inputs, _output: setattr(captured, "hidden", inputs[0]))
    try:
        yield captured
    finally:
        handle.remove()


@torch.no_grad()
def response_geometry(
    spec, logits, hidden, labels, action_mask, attention_mask, indices=None, temperature=1.0, ring_attn_group=None
):
    """Per-response outputs of one experience forward, small CPU tensors: features (B, D), hidden (B, d), entropy (B,).

    logits (B, S, V) padded or (1, T, V) packed, already divided by `temperature` (Actor.forward does it in place);
    hidden: the lm_head input of the same forward, same layout; labels: Actor.forward's rolled sequences (label at
    position s = token s+1), same layout; action_mask (B, A): column j <-> position S-1-A+j (whose logits produced
    token S-A+j); attention_mask (B, S); indices (T,): packed position -> flat padded position (None = padded).
    features: the SALT proxy (`lm_head_features`) of each response's action tokens; `hidden / temperature` makes
    them the exact gradient of the temperature-scaled log-probs. hidden: the lm_head input at the response's last
    token. entropy: sum over action tokens of H(softmax(z)) / log V.
    """
    if ring_attn_group is not None:
        raise ValueError("SALT / GeoAlign geometry is not available with ring attention (--ds.ring_attn_size > 1)")
    if hidden is None:
        raise RuntimeError("the lm_head forward hook did not fire: no hidden states captured")
    batch, seqlen = attention_mask.shape
    width = action_mask.shape[1]
    producing = action_mask.new_zeros(batch, seqlen, dtype=torch.bool)  # positions whose logits produced an action
    producing[:, seqlen - 1 - width : seqlen - 1] = action_mask.bool()
    response = action_mask.new_zeros(batch, seqlen, dtype=torch.bool)  # positions holding response tokens
    response[:, seqlen - width :] = action_mask.bool()
    segment_ids = None
    if indices is not None:  # packed: the same masks on the (1, T) stream, each token tagged with its row
        producing, response = producing.flatten()[indices][None], response.flatten()[indices][None]
        segment_ids = (indices // seqlen)[None]
    out = {}
    if spec.features is not None:
        scaled = hidden / temperature if temperature != 1.0 else hidden
        feats = lm_head_features(
            logits, scaled, labels, producing, spec.features, spec.dim, spec.seed, segment_ids=segment_ids
        )
        out["features"] = _pad_rows(feats, batch).float().cpu()
    if spec.hidden:
        out["hidden"] = _pad_rows(last_token_hidden(hidden, response, segment_ids), batch).float().cpu()
    if spec.entropy:
        out["entropy"] = _entropy_sums(logits, producing, segment_ids, batch).cpu()
    return out


def _pad_rows(rows, batch):
    """(R, ·) -> (batch, ·): responses after the last one with a token (packed layout) get zero rows."""
    missing = batch - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])]) if missing else rows


def _entropy_sums(logits, mask, segment_ids, batch):
    """(batch,) float32: per response, sum over masked positions of token entropy / log V (chunks of positions)."""
    rows, cols = mask.nonzero(as_tuple=True)
    owner = rows if segment_ids is None else segment_ids[rows, cols]
    sums = torch.zeros(batch, dtype=torch.float32, device=logits.device)
    for start in range(0, len(rows), ENTROPY_CHUNK):
        part = slice(start, start + ENTROPY_CHUNK)
        z = logits[rows[part], cols[part]].float()
        entropy = torch.distributions.Categorical(logits=z, validate_args=False).entropy()
        sums.index_add_(0, owner[part], entropy)
    return sums / math.log(logits.shape[-1])


# ── the experience maker (trainer/ppo_utils/experience_maker.py), in the trainer process ──


def _section(args, name):
    """args.<name>, or None for args built without the fork's flags (upstream's own tests): everything off."""
    return getattr(args, name, None) if args is not None else None


class ExperienceGeometry:
    """SALT / GeoAlign / reward-noise state of one RemoteExperienceMaker: the flags, GeoAlign's warm-started
    projector and the RNGs. `start_batch` hands out the steps of one rollout batch (a GeometryBatch)."""

    def __init__(self, args=None):
        salt, geo = _section(args, "salt"), _section(args, "geoalign")
        noise = _section(_section(args, "reward"), "noise")
        self.salt = salt if salt is not None and salt.enable else None
        self.geoalign = options.geoalign_config(args) if geo is not None and geo.enable else None
        self.noise = noise if noise is not None and noise.type != "none" else None
        self.active = any(x is not None for x in (self.salt, self.geoalign, self.noise))
        if not self.active:
            return
        self.n_samples = args.rollout.n_samples_per_prompt
        # SALT's randomized variants and GeoAlign's init / validation split / replacement draws share one stream.
        self.generator = torch.Generator().manual_seed(args.train.seed)
        self.noise_generator = torch.Generator().manual_seed(self.noise.seed if self.noise else 0)
        self.projector = None

    @classmethod
    def disabled(cls):
        return cls(None)

    @property
    def needs_actor_outputs(self) -> bool:
        return self.salt is not None or self.geoalign is not None

    def take_actor_outputs(self, samples_list, outputs):
        """Policy-actor results per micro-batch -> log-probs; the (log-probs, geometry) pairs leave their geometry
        on the micro-batch (side attribute, removed by GeometryBatch.finish before the replay buffer)."""
        if not self.needs_actor_outputs:
            return outputs
        log_probs = []
        for samples, output in zip(samples_list, outputs):
            if not isinstance(output, tuple):
                raise RuntimeError(
                    "SALT / GeoAlign are on but a policy actor returned log-probs only: that Ray worker runs an "
                    "unpatched openrlhf (see `openrlhf-geo fork verify`)"
                )
            log_probs.append(output[0])
            setattr(samples, SIDE_ATTR, output[1])
        return log_probs

    def start_batch(self, experiences):
        """Begin one rollout batch (all rewards known): inject reward noise; returns the batch's remaining steps."""
        batch = GeometryBatch(self, experiences)
        if self.noise is not None:
            batch.inject_reward_noise()
        return batch

    def projector_for(self, in_dim):
        """GeoAlign's projector, created at the first batch and trained in place afterwards (warm start)."""
        if self.projector is None:
            self.projector = Projector(in_dim, self.geoalign, self.generator)
        elif self.projector.layers[0].in_features != in_dim:
            raise RuntimeError(f"hidden size changed from {self.projector.layers[0].in_features} to {in_dim}")
        return self.projector

    def state_dict(self) -> dict:
        state = {"generator": self.generator.get_state(), "noise_generator": self.noise_generator.get_state()}
        if self.projector is not None:
            state["projector"] = self.projector.state_dict()
            state["projector_in_dim"] = self.projector.layers[0].in_features
        return state

    def load_state_dict(self, state) -> None:
        if "projector" in state and self.geoalign is not None:
            self.projector = Projector(state["projector_in_dim"], self.geoalign)
            self.projector.load_state_dict(state["projector"])
        # after building the projector: its init must not advance the restored stream
        self.generator.set_state(state["generator"])
        self.noise_generator.set_state(state["noise_generator"])


class GeometryBatch:
    """The fork's steps on one rollout batch inside compute_advantages_and_returns. Tensors are in upstream's
    "prompt order" (rollout i of prompt g at g*n + i; row k of the concatenated micro-batches sits at indices[k])."""

    def __init__(self, owner, experiences):
        self.owner, self.experiences = owner, experiences
        if not owner.active:
            return
        self.indices = torch.tensor([i for exp in experiences for i in exp.index])
        self.size = len(self.indices)
        self.plan = CurationPlan.identity(self.size)
        self.corrupted = None
        self.metrics = {}  # name -> (N,) float32, prompt order

    def _prompt_order(self, rows):
        """Concatenated-row order (N, ...) -> prompt order."""
        out = rows.new_empty(rows.shape)
        out[self.indices] = rows
        return out

    def _geometry(self, key):
        """(N, ...) prompt order: the actor forward's per-response `key` of every micro-batch."""
        return self._prompt_order(torch.cat([getattr(exp, SIDE_ATTR)[key] for exp in self.experiences]))

    def _record(self, prefix, stats, part=slice(None)):
        for key, value in stats.items():
            values = self.metrics.setdefault(f"{prefix}/{key}", torch.full((self.size,), math.nan))
            values[part] = math.nan if value is None else float(value)

    def inject_reward_noise(self):
        """--reward.noise.{type,rate}: corrupt each prompt's rewards (before length penalties and group statistics).

        Training uses the corrupted `experience.rewards`, and upstream copies them into info["reward"] after the
        length penalties (train/reward); train/noise/clean_reward logs the verifier's clean reward and
        train/noise/corrupted the realized corruption rate.
        """
        noise = self.owner.noise
        clean = self._prompt_order(torch.cat([exp.rewards for exp in self.experiences]))
        groups = torch.arange(self.size) // self.owner.n_samples
        if noise.type == "flip":
            noisy, self.corrupted = flip_binary(
                clean, groups, noise.rate, self.owner.noise_generator, levels=noise.levels
            )
        else:
            noisy, self.corrupted = swap_to_extremes(clean, groups, noise.rate, self.owner.noise_generator)
        for exp in self.experiences:
            exp.rewards = noisy[exp.index].to(exp.rewards.dtype)
        self.metrics["noise/corrupted"] = self.corrupted.float()
        self.metrics["noise/clean_reward"] = clean.float()

    def curate(self, rewards, indices):
        """GeoAlign between rewards and group statistics: rewards (N,) prompt order -> slot rewards rewards[source]."""
        config = self.owner.geoalign
        if config is None:
            return rewards
        if not torch.equal(indices, self.indices):
            raise RuntimeError("experience order changed between start_batch and curate")
        hidden = self._geometry("hidden")
        groups = torch.arange(self.size) // self.owner.n_samples
        projector = self.owner.projector_for(hidden.shape[1])
        self.plan, stats = curate(
            hidden, rewards, groups, config, self.owner.generator, projector=projector, corrupted=self.corrupted
        )
        if not bool(self.plan.keep.all()):
            raise RuntimeError("GeoAlign dropped rollouts; the fork supports replace, zero and amplify")
        self._record("geo", stats)
        return rewards[self.plan.source]

    def salt(self, advantages):
        """SALT on the group-normalized sequence advantages: (P, n) prompt order -> (P, n) with a' per slot.

        Partitions of --salt.group_prompts prompts (0: the whole batch) each get one `salt_advantages` call on the
        slots' features (a replaced slot uses its source's). Then each rollout's row value becomes the mean a' of
        the slots it fills (identical copies agree up to solver rounding); `finish` multiplies by the count.
        """
        salt = self.owner.salt
        if salt is None:
            return advantages
        a = advantages.reshape(-1)
        source = self.plan.source
        features = self._geometry("features")[source]
        if salt.variant == "entropy-alpha":  # needs the partition's mean normalized token entropy, in [0, 1]
            tokens = self._prompt_order(torch.cat([exp.action_mask.sum(-1) for exp in self.experiences]))[source]
            entropy = self._geometry("entropy")[source]
        new = torch.empty_like(a)
        step = salt.group_prompts * self.owner.n_samples or self.size
        for start in range(0, self.size, step):
            part = slice(start, start + step)
            mean_entropy = None
            if salt.variant == "entropy-alpha":
                mean_entropy = float(entropy[part].sum() / tokens[part].sum().clamp(min=1))
            new[part], stats = salt_advantages(
                a[part],
                features[part],
                salt.variant,
                salt.alpha,
                self.owner.generator,
                entropy=mean_entropy,
                gram=salt.gram,
            )
            self._record("salt", stats, part)
        weight = self.plan.weight.to(new.dtype)
        count = torch.zeros_like(new).index_add_(0, source, weight)
        total = torch.zeros_like(new).index_add_(0, source, weight * new)
        new = torch.where(count > 0, total / count.clamp(min=1e-12), new)
        return new.view_as(advantages)

    def finish(self):
        """Multiply advantage rows by their multiplicity; per-sample metrics into `info`; drop the side geometry.

        Batch-level stats are broadcast to (B,) per micro-batch (upstream's `info` rule: per-sample scalars), so
        the sample-weighted mean upstream logs as train/<key> is the batch value (partition-size weighted for SALT).
        """
        if not self.owner.active:
            return
        multiplicity = torch.zeros(self.size).index_add_(0, self.plan.source, self.plan.weight.float().cpu())
        identity = torch.equal(multiplicity, torch.ones(self.size))
        for exp in self.experiences:
            rows = torch.as_tensor(exp.index)
            if not identity:
                exp.advantages = exp.advantages * multiplicity[rows].to(exp.advantages)[:, None]
            for key, values in self.metrics.items():
                exp.info[key] = values[rows].clone()
            exp.__dict__.pop(SIDE_ATTR, None)


# ── checkpoints (trainer/ppo_trainer.py) ──


def save_geometry_state(trainer, client_states) -> None:
    """Add the GeoAlign projector and RNG states to a checkpoint's client states (nothing when the steps are off)."""
    geometry = getattr(getattr(trainer, "experience_maker", None), "geometry", None)
    if geometry is not None and geometry.active:
        client_states[STATE_KEY] = geometry.state_dict()


def load_geometry_state(trainer, checkpoint_states) -> None:
    """Restore what `save_geometry_state` saved (a checkpoint without it leaves the fresh state)."""
    geometry = getattr(getattr(trainer, "experience_maker", None), "geometry", None)
    if geometry is not None and geometry.active and STATE_KEY in checkpoint_states:
        geometry.load_state_dict(checkpoint_states[STATE_KEY])
