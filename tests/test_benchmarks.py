"""benchmarks/gpu_step_overhead.py: its CPU functional check (tiny shape) runs without vLLM, Ray or DeepSpeed and
writes every JSON field; its transcribed log-prob pass equals openrlhf 0.11.2's. Nothing here times anything."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from openrlhf_geo.features import DEFAULT_DIM

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_step_overhead.py"
BLOCKED = ("vllm", "ray", "deepspeed")

# None in sys.modules: `import deepspeed` raises ImportError and find_spec probes report it absent; at the end no
# entry may have been replaced and no submodule loaded, and openrlhf itself must not have been imported.
RUNNER = """
import runpy, sys
blocked = {blocked!r}
for name in blocked:
    sys.modules[name] = None
sys.argv = [{script!r}, *{argv!r}]
runpy.run_path({script!r}, run_name="__main__")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in (*blocked, "openrlhf") and sys.modules[m] is not None)
print("LOADED", loaded)
"""


def load_script(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the repository and benchmarks/
    spec = importlib.util.spec_from_file_location("gpu_step_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_tiny_run_writes_the_json_without_vllm_ray_or_deepspeed(tmp_path):
    out = tmp_path / "cpu.json"
    argv = ["--device", "cpu", "--shape", "tiny", "--quick", "--out", str(out)]
    code = RUNNER.format(blocked=BLOCKED, script=str(SCRIPT), argv=argv)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "LOADED []"
    assert "NOT a measurement" in done.stdout and "salt / grpo" in done.stdout
    result = json.loads(out.read_text())
    assert result["measured"] is False and result["label"] == "functional check, not a measurement"
    assert result["device"] == "cpu" and result["shape"] == "tiny"
    assert result["settings"]["reps"] == 2 and result["settings"]["salt_dim"] == DEFAULT_DIM
    for name in ("grpo", "salt", "geoalign", "curate", "salt_solve"):
        assert len(result["seconds"][name]["values"]) == 2 and result["seconds"][name]["median"] > 0
    for name in ("salt_forward", "geoalign_forward", "salt_batch", "geoalign_batch"):
        ratio = result["ratios"][name]
        assert ratio["q25"] <= ratio["median"] <= ratio["q75"] and ratio["min"] > 0
        assert ratio["ci95"] is None  # 2 repeats: no bootstrap interval
    checks = result["checks"]
    assert checks["log_prob_max_abs_diff_salt_vs_grpo"] < 1e-4  # the sketch's log-probs are upstream's
    assert checks["features_shape"] == [2, DEFAULT_DIM] and checks["features_finite"]
    assert checks["hidden_shape"] == [2, 64]
    assert result["geoalign"]["pairs"] == 8 * 8 * 8 and min(result["geoalign"]["proj_steps"]) == 50
    assert abs(result["anchors"]["salt_table11_total"] - 0.077) < 0.0005  # SALT §4.2's "about 7.7 %"


def test_transcribed_log_probs_equal_openrlhfs(monkeypatch):
    module = load_script(monkeypatch)
    upstream = module.upstream_log_probs()
    if upstream is None:
        pytest.skip("openrlhf is not installed")
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 700, 50, generator=gen)  # 2100 rows: the 1024-row chunks and a remainder
    labels = torch.randint(0, 50, (3, 700), generator=gen)
    expected = upstream(logits.clone(), labels, temperature=0.6)
    torch.testing.assert_close(module.transcribed_log_probs(logits.clone(), labels, 0.6), expected)


def load_fork_step_time():
    spec = importlib.util.spec_from_file_location("fork_step_time", ROOT / "benchmarks" / "fork_step_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fork_step_time_reads_upstreams_timers_drops_the_warm_up_and_takes_ratios_against_grpo():
    fst = load_fork_step_time()
    scalars = {
        "train/timing/step_total": {1: 9.0, 2: 1.0, 3: 1.2, 4: 0.8},
        "train/timing/generation": {1: 5.0, 2: 0.4, 3: 0.5, 4: 0.3},
        "train/salt/solve_ms": {1: 30.0, 2: 2.0, 3: 4.0, 4: 3.0},
        "train/loss": {1: 0.5, 2: 0.4, 3: 0.3, 4: 0.2},
    }
    rows = fst.step_times(scalars)
    assert list(rows) == [2, 3, 4]  # step 1 is the warm-up
    assert rows[3] == {"step_total": 1.2, "generation": 0.5, "salt/solve_ms": 0.004}  # ms -> s; no other tags
    grpo = [{"step_total": t} for t in (1.0, 1.1, 0.9, 1.0, 1.05, 0.95)]
    salt = [{"step_total": t, "salt/solve_ms": 0.002} for t in (1.1, 1.2, 1.0, 1.15, 1.1, 1.05)]
    summary = fst.summarize({"grpo": grpo, "salt": salt})
    expected = np.mean([r["step_total"] for r in salt]) / np.mean([r["step_total"] for r in grpo])
    ratio = summary["salt"]["step_ratio"]
    assert ratio["ratio"] == pytest.approx(expected) and ratio["overhead_pct"] == pytest.approx(100 * (expected - 1))
    assert ratio["ci95"][0] < expected < ratio["ci95"][1]
    assert summary["salt"]["median_s"] == {"step_total": pytest.approx(1.1), "salt/solve_ms": 0.002}
    assert "step_ratio" not in summary["grpo"] and summary["grpo"]["steps"] == 6
    assert "+10.0 % [" in fst.render(summary) and "SALT Table 11: +7.7 %" in fst.render(summary)
    one = fst.summarize({"grpo": grpo[:1], "salt": salt[:1]})  # one step each: a ratio, no interval
    assert one["salt"]["step_ratio"]["ratio"] == pytest.approx(1.1) and np.isnan(one["salt"]["step_ratio"]["ci95"][0])


def test_fork_step_time_needs_grpo_among_its_conditions(capsys):
    fst = load_fork_step_time()
    with pytest.raises(SystemExit) as exc:
        fst.main(["out", "--conditions", "salt,geoalign"])
    assert exc.value.code == 2 and "includes grpo" in capsys.readouterr().err


def test_fork_step_time_without_the_cpu_engines_is_one_line(tmp_path, capsys, monkeypatch):
    from openrlhf_geo.fork import launch
    from openrlhf_geo.fork.install import ForkError

    def missing():
        raise ForkError("the CPU engines are not installed")

    monkeypatch.setattr(launch, "check_cpu_engines", missing)
    fst = load_fork_step_time()
    for model in ("tiny", "smollm2"):
        assert fst.main([str(tmp_path / model), "--model", model]) == 1
        assert capsys.readouterr().err == "fork_step_time: the CPU engines are not installed\n"
    assert not (tmp_path / "tiny").exists()  # nothing claimed before the check


def test_fork_step_time_takes_the_experience_phase_difference_against_grpo():
    fst = load_fork_step_time()
    grpo = [{"step_total": t, "make_experience": e} for t, e in ((10.0, 1.0), (11.0, 1.2), (9.0, 0.8), (10.0, 1.0))]
    salt = [{"step_total": t, "make_experience": e} for t, e in ((10.5, 1.1), (10.0, 1.3), (11.0, 0.9), (10.5, 1.1))]
    summary = fst.summarize({"grpo": grpo, "salt": salt})
    delta = summary["salt"]["experience_delta"]
    assert delta["s"] == pytest.approx(0.1) and delta["ci95"][0] < 0.1 < delta["ci95"][1]
    assert delta["pct_of_grpo_step"][0] == pytest.approx(1.0)  # 0.1 s of GRPO's 10 s mean step
    assert "experience +1.00 % [" in fst.render(summary)


def test_fork_step_time_reads_the_runs_an_earlier_invocation_finished(tmp_path, monkeypatch):
    from openrlhf_geo.fork import launch
    from openrlhf_geo.fork.hooks import DUMP_ENV

    fst = load_fork_step_time()
    ran = []

    def run_group(command, log, env, run, timeout):
        assert DUMP_ENV not in env  # the step time users pay: no replay dump
        ran.append(run.name)
        (run / "final").mkdir()  # upstream's final model: the run finished
        return 0, []

    scalars = {"train/timing/step_total": {1: 5.0, 2: 1.0, 3: 1.1}, "train/timing/make_experience": {2: 0.2, 3: 0.3}}
    monkeypatch.setattr(launch, "check_cpu_engines", lambda: None)
    monkeypatch.setattr(fst.smoke, "build_assets", lambda out: None)
    monkeypatch.setattr(fst.smoke, "run_group", run_group)
    monkeypatch.setattr(fst.smoke, "read_scalars", lambda path: scalars)
    argv = [str(tmp_path / "out"), "--conditions", "grpo,salt", "--rounds", "1"]
    assert fst.main(argv) == 0 and ran == ["grpo-0", "salt-0"]
    first = json.loads((tmp_path / "out" / "fork_step_time.json").read_text())
    (tmp_path / "out" / "salt-0" / "final").rmdir()  # an unfinished run is run again, from an empty folder
    (tmp_path / "out" / "salt-0" / "stale").write_text("")
    assert fst.main(argv) == 0 and ran == ["grpo-0", "salt-0", "salt-0"]
    assert not (tmp_path / "out" / "salt-0" / "stale").exists()
    assert json.loads((tmp_path / "out" / "fork_step_time.json").read_text()) == first
    assert fst.main([*argv, "--episodes", "3"]) == 1  # the folder holds runs of another length


def test_geoalign_threads_prints_one_row_per_shape_and_restores_the_thread_count(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("geoalign_threads", ROOT / "benchmarks" / "geoalign_threads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "SHAPES", ((2, 4, 16), (3, 4, 8)))
    before = torch.get_num_threads()
    assert module.main(["--threads", "2", "--reps", "1"]) == 0
    assert torch.get_num_threads() == before
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[:4] for row in rows] == [["2", "x", "4", "16"], ["3", "x", "4", "8"]]
    for row in rows:
        pairs, one, many, ratio = map(float, row.split()[4:])
        assert pairs >= 1 and one > 0 and many > 0
        # every column is printed to 2 decimals: the ratio of the unrounded times, rounded, lies in this interval
        assert (one - 0.005) / (many + 0.005) - 0.005 <= ratio <= (one + 0.005) / max(many - 0.005, 1e-9) + 0.005


# A stand-in for the Chang-pw/SALT checkout (no network in CI): the code's documented rule written out independently,
# k = max(1, min(round(rho * PR), 64, m - 1)) with its absolute ε's (docs/usage.md), in float64, and its proxy, the
# gradient of -sum_t log p w.r.t. the LM head.
STAND_IN_DECOMPOSITION = """
from dataclasses import dataclass, field
import torch

