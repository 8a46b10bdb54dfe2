"""`openrlhf-geo study salt-proxy` (SALT Table 1 / App. E): every metric of App. E.2 against an independent float64
brute-force computation, the per-sample full gradient against a per-sample autograd loop on the engine's layout, its
LM-head block against the Eq. 19 proxy, the decision rule, the registration, and a --quick study end to end with a
resume."""

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from openrlhf_geo import salt
from openrlhf_geo.estimators import group_norm
from openrlhf_geo.features import GeometrySpec
from openrlhf_geo.jsonl import strict_json
from openrlhf_geo.lab import recipe, studies
from openrlhf_geo.lab.studies import salt_proxy as proxy_study
from openrlhf_geo.lab.studies.base import ConditionStudy
from openrlhf_geo.lab.task import build_model, build_tokenizer
from openrlhf_geo.local.engine import generate_rollouts, response_forward
from openrlhf_geo.local.flags import parse_args

DOC = Path(__file__).resolve().parents[1] / "docs" / "studies" / "salt-proxy.md"


def random_set(m=12, d=30, seed=0, rank=None):
    rng = np.random.default_rng(seed)
    if rank is None:
        return rng.standard_normal((m, d))
    return rng.standard_normal((m, rank)) @ rng.standard_normal((rank, d)) + 0.1 * rng.standard_normal((m, d))


def brute_cosines(F):
    """{(i, j): cos(f_i, f_j)} for i < j by a double loop (a zero row: cosine 0)."""
    out = {}
    for i in range(len(F)):
        for j in range(i + 1, len(F)):
            ni, nj = math.sqrt(sum(x * x for x in F[i])), math.sqrt(sum(x * x for x in F[j]))
            out[i, j] = sum(x * y for x, y in zip(F[i], F[j])) / (ni * nj) if ni > 0 and nj > 0 else 0.0
    return out


# ---------------------------------------------------------------- App. E.2 metrics against brute force


def test_gram_rho_is_spearman_over_the_off_diagonal_cosines():
    P, G = random_set(seed=1), random_set(seed=2)
    G[:, :10] += P[:, :10]  # correlated geometry
    P[3] = 0.0  # a zero row: cosine 0 with everything
    cp, cg = brute_cosines(P.tolist()), brute_cosines(G.tolist())
    x, y = np.array([cp[k] for k in sorted(cp)]), np.array([cg[k] for k in sorted(cg)])
    # Spearman = Pearson of the ranks (average ranks for ties), independently of spearmanr
    expected = np.corrcoef(scipy.stats.rankdata(x), scipy.stats.rankdata(y))[0, 1]
    got = proxy_study.gram_rho(proxy_study.cosine_gram(P), proxy_study.cosine_gram(G))
    assert got == pytest.approx(expected, abs=1e-12)
    assert proxy_study.gram_rho(proxy_study.cosine_gram(G), proxy_study.cosine_gram(G)) == pytest.approx(1.0)
    assert np.allclose(np.diag(proxy_study.cosine_gram(P)), [0.0 if i == 3 else 1.0 for i in range(len(P))])


def test_sign_agreement_counts_the_top_quartile_of_reference_pairs_by_magnitude():
    P, G = random_set(m=15, seed=3), random_set(m=15, seed=4)
    P[:, :5] += G[:, :5]
    cp, cg = brute_cosines(P.tolist()), brute_cosines(G.tolist())
    keys = sorted(cg)
    magnitudes = sorted(abs(cg[k]) for k in keys)
    h = (len(magnitudes) - 1) * 0.75  # the linear-interpolation quantile, by hand
    lo = math.floor(h)
    threshold = magnitudes[lo] + (h - lo) * (magnitudes[min(lo + 1, len(magnitudes) - 1)] - magnitudes[lo])
    high = [k for k in keys if abs(cg[k]) >= threshold]
    expected = sum(math.copysign(1, cp[k]) == math.copysign(1, cg[k]) for k in high) / len(high)
    got = proxy_study.sign_agreement(proxy_study.cosine_gram(P), proxy_study.cosine_gram(G))
    assert len(high) == math.ceil(len(keys) / 4) and got == pytest.approx(expected)
    flipped = proxy_study.sign_agreement(-proxy_study.cosine_gram(G), proxy_study.cosine_gram(G))
    assert flipped == 0.0


