"""What the runtime predicts of a node's answers when it splits and orders a window of
requests: each request's expected output tokens (its answer's length cut at max_tokens,
times n), for the replica split by work and the longest-first order.

Two parts, learnt apart: the level, the node's own length distribution as the run has
calibrated it so far (its pilot's outputs, those that ended and those still running), and
the spread between requests, the length model's per-request shifts when one is used for
the model (the shifts are taken relative to the window's mean, so the model moves
requests against each other and the calibration alone says how long answers are), scaled
by how much of it held on the node's pilot (`spread`: 0 when none did). A
forecast is a snapshot, made on the driver's main loop and used in the preparing thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineRequest
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.request_lengths import RequestLengths, relative_shifts

LogShift = Callable[[Sequence[LengthPrompt]], np.ndarray]  # a length model's per-request shifts


@dataclass(frozen=True)
class CalibratedForecast:
    """A node's forecast as the run has calibrated it: each request's expected output tokens (x n)."""

    node: str
    level: LengthDistribution  # the node's calibrated output lengths
    log_shift: LogShift | None = None  # None: every request alike
    source: str = "prior"  # where the level comes from (see costmodel.request_lengths)
    spread: float = 1.0  # how much of the shifts holds on this prompt set (costmodel.length_spread)

    def lengths(self, requests: Sequence[EngineRequest]) -> RequestLengths:
        if self.log_shift is None or self.spread == 0.0 or not requests:
            return RequestLengths.shared(self.level, len(requests), self.source)
        shifts = self.spread * np.asarray(self.log_shift([LengthPrompt.of(r, self.node) for r in requests]), float)
        return RequestLengths(self.level, relative_shifts(shifts), "length model")  # the window's mean stays the level's

    def __call__(self, requests: Sequence[EngineRequest]) -> np.ndarray:
        """Expected output tokens per request (x n)."""
        caps = np.array([r.max_tokens for r in requests], float)
        samples = np.array([r.n for r in requests], float)
        return self.lengths(requests).expected(caps) * samples
