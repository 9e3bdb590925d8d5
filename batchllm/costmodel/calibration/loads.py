"""An engine's start cost (launch until it takes requests), from the starts a run saw.

Posterior mean with the prior counted as `prior_loads` starts: one start already moves
it nearly all the way, since a start is a single long measurement, not a noisy small one,
and what slows starts here (cold caches, a busy machine) the prior cannot know.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_LOADS = 0.1
MIN_LOAD_S = 1.0  # a start shorter than this loaded nothing (a stand-in engine): not a measurement


@dataclass
class LoadCalibration:
    prior_s: float
    prior_loads: float = PRIOR_LOADS
    loads: int = 0
    total_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prior_loads <= 0:
            raise ValueError(f"prior_loads must be positive, got {self.prior_loads}")

    def observe(self, load_s: float) -> None:
        if load_s >= MIN_LOAD_S:
            self.loads += 1
            self.total_s += load_s

    def posterior_s(self) -> float:
        return (self.prior_loads * self.prior_s + self.total_s) / (self.prior_loads + self.loads)

    def factor(self) -> float:
        """Posterior over prior (1 when the prior is zero)."""
        return self.posterior_s() / self.prior_s if self.prior_s > 0 else 1.0