def test_subspace_overlap_is_the_mean_squared_cosine_of_the_principal_angles():
    rng = np.random.default_rng(5)
    A = np.linalg.qr(rng.standard_normal((20, 4)))[0]
    B = np.linalg.qr(A + 0.5 * rng.standard_normal((20, 4)))[0]
    angles = scipy.linalg.subspace_angles(A, B)
    assert proxy_study.subspace_overlap(A, B) == pytest.approx(np.mean(np.cos(angles) ** 2), abs=1e-12)
    assert proxy_study.subspace_overlap(A, A @ np.linalg.qr(rng.standard_normal((4, 4)))[0]) == pytest.approx(1.0)
    Q = np.linalg.qr(rng.standard_normal((20, 8)))[0]
    assert proxy_study.subspace_overlap(Q[:, :4], Q[:, 4:]) == pytest.approx(0.0, abs=1e-12)


def brute_salt(a, F):
    """SALT Eq. 4, 5, 14, 13/15, 17 (Eq. 6's n_eff), 18 in numpy float64 -> (PR, k_t, top eigenvectors, a')."""
    m = len(a)
    K = F @ F.T / m
    lam, U = np.linalg.eigh(K)
    lam, U = lam[::-1], U[:, ::-1]
    lam = np.clip(lam, 0, None)
    pr = lam.sum() ** 2 / (lam**2).sum()
    k = min(max(int(np.floor(pr + 0.5)), 1), m)
    Pk = U[:, :k] @ U[:, :k].T
    u = a[:, None] * F
    n_eff = np.sum(u.sum(0) ** 2) / np.sum(u**2)
    alpha = max(0.0, 1.0 - n_eff)
    a_prime = Pk @ a + alpha * (np.eye(m) - Pk) @ np.clip(a, 0, None)
    return pr, k, U, a_prime


def test_geometry_and_fidelity_match_a_numpy_float64_salt():
    a = np.array([1.2, -0.4, -0.8, 0.0, 0.9, -0.9, 1.5, -1.5, 0.3, -0.3, 0.0, 0.0])
    P = random_set(seed=6, rank=3, d=40)
    G = P @ random_set(m=40, d=200, seed=7) / 6 + 0.3 * random_set(d=200, seed=8)
    gp, gg = (
        proxy_study.geometry(torch.tensor(a), torch.tensor(P)),
        proxy_study.geometry(torch.tensor(a), torch.tensor(G)),
    )
    for geo, F in ((gp, P), (gg, G)):
        pr, k, U, a_prime = brute_salt(a, F)
        assert geo.pr == pytest.approx(pr, rel=1e-10) and geo.k == k
        assert np.allclose(geo.a_prime, a_prime, atol=1e-10)
        assert proxy_study.subspace_overlap(geo.eigvecs[:, :k], U[:, :k]) == pytest.approx(1.0, abs=1e-9)
    pr_p, k_p, U_p, a_p = brute_salt(a, P)
    pr_g, k_g, U_g, a_g = brute_salt(a, G)
    got = proxy_study.fidelity(gp, gg)
    assert got["pr_err"] == pytest.approx(abs(pr_p - pr_g) / pr_g, rel=1e-9)
    assert got["k_match"] == float(k_p == k_g) and got["k_diff"] == abs(k_p - k_g)
    angles = scipy.linalg.subspace_angles(U_p[:, :k_g], U_g[:, :k_g])
    assert got["subspace"] == pytest.approx(np.mean(np.cos(angles) ** 2), abs=1e-9)
    assert got["subspace_chance"] == k_g / len(a)
    assert got["a_cos"] == pytest.approx(a_p @ a_g / np.linalg.norm(a_p) / np.linalg.norm(a_g), abs=1e-10)
    assert got["a_rank"] == pytest.approx(scipy.stats.spearmanr(a_p, a_g).statistic, abs=1e-10)


