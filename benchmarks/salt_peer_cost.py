"""SALT's cost next to its authors' released code (Chang-pw/SALT at 94ac08e): time and peak memory, side by side.

The same responses (tokens, LM-head inputs h_t, LM-head weight W, advantages) go through
  theirs  proxy.py's ManualLmHeadProxy.compute_from_logits (the V x d LM-head gradient of -sum_t log p per response,
          one autograd.grad over the micro-batch's logits per response, as dp_actor.py calls it) and
          AdvantageDecomposer(DecompositionConfig(enabled=True, rho=1.0)).decompose (its Gram, PR, LOBPCG, a')
  ours    features.lm_head_features (the default blocked TensorSketch, D = 102400, one pass over each micro-batch's
          logits) and salt.salt_advantages (Gram over the whole mini-batch, eigensolver, a')
Nothing of theirs is in this repository: --salt-repo (or $OPENRLHF_GEO_SALT_REPO) is a local checkout; its two files
are loaded by path (benchmarks/salt_reference.py's `load`), with nothing stubbed.

Timed is only what SALT adds to the step: the logits (h_t W^T) and, for theirs, the log-prob graph its actor builds
for the policy loss anyway are made before the clock starts, and their memory is the baseline the peak is measured
from. Ours is charged its whole feature pass, though in the fork that pass also gives the log-probs that replace
upstream's own log-prob pass (benchmarks/README.md, "SALT features vs LM-head matmul"), so ours is overstated.

Scopes, for each m:
  theirs, one micro-batch   their code as it runs: SALT per micro-batch of the actor update, here one micro-batch
                            holding all m responses (one logits tensor, one Gram over m)
  theirs, one mini-batch    the m responses in micro-batches of --micro, their proxy per micro-batch, one Gram over
                            all m (the fork's scope with their code; as their distributed_gram would gather)
  ours, one mini-batch      the fork's scope: features per micro-batch of --micro, one Gram over all m
Peak memory: above the baseline; on CPU the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) in one
more, untimed, pass after the timed repeats, with glibc set to mmap every allocation of 64 KiB or more and the heap
trimmed before each measurement (so memory is not reused unseen; this would slow the timed passes with page
faults); on CUDA torch.cuda.max_memory_allocated. A case whose predicted peak passes --budget-gib is not run and is
printed with its prediction: theirs holds (2m + 1) x V x d floats at its peak (the rows and their stack, then the
stack, decompose's signed updates and their sum) plus, bounded, 4 copies of a micro-batch's logits; ours m x D floats
and the pass's tiles, bounded by 2 x m x D plus 4 copies of a micro-batch's logits.

Shapes: smollm2 = the real LM (SmolLM2-135M-Instruct, `openrlhf-geo model smollm2`; V = 49152, d = 576, tied
W): its sampled responses to the lab's word problems, their real post-norm hidden states (the lm_head input);
qwen = Qwen2.5-1.5B's LM-head shape (V = 151936, d = 1536) with random weights and hidden states of that shape
(W ~ N(0, 9/d), h ~ N(0, 1): logits of sd 3) and uniform random tokens (neither side's cost depends on which token).
Advantages: GRPO's (Eq. 2) from seeded 0/1 rewards in groups of --group (the cost does not depend on them).
Repeats alternate the order of the sides; min and median over --reps; ratios per response from the same repeats.

Usage: python benchmarks/salt_peer_cost.py [--salt-repo DIR] [--shapes smollm2 qwen] [--sizes 16 32 64 128 256]
       [--micro 16] [--tokens 32] [--reps 2] [--budget-gib 8] [--threads 2] [--device cpu|cuda] [--rollouts FILE]
"""

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from openrlhf_geo.features import DEFAULT_DIM, lm_head_features
from openrlhf_geo.salt import salt_advantages

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from salt_reference import load  # noqa: E402  (their files by path)

GIB = 2**30
OURS = "ours, one mini-batch"
SHAPES = {"smollm2": (49152, 576), "qwen": (151936, 1536)}


