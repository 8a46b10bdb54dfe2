"""GeoAlign: geometric rollout curation (arXiv 2606.26917).

Pipeline per rollout batch (N rollouts, hidden states (N, d), rewards (N,), prompt ids (N,)):
pairs (Eq. 3) -> online projector on unit displacements (Eq. 4) -> prototype (Eq. 5) -> deviation (Eq. 6)
-> GDI per rollout (Eq. 7) -> KDE anomaly rule (§4.4, Algorithm 1 line 24) -> rectification plan (Best-Random, Eq. 8).

config  GeoAlignConfig (the --geoalign.* flags), PRESETS, the choices of rule, mode, GDI and prototype
pairs   Eq. 3 preference pairs and their distances; Eq. 4 the projector M_psi and its training (fit_projector)
scores  Eq. 5-7 prototype, deviation, GDI; §4.4 the KDE anomaly rule (kde_flags); detection_auroc
plan    Eq. 8 best_random_probs and rectify; curate (the whole batch); GeoAlignState; the registered curation

`curate` runs the whole pipeline and returns `(CurationPlan, stats)`; each step is also a public function of
tensors so tests and experiments can check it against a brute-force computation. Randomness (projector and
probe initialisation, the validation split, pair mini-batches, tie-breaks, replacement draws) comes from one CPU
`torch.Generator`. "The reference code" below is the authors' released implementation linked from §1 of the paper;
the paper's Table 6 (hyperparameters) survives only as a caption, so no value attributed to it can be checked.

Importing this package imports `plan`, which registers GeoAlign as the "geoalign" curation (registry.CURATIONS).
`curate`'s steps are looked up in plan's namespace: to replace one in a test, patch `openrlhf_geo.geoalign.plan`.
"""

from openrlhf_geo.geoalign.config import GDI_KINDS, MODES, PRESETS, PROJECTOR, PROTOTYPES, RULES, GeoAlignConfig
from openrlhf_geo.geoalign.pairs import Projector, fit_projector, orientation_loss, pair_distances, preference_pairs
from openrlhf_geo.geoalign.plan import SKIP_REASONS, GeoAlignState, best_random_probs, curate, rectify
from openrlhf_geo.geoalign.scores import detection_auroc, deviation, gdi, kde_flags, kde_tail_threshold, prototype

__all__ = [
    "GDI_KINDS",
    "MODES",
    "PRESETS",
    "PROJECTOR",
    "PROTOTYPES",
    "RULES",
    "SKIP_REASONS",
    "GeoAlignConfig",
    "GeoAlignState",
    "Projector",
    "best_random_probs",
    "curate",
    "detection_auroc",
    "deviation",
    "fit_projector",
    "gdi",
    "kde_flags",
    "kde_tail_threshold",
    "orientation_loss",
    "pair_distances",
    "preference_pairs",
    "prototype",
    "rectify",
]
