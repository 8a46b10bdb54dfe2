"""`openrlhf-geo inspect`: before renting GPUs, is a user's GRPO batch in SALT's regime, and do its hidden states carry
GeoAlign's direction? On the user's model, prompts and reward, beside their nulls, with CIs over prompts.

Phases, each saved in --out so that a killed run resumes where it stopped: sampling (G rollouts per prompt, HF
`generate` or vLLM, `studies.real_lm`'s samplers; or --rollouts, token ids saved before) -> rollouts.npz; scoring
(the reward the engines take: `--reward.func` math_verify or a .py file, `--reward.remote_url` an HTTP reward model)
-> rewards.pt; one forward per rollout for SALT's default LM-head features (SALT Eq. 19) and the last-token hidden
states (GeoAlign §4.1), `real_lm.forward_geometry` -> geometry.pt; then the analysis and report.md, summary.json,
inspect.png.

The analysis is the real-LM studies' own, at a fixed protocol (no threshold is chosen from the results):
- SALT (`real_lm_geometry`): disjoint batches of --rollout.batch_size prompts x G (a training step's SALT batch,
  SALT Table 4: 32 x 8): GRPO advantages (group_norm), n_eff(a) (Eq. 6) with the corrected CI over prompts (the
  study's amendment item 2, copies apart) beside n_eff of a permuted within groups (item 6); PR (Eq. 5); k_t by
  Eq. 14 and by the released code's rule (`salt.K_RULES`); D_a (Eq. 59) and ‖a'‖/‖a‖ of SALT's a' (Eq. 18) beside
  a random subspace of the same k_t (item 3, with the gap's CI over prompts, recentred) and beside a permuted within
  groups; App. D.1's n_eff,in (Eq. 49 over the groups with signal). The verdict is the study's rule: in SALT's
  regime when the CI of n_eff(a) lies below 1, outside when above, else not decided, with the prompts that would
  decide it.
- GeoAlign (`real_lm_geoalign`'s amendment): batches of up to 16 prompts; the projector's orientation accuracy and
  the cos > 0.8 share on held-out prompts by cross-fitting (§4.2-4.3, Eq. 4-6) beside two nulls (hidden states
  permuted within each prompt, Gaussian rows); GDI's AUROC (Eq. 7) on planted 5 % / 10 % flips (§5.3) beside GDI on
  the permuted null and the reward-only pair count; CIs over prompts; the study's amended verdicts.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import shlex
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from openrlhf_geo.jsonl import strict_json

ROLLOUTS, REWARDS, GEOMETRY = "rollouts.npz", "rewards.pt", "geometry.pt"  # rollouts: real_lm.save_rollouts
SUMMARY, REPORT, PLOT = "summary.json", "report.md", "inspect.png"
FORMAT = 1  # what rewards.pt / geometry.pt hold; a phase file of another format is recomputed
MIN_PROMPTS = 8  # fewer: a percentile CI over prompt resamples is no CI (and GeoAlign has no held-out fold)
PERMUTED_DRAWS = 20  # the permuted-advantage null of D_a and ‖a'‖/‖a‖: draws per batch
PERMUTED_STREAM = 4  # real_lm_geometry.draw_seed's stream for it (0-3 are the study's)
REMOTE_TIMEOUT_S = 600
REMOTE_BATCH = 256  # responses per POST (upstream posts one per rollout; serve-rm refuses more than 4096 in one)


@dataclass(frozen=True)
class Protocol:
    """What the analysis does with a collection. `inspect` fixes all but the SALT batch (its --rollout.batch_size):
    the study's counts, seeds and rules; GeoAlign's flip draws are 2 per rate and batch (the study's quick count:
    its 5 cost 2.5x the time for the same pooled AUROC CI's resolution over prompts)."""

    salt_prompts: int = 32
    geoalign_prompts: int = 16
    draws: int = 2
    replicates: int = 2000  # real_lm_geometry.PROMPT_REPLICATES
    gap_replicates: int = 200  # real_lm_geometry.GAP_REPLICATES


class InspectError(ValueError):
    """A one-line refusal naming the flag or value at fault."""


def build_parser():
    p = argparse.ArgumentParser(
        prog="openrlhf-geo inspect",
        description="Sample G rollouts per prompt with your model and reward, then measure SALT's regime and "
        "GeoAlign's separability beside their nulls (report.md, summary.json, inspect.png in --out).",
    )
    p.add_argument("--model", "--actor.model_name_or_path", dest="model", required=True,
                   help="HF causal LM (directory or hub id), or smollm2 (the offline real LM)")  # fmt: skip
    p.add_argument(
        "--prompts", "--data.prompt_dataset", dest="prompts", required=True, help="jsonl, one prompt a line"
    )
    p.add_argument("--out", required=True, help="output directory (new or empty; the same command resumes in it)")
    p.add_argument("--data.input_key", dest="input_key", default="prompt", help="jsonl key of the prompt")
    p.add_argument("--data.label_key", dest="label_key", default="answer",
                   help="jsonl key of the label the reward reads (math-verify: the gold answer)")  # fmt: skip
    p.add_argument("--data.max_samples", dest="max_samples", type=int, default=64, help="prompts used (the first N)")
    p.add_argument("--data.apply_chat_template", dest="chat_template", action="store_true",
                   help="wrap each prompt as one user turn of the tokenizer's chat template")  # fmt: skip
    p.add_argument("--data.input_template", dest="input_template", default=None,
                   help="format string with one {} for the prompt, applied before the chat template")  # fmt: skip
    p.add_argument("--reward.func", dest="reward_func", default="math_verify",
                   help="math_verify (the boxed answer against --data.label_key, 1/0) or a .py file defining "
                   "reward_func(queries, prompts, labels)")  # fmt: skip
    p.add_argument("--reward.remote_url", dest="remote_url", default=None,
                   help='an HTTP reward model: POST {"query", "prompts", "labels"} -> {"rewards"} (upstream\'s '
                   "protocol, `openrlhf-geo serve-rm`); replaces --reward.func")  # fmt: skip
    p.add_argument("--rollout.n_samples_per_prompt", dest="samples", type=int, default=8, help="G (>= 2)")
    p.add_argument("--rollout.batch_size", dest="batch_size", type=int, default=32,
                   help="prompts per SALT batch (one training step's; SALT Table 4: 32 x 8)")  # fmt: skip
    p.add_argument("--rollout.max_new_tokens", dest="max_new_tokens", type=int, default=256)
    p.add_argument("--rollout.temperature", dest="temperature", type=float, default=1.0)
    p.add_argument("--generator", choices=("hf", "vllm"), default="hf", help="HF generate, or vLLM in a child process")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--rollouts", default=None,
                   help="score and analyse these saved rollouts instead of sampling: another inspect run's "
                   "rollouts.npz, or a real-LM study's (the committed studies': "
                   "openrlhf_geo/assets/real_lm_rollouts)")  # fmt: skip
    return p


