"""Single-process GRPO-family trainer for CPU or one GPU (the local engine).

`Trainer.step()` reads as the algorithm:

    rollout (HF generate, G samples per prompt) -> reward -> (reward noise) -> (DAPO dynamic filtering)
    -> old-policy forward: log-probs + SALT features + last-token hidden states from ONE forward
    -> (PAR: rewards vs the initial policy's reference responses)
    -> (GeoAlign | PF-PPO | PODS curate: slot rewards) -> group advantages (GRPO | Dr.GRPO) -> (Seed-GRPO scale)
    -> (SALT reweight) -> row advantages x multiplicities
    -> clipped surrogate | Clip-Cov | KL-Cov (token-mean | seq-mean-token-mean)
    + optional KL to the reference - optional entropy bonus -> AdamW

Layout: a rollout batch holds N = prompts x G rows. `sequences` (N, S) = left-padded prompt (P columns) then the
response (R = S - P columns, padded after EOS). Response-aligned tensors are (N, R): column t is the response token
`sequences[:, P + t]`, produced by the logits / lm_head input at position P + t - 1. `mask` (N, R) marks the
tokens that count: everything up to and including the first EOS.

Reward noise, GeoAlign, SALT and their metrics and state are `openrlhf_geo.pipeline`, the same code the fork runs:
GeoAlign's replacement gives slot i the reward (and, for SALT, the features) of rollout `plan.source[i]` and each
rollout's row its multiplicity (see the pipeline's docstring for when that equals physical duplication). The
comparison baselines (--baseline.*, --actor.entropy_coef) are `openrlhf_geo.baselines`: PF-PPO / PODS / Seed-GRPO
through the pipeline, PAR and the policy losses here.
"""

import copy
import math
import random
import time
import warnings
from array import array
from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig

from openrlhf_geo import GeoWarning, baselines
from openrlhf_geo.estimators import check_reward_scale
from openrlhf_geo.features import lm_head_input, response_geometry
from openrlhf_geo.groups import group_index, tied_groups
from openrlhf_geo.pipeline import GeometryPipeline, SignalGuard, check_finite
from openrlhf_geo.registry import ESTIMATORS, POLICY_LOSSES, adjustment_inputs
from openrlhf_geo.rewards.math_verify import PROBLEMS
from openrlhf_geo.salt_stage import minibatch_order, minibatch_partitions, salt_partition_prompts
from openrlhf_geo.stages import stream

# DAPO dynamic sampling: at most this many generation rounds to fill a batch with informative prompts.
MAX_FILTER_ROUNDS = 4
# The longest prompt the engine trains on, in tokens after the truncation to the model's positions (`check_prompts`):
# its forward holds (rows, tokens, vocabulary) float32 logits, 17 GB a row at 128k tokens and a 32k vocabulary.
MAX_PROMPT_TOKENS = 131072
# Prompts tokenized together when they are measured (`check_prompts`): at most this many, or this many characters
# (a tokenizer holds ~150 bytes a character), so that the memory it takes stays small whatever the dataset
MEASURE_ROWS, MEASURE_CHARS = 1024, 1_000_000


