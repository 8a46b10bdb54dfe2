"""Everything the fork's diffs (patches/) call into; the diffs themselves only wire these in.

One flag's path through the fork, by the upstream file whose diff makes the call:
    cli/train_ppo_ray.py      (its parse time is `fork.flags`: add_args, validate_args -> args.geometry)
                              clear_checkpoints(args): --ckpt.overwrite's deletion, once every check passed;
                              --reward.timeout_s into the workers' environment (REWARD_TIMEOUT_ENV)
    utils/agent.py            bounded_reward_func: a .py reward_func's calls bounded by --reward.timeout_s
    trainer/ray/ppo_actor.py  actor_spec(args) -> GeometrySpec: what the experience forward also returns
                              policy_loss(args, PolicyLoss) -> the actor's loss (--baseline.policy_loss)
                              VllmWeights: what the weight sync sends vLLM (a LoRA actor's layers merged)
    models/actor.py           lm_head_input(), response_geometry(): features and hidden states of that same forward
                              (with SALT features, also the log-probs, from their exp pass over the logits)
    trainer/ppo_utils/experience_maker.py   (RemoteExperienceMaker, in the trainer process)
        ExperienceGeometry.take_actor_outputs   per-response geometry onto each micro-batch (side attribute)
        ExperienceGeometry.start_batch          reward noise (--reward.noise.*) where rewards are known
        GeometryBatch.curate                    the registered curation (GeoAlign, PF-PPO), after rewards and before
                                                group statistics
        GeometryBatch.salt                      Seed-GRPO, then SALT a', on the group-normalized advantages
        GeometryBatch.finish                    replacement multiplicities on advantage rows; metrics into `info`
    trainer/ppo_trainer.py    save_geometry_state / load_geometry_state: projector + RNG states in checkpoints

The per-step logic (reward noise, GeoAlign, SALT, replacement multiplicities, metrics, state) is
`openrlhf_geo.pipeline`, shared with the local engine; this module only adapts upstream's objects to it.
tests/test_fork_pipeline.py checks the replacement semantics against an explicitly duplicated batch, and that the
fork and the local engine produce identical advantages and metrics on the same rollouts.
"""

import asyncio
import errno
import fnmatch
import functools
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import warnings
import zipfile
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from openrlhf_geo import GeoWarning, baselines, diagnostics, features, options, registry
from openrlhf_geo.estimators import check_reward_scale
from openrlhf_geo.features import GeometrySpec, lm_head_input  # noqa: F401  (the actor diff's names)
from openrlhf_geo.fork.flags import FLAGS_KEY, latest_tag, resume_changes, resume_flags, writes_checkpoints
from openrlhf_geo.fork.install import DUMP_ENV
from openrlhf_geo.fork.replay import Recorder, record_training_step  # noqa: F401  (the ppo_actor diff's name)
from openrlhf_geo.local import rundir
from openrlhf_geo.local.reward import RewardTimeout
from openrlhf_geo.pipeline import GeometryPipeline, SignalGuard, check_finite
from openrlhf_geo.registry import POLICY_LOSSES, adjustment_inputs
from openrlhf_geo.salt import InnerProducts
from openrlhf_geo.salt_stage import minibatch_order, minibatch_partitions, salt_partition_prompts
from openrlhf_geo.stages import FORK_STEP_STRIDE

SIDE_ATTR = "_openrlhf_geo"  # per-response geometry on an Experience between make_experience and finish()
STATE_KEY = "openrlhf_geo"  # checkpoint client_states entry
SIGNAL_KEY = "openrlhf_geo_signal"  # the learning-signal guard's streak and warning windows


# ── before train() (cli/train_ppo_ray.py) ──


CHECKPOINT_DIRS = ("_actor", "_critic")  # upstream's DeepSpeed checkpoints in --ckpt.path
# what a run writes in --ckpt.path (fnmatch patterns), stored in its record (rundir.RECORD), which --ckpt.overwrite
# deletes: the DeepSpeed checkpoints and the HF ones of --ckpt.save_hf (<tag>_hf); nothing else there
RUN_CHECKPOINTS = (*CHECKPOINT_DIRS, "global_step[0-9]*_hf", "best_global_step[0-9]*_hf")


@contextmanager
def claim_outputs(args):
    """Hold --ckpt.output_dir, and --ckpt.path when the run writes checkpoints, for this driver until the block ends
    (`rundir.locked`: released on exit, failure or Ctrl-C; a second run into them is refused). Under the locks: the
    record of what the run writes in --ckpt.path (RUN_CHECKPOINTS, for `clear_checkpoints`; taken back when the
    block raises before the run wrote a checkpoint) and a resume's fallback from a damaged newest checkpoint
    (`fall_back_from_damaged`). A refusal exits as a parse error does, in one line naming the flag. The patched
    __main__ runs train() in this block, before Ray starts."""
    ckpt = args.ckpt
    folders = {ckpt.output_dir: "--ckpt.output_dir"}
    if writes_checkpoints(args):
        folders.setdefault(ckpt.path, "--ckpt.path")
    record, written, held = Path(ckpt.path, rundir.RECORD), False, []
    with ExitStack() as stack:
        try:
            for folder, flag in folders.items():
                rundir.hold(stack, folder, flag)
            if writes_checkpoints(args) and not record.exists():
                written_by = {"written_by": "openrlhf-geo train-ppo-ray", "paths": list(RUN_CHECKPOINTS)}
                record.write_text(json.dumps(written_by) + "\n")
                written, held = True, run_checkpoints(ckpt.path)
            if ckpt.load_enable:
                fall_back_from_damaged(ckpt.path)
        except BaseException as error:
            if written:
                record.unlink()
            if isinstance(error, ValueError):
                raise SystemExit(f"{Path(sys.argv[0]).name}: error: {error}") from None
            raise
        try:
            yield
        except BaseException:
            if written and set(run_checkpoints(ckpt.path)) <= set(held):  # the run wrote no checkpoint
                record.unlink(missing_ok=True)
            raise


