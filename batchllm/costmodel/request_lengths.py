"""Each request's output length as a distribution: the one record the planner's
simulation, the runtime's replica split and order, and the ETAs read lengths from.

An accelerated-failure-time form: request i's length (before its max_tokens cap) is
`base` x exp(log_shift[i]), `base` one distribution shared by the requests (an empirical,
censoring-aware CDF) and log_shift[i] what is known of request i from its prompt. With
nothing known of the prompts every shift is 0 and each request's distribution is the
base: the per-model CDF a profile holds, as the planner used before lengths were
predicted. `source` says where the lengths come from, for the plan's notes:

    store          learnt from this prompt set's own earlier outputs (the local store)
    pilot          a pilot sample of this prompt set, run first
    length model   predicted per request from its prompt (per-model, gated)
    prior          the model profile's CDF (another prompt set's lengths)

No vLLM import: the cost model's layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from batchllm.costmodel.lengths import LengthDistribution

SOURCES = ("store", "pilot", "length model", "prior")


def relative_shifts(shifts: npt.ArrayLike) -> np.ndarray:
    """Shifts moved so that their mean factor is 1: they spread requests against each other
    and leave the level (the base's mean) alone."""
    shifts = np.asarray(shifts, float)
    return shifts - np.log(np.mean(np.exp(shifts))) if shifts.size else shifts


@dataclass(frozen=True)
class RequestLengths:
    base: LengthDistribution
    log_shift: np.ndarray  # per request; zeros when nothing is known of the prompts
    source: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"length source must be one of {SOURCES}, got {self.source!r}")

    @classmethod
    def shared(cls, base: LengthDistribution, count: int, source: str) -> RequestLengths:
        """Every request alike: the base distribution itself."""
        return cls(base, np.zeros(count), source)

    def __len__(self) -> int:
        return int(self.log_shift.size)

    def take(self, indices: Sequence[int] | np.ndarray) -> RequestLengths:
        return RequestLengths(self.base, self.log_shift[np.asarray(indices, np.int64)], self.source)

    def repeat(self, times: int) -> RequestLengths:
        """Each request `times` times over in a row (a node's `n` samples of one prompt)."""
        return RequestLengths(self.base, np.repeat(self.log_shift, times), self.source)

    def sample(self, seed: int) -> np.ndarray:
        """One length per request (>= 1, before any cap), drawn with a fixed seed."""
        drawn = self.base.sample(len(self), seed).astype(float) * np.exp(self.log_shift)
        return np.maximum(np.rint(drawn), 1).astype(np.int64)

    def quantile(self, q: float) -> np.ndarray:
        """Per request, the length at probability `q` (before any cap)."""
        index = min(int(np.searchsorted(self.base.cdf, q, side="left")), self.base.lengths.size - 1)
        return np.maximum(self.base.lengths[index] * np.exp(self.log_shift), 1.0)

    def expected(self, cap: np.ndarray | int | None = None) -> np.ndarray:
        """Per request, the expected length, cut at its `cap` (max_tokens) when given:
        E[min(B e^s, cap)] = e^s E[min(B, cap e^-s)], with E[min(B, c)] the base's masses
        below c times their lengths plus c times the mass above (no requests x points table)."""
        scale = np.exp(self.log_shift)
        if cap is None:
            return scale * self.base.mean()
        lengths = self.base.lengths.astype(float)
        masses = np.diff(np.concatenate([[0.0], self.base.cdf]))
        below = np.concatenate([[0.0], np.cumsum(masses * lengths)])  # sum over the first k points
        cut = np.broadcast_to(np.asarray(cap, float), scale.shape) / scale
        k = np.searchsorted(lengths, cut, side="right")
        above = 1.0 - np.concatenate([[0.0], self.base.cdf])[k]
        return scale * (below[k] + cut * above)