def check(args):
    """The flags' values, before anything loads -> InspectError naming the flag."""
    if args.samples < 2:
        raise InspectError(f"--rollout.n_samples_per_prompt must be >= 2 (got {args.samples}): GRPO compares a group")
    for flag, value in (("--rollout.max_new_tokens", args.max_new_tokens), ("--rollout.batch_size", args.batch_size),
                        ("--data.max_samples", args.max_samples)):  # fmt: skip
        if value < 1:
            raise InspectError(f"{flag} must be >= 1 (got {value})")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise InspectError(f"--rollout.temperature must be > 0 (got {args.temperature})")
    if args.max_samples < MIN_PROMPTS:
        raise InspectError(f"--data.max_samples {args.max_samples}: too few prompts for a CI over prompts (at least "
                           f"{MIN_PROMPTS})")  # fmt: skip
    if args.input_template is not None and args.input_template.count("{}") != 1:
        raise InspectError(f"--data.input_template must hold one {{}} for the prompt (got {args.input_template!r})")
    if args.remote_url is not None:  # here, not after sampling: a bad port or host would only fail at scoring
        try:
            url = urllib.parse.urlsplit(args.remote_url)
            url.port  # noqa: B018 - raises for a port that is not a number in 0-65535
        except ValueError as error:
            raise InspectError(f"--reward.remote_url {args.remote_url}: {error}") from None
        if url.scheme not in ("http", "https") or not url.hostname:
            raise InspectError(f"--reward.remote_url {args.remote_url}: an http(s) URL with a host (a .py reward: "
                               "--reward.func)")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InspectError("--device cuda: no CUDA device is visible here (--device cpu)")
    if not Path(args.prompts).is_file():
        raise InspectError(f"--prompts {args.prompts}: no such file")
    if args.rollouts is not None and not Path(args.rollouts).is_file():
        raise InspectError(f"--rollouts {args.rollouts}: no such file")


def command_line(args) -> str:
    """What the outputs depend on, as one command line (rundir.claim_output's record; the same one resumes)."""
    flags = {"--model": args.model, "--prompts": str(Path(args.prompts).resolve()),
             "--data.input_key": args.input_key, "--data.label_key": args.label_key,
             "--data.max_samples": args.max_samples, "--data.input_template": args.input_template,
             "--reward.func": args.reward_func, "--reward.remote_url": args.remote_url,
             "--rollout.n_samples_per_prompt": args.samples, "--rollout.batch_size": args.batch_size,
             "--rollout.max_new_tokens": args.max_new_tokens, "--rollout.temperature": args.temperature,
             "--generator": args.generator, "--seed": args.seed,
             "--rollouts": str(Path(args.rollouts).resolve()) if args.rollouts else None}  # fmt: skip
    parts = [f"{flag} {shlex.quote(str(value))}" for flag, value in flags.items() if value is not None]
    return "openrlhf-geo inspect " + " ".join(parts) + (" --data.apply_chat_template" if args.chat_template else "")


# ---------------------------------------------------------------- inputs


def model_path(name) -> str:
    """The model's directory or hub id; `smollm2` is the offline real LM (converted once, `real_lm.convert`)."""
    from openrlhf_geo import real_lm

    if name in real_lm.ASSETS and not Path(name).exists():
        try:
            return str(real_lm.convert(real_lm.ASSETS[name]))
        except (real_lm.AssetError, OSError) as error:
            raise InspectError(f"--model {name}: {error}") from None
    return name


