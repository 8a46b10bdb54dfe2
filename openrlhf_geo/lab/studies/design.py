"""What a condition study runs and what its summary is computed from: `Condition`, `Design`, `Result` (plain data,
read by `runner`; the study types are in `base`)."""

from dataclasses import dataclass, field
from pathlib import Path

from openrlhf_geo.lab.studies.common import FINAL, SALT_METRICS

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
