"""`openrlhf-geo study salt-proxy`: does the LM-head proxy preserve SALT's geometry? SALT (arXiv 2606.05800) §3.2
Table 1 and App. E (E.1 protocol, E.2 metrics, Table 5) on the demo's model, where exact per-sample gradients of
every parameter are cheap. Protocol, open choices and decision rule: docs/studies/salt-proxy.md.

Per seed, the demo's GRPO run (`recipe.common_flags` + `recipe.METHOD_FLAGS["grpo"]`) is stepped in-process; at each
validation checkpoint t (CHECKPOINTS) the rollout batch of step t + 1 (policy θ_t, its rewards and GRPO advantages,
App. E.1: "the same rollouts, rewards, and group-normalized advantages as in training"; m = 128 = SALT's partition
here) is analysed before its update: the proxies (Eq. 19 exact, and `SaltConfig()`'s default), the references (the
full per-sample gradient of the mean action log-prob, its last- and first-block parts) and the nulls (permuted
proxy rows, Gaussian rows) -> App. E.2's metrics (`fidelity`). Results per seed and checkpoint in
<out>/runs/seed<S>/step<t>.json, the trainer state at the next checkpoint in trainer.pt (resume), then
<out>/summary.json, report.md and proxy_fidelity.png.
"""

import copy
import json
import math
import os
import shlex
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from openrlhf_geo import diagnostics, sketch_gram
from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab import recipe
from openrlhf_geo.lab.studies.base import Study

SEEDS = (0, 1, 2, 3, 4)  # the demo's seeds: the analysed runs are the demo's GRPO runs
CHECKPOINTS = (0, 10, 20, 30, 40, 50, 60)  # the demo's validation (evaluation) steps
QUICK_STUDY = {"checkpoints": (0, 2), "sft_max_steps": 30, "seeds": (0,)}
RUN_STEPS, EVAL_STEPS = (
    recipe.FULL["steps"],
    recipe.FULL["eval_steps"],
)  # the demo's GRPO run (flags only: no eval runs)
SIGN_QUANTILE = 0.75  # sign agreement on the pairs with |reference cosine| in the top quartile (the text: unspecified)
NULL_SEED = 20260605  # the nulls' draws: a generator per (NULL_SEED, seed, step), never the training's streams
VMAP_CHUNK = 32  # responses per vmap(grad) call
# the proxies compared with each reference, the nulls, and the references (`analyse`)
PROXIES, NULLS, REFERENCES = ("exact", "default"), ("permutation", "noise"), ("full", "last_block", "first_block")
METRICS = ("rho", "sign", "pr_err", "k_match", "subspace", "a_cos")
EXTRA = ("k_diff", "subspace_chance", "a_rank")
# SALT Table 5 (App. E.3), mean ± sd over checkpoints and mini-batches: (ρ, sign, PR rel. err, subspace, k_t, a' cos)
PAPER_TABLE5 = {
    "full": {"rho": (0.71, 0.06), "sign": (0.82, 0.03), "pr_err": (0.09, 0.04), "subspace": (0.78, 0.05),
             "k_match": (0.74, 0.07), "a_cos": (0.86, 0.04)},
    "last_block": {"rho": (0.79, 0.04), "sign": (0.85, 0.03), "pr_err": (0.06, 0.03), "subspace": (0.84, 0.04),
                   "k_match": (0.82, 0.05), "a_cos": (0.90, 0.03)},
    "first_block": {"rho": (0.58, 0.07), "sign": (0.75, 0.04), "pr_err": (0.16, 0.06), "subspace": (0.64, 0.06),
                    "k_match": (0.61, 0.08), "a_cos": (0.77, 0.05)},
    "permutation": {"rho": (0.02, 0.04), "sign": (0.51, 0.02), "pr_err": (0.47, 0.15), "subspace": (0.18, 0.06),
                    "k_match": (0.19, 0.08), "a_cos": (0.08, 0.05)},
    "noise": {"rho": (0.00, 0.03), "sign": (0.50, 0.02), "pr_err": (0.56, 0.18), "subspace": (0.13, 0.05),
              "k_match": (0.12, 0.06), "a_cos": (0.03, 0.04)},
}  # fmt: skip
PAPER_NAMES = {"full": "Full gradient, small model", "last_block": "Last block, disjoint",
               "first_block": "Early block", "permutation": "Permutation null", "noise": "Noise null"}  # fmt: skip
BAND_SDS = 3  # (B): within 3 of Table 5's sds of the reference's row, in the harmful direction
HIGHER_IS_BETTER = {"rho": True, "sign": True, "pr_err": False, "k_match": True, "subspace": True, "a_cos": True}
# The estimate's unit costs (seconds on one core): an RL step of 128 rollouts (the demo's measured 0.6 s, reward
# worker included: runner.STEP_S), one analysed mini-batch (3.0 s CPU measured at mean response length 26, rounded up
# for longer responses later in the run), starting a seed's process, and the demo's float64 SFT warm-up of 600 steps
# (121.5 s CPU measured); the timed partial run is in docs/studies/salt-proxy.md, "Time estimate"
STEP_S, ANALYSIS_S, LOAD_S, SFT_S = 0.6, 3.5, 5.0, 122.0

# ---------------------------------------------------------------- App. E.2's metrics


