"""One node's answer lengths as a run learns them (`NodeLengths`, an `OutputLengths` of
`costmodel.output_lengths`): observe the node's outputs, forecast a window of its requests,
end its pilot.

Its parts: the node's `LengthCalibration` (censored: an output cut at max_tokens, or still
being generated, says "at least this long"), the node's outputs still running (per engine,
from its last step: how many sequences decode and their total context, so their mean age is
that context per sequence less the node's mean prompt), its measured prompt sizes (which also
correct the planner's estimate of them), and its length model's per-request shifts, scaled
by how much of them held on its pilot.

Invariant: `version` grows with every change that can change a forecast or a posterior, so
a cost model built on them knows when it is stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineResult, FinishReason
from batchllm.costmodel.calibration.lengths import LengthCalibration
from batchllm.costmodel.length_spread import fitted_spread
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.output_lengths import LogShift, PilotLearnt, WindowForecast
from batchllm.costmodel.profile import Profile
from batchllm.costmodel.request_lengths import RequestLengths
from batchllm.io.node_data import NodeSummary

PILOT_PRIOR_OUTPUTS = 0.5  # the prior's weight in outputs once a node's pilot has ended (a random sample of the set)
PROMPT_PRIOR_UNITS = 8.0  # the planner's prompt estimate counts as this many measured prompts
RUNNING_MAX_AGE_S = 10.0  # an engine's last step older than this says nothing about what runs now


def output_length(result: EngineResult, requests_per_unit: int) -> tuple[int, bool] | None:
    """(tokens per answer, finished: not cut at max_tokens) of a committed output; None: an error.
    A pooling request's answer (a vector, a score, a label: no tokens) counts as one token, as
    the cost model sees it: answered by its prefill step."""
    if result.is_error:
        return None
    return max(1, round(result.num_output_tokens / requests_per_unit)), result.finish_reason != FinishReason.LENGTH


@dataclass(frozen=True)
class _Running:
    decode_seqs: int
    decode_context: int
    at_s: float


class NodeLengths:
    """One node's `OutputLengths`, learnt from its outputs, its engines' last steps and its pilot."""

    def __init__(self, node: str, prior: LengthDistribution, *, max_tokens: int, requests_per_unit: int,
                 planned_prompt_tokens: float, log_shift: LogShift | None = None, clock: Callable[[], float] = time.monotonic):
        """`prior`: the profile's lengths; `planned_prompt_tokens`: the planner's mean prompt estimate;
        `log_shift`: the node's length model (per-request shifts), where one is used."""
        self.node, self.max_tokens, self.requests_per_unit = node, max_tokens, requests_per_unit
        self.planned_prompt_tokens, self.log_shift, self.clock = planned_prompt_tokens, log_shift, clock
        self.calibration = LengthCalibration(prior)
        self.spread: float | None = None  # once the pilot ended, with a length model: how much of its spread held
        self.prompt_tokens, self.units = 0, 0  # measured prompt tokens, over `units` outputs
        self._running: dict[Hashable, _Running] = {}  # by engine: its last step's decoding outputs
        self.version = 0

    # -- what it is told
    def observe(self, results: Sequence[EngineResult]) -> None:
        for result in results:
            seen = output_length(result, self.requests_per_unit)
            if seen is None:
                continue
            self.calibration.observe(*seen, self.requests_per_unit)
            self.prompt_tokens += result.num_prompt_tokens
            self.units += 1
        self.version += 1

    def observe_running(self, engine: Hashable, decode_seqs: int, decode_context: int) -> None:
        """An engine of the node took a step with `decode_seqs` outputs decoding over `decode_context` tokens."""
        self._running[engine] = _Running(decode_seqs, decode_context, self.clock())
        self.version += 1

    def pilot_ended(self, answers: Sequence[tuple[LengthPrompt, int]] = ()) -> PilotLearnt:
        """The pilot is a random sample of the node's own prompt set, all of it ended (no
        short-first bias), so from now on the prior (another prompt set's lengths) weighs as
        PILOT_PRIOR_OUTPUTS outputs, not as many as a run's first ones need. Where the node's
        length model spreads requests, how much of that spread holds on the pilot scales it."""
        lengths = self.calibration
        self.calibration = lengths = replace(lengths, prior_outputs=min(lengths.prior_outputs, PILOT_PRIOR_OUTPUTS), _last=None)
        self._running.clear()  # the engines' last steps counted the outputs that ended in them: none runs now
        self.version += 1
        if self.log_shift is not None and answers:
            prompts = [prompt for prompt, _ in answers]
            self.spread = fitted_spread(lengths.posterior(), self.log_shift(prompts), [length for _, length in answers],
                                        [p.max_tokens for p in prompts])

        def capped_mean(distribution: LengthDistribution) -> float:
            return float(RequestLengths.shared(distribution, 1, "pilot").expected(self.max_tokens)[0])

        return PilotLearnt(capped_mean(lengths.posterior()), capped_mean(lengths.prior), self.max_tokens, self.spread)

    # -- what it knows
    def forecast(self) -> WindowForecast:
        return WindowForecast(self.node, self.posterior(), self.log_shift,
                                  source="prior" if self.calibration.outputs == 0 else "pilot", spread=self.spread_now)

    def sample_lengths(self, summary: NodeSummary, profile: Profile) -> RequestLengths:
        """The node's sample rows at the lengths learnt so far, as a window's forecast takes
        them (`profile`: its prior, which these lengths already start from)."""
        return self.forecast().lengths(list(summary.samples))

    @property
    def spread_now(self) -> float:
        """How much of the length model's spread to use: all of it until a pilot said otherwise."""
        return 1.0 if self.spread is None else self.spread

    def posterior(self) -> LengthDistribution:
        """The node's lengths from everything seen, its outputs still running counted at their age."""
        return self.calibration.posterior(self.running_ages())

    @property
    def has_evidence(self) -> bool:
        """An output ended or one is being generated now: the node's own lengths say something."""
        return self.calibration.outputs > 0 or bool(self.running_engines())

    def running_engines(self) -> dict[Hashable, tuple[int, int]]:
        """(decoding outputs, their total context) of each engine whose last step is recent and decodes."""
        now = self.clock()
        return {engine: (r.decode_seqs, r.decode_context) for engine, r in self._running.items()
                if now - r.at_s <= RUNNING_MAX_AGE_S and r.decode_seqs > 0}

    def running_ages(self) -> list[tuple[int, float]]:
        """(tokens so far, sequences) of the node's outputs being generated now."""
        prompt = self.mean_prompt_tokens()
        return [(max(1, round(context / seqs - prompt)), float(seqs)) for seqs, context in self.running_engines().values()]

    def prompt_factor(self) -> float:
        """Measured prompt tokens over the planner's estimate, the estimate counting as PROMPT_PRIOR_UNITS prompts."""
        planned = self.planned_prompt_tokens
        if planned <= 0 or not self.units:
            return 1.0
        return (PROMPT_PRIOR_UNITS * planned + self.prompt_tokens) / (PROMPT_PRIOR_UNITS + self.units) / planned

    def mean_prompt_tokens(self) -> float:
        """Measured, else the planner's estimate."""
        return self.prompt_tokens / self.units if self.units else self.planned_prompt_tokens

