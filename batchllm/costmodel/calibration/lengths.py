"""Each model's output-length distribution, updated from the outputs a run finishes.

Censoring, as the profile builder treats it (Kaplan-Meier): an output cut at max_tokens
says only "at least this long", and so does an output still being generated (its age, in
tokens so far). Without the second, the first outputs of a run, which are the short
ones, would make every output look short.

Prior: the profile's CDF, stretched or shrunk to this run's outputs, counted as
`prior_outputs` pseudo-outputs (its probability masses; the mass it holds at its own cap is
censored there). The stretch is the factor s that makes "this run's lengths are the prior's
times s" most likely given every output seen so far, finished, cut or still running (an
accelerated-failure-time fit, s on a log grid, ln s held near 0 by a normal prior of
LOG_SCALE_SIGMA). Kaplan-Meier covers only the lengths outputs have reached: beyond the age
of those still running, the posterior is the prior's shape alone, so a prior of long
answers kept predicting long answers for a run of short ones (200 numbers prompts on the
Xeon profile's lengths, at age 30 with 87 ended: 91 tokens left for the rest, where 11
were; stretched by s = 0.14: 6). Past the last length an output ended at, the tail is
geometric (`_with_tail`), so outputs older than every ended one still have tokens to go.
Counts per length only, so memory is bounded by the longest output, not by the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from batchllm.costmodel.lengths import LengthDistribution

PRIOR_OUTPUTS = 32.0  # the prior counts as this many outputs
LOG_SCALE_SIGMA = 0.5  # the prior on ln s: a stretch of 1.65 (or 1/1.65) is one standard deviation
LOG_SCALE_GRID = np.linspace(-3.0, 3.0, 121)  # ln s: stretches of 1/20 to 20, 5 % apart
TAIL_TOKENS = 512  # the geometric tail past the last ended length: a point per token this far


@dataclass
class LengthCalibration:
    prior: LengthDistribution
    prior_outputs: float = PRIOR_OUTPUTS
    _ended: dict[int, float] = field(default_factory=dict, repr=False)  # length -> outputs that stopped there
    _cut: dict[int, float] = field(default_factory=dict, repr=False)  # length -> outputs cut there (max_tokens)
    _observed: int = field(default=0, repr=False)  # observe() calls that counted: with `running`, what a posterior is of
    _last: tuple[tuple, LengthDistribution] | None = field(default=None, repr=False)  # the last posterior, by that key

    def __post_init__(self) -> None:
        if self.prior_outputs <= 0:
            raise ValueError(f"prior_outputs must be positive, got {self.prior_outputs}")

    def observe(self, length: int, finished: bool, count: float = 1.0) -> None:
        """An output of `length` tokens; `finished` False when it was cut (finish_reason 'length')."""
        length = int(length)
        if length < 1:
            return  # no token: no information about the length distribution
        target = self._ended if finished else self._cut
        target[length] = target.get(length, 0.0) + count
        self._observed += 1

    def observe_many(self, lengths: Iterable[int], finished: Iterable[bool]) -> None:
        for length, done in zip(lengths, finished):
            self.observe(length, done)

    @property
    def outputs(self) -> float:
        return sum(self._ended.values()) + sum(self._cut.values())

    @property
    def prior_share(self) -> float:
        return self.prior_outputs / (self.prior_outputs + self.outputs)

    def scale(self, running: Iterable[tuple[int, float]] = ()) -> float:
        """s: this run's lengths look like the prior's times s (1.0 before any evidence)."""
        running = [(int(age), float(count)) for age, count in running if count > 0 and age >= 1]
        if not self._ended and not self._cut and not running:
            return 1.0
        ended = np.array(list(self._ended.items()), float).reshape(-1, 2)
        censored = np.array(list(self._cut.items()) + running, float).reshape(-1, 2)
        stretch = np.exp(LOG_SCALE_GRID)[:, None]  # one row per candidate s
        prior_cdf = _prior_cdf(self.prior)
        # The stretched prior, mixed with a uniform length over [1, longest] weighing as one of
        # its pseudo-outputs: a length it rules out costs much, not all (else one output decides s).
        longest = float(max(self.prior.censored_at, ended[:, 0].max(initial=1), censored[:, 0].max(initial=1)))
        uniform = 1.0 / (self.prior_outputs + 1.0)
        density = (1 - uniform) * (prior_cdf(ended[:, 0] / stretch) - prior_cdf((ended[:, 0] - 1) / stretch)) + uniform / longest
        survival = (1 - uniform) * (1.0 - prior_cdf(censored[:, 0] / stretch)) + uniform * (1 - censored[:, 0] / longest)
        log_likelihood = (np.log(density) @ ended[:, 1] + np.log(np.maximum(survival, 1e-12)) @ censored[:, 1]
                          - 0.5 * (LOG_SCALE_GRID / LOG_SCALE_SIGMA) ** 2)
        return float(np.exp(LOG_SCALE_GRID[int(np.argmax(log_likelihood))]))

    def posterior(self, running: Iterable[tuple[int, float]] = ()) -> LengthDistribution:
        """The updated CDF. `running`: (tokens so far, how many) of outputs still being
        generated, censored at their age. Asked again with nothing new observed and the same
        `running`, the last one (an ETA asks twice a node; the stretch fit is ~10 ms at 2,000
        distinct lengths)."""
        running = list(running)
        key = (self._observed, tuple(running))
        if self._last is None or self._last[0] != key:
            self._last = (key, self._fit(running))
        return self._last[1]

    def _fit(self, running: list[tuple[int, float]]) -> LengthDistribution:
        ended: dict[int, float] = {}
        censored: dict[int, float] = {}

        def add(table: dict[int, float], length: int, weight: float) -> None:
            if weight > 0 and length >= 1:
                table[length] = table.get(length, 0.0) + weight

        stretch = self.scale(running)
        prior_cap = max(1, round(self.prior.censored_at * stretch))
        masses = np.diff(np.concatenate([[0.0], self.prior.cdf]))
        for length, mass in zip(self.prior.lengths.tolist(), masses.tolist()):
            if length >= self.prior.censored_at:
                add(censored, prior_cap, mass * self.prior_outputs)
            else:
                add(ended, max(1, round(length * stretch)), mass * self.prior_outputs)
        for length, count in self._ended.items():
            add(ended, length, count)
        for length, count in self._cut.items():
            add(censored, length, count)
        for age, count in running:
            add(censored, int(age), float(count))
        support = np.array(sorted(set(ended) | set(censored)), np.int64)
        events = np.array([ended.get(int(l), 0.0) for l in support])
        cuts = np.array([censored.get(int(l), 0.0) for l in support])
        at_risk = np.cumsum((events + cuts)[::-1])[::-1]
        survival = np.cumprod(1.0 - np.divide(events, at_risk, out=np.zeros_like(events), where=at_risk > 0))
        cdf = 1.0 - survival
        cut_points = [l for l, w in self._cut.items() if w > 0]
        support, cdf = _with_tail(support, cdf, events, events + cuts, max(cut_points, default=0))
        if (masses[-1] > 0 and self.prior.lengths[-1] >= self.prior.censored_at
                and prior_cap >= max(self._ended, default=0)):  # outputs of the run ended past it: not a cap here
            cut_points.append(prior_cap)
        keep = np.concatenate([[True], np.diff(cdf) > 1e-12])  # lengths no output ends at carry no mass
        keep[-1] = True
        support, cdf = support[keep], cdf[keep]
        cdf[-1] = 1.0  # what is left sits at the last length: the cap, or the tail's end
        censored_at = max(cut_points) if cut_points else int(support[-1]) + 1
        return LengthDistribution(support, cdf, censored_at)


def _prior_cdf(prior: LengthDistribution) -> Callable[[np.ndarray], np.ndarray]:
    """The prior's CDF as a continuous function of the length (linear between its points,
    from 0 at length 0); past its last uncensored length it stays there: the mass at the cap
    runs on beyond it."""
    censored = prior.lengths >= prior.censored_at
    xs = np.concatenate([[0.0], prior.lengths[~censored].astype(float)])
    ys = np.concatenate([[0.0], prior.cdf[~censored]])

    def cdf(length: np.ndarray) -> np.ndarray:
        return np.interp(length, xs, ys)

    return cdf


def _with_tail(support: np.ndarray, cdf: np.ndarray, events: np.ndarray, weights: np.ndarray,
               cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier leaves the mass past its last ended length on its last point; when that
    point is the age of outputs still running, it says they end now (200 numbers prompts at
    age 45: 22 still running, ~13 tokens each to go; a posterior ending them all at 45).
    Past the last ended length the tail is geometric instead, its hazard the ends per token
    at risk over the upper half of the lengths seen (outputs running on without ending lower
    it), and cut at `cap` (the longest output of the run cut at max_tokens) when that lies
    beyond the oldest output still running (a cut below it is another max_tokens, not
    theirs; the stretched prior's cap is a censoring, not a cut). Every length of the
    tail has its point for `TAIL_TOKENS` tokens past the last ended length and past the
    oldest age (so survival at any age is the geometric's own); the rest sits on the last."""
    ended_at = np.flatnonzero(events > 0)
    if not len(ended_at):
        return support, cdf
    last = int(ended_at[-1])
    left, last_length, oldest = 1.0 - float(cdf[last]), int(support[last]), int(support[-1])
    if cap < oldest:
        cap = 0
    if left <= 1e-12 or cap == last_length:  # nothing past it, or the rest is cut right there
        return support, cdf
    low = last_length // 2
    exposure = float(weights @ (np.clip(support, low, oldest) - low))
    hazard = float(events[support > low].sum()) / exposure if exposure > 0 else 1.0 / last_length
    hazard = min(max(hazard, 1e-6), 0.5)
    span = min(TAIL_TOKENS, int(np.ceil(np.log(1e-3) / np.log1p(-hazard))))  # 99.9 % of the tail, or TAIL_TOKENS
    steps = np.arange(1, span + 1)
    tail = np.unique(np.concatenate([last_length + steps, oldest + steps]))
    if cap > last_length:
        tail = np.append(tail[tail < cap], cap)
    tail_cdf = 1.0 - left * (1.0 - hazard) ** (tail - last_length)
    return np.concatenate([support[:last + 1], tail]), np.concatenate([cdf[:last + 1], tail_cdf])