def cosine_gram(features) -> np.ndarray:
    """Eq. 55: K̃_ij = ⟨f_i, f_j⟩ / (‖f_i‖ ‖f_j‖) of the rows of features (m, D), float64; a zero row has cosine 0
    with every row (itself included)."""
    f = torch.as_tensor(features).detach().to(torch.float64)
    norms = f.norm(dim=1, keepdim=True)
    unit = torch.where(norms > 0, f / norms.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return (unit @ unit.T).cpu().numpy()


def _pairs(gram: np.ndarray) -> np.ndarray:
    """The m(m−1)/2 entries i < j of an (m, m) matrix."""
    return gram[np.triu_indices(gram.shape[0], k=1)]


def gram_rho(cos_proxy: np.ndarray, cos_reference: np.ndarray) -> float:
    """Gram correlation (Eq. 55): Spearman correlation of two cosine Grams over their off-diagonal pairs i < j; NaN
    when either side is constant over the pairs."""
    x, y = _pairs(cos_proxy), _pairs(cos_reference)
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(stats.spearmanr(x, y).statistic)


def sign_agreement(cos_proxy: np.ndarray, cos_reference: np.ndarray, quantile: float = SIGN_QUANTILE) -> float:
    """App. E.2 signed alignment: the share of the high-magnitude reference pairs (i < j with |K̃^g_ij| at or above
    the `quantile` of |K̃^g| over all pairs) on which sign(K̃^p_ij) = sign(K̃^g_ij)."""
    x, y = _pairs(cos_proxy), _pairs(cos_reference)
    if y.size == 0:
        return math.nan
    high = np.abs(y) >= np.quantile(np.abs(y), quantile)
    return float(np.mean(np.sign(x[high]) == np.sign(y[high])))


def pr_relative_error(pr_proxy: float, pr_reference: float) -> float:
    """Eq. 56's PR compared: |PR^p − PR^g| / PR^g (NaN for PR^g = 0)."""
    return abs(pr_proxy - pr_reference) / pr_reference if pr_reference > 0 else math.nan


def top_eigenvectors(gram) -> np.ndarray:
    """Eigenvectors of a symmetric (m, m) matrix as columns, by descending eigenvalue (numpy's eigh)."""
    lam, vecs = np.linalg.eigh(np.asarray(gram, dtype=np.float64))
    return vecs[:, np.argsort(lam, kind="stable")[::-1]]


def subspace_overlap(basis_proxy: np.ndarray, basis_reference: np.ndarray) -> float:
    """App. E.2 subspace consistency: σ_j the singular values of (V_k^p)ᵀ V_k^g (cosines of the principal angles
    between two k-dimensional subspaces, orthonormal bases as columns) -> (1/k) Σ σ_j² ∈ [0, 1] (1: the same
    subspace; k/m: the mean for a uniformly random one)."""
    k = basis_reference.shape[1]
    if k == 0:
        return math.nan
    sigma = np.linalg.svd(basis_proxy.T @ basis_reference, compute_uv=False)
    return float(np.sum(np.clip(sigma, 0.0, 1.0) ** 2) / k)


def _cosine(x: np.ndarray, y: np.ndarray) -> float:
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    return float(x @ y / (nx * ny)) if nx > 0 and ny > 0 else math.nan


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(stats.spearmanr(x, y).statistic)


@dataclass
class Geometry:
    """What SALT computes from one set of vectors F (m, D) and the advantages a (`geometry`)."""

    pr: float  # Eq. 5 (the sketch's debiased PR under gram="shrink")
    k: int  # Eq. 14
    alpha: float  # Eq. 17
    a_prime: np.ndarray  # (m,) Eq. 18
    eigvecs: np.ndarray  # (m, m) eigenvectors of the Gram P_k is taken from, by descending eigenvalue
    cosine: np.ndarray  # (m, m) Eq. 55


def geometry(advantages, features, gram: str = "raw") -> Geometry:
    """SALT's geometry of F (m, D) for advantages a (m,), by the project's SALT code: PR, k_t, α_t and a' from
    `salt.salt_advantages` (variant full, estimator `gram`); the eigenvectors of the Gram it takes P_k from (raw:
    K = F Fᵀ/m, Eq. 4; shrink: sketch_gram's SURE-thresholded K̃); the cosine Gram."""
    from openrlhf_geo.salt import salt_advantages

    a = torch.as_tensor(advantages).detach().to(torch.float64)
    f = torch.as_tensor(features).detach()
    new, salt_stats = salt_advantages(a, f, gram=gram)
    scaled = f / diagnostics.unit_scale(f)  # a power of two: K's eigenvectors unchanged
    if gram == "raw":
        K = diagnostics.gram(scaled).cpu()
    else:
        K = sketch_gram.shrink(*(x.cpu() for x in sketch_gram.gram_and_noise(scaled)))[0]
    return Geometry(
        pr=float(salt_stats["pr"]),
        k=int(salt_stats["k"]),
        alpha=float(salt_stats["alpha"]),
        a_prime=new.numpy(),
        eigvecs=top_eigenvectors(K.numpy()),
        cosine=cosine_gram(f),
    )


def fidelity(proxy: Geometry, reference: Geometry) -> dict:
    """App. E.2's metrics of `proxy` against `reference` (docs/studies/salt-proxy.md, "Metrics") -> floats:
    rho (Eq. 55), sign, pr_err (Eq. 56), k_match and k_diff (Eq. 14), subspace (k = the reference's k_t) with its
    chance level k/m, a_cos and a_rank (Eq. 57: cosine and Spearman of the two a')."""
    m, k = reference.eigvecs.shape[0], reference.k
    return {
        "rho": gram_rho(proxy.cosine, reference.cosine),
        "sign": sign_agreement(proxy.cosine, reference.cosine),
        "pr_err": pr_relative_error(proxy.pr, reference.pr),
        "k_match": float(proxy.k == reference.k),
        "k_diff": float(abs(proxy.k - reference.k)),
        "subspace": subspace_overlap(proxy.eigvecs[:, :k], reference.eigvecs[:, :k]),
        "subspace_chance": k / m,
        "a_cos": _cosine(proxy.a_prime, reference.a_prime),
        "a_rank": _spearman(proxy.a_prime, reference.a_prime),
    }


# ---------------------------------------------------------------- per-response vectors


def parameter_blocks(model) -> dict:
    """{name: (start, stop)} of each trainable parameter in the flattened gradient, in named_parameters order."""
    blocks, start = {}, 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            blocks[name] = (start, start + p.numel())
            start += p.numel()
    return blocks


def block_columns(blocks: dict, prefix: str) -> np.ndarray:
    """The columns of the parameters whose name starts with `prefix` (e.g. "model.layers.1.")."""
    spans = [np.arange(a, b) for name, (a, b) in blocks.items() if name.startswith(prefix)]
    if not spans:
        raise ValueError(f"no trainable parameter starts with {prefix!r}")
    return np.concatenate(spans)


def _mean_logprob(model, width, temperature):
    """ℓ(params, seq (S,), mask (S − width,)) = masked mean of log softmax(z_t/τ)[y_t] over the response of one
    unpadded sequence whose prompt is `width` tokens (torch.func.functional_call of `model`)."""
    from torch.func import functional_call

    def loss(params, seq, mask):
        logits = functional_call(model, params, (seq[None],), {"use_cache": False}).logits[0, width - 1 : -1]
        logp = torch.log_softmax(logits.to(torch.float64) / temperature, -1)
        token = logp.gather(-1, seq[width:, None]).squeeze(-1)
        return (token * mask).sum() / mask.sum().clamp_min(1)

    return loss


def per_sample_gradients(model, sequences, attention_mask, mask, prompt_width, temperature=1.0, chunk=VMAP_CHUNK):
    """Full per-response gradients (N, |θ|) float64: row i = ∇_θ ℓ_i over every trainable parameter (in
    `parameter_blocks` order), ℓ_i = (1/T_i) Σ_t log softmax(z_t/τ)[y_t] over response i's masked tokens — the
    objective whose LM-head gradient is `features.lm_head_features` (SALT Eq. 19).

    Layout as the engine's (`engine.Rollouts`): sequences (N, S), left-padded prompts of width `prompt_width`,
    attention_mask 0 on the left padding only, mask (N, S − prompt_width) the response tokens that count. torch.func:
    vmap(grad(ℓ)) over responses with the same padding, each without it (the engine masks it out and numbers the
    positions after it from 0, so the forward is the same), on a float64 copy of the model in eval mode.
    """
    from torch.func import grad, vmap

    ref = copy.deepcopy(model).to(torch.float64).eval()  # its own attention (eager's softmax runs in float32)
    params = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    blocks = parameter_blocks(ref)
    out = torch.empty(sequences.shape[0], max(b for _, b in blocks.values()), dtype=torch.float64)
    pads = (attention_mask == 0).sum(1)
    for pad in torch.unique(pads).tolist():
        rows = torch.nonzero(pads == pad)[:, 0]
        per_row = vmap(grad(_mean_logprob(ref, prompt_width - pad, temperature)), in_dims=(None, 0, 0))
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            with warnings.catch_warnings():  # CPU sdpa has no vmap batching rule: a per-row fallback, same values
                warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
                g = per_row(params, sequences[part, pad:], mask[part].to(torch.float64))
            out[part] = torch.cat([g[name].reshape(len(part), -1) for name in blocks], dim=1)
    return out


@torch.no_grad()
def proxy_features(model, batch, temperature, specs):
    """{name: (N, D) float32} LM-head proxy features of `batch` for each `features.GeometrySpec` in `specs`, from
    one forward exactly as the engine's old-policy forward computes them (`Trainer._old_policy_forward`)."""
    from openrlhf_geo.features import response_geometry
    from openrlhf_geo.local.engine import response_forward

    was_training = model.training
    model.eval()
    try:
        width = batch.prompt_width
        _, logits, hidden = response_forward(
            model, batch.sequences, batch.attention_mask, width, temperature, with_geometry=True
        )
        producing = torch.zeros_like(batch.sequences, dtype=torch.bool)
        producing[:, width - 1 : -1] = batch.mask
        response = torch.zeros_like(batch.sequences, dtype=torch.bool)
        response[:, width:] = batch.mask
        labels = batch.sequences.roll(-1, dims=1)
        return {
            name: response_geometry(
                spec, logits.float() / temperature, hidden, labels, producing, response, temperature
            )["features"]
            for name, spec in specs.items()
        }
    finally:
        model.train(was_training)


def default_proxy() -> dict:
    """The project's default proxy, read now: `SaltConfig()`'s features, dim, seed and Gram estimator."""
    from openrlhf_geo.salt import SaltConfig

    config = SaltConfig()
    return {"features": config.features, "dim": config.dim, "seed": config.seed, "gram": config.gram}


def _gram_diff(features, reference) -> float:
    K, R = diagnostics.gram(features.double()), diagnostics.gram(reference.double())
    return float((K - R).norm() / R.norm()) if float(R.norm()) > 0 else math.nan


def _null_generator(seed: int, step: int) -> torch.Generator:
    state = np.random.SeedSequence([NULL_SEED, seed, step]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def analyse(model, batch, advantages, temperature, default, seed, step) -> dict:
    """App. E.2 on one mini-batch -> a JSON-able record: per (vectors, reference) pair the `fidelity` metrics, per
    set of vectors its PR, k_t and α_t, and checks (the LM-head block of the full gradient against the exact proxy,
    the LM head's share of ‖g_i‖²)."""
    from openrlhf_geo.features import GeometrySpec

    t0 = time.perf_counter()
    specs = {"exact": GeometrySpec(features="exact")}
    same = default["features"] == "exact" and default["gram"] == "raw"
    if not same:
        specs["default"] = GeometrySpec(features=default["features"], dim=default["dim"], seed=default["seed"])
    proxies = proxy_features(model, batch, temperature, specs)
    full = per_sample_gradients(model, batch.sequences, batch.attention_mask, batch.mask, batch.prompt_width,
                                temperature)  # fmt: skip
    blocks = parameter_blocks(model)
    layers = sorted({int(n.split(".")[2]) for n in blocks if n.startswith("model.layers.")})
    head = block_columns(blocks, "lm_head.")
    references = {
        "full": full,
        "last_block": full[:, block_columns(blocks, f"model.layers.{layers[-1]}.")],
        "first_block": full[:, block_columns(blocks, f"model.layers.{layers[0]}.")],
    }
    exact = proxies["exact"]
    m = exact.shape[0]
    generator = _null_generator(seed, step)
    vectors = {
        **proxies,
        "permutation": exact[torch.randperm(m, generator=generator)],
        "noise": torch.randn(exact.shape, generator=generator, dtype=torch.float64),
    }
    a = advantages.detach().to(torch.float64).cpu()
    geo = {
        name: geometry(a, f, default["gram"] if name == "default" else "raw")
        for name, f in {**vectors, **references}.items()
    }
    pairs = {f"{name}/{ref}": fidelity(geo[name], geo[ref]) for ref in references for name in vectors}
    groups = batch.group_ids.unique()
    head_grad = full[:, head]
    energy = full.pow(2).sum(1)
    record = {
        "seed": seed,
        "step": step,
        "m": m,
        "accuracy": float(batch.rewards.float().mean()),
        "tied_groups": sum(bool((r == r[0]).all()) for r in (batch.rewards[batch.group_ids == g] for g in groups)),
        "groups": len(groups),
        "response_length": float(batch.mask.sum(1).double().mean()),
        "default_is_exact": same,
        "dims": {name: int(f.shape[1]) for name, f in {**vectors, **references}.items()},
        "sets": {name: {"pr": g.pr, "k": g.k, "alpha": g.alpha} for name, g in geo.items()},
        "pairs": pairs,
        # ‖exact proxy − LM-head block of the full gradient‖_F / ‖that block‖_F: both are Eq. 19's gradient
        "proxy_check": float((exact.double() - head_grad).norm() / head_grad.norm()),
        "lm_head_share": float((head_grad.pow(2).sum(1) / energy.clamp_min(1e-300)).mean()),
        # ‖K_default − K_exact‖_F / ‖K_exact‖_F (Eq. 4 Grams): 0 when the default proxy is the exact one in disguise
        # (e.g. a sketch whose D holds all V·d entries)
        "default_gram_diff": _gram_diff(proxies["default"], exact) if "default" in proxies else 0.0,
        "seconds": time.perf_counter() - t0,
    }
    return record


# ---------------------------------------------------------------- one seed's GRPO run


def train_argv(out, seed, steps=RUN_STEPS):
    """The demo's GRPO run for `seed` (`openrlhf-geo train` flags), its settings under <out>/settings/demo."""
    from openrlhf_geo.lab.studies.runner import setting_dir

    common = recipe.common_flags(setting_dir(out, "demo"), steps, EVAL_STEPS)
    run = Path(out) / "runs" / f"seed{seed}"
    return [*common, *recipe.METHOD_FLAGS["grpo"], "--train.seed", str(seed), "--reward.noise.seed", str(seed),
            "--ckpt.output_dir", str(run)]  # fmt: skip


def plan(out, seeds, checkpoints, default):
    """One job per seed: {"argv", "out", "seed", "checkpoints", "default"} (what `run_seed` runs; `identity` is what
    a resumed seed must match)."""
    jobs = []
    for seed in seeds:
        argv = train_argv(out, seed, max(checkpoints[-1], 1))
        job = {"argv": argv, "out": str(Path(out) / "runs" / f"seed{seed}"), "seed": seed,
               "checkpoints": list(checkpoints), "default": default}  # fmt: skip
        jobs.append(job)
    return jobs


def identity(job):
    return {k: job[k] for k in ("argv", "checkpoints", "default")} | {"sign_quantile": SIGN_QUANTILE, "version": 1}


def step_file(run, step):
    return Path(run) / f"step{step:03d}.json"


def done_steps(job):
    """The checkpoints of `job` whose results are on disk for its identity (none if another configuration wrote
    them)."""
    run = Path(job["out"])
    try:
        if json.loads((run / "config.json").read_text()) != strict_json(identity(job)):
            return set()
    except (OSError, ValueError):
        return set()
    return {t for t in job["checkpoints"] if step_file(run, t).exists()}


def _atomic_write(path, text):
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a file that exists is complete (`done_steps`)


class _Finished(Exception):
    """Raised by the analysis hook after the last checkpoint: that step's update is not needed."""


def run_seed(job, progress=None):
    """The GRPO run of one seed up to its last checkpoint, analysing the batch of step t + 1 at each checkpoint t
    (before its update) -> the run directory. Resumes from <run>/trainer.pt (the state at the first checkpoint not
    yet analysed) when it matches; `progress(step)` after each analysed checkpoint."""
    from openrlhf_geo.local.flags import parse_args
    from openrlhf_geo.local.reward import shared_reward_fn
    from openrlhf_geo.local.training import load_model, make_trainer, read_dataset
    from openrlhf_geo.registry import ESTIMATORS

    run = Path(job["out"])
    done = done_steps(job)
    todo = [t for t in job["checkpoints"] if t not in done]
    if not todo:
        return str(run)
    if not done:  # a fresh start: an earlier configuration's files go
        run.mkdir(parents=True, exist_ok=True)
        for path in run.glob("step*.json"):
            path.unlink()
        (run / "trainer.pt").unlink(missing_ok=True)
        (run / "config.json").write_text(json.dumps(strict_json(identity(job)), indent=1) + "\n")
    args = parse_args(job["argv"])
    if (
        args.reward.pm1
        or args.geometry.noise.enabled
        or args.algo.advantage.estimator != "group_norm"
        or (args.geometry.salt is not None and args.geometry.salt.apply)
    ):
        raise ValueError("salt-proxy analyses a plain GRPO run (0/1 rewards, no noise, group_norm advantages)")
    torch.set_num_threads(args.train.threads)
    model, tokenizer = load_model(args, torch.device("cpu"))
    rows = read_dataset(args.data.prompt_dataset, args.data.input_key, args.data.label_key, "--data.prompt_dataset")
    trainer = make_trainer(args, model, tokenizer, rows, shared_reward_fn(args.reward.func, args.reward.timeout_s))
    state_path = run / "trainer.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["global_step"] == todo[0]:
            trainer.load_state_dict(state)
    pending, last = set(todo), todo[-1]
    learn = trainer.learn

    def hook(batch):
        t = trainer.global_step - 1  # Trainer.step counts the step before collecting its rollouts
        if t in pending:
            advantages = ESTIMATORS[args.algo.advantage.estimator].advantages(batch.rewards, batch.group_ids)
            temperature = args.rollout.temperature
            record = analyse(trainer.model, batch, advantages, temperature, job["default"], job["seed"], t)
            _atomic_write(step_file(run, t), json.dumps(strict_json(record), indent=1) + "\n")
            pending.discard(t)
            if progress is not None:
                progress(t)
            if t == last:
                raise _Finished
        return learn(batch)

    trainer.learn = hook
    try:
        while True:
            if trainer.global_step in pending:  # the state at θ_t, before step t + 1 (the resume point)
                tmp = state_path.with_suffix(".tmp")
                torch.save(trainer.state_dict(), tmp)
                os.replace(tmp, state_path)  # a kill leaves the old state or the new one
            trainer.step()
    except _Finished:
        pass
    return str(run)


def run_all(jobs, workers):
    """Each seed's job (in `workers` processes, or in this one), one progress bar over the analysed checkpoints."""
    from tqdm.auto import tqdm

    total = sum(len(job["checkpoints"]) for job in jobs)
    bar = tqdm(total=total, initial=sum(len(done_steps(j)) for j in jobs), desc="salt-proxy", unit="checkpoint")
    if workers <= 1:
        for job in jobs:
            bar.set_postfix(seed=job["seed"])
            run_seed(job, progress=lambda step: bar.update(1))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_seed, job) for job in jobs]
            while not all(f.done() for f in futures):
                time.sleep(0.5)
                bar.update(sum(len(done_steps(j)) for j in jobs) - bar.n)
            for f in futures:
                f.result()  # a failed seed raises here
    bar.update(bar.total - bar.n)
    bar.close()