def run_checkpoints(path) -> list[str]:
    """The names in --ckpt.path `path` that a run wrote: those its record lists (as far as RUN_CHECKPOINTS has them:
    a record never widens what `clear_checkpoints` deletes); an older version's run, which wrote no record, is
    recognised by its _actor/ or _critic/ folder. Anything else there is not a run's."""
    legacy = any(Path(path, d).is_dir() for d in CHECKPOINT_DIRS)
    patterns = rundir.recorded(path, RUN_CHECKPOINTS, legacy) or []
    names = sorted(entry.name for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False))
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def clear_checkpoints(args) -> None:
    """--ckpt.overwrite: delete the earlier run's checkpoints in --ckpt.path (`run_checkpoints`: _actor/, _critic/,
    its <tag>_hf/; never another folder there), naming them, so that neither a later resume nor the --ckpt.max_num
    rotation mixes them with this run's. Called by the patched __main__ right before train(), under the locks
    (`claim_outputs`) and after upstream's own argument checks too: a refused command deletes nothing."""
    ckpt = args.ckpt
    if not (ckpt.overwrite and writes_checkpoints(args) and os.path.isdir(ckpt.path)):
        return
    if ckpt.load_enable and Path(ckpt.path, "_actor").is_dir():  # a resume (`check_outputs`) keeps its checkpoint
        return
    names = run_checkpoints(ckpt.path)
    if names:
        print(f"--ckpt.overwrite: deleting the earlier run's checkpoints in {ckpt.path}: {', '.join(names)}")
    for name in names:
        shutil.rmtree(Path(ckpt.path, name))


def policy_loss(args, upstream):
    """The actor's policy loss (ActorPPOTrainer.actor_loss_fn): upstream's PolicyLoss `upstream`, or with
    --baseline.policy_loss clip_cov | kl_cov a BaselinePolicyLoss taking its clip ratios and aggregation."""
    geometry = _section(args, "geometry")
    baseline = None if geometry is None else geometry.baseline
    if baseline is None or POLICY_LOSSES[baseline.policy_loss].upstream:
        return upstream
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    generator = torch.Generator().manual_seed(args.train.seed + rank)  # Clip-Cov's draw, one stream per rank
    return BaselinePolicyLoss(
        baseline, upstream.clip_eps_low, upstream.clip_eps_high, upstream.token_level_loss, generator
    )


class BaselinePolicyLoss:
    """A registered policy loss (Clip-Cov, KL-Cov: `baselines.policy_loss`) with upstream PolicyLoss's call signature
    and return tuple (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), aggregated by upstream's `aggregate_loss`
    with the micro-batch's loss_batch_info (dp_size, batch_num_tokens, global_batch_size), as PolicyLoss aggregates.

    clip_ratio: the share of valid tokens the PPO clip cuts off (the loss's registered `clip_frac` stat; upstream's
    definition), 0 for a loss without a ratio clip (KL-Cov); ppo_kl as upstream's; vllm_kl and is_filter_ratio None
    (no IS correction).
    """

    def __init__(self, config, clip_eps_low, clip_eps_high, token_level_loss, generator):
        self.config, self.clip_eps_low, self.clip_eps_high = config, clip_eps_low, clip_eps_high
        self.token_level_loss, self.generator = token_level_loss, generator

    def __call__(
        self,
        log_probs,
        old_log_probs,
        advantages,
        action_mask=None,
        rollout_log_probs=None,
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=None,
    ):
        from openrlhf.models.loss import aggregate_loss

        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.bool()
        per_token, stats = baselines.policy_loss(
            self.config,
            log_probs,
            old_log_probs,
            advantages,
            mask,
            self.clip_eps_low,
            self.clip_eps_high,
            self.generator,
        )
        loss = aggregate_loss(
            per_token,
            mask.to(per_token.dtype),
            token_level_loss=self.token_level_loss,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )
        clip_frac = POLICY_LOSSES[self.config.policy_loss].clip_frac
        clip_ratio = torch.tensor(stats.get(clip_frac, 0.0), device=log_probs.device)
        valid = mask.float()
        ppo_kl = ((old_log_probs - log_probs).detach() * valid).sum() / valid.sum().clamp(min=1)
        return loss, clip_ratio, ppo_kl, None, None


# ── the experience forward (trainer/ray/ppo_actor.py, models/actor.py) ──


def actor_spec(args) -> GeometrySpec | None:
    """The policy actor's GeometrySpec from the flags (None: SALT and GeoAlign are off); checks this worker's fork."""
    from openrlhf_geo.fork.install import check_worker

    check_worker()
    geometry = _section(args, "geometry")
    return None if geometry is None else geometry.spec


