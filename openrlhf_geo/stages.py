"""What every registered stage (registry.py) shares: the batch it reads, the plan a curation returns, the state it
owns, and the run's seeded random streams.

A stage is a pure function of explicit inputs plus its own state: it reads a `Batch` (never the pipeline), and what
lives across steps (a random stream, GeoAlign's projector, SALT's entropy range) is its State, an object with
`state_dict()` / `load_state_dict(state)` that the pipeline checkpoints under the stage's name.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, TypeVar, overload

import torch

# Every seeded random stream of a run, as an offset from its --train.seed: one torch.Generator per consumer, so
# switching one method on never shifts another's draws (the reward noise has its own --reward.noise.seed). Changing a
# value changes every seeded result, the committed ones included.
STREAM_OFFSETS = {
    "geoalign": 1,  # GeoAlign: projector initialisation and training order, pair subsampling, Best-Random donors
    "salt": 2,  # SALT
    "minibatch": 3,  # local engine: the optimizer mini-batch order
    "baseline": 4,  # PF-PPO / PODS draws
    "loss": 5,  # local engine: Clip-Cov's token draw
}
# The fork's per-step streams: seed * FORK_STEP_STRIDE + step (rank_batches' partition order after rollout step
# `step`, PartitionSampler's order at ppo_train call `step`), and Clip-Cov's seed + rank (one stream per rank).
FORK_STEP_STRIDE = 1_000_003

_T = TypeVar("_T")


def stream(seed: int, name: str) -> torch.Generator:
    """The CPU generator of stream `name` (STREAM_OFFSETS) for a run seeded with `seed`."""
    return torch.Generator().manual_seed(seed + STREAM_OFFSETS[name])


class State(Protocol):
    """What a stage remembers across steps, checkpointed by the pipeline under the stage's name."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Stream:
    """The State of a stage whose only memory is one seeded random stream (`generator`)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


@dataclass(frozen=True)
class Batch:
    """What a stage reads of one rollout batch besides its values: N rollouts in prompt order.

    group_ids  (N,) long CPU  prompt ids
    corrupted  (N,) bool | None  rollouts whose reward the injected noise changed (None without --reward.noise.*)
    source     (N,) long CPU  the rollout each slot holds (the curation plan's; slot i itself before curation)
    kept       (N,) bool CPU  slots in the group statistics and SALT after curation (False: dropped by the plan)
    step       the rollout step, from 1 (for messages)
    actions    (N,) long CPU | None  each rollout's action tokens (the response tokens the loss reads); None: unknown
    """

    group_ids: torch.Tensor
    corrupted: torch.Tensor | None
    source: torch.Tensor
    kept: torch.Tensor
    step: int
    actions: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.group_ids.numel()


@dataclass
class CurationPlan:
    """What the engine trains on after a curation (GeoAlign, PF-PPO, PODS). Slot i of the batch gets the content of
    rollout `source[i]`.

    source  (N,) long   rollout whose content (tokens, reward, log-probs, ...) fills slot i; i itself if kept
    weight  (N,) float  loss weight of slot i (0 removes its gradient and keeps the batch shape), else 1
    keep    (N,) bool   False for slots the plan drops (they also leave the group statistics), else True
    flagged (N,) bool   rollouts the curation found bad (a prompt with no good rollout is left unchanged)
    score   (N,) float  each rollout's score the curation flagged by (GeoAlign: its GDI, Eq. 7), NaN where none
    All five live on one device.
    """

    source: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    flagged: torch.Tensor
    score: torch.Tensor

    @classmethod
    def identity(cls, n: int, device=None) -> "CurationPlan":
        """The plan that changes nothing (every rollout fills its own slot with weight 1)."""
        return cls(
            source=torch.arange(n, device=device),
            weight=torch.ones(n, device=device),
            keep=torch.ones(n, dtype=torch.bool, device=device),
            flagged=torch.zeros(n, dtype=torch.bool, device=device),
            score=torch.full((n,), math.nan, device=device),
        )

    def to(self, device) -> "CurationPlan":
        """The same plan with every tensor on `device`."""
        return CurationPlan(*(getattr(self, f.name).to(device) for f in fields(self)))

    @overload
    def apply(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def apply(self, x: Sequence[_T]) -> list[_T]: ...

    def apply(self, x: torch.Tensor | Sequence[_T]) -> torch.Tensor | list[_T]:
        """The kept slots' content, in slot order: `x[source[keep]]` for a tensor (rows) or a sequence (items)."""
        index = self.source[self.keep]
        if isinstance(x, torch.Tensor):
            return x[index.to(x.device)]
        return [x[i] for i in index.tolist()]


def record(metrics: dict, text: dict, prefix: str, stats: dict, size: int, part=slice(None)) -> None:
    """A stage's stats into per-slot metrics named `<prefix>/<key>` (`key` alone when prefix is ""): each number v
    becomes `metrics[name][part] = v` (an (N,) float tensor, NaN elsewhere; None -> NaN), each (N,) tensor (stats a
    stage already gives per slot) `metrics[name]` itself, each string `text[name]`."""
    for key, value in stats.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, str):
            text[name] = value
        elif isinstance(value, torch.Tensor):
            if value.shape != (size,):
                raise ValueError(f"{name}: a per-slot stat must have shape ({size},), got {tuple(value.shape)}")
            metrics[name] = value
        else:
            values = metrics.setdefault(name, torch.full((size,), math.nan))
            values[part] = math.nan if value is None else float(value)
