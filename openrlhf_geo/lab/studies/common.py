"""What several studies share: the settings (SFT warm-up + data) and regimes they run in, the method flags, SALT
Table 10, the metric names, and the helpers their summaries, reports and plots use."""

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from openrlhf_geo.eval.report import final_name
from openrlhf_geo.lab import recipe

FINAL = "final/eval/accuracy"  # held-out accuracy at the last step (the demo's headline number)
TABLE10_WINDOW = ("last-frac", 0.2)  # SALT Table 10 averages the last 20 % of checkpoints
SEEDS = (2025, 2026, 2027, 2028, 2029)

# SALT Table 10 (App. F.5; DeepSeek-R1-Distill-Qwen-7B / MATH-TRAIN, last 20 % of checkpoints, 5 seeds): mean, sd
PAPER_TABLE10 = {
    "grpo": {"n_eff": (0.31, 0.05), "acc": 66.9},
    "grpo_salt": {"D_a": (0.24, 0.04), "D_g": (0.16, 0.03), "n_eff": (0.80, 0.04), "U_perp_gain": 1.47, "acc": 69.7},
    "dapo": {"n_eff": (0.82, 0.03), "acc": 65.8},
    "dapo_salt": {"D_a": (0.17, 0.03), "D_g": (0.11, 0.02), "n_eff": (1.00, 0.03), "U_perp_gain": 1.24, "acc": 68.2},
}
# the curves a SALT study summarises over Table 10's window: SALT's geometry and the run's basics
SALT_METRICS = ("salt/pr", "salt/k", "salt/n_eff_in", "salt/n_eff_out", "salt/alpha", "salt/D_a", "salt/D_g",
                "salt/U_perp_gain", "salt/sign_flip", "salt/kept", "clip_frac", "response_length",
                "accuracy")  # fmt: skip

GRPO_DIAG = tuple(recipe.METHOD_FLAGS["grpo"])  # GRPO logging SALT's geometry of its own advantages (exact features)
SALT = tuple(recipe.METHOD_FLAGS["salt"])


def window(key):
    """The scalar name of `key`'s mean over SALT Table 10's window (the last 20 % of steps): last20%/<key>."""
    return final_name(key, TABLE10_WINDOW)


# ---------------------------------------------------------------- where the studies run


@dataclass(frozen=True)
class Setting:
    """An SFT warm-up and its data: the demo's (`recipe.SFT`, two-digit carry additions) with some SFT keys changed.

    `sft` overrides keys of SFT; `max_operand` > 99 makes the additions three-digit (it joins the SFT cache key).
    """

    name: str
    sft: dict = field(default_factory=dict)
    max_operand: int = 99
    sft_scale: int = 1  # SFT steps in multiples of the demo's (recipe.FULL["sft_max_steps"], the quick run's)
    cost: tuple = (1.0, 1.0)  # (RL, SFT step) time relative to the demo's model, for the estimate (`run_seconds`)

    def sft_config(self):
        extra = {"max_operand": self.max_operand} if self.max_operand != 99 else {}
        return {**recipe.SFT, **self.sft, **extra}


# One-factor-at-a-time departures from the demo. cost: measured 1-thread ratios to the demo's 2 x 64 model (SFT step
# of 128 sequences: 2.4x for width 128, 1.5x for depth 4; sampling 128 rollouts: 1.6x, 1.4x), RL taken in between.
SETTINGS = {
    "demo": Setting("demo"),
    "three_digit": Setting("three_digit", max_operand=999, cost=(1.1, 1.0)),
    "all_strategies": Setting("all_strategies", {"strategies": ["tens", "split_b", "split_a", "digits"]}),
    "width128": Setting("width128", {"hidden_size": 128}, cost=(2.0, 2.4)),
    "depth4": Setting("depth4", {"num_layers": 4}, cost=(1.5, 1.5)),
    # learnable-regime's candidates (docs/studies/learnable-regime.md); their RL cost 1.1 is three_digit's, assumed
    "operands199": Setting("operands199", max_operand=199, cost=(1.1, 1.0)),
    "operands499": Setting("operands499", max_operand=499, cost=(1.1, 1.0)),
    "no_shortcut": Setting("no_shortcut", {"shortcut_rate": 0.0}),
    "three_digit_sft4x": Setting("three_digit_sft4x", max_operand=999, sft_scale=4, cost=(1.1, 1.0)),
}


@dataclass(frozen=True)
class Regime:
    """Where salt-scaling runs: a setting plus rollout-flag changes (`varies_g`: the change is G, which it sweeps)."""

    setting: str = "demo"
    rollout: dict = field(default_factory=dict)
    varies_g: bool = False


BUDGET = 128  # rollouts per step (the demo's 8 prompts x G = 16), fixed while G varies
LEARNABLE = ("operands199", "operands499", "no_shortcut", "three_digit_sft4x")  # learnable-regime's candidates
REGIMES = {
    "demo": Regime(),
    "g4": Regime(rollout={"--rollout.batch_size": 32, "--rollout.n_samples_per_prompt": 4}, varies_g=True),
    "g64": Regime(rollout={"--rollout.batch_size": 2, "--rollout.n_samples_per_prompt": 64}, varies_g=True),
    "t06": Regime(rollout={"--rollout.temperature": 0.6}),  # SALT Table 4's rollout temperature
    "t13": Regime(rollout={"--rollout.temperature": 1.3}),
    "three_digit": Regime("three_digit"),
    "all_strategies": Regime("all_strategies"),
    "width128": Regime("width128"),
    "depth4": Regime("depth4"),
    **{name: Regime(name) for name in LEARNABLE},
}

# ---------------------------------------------------------------- summaries, reports, plots


def describe(values):
    values = np.asarray(values, dtype=float)
    return {
        "mean": float(values.mean()) if values.size else math.nan,
        "sd": float(values.std(ddof=1)) if values.size > 1 else math.nan,
        "n": int(values.size),
    }


def mean_of(table, condition, scalar):
    """The mean over seeds of `scalar` for `condition` in a `runner.condition_table` (NaN when absent)."""
    return table.get(condition, {}).get(scalar, {}).get("mean", math.nan)


def fmt(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fmt_ci(row):
    """A paired difference with its 95 % CI (an `eval.report.compare` row, or None)."""
    if row is None:
        return "n/a"
    if row["n"] < 2 or row["low"] is None or not math.isfinite(row["low"]):
        return f"{row['gain']:+.3f} ({row['n']} seed, no CI)"
    return f"{row['gain']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def figure(*shape, size=(6, 4)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(*shape, figsize=size)


def save(plt, fig, out, name):
    fig.tight_layout()
    fig.savefig(Path(out) / name, dpi=100)
    plt.close(fig)
    return name