@dataclass
class Rollouts:
    """One rollout batch; every tensor field has N rows (see the module docstring for the layout)."""

    sequences: torch.Tensor  # (N, S) long
    attention_mask: torch.Tensor  # (N, S) long: 0 on left padding only
    mask: torch.Tensor  # (N, R) bool: response tokens through the first EOS
    group_ids: torch.Tensor  # (N,) long: prompt index within the step
    prompts: list
    responses: list  # decoded response texts (special tokens skipped)
    answers: list
    prompt_width: int  # P
    correct: torch.Tensor = None  # (N,) float: the reward function's verdict (1 = correct), before noise
    rewards: torch.Tensor = None  # (N,) float: the reward the trainer sees (±1 mapping, noise)
    corrupted: torch.Tensor = None  # (N,) bool: reward changed by noise injection
    old_logprobs: torch.Tensor = None  # (N, R) float32
    ref_logprobs: torch.Tensor = None  # (N, R) float32
    features: torch.Tensor = None  # (N, D) float32 LM-head-gradient proxy (SALT)
    hidden: torch.Tensor = None  # (N, d) float32 last-response-token hidden state (GeoAlign)
    entropy: torch.Tensor = None  # (N,) sum over tokens of entropy / log V (SALT entropy-alpha)
    truncated: torch.Tensor = None  # (N,) bool: the response hit --rollout.max_new_tokens without an EOS

    def __len__(self):
        return self.sequences.shape[0]

    def select(self, index):
        """The rollouts at `index` (N',) long, in that order (rows may repeat): tensors, lists and texts alike."""
        index = index.cpu()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index.to(value.device)]
            elif isinstance(value, list):
                value = [value[i] for i in index.tolist()]
            out[f.name] = value
        return Rollouts(**out)

    @staticmethod
    def concat(batches, pad_token_id):
        """Rows of freshly generated batches (before the forward): prompts re-padded on the left to the widest
        prompt, responses on the right to the widest response; group ids kept distinct."""
        if len(batches) == 1:
            return batches[0]
        p_width = max(b.prompt_width for b in batches)
        r_width = max(b.mask.shape[1] for b in batches)

        def repad(x, b, value):
            left, right = p_width - b.prompt_width, r_width - b.mask.shape[1]
            return torch.nn.functional.pad(x, (left, right), value=value)

        offsets = torch.tensor([0] + [int(b.group_ids.max()) + 1 for b in batches[:-1]]).cumsum(0)
        return Rollouts(
            sequences=torch.cat([repad(b.sequences, b, pad_token_id) for b in batches]),
            attention_mask=torch.cat([repad(b.attention_mask, b, 0) for b in batches]),
            mask=torch.cat([torch.nn.functional.pad(b.mask, (0, r_width - b.mask.shape[1])) for b in batches]),
            group_ids=torch.cat([b.group_ids + o for b, o in zip(batches, offsets)]),
            prompts=[x for b in batches for x in b.prompts],
            responses=[x for b in batches for x in b.responses],
            answers=[x for b in batches for x in b.answers],
            prompt_width=p_width,
            correct=torch.cat([b.correct for b in batches]),
            rewards=torch.cat([b.rewards for b in batches]),
            corrupted=None if batches[0].corrupted is None else torch.cat([b.corrupted for b in batches]),
            truncated=torch.cat([b.truncated for b in batches]),
        )


def response_mask(responses, eos_token_id):
    """(N, R) bool: True up to and including the first EOS of each row; rows without EOS count every token.

    responses (N, R) long. Works whether the generator pads finished rows with a pad id or with EOS itself.
    """
    is_eos = responses == eos_token_id
    return (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0


def distinct_fraction(responses, group_ids):
    """Mean over prompts of (distinct response strings) / (responses): 1 = no two rollouts of a prompt are equal.

    responses: N texts, group_ids (N,) prompt ids.
    """
    groups = {}
    for text, g in zip(responses, group_ids.tolist()):
        groups.setdefault(g, []).append(text)
    return sum(len(set(texts)) / len(texts) for texts in groups.values()) / max(len(groups), 1)


def position_ids(attention_mask):
    """(N, S) positions counting only attended tokens, as HF `generate` assigns them with left padding."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def generate_rollouts(
    model,
    tokenizer,
    prompts,
    answers,
    n_samples,
    max_new_tokens,
    temperature=1.0,
    top_p=1.0,
    max_prompt_tokens=None,
):
    """HF `generate` with `n_samples` samples per prompt -> Rollouts (rows i*G .. i*G+G-1 belong to prompt i).

    A prompt longer than `max_prompt_tokens` (`prompt_budget`) is truncated on the left (`check_prompts`); the
    Rollouts keep its text as written. Sampling uses the global torch RNG (the trainer seeds it and checkpoints its
    state).
    """
    device = next(model.parameters()).device
    side, tokenizer.truncation_side = tokenizer.truncation_side, "left"  # restored: it is saved with the model
    try:
        enc = tokenizer(
            list(prompts),
            return_tensors="pt",
            padding=True,
            padding_side="left",
            truncation=max_prompt_tokens is not None,
            max_length=max_prompt_tokens,
        )
    finally:
        tokenizer.truncation_side = side
    input_ids = enc["input_ids"].repeat_interleave(n_samples, 0).to(device)
    prompt_mask = enc["attention_mask"].repeat_interleave(n_samples, 0).to(device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    was_training = model.training
    model.eval()
    sequences = model.generate(input_ids=input_ids, attention_mask=prompt_mask, generation_config=config)
    model.train(was_training)
    width = input_ids.shape[1]
    responses = sequences[:, width:]
    mask = response_mask(responses, eos)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(responses)], dim=1)
    texts = tokenizer.batch_decode(responses.masked_fill(~mask, pad).cpu(), skip_special_tokens=True)
    return Rollouts(
        sequences=sequences,
        attention_mask=attention_mask,
        mask=mask,
        group_ids=torch.arange(len(prompts)).repeat_interleave(n_samples),
        prompts=[p for p in prompts for _ in range(n_samples)],
        responses=texts,
        answers=[a for a in answers for _ in range(n_samples)],
        prompt_width=width,
        truncated=~(responses == eos).any(1).cpu(),
    )


def _at_least_float32(x):
    """bf16/fp16 logits as float32; a float64 model's stay float64 (--train.dtype float64 exists for its rounding)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def response_forward(
    model, sequences, attention_mask, prompt_width, temperature=1.0, with_geometry=False, return_logits=False
):
    """One forward over full sequences -> (logprobs (N, R) float32, logits (N, S, V) | None, hidden (N, S, d) | None).

    With `with_geometry`, logits (raw) and hidden (the lm_head input, captured by a forward hook in the SAME forward)
    cover every position, for `features.response_geometry`; `return_logits` returns the logits without the hook.
    """
    with lm_head_input(model, enabled=with_geometry) as captured:
        out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    tokens = sequences[:, prompt_width:]
    scaled = _at_least_float32(out.logits[:, prompt_width - 1 : -1]) / temperature
    logprobs = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    if not with_geometry:
        return logprobs, out.logits if return_logits else None, None
    return logprobs, out.logits, captured.hidden