def load_model(path, device):
    """(model, tokenizer) as `openrlhf-geo train` loads them (`training.load_model`: its one-line errors, here
    naming --model)."""
    from openrlhf_geo.local.training import load_model as load

    actor = SimpleNamespace(model_name_or_path=path, config=None, tokenizer=None)
    try:
        model, tokenizer = load(SimpleNamespace(actor=actor, train=SimpleNamespace(seed=0)), device)
    except ValueError as error:
        raise InspectError(str(error).replace("--actor.model_name_or_path", "--model", 1)) from None
    return model.eval(), tokenizer


def read_prompts(args, tokenizer):
    """-> (prompt texts as the model sees them, labels, the file's sha256); InspectError for a row without a key,
    a model without a chat template, fewer than MIN_PROMPTS prompts."""
    from openrlhf_geo.local.training import read_dataset

    rows = read_dataset(args.prompts, args.input_key, args.label_key, "--prompts")
    rows = [row for _, row in zip(range(args.max_samples), rows)]
    if len(rows) < MIN_PROMPTS:
        raise InspectError(f"--prompts {args.prompts}: {len(rows)} prompts, too few for a CI over prompts (at least "
                           f"{MIN_PROMPTS})")  # fmt: skip
    texts = [args.input_template.format(row["prompt"]) if args.input_template else row["prompt"] for row in rows]
    if args.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise InspectError(f"--data.apply_chat_template: the tokenizer of --model {args.model} has no chat "
                               "template (leave the flag out, or give prompts in the model's format)")  # fmt: skip
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]  # fmt: skip
    digest = hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest()
    return texts, [row["answer"] for row in rows], digest


def used_prompts(n, batch_size) -> tuple[int, int]:
    """(prompts analysed, SALT batch prompts B): whole batches of min(batch_size, n) prompts."""
    B = min(batch_size, n)
    return n - n % B, B


def remote_reward(url):
    """reward_fn(prompts, responses, labels) of an HTTP reward model (upstream's `--reward.remote_url` protocol);
    InspectError naming the flag when it cannot be reached or answers something else than one number a response."""

    def reward_fn(prompts, responses, labels):
        chunks = [slice(i, i + REMOTE_BATCH) for i in range(0, len(responses), REMOTE_BATCH)]
        return torch.cat([post(prompts[c], responses[c], labels[c]) for c in chunks])

    def post(prompts, responses, labels):
        body = json.dumps({"query": [p + r for p, r in zip(prompts, responses)], "prompts": list(prompts),
                           "labels": list(labels)}).encode()  # fmt: skip
        try:
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=REMOTE_TIMEOUT_S) as reply:
                text = reply.read()
        except urllib.error.HTTPError as error:  # the server answered with an error status: its own words too
            said = error.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not JSON, or no "error" in it
                said = json.loads(said)["error"]
            said = " ".join(str(said).split())[:200]
            raise InspectError(f"--reward.remote_url {url}: HTTP {error.code} {error.reason}"
                               + (f": {said}" if said else "")) from None  # fmt: skip
        except (urllib.error.URLError, OSError, ValueError) as error:  # unreachable, timed out, a malformed URL
            raise InspectError(f"--reward.remote_url {url}: {getattr(error, 'reason', error)}") from None
        try:
            out = torch.as_tensor(json.loads(text)["rewards"], dtype=torch.float32).flatten()
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            raise InspectError(f"--reward.remote_url {url}: the reply is not {{\"rewards\": [numbers]}} "
                               f"({type(error).__name__}: {error})") from None  # fmt: skip
        if out.numel() != len(responses):
            raise InspectError(f"--reward.remote_url {url}: {out.numel()} rewards for {len(responses)} responses")
        return out

    return reward_fn


def make_reward(args):
    """The reward the engines take, built before sampling (a .py file that cannot load fails before any rollout)."""
    from openrlhf_geo.local.reward import make_reward_fn

    if args.remote_url:
        return remote_reward(args.remote_url)
    try:
        return make_reward_fn(args.reward_func)
    except ValueError as error:  # load_python_reward's one-line errors name --reward.func
        raise InspectError(str(error)) from None


def score(args, reward_fn, prompts, responses, labels) -> torch.Tensor:
    """(N,) float32 rewards of the decoded responses; InspectError naming the reward's flag when it fails."""
    flag = "--reward.remote_url" if args.remote_url else "--reward.func"
    try:
        rewards = reward_fn(prompts, responses, labels).float()
    except InspectError:
        raise
    except ValueError as error:  # load_python_reward's one-line errors name --reward.func already
        raise InspectError(str(error)) from None
    except Exception as error:  # math-verify's own failure
        raise InspectError(f"{flag} {args.remote_url or args.reward_func}: {type(error).__name__}: {error}") from None
    if not bool(torch.isfinite(rewards).all()):
        raise InspectError(f"{flag} {args.remote_url or args.reward_func}: a reward is not finite")
    return rewards


# ---------------------------------------------------------------- the phases (each saved, each resumable)


def _load_phase(path, key):
    """A saved phase's payload when it was written for `key` (the settings it depends on), else None."""
    if not path.exists():
        return None
    try:
        saved = torch.load(path, weights_only=False)
    except Exception:  # a truncated file of a killed run: recomputed
        return None
    return saved["payload"] if saved.get("format") == FORMAT and saved.get("key") == key else None


def _save_phase(path, key, payload):
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT, "key": key, "payload": payload}, tmp)
    os.replace(tmp, path)