@dataclass
class DecompositionConfig:
    enabled: bool = False
    rho: float = 0.5

@dataclass
class Result:
    advantage_final: torch.Tensor
    k_t: int
    alpha_t: float
    metrics: dict = field(default_factory=dict)

class AdvantageDecomposer:
    def __init__(self, config):
        self.config = config

    def decompose(self, F, a):
        F64, a64, m = F.double(), a.double(), len(a)
        K = F64 @ F64.T / m
        pr = float(K.trace() ** 2 / (K.square().sum() + 1e-10))
        k = max(1, min(round(self.config.rho * pr), 64, m - 1))
        V = torch.linalg.eigh(K).eigenvectors[:, -k:]
        u = a64[:, None] * F64
        neff = float(u.sum(0).square().sum() / (u.square().sum() + 1e-9))
        alpha = min(max(1.0 - neff, 0.0), 1.0)
        positive = a64.clamp_min(0)
        out = V @ (V.T @ a64) + alpha * (positive - V @ (V.T @ positive))
        metrics = {"adv_decomp/neff": neff, "adv_decomp/participation_ratio": pr}
        return Result(out.to(a.dtype), k, alpha, metrics)
"""
STAND_IN_PROXY = """
from types import SimpleNamespace
import torch

class ManualLmHeadProxy:
    def compute_from_logits(self, per_sample_loss, logits, response_mask, group_ids, hidden_states):
        rows = []
        for i in range(len(per_sample_loss)):
            (grad,) = torch.autograd.grad(per_sample_loss[i], logits, retain_graph=True)
            rows.append(torch.einsum("tv,td->vd", grad[i] * response_mask[i, :, None], hidden_states[i]).reshape(-1))
        return SimpleNamespace(grads_flat=torch.stack(rows))