def estimate_seconds(jobs, workers, sft_steps):
    """Estimated wall seconds on idle cores: the SFT warm-up, then the seeds in rounds of `workers` (STEP_S, ...)."""
    if not jobs:
        return SFT_S * sft_steps / recipe.FULL["sft_max_steps"]
    per = max(LOAD_S + (max(j["checkpoints"]) + 1) * STEP_S + len(j["checkpoints"]) * ANALYSIS_S for j in jobs)
    return SFT_S * sft_steps / recipe.FULL["sft_max_steps"] + math.ceil(len(jobs) / workers) * per


# ---------------------------------------------------------------- summary, report, plot


def load_records(jobs):
    """{seed: [record per checkpoint, in checkpoint order]}."""
    return {j["seed"]: [json.loads(step_file(j["out"], t).read_text()) for t in j["checkpoints"]] for j in jobs}


def _value(x):
    return math.nan if x is None else float(x)


def _nanmean(values):
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else math.nan


def per_seed_means(records, pair, metric):
    """{seed: mean over its checkpoints of `metric` for `pair`} (undefined values left out; a seed without any
    finite value is left out)."""
    out = {}
    for seed, rows in records.items():
        values = np.array([_value(r["pairs"][pair][metric]) for r in rows if pair in r["pairs"]])
        values = values[np.isfinite(values)]
        if values.size:
            out[seed] = float(values.mean())
    return out


