"""The studies of `openrlhf-geo study NAME`, one module each (`base.Study`; most are `base.ConditionStudy`: a list
of train conditions run by `runner`). Each module defines STUDY; adding a study is its module plus its line in
MODULES. A module without a complete STUDY fails this package's import, so a study cannot be half registered."""

import importlib
import inspect

from openrlhf_geo.lab.studies.base import SUMMARY_KEYS, ConditionStudy, Study
from openrlhf_geo.lab.studies.registry import REGISTRY

MODULES = (
    "salt_scaling",
    "regime",
    "learnable_regime",
    "salt_ablations",
    "geoalign_failure",
    "salt_proxy",
    "long_cot",
    "real_lm_geometry",
    "real_lm_geoalign",
    "real_lm_proxy",
    "real_lm_rl",
)


def register(study):
    """Add `study` (a Study instance) to REGISTRY -> it; TypeError when it is not a complete study or its name or
    summary section is taken."""
    if not isinstance(study, Study) or inspect.isabstract(type(study)):
        raise TypeError(f"{study!r} is not a complete Study (one that implements every abstract method)")
    name = getattr(study, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(study).__name__} has no name (the command's NAME, e.g. 'salt-scaling')")
    if name in REGISTRY:
        twice = f"{type(REGISTRY[name]).__name__}, {type(study).__name__}"
        raise TypeError(f"study {name!r} is registered twice ({twice})")
    if isinstance(study, ConditionStudy):
        section = getattr(study, "section", None)
        taken = {*SUMMARY_KEYS, *(s.section for s in REGISTRY.values() if isinstance(s, ConditionStudy))}
        if not isinstance(section, str) or section in taken:
            raise TypeError(f"study {name!r}: its summary section must be a key of its own (got {section!r})")
    REGISTRY[name] = study
    return study


def load(module):
    """Import `module` and register its STUDY -> the study (TypeError when it has none or it is incomplete)."""
    study = getattr(importlib.import_module(module), "STUDY", None)
    if study is None:
        raise TypeError(f"{module} defines no STUDY")
    return register(study)


for _module in MODULES:
    load(f"{__name__}.{_module}")
