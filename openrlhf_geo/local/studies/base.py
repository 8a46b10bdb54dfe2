"""The study types. `Study`: a registered `openrlhf-geo study NAME` (protocol: docs/studies/NAME.md) that runs in its
claimed --out. `ConditionStudy`: a study that is a list of train conditions (`design`), which `runner` plans, runs,
resumes, estimates and tabulates; the study adds its own section of summary.json (`summarize`), of report.md
(`render`) and its plots."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from openrlhf_geo.local.studies.common import FINAL, SALT_METRICS

# the keys every condition study's summary has; a study's own section takes another
SUMMARY_KEYS = ("study", "title", "setup", "notes", "shown", "table", "comparisons", "stopped", "plots")


@dataclass(frozen=True)
class Condition:
    """One configuration: method `flags` on the demo's common flags in `setting`, with `rollout` changes.

    `facts`: what the condition is for its study's summary (e.g. {"G": 16, "backbone": "grpo", "salt": True}), so
    that a summary reads them here instead of parsing the name.
    """

    name: str
    flags: tuple
    setting: str = "demo"
    rollout: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Design:
    """What a condition study runs: its conditions, the (condition, baseline) pairs compared seed by seed, seeds and
    RL steps, the conditions a --quick smoke run takes, the curves summarised over the last 20 % of steps (SALT
    Table 10's window) and the paired differences report.md shows (summary.json holds them for every scalar)."""

    name: str
    title: str
    conditions: tuple
    comparisons: tuple
    seeds: tuple
    steps: int
    eval_steps: int
    quick: tuple
    metrics: tuple = SALT_METRICS
    shown: tuple = (FINAL, "last20%/accuracy", "last20%/salt/pr", "last20%/salt/n_eff_out", "last20%/salt/D_a")


@dataclass(frozen=True)
class Result:
    """What a study's summary is computed from: the planned runs that finished ({condition: {seed: Run}}, with
    FINAL and the window scalars), their table (`runner.condition_table`), the paired comparisons, the output
    directory and the last step any run reached."""

    design: Design
    out: Path
    runs: dict
    table: dict
    comparisons: list
    steps: int


class Study(ABC):
    """A registered study: `name` (the command's NAME) and `run`. `options`: the study-specific options of the
    command line it takes (attributes of the parsed args, e.g. "regime"); any other is refused before --out is
    claimed."""

    name: ClassVar[str]
    options: ClassVar[tuple] = ()

    def check(self, **options):
        """Refuse bad option values before --out is claimed (ValueError naming the option)."""
        return None

    @abstractmethod
    def run(self, args, out, workers):
        """The study in its claimed `out` (the options checked) -> exit status."""


class ConditionStudy(Study):
    """A study of train conditions: `design`, and its summary section (`section` is its key), report and plots."""

    section: ClassVar[str]

    @abstractmethod
    def design(self, **options) -> Design:
        """The conditions the study runs (ValueError for bad options)."""

    @abstractmethod
    def summarize(self, result: Result) -> dict:
        """The study's section of summary.json."""

    @abstractmethod
    def render(self, section) -> list:
        """The report's lines for the section (as read back from summary.json)."""

    def plots(self, summary, result: Result) -> list:
        """The study's own figures, written to `result.out` -> their file names."""
        return []

    def curve_groups(self, result: Result) -> dict:
        """{file-name suffix: conditions} of the held-out accuracy curves, in groups a plot can hold."""
        return {"": list(result.runs)} if len(result.runs) <= 8 else {}

    def check(self, **options):
        self.design(**options)

    def run(self, args, out, workers):
        from openrlhf_geo.local.studies import runner

        options = {key: getattr(args, key) for key in self.options if getattr(args, key) is not None}
        return runner.run(self.design(**options), args, out, workers)