def token_entropy(logits, prompt_width, temperature=1.0):
    """Per-token policy entropy H(s_t) = -sum_a pi log pi (SALT Eq. 70) of the temperature-scaled policy that sampled
    the responses -> (N, R), differentiable; logits (N, S, V) raw, response-aligned as in `response_forward`."""
    scaled = _at_least_float32(logits[:, prompt_width - 1 : -1]) / temperature
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)


def approx_kl(logprobs, ref_logprobs, estimator="k3"):
    """Per-token KL(pi || pi_ref) estimate (N, R): k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return log_ratio**2 / 2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"--algo.kl.estimator must be one of k1, k2, k3 (got {estimator!r})")


def aggregate(per_token, mask, mode, normalizer):
    """Sum a per-token loss (N, R) into a scalar share of a mini-batch whose size is `normalizer`.

    token-mean: sum of masked tokens / normalizer (= tokens in the mini-batch).
    seq-mean-token-mean: sum over rows of (row's token mean) / normalizer (= rows in the mini-batch).
    Summing the shares of all micro-batches gives the mini-batch loss exactly (gradient accumulation).
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / normalizer
    if mode == "seq-mean-token-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / normalizer
    raise ValueError(f"--actor.loss_agg_mode must be token-mean or seq-mean-token-mean (got {mode!r})")


def dynamic_filter(rewards, group_ids):
    """DAPO dynamic sampling: (N,) bool keeping the prompts whose rewards are not all equal."""
    group, n_groups = group_index(group_ids)
    return ~tied_groups(rewards.detach().cpu(), group, n_groups)[group]


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows,
    reward_fn,
    n_samples=1,
    max_new_tokens=16,
    temperature=1.0,
    top_p=1.0,
    seed=0,
    max_prompt_tokens=None,
):
    """Mean reward-function verdict over `rows` ({"prompt", "answer"}), `n_samples` samples each (prompts truncated
    to `max_prompt_tokens` as in `generate_rollouts`).

    Samples under a forked torch RNG seeded with `seed`, so evaluating never shifts the caller's random stream.
    """
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        batch = generate_rollouts(
            model,
            tokenizer,
            [r["prompt"] for r in rows],
            [r["answer"] for r in rows],
            n_samples,
            max_new_tokens,
            temperature,
            top_p,
            max_prompt_tokens,
        )
    return torch.as_tensor(reward_fn(batch.prompts, batch.responses, batch.answers), dtype=torch.float32).mean().item()


def model_source(args, tokenizer=False):
    """The flag and value that named the model (or, with `tokenizer`, its tokenizer), for messages."""
    if tokenizer and args.actor.tokenizer is not None:
        return f"--actor.tokenizer {args.actor.tokenizer}"
    if args.actor.model_name_or_path is not None:
        return f"--actor.model_name_or_path {args.actor.model_name_or_path}"
    return f"--actor.config {args.actor.config}"