def read_rollouts(args, prompt_ids) -> list:
    """--rollouts -> the response ids of the first len(prompt_ids) prompts' G samples each; InspectError naming the
    flag whose value they were not sampled with (the prompts as the tokenizer reads them, G, temperature, tokens)."""
    from openrlhf_geo.lab.studies import real_lm

    name = f"--rollouts {args.rollouts}"
    try:
        stored, responses, meta = real_lm.load_rollouts(args.rollouts)
    except ValueError as error:
        raise InspectError(f"--rollouts {error}") from None
    if not stored or len(responses) % len(stored):
        raise InspectError(f"{name}: {len(responses)} responses for {len(stored)} prompts, not G per prompt")
    if len(responses) // len(stored) != args.samples:
        raise InspectError(f"--rollout.n_samples_per_prompt {args.samples}: {name} holds "
                           f"{len(responses) // len(stored)} samples per prompt")  # fmt: skip
    if len(stored) < len(prompt_ids):
        raise InspectError(f"{name}: rollouts of {len(stored)} prompts, and --prompts gives {len(prompt_ids)} "
                           f"(--data.max_samples {len(stored)})")  # fmt: skip
    for i, (mine, theirs) in enumerate(zip(prompt_ids, stored)):
        if mine != theirs:
            raise InspectError(f"{name}: prompt {i} is not --prompts' prompt {i} as the tokenizer of --model reads "
                               "it (--data.apply_chat_template and --data.input_template included)")  # fmt: skip
    sampled = meta.get("collection", {})
    # the features' logits are divided by the sampling temperature (SALT Eq. 19): another one misstates them
    for flag, key, value in (("--rollout.temperature", "temperature", args.temperature),
                             ("--rollout.max_new_tokens", "max_tokens", args.max_new_tokens)):  # fmt: skip
        if key in sampled and sampled[key] != value:
            raise InspectError(f"{flag} {value}: {name} was sampled with {sampled[key]}")
    return responses[: len(prompt_ids) * args.samples]


def _load_rollouts_phase(path, key):
    """A saved rollouts.npz's (prompt_ids, response_ids) when it was written for `key`, else None."""
    from openrlhf_geo.lab.studies import real_lm

    if not path.exists():
        return None
    try:
        prompt_ids, response_ids, meta = real_lm.load_rollouts(path)
    except ValueError:  # a truncated file of a killed run: sampled again
        return None
    return {"prompt_ids": prompt_ids, "response_ids": response_ids} if meta.get("inspect") == key else None


def collect(args, out, log=print) -> dict:
    """Sample, score and forward (each phase from its saved file when there) -> the studies' collection layout
    (`real_lm.collect`'s keys), one cap: --rollout.max_new_tokens."""
    from tqdm.auto import tqdm

    from openrlhf_geo.lab.studies import real_lm

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = model_path(args.model)
    model, tokenizer = load_model(path, device)
    texts, labels, digest = read_prompts(args, tokenizer)
    reward_fn = make_reward(args)
    n, _ = used_prompts(len(texts), args.batch_size)
    if n < len(texts):
        log(f"inspect: {n} of the {len(texts)} prompts are used (whole SALT batches of --rollout.batch_size)")
    texts, labels = texts[:n], labels[:n]
    G, L = args.samples, args.max_new_tokens
    collection = real_lm.Collection(prompts=n, samples=G, temperature=args.temperature, max_tokens=L, caps=(L,),
                                    seed=args.seed, generator=args.generator)  # fmt: skip
    key = {
        "command": command_line(args),
        "prompts_sha256": digest,
        "rollouts_sha256": hashlib.sha256(Path(args.rollouts).read_bytes()).hexdigest() if args.rollouts else None,
    }
    timings = {}
    start = time.perf_counter()
    sampled = _load_rollouts_phase(out / ROLLOUTS, key)
    if sampled is None:
        # as the fork's engines read a prompt (upstream's agent executor): no special tokens added, a chat template
        # carries its own (added again they would put a second BOS before a Llama-3 template)
        prompt_ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        if args.rollouts:
            response_ids = read_rollouts(args, prompt_ids)
        elif args.generator == "vllm":
            log(f"inspect: sampling {n} prompts x {G} with vLLM (one child process)")
            response_ids = real_lm._sample_vllm(path, prompt_ids, collection, tokenizer.eos_token_id, out / "vllm")
        else:
            with tqdm(total=n, desc=f"sampling {n} prompts x {G}", unit="prompt") as bar:
                response_ids = real_lm._sample_hf(path, prompt_ids, collection, progress=bar.update, model=model)
        sampled = {"prompt_ids": prompt_ids, "response_ids": response_ids}
        # where the token ids came from: this run's sampler, or the --rollouts file they were read from
        origin = f"--rollouts {args.rollouts}" if args.rollouts else args.generator
        meta = {"inspect": key, "collection": {"prompts": n, "samples": G, "temperature": args.temperature,
                                               "max_tokens": L, "seed": args.seed, "generator": origin,
                                               "model": args.model}}  # fmt: skip
        real_lm.save_rollouts(out / ROLLOUTS, prompt_ids, response_ids, meta)
        timings["sampling"] = time.perf_counter() - start
    prompt_ids, response_ids = sampled["prompt_ids"], sampled["response_ids"]
    start = time.perf_counter()
    rewards = _load_phase(out / REWARDS, key)
    if rewards is None:
        # a .py reward_func or a remote model gets upstream's query, prompt and response with their special tokens
        # (EOS included); math-verify reads the response's text, as the studies score it
        special = args.remote_url is not None or args.reward_func != "math_verify"
        responses = tokenizer.batch_decode(response_ids, skip_special_tokens=not special)
        with tqdm(total=1, desc=f"scoring {len(responses)} responses", unit="batch") as bar:
            prompts = [t for t in texts for _ in range(G)]
            rewards = score(args, reward_fn, prompts, responses, [a for a in labels for _ in range(G)])
            bar.update(1)
        _save_phase(out / REWARDS, key, rewards)
        timings["scoring"] = time.perf_counter() - start
    start = time.perf_counter()
    geometry = _load_phase(out / GEOMETRY, key)
    if geometry is None:
        with tqdm(total=len(response_ids), desc="forward: SALT features and hidden states", unit="rollout") as bar:
            geometry = real_lm.forward_geometry(model, prompt_ids, response_ids, G, (L,), args.temperature,
                                                progress=bar.update)  # fmt: skip
        _save_phase(out / GEOMETRY, key, geometry)
        timings["forward"] = time.perf_counter() - start
    return {"collection": {"prompts": n, "samples": G, "temperature": args.temperature, "max_tokens": L,
                           "caps": [L]},  # fmt: skip
            "eos": tokenizer.eos_token_id, "questions": texts, "prompt_ids": prompt_ids, "response_ids": response_ids,
            "rewards": {L: rewards}, "geometry": geometry, "seconds": timings, "device": device}  # fmt: skip