def interval(values):
    """{"mean", "sd", "low", "high", "n"}: mean over seeds with its 95 % percentile-bootstrap CI (SALT App. H)."""
    from openrlhf_geo.eval.metrics import paired_gain

    v = np.asarray(list(values), dtype=np.float64)
    ci = paired_gain(v, np.zeros_like(v)) if v.size else {"gain": math.nan, "low": math.nan, "high": math.nan}
    return {"mean": ci["gain"], "sd": float(v.std(ddof=1)) if v.size > 1 else math.nan, "low": ci["low"],
            "high": ci["high"], "n": int(v.size)}  # fmt: skip


def versus(records, pair, null_pair, metric):
    """Paired by seed: `pair` − `null_pair` of the per-seed means of `metric` -> eval.metrics.paired_gain's row."""
    from openrlhf_geo.eval.metrics import paired_gain

    ours, theirs = per_seed_means(records, pair, metric), per_seed_means(records, null_pair, metric)
    seeds = sorted(set(ours) & set(theirs))
    row = paired_gain(np.array([ours[s] for s in seeds]), np.array([theirs[s] for s in seeds]))
    return {**row, "seeds": seeds}


def verdict(table, nulls, reference, proxy):
    """The protocol's decision rule for `proxy` against `reference` -> {"verdict", "failed": [test names]}."""
    pair = f"{proxy}/{reference}"
    if table[pair]["rho"]["n"] < 2:
        return {"verdict": "no verdict (fewer than two seeds: no CI)", "failed": []}
    failed = []
    tests = [(m, null) for m in ("rho", "sign", "subspace", "a_cos") for null in NULLS]
    tests += [("pr_err", "noise"), ("k_match", "noise")]
    for metric, null in tests:
        row = nulls[pair][metric][null]
        # proxy − null must be > 0; for PR error (lower is better) null − proxy must be
        low = row["low"] if HIGHER_IS_BETTER[metric] else -row["high"]
        if not (math.isfinite(low) and low > 0):
            failed.append(f"(A) {metric} vs {null} null")
    paper = PAPER_TABLE5[reference]
    for metric in ("rho", "pr_err", "subspace"):
        mean, (value, sd) = table[pair][metric]["mean"], paper[metric]
        bound = value - BAND_SDS * sd if HIGHER_IS_BETTER[metric] else value + BAND_SDS * sd
        ok = math.isfinite(mean) and (mean >= bound if HIGHER_IS_BETTER[metric] else mean <= bound)
        if not ok:
            failed.append(f"(B) {metric} {'<' if HIGHER_IS_BETTER[metric] else '>'} {bound:.2f}")
    rho_nulls = [f"(A) rho vs {null} null" for null in NULLS]
    if any(f in failed for f in rho_nulls):
        name = "does not preserve the geometry"
    elif failed:
        name = "above chance, below Table 1's level"
    else:
        name = "preserves the geometry at Table 1's level"
    return {"verdict": name, "failed": failed}


