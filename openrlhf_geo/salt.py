"""SALT: subspace-adaptive reweighting of group-relative advantages (arXiv 2606.05800, Eq. 12-18, App. F.3)."""

# App. F.3 ablations; "full" is the method.
VARIANTS = (
    "full",
    "only-main",
    "only-exp",
    "no-pos",
    "no-proj",
    "rand-proj",
    "fixed-alpha",
    "pr-alpha",
    "entropy-alpha",
    "permuted",
    "matched-rand-subspace",
)