def smollm2_rollouts(n_prompts: int, samples: int, max_new_tokens: int, seed: int = 0, cache=None) -> dict:
    """The real LM's sampled responses to the lab's word problems, with their post-norm hidden states at the
    positions whose logits gave each response token: {"tokens" (m, T), "mask" (m, T), "hidden" (m, T, d),
    "last_hidden" (m, d) (the last response token's, GeoAlign's input), "weight" (V, d), "group_ids" (m,)}.
    `cache` (--rollouts): a file holding them is read instead of sampling; else they are written there."""
    if cache is not None and cache.is_file():
        return torch.load(cache)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_geo import real_lm
    from openrlhf_geo.features import lm_head_input
    from openrlhf_geo.lab.word_task import word_problems

    directory = real_lm.convert()  # converted once, then read from the cache
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    prompts = [  # the question alone, in the model's chat template (short prompts: a cheap prefill)
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q, _ in word_problems(n_prompts, seed)
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=batch.input_ids.repeat_interleave(samples, 0),
            attention_mask=batch.attention_mask.repeat_interleave(samples, 0),
            do_sample=True,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=2,
            pad_token_id=tokenizer.pad_token_id,
        )
        width = batch.input_ids.shape[1]
        tokens = out[:, width:]
        mask = torch.ones_like(tokens, dtype=torch.bool)
        for i, row in enumerate(tokens):  # everything after the first end-of-sequence token is padding
            ends = (row == tokenizer.eos_token_id).nonzero()
            if len(ends):
                mask[i, int(ends[0]) + 1 :] = False
        attention = torch.cat([batch.attention_mask.repeat_interleave(samples, 0), mask.long()], 1)
        hidden = []
        for part in range(0, len(out), 16):
            with lm_head_input(model) as captured:
                model(input_ids=out[part : part + 16], attention_mask=attention[part : part + 16])
            hidden.append(captured.hidden[:, width - 1 : -1].clone())  # position t-1's logits give token t
    hidden = torch.cat(hidden)
    lengths = mask.sum(1)
    last = hidden[torch.arange(len(hidden)), lengths - 1]
    group_ids = torch.arange(n_prompts).repeat_interleave(samples)
    weight = model.get_output_embeddings().weight.detach().clone()
    rollouts = {"tokens": tokens, "mask": mask, "hidden": hidden, "last_hidden": last, "weight": weight,
                "group_ids": group_ids}  # fmt: skip
    if cache is not None:
        torch.save(rollouts, cache)
    return rollouts


def grpo_advantages(group_ids: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(group_ids),), generator=g).float()
    out = torch.empty_like(rewards)
    for gid in group_ids.unique():
        rows = group_ids == gid
        r = rewards[rows]
        out[rows] = (r - r.mean()) / (r.std() + 1e-6) if len(r) > 1 else 0.0
    return out


def qwen_batch(m: int, tokens: int, seed: int) -> dict:
    V, d = SHAPES["qwen"]
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, V, (m, tokens), generator=g),
        "mask": torch.ones(m, tokens, dtype=torch.bool),
        "hidden": torch.randn(m, tokens, d, generator=g),
        "weight": torch.randn(V, d, generator=g) * (3 / d**0.5),
    }


LIBC = ctypes.CDLL("libc.so.6")
TRIM = []  # set by exact_rss_peaks: every Meter then starts from a trimmed heap


def exact_rss_peaks():
    """glibc: serve every allocation of 64 KiB or more by mmap and return it on free (no dynamic threshold), and
    give the heap's free pages back before each measurement (malloc_trim), so the peak RSS above a baseline counts
    this step's memory rather than pages an earlier step left resident."""
    LIBC.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    LIBC.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    TRIM.append(True)