@torch.no_grad()
def response_geometry(
    spec, logits, hidden, labels, action_mask, attention_mask, indices=None, temperature=1.0, ring_attn_group=None
):
    """Actor.forward's layout -> `features.response_geometry`: features (B, D), hidden (B, d), entropy (B,), and
    with features "log_probs" in logits' layout: the action tokens' log-probs from the features' own exp pass,
    which Actor.forward uses instead of its log_probs_from_logits pass (0 at other positions, masked there anyway).

    logits (B, S, V) padded or (1, T, V) packed, already divided by `temperature` (Actor.forward does it in place);
    hidden: the lm_head input of the same forward, same layout; labels: Actor.forward's rolled sequences (label at
    position s = token s+1), same layout; action_mask (B, A): column j <-> position S-1-A+j (whose logits produced
    token S-A+j), any number of spans per row (a multi-turn agent's turns: every action token counts, the hidden
    state is the last one's); attention_mask (B, S); indices (T,): packed position -> flat padded position (None =
    padded).
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
    return features.response_geometry(
        spec, logits, hidden, labels, producing, response, temperature, segment_ids, rows=batch, log_probs=True
    )


# ── SALT's Gram on the policy ranks (trainer/ray/ppo_actor.py, trainer/ppo_utils/experience_maker.py) ──


class RankFeatures(NamedTuple):
    """One micro-batch's SALT features (rows, D), left in the Ray object store of the policy rank that computed them
    (ref: its ray.put): what the experience forward returns in their place, so that they never reach the trainer."""

    ref: Any
    rows: int


def keep_features(args, geometry):
    """The experience forward's geometry, its features kept on this rank (RankFeatures) where SALT's Grams are formed
    on the ranks: --salt.gram raw, whose K = F Fᵀ/m is all SALT reads of F (`salt.InnerProducts`). Under
    --salt.gram shrink (which reads F's columns) the features travel to the trainer as before."""
    config = _section(args, "geometry")
    if geometry is None or "features" not in geometry or config is None or getattr(config.salt, "gram", None) != "raw":
        return geometry
    import ray

    feats = geometry["features"]
    return {**geometry, "features": RankFeatures(ray.put(feats), feats.shape[0])}


class RankGrams:
    """`salt_stage.GramSource` of the features the policy ranks kept (RankFeatures): parts[j] is micro-batch j's,
    indices[j] its rows' prompt-order rollout indices. `grams` deals the partitions to the ranks, spread over them
    (partition p of P to rank p·R // P; round robin when P > R); each rank fetches the rows it is given from the
    object stores, forms their Gram and its eigendecomposition on its GPU (`rank_gram`) and returns them, so that
    the trainer receives 2·m² floats per partition instead of m·D and runs no O(m²·D) product nor O(m³) solve."""

    def __init__(self, actors, parts, indices):
        self.actors, self.refs = actors, [part.ref for part in parts]
        n = sum(len(index) for index in indices)
        self.where = torch.full((n, 2), -1)  # rollout -> (micro-batch, row in it)
        for j, index in enumerate(indices):
            self.where[torch.as_tensor(index)] = torch.stack(
                [torch.full((len(index),), j), torch.arange(len(index))], 1
            )
        if (self.where[:, 0] < 0).any():
            raise RuntimeError(f"SALT: no features for {int((self.where[:, 0] < 0).sum())} of the {n} rollouts")

    def grams(self, rows):
        import ray

        ranks, count = len(self.actors), len(rows)
        work: list[list] = [[] for _ in self.actors]
        for p, wanted in enumerate(rows):
            where = self.where[wanted]
            pieces = []
            for j in torch.unique(where[:, 0]).tolist():
                mine = where[:, 0] == j
                pieces.append((self.refs[j], where[mine, 1], torch.nonzero(mine)[:, 0]))
            work[p * ranks // count if count <= ranks else p % ranks].append((p, len(wanted), pieces))
        busy = [(actor, items) for actor, items in zip(self.actors, work) if items]
        out: list = [None] * count
        for (_, items), answers in zip(busy, ray.get([actor.salt_grams.remote(items) for actor, items in busy])):
            for (p, _, _), (G, eig) in zip(items, answers):
                out[p] = InnerProducts(G, eig)
        return out


def rank_gram(items) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]]:
    """A policy rank's half of `RankGrams.grams` (its `salt_grams`): per partition, its rows' features fetched
    from the object stores onto this rank's device, G = F Fᵀ (`diagnostics.gram`: the product in float32 after a
    power-of-two scale, as the trainer formed it before) and torch.linalg.eigh(G), as float64 CPU tensors; None in
    eigh's place where the GPU's eigensolver does not converge (the trainer then solves on its own)."""
    import ray

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    out = []
    for _, m, pieces in items:
        fetched = ray.get([ref for ref, _, _ in pieces])
        F = torch.empty(m, fetched[0].shape[1], dtype=fetched[0].dtype, device=device)
        for tensor, (_, rows, positions) in zip(fetched, pieces):  # the pieces cover the m rows (RankGrams.grams)
            F[positions.to(device)] = tensor[rows].to(device)
        G = diagnostics.gram(F) * m
        try:
            eig = tuple(x.cpu() for x in torch.linalg.eigh(G))
        except torch.linalg.LinAlgError:
            eig = None
        out.append((G.cpu(), eig))
    return out


# ── the weight sync to vLLM (trainer/ray/ppo_actor.py) ──