def test_a_permutation_null_keeps_pr_and_k_but_loses_the_rest():
    a = torch.tensor(np.tile([1.0, -1.0, 0.5, -0.5], 6))
    F = torch.tensor(random_set(m=24, d=50, seed=9, rank=4))
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    ref, null = proxy_study.geometry(a, F), proxy_study.geometry(a, F[perm])
    got = proxy_study.fidelity(null, ref)
    assert got["pr_err"] == pytest.approx(0.0, abs=1e-12) and got["k_match"] == 1.0
    assert proxy_study.fidelity(ref, ref)["rho"] == pytest.approx(1.0) and got["rho"] < 0.5


# ---------------------------------------------------------------- per-sample gradients on the engine's layout


@pytest.fixture(scope="module")
def tiny():
    """A tiny float64 Qwen2 and a rollout batch with prompts of different widths (left padding varies)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=16, num_layers=2, num_heads=2, seed=3).double()
    torch.manual_seed(0)
    batch = generate_rollouts(model, tokenizer, ["1+2=", "12+34=", "7+95="], ["3", "46", "102"], 3, 7)
    assert len(set((batch.attention_mask == 0).sum(1).tolist())) > 1  # the padding really varies
    return model, tokenizer, batch


def loop_gradients(model, batch, temperature):
    """Per response: autograd of the masked mean log-prob from the engine's own padded forward (response_forward)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(batch)):
        logprobs, _, _ = response_forward(
            model, batch.sequences[i : i + 1], batch.attention_mask[i : i + 1], batch.prompt_width, temperature
        )
        mask = batch.mask[i : i + 1].double()
        loss = (logprobs * mask).sum() / mask.sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def test_per_sample_gradients_match_a_per_sample_autograd_loop_on_the_padded_layout(tiny):
    model, _, batch = tiny
    for temperature in (1.0, 0.7):
        got = proxy_study.per_sample_gradients(
            model, batch.sequences, batch.attention_mask, batch.mask, batch.prompt_width, temperature, chunk=2
        )
        expected = loop_gradients(model.eval(), batch, temperature)
        assert got.dtype == torch.float64 and got.shape == expected.shape
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-13)


def test_the_lm_head_block_of_the_full_gradient_is_the_exact_proxy(tiny):
    model, _, batch = tiny
    for temperature in (1.0, 0.7):
        full = proxy_study.per_sample_gradients(
            model, batch.sequences, batch.attention_mask, batch.mask, batch.prompt_width, temperature
        )
        head = full[:, proxy_study.block_columns(proxy_study.parameter_blocks(model), "lm_head.")]
        exact = proxy_study.proxy_features(model, batch, temperature, {"e": GeometrySpec(features="exact")})["e"]
        assert torch.allclose(exact.double(), head, rtol=1e-5, atol=1e-7)


def test_the_blocks_are_disjoint_and_cover_the_named_parameters(tiny):
    model, _, _ = tiny
    blocks = proxy_study.parameter_blocks(model)
    last, first, head = (
        proxy_study.block_columns(blocks, p) for p in ("model.layers.1.", "model.layers.0.", "lm_head.")
    )
    assert not set(last) & set(head) and not set(last) & set(first)
    assert len(last) == sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.1."))
    with pytest.raises(ValueError, match="no trainable parameter"):
        proxy_study.block_columns(blocks, "model.layers.9.")


