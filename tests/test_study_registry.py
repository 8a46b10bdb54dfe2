"""The study registry (`local.studies`): a toy condition study registered in a module of its own runs through the
runner and the command line like the shipped ones (plan, runs, resume, summary.json, report.md, plots), and an
incomplete study or a clashing registration fails when its module is loaded, never silently."""

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

from openrlhf_geo import cli
from openrlhf_geo.lab import recipe, studies
from openrlhf_geo.lab.studies import runner
from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import FINAL, GRPO_DIAG

TOY = """
from openrlhf_geo.lab.studies.base import Condition, ConditionStudy, Design
from openrlhf_geo.lab.studies.common import FINAL, GRPO_DIAG, fmt, mean_of


class Toy(ConditionStudy):
    name, section = "toy", "toy"

    def design(self):
        conditions = (Condition("cold", GRPO_DIAG, rollout={"--rollout.temperature": 0.6}, facts={"t": 0.6}),
                      Condition("hot", GRPO_DIAG, rollout={"--rollout.temperature": 1.3}, facts={"t": 1.3}))
        return Design("toy", "A toy study", conditions, (("hot", "cold"),), (0, 1), 4, 2, quick=("cold", "hot"))

    def summarize(self, result):
        return {c.name: {"t": c.facts["t"], "acc": mean_of(result.table, c.name, FINAL)}
                for c in result.design.conditions if c.name in result.table}

    def render(self, section):
        return ["", "## Toy", *(f"- {name} at T = {v['t']}: {fmt(v['acc'])}" for name, v in section.items())]


STUDY = Toy()
"""


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """Load a study module from `source` as studies.MODULES' modules are loaded; unregistered afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(module, source):
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        monkeypatch.delitem(sys.modules, module, raising=False)
        return studies.load(module)

    before = dict(studies.REGISTRY)
    yield load
    studies.REGISTRY.clear()
    studies.REGISTRY.update(before)


def fake_runs(jobs, workers, steps):
    """recipe.run_all's stand-in: each run's metrics.jsonl, accuracy rising with the seed and the temperature."""
    for job in jobs:
        run = Path(job["out"])
        run.mkdir(parents=True, exist_ok=True)
        t = 1.0 if job["condition"] == "hot" else 0.5
        rows = [{"step": s, "eval/accuracy": 0.1 * t * (s + job["seed"]), "accuracy": 0.5} for s in range(steps + 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_toy_study_is_one_module_and_runs_through_the_runner_and_the_command_line(registered, tmp_path, monkeypatch):
    toy = registered("toy_study", TOY)
    assert studies.REGISTRY["toy"] is toy
    out = tmp_path / "out"
    monkeypatch.setattr(runner, "prepare_settings", lambda out, jobs, steps: {})
    monkeypatch.setattr(recipe, "run_all", fake_runs)
    assert cli.main(["study", "toy", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["study"] == "toy" and summary["setup"]["runs"] == 4 and summary["setup"]["skipped"] == 0
    # the seeds' final accuracies: 0.1 * t * (4 + seed), paired hot - cold = 0.05 * (4 + seed)
    assert summary["toy"] == {
        "cold": {"t": 0.6, "acc": pytest.approx(0.225)},
        "hot": {"t": 1.3, "acc": pytest.approx(0.45)},
    }
    gain = next(r for r in summary["comparisons"] if r["method"] == "hot" and r["metric"] == FINAL)
    assert gain["baseline"] == "cold" and gain["gain"] == pytest.approx(0.225)
    assert summary["setup"]["commands"]["hot"] == "--rollout.temperature 1.3 " + " ".join(GRPO_DIAG)
    report = (out / "report.md").read_text()
    assert "# openrlhf-geo study toy: A toy study" in report and "- hot at T = 1.3: 0.450" in report
    assert summary["plots"] == ["eval_accuracy.png"] and (out / "eval_accuracy.png").stat().st_size > 0

    def refuse(jobs, workers, steps):
        raise AssertionError(f"reran {len(jobs)} finished runs")

    monkeypatch.setattr(recipe, "run_all", refuse)  # the same command again: every run is finished
    assert cli.main(["study", "toy", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["setup"]["skipped"] == 4
    assert runner.render(json.loads((out / "summary.json").read_text())) == (out / "report.md").read_text()


def test_the_toy_study_takes_no_regime_and_its_plan_is_its_conditions(registered, tmp_path, capsys):
    registered("toy_study", TOY)
    assert cli.main(["study", "toy", "--regime", "t06", "--out", str(tmp_path / "o")]) == 2
    assert "--regime only applies to salt-scaling (got study toy)" in capsys.readouterr().err
    jobs = runner.plan(studies.REGISTRY["toy"].design(), tmp_path)
    assert [(j["condition"], j["seed"]) for j in jobs] == [("cold", 0), ("cold", 1), ("hot", 0), ("hot", 1)]


@pytest.mark.parametrize(
    "source, message",
    [
        (TOY.replace("    def render(self, section):", "    def rendered(self, section):"), "render"),
        (TOY.replace('name, section = "toy", "toy"', 'section = "toy"'), "has no name"),
        (TOY.replace('name, section = "toy", "toy"', 'name, section = "toy", "table"'), "section must be a key"),
        (TOY.replace('name, section = "toy", "toy"', 'name, section = "regime", "toy"'), "registered twice"),
        (TOY.replace('name, section = "toy", "toy"', 'name, section = "toy", "scaling"'), "section must be a key"),
        (TOY.replace("class Toy(ConditionStudy):", "class Toy:"), "is not a complete Study"),
        ("X = 1\n", "defines no STUDY"),
    ],
)
def test_an_incomplete_or_clashing_study_fails_when_its_module_is_loaded(registered, source, message):
    with pytest.raises(TypeError, match=message):
        registered("broken_study", source)
    assert len(studies.REGISTRY) == len(studies.MODULES) and "toy" not in studies.REGISTRY


def test_an_unregistered_study_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="no condition study 'nope' is registered .*salt-scaling"):
        runner.registered("nope")
    with pytest.raises(ValueError, match="no condition study 'salt-proxy'"):
        runner.registered("salt-proxy")  # registered, but it has its own runner


def test_every_shipped_study_is_registered_from_its_own_module():
    assert list(studies.REGISTRY) == [
        "salt-scaling", "regime", "learnable-regime", "salt-ablations", "geoalign-failure", "salt-proxy",
        "long-cot", "real-lm-geometry", "real-lm-geoalign", "real-lm-proxy", "real-lm-rl"]  # fmt: skip
    for module, study in zip(studies.MODULES, studies.REGISTRY.values()):
        assert type(study).__module__ == f"openrlhf_geo.lab.studies.{module}"
    designs = {n: s.design() for n, s in studies.REGISTRY.items() if isinstance(s, ConditionStudy)}
    for name, design in designs.items():
        assert isinstance(design, Design) and design.name == name
        assert all(isinstance(c, Condition) for c in design.conditions)


def test_the_recipe_in_the_architecture_doc_is_a_complete_study(registered, tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    recipe = doc.split("## 8. How to add a study")[1].split("```python\n")[1].split("```")[0]
    study = registered("my_study", recipe)
    assert studies.REGISTRY["my-study"] is study and isinstance(study, ConditionStudy)
    jobs = runner.plan(study.design(), tmp_path, quick=True)
    assert [j["condition"] for j in jobs] == ["grpo", "salt"] and all(j["seed"] == 2025 for j in jobs)
