"""SALT's and GeoAlign's per-step costs at the papers' settings on one GPU, side by side in one run.

Needs torch, transformers, numpy and scipy, no vLLM, Ray or DeepSpeed (none is imported), and no weights: the model
is built from a config and randomly initialised (weights do not change the timings).

[1] The experience forward: what the fork's experience maker runs per micro-batch, upstream's Actor.forward on the
    padded layout as patches/openrlhf.models.actor.diff changes it: the policy's forward with logits, cast to
    float32 and divided by the rollout temperature, then the action log-probs. Three arms:
      grpo      no GeometrySpec: upstream's `log_probs_from_logits` (openrlhf 0.11.2's own function when openrlhf
                is installed, else `transcribed_log_probs`; flash-attn's Triton cross-entropy when installed)
      salt      `GeometryConfig(salt=SaltConfig()).spec` (the default sketch, D = features.DEFAULT_DIM): the lm_head
                input hook and `fork_hooks.response_geometry`, whose exp pass over the logits also gives the
                log-probs, so upstream's pass is skipped
      geoalign  the spec of `--geoalign.enable` alone: the hook and the last-response-token hidden states, then
                upstream's log-prob pass
    Model: Qwen2-1.5B-like (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocabulary 151936, tied
    embeddings), bf16, SDPA attention. Batch: SALT Table 4 (App. C.1): prompt length 1024, response length 8192,
    rollout temperature 0.6; every response at the 8192-token limit and no padding, so the features (which scale
    with response tokens) take their largest share. Micro-batch 8: the fork's SALT recipe
    (examples/scripts/lib/common.sh, ROLLOUT_MICRO_BATCH; Table 4 does not give one); halved on out-of-memory.
[2] GeoAlign's `curate`, through the pipeline as fork_hooks.GeometryBatch.curate calls it (`GeometryStep.curate`,
    the warm-started projector, the math preset), on the CPU, where the fork runs it (--geoalign.device cpu: the
    trainer actor has no GPU). Batch: §5.1 (math) 16 rollouts per prompt on Qwen3-1.7B, whose hidden size is 2048
    (its config; 2560 for Qwen3-4B: --geo-dim); the prompts per step are in Table 6, which survives only as its
    caption, so 128 is the fork's recipe (examples/scripts/train_math_geoalign.sh, unchecked). Random hidden
    states and 8 of 16 correct per prompt, as benchmarks/geoalign_speed.py: 8192 pairs, and the held-out accuracy
    stays near 50 %, so all 50 projector steps run (the worst case).
[3] SALT's Gram + solve: `salt_advantages(a, F)` on one partition of m = 256 (Table 4: mini-batch 32 prompts x 8)
    at D = DEFAULT_DIM, on the CPU, where the fork's trainer runs it, with benchmarks/salt_overhead.py's power-law
    features.

Each repeat runs the three forwards in a rotated order (interleaved, so a load change hits every arm alike), then [2]
and [3]; ratios are per repeat, printed as median [IQR] and a bootstrap 95 % CI of the median (scipy). GPU timings use
CUDA events after torch.cuda.synchronize; CPU ones perf_counter. Per rollout batch (SALT: Table 4's 64 prompts x 8 = 2
partitions; GeoAlign: 128 x 16) the extra cost is also put against that batch's experience forwards at this shape (for
GeoAlign's batch too, whose Qwen3 models are larger): an upper bound on these costs' share of a whole step, which adds
generation, the reference forward and training. The papers' anchors (whole training steps): SALT +7.7 % (§4.2 RQ1-2;
Table 11, App. G.2: the 8 runs' total time, computed below), GeoAlign about 1 % and 300-500 MB of GPU memory (App.
C.6).

Usage: python benchmarks/gpu_step_overhead.py --device cuda --out gpu.json       (one GPU; sized for <= 5 min)
       python benchmarks/gpu_step_overhead.py --device cpu --shape tiny --quick  (a functional check, < 60 s)
"""

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch

# runs from a checkout without installing it: the repository (openrlhf_geo) and benchmarks/ (salt_overhead)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [path for path in (os.path.dirname(HERE), HERE) if path not in sys.path]

from salt_overhead import powerlaw_features, upstream_log_probs  # noqa: E402