@pytest.mark.parametrize("features", ["exact", "sketch"])
def test_analyse_reads_the_default_proxy_from_salt_config(tiny, monkeypatch, features):
    model, _, batch = tiny
    batch.rewards = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 1, 0])

    class Default(salt.SaltConfig):
        def __init__(self):
            super().__init__(features=features, dim=64)

    monkeypatch.setattr(salt, "SaltConfig", Default)
    default = proxy_study.default_proxy()
    assert default == {"features": features, "dim": 64, "seed": 0, "gram": "raw"}
    a = group_norm(batch.rewards, batch.group_ids)
    record = proxy_study.analyse(model, batch, a, 1.0, default, seed=0, step=0)
    assert ("default" in record["sets"]) == (features == "sketch") and record["default_is_exact"] == (
        features == "exact"
    )
    assert record["proxy_check"] < 1e-5 and 0 < record["lm_head_share"] < 1
    assert record["tied_groups"] == 0 and record["groups"] == 3
    assert record["dims"]["noise"] == record["dims"]["exact"] == 28 * 16
    names = {"exact", "permutation", "noise"} | ({"default"} if features == "sketch" else set())
    assert set(record["pairs"]) == {f"{n}/{r}" for n in names for r in proxy_study.REFERENCES}
    again = proxy_study.analyse(model, batch, a, 1.0, default, seed=0, step=0)
    assert again["pairs"] == record["pairs"]  # the nulls' draws are seeded by (seed, step)


# ---------------------------------------------------------------- decision rule


def fake_summary(rho, rho_null_low, pr_err=0.1, subspace=0.8):
    """table / versus_nulls rows for exact/full as `verdict` reads them (every other test passes)."""
    table = {"exact/full": {"rho": {"mean": rho, "n": 5}, "pr_err": {"mean": pr_err, "n": 5},
                            "subspace": {"mean": subspace, "n": 5}}}  # fmt: skip
    ok = {"gain": 0.5, "low": 0.2, "high": 0.8, "n": 5}
    nulls = {"exact/full": {m: {n: dict(ok) for n in proxy_study.NULLS} for m in proxy_study.METRICS}}
    nulls["exact/full"]["pr_err"]["noise"] = {"gain": -2.0, "low": -3.0, "high": -1.0, "n": 5}
    nulls["exact/full"]["rho"]["permutation"]["low"] = rho_null_low
    return table, nulls


@pytest.mark.parametrize(
    "args, expected, failed",
    [
        ((0.6, 0.1), "preserves the geometry at Table 1's level", []),
        ((0.5, 0.1), "above chance, below Table 1's level", ["(B) rho < 0.53"]),
        ((0.6, 0.1, 0.25, 0.5), "above chance, below Table 1's level", ["(B) pr_err > 0.21", "(B) subspace < 0.63"]),
        ((0.6, -0.01), "does not preserve the geometry", ["(A) rho vs permutation null"]),
    ],
)
def test_the_decision_rule_is_the_protocols(args, expected, failed):
    table, nulls = fake_summary(*args)
    got = proxy_study.verdict(table, nulls, "full", "exact")
    assert got == {"verdict": expected, "failed": failed}
    table["exact/full"]["rho"]["n"] = 1
    assert proxy_study.verdict(table, nulls, "full", "exact")["verdict"].startswith("no verdict")


def fake_record(seed, step, shift):
    """A record as `analyse` writes it, with metric values that depend on (seed, step) in a known way."""
    sets = {n: {"pr": 5.0, "k": 5, "alpha": 0.0} for n in ("exact", "permutation", "noise", *proxy_study.REFERENCES)}
    pairs = {}
    for ref in proxy_study.REFERENCES:
        for name, base in (("exact", 0.7), ("permutation", 0.0), ("noise", 0.0)):
            value = base + shift * seed + 0.01 * step
            pairs[f"{name}/{ref}"] = {m: value for m in (*proxy_study.METRICS, *proxy_study.EXTRA)}
            pairs[f"{name}/{ref}"]["pr_err"] = 0.05 if name == "exact" else 3.0 + seed
            pairs[f"{name}/{ref}"]["a_cos"] = None if step == 10 else value  # undefined there: left out
    return {"seed": seed, "step": step, "m": 128, "accuracy": 0.5, "tied_groups": 1, "groups": 8,
            "response_length": 30.0, "default_is_exact": True, "dims": {"exact": 1792}, "sets": sets, "pairs": pairs,
            "proxy_check": 1e-8, "lm_head_share": 0.4, "default_gram_diff": 0.0, "seconds": 1.0}  # fmt: skip