def summarize(jobs, setup):
    """Every number of the report -> dict (strict JSON once passed through `strict_json`)."""
    records = load_records(jobs)
    first = next(iter(records.values()))[0]
    names = [n for n in (*PROXIES, *NULLS) if f"{n}/full" in first["pairs"]]
    pairs = [f"{n}/{ref}" for ref in REFERENCES for n in names]
    means = {p: {m: per_seed_means(records, p, m) for m in (*METRICS, *EXTRA)} for p in pairs}
    table = {p: {m: {**interval(v.values()), "per_seed": v} for m, v in row.items()} for p, row in means.items()}
    proxies = [n for n in PROXIES if n in names]
    nulls = {f"{n}/{ref}": {m: {null: versus(records, f"{n}/{ref}", f"{null}/{ref}", m) for null in NULLS}
                            for m in METRICS} for ref in REFERENCES for n in proxies}  # fmt: skip
    verdicts = {f"{n}/{ref}": verdict(table, nulls, ref, n) for ref in REFERENCES for n in proxies}
    steps = [r["step"] for r in next(iter(records.values()))]
    by_step = {
        p: {m: {t: _nanmean([_value(rows[i]["pairs"][p][m]) for rows in records.values()])
                for i, t in enumerate(steps)} for m in (*METRICS, "a_rank")} for p in pairs
    }  # fmt: skip
    sets = sorted(first["sets"])
    context = {
        key: {t: _nanmean([_value(rows[i][key]) for rows in records.values()]) for i, t in enumerate(steps)}
        for key in (
            "accuracy",
            "tied_groups",
            "response_length",
            "lm_head_share",
            "proxy_check",
            "default_gram_diff",
            "seconds",
        )
    }
    set_stats = {
        s: {key: {t: _nanmean([rows[i]["sets"][s][key] for rows in records.values()]) for i, t in enumerate(steps)}
            for key in ("pr", "k", "alpha")} for s in sets
    }  # fmt: skip
    return {
        "study": "salt-proxy",
        "title": "Does the LM-head proxy preserve SALT's geometry? (SALT Table 1 / App. E)",
        "setup": {**setup, "dims": first["dims"], "default_is_exact": first["default_is_exact"], "m": first["m"]},
        "table": table,
        "versus_nulls": nulls,
        "verdicts": verdicts,
        "by_step": by_step,
        "context": context,
        "sets": set_stats,
        "paper_table5": PAPER_TABLE5,
    }