class VllmWeights:
    """What `broadcast_to_vllm` sends the engines: (name, tensor) pairs, `len()` of them (upstream marks the last
    one), each held gathered while it is sent (`gather(param)`: upstream's ZeRO-3 / tensor-parallel gather).

    Upstream's `params` as they are, except for a LoRA actor (`--ds.lora.rank`, a PEFT model). Upstream sent those
    under PEFT's names (`base_model.model.<name>`, `<layer>.base_layer.weight`, the adapters' `lora_A` / `lora_B`),
    which the engine's model, the base model without adapters, does not have (vLLM: "There is no module or parameter
    named 'base_model'"). Here each adapted layer's weight goes with its adapters merged, W + scale·B·A (PEFT's
    `get_delta_weight`, on a new tensor: the actor's own weights are not touched), under the base model's name, and
    no adapter parameter is sent: the engine then samples from the policy the actor trains.
    """

    def __init__(self, model, params, gather):
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        self.gather = gather
        self.lora = isinstance(model, PeftModel)
        self.adapted: dict[int, LoraLayer] = {}  # id(base weight) -> its adapted layer
        owner = {}  # id(adapter parameter) -> (name, base weight) of its layer
        for prefix, layer in model.named_modules() if self.lora else ():
            if isinstance(layer, LoraLayer):
                weight = layer.get_base_layer().weight
                self.adapted[id(weight)] = layer
                for key in layer.adapter_layer_names:
                    owner.update(
                        {id(p): (f"{prefix}.base_layer.weight", weight) for p in getattr(layer, key).parameters()}
                    )
        # an adapter stands for its layer's merged weight, sent once (upstream's vision-language selection keeps only
        # the trainable parameters: with LoRA, the adapters)
        self.params, sent = [], set()
        for name, param in params:
            name, param = owner.get(id(param), (name, param))
            if id(param) not in sent:
                sent.add(id(param))
                self.params.append((name, param))

    def __len__(self) -> int:
        return len(self.params)

    @torch.no_grad()
    def __iter__(self):
        for name, param in self.params:
            if self.lora:  # PeftModel -> LoraModel -> the base model; a LoRA layer holds the base one
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            layer = self.adapted.get(id(param))
            if layer is None:
                with self.gather(param):
                    yield name, param
                continue
            active = [a for a in layer.active_adapters if a in layer.lora_A]
            with ExitStack() as gathered:
                for part in (param, *(p for a in active for p in (layer.lora_A[a].weight, layer.lora_B[a].weight))):
                    gathered.enter_context(self.gather(part))
                merged = param.data + sum(layer.get_delta_weight(a) for a in active)
                if hasattr(param, "ds_shape"):  # upstream's sync reads a ZeRO-3 parameter's shape there
                    merged.ds_shape = param.ds_shape
                yield name, merged


# ── the experience maker (trainer/ppo_utils/experience_maker.py), in the trainer process ──


def _section(args, name):
    """args.<name>, or None for args built without the fork's flags (upstream's own tests): everything off.
    `geometry` is the GeometryConfig `options.validate` built at parse time."""
    return getattr(args, name, None) if args is not None else None


class ExperienceGeometry:
    """The `GeometryPipeline` of one RemoteExperienceMaker (flags, GeoAlign's projector, random streams, running
    statistics). `start_batch` hands out the adapter for one rollout batch (a GeometryBatch).

    tokenizer: the experience maker's, to decode responses for Seed-GRPO's answer clusters, which it checks with a
    math-verify worker pool (`reward_from_env`: OPENRLHF_GEO_MATH_TIMEOUT / _WORKERS, as the math reward).
    actors: the policy model's RayActorGroup, whose ranks form SALT's Grams from the features they kept (RankGrams).
    """

    def __init__(self, args=None, tokenizer=None, actors=None):
        self.pipeline, self.n_samples, self.steps = None, None, 0
        self.tokenizer, self.verifier, self.actors = tokenizer, None, actors
        config = _section(args, "geometry")  # options.validate's, built once at parse time
        if config is None:
            return
        self.n_samples = args.rollout.n_samples_per_prompt  # also for the reward / advantage checks
        reward = args.reward  # the source the reward-scale error names (check_reward_scale)
        self.reward_source = (f"--reward.remote_url {reward.remote_url}" if reward.remote_url
                              else f"--reward.model_name_or_path {reward.model_name_or_path}"
                              if reward.model_name_or_path else "the reward")  # fmt: skip
        self.signal = SignalGuard(args.rollout.max_new_tokens)
        if not config.active:
            return
        self.pipeline = GeometryPipeline(config)
        if "verifier" in adjustment_inputs(config):  # Seed-GRPO's answer pairs
            from openrlhf_geo.rewards.math_verify import reward_from_env

            self.verifier = reward_from_env()  # its worker processes start at the first check
        # SALT's m = B*G is the optimizer mini-batch (SALT §3.1, Table 4): --train.batch_size counts samples
        self.partition_prompts = salt_partition_prompts(config.salt, args.train.batch_size, self.n_samples)

    @classmethod
    def disabled(cls):
        return cls(None)

    @property
    def active(self) -> bool:
        return self.pipeline is not None

    @property
    def needs_actor_outputs(self) -> bool:
        return self.active and self.pipeline.config.spec is not None

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
        """Begin one rollout batch (all rewards known): reward noise; returns the batch's remaining steps (recorded
        for the replay tests when OPENRLHF_GEO_DUMP_DIR is set: `fork.replay`)."""
        if os.environ.get(DUMP_ENV):
            return RecordingBatch(self, experiences)
        return GeometryBatch(self, experiences)