def test_summary_averages_checkpoints_within_a_seed_then_bootstraps_over_seeds(tmp_path):
    default = {"features": "exact", "dim": 4096, "seed": 0, "gram": "raw"}
    jobs = proxy_study.plan(tmp_path, [0, 1, 2], (0, 10, 20), default)
    for job in jobs:
        Path(job["out"]).mkdir(parents=True)
        for t in job["checkpoints"]:
            record = fake_record(job["seed"], t, shift=0.02 * (job["seed"] % 2))
            proxy_study.step_file(job["out"], t).write_text(json.dumps(record))
    setup = {"quick": False, "seeds": [0, 1, 2], "checkpoints": [0, 10, 20], "workers": 1, "wall_s": 1.0,
             "estimate_s": 1.0, "skipped": 0, "sft": {}, "command": "x", "default": default}  # fmt: skip
    summary = proxy_study.summarize(jobs, setup)
    per_seed = {s: 0.7 + 0.02 * (s % 2) * s + 0.1 for s in (0, 1, 2)}  # mean of 0.01·t over t = 0, 10, 20
    row = summary["table"]["exact/full"]["rho"]
    assert row["per_seed"] == pytest.approx(per_seed) and row["mean"] == pytest.approx(
        np.mean(list(per_seed.values()))
    )
    boot = scipy.stats.bootstrap((np.array(list(per_seed.values())),), np.mean, n_resamples=9999,
                                 method="percentile", random_state=np.random.default_rng(0))  # fmt: skip
    assert (row["low"], row["high"]) == pytest.approx(tuple(boot.confidence_interval))
    # a' cosine undefined at t = 10: each seed's mean over t = 0 and 20
    assert summary["table"]["exact/full"]["a_cos"]["per_seed"][0] == pytest.approx(0.7 + 0.1)
    versus = summary["versus_nulls"]["exact/full"]["rho"]["permutation"]
    assert versus["gain"] == pytest.approx(0.7) and versus["low"] == pytest.approx(0.7)  # the same gap every seed
    assert summary["versus_nulls"]["exact/full"]["pr_err"]["noise"]["gain"] == pytest.approx(0.05 - 4.0)
    assert summary["verdicts"]["exact/full"] == {"verdict": "preserves the geometry at Table 1's level", "failed": []}
    assert summary["by_step"]["exact/full"]["rho"][10] == pytest.approx(np.mean([0.7 + 0.02 * (s % 2) * s + 0.1
                                                                                 for s in (0, 1, 2)]))  # fmt: skip
    report = proxy_study.render(json.loads(json.dumps(strict_json(summary))))
    assert "`exact/full`: **preserves the geometry at Table 1's level**" in report
    assert "| Full gradient, small model | 0.71 ± 0.06 |" in report


def test_the_protocol_states_the_runners_choices():
    text = DOC.read_text()
    assert "seeds 0 1 2 3 4" in text and proxy_study.SEEDS == (0, 1, 2, 3, 4)
    assert "t = 0, 10, 20, 30, 40, 50, 60" in text and proxy_study.CHECKPOINTS == (0, 10, 20, 30, 40, 50, 60)
    assert "75th percentile" in text and proxy_study.SIGN_QUANTILE == 0.75
    assert shlex.join(recipe.METHOD_FLAGS["grpo"]) in text and proxy_study.RUN_STEPS == 60
    assert "--rollout.batch_size 8 --rollout.n_samples_per_prompt 16" in text
    for reference, row in proxy_study.PAPER_TABLE5.items():
        low = row["rho"][0] - 3 * row["rho"][1]
        assert reference in ("permutation", "noise") or f"{low:.2f}" in text


def test_the_full_study_is_estimated_within_its_30_minute_budget(tmp_path):
    jobs = proxy_study.plan(tmp_path, proxy_study.SEEDS, proxy_study.CHECKPOINTS, proxy_study.default_proxy())
    estimate = proxy_study.estimate_seconds(jobs, 2, recipe.FULL["sft_max_steps"])
    assert estimate <= 1800 and f"estimated {estimate / 60:.0f} min on 2 idle cores" in DOC.read_text()
    assert len(jobs) == 5 and all(parse_args(j["argv"]).train.steps == proxy_study.RUN_STEPS for j in jobs)