# ---------------------------------------------------------------- the analysis (the studies' functions)


def salt_setup(data, protocol) -> dict:
    collection = data["collection"]
    return {"caps": tuple(collection["caps"]), "groups": (collection["samples"],),
            "m": min(protocol.salt_prompts, collection["prompts"]) * collection["samples"]}  # fmt: skip


def permuted_advantage_null(data, setup) -> list[dict]:
    """Per batch at the longest cap: D_a and ‖a'‖/‖a‖ (`real_lm_geometry.salt_metrics`) of SALT on a permuted within
    each group (n_eff's own null, the study's item 6, for what SALT would do), the mean of PERMUTED_DRAWS draws."""
    from openrlhf_geo.estimators import group_norm
    from openrlhf_geo.lab.studies import real_lm_geometry as geo
    from openrlhf_geo.salt import salt_advantages

    collection = data["collection"]
    cap, G = max(setup["caps"]), setup["groups"][0]
    T = collection["temperature"]
    out = []
    for r, rows in enumerate(geo.replicates(collection["prompts"], collection["samples"], G, setup["m"])):
        idx = torch.as_tensor(rows)
        a = group_norm(data["rewards"][cap][idx].double(), torch.arange(len(rows)) // G)
        if not bool((a != 0).any()):
            out.append({"D_a": math.nan, "norm_ratio": math.nan})
            continue
        factor = geo.gram_factor(data["geometry"][cap]["gram"][idx][:, idx])
        rng = np.random.default_rng(geo.draw_seed(T, cap, G, r, stream=PERMUTED_STREAM))
        draws = []
        for index in geo.within_group_permutations(rng, PERMUTED_DRAWS, len(rows), G):
            a_p = a[torch.as_tensor(index)]
            draws.append(geo.salt_metrics(a_p, *salt_advantages(a_p, factor)))
        out.append({m: float(np.mean([d[m] for d in draws])) for m in ("D_a", "norm_ratio")})
    return out


def prompts_to_decide(ci, prompts) -> int | None:
    """Prompts at which the CI of n_eff(a) would exclude 1 if its half-width shrinks as 1/√prompts and its centre
    stays (an extrapolation, not a promise); None when the CI already excludes 1 or its centre is 1."""
    low, high, mean = ci["low"], ci["high"], ci["mean"]
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(mean)) or low > 1 or high < 1:
        return None
    if mean == 1:
        return None
    return int(math.ceil(prompts * ((high - low) / 2 / abs(mean - 1)) ** 2))


