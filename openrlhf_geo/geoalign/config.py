"""GeoAlign's settings: GeoAlignConfig (the --geoalign.* flags, validated on construction), the paper's presets
(§5.1 "Implementation", App. C.1) and the choices of the anomaly rule (§4.4), rectification (Eq. 8, App. C.5, §5.4),
GDI aggregation (Eq. 7), prototype (Eq. 5) and projector (Eq. 4, §4.2)."""

import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from openrlhf_geo.config_flags import setting

PRESETS: dict[str, dict[str, Any]] = {
    # alpha: §5.1 "Implementation" (0.05 on Math, 0.12 on HH-RLHF; App. C.2 sensitivity);
    # val_acc: App. C.1 early stop "once validation accuracy surpasses ... 95% for Math and 85% for HH-RLHF".
    "math": {"alpha": 0.05, "val_acc": 0.95},
    "rlhf": {"alpha": 0.12, "val_acc": 0.85},
}
RULES = ("pointwise", "threshold")
MODES = ("replace", "zero", "drop", "amplify")
GDI_KINDS = ("cumulative", "mean")
PROTOTYPES = ("margin", "plain")
# field metadata of the settings of --geoalign.projector.<field>; every other field is --geoalign.<field>
PROJECTOR = {"group": "projector"}


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class GeoAlignConfig:
    """All GeoAlign knobs, validated on construction (ValueError naming the flag); frozen, so `dataclasses.replace`
    (which validates again) is the way to change one. `GeoAlignConfig.preset("math" | "rlhf", **overrides)` gives
    the paper's per-task values; the field defaults are the "math" preset."""

    FLAG_PREFIX = "geoalign"

    alpha: float = setting(  # §4.4 (a fraction in (0, 1))
        0.05, "flag rollouts whose GDI density < alpha * peak on the high tail"
    )
    rule: str = setting(  # see kde_flags
        "pointwise",
        "anomaly rule: pointwise = the paper's (§4.4: GDI right of the mode and its own density < alpha * peak) or "
        "threshold = the released code's (every score past the first crossing right of the mode)",
        choices=RULES,
    )
    mode: str = setting(
        "replace",
        "rectification: replace (Best-Random, Eq. 8), zero, drop (App. C.5) or amplify (Anomaly-Amplify, §5.4)",
        choices=MODES,
    )
    gdi: str = setting(
        "cumulative", "GDI aggregation: cumulative (Eq. 7) or mean (§5.4's ablation)", choices=GDI_KINDS
    )
    prototype: str = setting(
        "margin", "margin-weighted prototype (Eq. 5) or plain mean (the reference code)", choices=PROTOTYPES
    )
    # Opt-in gates from the reference code, not in the paper (None or 0 = off; the reference code uses 0.2 and 100):
    max_flag_frac: float | None = setting(
        None,
        "opt-in cap on the flagged fraction of the scored rollouts, highest GDI first (not in the paper; the "
        "reference code uses 0.2)",
        type=float,
    )
    min_scores: int | None = setting(
        None,
        "opt-in: fewer GDI scores -> flag nothing (not in the paper; the reference code uses 100)",
        type=int,
    )
    max_pairs_per_side: int = setting(  # §4.5
        0, "per prompt pair only the top-m winners with the bottom-m losers; 0 = all pairs"
    )
    # Projector M_psi and its temporary linear probe, trained on every call (§4.2 "Implementation", App. C.1).
    # The paper gives "3-layer MLP with ReLU", 50 steps, cosine LR from 1e-3; the widths are ours (Table 6 is lost).
    hidden_sizes: tuple = setting(
        (512, 512), "hidden widths of the projector MLP", metadata=PROJECTOR, type=int, nargs="+"
    )
    out_dim: int = setting(128, "projector output width", metadata=PROJECTOR)
    steps: int = setting(50, "projector Adam steps per batch", metadata=PROJECTOR)
    lr: float = setting(1e-3, "projector peak LR, cosine decay", metadata=PROJECTOR)
    pair_batch: int = setting(  # epoch-wise shuffled
        1024,
        "pairs per projector step (the released code's 1024); 0 = every pair of the batch",
        metadata=PROJECTOR,
    )
    val_acc: float = setting(  # App. C.1: stop once validation accuracy "surpasses" this (>=, as the reference code)
        0.95, "early-stop validation accuracy", metadata=PROJECTOR
    )
    val_frac: float = setting(  # reference code: 10 % of pairs
        0.1, "fraction of the paired prompts held out for validation", metadata=PROJECTOR
    )
    warm_start: bool = setting(  # Algorithm 1 initialises M_psi once (line 1)
        True,
        "re-initialise the projector every step instead of keeping it",
        metadata=PROJECTOR,
        flag="no_warm_start",
        action="store_const",
        const=False,
    )
    device: str = setting("cpu", "device of the projector", type=str)

    def __post_init__(self):
        if isinstance(self.hidden_sizes, list):
            object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        fraction = "a number in (0, 1)"
        checks = (
            ("alpha", _is_real(self.alpha) and 0 < self.alpha < 1, fraction),
            ("rule", self.rule in RULES, f"one of {RULES}"),
            ("mode", self.mode in MODES, f"one of {MODES}"),
            ("gdi", self.gdi in GDI_KINDS, f"one of {GDI_KINDS}"),
            ("prototype", self.prototype in PROTOTYPES, f"one of {PROTOTYPES}"),
            (
                "max_flag_frac",
                self.max_flag_frac is None or (_is_real(self.max_flag_frac) and 0 <= self.max_flag_frac <= 1),
                "a number in (0, 1], or 0 / None for no cap",
            ),
            (
                "min_scores",
                self.min_scores is None or (_is_int(self.min_scores) and self.min_scores >= 0),
                "an integer >= 0 (0 / None: no minimum)",
            ),
            (
                "max_pairs_per_side",
                _is_int(self.max_pairs_per_side) and self.max_pairs_per_side >= 0,
                "an integer >= 0",
            ),
            (
                "hidden_sizes",
                isinstance(self.hidden_sizes, tuple) and all(_is_int(w) and w >= 1 for w in self.hidden_sizes),
                "a tuple of integer widths >= 1",
            ),
            ("out_dim", _is_int(self.out_dim) and self.out_dim >= 1, "an integer >= 1"),
            ("steps", _is_int(self.steps) and self.steps >= 1, "an integer >= 1"),
            ("lr", _is_real(self.lr) and 0 < self.lr < math.inf, "a finite number > 0"),
            ("pair_batch", _is_int(self.pair_batch) and self.pair_batch >= 0, "an integer >= 0 (0: all pairs)"),
            ("val_acc", _is_real(self.val_acc) and 0 < self.val_acc <= 1, "a number in (0, 1]"),
            ("val_frac", _is_real(self.val_frac) and 0 < self.val_frac < 1, fraction),
            ("warm_start", isinstance(self.warm_start, bool), "True or False"),
            ("device", isinstance(self.device, str), "a torch device string such as cpu or cuda:0"),
        )
        groups = {f.name: f.metadata.get("group") for f in fields(self)}
        for name, ok, requirement in checks:
            if not ok:
                flag = ".".join(part for part in ("--geoalign", groups[name], name) if part)
                raise ValueError(f"{flag} must be {requirement} (got {getattr(self, name)!r})")
        try:
            torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"--geoalign.device must be a torch device string (got {self.device!r})") from error

    @classmethod
    def preset(cls, name, **overrides) -> "GeoAlignConfig":
        """The "math" or "rlhf" preset (PRESETS, §5.1 and App. C.1) with `overrides` applied and validated."""
        if name not in PRESETS:
            raise ValueError(f"unknown GeoAlign preset {name!r}; choose one of {sorted(PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown GeoAlign config field {unknown[0]!r}")
        return replace(cls(**PRESETS[name]), **overrides)