class Meter:
    """Wall time and peak memory above the memory in use at the start (CPU: RSS; CUDA: allocated)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            if TRIM:
                LIBC.malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = self._status("VmRSS:")
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        peak = torch.cuda.max_memory_allocated() if self.cuda else self._status("VmHWM:")
        self.peak = max(peak - self.base, 0)


def logits_of(batch: dict, rows: slice) -> torch.Tensor:
    return batch["hidden"][rows] @ batch["weight"].T


def run_theirs(code, proxy, batch, a, m, chunk, device):
    """Their proxy per micro-batch of `chunk` rows and one decompose over the m rows -> (Meter, k_t)."""
    rows, seconds, peak = [], 0.0, 0
    for start in range(0, m, chunk):
        part = slice(start, min(start + chunk, m))
        leaf = logits_of(batch, part).requires_grad_()
        mask = batch["mask"][part]
        log_prob = torch.log_softmax(leaf, -1).gather(-1, batch["tokens"][part].unsqueeze(-1)).squeeze(-1)
        loss = -(log_prob * mask).sum(-1)  # dp_actor.py: per_sample_loss = -(log_prob * response_mask).sum(-1)
        group_ids = torch.zeros(len(loss), dtype=torch.long, device=device)
        with Meter(device) as meter:
            result = proxy.ManualLmHeadProxy().compute_from_logits(
                loss, leaf, mask.float(), group_ids, batch["hidden"][part]
            )
        rows.append(result.grads_flat)
        seconds += meter.seconds
        held = sum(r.numel() * r.element_size() for r in rows[:-1])  # earlier micro-batches' rows stay in memory
        peak = max(peak, meter.peak + held)
        del leaf, log_prob, loss, result
    F = rows[0] if len(rows) == 1 else torch.cat(rows)
    del rows
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)  # torch.lobpcg's random start
        with Meter(device) as meter:
            out = code.AdvantageDecomposer(code.DecompositionConfig(enabled=True, rho=1.0)).decompose(F, a)
    total = Meter(device)
    total.seconds = seconds + meter.seconds
    total.peak = max(peak, meter.peak + F.numel() * F.element_size())
    return total, out.k_t


def run_ours(batch, advantages, sizes, chunk, device):
    """Our features per micro-batch of at most `chunk` rows (cut at every m too) and one salt_advantages per m over
    its first m rows -> {m: (seconds, peak bytes, k_t)}. A micro-batch's features do not depend on m, so each is
    made once (and its logits once) and counted for every m it belongs to."""
    cuts = sorted({*sizes, *range(chunk, max(sizes), chunk), max(sizes)})
    rows, pass_s, pass_peak, out = [], [], [], {}
    for start, stop in zip([0, *cuts], cuts):
        logits = logits_of(batch, slice(start, stop))
        part = slice(start, stop)
        with Meter(device) as meter:
            rows.append(lm_head_features(logits, batch["hidden"][part], batch["tokens"][part], batch["mask"][part]))
        pass_s.append(meter.seconds)
        pass_peak.append(meter.peak + sum(r.numel() * r.element_size() for r in rows[:-1]))
        del logits
        if stop in sizes:
            F = torch.cat(rows)
            with Meter(device) as meter:
                _, stats = salt_advantages(advantages[:stop], F)
            peak = max(max(pass_peak), meter.peak + F.numel() * F.element_size())
            out[stop] = (sum(pass_s) + meter.seconds, peak, int(stats["k"]))
            del F
    return out


def predicted_theirs(m, chunk, tokens, V, d):
    return (2 * m + 1) * V * d * 4 + 4 * min(chunk, m) * tokens * V * 4


def predicted_ours(m, chunk, tokens, V):
    return 2 * m * DEFAULT_DIM * 4 + 4 * min(chunk, m) * tokens * V * 4


def fmt_gib(nbytes):
    return f"{nbytes / GIB:.3f}" if nbytes < 10 * GIB else f"{nbytes / GIB:.0f}"


def shape_batch(shape, args, device):
    """(batch on device, advantages (m_max,), what the data is) for one shape."""
    m_max = max(args.sizes)
    if shape == "smollm2":
        batch = smollm2_rollouts(-(-m_max // args.group), args.group, args.tokens, cache=args.rollouts)
        group_ids = batch["group_ids"]
        source = "SmolLM2-135M-Instruct's sampled responses and hidden states"
    else:
        batch = qwen_batch(m_max, args.tokens, seed=0)
        group_ids = torch.arange(m_max) // args.group
        source = "random weights and hidden states of Qwen2.5-1.5B's LM-head shape"
    if m_max > len(group_ids):
        raise SystemExit(
            f"salt_peer_cost: --sizes {m_max} is more than the {len(group_ids)} rollouts in {args.rollouts}"
        )
    batch = {k: v.to(device) for k, v in batch.items() if k in ("tokens", "mask", "hidden", "weight")}
    return batch, grpo_advantages(group_ids, seed=0).to(device), source


def plan(args, V, d):
    """{(m, case): its predicted peak and room for its measurements}."""
    runs = {}
    for m in args.sizes:
        runs[m, OURS] = {"side": "ours", "need": predicted_ours(m, args.micro, args.tokens, V)}
        scopes = {"theirs, one micro-batch": m, "theirs, one mini-batch": args.micro} if m > args.micro else {
            "theirs, one micro-batch": m}  # fmt: skip
        for name, chunk in scopes.items():
            runs[m, name] = {"side": "theirs", "chunk": chunk, "need": predicted_theirs(m, chunk, args.tokens, V, d)}
    for run in runs.values():
        run.update(times=[], unused=[], peaks=[], k=None, fits=run["need"] <= args.budget_gib * GIB)
    return runs


def measure(runs, code, proxy, batch, advantages, args, device):
    """--reps repeats, the sides in alternating order; ours once per repeat for all its sizes."""
    ours_sizes = [m for (m, name), run in runs.items() if name == OURS and run["fits"]]
    for rep in range(args.reps + (device.type == "cpu")):
        memory_pass = rep == args.reps  # CPU: one more, untimed, pass for the peaks
        if memory_pass:
            exact_rss_peaks()
        for side in ("theirs", "ours")[:: 1 if rep % 2 == 0 else -1]:
            if side == "ours" and ours_sizes:
                for m, (seconds, peak, k) in run_ours(batch, advantages, ours_sizes, args.micro, device).items():
                    runs[m, OURS]["times" if not memory_pass else "unused"].append(seconds)
                    runs[m, OURS]["peaks"].append(peak)
                    runs[m, OURS]["k"] = k
            for (m, _), run in runs.items():
                if side == "theirs" and run["side"] == side and run["fits"]:
                    meter, run["k"] = run_theirs(code, proxy, batch, advantages[:m], m, run["chunk"], device)
                    run["times" if not memory_pass else "unused"].append(meter.seconds)
                    run["peaks"].append(meter.peak)


def table(shape, runs, budget_gib):
    """Print one row per (m, case); return them as dicts."""
    results = []
    for (m, name), run in runs.items():
        ours = runs[m, OURS]
        if not run["times"]:
            print(f"| {m} | {name} | does not fit: needs ~{fmt_gib(run['need'])} GiB > {budget_gib:g} | | | | | |")
            results.append({"shape": shape, "m": m, "case": name, "fits": False, "need": run["need"]})
            continue
        best, median, peak = min(run["times"]), statistics.median(run["times"]), run["peaks"][-1]
        ratio = share = ""
        if name != OURS and ours["times"]:
            per_rep = [t / o for t, o in zip(run["times"], ours["times"])]
            ratio = f"{statistics.median(per_rep):.2f}x ({min(per_rep):.2f}-{max(per_rep):.2f})"
            share = f"{ours['peaks'][-1] / max(peak, 1):.4f}"
        print(f"| {m} | {name} | {best:.3f} ({median:.3f}) | {1000 * best / m:.2f} | "
              f"{fmt_gib(peak)} ({fmt_gib(run['need'])}) | {run['k']} | {ratio} | {share} |")  # fmt: skip
        results.append({"shape": shape, "m": m, "case": name, "fits": True, "seconds": run["times"], "peak": peak,
                        "k": run["k"]})  # fmt: skip
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--salt-repo", type=Path, default=os.environ.get("OPENRLHF_GEO_SALT_REPO"),
                        help="checkout of Chang-pw/SALT at 94ac08e (default $OPENRLHF_GEO_SALT_REPO)")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--micro", type=int, default=16, help="responses per micro-batch of the forward")
    parser.add_argument("--tokens", type=int, default=32, help="response tokens (smollm2: max new tokens)")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=8.0, help="skip a case predicted to need more")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rollouts", type=Path, default=None, help="cache of the real LM's rollouts (.pt)")
    args = parser.parse_args(argv)
    if args.salt_repo is None:
        parser.error("--salt-repo (or $OPENRLHF_GEO_SALT_REPO): a checkout of Chang-pw/SALT at 94ac08e")
    code = load(args.salt_repo, "advantage_decomposition")
    proxy = load(args.salt_repo, "proxy")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"# SALT cost: theirs (proxy + AdvantageDecomposer) vs ours (sketch D={DEFAULT_DIM} + salt_advantages)")
    print(f"device {device}, {args.threads} threads, micro-batch {args.micro}, T <= {args.tokens}, reps {args.reps}, "
          f"budget {args.budget_gib:g} GiB, load average {os.getloadavg()[0]:.2f} at the start")  # fmt: skip
    results = []
    for shape in args.shapes:
        batch, advantages, source = shape_batch(shape, args, device)
        V, d = SHAPES[shape]
        lengths = batch["mask"].sum(1).float()
        print(f"\n## {shape}: V = {V}, d = {d}; {source}; response tokens {lengths.min():.0f}-{lengths.max():.0f} "
              f"(mean {lengths.mean():.1f})")  # fmt: skip
        print("| m | side, scope | time s min (median) | ms per response | peak GiB (predicted) | k_t | "
              "time theirs / ours | peak ours / theirs |")  # fmt: skip
        print("|" + "---|" * 8)
        runs = plan(args, V, d)
        measure(runs, code, proxy, batch, advantages, args, device)
        results += table(shape, runs, args.budget_gib)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