def _f(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _ci(row, signed=False):
    if row is None or row.get("mean", row.get("gain")) is None:
        return "n/a"
    mean = row.get("mean", row.get("gain"))
    fmt = (lambda x: f"{x:+.3f}") if signed else (lambda x: f"{x:.3f}")
    if not math.isfinite(mean):
        return "n/a"
    if row["low"] is None or not math.isfinite(row["low"]):
        return f"{fmt(mean)} ({row['n']} seed{'s' if row['n'] != 1 else ''}, no CI)"
    return f"{fmt(mean)} [{fmt(row['low'])}, {fmt(row['high'])}]"


LABELS = {"rho": "Gram ρ ↑", "sign": "sign agree. ↑", "pr_err": "PR rel. err. ↓", "subspace": "subspace ↑",
          "k_match": "k_t match ↑", "a_cos": "a' cosine ↑"}  # fmt: skip


def _default_line(summary):
    """Whether the default proxy's Gram is the exact proxy's (a sketch whose D holds every V·d entry is exact)."""
    diffs = [v for v in summary["context"]["default_gram_diff"].values() if v is not None and math.isfinite(v)]
    if summary["setup"]["default_is_exact"] or not diffs:
        return "- The default proxy is the exact proxy here."
    same = " (the same geometry: its rows are the exact proxy's)" if max(diffs) < 1e-6 else ""
    return f"- Default vs exact proxy Gram, ‖K_default − K_exact‖_F / ‖K_exact‖_F: at most {max(diffs):.2e}{same}."


def render(summary):
    """report.md from a summary (its strict-JSON form renders the same)."""
    setup, table = summary["setup"], summary["table"]
    metric_cols = [LABELS[m] for m in METRICS]
    lines = [
        f"# openrlhf-geo study salt-proxy: {summary['title']}" + (" (`--quick`)" if setup["quick"] else ""),
        "",
        f"Protocol: docs/studies/salt-proxy.md. Seeds {setup['seeds']}; checkpoints (RL steps) "
        f"{setup['checkpoints']}; "
        f"one mini-batch of m = {setup['m']} rollouts per checkpoint (the batch of step t + 1, before its update); "
        f"wall time {setup['wall_s']:.0f} s, SFT included (estimated {setup['estimate_s']:.0f} s on idle cores; "
        f"{setup['skipped']} checkpoint results reused).",
        "",
        "The GRPO run (`openrlhf-geo train`, stepped in-process), for seed S:",
        "",
        "```",
        setup["command"],
        "```",
        "",
        f"- Default proxy (`SaltConfig()` at run time): {setup['default']}"
        + (" = the exact proxy (one row)." if setup["default_is_exact"] else "."),
        _default_line(summary),
        "- Dimensions: " + ", ".join(f"{k} {v:,}" for k, v in setup["dims"].items()) + ".",
        *(
            f"- SFT `{name}`: {info['steps']} steps, held-out accuracy {_f(info['accuracy'])}, {info['params']:,} "
            f"parameters."
            for name, info in setup["sft"].items()
        ),  # fmt: skip
        "",
        "## App. E.2 metrics: mean over seeds [95 % percentile-bootstrap CI] of each seed's mean over checkpoints",
        "",
        "| vectors | reference | " + " | ".join(metric_cols) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for pair, row in table.items():
        name, ref = pair.split("/")
        lines.append(f"| {name} | {ref} | " + " | ".join(_ci(row[m]) for m in METRICS) + " |")
    lines += ["", "SALT Table 5 (mean ± sd over checkpoints and mini-batches):", "",
              "| row | " + " | ".join(metric_cols) + " |", "|---|" + "---|" * len(METRICS)]  # fmt: skip
    for key, row in summary["paper_table5"].items():
        lines.append(f"| {PAPER_NAMES[key]} | " + " | ".join(f"{row[m][0]:.2f} ± {row[m][1]:.2f}" for m in METRICS)
                     + " |")  # fmt: skip
    lines += [
        "",
        "Beside them: the absolute difference of the two k_t, the subspace overlap's chance level k/m, and the "
        "Spearman correlation of the two a' (Eq. 57's rank correlation):",
        "",
        "| vectors | reference | Δk_t (absolute) | chance k/m | a' Spearman |",
        "|---|---|---|---|---|",
        *(
            f"| {p.split('/')[0]} | {p.split('/')[1]} | " + " | ".join(_ci(r[m]) for m in EXTRA) + " |"
            for p, r in table.items()
        ),  # fmt: skip
        "",
        "## Against the nulls (proxy − null, paired by seed, 95 % CI; for PR rel. err. lower is better)",
        "",
        "| proxy | reference | null | " + " | ".join(metric_cols) + " |",
        "|---|---|---|" + "---|" * len(METRICS),
    ]
    for pair, rows in summary["versus_nulls"].items():
        name, ref = pair.split("/")
        for null in NULLS:
            lines.append(f"| {name} | {ref} | {null} | " + " | ".join(_ci(rows[m][null], True) for m in METRICS)
                         + " |")  # fmt: skip
    lines += ["", "## Verdicts (the protocol's decision rule, applied mechanically)", ""]
    for pair, v in summary["verdicts"].items():
        failed = f" (failed: {', '.join(v['failed'])})" if v["failed"] else ""
        lines.append(f"- `{pair}`: **{v['verdict']}**{failed}.")
    lines += ["", "## By checkpoint (mean over seeds)", ""]
    steps = list(next(iter(summary["context"].values())))
    lines += ["| vectors | reference | metric | " + " | ".join(f"t={t}" for t in steps) + " |",
              "|---|---|---|" + "---|" * len(steps)]  # fmt: skip
    for pair, metrics in summary["by_step"].items():
        if pair.endswith("/full"):
            name, ref = pair.split("/")
            for m in METRICS:
                values = " | ".join(_f(metrics[m][t]) for t in steps)
                lines.append(f"| {name} | {ref} | {LABELS[m]} | {values} |")
    lines += ["", "| context | " + " | ".join(f"t={t}" for t in steps) + " |", "|---|" + "---|" * len(steps)]
    for key, values in summary["context"].items():
        lines.append(f"| {key} | " + " | ".join(_f(values[t]) for t in steps) + " |")
    for s, values in summary["sets"].items():
        for key in ("pr", "k", "alpha"):
            lines.append(f"| {s} {key} | " + " | ".join(_f(values[key][t], 2) for t in steps) + " |")
    lines += [
        "",
        "accuracy: the analysed batch's training accuracy; tied_groups: prompts (of the batch's groups) whose "
        "rollouts all got the same reward (a = 0 there); lm_head_share: mean over responses of the LM head's share "
        "of ‖g_i‖²; proxy_check: ‖exact proxy − LM-head block of the full gradient‖_F / ‖block‖_F (both are "
        "Eq. 19's gradient; float32 proxy against float64 gradient); default_gram_diff: ‖K_default − K_exact‖_F / "
        "‖K_exact‖_F (0: the default proxy has the exact proxy's geometry); seconds: analysis time per mini-batch.",
    ]
    plots = summary.get("plots", [])
    lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)] if plots else []
    return "\n".join(lines) + "\n"


