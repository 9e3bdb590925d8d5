"""How much of the length model carries over to a prompt set it has not seen.

Within a prompt set the model learns what makes one answer longer than another; across sets
part of that does not carry over (a short last turn means a short answer in a set of quiz
questions, not in a conversation that asks to "continue"). Measured by leaving training prompt
sets out: the model fit on the other sets predicts a held-out set's shifts s. With more than
SET_FOLDS sets, they are held out SET_FOLDS groups at a time (each set in one group, by a
stable hash) rather than one by one: a fit a set made the cost grow with the sets a store had
seen (47 small sets on a 2-core AVX2 host: over 200 s at a run's start), SET_FOLDS fits bound it.
A new set's lengths are then base' x exp(k s), k in [0, 1] the share of the shift that
carries over and base' the Kaplan-Meier distribution of the held-out outputs' residuals
length / exp(k s): k minimises the censoring-aware log error (scores.py) of each held-out set
over that of the CDF (k = 0), averaged over the sets, so every set counts alike (a set whose
CDF error is large does not outweigh the others). k = 0 is the per-model CDF itself (base' =
the lengths' own distribution), so over the held-out sets the calibrated model's error,
relative to the CDF's set by set, is never worse on average than the CDF's.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchllm.costmodel.length_model.scores import log_error
from batchllm.costmodel.lengths import LengthDistribution

MIN_SETS = 3  # prompt sets needed to measure the carry-over
SET_FOLDS = 8  # at most this many fits without a group of sets
TRANSFERS = np.linspace(0.0, 1.0, 11)
ERROR_FLOOR = 0.05  # log error added to each set's, so a set the CDF fits almost exactly does not decide alone


@dataclass(frozen=True)
class NewSetCalibration:
    transfer: float  # k: the share of each shift that carries over to a new set
    base: LengthDistribution  # base' of a new set's requests
    sets: int  # prompt sets it was measured on
    outside_shift: float = 0.0  # LengthModel.outside_shift on this base


def residual_base(lengths: np.ndarray, finished: np.ndarray, shifts: np.ndarray) -> LengthDistribution:
    """Kaplan-Meier of length / exp(shift), whole tokens (a cut output's residual is cut too)."""
    residual = np.maximum(np.rint(np.asarray(lengths, float) / np.exp(shifts)), 1).astype(np.int64)
    return LengthDistribution.fit(residual, finished)


def calibrate_new_sets(matrix: Any, lengths: np.ndarray, finished: np.ndarray, groups: Sequence[str], alpha: float,
                       seed: int = 0) -> NewSetCalibration | None:
    """None when the outputs come from fewer than MIN_SETS prompt sets."""
    keys = sorted(set(groups))
    if len(keys) < MIN_SETS:
        return None
    labels = np.asarray(groups, dtype=object)
    targets = np.log(np.maximum(lengths, 1.0))
    shifts = np.zeros(lengths.size)
    for fold in set_folds(keys, seed):
        out = np.isin(labels, fold)
        held, kept = np.flatnonzero(out), np.flatnonzero(~out)
        from batchllm.costmodel.length_model.censored_fit import fit_censored  # scipy.stats and sklearn: a fit's only

        fit = fit_censored(matrix[kept], targets[kept], ~finished[kept], alpha=alpha, iterations=3, seed=seed)
        shifts[held] = fit.predict(matrix[held]) - float(np.mean(fit.predict(matrix[kept])))
    best = best_transfer(shifts, lengths, finished, labels)
    return NewSetCalibration(best, residual_base(lengths, finished, best * shifts), len(keys))


def set_folds(keys: Sequence[str], seed: int = 0) -> list[list[str]]:
    """The groups of prompt sets held out together: one a set up to SET_FOLDS sets, else at most
    SET_FOLDS groups, each set's by a stable hash of its name (a refit with one more set moves
    no other)."""
    keys = sorted(set(keys))
    if len(keys) <= SET_FOLDS:
        return [[key] for key in keys]
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(zlib.crc32(f"{seed}:{key}".encode()) % SET_FOLDS, []).append(key)
    return [groups[k] for k in sorted(groups)]


def best_transfer(shifts: np.ndarray, lengths: np.ndarray, finished: np.ndarray, labels: np.ndarray) -> float:
    """The k of TRANSFERS whose held-out log error, each set's over its error at k = 0, is least
    on average over the sets (the smaller k on a tie). `shifts`: each output's, predicted by a
    model fit without its set; `labels`: each output's set."""
    sets = [labels == key for key in sorted(set(labels.tolist()))]

    def set_errors(k: float) -> np.ndarray:
        base = residual_base(lengths, finished, k * shifts)
        return np.array([log_error(base, k * shifts[rows], lengths[rows], finished[rows]) for rows in sets])

    cdf_errors = set_errors(0.0) + ERROR_FLOOR
    _, best = min((float(np.mean((set_errors(k) + ERROR_FLOOR) / cdf_errors)), float(k)) for k in TRANSFERS)
    return best