from openrlhf_geo.features import DEFAULT_DIM, lm_head_input  # noqa: E402
from openrlhf_geo.fork import hooks as fork_hooks  # noqa: E402
from openrlhf_geo.geoalign import GeoAlignConfig  # noqa: E402
from openrlhf_geo.pipeline import GeometryConfig, GeometryPipeline  # noqa: E402
from openrlhf_geo.salt import SaltConfig, salt_advantages  # noqa: E402

QWEN2_1_5B = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
SHAPES = {
    "1.5b": {
        "model": QWEN2_1_5B,
        "prompt_len": 1024,  # SALT Table 4
        "response_len": 8192,  # SALT Table 4
        "micro_batch": 8,
        "salt_prompts": 64,  # Table 4 "Train batch size 64" prompts per rollout step
        "salt_group": 8,  # Table 4 "Rollout samples per prompt 8"
        "salt_partition": 32,  # Table 4 "Mini-Batch Size 32" prompts: m = 256
        "geo_prompts": 128,  # the fork's recipe (GeoAlign Table 6 is lost)
        "geo_group": 16,  # GeoAlign §5.1, math
        "geo_dim": 2048,  # Qwen3-1.7B's hidden size
    },
    # V·d = 131072 > D, so the features take the sketch's path, as at the 1.5B shape
    "tiny": {
        "model": {
            **QWEN2_1_5B,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 2048,
            "max_position_embeddings": 256,
        },
        "prompt_len": 16,
        "response_len": 32,
        "micro_batch": 2,
        "salt_prompts": 16,
        "salt_group": 8,
        "salt_partition": 8,
        "geo_prompts": 8,
        "geo_group": 16,
        "geo_dim": 64,
    },
}
TEMPERATURE = 0.6  # SALT Table 4 rollout temperature
# SALT Table 11 (App. G.2), hours:minutes without / with SALT: the 8 runs' total is §4.2's "about 7.7 %"
SALT_TABLE11 = {
    "1.5B GRPO MATH-TRAIN": ("07:21", "07:58"),
    "1.5B GRPO DAPO-MATH": ("15:41", "17:08"),
    "1.5B DAPO MATH-TRAIN": ("07:17", "08:05"),
    "1.5B DAPO DAPO-MATH": ("16:01", "17:58"),
    "7B GRPO MATH-TRAIN": ("24:07", "26:22"),
    "7B GRPO DAPO-MATH": ("61:26", "66:08"),
    "7B DAPO MATH-TRAIN": ("24:31", "25:58"),
    "7B DAPO DAPO-MATH": ("62:23", "66:04"),
}
ARMS = ("grpo", "salt", "geoalign")


def transcribed_log_probs(logits, labels, temperature=1.0):
    """openrlhf 0.11.2's `log_probs_from_logits` for float32 logits, transcribed for machines without openrlhf
    (tests/test_benchmarks.py checks it against the installed function): flash-attn's Triton cross-entropy when
    installed, else the label logit minus a logsumexp in chunks of 1024 rows."""
    if temperature != 1.0:
        logits.div_(temperature)
    batch_dim, last_dim = logits.shape[:-1], logits.shape[-1]
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        return -cross_entropy_loss(logits.reshape(-1, last_dim), labels.reshape(-1))[0].view(*batch_dim)
    except ImportError:
        flat = logits.reshape(-1, last_dim)
        total = torch.cat([torch.logsumexp(flat[s : s + 1024], dim=-1) for s in range(0, flat.shape[0], 1024)])
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - total.view(*batch_dim)


def table11_overhead():
    """(total time with SALT / without - 1, per-run overheads) from SALT Table 11."""

    def minutes(text):
        hours, mins = text.split(":")
        return 60 * int(hours) + int(mins)

    runs = {name: minutes(b) / minutes(a) - 1 for name, (a, b) in SALT_TABLE11.items()}
    base = sum(minutes(a) for a, _ in SALT_TABLE11.values())
    return sum(minutes(b) for _, b in SALT_TABLE11.values()) / base - 1, runs