class GeometryBatch:
    """Adapter between upstream's Experience list and one `GeometryStep`. Tensors are in upstream's "prompt order"
    (rollout i of prompt g at g*n + i; row k of the concatenated micro-batches sits at indices[k])."""

    def __init__(self, owner, experiences):
        self.owner, self.experiences = owner, experiences
        if owner.n_samples is None:  # args without the fork's flags (upstream's own tests)
            return
        owner.steps += 1
        self.indices = torch.tensor([i for exp in experiences for i in exp.index])
        self.group_ids = torch.arange(len(self.indices)) // owner.n_samples
        # an HTTP reward model's per-sample list makes upstream's rewards (B, 1): one value per rollout either way
        rewards = self._prompt_order(torch.cat([exp.rewards.reshape(-1) for exp in experiences]))
        check_finite("reward", rewards, self.group_ids, owner.steps)  # every run, before any shaping or actor step
        check_reward_scale(rewards, self.group_ids, owner.steps, owner.reward_source)  # upstream's float32 std
        if owner.active:
            rewards = self._start(rewards)
        # every run: warn when the step has nothing to learn from (signal/* into info, logged as train/signal/*)
        truncated = None
        if all(exp.truncated is not None for exp in experiences):
            truncated = self._prompt_order(torch.cat([exp.truncated.reshape(-1).bool() for exp in experiences]))
        for key, value in owner.signal.check(rewards, self.group_ids, truncated).items():
            for exp in experiences:
                exp.info[key] = torch.full((len(exp.index),), value)

    def _start(self, clean):
        """Reward noise and the pipeline's step; -> the rewards training sees (prompt order)."""
        experiences, pipeline = self.experiences, self.owner.pipeline
        noisy, corrupted = pipeline.corrupt(clean, self.group_ids)
        self.actions = self._prompt_order(torch.cat([exp.action_mask.sum(-1) for exp in experiences]))
        self.step = pipeline.start(self.group_ids, corrupted, self.actions)
        if pipeline.config.noise.enabled:
            # Training uses the corrupted `experience.rewards`; upstream copies them into info["reward"] after the
            # length penalties (train/reward); train/noise/clean_reward logs the verifier's clean reward.
            for exp in experiences:
                exp.rewards = noisy[exp.index].to(exp.rewards.dtype).view_as(exp.rewards)
            self.step.metrics["noise/clean_reward"] = clean.float()
        return noisy

    def _prompt_order(self, rows):
        """Concatenated-row order (N, ...) -> prompt order."""
        out = rows.new_empty(rows.shape)
        out[self.indices] = rows
        return out

    def _geometry(self, key):
        """(N, ...) prompt order: the actor forward's per-response `key` of every micro-batch, each written straight
        into its rows (no concatenated copy: the features are N·D floats)."""
        parts = [getattr(exp, SIDE_ATTR)[key] for exp in self.experiences]
        out = parts[0].new_empty(
            (len(self.indices), *parts[0].shape[1:]),
            dtype=functools.reduce(torch.promote_types, (part.dtype for part in parts)),
        )
        for exp, part in zip(self.experiences, parts):
            out[torch.as_tensor(exp.index)] = part.to(out.dtype)
        return out

    def _features(self):
        """SALT's features (N, D) prompt order; where the ranks kept them (RankFeatures), the ranks' Grams instead."""
        parts = [getattr(exp, SIDE_ATTR)["features"] for exp in self.experiences]
        if not isinstance(parts[0], RankFeatures):
            return self._geometry("features")
        return RankGrams(self.owner.actors._actor_handlers, parts, [exp.index for exp in self.experiences])

    def curate(self, rewards, indices):
        """The registered curation (GeoAlign, PF-PPO) between rewards and group statistics: rewards (N,) prompt order
        -> slot rewards (kept for a registered estimator the pipeline computes, `salt`)."""
        if not self.owner.active:
            return rewards
        curation = self.owner.pipeline.curation
        slot_rewards = rewards.reshape(-1)  # (N,) or an HTTP reward model's (N, 1)
        if curation is not None:
            if not torch.equal(indices, self.indices):
                raise RuntimeError("experience order changed between start_batch and curate")
            hidden = self._geometry("hidden") if curation.needs_hidden else None
            slot_rewards = self.step.curate(slot_rewards, hidden)
        self.slot_rewards = slot_rewards
        return rewards if curation is None else slot_rewards

    def _responses(self):
        """The N response texts in prompt order, decoded with the experience maker's tokenizer (special tokens
        skipped): row b's response tokens are sequences[b, S-A:] under its action_mask (A columns)."""
        tokens = []
        for exp in self.experiences:
            width = exp.action_mask.shape[1]
            tokens += [seq[-width:][mask.bool()].tolist() for seq, mask in zip(exp.sequences, exp.action_mask)]
        texts = self.owner.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        out = [None] * len(texts)
        for row, i in enumerate(self.indices.tolist()):
            out[i] = texts[row]
        return out

    def salt(self, advantages):
        """Seed-GRPO, then SALT, on the group-normalized sequence advantages: (P, n) prompt order -> (P, n), each
        row the mean a' of the slots it fills (`finish` multiplies the token advantages by the multiplicity)."""
        if self.owner.n_samples is not None:
            check_finite("advantage", advantages.reshape(-1), self.group_ids, self.owner.steps)
        if not self.owner.active:
            return advantages
        pipeline = self.owner.pipeline
        a = advantages.reshape(-1)
        if pipeline.config.estimator is not None:  # registered without an upstream branch: upstream ran dr_grpo's
            a = registry.ESTIMATORS[pipeline.config.estimator].advantages(self.slot_rewards, self.group_ids).to(a)
        spec = pipeline.config.spec
        a = self.step.adjust(
            "advantage",
            a,
            responses=self._responses,
            verifier=lambda: self.owner.verifier,
            features=self._features,
            entropy=lambda: self._geometry("entropy") if spec is not None and spec.entropy else None,
            lengths=lambda: self.actions,
            partition_prompts=lambda: self.owner.partition_prompts,
        )
        value, _ = self.step.rows(a)
        return value.view_as(advantages)

    def finish(self):
        """Multiply advantage rows by their multiplicity; per-sample metrics into `info`; drop the side geometry.

        Batch-level stats are per-slot (B,) per micro-batch (upstream's `info` rule: per-sample scalars), so the
        sample-weighted mean upstream logs as train/<key> is the batch value (partition-size weighted for SALT).
        String stats (geo/skipped_reason) are logged as their one-hot float twins (geo/skip_*).
        """
        if not self.owner.active:
            return
        _, multiplicity = self.step.rows(torch.zeros(len(self.indices)))
        identity = torch.equal(multiplicity, torch.ones_like(multiplicity))
        # a slot whose partition has no value (NaN: e.g. salt/n_eff_group with every group tied) gets the batch's
        # nanmean, so that upstream's plain mean over the slots logs what the local engine logs (its nanmean)
        metrics = self.step.metrics
        filled = {key: torch.where(values.isnan(), values.nanmean(), values) for key, values in metrics.items()}
        for exp in self.experiences:
            rows = torch.as_tensor(exp.index)
            if not identity:
                exp.advantages = exp.advantages * multiplicity[rows].to(exp.advantages)[:, None]
            for key, values in filled.items():
                exp.info[key] = values[rows].clone()
            exp.__dict__.pop(SIDE_ATTR, None)