def prompt_budget(args, model, tokenizer):
    """The most tokens a prompt may have so that it and --rollout.max_new_tokens fit the model's positions
    (max_position_embeddings; None for a model without that limit); ValueError when no prompt fits."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return None
    new = args.rollout.max_new_tokens
    if positions - new < len(tokenizer("")["input_ids"]) + 1:  # the special tokens every prompt gets, and one more
        raise ValueError(
            f"--rollout.max_new_tokens {new} leaves no room for a prompt in the {positions} positions "
            f"(max_position_embeddings) of {model_source(args)}"
        )
    return positions - new


def check_prompts(rows, tokenizer, budget, args, name):
    """Tokenize every prompt of `rows` once, a few at a time (a dataset streams from its file). ValueError naming
    the prompt's file and line (`rows.where`; else its row in `name`) for a prompt longer than MAX_PROMPT_TOKENS once
    truncated to `budget`, or one the tokenizer gives no tokens. The prompts longer than `budget` get one GeoWarning
    saying how many and how `generate_rollouts` cuts them: on the left, as upstream OpenRLHF cuts a prompt longer
    than its budget, so that the prompt's end, which the response continues, stays (and so does a leading <bos>)."""
    longer, batch, chars = 0, [], 0

    def where(i):
        return rows.where(i) if hasattr(rows, "where") else f"{name} row {i + 1}"

    def measure():
        nonlocal longer
        if not batch:
            return
        for (i, _), ids in zip(batch, tokenizer([prompt for _, prompt in batch])["input_ids"]):
            if min(len(ids), budget or len(ids)) > MAX_PROMPT_TOKENS:
                raise ValueError(
                    f"{where(i)}: the prompt is {len(ids)} tokens, over the local engine's limit of "
                    f"{MAX_PROMPT_TOKENS} (MAX_PROMPT_TOKENS)"
                )
            if not ids:
                raise ValueError(
                    f"{model_source(args, tokenizer=True)}: its tokenizer gives no tokens for the prompt of "
                    f"{where(i)} (an empty prompt, or a tokenizer without its vocabulary, e.g. no tokenizer.json)"
                )
            longer += budget is not None and len(ids) > budget
        batch.clear()

    for i, row in enumerate(rows):
        batch.append((i, row["prompt"]))
        chars += len(row["prompt"])
        if len(batch) >= MEASURE_ROWS or chars >= MEASURE_CHARS:
            measure()
            chars = 0
    measure()
    if longer:
        new = args.rollout.max_new_tokens
        warnings.warn(
            f"{longer} of the {len(rows)} prompts of {getattr(rows, 'source', name)} are longer than the {budget} "
            f"tokens the model leaves a prompt (max_position_embeddings {budget + new} - --rollout.max_new_tokens "
            f"{new}): they are truncated on the left, as upstream OpenRLHF does, keeping their end (where the "
            "response continues) after any leading special token",
            GeoWarning,
            stacklevel=3,
        )