"""


def run_salt_reference(tmp_path, monkeypatch, argv):
    gradient = tmp_path / "SALT" / "verl" / "verl" / "trainer" / "gradient"
    gradient.mkdir(parents=True)
    (gradient / "advantage_decomposition.py").write_text(STAND_IN_DECOMPOSITION)
    (gradient / "proxy.py").write_text(STAND_IN_PROXY)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends benchmarks/
    for name in ("salt_reference_advantage_decomposition", "salt_reference_proxy"):
        monkeypatch.setitem(sys.modules, name, None)  # removed again afterwards
    spec = importlib.util.spec_from_file_location("salt_reference", ROOT / "benchmarks" / "salt_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--salt-repo", str(tmp_path / "SALT"), *argv])


def table_rows(out, title):
    """The cells of the markdown rows under the `## <title>` header line."""
    lines = out.split(f"## {title}")[1].split("\n## ")[0].splitlines()
    rows = [line for line in lines[3:] if line.startswith("|")]
    return [[cell.strip() for cell in row.replace("\\|", "/").strip("|").split("|")] for row in rows]


def test_salt_reference_runs_theirs_and_ours_side_by_side_on_a_stand_in_checkout(tmp_path, monkeypatch, capsys):
    argv = ["--seeds", "1", "--sizes", "32", "256", "--groups", "8", "--dim", "2048", "--micro", "16", "--real", "0"]
    assert run_salt_reference(tmp_path, monkeypatch, argv) == 0
    out = capsys.readouterr().out
    rows = table_rows(out, "1. synthetic")
    assert len(rows) == 2 * 2 * 4  # sizes x feature structures x rule pairs
    for *_, pair, k_ours, k_theirs, _, _, _, _, cos in rows:
        ours_rule, theirs_rule = pair.split(" / ")
        if ours_rule == theirs_rule:  # this project's --salt.k_rule code against the code: the same a'
            assert k_ours == k_theirs and float(cos) > 1 - 1e-5
        if ours_rule == "paper" and theirs_rule == "code ρ=0.5":
            assert float(k_ours) > float(k_theirs)
    diffuse = [r for r in rows if r[0] == "256" and r[2] == "diffuse" and r[4] == "paper / code ρ=1"]
    assert float(diffuse[0][3]) > 64 and float(diffuse[0][6]) == 64 and float(diffuse[0][-1]) < 0.99  # k_max binds
    scope = table_rows(out, "1b. scope")
    assert [r[:4] for r in scope] == [[m, "8", f, "16"] for m in ("32", "256") for f in ("low-rank", "diffuse")]
    assert "## 2. distributed_gram: not checked" in out


def test_salt_reference_compares_the_proxies_of_a_tiny_lm(tmp_path, monkeypatch, capsys):
    argv = ["--seeds", "1", "--sizes", "16", "--groups", "8", "--dim", "32", "--micro", "--real", "1"]
    argv += ["--sft-steps", "1", "--prompts", "2", "--samples", "4"]
    assert run_salt_reference(tmp_path, monkeypatch, argv) == 0
    (row,) = table_rows(capsys.readouterr().out, "3. the demo's tiny LM")
    assert float(row[3]) < 1e-5  # the code's proxy is −T_i times Eq. 19's, response by response


def _edge_tables(out):
    """{title: its table's rows} of part 4's "### title" sections."""
    sections = {part.split(":")[0]: part for part in out.split("\n### ")[1:]}
    return {title: table_rows("## " + sections[title], "") for title in ("scale", "zero features", "ties")}


def test_salt_reference_edge_cases_print_ours_scale_free_identity_at_zero_and_tie_conventions(
    tmp_path, monkeypatch, capsys
):
    """On the stand-in (no ε, float64): ours is scale-free (k 4 at every c), returns a unchanged with k = 0 for F = 0,
    and takes each rule's tie convention at PR = 4.5 (code 4, paper 5)."""
    assert run_salt_reference(tmp_path, monkeypatch, ["--edge-cases", "--seeds", "2", "--tie-draws", "8"]) == 0
    out = capsys.readouterr().out
    tables = _edge_tables(out)
    assert [row[0] for row in tables["scale"]] == ["1", "0.01", "0.001", "0.0001", "1e-06"]
    assert all(row[2] == "4.0000" and row[4] == "4.0" for row in tables["scale"])
    assert [row[1:6] for row in tables["zero features"]] == [["0", "1", "1", "1", "True"]] * 2
    assert tables["ties"][:2] == [["ours (code)", "8", "0"], ["ours (paper)", "0", "8"]]
    assert "## 1. synthetic" not in out


@pytest.mark.skipif(not os.environ.get("OPENRLHF_GEO_SALT_REPO"), reason="set OPENRLHF_GEO_SALT_REPO to a checkout "
                    "of Chang-pw/SALT at 94ac08e")  # fmt: skip
def test_salt_reference_edge_cases_against_the_released_code(monkeypatch, capsys):
    """docs/usage.md's numbers: the code's ε collapses PR at c <= 1e-3 (k 1 against 4), takes k = 1 and α = 1 on an
    eigenvector of the zero Gram, and rounds exact ties of ρ·PR by float32's last bit."""
    spec = importlib.util.spec_from_file_location("salt_reference", ROOT / "benchmarks" / "salt_reference.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec.loader.exec_module(module)
    argv = ["--salt-repo", os.environ["OPENRLHF_GEO_SALT_REPO"], "--edge-cases", "--seeds", "3", "--tie-draws", "200"]
    assert module.main(argv) == 0
    tables = _edge_tables(capsys.readouterr().out)
    k = {row[0]: (row[4], row[5]) for row in tables["scale"]}
    assert k["1"] == k["0.01"] == ("4.0", "4.0") and k["0.001"] == k["0.0001"] == k["1e-06"] == ("4.0", "1.0")
    assert [row[1:6] for row in tables["zero features"]] == [["0", "1", "1", "1", "True"]] * 3
    assert all(int(row[7]) == 64 for row in tables["zero features"])
    ties = {row[0]: (int(row[1]), int(row[2])) for row in tables["ties"]}
    assert ties["ours (code)"] == (200, 0) and ties["ours (paper)"] == (0, 200) and 0 < ties["theirs"][1] < 200


def test_salt_reference_refuses_a_folder_without_the_code(tmp_path):
    spec = importlib.util.spec_from_file_location("salt_reference", ROOT / "benchmarks" / "salt_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit, match="advantage_decomposition.py not found: --salt-repo must be a checkout"):
        module.main(["--salt-repo", str(tmp_path)])


SCALE = ROOT / "benchmarks" / "salt_scale.py"


@pytest.fixture
def scale(monkeypatch):
    """benchmarks/salt_scale.py as a module; its main() sets torch's thread count, restored after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the repository and benchmarks/
    spec = importlib.util.spec_from_file_location("salt_scale", SCALE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


def test_salt_scale_tiny_run_measures_what_fits_and_projects_the_rest(scale, tmp_path, capsys):
    """benchmarks/salt_scale.py at a tiny size, cases in this process: every field of its JSON, the case over
    --max-gib projected by the fit, the papers' rows from SALT Table 11. Nothing here times anything."""
    out, dim = tmp_path / "scale.json", 1024
    budget = scale.predicted_peak(32, 2, dim) - 1  # every case but m = 32, P = 2 fits
    argv = ["--sizes", "16", "32", "--partitions", "1", "2", "--dim", str(dim), "--reps", "1", "--inline"]
    scale.main([*argv, "--max-gib", str(budget / scale.GIB), "--out", str(out)])
    assert "[7] measured" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["measured"]) == {"16x1", "16x2", "32x1"} and set(result["gram_only"]) == {"16", "32"}
    for cell in result["measured"].values():
        assert cell["k"] and min(cell["total"]) >= min(cell["gram"]) + min(cell["solve"]) >= 0
    fit = result["fit"]
    for key, cell in result["grid"].items():
        m, p = map(int, key.split("x"))
        assert cell["bytes"] == m * p * dim * 4 and cell["measured"] == (key != "32x2")
    projected = p * (fit["gram_per_m2D"] * 32 * 32 * dim + fit["solve_per_m3"] * 32**3 + fit["rest_per_mD"] * 32 * dim)
    assert result["grid"]["32x2"]["seconds"] == pytest.approx(projected)
    papers = result["papers"]
    assert len(papers) == 2 * len(scale.PAPER_SETTINGS) and {row["gpus"] for row in papers} == {8, 64}
    first = papers[0]  # SALT Table 4 (64 x 8 rollouts, mini-batch 32 x 8), Table 11's GRPO 07:21 over 234 steps
    assert (first["rollouts"], first["m"], first["partitions"]) == (512, 256, 2)
    assert first["step_s"] == pytest.approx(441 * 60 / 234) and papers[1]["step_s"] == pytest.approx(
        first["step_s"] / 8
    )
    for row in papers:
        assert row["driver_share"] == pytest.approx(row["driver_s"] / row["step_s"])
        assert row["bytes"] == row["rollouts"] * dim * 4
        # the Gram on the ranks: the driver's work is part of the step's path through ranks and driver
        assert 0 < row["ranks_driver_s"] < row["ranks_s"]
        assert row["ranks_driver_share"] == pytest.approx(row["ranks_driver_s"] / row["step_s"])
    assert set(result["driver_from_gram"]) == {"16", "32"}
    assert all(cell.keys() == {"seconds", "with_eigh", "k"} for cell in result["driver_from_gram"].values())


def test_salt_scale_child_reports_its_case_and_peak(scale, capsys):
    """The per-case process's entry point (what the parent runs with --child): one JSON line with the peak RSS."""
    scale.main(["--child", "16", "2", "0", "--dim", "1024", "--threads", "1"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("RESULT "))
    assert len(result["k"]) == 2 and result["peak_bytes"] >= 0 and result["total"] >= result["gram"]


def load_cost_script(monkeypatch, name):
    """benchmarks/<name>.py as a module, with glibc's allocation settings left alone (its memory pass changes them
    for the rest of the process)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends benchmarks/
    for loaded in ("salt_reference_advantage_decomposition", "salt_reference_proxy"):
        monkeypatch.setitem(sys.modules, loaded, None)  # removed again afterwards
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "exact_rss_peaks", lambda: None)
    return module


def salt_cost_rows(module, repo, capsys):
    """Qwen's shape shrunk to V = 500, d = 16: every case of m = 4 and 8 measured, its table rows returned."""
    module.SHAPES["qwen"] = (500, 16)
    argv = ["--salt-repo", str(repo), "--shapes", "qwen", "--sizes", "4", "8", "--micro", "4", "--tokens", "4"]
    assert module.main([*argv, "--reps", "1", "--threads", "1", "--budget-gib", "1"]) == 0
    return table_rows(capsys.readouterr().out, "qwen")


def test_salt_peer_cost_measures_both_sides_at_each_scope_on_a_stand_in_checkout(tmp_path, monkeypatch, capsys):
    gradient = tmp_path / "SALT" / "verl" / "verl" / "trainer" / "gradient"
    gradient.mkdir(parents=True)
    (gradient / "advantage_decomposition.py").write_text(STAND_IN_DECOMPOSITION)
    (gradient / "proxy.py").write_text(STAND_IN_PROXY)
    module = load_cost_script(monkeypatch, "salt_peer_cost")
    rows = salt_cost_rows(module, tmp_path / "SALT", capsys)
    cases = [(m, case) for m, case, *_ in rows]
    ours, micro, mini = "ours, one mini-batch", "theirs, one micro-batch", "theirs, one mini-batch"
    assert cases == [("4", ours), ("4", micro), ("8", ours), ("8", micro), ("8", mini)]
    for m, case, seconds, per_response, peak, k, ratio, share in rows:
        best = float(seconds.split()[0])  # printed to 3 decimals, the time per response from the unrounded
        assert best > 0 and float(per_response) == pytest.approx(1000 * best / int(m), abs=0.5 / int(m) + 0.006)
        assert 1 <= int(k) <= int(m) and float(peak.split()[0]) >= 0
        assert (ratio == "" and share == "") if case == ours else float(ratio.split("x")[0]) > 0


def test_salt_peer_cost_says_what_does_not_fit_and_what_it_would_need(tmp_path, monkeypatch, capsys):
    module = load_cost_script(monkeypatch, "salt_peer_cost")
    need = module.predicted_theirs(8, 8, 4, 500, 16)
    assert need == (2 * 8 + 1) * 500 * 16 * 4 + 4 * 8 * 4 * 500 * 4  # rows, their stack and a sum; 4 x the logits
    assert 447 < module.predicted_theirs(256, 16, 32, 151936, 1536) / module.GIB < 448  # Qwen's shape at m = 256
    module.SHAPES["qwen"] = (500, 16)
    gradient = tmp_path / "SALT" / "verl" / "verl" / "trainer" / "gradient"
    gradient.mkdir(parents=True)
    (gradient / "advantage_decomposition.py").write_text(STAND_IN_DECOMPOSITION)
    (gradient / "proxy.py").write_text(STAND_IN_PROXY)
    budget = (
        module.predicted_ours(8, 4, 4, 500) + 1
    ) / module.GIB  # ours fits at m = 8, theirs in one micro-batch not
    assert module.predicted_theirs(8, 8, 4, 500, 16) <= budget * module.GIB  # (the tiny shape: theirs is smaller)
    argv = ["--salt-repo", str(tmp_path / "SALT"), "--shapes", "qwen", "--sizes", "8", "--micro", "4", "--tokens", "4"]
    assert module.main([*argv, "--reps", "1", "--threads", "1", "--budget-gib", "1e-9"]) == 0
    rows = table_rows(capsys.readouterr().out, "qwen")
    assert [row[2].split(":")[0] for row in rows] == ["does not fit"] * 3
    assert rows[1][2] == f"does not fit: needs ~{module.fmt_gib(need)} GiB > 1e-09"


@pytest.mark.skipif(not os.environ.get("OPENRLHF_GEO_SALT_REPO"), reason="set OPENRLHF_GEO_SALT_REPO to a checkout "
                    "of Chang-pw/SALT at 94ac08e")  # fmt: skip
def test_salt_peer_cost_runs_the_released_code(monkeypatch, capsys):
    module = load_cost_script(monkeypatch, "salt_peer_cost")
    rows = salt_cost_rows(module, os.environ["OPENRLHF_GEO_SALT_REPO"], capsys)
    assert len(rows) == 5 and all(float(row[2].split()[0]) > 0 for row in rows)


@pytest.mark.skipif(not os.environ.get("OPENRLHF_GEO_GEOALIGN_REPO"), reason="set OPENRLHF_GEO_GEOALIGN_REPO to a "
                    "checkout of SYSUzhouting/Trinity-RFT at 9cecab1")  # fmt: skip
def test_geoalign_reference_runs_their_filter_and_curate_on_one_batch(monkeypatch, capsys):
    before = set(sys.modules)
    try:
        module = load_cost_script(monkeypatch, "geoalign_reference")
        argv = ["--batches", "synthetic", "--prompts", "16", "--group", "8", "--dim", "64", "--reps", "1"]
        assert module.main([*argv, "--threads", "1"]) == 0
    finally:
        for name in set(sys.modules) - before:  # the Trinity and sklearn stand-ins, their filter
            del sys.modules[name]
    rows = table_rows(capsys.readouterr().out, "side by side")
    assert [row[:2] for row in rows] == [["synthetic 16x8, d=64", "theirs"], ["synthetic 16x8, d=64", "ours"]]
    theirs, ours = rows
    assert float(theirs[3]) <= float(theirs[2].split()[0]) and "replaced" in theirs[5] and "flagged" in ours[5]
    assert float(theirs[6].split("x")[0]) > 0
