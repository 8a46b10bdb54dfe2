"""Single-process GRPO-family trainer for CPU or one GPU (the local engine).

`Trainer.step()` reads as the algorithm:

    rollout (HF generate, G samples per prompt) -> reward -> (reward noise) -> (DAPO dynamic filtering)
    -> old-policy forward: log-probs + SALT features + last-token hidden states from ONE forward
    -> (GeoAlign curate: replace anomalous rollouts) -> group advantages (GRPO | Dr.GRPO) -> (SALT reweight)
    -> clipped surrogate (token-mean | seq-mean-token-mean) + optional KL to the reference -> AdamW

Layout: a rollout batch holds N = prompts x G rows. `sequences` (N, S) = left-padded prompt (P columns) then the
response (R = S - P columns, padded after EOS). Response-aligned tensors are (N, R): column t is the response token
`sequences[:, P + t]`, produced by the logits / lm_head input at position P + t - 1. `mask` (N, R) marks the
tokens that count: everything up to and including the first EOS.

GeoAlign's Best-Random replacement is applied as physical duplication: slot i of the batch gets a copy of rollout
`plan.source[i]` (tokens, reward, old log-probs, features), before the group statistics, so every normalizer
(group mean/std, token-mean, seq-mean-token-mean) sees the curated batch exactly as if the copies had been sampled.
"""

import copy
import math
import os
import random
import time
from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig

from openrlhf_geo import diagnostics, salt
from openrlhf_geo.features import last_token_hidden, lm_head_features
from openrlhf_geo.geoalign import Projector, curate
from openrlhf_geo.options import geoalign_config
from openrlhf_geo.rewards.noise import flip_binary, swap_to_extremes

# DAPO dynamic sampling: at most this many generation rounds to fill a batch with informative prompts.
MAX_FILTER_ROUNDS = 4


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
    entropy: torch.Tensor = None  # (N,) mean token entropy / log V, in [0, 1] (SALT entropy-alpha)
    weights: torch.Tensor = None  # (N,) float loss weight per rollout (GeoAlign zero mode)

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
def generate_rollouts(model, tokenizer, prompts, answers, n_samples, max_new_tokens, temperature=1.0, top_p=1.0):
    """HF `generate` with `n_samples` samples per prompt -> Rollouts (rows i*G .. i*G+G-1 belong to prompt i).

    Sampling uses the global torch RNG (the trainer seeds it and checkpoints its state).
    """
    device = next(model.parameters()).device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
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
    )


def response_forward(model, sequences, attention_mask, prompt_width, temperature=1.0, with_hidden=False):
    """One forward over full sequences -> (logprobs (N, R) float32, logits (N, R, V) | None, hidden (N, R, d) | None).

    logits are the raw (pre-temperature) logits that produced each response token and hidden the lm_head input at
    the same positions, captured by a forward hook on the output embedding in the SAME forward (no extra pass).
    """
    captured = {}
    handle = None
    if with_hidden:
        handle = model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: captured.__setitem__("hidden", inputs[0])
        )
    try:
        out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits[:, prompt_width - 1 : -1]
    tokens = sequences[:, prompt_width:]
    scaled = logits.float() / temperature
    logprobs = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    if not with_hidden:
        return logprobs, None, None
    return logprobs, logits, captured["hidden"][:, prompt_width - 1 : -1]