class PromptSampler:
    """Epoch-wise shuffled prompts: every method with the same seed sees the same prompts at the same step.

    `rows`: any sequence of {"prompt", "answer"} (a dataset reads the rows it is asked for from its file); the
    epoch's order is an int64 array, 8 bytes a row (the checkpoint stores it as a list, as before).
    """

    def __init__(self, rows, seed):
        self.rows = rows
        self.rng = random.Random(seed)
        self.order, self.cursor = array("q"), 0

    def next(self, n):
        if not self.rows:
            raise ValueError("no prompts to sample: the prompt dataset is empty")
        batch = []
        while len(batch) < n:
            if self.cursor == len(self.order):
                self.order = array("q", range(len(self.rows)))
                self.rng.shuffle(self.order)  # the permutation a list of the same numbers gets
                self.cursor = 0
            batch.append(self.rows[self.order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self):
        return {"rng": self.rng.getstate(), "order": list(self.order), "cursor": self.cursor}

    def load_state_dict(self, state):
        self.rng.setstate(state["rng"])
        self.order, self.cursor = array("q", state["order"]), state["cursor"]


def check_misspecified(args, misspecified_pay) -> None:
    """ValueError when --reward.noise.type misspecified comes without the task's hook saying which rollouts the
    misspecified verifier pays (`openrlhf-geo train` checks before loading anything, the Trainer when built)."""
    if args.geometry.noise.type == "misspecified" and misspecified_pay is None:
        raise ValueError(
            "--reward.noise.type misspecified needs a task that says which rollouts its misspecified verifier "
            "pays; `openrlhf-geo train` has none (the demo task has one: `openrlhf-geo study geoalign-failure`)"
        )


class Trainer:
    """The local engine. `args` is the validated nested namespace of `openrlhf_geo.local.flags.parse_args`.

    reward_fn(prompts, responses, answers) -> (N,) float tensor of binary verdicts (1 correct, 0 not) or any
    scalar rewards (noise type `flip` and DAPO's ±1 mapping need binary ones). A reward_fn with `last_statuses`
    (math-verify verdict kinds of its last call, reward.CachedMathVerify) gets their shares logged as
    math_verify/<status> (no_box, bad_gold, timeout, error), as the fork logs them.
    rollout_stats(prompts, responses, correct) -> {name: count}: optional task-specific counts over a generated
    batch (e.g. `task.shortcut_stats`), summed over DAPO's generation rounds and merged into the step's metrics.
    misspecified_pay(prompts, responses, answers) -> (N,) bool: the rollouts a misspecified verifier also pays
    (e.g. `task.ShortcutPayer`); required by, and only used with, --reward.noise.type misspecified.
    verifier: a MathVerifyReward whose worker pool (and timeout) checks Seed-GRPO's answer pairs (the math reward's,
    `training.make_trainer`); None checks them in this process, without a timeout.
    """

    def __init__(
        self,
        args,
        model,
        tokenizer,
        rows,
        reward_fn,
        eval_rows=None,
        rollout_stats=None,
        misspecified_pay=None,
        verifier=None,
    ):
        self.args = args
        self.model = model
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.rollout_stats = rollout_stats
        check_misspecified(args, misspecified_pay)
        self.misspecified_pay = misspecified_pay
        self.eval_rows = eval_rows or []
        self.device = next(model.parameters()).device
        self.max_prompt_tokens = prompt_budget(args, model, tokenizer)  # longer prompts are truncated (generate)
        check_prompts(rows, tokenizer, self.max_prompt_tokens, args, "prompts")
        check_prompts(self.eval_rows, tokenizer, self.max_prompt_tokens, args, "held-out prompts")
        seed = args.train.seed
        torch.manual_seed(seed)  # HF `generate` samples from the global RNG (its state is checkpointed)
        self.sampler = PromptSampler(rows, seed)
        # reward noise, GeoAlign, SALT: the pipeline the fork runs too (its own random streams, seeded from `seed`)
        self.pipeline = GeometryPipeline(args.geometry)  # built once at parse time (options.validate)
        self.signal = SignalGuard(args.rollout.max_new_tokens)  # warns when a step has nothing to learn from
        salt, n = self.pipeline.config.salt, args.rollout.n_samples_per_prompt
        # SALT's m = B*G is the optimizer mini-batch (SALT §3.1, Table 4): prompts per AdamW step by default, and
        # then each AdamW step trains on exactly one partition's rollouts
        self.partition_prompts = salt_partition_prompts(salt, args.train.batch_size, n)
        self.minibatch_prompts = minibatch_partitions(salt, args.train.batch_size, n)
        self.minibatch_generator = stream(seed, "minibatch")
        self.baseline = self.pipeline.config.baseline or baselines.BaselineConfig()
        self.loss_generator = stream(seed, "loss")  # Clip-Cov's token draw
        self.verifier = verifier
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=args.actor.adam.lr,
            betas=tuple(args.actor.adam.betas),
            weight_decay=args.actor.adam.weight_decay,
        )
        self.reference = None  # the frozen initial policy: KL's reference and PAR's reference-response sampler
        if args.algo.kl.init_coef > 0 or "references" in adjustment_inputs(self.pipeline.config):  # PAR's
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.last_curation = None  # per-rollout GDI, corruption, flags, rewards, prompt ids of the last curated batch
        self.global_step = 0

    # ---------------------------------------------------------------- one RL step
    def step(self):
        """One RL step: collect a rollout batch, then learn from it -> metrics (the row written to metrics.jsonl)."""
        t0 = time.perf_counter()
        self.global_step += 1
        # 1-3. rollouts (HF generate), rewards, noise; DAPO refills filtered prompts with fresh ones
        batch, stats = self._collect()
        stats["time/rollout_s"] = time.perf_counter() - t0
        stats.update(self.signal.check(batch.rewards, batch.group_ids, batch.truncated))
        metrics = {"step": self.global_step, **stats, **self.learn(batch)}
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def learn(self, batch):
        """Steps 4-8 on a scored batch (rewards set; `correct`/`corrupted` optional) -> metrics."""
        args, t0 = self.args, time.perf_counter()
        metrics = {"reward": batch.rewards.mean().item(), "response_length": batch.mask.sum(1).double().mean().item()}

        # 4. the old-policy forward: log-probs, SALT features, last-token hidden states
        self._old_policy_forward(batch)
        metrics["time/forward_s"] = time.perf_counter() - t0

        # 5. PAR: each reward against M reference responses of the initial policy, then GeoAlign / PF-PPO / PODS:
        # slot i takes the reward of the rollout that fills it (identity without curation)
        step = self.pipeline.start(batch.group_ids.cpu(), batch.corrupted, batch.mask.sum(1))
        rewards = step.adjust("reward", batch.rewards, references=lambda: self._reference_rewards(batch))
        metrics.update(step.batch_metrics)
        rewards = step.curate(rewards, batch.hidden)
        self.last_curation = step.curation

        # 6. group advantages on the slots (a `drop`, PODS or PF-PPO-filtered slot leaves the group statistics)
        kept = step.kept.to(rewards.device)
        advantages = torch.zeros_like(rewards)
        advantages[kept] = ESTIMATORS[args.algo.advantage.estimator].advantages(rewards[kept], batch.group_ids[kept])
        # 7. the advantage adjustments: Seed-GRPO's per-prompt scaling, then SALT's reweighting of the sequence
        # advantages (or, with --salt.diagnostics, only its geometry logged)
        advantages = step.adjust(
            "advantage",
            advantages,
            responses=lambda: batch.responses,
            verifier=lambda: self.verifier,
            features=lambda: batch.features,
            entropy=lambda: batch.entropy,
            lengths=lambda: batch.mask.sum(1),
            partition_prompts=lambda: self.partition_prompts,
        )
        value, multiplicity = step.rows(advantages)
        # as upstream's compute_reward clamps the sequence advantage to --reward.clip_range before the tokens get it
        advantages = value.clamp(*args.reward.clip_range) * multiplicity
        check_finite("advantage", advantages, batch.group_ids, self.global_step)
        for key, values in step.metrics.items():
            metrics[key] = float(values.nanmean()) if bool(values.isfinite().any()) else math.nan
        metrics.update(step.text_metrics)

        # 8. clipped surrogate (+ KL to the reference) and AdamW
        t1 = time.perf_counter()
        metrics.update(self._update(batch, advantages))
        metrics["time/update_s"] = time.perf_counter() - t1
        return metrics

    def _collect(self):
        """Generate, score and corrupt rollouts -> (batch, stats). With DAPO dynamic filtering, prompts whose rollouts
        all got the same reward are dropped and replaced by fresh ones, for at most MAX_FILTER_ROUNDS rounds."""
        args = self.args
        need, kept, correct, distinct, generated = args.rollout.batch_size, [], [], [], 0
        counts = {}  # rollout_stats, summed over generation rounds
        statuses = []  # math-verify verdict kinds when the reward function reports them (reward.CachedMathVerify)
        for _ in range(MAX_FILTER_ROUNDS if args.algo.dynamic_filtering_enable else 1):
            rows = self.sampler.next(need)
            batch = generate_rollouts(
                self.model,
                self.tokenizer,
                [r["prompt"] for r in rows],
                [r["answer"] for r in rows],
                args.rollout.n_samples_per_prompt,
                args.rollout.max_new_tokens,
                args.rollout.temperature,
                args.rollout.top_p,
                self.max_prompt_tokens,
            )
            self._score(batch)
            statuses += getattr(self.reward_fn, "last_statuses", None) or []
            if self.rollout_stats is not None:
                for key, value in self.rollout_stats(batch.prompts, batch.responses, batch.correct).items():
                    counts[key] = counts.get(key, 0.0) + float(value)
            generated += len(rows)
            correct.append(batch.correct)
            distinct.append(distinct_fraction(batch.responses, batch.group_ids) * len(rows))
            if args.algo.dynamic_filtering_enable:
                batch = batch.select(torch.nonzero(dynamic_filter(batch.rewards, batch.group_ids))[:, 0])
            need -= len(batch) // args.rollout.n_samples_per_prompt
            if len(batch):
                kept.append(batch)
            if need <= 0:
                break
        if not kept:
            raise RuntimeError(
                f"dynamic filtering removed every prompt in {MAX_FILTER_ROUNDS} rounds (every prompt's rollouts got "
                "the same reward); make the task easier/harder or drop --algo.dynamic_filtering_enable"
            )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batch = Rollouts.concat(kept, pad)
        # over everything generated, before filtering
        stats = {"accuracy": torch.cat(correct).mean().item(), "distinct_responses": sum(distinct) / generated}
        stats.update(counts)
        if statuses:  # shares, as the fork logs the math-verify reward's extra_logs (e.g. a gold it cannot parse)
            stats.update({f"math_verify/{s}": statuses.count(s) / len(statuses) for s in PROBLEMS})
        if args.algo.dynamic_filtering_enable:
            stats["filter/pass_rate"] = (len(batch) // args.rollout.n_samples_per_prompt) / generated
        return batch, stats

    @torch.no_grad()
    def _reference_rewards(self, batch):
        """PAR's references: --baseline.par_references M responses per prompt sampled from the frozen initial policy
        (rollout settings), scored by the reward function with the rollouts' ±1 mapping and without injected noise
        (the noise experiments corrupt the policy's rewards) -> (N, M), each rollout its prompt's M rewards."""
        args, m = self.args, self.baseline.par_references
        prompt, n_prompts = group_index(batch.group_ids)  # each rollout's prompt, 0..P-1
        rows = [int(torch.nonzero(prompt == g)[0, 0]) for g in range(n_prompts)]  # one row per prompt
        references = generate_rollouts(
            self.reference,
            self.tokenizer,
            [batch.prompts[i] for i in rows],
            [batch.answers[i] for i in rows],
            m,
            args.rollout.max_new_tokens,
            args.rollout.temperature,
            args.rollout.top_p,
            self.max_prompt_tokens,
        )
        scores = torch.as_tensor(
            self.reward_fn(references.prompts, references.responses, references.answers), dtype=torch.float32
        )
        scores = 2 * scores - 1 if args.reward.pm1 else scores
        return scores.view(len(rows), m)[prompt].to(batch.rewards.device)

    def _score(self, batch):
        """Rewards from the reward function, DAPO's ±1 mapping, then injected noise (recording what changed)."""
        args = self.args
        correct = torch.as_tensor(self.reward_fn(batch.prompts, batch.responses, batch.answers), dtype=torch.float32)
        batch.correct = correct
        rewards = 2 * correct - 1 if args.reward.pm1 else correct.clone()
        check_reward_scale(rewards, batch.group_ids, self.global_step, f"--reward.func {args.reward.func}")
        paid = None
        if self.pipeline.config.noise.type == "misspecified":
            paid = torch.as_tensor(
                self.misspecified_pay(batch.prompts, batch.responses, batch.answers), dtype=torch.bool
            )
        rewards, corrupted = self.pipeline.corrupt(rewards, batch.group_ids, paid)
        batch.corrupted = corrupted if self.pipeline.config.noise.enabled else None
        batch.rewards = rewards.to(self.device)

    @torch.no_grad()
    def _old_policy_forward(self, batch):
        """Fill old (and reference) log-probs and, for SALT / GeoAlign, the per-response geometry of the SAME forward
        (`features.response_geometry`, as in the fork: features, last-response-token hidden state, entropy sums)."""
        args = self.args
        spec = self.pipeline.config.spec
        outputs = {k: [] for k in ("old_logprobs", "ref_logprobs", "features", "hidden", "entropy")}
        size = args.rollout.micro_batch_size or len(batch)
        width = batch.prompt_width
        self.model.eval()
        for start in range(0, len(batch), size):
            rows = slice(start, start + size)
            sequences, attention = batch.sequences[rows], batch.attention_mask[rows]
            logprobs, logits, hidden = response_forward(
                self.model, sequences, attention, width, args.rollout.temperature, spec is not None
            )
            outputs["old_logprobs"].append(logprobs)
            if spec is not None:
                mask = batch.mask[rows]
                producing = torch.zeros_like(sequences, dtype=torch.bool)  # positions whose logits made a token
                producing[:, width - 1 : -1] = mask
                response = torch.zeros_like(sequences, dtype=torch.bool)  # positions holding a response token
                response[:, width:] = mask
                geometry = response_geometry(
                    spec,
                    logits.float() / args.rollout.temperature,
                    hidden,
                    sequences.roll(-1, dims=1),
                    producing,
                    response,
                    args.rollout.temperature,
                )
                for key, value in geometry.items():
                    outputs[key].append(value)
            if args.algo.kl.init_coef > 0:
                ref, _, _ = response_forward(self.reference, sequences, attention, width, args.rollout.temperature)
                outputs["ref_logprobs"].append(ref)
        self.model.train()
        for key, parts in outputs.items():
            setattr(batch, key, torch.cat(parts) if parts else None)

    def _update(self, batch, advantages):
        """`--train.max_epochs` passes over shuffled mini-batches of `--train.batch_size` rollouts, one AdamW step
        each, with gradient accumulation over `--train.micro_batch_size` rows -> metrics. With SALT's partitions as
        mini-batches (salt_stage.minibatch_partitions), each mini-batch is one partition's rows, a short partition (a
        rollout batch that is not whole partitions, e.g. after DAPO's filter) included: its own, smaller step."""
        args = self.args
        n = len(batch)
        mini = args.train.batch_size or n
        micro = args.train.micro_batch_size or mini
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}
        updates = 0  # micro-batch shares of the mini-batch statistics add up; mini-batches are averaged
        self.model.train()
        for _ in range(args.train.max_epochs):
            if mini >= n:
                minibatches = [torch.arange(n)]
            elif self.minibatch_prompts:
                partition = group_index(batch.group_ids)[0] // self.minibatch_prompts
                order = minibatch_order(partition, self.minibatch_generator)
                # one step per partition: slicing `mini` rows after a short partition splits the next one in two
                sizes = torch.unique_consecutive(partition[order], return_counts=True)[1]
                minibatches = order.split(sizes.tolist())
            else:
                minibatches = torch.randperm(n, generator=self.minibatch_generator).split(mini)
            for rows in minibatches:
                tokens = batch.mask[rows.to(self.device)].sum()
                normalizer = tokens if args.actor.loss_agg_mode == "token-mean" else len(rows)
                self.optimizer.zero_grad(set_to_none=True)
                for mstart in range(0, len(rows), micro):
                    part = rows[mstart : mstart + micro]
                    stats = self._loss_backward(batch, advantages, part, normalizer, tokens)
                    for key, value in stats.items():
                        totals[key] = totals.get(key, 0.0) + value
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.actor.max_norm)
                totals["grad_norm"] += float(grad_norm)
                self.optimizer.step()
                updates += 1
        return {k: v / updates for k, v in totals.items()}

    def _loss_backward(self, batch, advantages, rows, normalizer, tokens):
        """Backward of one micro-batch's share of the mini-batch loss; returns its share of each statistic
        (`tokens`: response tokens in the mini-batch, for the token fractions)."""
        args = self.args
        index = rows.to(self.device)
        mask = batch.mask[index]
        entropy_coef = args.actor.entropy_coef
        logprobs, logits, _ = response_forward(
            self.model,
            batch.sequences[index],
            batch.attention_mask[index],
            batch.prompt_width,
            args.rollout.temperature,
            return_logits=entropy_coef is not None,
        )
        eps_low, eps_high = args.actor.eps_clip_low_high or (args.actor.eps_clip, args.actor.eps_clip)
        share = float(mask.sum()) / float(tokens)  # this micro-batch's part of the mini-batch's tokens
        out = {}
        # the registered loss: PPO's clipped surrogate (default), SALT App. I's Clip-Cov / KL-Cov (arXiv 2505.22617)
        registered = POLICY_LOSSES[self.baseline.policy_loss]
        per_token, stats = baselines.policy_loss(
            self.baseline, logprobs, batch.old_logprobs[index], advantages[index], mask, eps_low, eps_high,
            self.loss_generator,
        )  # fmt: skip
        out["clip_frac"] = stats.get(registered.clip_frac, 0.0) * share  # None: no ratio clip (KL-Cov)
        if registered.metrics is not None:
            out.update({f"{registered.metrics}/{key}": value * share for key, value in stats.items()})
        policy_loss = aggregate(per_token, mask, args.actor.loss_agg_mode, normalizer)
        loss = policy_loss
        if entropy_coef is not None:  # SALT Eq. 70-71, aggregated like the policy loss
            bonus, stats = baselines.entropy_bonus_loss(
                token_entropy(logits, batch.prompt_width, args.rollout.temperature),
                mask,
                entropy_coef,
                args.actor.loss_agg_mode,
                normalizer,
            )
            loss = loss + bonus
            out["entropy_loss"] = stats["entropy_bonus/entropy"]  # upstream's name for the aggregated entropy
        kl = torch.zeros(())
        if args.algo.kl.init_coef > 0:
            kl = aggregate(
                approx_kl(logprobs, batch.ref_logprobs[index], args.algo.kl.estimator),
                mask,
                args.actor.loss_agg_mode,
                normalizer,
            )
            loss = loss + args.algo.kl.init_coef * kl
        if not bool(torch.isfinite(loss)):
            raise ValueError(
                f"step {self.global_step}: the loss of rollouts {rows.tolist()[:8]}... is {loss.item()}; stopped "
                "before the optimizer step (no checkpoint written)"
            )
        loss.backward()
        return {"loss": loss.item(), "policy_loss": policy_loss.item(), "kl": kl.item(), **out}

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, n_samples=1, seed=0):
        """{"eval/accuracy": mean verdict on the held-out rows} at the rollout temperature ({} without rows)."""
        if not self.eval_rows:
            return {}
        a = self.args.rollout
        acc = evaluate(
            self.model,
            self.tokenizer,
            self.eval_rows,
            self.reward_fn,
            n_samples,
            a.max_new_tokens,
            a.temperature,
            a.top_p,
            seed,
            self.max_prompt_tokens,
        )
        return {"eval/accuracy": acc}

    # ---------------------------------------------------------------- checkpoint / resume
    def state_dict(self):
        """Everything the next step depends on: weights, optimizer, projector, every RNG stream, the step."""
        return {
            "global_step": self.global_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "pipeline": self.pipeline.state_dict(),
            "signal": self.signal.state_dict(),
            "sampler": self.sampler.state_dict(),
            "minibatch_generator": self.minibatch_generator.get_state(),
            "loss_generator": self.loss_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state):
        self.global_step = state["global_step"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.pipeline.load_state_dict(state["pipeline"])
        if "signal" in state:  # checkpoints from before the learning-signal guard
            self.signal.load_state_dict(state["signal"])
        self.sampler.load_state_dict(state["sampler"])
        self.minibatch_generator.set_state(state["minibatch_generator"])
        if "loss_generator" in state:  # checkpoints from before Clip-Cov
            self.loss_generator.set_state(state["loss_generator"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])


__all__ = [
    "Rollouts",
    "Trainer",
    "aggregate",
    "approx_kl",
    "distinct_fraction",
    "dynamic_filter",
    "evaluate",
    "generate_rollouts",
    "response_forward",
    "response_mask",
    "token_entropy",
]