def analyse_salt(data, protocol=Protocol(), progress=None) -> dict:
    """SALT on the collection's batches: real_lm_geometry's analysis (records, prompt resampling, CIs, summary) at
    the inspect protocol -> {"study": the study's summary (its table row for the one condition), "condition": the
    inspect view of it}."""
    from openrlhf_geo.lab.studies import real_lm_geometry as geo
    from openrlhf_geo.salt import _subspace_dim

    setup = salt_setup(data, protocol)
    records = geo.analyse(data, setup, families=False, progress=progress)
    resampled = geo.resample(data, setup, count=protocol.replicates, gap_count=protocol.gap_replicates)
    summary = geo.summarize(records, setup, geo.prompt_cis(records, setup, resampled))
    collection = data["collection"]
    cap, G = max(setup["caps"]), setup["groups"][0]
    row = summary["table"][f"T={collection['temperature']} cap={cap} G={G}"]
    k_code = [_subspace_dim(r["pr"], setup["m"], "code") if math.isfinite(r["pr"]) else math.nan
              for r in records if r["cap"] == cap]  # fmt: skip
    permuted = permuted_advantage_null(data, setup)
    ci = row["n_eff_prompts_apart"]
    verdict = geo.regime(ci)
    condition = {
        "prompts": collection["prompts"], "G": G, "m": setup["m"], "batches": len(k_code),
        "batches_with_signal": int(sum(r["signal"] for r in records if r["cap"] == cap)),
        "n_eff": ci, "n_eff_batches": row["n_eff"], "n_eff_permuted": row["n_eff_perm_mean"],
        "n_eff_vs_permuted": row["n_eff_vs_perm_counts"], "n_eff_in": row["n_eff_group"],
        "pr": row["pr"], "k_paper": row["k"], "k_code": geo.interval(k_code), "alpha": row["alpha"],
        "D_a": row["D_a"], "D_a_random": row["random_D_a"],
        "D_a_permuted": geo.interval([p["D_a"] for p in permuted]),
        "norm_ratio": row["norm_ratio"], "norm_ratio_random": row["random_norm_ratio"],
        "norm_ratio_permuted": geo.interval([p["norm_ratio"] for p in permuted]),
        "gap_vs_random": {m: row["gap_vs_random_centred"][m] for m in ("D_a", "norm_ratio")}
        if "gap_vs_random_centred" in row else {},
        "accuracy": row["accuracy"], "mixed": row["mixed"], "length": row["length"], "truncated": row["truncated"],
        "verdict": verdict, "prompts_to_decide": prompts_to_decide(ci, collection["prompts"]),
    }  # fmt: skip
    return {"study": summary, "condition": condition}


def analyse_geoalign(data, protocol=Protocol(), progress=None) -> dict:
    """GeoAlign on the collection: real_lm_geoalign's amended analysis (cross-fitting, nulls, planted flips,
    prompt CIs, verdicts) on batches of min(16, prompts) prompts."""
    from openrlhf_geo.lab.studies import real_lm_geoalign as ga

    collection = data["collection"]
    per_batch = min(protocol.geoalign_prompts, collection["prompts"])
    records = ga.analyse(data, per_batch, protocol.draws, progress=progress)
    setup = {"prompts_per_batch": per_batch, "batches": collection["prompts"] // per_batch,
             "samples": collection["samples"]}  # fmt: skip
    amendment = ga.summarize_amendment(records, setup)
    return {**setup, "draws": protocol.draws, "amendment": amendment, "verdicts": ga.amended_verdicts(amendment)}


# ---------------------------------------------------------------- verdicts, suggestions, report


def salt_suggestion(c) -> str:
    """The flags SALT's measurement suggests, each with the paper's passage."""
    if c["verdict"].startswith("in SALT"):
        return ("`--advantage_estimator salt` (SALT §3.1, Eq. 16-18): n_eff(a) < 1, so α_t = 1 − n_eff > 0 "
                "(Eq. 17) mixes the exploration channel P_k⊥[a]₊ into P_k a, the cancellation regime SALT's gain is "
                "tied to (App. D; Table 10: GRPO's n_eff 0.31). `--salt.diagnostics` alone logs the same salt/* "
                "metrics without changing the advantages.")  # fmt: skip
    if c["verdict"].startswith("outside"):
        return (f"SALT is not expected to help here: with n_eff(a) > 1 it sets α_t = max(0, 1 − n_eff) = 0 (Eq. 17) "
                f"and applies P_k a alone (Eq. 18), a projection of GRPO's advantages on the top-k_t subspace "
                f"(‖a'‖/‖a‖ {_f(c['norm_ratio']['mean'])}, a random subspace of the same k_t "
                f"{_f(c['norm_ratio_random']['mean'])}); its gain is tied to the cancellation regime n_eff < 1 (App. "
                "D; Table 10). Train with GRPO; `--salt.diagnostics` (no change to the advantages) watches n_eff as "
                "training lengthens the responses.")  # fmt: skip
    more = c["prompts_to_decide"]
    return (
        f"Not decided at {c['prompts']} prompts: rerun with about {more} prompts (--data.max_samples {more}; "
        "an extrapolation of the CI's width) before choosing; meanwhile `--salt.diagnostics` logs n_eff "
        "(Eq. 6) during a GRPO run without changing it."  # fmt: skip
        if more
        else "No verdict: too few batches with a learning signal (every group tied); raise G, the "
        "temperature or --data.max_samples."
    )


def geoalign_suggestion(verdicts) -> str:
    direction = verdicts.get("reward direction", "")
    detects = [rate.split()[-1] for rate, text in verdicts.items()
               if rate.startswith("detection") and text.startswith("GDI detects")]  # fmt: skip
    if direction.startswith("stated") and detects:
        return (
            "`--geoalign.enable` (GeoAlign §4.2-4.4, Eq. 4-8): the projector orients held-out pairs above its "
            f"null and GDI (Eq. 7) beats the reward-only count on planted flips at rate(s) {', '.join(detects)}."
        )
    why = [] if direction.startswith("stated") else ["the held-out reward direction is not above its null"]
    if not detects:
        why.append("GDI does not beat the reward-only pair count on planted flips")
    return ("GeoAlign is not suggested: its curation rests on a projector that orients held-out pairs (§4.2, Eq. 4; "
            "§5.4, Fig. 9: median validation accuracy > 0.97 on math) and on GDI flagging corrupted rollouts (§4.3, "
            f"Eq. 7); here {' and '.join(why)}.")  # fmt: skip