def group_advantages(rewards, group_ids, estimator, eps=1e-9):
    """Per-rollout advantages (N,) from rewards (N,) and prompt ids (N,), float64 group statistics.

    group_norm (GRPO): (r - mean_g) / (std_g + eps), std with Bessel's correction as upstream OpenRLHF;
    dr_grpo (Dr. GRPO): r - mean_g. A single-rollout group gets advantage 0.
    """
    if estimator not in ("group_norm", "dr_grpo"):
        raise ValueError(f"the local engine supports estimators group_norm and dr_grpo (got {estimator!r})")
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
    group = group.to(rewards.device)
    r = rewards.double()
    n = torch.zeros(int(group.max()) + 1, dtype=torch.float64, device=r.device).index_add_(
        0, group, torch.ones_like(r)
    )
    mean = torch.zeros_like(n).index_add_(0, group, r) / n
    centred = r - mean[group]
    if estimator == "dr_grpo":
        return centred.to(rewards.dtype)
    var = torch.zeros_like(n).index_add_(0, group, centred**2) / (n - 1).clamp(min=1)
    adv = centred / (var.sqrt()[group] + eps)
    return torch.where(n[group] > 1, adv, 0.0).to(rewards.dtype)


def clipped_surrogate(logprobs, old_logprobs, advantages, eps_low, eps_high):
    """PPO-clip per token -> (loss (N, R), clipped (N, R) bool): -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logprobs / old_logprobs (N, R), advantages (N,) broadcast over tokens. eps_high > eps_low is DAPO's clip-higher.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


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


def salt_weight_stats(advantages, new, gram, k, lengths):
    """Where SALT's coefficients put their weight (a diagnostic of the geometry, not part of SALT) -> dict of floats.

    advantages a (m,) (group-normalized), new a' (m,) (SALT's applied coefficients), gram K (m, m) of the features
    (SALT Eq. 12, ‖φ_i‖² = m·K_ii), k = SALT's k_t, lengths T (m,) response tokens. P_k is recomputed here as the
    projector on the top-k eigenvectors of K (float64 `eigh`; ties at the boundary may pick another top-k space).
      pk_rho_norm     Spearman correlation of diag(P_k) with ‖φ_i‖² (NaN when either is constant)
      pk_rho_inv_len  Spearman correlation of diag(P_k) with 1/T_i
      topnorm_share   share of ‖a'‖² on the k rollouts with the largest ‖φ_i‖² (k/m when spread evenly)
      kept            ‖a'‖² / ‖a‖²
      sign_flip       fraction of the rollouts with a_i ≠ 0 whose a'_i does not have the sign of a_i
    """
    from scipy.stats import spearmanr

    a, b = advantages.detach().double().cpu(), new.detach().double().cpu()
    K = gram.detach().double().cpu()
    m = a.numel()
    if not 1 <= k <= m:
        raise ValueError(f"k must be in [1, m] = [1, {m}] (got {k})")
    diag_p = torch.linalg.eigh(K).eigenvectors[:, m - k :].square().sum(1)  # diag(V_k V_kᵀ)
    norms, inv_len = K.diagonal(), 1.0 / lengths.detach().double().cpu().clamp(min=1)

    def rho(x, y):
        if float(x.max() - x.min()) <= 1e-12 * float(x.abs().max()) or float(y.max() - y.min()) == 0.0:
            return math.nan
        return float(spearmanr(x.numpy(), y.numpy()).statistic)

    top = torch.argsort(norms, descending=True, stable=True)[:k]
    energy = float(b.square().sum())
    moving = a != 0
    return {
        "pk_rho_norm": rho(diag_p, norms),
        "pk_rho_inv_len": rho(diag_p, inv_len),
        "topnorm_share": float(b[top].square().sum()) / energy if energy > 0 else math.nan,
        "kept": energy / float(a.square().sum()) if bool(moving.any()) else math.nan,
        "sign_flip": float((torch.sign(b[moving]) != torch.sign(a[moving])).double().mean())
        if bool(moving.any())
        else math.nan,
    }


def dynamic_filter(rewards, group_ids):
    """DAPO dynamic sampling: (N,) bool keeping the prompts whose rewards are not all equal."""
    _, group = torch.unique(group_ids.cpu(), return_inverse=True)
    n = int(group.max()) + 1
    r = rewards.detach().cpu().double()
    low = torch.full((n,), math.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amin")
    high = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amax")
    return (high > low)[group]


def sft(model, tokenizer, rows, steps, batch_size=128, lr=3e-3, warmup=50, seed=0, callback=None, final_lr_ratio=None):
    """Supervised warm-up: response-only cross-entropy (token-mean) on prompt -> response rows -> losses.

    rows: dicts with "prompt" and "response"; the target is the response tokens plus EOS. AdamW; the learning rate
    at step s (0-based) is lr·min(1, (s+1)/warmup), times, when final_lr_ratio is given, a cosine decay
    r + (1 − r)·(1 + cos(π·s/(steps − 1)))/2 from 1 at the first step to r = final_lr_ratio at the last one;
    grad-norm clip 1.0; batches drawn with a seeded `random.Random` so the warm-up is reproducible. Stops after
    `steps` steps, or earlier when `callback(step, loss)` returns True.
    """
    device = next(model.parameters()).device
    rng = random.Random(seed)
    if not rows:
        raise ValueError("sft needs at least one {prompt, response} row (got none)")
    if final_lr_ratio is not None and not 0.0 <= final_lr_ratio <= 1.0:
        raise ValueError(f"final_lr_ratio must be in [0, 1] or None (got {final_lr_ratio})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def factor(step):
        ramp = min(1.0, (step + 1) / warmup)
        if final_lr_ratio is None:
            return ramp
        cosine = (1 + math.cos(math.pi * min(1.0, step / max(steps - 1, 1)))) / 2
        return ramp * (final_lr_ratio + (1 - final_lr_ratio) * cosine)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = tokenizer([row["prompt"] for row in rows])["input_ids"]
    responses = tokenizer([row["response"] for row in rows], add_special_tokens=False)["input_ids"]
    encoded = [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompts, responses)]
    losses = []
    model.train()
    for step in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (p, r) in enumerate(batch):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            attention[i, : len(p) + len(r)] = 1
        loss = model(input_ids=ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if callback is not None and callback(step + 1, loss.item()):
            break
    return losses


@torch.no_grad()
def evaluate(model, tokenizer, rows, reward_fn, n_samples=1, max_new_tokens=16, temperature=1.0, top_p=1.0, seed=0):
    """Mean reward-function verdict over `rows` ({"prompt", "answer"}), `n_samples` samples each.

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
        )
    return torch.as_tensor(reward_fn(batch.prompts, batch.responses, batch.answers), dtype=torch.float32).mean().item()


