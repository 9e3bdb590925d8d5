"""The censoring-aware score the gate and the new-set calibration compare predictions by."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from batchllm.costmodel.lengths import LengthDistribution


def median(distribution: LengthDistribution) -> float:
    index = min(int(np.searchsorted(distribution.cdf, 0.5, side="left")), distribution.lengths.size - 1)
    return float(distribution.lengths[index])


def log_error(base: LengthDistribution, log_shift: np.ndarray, lengths: npt.ArrayLike, finished: npt.ArrayLike) -> float:
    """Mean over outputs of |log length - log predicted median| (the median of base x
    exp(shift)); for a cut output, only how far the prediction falls short of its length
    (predicting longer than an output that was cut is no error)."""
    actual = np.log(np.maximum(np.asarray(lengths, float), 1.0))
    predicted = np.log(median(base)) + np.asarray(log_shift, float)
    error = np.where(np.asarray(finished, bool), np.abs(actual - predicted), np.maximum(actual - predicted, 0.0))
    return float(np.mean(error))