def _f(x, digits=3):
    return "n/a" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row, digits=3):
    if row.get("low") is None or not math.isfinite(row["low"]):
        return _f(row["mean"], digits)
    return f"{_f(row['mean'], digits)} [{_f(row['low'], digits)}, {_f(row['high'], digits)}]"


def render(summary) -> str:
    s, g, setup = summary["salt"], summary["geoalign"], summary["setup"]
    a = g["amendment"]
    counts = s["n_eff_vs_permuted"]
    lines = [
        f"# `openrlhf-geo inspect`: {setup['model']}",
        "",
        f"{s['prompts']} prompts x G = {s['G']} at T = {setup['temperature']}, up to {setup['max_new_tokens']} new "
        f"tokens ({setup['generator']}, {setup['device']}, seed {setup['seed']}); reward {setup['reward']}; "
        f"accuracy {_f(s['accuracy']['mean'])}, groups with both rewards {_f(s['mixed']['mean'])}, mean length "
        f"{_f(s['length']['mean'], 1)} tokens, {_f(s['truncated']['mean'])} cut at the cap. Wall time "
        f"{setup['wall_s'] / 60:.1f} min ({', '.join(f'{k} {v:.0f} s' for k, v in setup['seconds'].items())}).",
        "",
        "## Verdicts",
        "",
        f"- **SALT**: {s['verdict']} — n_eff(a) {_ci(s['n_eff'])} (CI over prompts).",
        *(f"- **GeoAlign, {name}**: {text}" for name, text in g["verdicts"].items()),
        "",
        "## Suggested flags",
        "",
        f"- SALT: {summary['suggestions']['salt']}",
        f"- GeoAlign: {summary['suggestions']['geoalign']}",
        "",
        "## SALT (arXiv 2606.05800)",
        "",
        f"{s['batches']} disjoint batches of m = {s['m']} rollouts ({s['m'] // s['G']} prompts x {s['G']}), "
        f"{s['batches_with_signal']} with a learning signal; GRPO advantages a (group_norm); SALT's default LM-head "
        "features (Eq. 19). Each value: mean over batches [95 % CI]; n_eff(a)'s CI resamples the prompts (copies "
        "apart).",
        "",
        "| quantity | value | null |",
        "|---|---|---|",
        f"| n_eff(a) (Eq. 6) | {_ci(s['n_eff'])} | a permuted within groups: {_ci(s['n_eff_permuted'])}; batches "
        f"below / inside / above its range: {counts['below']} / {counts['inside']} / {counts['above']} |",
        f"| n_eff,in (App. D.1, Eq. 49) | {_ci(s['n_eff_in'])} | |",
        f"| PR (Eq. 5) | {_ci(s['pr'], 2)} | features only: unchanged by permuting a |",
        f"| k_t, Eq. 14 / released code | {_ci(s['k_paper'], 1)} / {_ci(s['k_code'], 1)} | features only |",
        f"| α_t (Eq. 17) | {_ci(s['alpha'])} | |",
        f"| D_a (Eq. 59) | {_ci(s['D_a'])} | random subspace of the same k_t: {_ci(s['D_a_random'])}; a permuted: "
        f"{_ci(s['D_a_permuted'])} |",
        f"| ‖a'‖/‖a‖ (Eq. 18) | {_ci(s['norm_ratio'])} | random subspace: {_ci(s['norm_ratio_random'])}; a "
        f"permuted: {_ci(s['norm_ratio_permuted'])} |",
        *(
            f"| SALT − random subspace, {name} (CI over prompts, recentred on the gap) | {_ci(row)} | 0 |"
            for name, row in s["gap_vs_random"].items()
        ),  # fmt: skip
        "",
        "Rule (real-lm-geometry's protocol, fixed before any result): in SALT's regime when the CI of n_eff(a) lies "
        "below 1, outside when above, else not decided"
        + (
            f"; about {s['prompts_to_decide']} prompts would decide it (the CI's width scaled as 1/√prompts)."
            if s["prompts_to_decide"]
            else "."
        ),  # fmt: skip
        "",
        "## GeoAlign (arXiv 2606.26917)",
        "",
        f"{g['batches']} batches of {g['prompts_per_batch']} prompts x {g['samples']}; the projector (math preset) "
        f"cross-fitted over {a['folds']} folds of prompts; {g['draws']} flip draws per rate and batch; CIs: "
        f"{a['resamples']} resamples of the {a['prompts']} prompts.",
        "",
        "| held out | orientation accuracy | cos > 0.8 share |",
        "|---|---|---|",
        *(
            f"| {kind} | {_ci(row['val_acc'])} | {_ci(row['cos_gt_0.8'])} |"
            for kind, row in (
                ("real hidden states", a["held_out"]["real"]),
                ("null: permuted within prompts", a["held_out"]["permuted"]),
                ("null: Gaussian rows", a["held_out"]["gaussian"]),
            )
        ),  # fmt: skip
        f"| real − permuted null | {_ci(a['held_out_gap']['permuted']['val_acc'])} | "
        f"{_ci(a['held_out_gap']['permuted']['cos_gt_0.8'])} |",
        "",
        "| planted flips | GDI AUROC (Eq. 7) | GDI, permuted null | reward-only pair count | GDI − reward-only |",
        "|---|---|---|---|---|",
        *(
            f"| {rate} | {_ci(row['gdi'])} | {_ci(row['gdi_permuted'])} | {_ci(row['pair_count'])} | "
            f"{_ci(row['gdi_minus_pair_count'])} |"
            for rate, row in a["detection"].items()
        ),  # fmt: skip
        "",
        "Rules (real-lm-geoalign's amendment, item 5): the paper's 0.97 median validation accuracy (§5.4, Fig. 9); "
        "a reward direction when the held-out accuracy and cos > 0.8 share exceed the permuted null (CIs of the "
        "gaps above 0); detection when GDI − reward-only has its CI above 0.",
        "",
        f"![SALT and GeoAlign beside their nulls]({PLOT})",
        "",
    ]
    return "\n".join(lines)