def build_model(config, device):
    """A randomly initialised Qwen2ForCausalLM in bf16 on `device`, as upstream's Actor sets it up for the experience
    forward (eval mode, use_cache off)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**config, attn_implementation="sdpa")
    cfg.use_cache = False
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters made in bf16: no float32 copy of 1.5B on the device
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    return model.eval()


@torch.no_grad()  # as the experience maker's make_experience
def experience_forward(model, sequences, attention_mask, action_mask, spec, log_probs_from_logits):
    """Actor.forward(sequences, action_mask, attention_mask, return_output=True, geometry=spec) of the fork on the
    padded layout (patches/openrlhf.models.actor.diff) -> (action log-probs (B, A), geometry or None)."""
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    with lm_head_input(model, enabled=spec is not None) as lm_head:
        output = model(sequences, attention_mask=attention_mask, position_ids=position_ids)
    output["logits"] = output["logits"].to(torch.float32)  # replaces the bf16 logits, as upstream
    output["logits"].div_(TEMPERATURE)
    geometry = None
    if spec is not None:
        geometry = fork_hooks.response_geometry(
            spec, output["logits"], lm_head.hidden, rolled, action_mask, attention_mask, None, TEMPERATURE, None
        )
    log_probs = geometry.pop("log_probs", None) if geometry is not None else None
    if log_probs is None:
        log_probs = log_probs_from_logits(output["logits"], rolled)
    log_probs = log_probs[:, :-1]
    return log_probs[:, -action_mask.shape[1] :] * action_mask.float(), geometry


class Clock:
    """Seconds of one call: CUDA events around it (after a synchronize) on a GPU, perf_counter on a CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn):
        if not self.cuda:
            start = time.perf_counter()
            out = fn()
            return time.perf_counter() - start, out
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, out


def spread(values):
    """median, IQR, min/max and a bootstrap 95 % CI of the median (None below 3 values) of per-repeat values."""
    from scipy.stats import bootstrap

    x = np.asarray(values, dtype=float)
    q25, median, q75 = np.percentile(x, [25, 50, 75])
    ci = None
    if len(x) >= 3 and np.ptp(x) > 0:
        res = bootstrap((x,), np.median, n_resamples=2000, method="percentile", rng=np.random.default_rng(0))
        ci = [float(res.confidence_interval.low), float(res.confidence_interval.high)]
    return {"values": x.tolist(), "median": median, "q25": q25, "q75": q75, "min": x.min(), "max": x.max(), "ci95": ci}


