"""The step-latency model refit while a run goes, from its own engine steps.

Evidence: every step a replica reports (features as `StepFeatures`, wall time). The fit
is the profile builder's: non-negative least squares on relative error (each step's row
divided by its time), kept as sufficient statistics (a 5x5 Gram matrix, a 5-vector and
counts), so memory does not grow with the run.

Prior: the profile's model, counted as `prior_steps` pseudo-steps spread over a fixed
design of representative steps (pure prefills of several sizes, pure decodes of several
batch sizes and contexts, one mixed step) whose times are what the prior predicts. With
no steps the posterior is the prior; as steps arrive the prior's share,
prior_steps / (prior_steps + steps), fades; and in a direction no step informs (say no
prefill was seen yet) the prior keeps holding.

Totals: relative error treats a step that stalled (another process had the core) as one
bad ratio among many, which is right for the model's shape but leaves the sum of step
times short on a busy machine, and a run's time is that sum. So the posterior is scaled
last by measured time over predicted time summed over the steps (`TOTAL_PRIOR_STEPS`
pseudo-steps at 1): its total over the run's steps is the measured total.

Shape and level: steps refit the model's shape only once they cover the batches the engine
runs, a decode step of at least SHAPE_COVERAGE of its `max_num_seqs`. Before that (a pilot's
few small batches, a workload of short answers) they set only its level: the posterior is the
prior times the speed factor below, so the shape the host's learnt profile (or the shipped or
analytic one) has across batch sizes carries the estimate to the batches the rest of the run
will use, instead of a line through the few batch sizes seen.

Speed factor: a foreign prior is mostly off by one factor (another CPU, another dtype,
a busier machine). That factor is estimated first, as measured time over the prior's time
summed over the steps (what makes the prior's total right), with `SCALE_PRIOR_STEPS`
pseudo-steps of ratio 1, and the design's targets are the prior's times times it, so a
handful of decode steps already rescales the prefill terms too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchllm.costmodel.latency import StepFeatures, StepLatencyModel
from batchllm.costmodel.nnls import nnls_normal

PRIOR_STEPS = 32.0  # the prior counts as this many steps
SCALE_PRIOR_STEPS = 1.0  # the speed factor's prior (1: the profile is right) counts as this many steps
TOTAL_PRIOR_STEPS = 1.0  # the total correction's prior (1) counts as this many steps
COEFFICIENTS = 5  # base + the four features
SHAPE_COVERAGE = 0.5  # a decode step of this share of max_num_seqs lets the steps refit the shape


def prior_design(max_num_seqs: int, max_num_batched_tokens: int) -> np.ndarray:
    """Representative steps (rows of StepFeatures) the prior's pseudo-steps sit on; they
    span all five coefficients, so the posterior is unique even before any step."""
    rows = []
    for prefill in sorted({32, 128, 512, max(1, min(2048, max_num_batched_tokens))}):
        rows.append((prefill, prefill * prefill, 0, 0))  # one prompt: attention ~ chunk x context
    for seqs in sorted({1, 8, 32, max(1, max_num_seqs)}):
        for context in (128, 768):
            rows.append((0, 0, seqs, seqs * context))
    rows.append((256, 256 * 256, 32, 32 * 400))
    return np.array(rows, float)


def scaled(model: StepLatencyModel, factor: float) -> StepLatencyModel:
    """Every coefficient times `factor`: the same machine, uniformly slower or faster."""
    return StepLatencyModel(*(value * factor for value in model.to_dict().values()))


@dataclass
class LatencyCalibration:
    prior: StepLatencyModel
    design: np.ndarray  # rows of StepFeatures: where the prior's pseudo-steps sit
    prior_steps: float = PRIOR_STEPS
    steps: int = 0  # steps observed
    skipped: int = 0  # steps not used: no time measured
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((COEFFICIENTS, COEFFICIENTS)), repr=False)
    _h: np.ndarray = field(default_factory=lambda: np.zeros(COEFFICIENTS), repr=False)
    _sum_x: np.ndarray = field(default_factory=lambda: np.zeros(COEFFICIENTS), repr=False)  # sum of [1, features]
    _measured_s: float = 0.0  # sum of the steps' measured times
    _prior_s: float = 0.0  # sum of the prior's times for the same steps
    _widest_decode_seqs: float = 0.0  # the most sequences a decode step observed had
    _cached: StepLatencyModel | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.design = np.asarray(self.design, float)
        if self.design.ndim != 2 or self.design.shape[1] != COEFFICIENTS - 1 or not len(self.design):
            raise ValueError(f"design must be rows of {COEFFICIENTS - 1} step features, got shape {self.design.shape}")
        if self.prior_steps <= 0:
            raise ValueError(f"prior_steps must be positive, got {self.prior_steps}")

    @classmethod
    def for_engine(cls, prior: StepLatencyModel, max_num_seqs: int, max_num_batched_tokens: int,
                   prior_steps: float = PRIOR_STEPS) -> LatencyCalibration:
        return cls(prior, prior_design(max_num_seqs, max_num_batched_tokens), prior_steps)

    def observe(self, features: StepFeatures | tuple[float, ...], wall_s: float) -> None:
        """One measured step."""
        if not wall_s > 0:
            self.skipped += 1
            return
        row = np.array([1.0, *features], float) / wall_s
        self._gram += np.outer(row, row)
        self._h += row
        self._sum_x += row * wall_s
        self._measured_s += wall_s
        self._prior_s += self.prior.step_s(StepFeatures(*features))
        self._widest_decode_seqs = max(self._widest_decode_seqs, float(features[2]))
        self.steps += 1
        self._cached = None

    def observe_many(self, features: np.ndarray, seconds: np.ndarray) -> None:
        for row, wall_s in zip(np.asarray(features, float), np.asarray(seconds, float)):
            self.observe(tuple(row), float(wall_s))

    @property
    def prior_share(self) -> float:
        """How much the prior still weighs, between 1 (no steps) and 0."""
        return self.prior_steps / (self.prior_steps + self.steps)

    def speed_factor(self) -> float:
        """Measured time over the prior's, summed over the steps, with SCALE_PRIOR_STEPS
        pseudo-steps (of the steps' mean prior time) at 1; 1 with no steps."""
        if not self.steps or self._prior_s <= 0:
            return 1.0
        pseudo_s = SCALE_PRIOR_STEPS * self._prior_s / self.steps
        return (pseudo_s + self._measured_s) / (pseudo_s + self._prior_s)

    @property
    def shape_covered(self) -> bool:
        """Whether the steps ran batches wide enough to refit the model's shape (see the module)."""
        return self._widest_decode_seqs >= SHAPE_COVERAGE * float(self.design[:, 2].max())

    def model(self) -> StepLatencyModel:
        """The posterior step-latency model."""
        if self._cached is None and not self.shape_covered:
            self._cached = scaled(self.prior, self.speed_factor())
        if self._cached is None:
            factor = self.speed_factor()
            targets = factor * np.array([self.prior.step_s(StepFeatures(*row)) for row in self.design])
            keep = targets > 0
            rows = np.column_stack([np.ones(int(keep.sum())), self.design[keep]]) / targets[keep, None]
            weight = self.prior_steps / max(int(keep.sum()), 1)
            gram = self._gram + weight * rows.T @ rows
            h = self._h + weight * rows.sum(axis=0)
            coefficients = nnls_normal(gram, h)
            predicted_s = float(coefficients @ self._sum_x)
            if self.steps and predicted_s > 0:
                pseudo_s = TOTAL_PRIOR_STEPS * predicted_s / self.steps
                coefficients = coefficients * (pseudo_s + self._measured_s) / (pseudo_s + predicted_s)
            self._cached = StepLatencyModel(*map(float, coefficients))
        return self._cached

