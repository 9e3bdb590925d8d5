"""Each model's output-length distribution, updated from the outputs a run finishes.

Censoring, as the profile builder treats it (Kaplan-Meier): an output cut at max_tokens
says only "at least this long", and so does an output still being generated (its age, in
tokens so far). Without the second, the first outputs of a run, which are the short
ones, would make every output look short.

Prior: the profile's CDF counted as `prior_outputs` pseudo-outputs (its probability
masses; the mass it holds at its own cap is censored there). Counts per length only, so
memory is bounded by the longest output, not by the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from batchllm.costmodel.lengths import LengthDistribution

PRIOR_OUTPUTS = 32.0  # the prior counts as this many outputs


@dataclass
class LengthCalibration:
    prior: LengthDistribution
    prior_outputs: float = PRIOR_OUTPUTS
    _ended: dict[int, float] = field(default_factory=dict, repr=False)  # length -> outputs that stopped there
    _cut: dict[int, float] = field(default_factory=dict, repr=False)  # length -> outputs cut there (max_tokens)

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

    def observe_many(self, lengths: Iterable[int], finished: Iterable[bool]) -> None:
        for length, done in zip(lengths, finished):
            self.observe(length, done)

    @property
    def outputs(self) -> float:
        return sum(self._ended.values()) + sum(self._cut.values())

    @property
    def prior_share(self) -> float:
        return self.prior_outputs / (self.prior_outputs + self.outputs)

    def posterior(self, running: Iterable[tuple[int, float]] = ()) -> LengthDistribution:
        """The updated CDF. `running`: (tokens so far, how many) of outputs still being
        generated, censored at their age."""
        ended: dict[int, float] = {}
        censored: dict[int, float] = {}

        def add(table: dict[int, float], length: int, weight: float) -> None:
            if weight > 0 and length >= 1:
                table[length] = table.get(length, 0.0) + weight

        masses = np.diff(np.concatenate([[0.0], self.prior.cdf]))
        for length, mass in zip(self.prior.lengths.tolist(), masses.tolist()):
            add(censored if length >= self.prior.censored_at else ended, length, mass * self.prior_outputs)
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
        keep = np.concatenate([[True], np.diff(cdf) > 1e-12])  # lengths no output ends at carry no mass
        keep[-1] = True
        support, cdf = support[keep], cdf[keep]
        cdf[-1] = 1.0  # the mass beyond the longest length seen sits there
        cut_points = [l for l, w in self._cut.items() if w > 0]
        if masses[-1] > 0 and self.prior.lengths[-1] >= self.prior.censored_at:
            cut_points.append(int(self.prior.censored_at))
        censored_at = max(cut_points) if cut_points else int(support[-1]) + 1
        return LengthDistribution(support, cdf, censored_at)