def fmt(s, pct=True):
    """'median [q25, q75] (CI lo-hi)' of a spread, as percentages above 1 (ratio - 1) or as seconds."""
    f = (lambda v: f"{100 * (v - 1):+.1f} %") if pct else (lambda v: f"{v:.3f} s")
    ci = f", CI95 {f(s['ci95'][0])} .. {f(s['ci95'][1])}" if s["ci95"] else ""
    return f"{f(s['median'])} [IQR {f(s['q25'])} .. {f(s['q75'])}{ci}]"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (with --shape tiny: a check)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1.5b")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 2 repeats (a functional check)")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats (default 8; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 2; --quick 1)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per experience forward")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--response-len", type=int, default=None)
    parser.add_argument("--geo-dim", type=int, default=None, help="GeoAlign hidden size (2048: Qwen3-1.7B)")
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch threads for [2] and [3]")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.shape == "1.5b" and torch.device(args.device).type == "cpu":
        parser.error("--shape 1.5b needs a GPU (about 70 GB at micro-batch 8): --device cuda, or --shape tiny")
    shape = dict(SHAPES[args.shape])
    for key in ("micro_batch", "prompt_len", "response_len", "geo_dim"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    reps = args.reps or (2 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    device = torch.device(args.device)
    clock, started = Clock(device), time.perf_counter()
    measured = device.type == "cuda" and args.shape == "1.5b" and not args.quick
    pooled, runs = table11_overhead()
    print(
        f"torch {torch.__version__}, {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", {torch.get_num_threads()} CPU threads; shape {args.shape}, {warmup} warm-up + {reps} repeats"
    )
    print(
        f"paper anchors (whole training steps): SALT Table 11 total +{100 * pooled:.1f} % (runs "
        f"+{100 * min(runs.values()):.1f} .. +{100 * max(runs.values()):.1f} %); GeoAlign App. C.6 ~1 %, 300-500 MB"
    )
    if not measured:
        print("NOT a measurement: a functional check (a GPU, --shape 1.5b and no --quick measure)")

    # ── [1] the experience forward ──
    log_probs_from_logits = upstream_log_probs()
    log_probs_source = "openrlhf 0.11.2" if log_probs_from_logits is not None else "transcribed"
    log_probs_from_logits = log_probs_from_logits or transcribed_log_probs
    flash = importlib.util.find_spec("flash_attn") is not None  # located, not imported
    specs = {
        "grpo": None,
        "salt": GeometryConfig(salt=SaltConfig()).spec,
        "geoalign": GeometryConfig(geoalign=GeoAlignConfig.preset("math")).spec,
    }
    t, model = clock(lambda: build_model(shape["model"], device))
    vocab = shape["model"]["vocab_size"]
    print(f"model built in {t:.1f} s: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, bf16")
    print(f"log-probs (grpo, geoalign arms): {log_probs_source}, {'flash-attn' if flash else 'torch'} cross-entropy")
    gen = torch.Generator().manual_seed(0)

    def make_batch(micro):
        length = shape["prompt_len"] + shape["response_len"]
        sequences = torch.randint(0, vocab, (micro, length), generator=gen).to(device)
        attention_mask = torch.ones(micro, length, dtype=torch.long, device=device)
        action_mask = torch.ones(micro, shape["response_len"], dtype=torch.bool, device=device)
        return sequences, attention_mask, action_mask

    def forward(arm, batch):
        return experience_forward(model, *batch, specs[arm], log_probs_from_logits)

    micro, checks = shape["micro_batch"], {}
    while True:  # warm-up; out of memory: half the micro-batch
        try:
            batch = make_batch(micro)
            for _ in range(warmup):
                outs = {arm: forward(arm, batch) for arm in ARMS}
            break
        except torch.cuda.OutOfMemoryError:
            if micro == 1:
                raise
        # outside the handler: its traceback no longer holds the failed forward's tensors
        outs = batch = None
        gc.collect()
        torch.cuda.empty_cache()
        micro //= 2
        print(f"out of GPU memory: micro-batch {micro}")
    mask = batch[2]
    checks["log_prob_max_abs_diff_salt_vs_grpo"] = float((outs["salt"][0] - outs["grpo"][0])[mask].abs().max())
    checks["features_shape"] = list(outs["salt"][1]["features"].shape)
    checks["features_finite"] = bool(torch.isfinite(outs["salt"][1]["features"]).all())
    checks["hidden_shape"] = list(outs["geoalign"][1]["hidden"].shape)
    outs = None

    # ── [2] GeoAlign's curate, [3] SALT's Gram + solve: inputs ──
    pipeline = GeometryPipeline(GeometryConfig(geoalign=GeoAlignConfig.preset("math"), seed=0))
    n_geo = shape["geo_prompts"] * shape["geo_group"]
    group_ids = torch.arange(shape["geo_prompts"]).repeat_interleave(shape["geo_group"])
    rewards = (torch.arange(n_geo) % shape["geo_group"] < shape["geo_group"] // 2).float()
    m = shape["salt_partition"] * shape["salt_group"]
    features = powerlaw_features(m, DEFAULT_DIM, gen)
    salt_rewards = (torch.rand(m // shape["salt_group"], shape["salt_group"], generator=gen) < 0.4).double()
    centred = salt_rewards - salt_rewards.mean(1, keepdim=True)
    advantages = (centred / (salt_rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)

    def curate(hidden):
        step = pipeline.start(group_ids)
        step.curate(rewards, hidden)
        return step.metrics

    def new_hidden():  # a new batch every step: the warm-started projector has not seen it
        return torch.randn(n_geo, shape["geo_dim"], generator=gen)

    cpu_clock = Clock("cpu")
    curate(new_hidden()), salt_advantages(advantages, features)  # warm-up

    times = {name: [] for name in (*ARMS, "curate", "salt_solve")}
    peak, proj_steps = dict.fromkeys(ARMS, 0), []
    for rep in range(reps):
        for arm in ARMS[rep % 3 :] + ARMS[: rep % 3]:  # rotated: each arm first, second and third alike
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, _ = clock(lambda arm=arm: forward(arm, batch))
            times[arm].append(seconds)
            if device.type == "cuda":
                peak[arm] = max(peak[arm], torch.cuda.max_memory_allocated(device))
        hidden = new_hidden()
        seconds, metrics = cpu_clock(lambda hidden=hidden: curate(hidden))
        times["curate"].append(seconds)
        proj_steps.append(float(metrics["geo/proj_steps"][0]))
        seconds, (_, salt_stats) = cpu_clock(lambda: salt_advantages(advantages, features))
        times["salt_solve"].append(seconds)
        print(f"  rep {rep}: " + ", ".join(f"{name} {ts[-1]:.3f} s" for name, ts in times.items()))

    # ── ratios and per-batch shares ──
    grpo = np.asarray(times["grpo"])
    n_salt = shape["salt_prompts"] * shape["salt_group"]
    micro_salt, micro_geo = math.ceil(n_salt / micro), math.ceil(n_geo / micro)
    partitions = shape["salt_prompts"] // shape["salt_partition"]
    salt_fwd, geo_fwd = np.asarray(times["salt"]), np.asarray(times["geoalign"])
    salt_extra = (salt_fwd - grpo) * micro_salt + np.asarray(times["salt_solve"]) * partitions
    geo_extra = (geo_fwd - grpo) * micro_geo + np.asarray(times["curate"])
    ratios = {
        "salt_forward": spread(salt_fwd / grpo),
        "geoalign_forward": spread(geo_fwd / grpo),
        "salt_batch": spread(1 + salt_extra / (grpo * micro_salt)),
        "geoalign_batch": spread(1 + geo_extra / (grpo * micro_geo)),
    }
    seconds = {name: spread(ts) for name, ts in times.items()}
    print(f"\n[1] experience forward, micro-batch {micro} x ({shape['prompt_len']} + {shape['response_len']}) tokens")
    for arm in ARMS:
        mem = f", peak {peak[arm] / 2**30:.2f} GiB" if device.type == "cuda" else ""
        print(f"  {arm:<9} {fmt(seconds[arm], pct=False)}{mem}")
    if device.type == "cuda":
        for arm in ARMS[1:]:
            print(f"  {arm} peak memory - grpo's: {(peak[arm] - peak['grpo']) / 2**20:+.0f} MiB")
    print(f"  salt / grpo     {fmt(ratios['salt_forward'])}")
    print(f"  geoalign / grpo {fmt(ratios['geoalign_forward'])}")
    print(
        f"  log-probs salt vs grpo: max |diff| {checks['log_prob_max_abs_diff_salt_vs_grpo']:.2e}; features "
        f"{checks['features_shape']} finite {checks['features_finite']}; hidden {checks['hidden_shape']}"
    )
    pairs, steps = float(metrics["geo/pairs"][0]), min(proj_steps)
    print(
        f"[2] GeoAlign curate, {shape['geo_prompts']} x {shape['geo_group']}, d={shape['geo_dim']}, "
        f"{pairs:.0f} pairs, >= {steps:.0f} projector steps: {fmt(seconds['curate'], pct=False)}"
    )
    print(
        f"[3] SALT salt_advantages, m={m}, D={DEFAULT_DIM}, k={int(salt_stats['k'])}: "
        f"{fmt(seconds['salt_solve'], pct=False)}"
    )
    print(
        f"per rollout batch, against its experience forwards only (an upper bound on the share of a step):\n"
        f"  SALT ({n_salt} rollouts: {micro_salt} forwards, {partitions} partitions) {fmt(ratios['salt_batch'])}\n"
        f"  GeoAlign ({n_geo} rollouts: {micro_geo} forwards, one curate) {fmt(ratios['geoalign_batch'])}"
    )
    elapsed = time.perf_counter() - started
    print(f"wall {elapsed:.0f} s")
    if args.out:
        result = {
            "measured": measured,
            "label": "measurement" if measured else "functional check, not a measurement",
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "transformers": sys.modules["transformers"].__version__,
            "cpu_threads": torch.get_num_threads(),
            "shape": args.shape,
            "settings": {
                **shape,
                "micro_batch": micro,
                "temperature": TEMPERATURE,
                "salt_dim": DEFAULT_DIM,
                "salt_m": m,
                "warmup": warmup,
                "reps": reps,
            },
            "log_probs": {"source": log_probs_source, "flash_attn": flash},
            "seconds": seconds,
            "peak_memory_bytes": peak if device.type == "cuda" else None,
            "ratios": ratios,
            "geoalign": {"pairs": pairs, "proj_steps": proj_steps},
            "salt": {"k": float(salt_stats["k"]), "solve_ms": float(salt_stats["solve_ms"])},
            "checks": checks,
            "anchors": {"salt_table11_total": pooled, "salt_table11_runs": runs, "geoalign_c6": 0.01},
            "wall_s": elapsed,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=float)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
