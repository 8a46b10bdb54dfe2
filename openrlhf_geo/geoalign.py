"""GeoAlign: geometric rollout curation (arXiv 2606.26917).

Pipeline per rollout batch (N rollouts, hidden states (N, d), rewards (N,), prompt ids (N,)):
pairs (Eq. 3) -> online projector on unit displacements (Eq. 4) -> prototype (Eq. 5) -> deviation (Eq. 6)
-> GDI per rollout (Eq. 7) -> KDE threshold on the high tail -> rectification plan (Best-Random, Eq. 8).
"""

from dataclasses import dataclass, replace

PRESETS = {
    # GeoAlign §4: binary verified rewards (math) vs a learned reward model (RLHF).
    "math": {"alpha": 0.05, "val_acc": 0.95},
    "rlhf": {"alpha": 0.12, "val_acc": 0.85},
}
MODES = ("replace", "zero", "drop", "amplify")
GDI_KINDS = ("cumulative", "mean")
PROTOTYPES = ("margin", "plain")


@dataclass
class GeoAlignConfig:
    """All GeoAlign knobs; `GeoAlignConfig.preset("math" | "rlhf", **overrides)` gives the paper's defaults."""

    alpha: float = 0.05  # KDE density threshold factor: flag where density < alpha * peak, right of the mode
    mode: str = "replace"  # replace (Best-Random, Eq. 8) | zero (weight 0) | drop | amplify (Anomaly-Amplify)
    gdi: str = "cumulative"  # cumulative (Eq. 7) | mean
    prototype: str = "margin"  # margin-weighted (Eq. 5) | plain mean
    max_flag_frac: float = 0.2  # cap on the flagged fraction of the batch
    min_scores: int = 100  # fewer GDI scores than this -> flag nothing
    max_pairs_per_side: int = 0  # >0: per prompt only the top-m winners x bottom-m losers form pairs
    # projector M_psi (3-layer ReLU MLP by default) + a temporary linear probe, trained per step
    hidden_sizes: tuple = (512, 512)
    out_dim: int = 128
    steps: int = 50
    lr: float = 1e-3
    val_acc: float = 0.95  # early stop once validation accuracy >= this
    val_frac: float = 0.2  # fraction of prompts held out for validation
    warm_start: bool = True  # keep the projector across steps
    device: str = "cpu"

    @classmethod
    def preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown GeoAlign preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(cls(**PRESETS[name]), **overrides)