# ---------------------------------------------------------------- the command


def test_salt_proxy_is_a_study_and_refuses_a_regime_in_one_line(tmp_path, capsys):
    from openrlhf_geo import cli

    # a registered study with its own runner, not a list of train conditions
    assert "salt-proxy" in studies.REGISTRY and not isinstance(studies.REGISTRY["salt-proxy"], ConditionStudy)
    assert cli.main(["study", "salt-proxy", "--regime", "t06", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--regime only applies to salt-scaling" in err
    assert not (tmp_path / "o").exists()


def test_quick_study_end_to_end_then_resumes_only_what_is_missing(tmp_path, monkeypatch):
    from openrlhf_geo import cli

    out = tmp_path / "proxy"
    assert cli.main(["study", "salt-proxy", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setup"]["checkpoints"] == [0, 2] and summary["setup"]["seeds"] == [0]
    assert summary["setup"]["default"] == proxy_study.default_proxy()
    assert summary["context"]["proxy_check"]["0"] < 1e-5
    assert set(summary["verdicts"]) >= {"exact/full", "exact/last_block"}
    report = (out / "report.md").read_text()
    assert "## Verdicts" in report and "--advantage_estimator group_norm" in report
    assert (out / "proxy_fidelity.png").stat().st_size > 0
    run = out / "runs" / "seed0"
    first = json.loads((run / "step002.json").read_text())

    # the analysis changes nothing in the run: the state saved at step 2 is that of two plain steps
    from openrlhf_geo.local.engine import Trainer
    from openrlhf_geo.local.reward import make_reward_fn
    from openrlhf_geo.local.training import load_model, read_dataset

    args = parse_args(proxy_study.plan(out, [0], (0, 2), proxy_study.default_proxy())[0]["argv"])
    model, tokenizer = load_model(args, torch.device("cpu"))
    rows = read_dataset(args.data.prompt_dataset, args.data.input_key, args.data.label_key, "prompts")
    plain = Trainer(args, model, tokenizer, rows, make_reward_fn(args.reward.func))
    plain.step(), plain.step()
    saved = torch.load(run / "trainer.pt", weights_only=False)
    assert saved["global_step"] == 2 and all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    assert torch.equal(saved["torch_rng"], torch.get_rng_state())

    # a second invocation analyses nothing again
    def refuse(*args, **kwargs):
        raise AssertionError("re-analysed a finished checkpoint")

    monkeypatch.setattr(proxy_study, "analyse", refuse)
    assert cli.main(["study", "salt-proxy", "--quick", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["setup"]["skipped"] == 2
    monkeypatch.undo()

    # a checkpoint lost (an interrupted run): resumed from the saved trainer state, the same rollouts and numbers
    (run / "step002.json").unlink()
    analysed = []
    original = proxy_study.analyse
    monkeypatch.setattr(proxy_study, "analyse", lambda *a, **k: analysed.append(a[-1]) or original(*a, **k))
    assert cli.main(["study", "salt-proxy", "--quick", "--out", str(out)]) == 0
    again = json.loads((run / "step002.json").read_text())
    assert analysed == [2] and again["pairs"] == first["pairs"] and again["accuracy"] == first["accuracy"]


def test_an_unfinished_seed_with_another_configuration_starts_over(tmp_path):
    job = proxy_study.plan(tmp_path, [0], (0, 2), {"features": "exact", "dim": 4096, "seed": 0, "gram": "raw"})[0]
    run = Path(job["out"])
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(proxy_study.identity(job)))
    (run / "step000.json").write_text("{}")
    assert proxy_study.done_steps(job) == {0}
    other = {**job, "default": {**job["default"], "features": "sketch"}}
    assert proxy_study.done_steps(other) == set()
    assert proxy_study.done_steps({**job, "checkpoints": [0, 2, 4]}) == set()
