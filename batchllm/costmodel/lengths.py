"""Output-length distribution of a model: an empirical CDF, corrected for censoring.

A profiling run caps outputs at `max_tokens`, so an output that hit the cap says only
"at least this long". The probability of ending at length l is estimated over the
requests that could have reached l (Kaplan-Meier); the mass left beyond the longest
observed cap sits at that cap, which is the model's "runs to the limit" share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    lengths: np.ndarray  # sorted support, in tokens (>= 1)
    cdf: np.ndarray  # P(X <= lengths[i]); last value is 1.0
    censored_at: int  # the largest length an output was cut at (the profiling cap)

    @classmethod
    def fit(cls, lengths: list[int] | np.ndarray, finished: list[bool] | np.ndarray) -> LengthDistribution:
        """`finished[i]` is False when output i was cut by the cap (finish_reason 'length')."""
        lengths = np.asarray(lengths, dtype=np.int64)
        finished = np.asarray(finished, dtype=bool)
        if lengths.size == 0:
            raise ValueError("cannot fit an output-length distribution on no samples")
        if (lengths < 1).any():
            raise ValueError(f"output lengths must be >= 1, got {int(lengths.min())}")
        support = np.unique(lengths)
        at_risk = lengths.size - np.searchsorted(np.sort(lengths), support, side="left")
        ended = np.array([np.count_nonzero((lengths == l) & finished) for l in support])
        survival = np.cumprod(1.0 - ended / at_risk)
        cdf = 1.0 - survival
        cdf[-1] = 1.0  # remaining mass: at the largest cap
        censored_at = int(lengths[~finished].max()) if (~finished).any() else int(support[-1]) + 1
        return cls(lengths=support, cdf=cdf, censored_at=censored_at)

    def sample(self, count: int, seed: int) -> np.ndarray:
        """`count` lengths drawn by inverse CDF with a fixed seed."""
        uniform = np.random.default_rng(seed).random(count)
        return self.lengths[np.searchsorted(self.cdf, uniform, side="right").clip(max=self.lengths.size - 1)]

    def mean(self) -> float:
        probabilities = np.diff(np.concatenate([[0.0], self.cdf]))
        return float((probabilities * self.lengths).sum())

    def to_rows(self) -> list[dict]:
        return [{"length": int(l), "cdf": float(c)} for l, c in zip(self.lengths, self.cdf)]

    @classmethod
    def from_rows(cls, rows: list[dict], censored_at: int) -> LengthDistribution:
        return cls(np.array([r["length"] for r in rows], np.int64), np.array([r["cdf"] for r in rows], float), censored_at)


def output_lengths(distribution: LengthDistribution, prompt_lengths: np.ndarray, max_tokens: np.ndarray | int,
                   max_model_len: int, seed: int, known: np.ndarray | None = None) -> np.ndarray:
    """min(X, max_tokens, max_model_len - prompt_len) per request, X sampled (or known)."""
    prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64)
    drawn = np.asarray(known, dtype=np.int64) if known is not None else distribution.sample(prompt_lengths.size, seed)
    room = np.maximum(max_model_len - prompt_lengths, 1)
    return np.minimum(np.minimum(drawn, max_tokens), room).clip(min=1)