def plot(summary, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, a = summary["salt"], summary["geoalign"]["amendment"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))

    def bars(ax, labels, rows, title, line=None):
        mean = [r["mean"] if r["mean"] is not None else math.nan for r in rows]
        err = [[max(0.0, m - r["low"]) if r.get("low") is not None and math.isfinite(r["low"]) else 0 for m, r in
                zip(mean, rows)],
               [max(0.0, r["high"] - m) if r.get("high") is not None and math.isfinite(r["high"]) else 0 for m, r in
                zip(mean, rows)]]  # fmt: skip
        ax.bar(range(len(rows)), mean, yerr=err, color=["C0" if i % 2 == 0 else "C7" for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        if line is not None:
            ax.axhline(line, color="black", linestyle=":")
        ax.set_title(title, fontsize=10)

    bars(left, ["n_eff(a)", "a permuted", "‖a'‖/‖a‖", "random\nsubspace"],
         [s["n_eff"], s["n_eff_permuted"], s["norm_ratio"], s["norm_ratio_random"]],
         f"SALT: {s['verdict'].split(' (')[0]} (n_eff = 1 dotted)", line=1.0)  # fmt: skip
    det = a["detection"]
    rows = [a["held_out"]["real"]["val_acc"], a["held_out"]["permuted"]["val_acc"]]
    labels = ["held-out acc.", "permuted"]
    for rate in det:
        rows += [det[rate]["gdi"], det[rate]["pair_count"]]
        labels += [f"GDI AUROC\n{rate}", f"reward-only\n{rate}"]
    bars(right, labels, rows, "GeoAlign beside its nulls (0.5 dotted)", line=0.5)
    fig.tight_layout()
    fig.savefig(Path(out) / PLOT, dpi=100)
    plt.close(fig)


def run(args, out, protocol=None) -> int:
    from tqdm.auto import tqdm

    start = time.perf_counter()
    data = collect(args, out)
    protocol = protocol or Protocol(salt_prompts=args.batch_size)
    n = data["collection"]["prompts"]
    t0 = time.perf_counter()
    with tqdm(total=n // min(protocol.salt_prompts, n), desc="SALT: batches and nulls", unit="batch") as bar:
        salt = analyse_salt(data, protocol, progress=bar.update)
    data["seconds"]["salt"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with tqdm(
        total=n // min(protocol.geoalign_prompts, n), desc="GeoAlign: projectors and flips", unit="batch"
    ) as bar:
        geoalign = analyse_geoalign(data, protocol, progress=bar.update)
    data["seconds"]["geoalign"] = time.perf_counter() - t0
    c = salt["condition"]
    setup = {"model": args.model, "prompts_file": str(Path(args.prompts).resolve()), "temperature": args.temperature,
             "max_new_tokens": args.max_new_tokens, "generator": args.generator, "device": data["device"],
             "seed": args.seed, "reward": args.remote_url or args.reward_func, "command": command_line(args),
             "seconds": data["seconds"], "wall_s": time.perf_counter() - start,
             "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
             "protocol": protocol.__dict__}  # fmt: skip
    summary = strict_json({"setup": setup, "salt": c, "geoalign": geoalign,
                           "suggestions": {"salt": salt_suggestion(c),
                                           "geoalign": geoalign_suggestion(geoalign["verdicts"])}})  # fmt: skip
    report = render(summary)
    plot(summary, out)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    (out / REPORT).write_text(report)
    print(f"SALT: {c['verdict']}; n_eff(a) {_ci(c['n_eff'])}")
    for name, text in geoalign["verdicts"].items():
        print(f"GeoAlign, {name}: {text}")
    print(f"openrlhf-geo inspect: {out / REPORT}")
    return 0


def main(argv=None) -> int:
    from openrlhf_geo.local import rundir

    args = build_parser().parse_args(argv)
    try:
        check(args)
        out = Path(args.out)
        with rundir.claim_output(out, command_line(args)):
            return run(args, out)
    except (InspectError, rundir.OutputClaimed) as error:
        print(f"openrlhf-geo inspect: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # the shared readers' one-line errors (the prompt file, a reward file)
        print(f"openrlhf-geo inspect: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # vLLM's one-line failure
        print(f"openrlhf-geo inspect: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        saved = [name for name in (ROLLOUTS, REWARDS, GEOMETRY) if (Path(args.out) / name).exists()]
        where = f"from its saved {', '.join(saved)}" if saved else "from the start (no phase had finished)"
        print(f"openrlhf-geo inspect: interrupted; the same command with --out {args.out} resumes {where}",
              file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main())
