"""The study types. `Study`: a registered `openrlhf-geo study NAME` (protocol: docs/studies/NAME.md) that runs in its
claimed --out. `ConditionStudy`: a study that is a list of train conditions (`design`), which `runner` plans, runs,
resumes, estimates and tabulates; the study adds its own section of summary.json (`summarize`), of report.md
(`render`) and its plots."""

from abc import ABC, abstractmethod
from typing import ClassVar

from openrlhf_geo.lab.studies.design import SUMMARY_KEYS, Condition, Design, Result

__all__ = ["SUMMARY_KEYS", "Condition", "ConditionStudy", "Design", "Result", "Study"]


class Study(ABC):
    """A registered study: `name` (the command's NAME) and `run`. `options`: the study-specific options of the
    command line it takes (attributes of the parsed args, e.g. "regime"); any other is refused before --out is
    claimed."""

    name: ClassVar[str]
    options: ClassVar[tuple] = ()
    # a study of one seed: its default; `--seeds` then takes one value, which its outputs (and so the command its --out
    # is claimed for) depend on. None: `--seeds` lists the seeds to run, and each run records its own command.
    seed: ClassVar[int | None] = None

    def check(self, **options):
        """Refuse bad option values before --out is claimed (ValueError naming the option)."""
        return None

    @abstractmethod
    def run(self, args, out, workers):
        """The study in its claimed `out` (the options checked; a study of one seed has `args.seeds == [seed]`) -> exit
        status."""


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
        from openrlhf_geo.lab.studies import runner

        options = {key: getattr(args, key) for key in self.options if getattr(args, key) is not None}
        return runner.run(self.design(**options), args, out, workers)