def plot(summary, out):
    """ρ, PR rel. err., subspace overlap and a' cosine against the full gradient by checkpoint -> file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, metric in zip(axes, ("rho", "pr_err", "subspace", "a_cos")):
        for pair, metrics in summary["by_step"].items():
            if pair.endswith("/full"):
                steps = [int(t) for t in metrics[metric]]
                ax.plot(steps, list(metrics[metric].values()), marker="o", label=pair.split("/")[0])
        ax.axhline(PAPER_TABLE5["full"][metric][0], color="black", linestyle="--", label="Table 1 (full gradient)")
        ax.set(xlabel="RL step (checkpoint)", title=f"{LABELS[metric]} vs full gradient")
        if metric == "pr_err":
            ax.set_yscale("symlog", linthresh=1.0)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    name = "proxy_fidelity.png"
    fig.savefig(Path(out) / name, dpi=100)
    plt.close(fig)
    return name


def write_report(jobs, out, setup):
    summary = summarize(jobs, setup)
    summary["plots"] = [plot(summary, out)]
    data = strict_json(summary)
    (Path(out) / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    (Path(out) / "report.md").write_text(render(data))
    return summary


# ---------------------------------------------------------------- the study (`openrlhf-geo study salt-proxy`)


def run(args, out, workers):
    """The study in its claimed `out` (`study.main` checked the options) -> exit status."""
    from openrlhf_geo.lab.studies.runner import prepare_settings

    torch.set_num_threads(1)
    checkpoints = QUICK_STUDY["checkpoints"] if args.quick else CHECKPOINTS
    seeds = list(args.seeds if args.seeds is not None else QUICK_STUDY["seeds"] if args.quick else SEEDS)
    sft_steps = QUICK_STUDY["sft_max_steps"] if args.quick else recipe.FULL["sft_max_steps"]
    default = default_proxy()
    jobs = plan(out, seeds, checkpoints, default)
    reused = sum(len(done_steps(j)) for j in jobs)
    estimate = estimate_seconds(jobs, workers, sft_steps)
    print(f"study salt-proxy: {len(seeds)} seeds x {len(checkpoints)} checkpoints, {reused} done; about "
          f"{estimate / 60:.0f} min on {workers} worker(s) (docs/studies/salt-proxy.md)")  # fmt: skip
    start = time.perf_counter()
    sft = prepare_settings(out, [{"setting": "demo"}], sft_steps)
    run_all(jobs, workers)
    argv = jobs[0]["argv"]
    command = "openrlhf-geo train " + shlex.join(argv[: argv.index("--train.seed")]) + " --train.seed S " \
        "--reward.noise.seed S"  # fmt: skip
    setup = {"quick": args.quick, "seeds": seeds, "checkpoints": list(checkpoints), "workers": workers,
             "wall_s": time.perf_counter() - start, "estimate_s": estimate, "skipped": reused, "sft": sft,
             "command": command, "default": default}  # fmt: skip
    write_report(jobs, out, setup)
    print(f"study salt-proxy finished: {Path(out) / 'report.md'}")
    return 0


class SaltProxy(Study):
    """Not a list of train conditions: the demo's GRPO runs stepped in-process, analysed at checkpoints."""

    name = "salt-proxy"

    def run(self, args, out, workers):
        return run(args, out, workers)


STUDY = SaltProxy()
