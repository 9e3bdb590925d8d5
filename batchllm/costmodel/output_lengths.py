"""A node's answer lengths, as the planner and the runtime ask for them: the one seam for
output lengths (`OutputLengths`).

The planner asks, before a run, for the lengths of a node's sample rows from its data
summary and the profile it is planned with (`sample_lengths`). The runtime tells it the
node's committed outputs (`observe`) and that its pilot has every answer (`pilot_ended`),
and asks, for the split and the order of each window, a forecast of its requests' output
tokens (`forecast`: a `WindowForecast`, a snapshot made on the driver's main loop and used
in the preparing thread).

Implementations: `UnlearntLengths` (`UNLEARNT`), a node's lengths as nothing learnt them:
the planner takes the profile's CDF for every request alike, the runtime every answer at
its max_tokens (x n), and a pilot teaches it nothing; the planner's length model of a
node's model (`planner.length_sources.ModelLengths`, the same with its own sample
lengths); and the run's calibrated lengths of a node (`calibration.node_lengths.NodeLengths`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineRequest, EngineResult
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.profile import Profile
from batchllm.costmodel.request_lengths import RequestLengths, relative_shifts
from batchllm.io.node_data import NodeSummary

LogShift = Callable[[Sequence[LengthPrompt]], np.ndarray]  # a length model's per-request shifts


@dataclass(frozen=True)
class PilotLearnt:
    """What a node's pilot taught: its answers' mean length and the prior's (both cut at the
    node's max_tokens), and how much of its length model's spread held (None: no length model)."""

    mean_output_tokens: float
    prior_mean_output_tokens: float
    max_tokens: int
    spread: float | None

    def note(self, node: str) -> str:
        held = "" if self.spread is None else \
            f"; the length model's differences between its requests: {self.spread:.0%} of them held on it"
        return (f"pilot of {node} done: mean answer {self.mean_output_tokens:.0f} tokens at max_tokens {self.max_tokens} "
                f"(the prior's {self.prior_mean_output_tokens:.0f}){held}; planning the rest on it")


@dataclass(frozen=True)
class WindowForecast:
    """What the runtime predicts of a node's answers when it splits and orders a window of
    requests: each request's expected output tokens (its answer's length cut at max_tokens,
    times n), for the replica split by work and the longest-first order.

    Two parts, learnt apart: the level, the node's own length distribution as the run has
    calibrated it so far (None: nothing learnt, every request generates all it may), and the
    spread between requests, the length model's per-request shifts when one is used for the
    model (taken relative to the window's mean, so the model moves requests against each
    other and the calibration alone says how long answers are), scaled by how much of it
    held on the node's pilot (`spread`: 0 when none did)."""

    node: str = ""
    level: LengthDistribution | None = None  # the node's calibrated output lengths (None: max_tokens each)
    log_shift: LogShift | None = None  # None: every request alike
    source: str = "prior"  # where the level comes from (see costmodel.request_lengths)
    spread: float = 1.0  # how much of the shifts holds on this prompt set (costmodel.length_spread)

    def lengths(self, prompts: Sequence[LengthPrompt]) -> RequestLengths:
        """The requests' lengths at the level (which must be known), each with its shift."""
        assert self.level is not None, "no level: nothing learnt of the node's lengths"
        if self.log_shift is None or self.spread == 0.0 or not prompts:
            return RequestLengths.shared(self.level, len(prompts), self.source)
        shifts = self.spread * np.asarray(self.log_shift(prompts), float)
        return RequestLengths(self.level, relative_shifts(shifts), "length model")  # the window's mean stays the level's

    def __call__(self, requests: Sequence[EngineRequest]) -> np.ndarray:
        """Expected output tokens per request (x n)."""
        caps = np.array([r.max_tokens for r in requests], float)
        samples = np.array([r.n for r in requests], float)
        if self.level is None:
            return caps * samples
        return self.lengths([LengthPrompt.of(r, self.node) for r in requests]).expected(caps) * samples


MAX_TOKENS = WindowForecast()  # the forecast that knows nothing: every request generates all it may


class OutputLengths(Protocol):
    """One node's answer lengths: what the planner asks of them, and what the runtime tells and asks."""

    def sample_lengths(self, summary: NodeSummary, profile: Profile) -> RequestLengths:
        """The planner: one `RequestLengths` per sample row of the node's summary, in its order
        (`profile`: the one the node is planned with)."""
        ...

    def observe(self, results: Sequence[EngineResult]) -> None:
        """Outputs the node committed (errors are no evidence)."""
        ...

    def forecast(self) -> WindowForecast:
        """The node's answer lengths as known now, for the runtime's split and order of a window."""
        ...

    def pilot_ended(self, answers: Sequence[tuple[LengthPrompt, int]] = ()) -> PilotLearnt | None:
        """The node's pilot has every answer (`answers`: its requests as the length model reads
        them, with their answers' lengths); None: nothing learns from it."""
        ...


def profile_lengths(summary: NodeSummary, profile: Profile) -> RequestLengths:
    """The profile's CDF for every request alike (what the planner assumed before lengths were
    predicted): source "store" when the profile was learnt on this machine, else "prior"."""
    return RequestLengths.shared(profile.lengths, len(summary.prompt_tokens), "store" if profile.kind == "learnt" else "prior")


class UnlearntLengths:
    """A node's `OutputLengths` as nothing learnt them: the profile's CDF for the planner,
    max_tokens for the runtime; its outputs and its pilot teach it nothing."""

    def sample_lengths(self, summary: NodeSummary, profile: Profile) -> RequestLengths:
        return profile_lengths(summary, profile)

    def observe(self, results: Sequence[EngineResult]) -> None:
        pass

    def forecast(self) -> WindowForecast:
        return MAX_TOKENS

    def pilot_ended(self, answers: Sequence[tuple[LengthPrompt, int]] = ()) -> PilotLearnt | None:
        return None


UNLEARNT = UnlearntLengths()