class RecordingBatch(Recorder, GeometryBatch):
    """GeometryBatch plus the replay tests' step record (`fork.replay`, OPENRLHF_GEO_DUMP_DIR only)."""


# ── optimizer mini-batches = SALT partitions (trainer/ppo_trainer.py, trainer/ray/ppo_actor.py) ──


def aligned_partitions(args) -> int:
    """`salt_stage.minibatch_partitions` for the fork's args: prompts per partition when every optimizer step must
    train on exactly one SALT partition, else 0. Also 0 where upstream's data path cannot keep partitions together:
    a critic (it shares the experience distribution). Upstream's asynchronous trainer (--train.async_enable) trains
    through the same patched `train_step` and the actors' `ppo_train`, so its partitions are optimizer steps too."""
    if _section(args, "geometry") is None or args.critic.model_name_or_path:
        return 0
    return minibatch_partitions(args.geometry.salt, args.train.batch_size, args.rollout.n_samples_per_prompt)


def _data_parallel_size(args) -> int:
    return (
        args.actor.num_nodes * args.actor.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size
    )


def rank_batches(trainer, experiences):
    """PPOTrainer, before the experiences go to the actor ranks: one batch per data-parallel rank, each holding its
    share of every SALT partition as consecutive blocks of --train.batch_size / ranks rollouts, the partitions in a
    random order (the same on every rank), so that optimizer step i on every rank trains on partition i
    (SALT §3.1: "the current mini-batch"). Inside a partition, rollouts are dealt to ranks by length (longest first,
    snake order), as upstream's balance_experiences does. None when mini-batches are not partitions (upstream's
    distribution stays), or when the batch does not split into whole partitions (a warning says why)."""
    args = trainer.args
    per = aligned_partitions(args)
    if not per:
        return None
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    ranks, size = _data_parallel_size(args), args.train.batch_size
    index = torch.tensor([i for exp in experiences for i in exp.index])  # prompt-order position of each rollout
    items = [item for exp in experiences for item in split_experience_batch(exp)]
    if len(items) % size or size % ranks:
        warnings.warn(
            f"{len(items)} rollouts do not split into SALT partitions of --train.batch_size {size} shared by {ranks} "
            "ranks: this step's optimizer mini-batches mix partitions",
            GeoWarning,
            stacklevel=2,
        )
        return None
    pipeline = trainer.experience_maker.geometry.pipeline
    generator = torch.Generator().manual_seed(args.train.seed * FORK_STEP_STRIDE + pipeline.steps)
    shares = [[] for _ in range(ranks)]
    for p in torch.randperm(len(items) // size, generator=generator).tolist():
        members = sorted(torch.nonzero(index // size == p)[:, 0].tolist(), key=lambda k: -int(items[k].total_length))
        for j, k in enumerate(members):
            lap, slot = divmod(j, ranks)
            shares[slot if lap % 2 == 0 else ranks - 1 - slot].append(items[k])
    return [make_experience_batch(share) for share in shares]


class PartitionSampler(torch.utils.data.Sampler):
    """A rank's replay-buffer order when its buffer holds SALT partitions as consecutive blocks (rank_batches):
    every epoch, the blocks in a new random order (the same on every rank: same seed, same count) and the rollouts
    inside each block shuffled. The DataLoader's --train.micro_batch_size batches then never cross a block."""

    def __init__(self, n_items, block, seed):
        self.n_items, self.block = n_items, block
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n_items

    def __iter__(self):
        return iter(minibatch_order(torch.arange(self.n_items) // self.block, self.generator).tolist())


def minibatch_sampling(actor_trainer, shuffle) -> dict:
    """ActorPPOTrainer.ppo_train's DataLoader order: upstream's `shuffle`, or a PartitionSampler when each optimizer
    step must be one SALT partition. Dynamic batching already steps through the buffer's blocks in order (its
    token-balanced micro-batches stay inside one), so it keeps upstream's order."""
    args = actor_trainer.args
    if not aligned_partitions(args) or args.train.dynamic_batch_enable:
        return {"shuffle": shuffle}
    # a new seed per call, the same on every rank (each calls ppo_train once per rollout step)
    actor_trainer.openrlhf_geo_epochs = getattr(actor_trainer, "openrlhf_geo_epochs", 0) + 1
    block = args.train.batch_size // _data_parallel_size(args)
    seed = args.train.seed * FORK_STEP_STRIDE + actor_trainer.openrlhf_geo_epochs
    return {"sampler": PartitionSampler(len(actor_trainer.replay_buffer), block, seed)}


# ── checkpoints (trainer/ppo_trainer.py) ──


def save_geometry_state(trainer, client_states) -> None:
    """Add the pipeline's state (projector, RNG streams, running statistics) and the fork's flags to a checkpoint's
    client states."""
    geometry = getattr(getattr(trainer, "experience_maker", None), "geometry", None)
    if geometry is not None and geometry.active:
        client_states[STATE_KEY] = geometry.pipeline.state_dict()
    if geometry is not None and geometry.n_samples is not None:
        client_states[SIGNAL_KEY] = geometry.signal.state_dict()
    if _section(getattr(trainer, "args", None), "salt") is not None:
        client_states[FLAGS_KEY] = resume_flags(trainer.args)


def load_geometry_state(trainer, checkpoint_states) -> None:
    """Restore what `save_geometry_state` saved (a checkpoint without it leaves the fresh state). A checkpoint
    written with other values of RESUME_FLAGS is refused, naming each one, as `openrlhf-geo train` refuses them."""
    saved = checkpoint_states.get(FLAGS_KEY)
    if saved is not None and _section(getattr(trainer, "args", None), "salt") is not None:
        changed = resume_changes(saved, trainer.args)  # checked at parse time too (fork.flags.check_resume)
        if changed:
            raise ValueError(
                f"the checkpoint to resume (--ckpt.load_enable) was written with other flags: {'; '.join(changed)}. "
                "Resume with the checkpoint's values, or start a new --ckpt.path"
            )
    geometry = getattr(getattr(trainer, "experience_maker", None), "geometry", None)
    if geometry is not None and geometry.active and STATE_KEY in checkpoint_states:
        geometry.pipeline.load_state_dict(checkpoint_states[STATE_KEY])
    if geometry is not None and geometry.n_samples is not None and SIGNAL_KEY in checkpoint_states:
        geometry.signal.load_state_dict(checkpoint_states[SIGNAL_KEY])


# ── rewards (utils/agent.py, in each vLLM engine's actor) ──

REWARD_TIMEOUT_ENV = "OPENRLHF_GEO_REWARD_TIMEOUT_S"  # --reward.timeout_s, set for every worker by the driver


def bounded_reward_func(reward_func, path):
    """Upstream's .py `reward_func` (--reward.remote_url PATH), each call bounded by --reward.timeout_s (0: not
    bounded): past it, RewardTimeout naming the function and its file, which agent.py lets through to end the run (it
    scores a sample whose reward raised anything else None). Upstream already calls it on a worker thread; the call
    runs on a daemon thread of its own, given up on at the deadline (a Python thread cannot be stopped, and a daemon
    does not keep the process from exiting when the run ends)."""
    seconds = float(os.environ.get(REWARD_TIMEOUT_ENV) or options.REWARD_TIMEOUT_S)
    if not seconds:
        return reward_func

    def bounded(*args, **kwargs):
        result = Future()

        def call():
            try:
                result.set_result(reward_func(*args, **kwargs))
            except BaseException as e:  # the user's code: returned to the caller as it was raised
                result.set_exception(e)

        threading.Thread(target=call, name="openrlhf-geo-reward-func", daemon=True).start()
        try:
            return result.result(timeout=seconds)
        except FutureTimeout:  # the builtin TimeoutError only from Python 3.11
            if not result.done():
                raise RewardTimeout("--reward.remote_url", path, seconds) from None
        return result.result()  # it raised its own TimeoutError, or returned as the wait ended

    return bounded


class AgentTimeout(RewardTimeout):
    """An AgentInstance's reset() or step() (--train.agent_func_path) that did not return within --reward.timeout_s."""

    def __init__(self, path, call, seconds):
        ValueError.__init__(
            self,
            f"--train.agent_func_path {path}: the agent's {call}() did not return within {seconds:g} s "
            "(--reward.timeout_s; 0 = no limit)",
        )
        self.flag, self.path, self.seconds, self.call = "--train.agent_func_path", path, seconds, call

    def __reduce__(self):  # Ray pickles it from the fork's vLLM actor to the driver
        return type(self), (self.path, self.call, self.seconds)


async def bounded_agent_call(agent, call, *args):
    """`await agent.<call>(*args)` in upstream's MultiTurnAgentExecutor (the AgentInstance of
    --train.agent_func_path, whose step() computes the rewards), bounded by --reward.timeout_s as a .py reward_func's
    calls are (0: not bounded): past it the call is cancelled and AgentTimeout, naming the agent's file, ends the run.
    The bound is the event loop's: a call that blocks the loop without awaiting is not interrupted."""
    seconds = float(os.environ.get(REWARD_TIMEOUT_ENV) or options.REWARD_TIMEOUT_S)
    task = asyncio.ensure_future(getattr(agent, call)(*args))
    done, _ = await asyncio.wait({task}, timeout=seconds or None)
    if not done:
        task.cancel()
        raise AgentTimeout(inspect.getfile(type(agent).step), call, seconds)
    return task.result()  # an error of its own (its own TimeoutError too) as it raised it


def _step(tag) -> int | None:
    """The step of a checkpoint tag upstream writes (global_step<N>, best_global_step<N>), else None."""
    match = re.fullmatch(r"(?:best_)?global_step(\d+)", tag)
    return int(match[1]) if match else None


def damaged_file(tag_dir) -> Path | None:
    """The first file of the DeepSpeed checkpoint folder `tag_dir` that cannot be read back whole (a torch zip
    archive cut short or failing its records' CRC-32, which torch's reader does not check: a flipped bit loads
    silently), or the folder itself when it holds no model states; None when every file checks out. A file in
    torch's legacy (non-zip) format is left to the load."""
    tag_dir = Path(tag_dir)
    if not any(tag_dir.glob("*model_states.pt")):
        return tag_dir
    for path in sorted(tag_dir.rglob("*.pt")):
        with open(path, "rb") as f:
            if f.read(1) == b"\x80":  # a pickle: torch's legacy format
                continue
        try:
            with zipfile.ZipFile(path) as archive:
                if archive.testzip() is None:
                    continue
        except (zipfile.BadZipFile, OSError, EOFError):
            pass
        return path
    return None


def fall_back_from_damaged(ckpt_path) -> None:
    """--ckpt.load_enable: when a file of the checkpoint DeepSpeed's `latest` names in <ckpt_path>/_actor (or
    _critic) is damaged (`damaged_file`), resume from the newest intact checkpoint before it, as the local engine
    falls back to checkpoint.prev.pt: the damaged tag's folders are moved aside to <tag>.bad (.bad.1, ... when one is
    there), kept for inspection, and `latest` names the intact tag (`commit_latest`), with a warning naming the file,
    its step and the checkpoint resumed. ValueError naming the file and its step when no intact one precedes it."""
    dirs = [Path(ckpt_path, name) for name in CHECKPOINT_DIRS if Path(ckpt_path, name).is_dir()]
    tag = latest_tag(dirs[0]) if dirs else None
    if tag is None:
        return

    def damage(candidate):
        return next((bad for d in dirs if (bad := damaged_file(d / candidate)) is not None), None)

    bad = damage(tag)
    if bad is None:
        return
    step = _step(tag)
    earlier = [p.name for p in dirs[0].iterdir() if p.is_dir() and _step(p.name) is not None]
    earlier = sorted((t for t in earlier if t != tag and (step is None or _step(t) < step)), key=_step, reverse=True)
    intact = next((t for t in earlier if damage(t) is None), None)
    if intact is None:
        raise ValueError(
            f"--ckpt.load_enable: {bad} is damaged (checkpoint {tag}, step {step}) and no intact checkpoint precedes "
            f"it in {dirs[0]}: restore a copy, or start over: run without --ckpt.load_enable, with --ckpt.overwrite"
        )
    aside = f"{tag}.bad"
    for d in dirs:
        if (d / tag).exists():
            aside = rundir.set_aside(d / tag).name
        commit_latest(d, intact)
    rundir.warn(
        f"--ckpt.load_enable: {bad} is damaged (checkpoint {tag}, step {step}); moved it aside to {aside} and "
        f"resuming from {dirs[0] / intact} (step {_step(intact)})"
    )


# Below this much free space on the checkpoint's filesystem, a failed save is reported as a full disk: torch.save's
# zip writer says "[enforce fail at inline_container.cc] unexpected pos" instead of ENOSPC
DISK_FULL_BYTES = 16 * 2**20


def save_checkpoint(strategy, model, save_dir, tag, client_state, save_latest) -> None:
    """upstream's `model.save_checkpoint` call in `DeepspeedStrategy.save_ckpt`, with `latest` pointed at `tag` only
    after every rank wrote its files (commit_latest), and a save that failed on a full disk raised as ENOSPC, naming
    the folder, the free space and the checkpoint kept."""
    from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

    try:
        model.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest and tag is None)
    except (OSError, RuntimeError) as e:
        free = shutil.disk_usage(save_dir).free
        if getattr(e, "errno", None) != errno.ENOSPC and free >= DISK_FULL_BYTES:
            raise
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: checkpoint {tag} in {save_dir} not written ({free / 2**20:.1f} MiB free; "
            f"--ckpt.load_enable resumes from {latest_tag(save_dir) or 'no earlier checkpoint'}): {e}",
        ) from e
    if save_latest and tag is not None:
        torch_dist_barrier_and_cuda_sync()
        if strategy.is_rank_0():
            commit_latest(save_dir, tag)


def commit_latest(save_dir, tag) -> None:
    """Point `latest` at `tag` atomically, after every rank wrote its files: a temp file written and fsynced, then
    renamed over `latest`, so a kill at any moment leaves the old name or the new one (DeepSpeed truncates and
    rewrites it in place, before the ranks' closing barrier)."""
    fd, tmp = tempfile.mkstemp(dir=save_dir, prefix=".latest.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, Path(save_dir, "latest"))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