class PromptSampler:
    """Epoch-wise shuffled prompts: every method with the same seed sees the same prompts at the same step."""

    def __init__(self, rows, seed):
        self.rows = rows
        self.rng = random.Random(seed)
        self.order, self.cursor = [], 0

    def next(self, n):
        if not self.rows:
            raise ValueError("no prompts to sample: the prompt dataset is empty")
        batch = []
        while len(batch) < n:
            if self.cursor == len(self.order):
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
                self.cursor = 0
            batch.append(self.rows[self.order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self):
        return {"rng": self.rng.getstate(), "order": list(self.order), "cursor": self.cursor}

    def load_state_dict(self, state):
        self.rng.setstate(state["rng"])
        self.order, self.cursor = list(state["order"]), state["cursor"]


class Trainer:
    """The local engine. `args` is the validated nested namespace of `openrlhf_geo.local.train.parse_args`.

    reward_fn(prompts, responses, answers) -> (N,) float tensor of binary verdicts (1 correct, 0 not) or any
    scalar rewards (noise type `flip` and DAPO's ±1 mapping need binary ones).
    rollout_stats(prompts, responses, correct) -> {name: count}: optional task-specific counts over a generated
    batch (e.g. `task.shortcut_stats`), summed over DAPO's generation rounds and merged into the step's metrics.
    """

    def __init__(self, args, model, tokenizer, rows, reward_fn, eval_rows=None, rollout_stats=None):
        self.args = args
        self.model = model
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.rollout_stats = rollout_stats
        self.eval_rows = eval_rows or []
        self.device = next(model.parameters()).device
        seed = args.train.seed
        torch.manual_seed(seed)  # HF `generate` samples from the global RNG (its state is checkpointed)
        self.sampler = PromptSampler(rows, seed)
        # independent streams so that enabling one method never shifts another's random draws
        self.generators = {
            "noise": torch.Generator().manual_seed(args.reward.noise.seed),
            "geoalign": torch.Generator().manual_seed(seed + 1),
            "salt": torch.Generator().manual_seed(seed + 2),
            "minibatch": torch.Generator().manual_seed(seed + 3),
        }
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=args.actor.adam.lr,
            betas=tuple(args.actor.adam.betas),
            weight_decay=args.actor.adam.weight_decay,
        )
        self.reference = None
        if args.algo.kl.init_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.geo_config = geoalign_config(args) if args.geoalign.enable else None
        self.projector = None  # created on the first curation (needs the hidden size)
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

        # 5. GeoAlign: replace anomalous rollouts by stable ones of their prompt (physical duplication)
        if args.geoalign.enable:
            plan, stats = self._curate(batch)
            self.last_curation = {
                "gdi": plan.gdi.cpu(),
                "corrupted": batch.corrupted,
                "flagged": plan.flagged.cpu(),
                "rewards": batch.rewards.cpu(),  # the rewards GeoAlign saw, for the report's pair-count baseline
                "group_ids": batch.group_ids.cpu(),
            }
            batch = batch.select(plan.source[plan.keep])
            batch.weights = plan.weight[plan.keep].to(self.device)
            metrics.update({f"geo/{k}": v for k, v in stats.items()})

        # 6. group advantages on the (curated) batch
        advantages = group_advantages(batch.rewards, batch.group_ids, args.algo.advantage.estimator)

        # 7. SALT reweighting of the sequence advantages (or, without SALT, the same geometry as a diagnostic)
        if batch.features is not None:
            advantages, stats = self._salt(advantages, batch)
            metrics.update({f"salt/{k}": v for k, v in stats.items()})
        if batch.weights is not None:
            advantages = advantages * batch.weights.to(advantages.dtype)

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
            )
            self._score(batch)
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
        if args.algo.dynamic_filtering_enable:
            stats["filter/pass_rate"] = (len(batch) // args.rollout.n_samples_per_prompt) / generated
        return batch, stats

    def _score(self, batch):
        """Rewards from the reward function, DAPO's ±1 mapping, then injected noise (recording what changed)."""
        args = self.args
        correct = torch.as_tensor(self.reward_fn(batch.prompts, batch.responses, batch.answers), dtype=torch.float32)
        batch.correct = correct
        rewards = 2 * correct - 1 if args.reward.pm1 else correct.clone()
        noise = args.reward.noise
        if noise.type == "flip":
            rewards, batch.corrupted = flip_binary(
                rewards, batch.group_ids, noise.rate, self.generators["noise"], levels=noise.levels
            )
        elif noise.type == "swap":
            rewards, batch.corrupted = swap_to_extremes(rewards, batch.group_ids, noise.rate, self.generators["noise"])
        batch.rewards = rewards.to(self.device)

    @torch.no_grad()
    def _old_policy_forward(self, batch):
        """Fill old (and reference) log-probs; with SALT / GeoAlign / diagnostics also features and hidden states."""
        args = self.args
        need_features = args.salt.enable or args.diagnostics.features is not None
        need_hidden = need_features or args.geoalign.enable
        method = args.salt.features if args.salt.enable else args.diagnostics.features
        dim = args.salt.dim if args.salt.enable else args.diagnostics.dim
        seed = args.salt.seed if args.salt.enable else 0
        outputs = {k: [] for k in ("old_logprobs", "ref_logprobs", "features", "hidden", "entropy")}
        size = args.rollout.micro_batch_size or len(batch)
        self.model.eval()
        for start in range(0, len(batch), size):
            rows = slice(start, start + size)
            sequences, attention = batch.sequences[rows], batch.attention_mask[rows]
            logprobs, logits, hidden = response_forward(
                self.model, sequences, attention, batch.prompt_width, args.rollout.temperature, need_hidden
            )
            outputs["old_logprobs"].append(logprobs)
            tokens, mask = sequences[:, batch.prompt_width :], batch.mask[rows]
            if need_features:
                outputs["features"].append(
                    lm_head_features(
                        logits, hidden, tokens, mask, method, dim, seed, temperature=args.rollout.temperature
                    )
                )
                if args.salt.enable and args.salt.variant == "entropy-alpha":
                    logp = torch.log_softmax(logits.float() / args.rollout.temperature, -1)
                    entropy = -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
                    outputs["entropy"].append((entropy * mask).sum(1) / mask.sum(1).clamp(min=1))
            if need_hidden:
                outputs["hidden"].append(last_token_hidden(hidden, mask).float())
            if self.reference is not None:
                ref, _, _ = response_forward(
                    self.reference, sequences, attention, batch.prompt_width, args.rollout.temperature
                )
                outputs["ref_logprobs"].append(ref)
        self.model.train()
        for key, parts in outputs.items():
            setattr(batch, key, torch.cat(parts) if parts else None)

    def _curate(self, batch):
        """GeoAlign on the batch's last-token hidden states (the projector is kept across steps) -> (plan, stats)."""
        config = self.geo_config
        if self.projector is None:
            self.projector = Projector(batch.hidden.shape[1], config, self.generators["geoalign"])
        return curate(
            batch.hidden,
            batch.rewards,
            batch.group_ids,
            config,
            self.generators["geoalign"],
            projector=self.projector,
            corrupted=batch.corrupted,
        )

    def _salt(self, advantages, batch):
        """SALT Eq. 12-18 per partition of `--salt.group_prompts` prompts -> (advantages (N,), stats averaged).

        Without SALT (diagnostics only) the advantages stay as they are and the stats hold PR and n_eff of those
        unmodified coefficients on the same features. `n_eff_out` is the n_eff of the coefficients applied (SALT's
        own stat when it is on).
        """
        args = self.args
        group = torch.unique(batch.group_ids.cpu(), return_inverse=True)[1]
        per = args.salt.group_prompts if args.salt.enable and args.salt.group_prompts else int(group.max()) + 1
        new = advantages.clone()
        all_stats = []
        for first in range(0, int(group.max()) + 1, per):
            rows = torch.nonzero((group >= first) & (group < first + per))[:, 0]
            a, feats = advantages[rows.to(advantages.device)], batch.features[rows.to(batch.features.device)]
            gram = diagnostics.gram(feats)  # raw K = F Fᵀ/m: the diagnostics' Gram (SALT may shrink its own)
            if args.salt.enable:
                # entropy-alpha: the partition's mean normalized token entropy (a scalar in [0, 1])
                entropy = float(batch.entropy[rows].mean()) if batch.entropy is not None else None
                out, stats = salt.salt_advantages(
                    a,
                    feats,
                    args.salt.variant,
                    args.salt.alpha,
                    self.generators["salt"],
                    entropy=entropy,
                    gram=args.salt.gram,
                )
                new[rows.to(new.device)] = out.to(new.dtype)
                lengths = batch.mask[rows.to(batch.mask.device)].sum(1)
                stats.update(salt_weight_stats(a, out, gram, int(stats["k"]), lengths))
            else:
                n_eff = float(diagnostics.effective_sample_size(a, gram))
                stats = {"pr": float(diagnostics.participation_ratio(gram)), "n_eff": n_eff, "n_eff_out": n_eff}
            all_stats.append(stats)
        return new, {k: sum(s[k] for s in all_stats) / len(all_stats) for k in all_stats[0]}

    def _update(self, batch, advantages):
        """`--train.max_epochs` passes over shuffled mini-batches of `--train.batch_size` rollouts, one AdamW step
        each, with gradient accumulation over `--train.micro_batch_size` rows -> metrics."""
        args = self.args
        n = len(batch)
        mini = args.train.batch_size or n
        micro = args.train.micro_batch_size or mini
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}
        updates = 0
        self.model.train()
        for _ in range(args.train.max_epochs):
            order = torch.randperm(n, generator=self.generators["minibatch"]) if mini < n else torch.arange(n)
            for start in range(0, n, mini):
                rows = order[start : start + mini]
                tokens = batch.mask[rows.to(self.device)].sum()
                normalizer = tokens if args.actor.loss_agg_mode == "token-mean" else len(rows)
                self.optimizer.zero_grad(set_to_none=True)
                for mstart in range(0, len(rows), micro):
                    part = rows[mstart : mstart + micro]
                    stats = self._loss_backward(batch, advantages, part, normalizer, tokens)
                    for key in ("loss", "policy_loss", "kl", "clip_frac"):
                        totals[key] += stats[key]
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.actor.max_norm)
                totals["grad_norm"] += float(grad_norm)
                self.optimizer.step()
                updates += 1
        return {k: v / updates for k, v in totals.items()}

    def _loss_backward(self, batch, advantages, rows, normalizer, tokens):
        """Backward of one micro-batch's share of the mini-batch loss; returns its share of each statistic
        (`tokens`: response tokens in the mini-batch, for the clipped fraction)."""
        args = self.args
        index = rows.to(self.device)
        mask = batch.mask[index]
        logprobs, _, _ = response_forward(
            self.model,
            batch.sequences[index],
            batch.attention_mask[index],
            batch.prompt_width,
            args.rollout.temperature,
        )
        eps_low, eps_high = args.actor.eps_clip_low_high or (args.actor.eps_clip, args.actor.eps_clip)
        per_token, clipped = clipped_surrogate(
            logprobs, batch.old_logprobs[index], advantages[index], eps_low, eps_high
        )
        policy_loss = aggregate(per_token, mask, args.actor.loss_agg_mode, normalizer)
        loss = policy_loss
        kl = torch.zeros(())
        if self.reference is not None:
            kl = aggregate(
                approx_kl(logprobs, batch.ref_logprobs[index], args.algo.kl.estimator),
                mask,
                args.actor.loss_agg_mode,
                normalizer,
            )
            loss = loss + args.algo.kl.init_coef * kl
        loss.backward()
        return {
            "loss": loss.item(),
            "policy_loss": policy_loss.item(),
            "kl": kl.item(),
            "clip_frac": float((clipped & mask).sum()) / float(tokens),
        }

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
        )
        return {"eval/accuracy": acc}

    # ---------------------------------------------------------------- checkpoint / resume
    def state_dict(self):
        """Everything the next step depends on: weights, optimizer, projector, every RNG stream, the step."""
        return {
            "global_step": self.global_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "projector": None if self.projector is None else self.projector.state_dict(),
            "sampler": self.sampler.state_dict(),
            "generators": {k: g.get_state() for k, g in self.generators.items()},
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state):
        self.global_step = state["global_step"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["projector"] is not None:
            hidden_size = state["projector"]["layers.0.weight"].shape[1]
            self.projector = Projector(hidden_size, self.geo_config)
            self.projector.load_state_dict(state["projector"])
        self.sampler.load_state_dict(state["sampler"])
        for key, value in state["generators"].items():
            self.generators[key].set_state(value)
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def save_checkpoint(self, path):
        """Write the state atomically (temporary file, then rename)."""
        tmp = f"{path}.tmp"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path):
        # RNG states must stay on the CPU; load_state_dict moves weights and optimizer state to their devices
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


__all__ = [
    "Rollouts",
    "Trainer",
    "aggregate",
    "approx_kl",
    "clipped_surrogate",
    "distinct_fraction",
    "dynamic_filter",
    "evaluate",
    "generate_rollouts",
    "group_advantages",
    "response_forward",
    "response_mask",
    "salt_weight_stats",
    "sft",
]
