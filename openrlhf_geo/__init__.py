"""openrlhf-geo: SALT advantage reweighting and GeoAlign rollout curation for GRPO-style RL.

Geometry modules (stateless tensor functions, no OpenRLHF import):
    features     per-response LM-head-gradient proxy features (exact | Kronecker sketch)
    diagnostics  PR, n_eff, positive alignment, D_a, D_g, U_perp, App. B/D group geometry (SALT §2, App. B, D, F.5)
    salt         SALT coefficients a' = P_k a + alpha_t P_k^perp [a]_+ (SALT Eq. 12-18)
    geoalign     pairs, online projector, prototype, GDI, KDE anomaly rule, rectification plan (GeoAlign Eq. 3-8)
    pipeline     the per-step pipeline both engines run: reward noise -> GeoAlign -> SALT -> multiplicities, metrics
Engines: ``openrlhf_geo.fork`` (patched OpenRLHF 0.11.2 on Ray) and ``openrlhf_geo.local`` (single process).
"""

__version__ = "0.1.0.dev0"
