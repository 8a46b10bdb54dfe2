"""openrlhf-geo: SALT advantage reweighting and GeoAlign rollout curation for GRPO-style RL.

Geometry modules (stateless tensor functions, no OpenRLHF import):
    features     per-response LM-head-gradient proxy features (exact | Kronecker sketch)
    diagnostics  PR, n_eff, positive alignment, D_a, D_g, U_perp, App. B/D group geometry (SALT §2, App. B, D, F.5)
    salt         SALT coefficients a' = P_k a + alpha_t P_k^perp [a]_+ (SALT Eq. 12-18)
    geoalign     pairs, online projector, prototype, GDI, KDE anomaly rule, rectification plan (GeoAlign Eq. 3-8)
    pipeline     the per-step pipeline both engines run: reward noise -> GeoAlign -> SALT -> multiplicities, metrics
Engines: ``openrlhf_geo.fork`` (patched OpenRLHF 0.11.2 on Ray) and ``openrlhf_geo.local`` (single process).
"""

import warnings

__version__ = "0.1.0"


class GeoWarning(UserWarning):
    """Base of the warnings openrlhf-geo gives a user (each names the flag or file to look at); shown as
    `warning: <message>`, without Python's location and source line, whichever process (Ray actors too) warns."""


_format_warning = warnings.formatwarning


def _format_geo_warning(message, category, filename, lineno, line=None):
    if issubclass(category, GeoWarning):
        return f"warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


warnings.formatwarning = _format_geo_warning
