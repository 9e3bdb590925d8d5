"""A per-model output-length predictor: each request's length as the shared base distribution
times exp(its shift), the shift read off its prompt (RequestLengths' accelerated-failure-time
form).

    model = LengthModel.fit(prompts, lengths, finished)     # finished False: cut at max_tokens
    model.request_lengths(prompts)                          # RequestLengths(base, shifts, "length model")
    model.scaled_to(pilot_prompts, pilot_lengths)           # the same, its level set by a pilot's outputs
    LengthModel.fit(..., groups=prompt_sets).for_new_set()  # for a prompt set it has not seen

The shift is linear in the prompt's features (features.py), fit to log length with the
censored outputs as lower bounds (censored_fit.py), and centred so it averages 0 over the
training outputs. The base is the Kaplan-Meier distribution of the outputs' residual lengths
length / exp(shift), each shift predicted without its own output (out of fold), so the
base's spread is what a new prompt's length has around its prediction. Saved as numbers
(.npz, .json), no pickle.

A prompt with a longer conversation before its last turn than the training prompts had
(HISTORY_MARGIN x their 99th percentile; any conversation when none had one) is outside what
the shift learnt (a short "go on" after a long chat reads as a short task): its length
(request_lengths) gets the level of the per-model CDF, the capped mean of all training outputs
alike. Its log_shift, what the features say, still orders it against other requests.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from batchllm.core.files import replacing
from batchllm.core.length_prompt import LengthPrompt
from batchllm.costmodel.length_model.features import FEATURES_VERSION, features, width
from batchllm.costmodel.length_model.new_sets import NewSetCalibration, calibrate_new_sets, residual_base
from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.request_lengths import RequestLengths

MODEL_FILE, NUMBERS_FILE = "length_model.json", "length_model.npz"
HISTORY_MARGIN = 1.25  # x the training prompts' 99th percentile of history_chars: outside what was learnt beyond it


@dataclass(frozen=True)
class LengthModel:
    coef: np.ndarray  # one per feature column (features.width())
    intercept: float  # centred: the training outputs' shifts average 0
    sigma: float  # residual spread of log length, out of fold (a new prompt's)
    base: LengthDistribution
    trained_on: int  # outputs fit on
    alpha: float  # ridge penalty
    new_set: NewSetCalibration | None = None  # how it carries over to an unseen prompt set (new_sets.py)
    history_limit_chars: float = math.inf  # a prompt with a longer history gets outside_shift (inf: none known)
    outside_shift: float = 0.0  # base x exp(it) has the per-model CDF's capped mean at the training outputs' caps

    @classmethod
    def fit(cls, prompts: Sequence[LengthPrompt], lengths: npt.ArrayLike, finished: npt.ArrayLike, *, groups: Sequence[str] | None = None,
            alpha: float | None = None, seed: int = 0) -> LengthModel:
        """`lengths` output tokens; `finished[i]` False when output i was cut (max_tokens, or
        still running): then its length is only a lower bound. `groups` each output's prompt
        set: with three or more, the model also learns how it carries over to a new set
        (for_new_set). `alpha` the ridge penalty (None: chosen out of fold; a refit with a few
        more outputs can keep the last one's)."""
        lengths = np.asarray(lengths, float).clip(min=1.0)
        finished = np.asarray(finished, bool)
        if len(prompts) != lengths.size or lengths.size != finished.size:
            raise ValueError(f"{len(prompts)} prompts, {lengths.size} lengths, {finished.size} finished flags")
        if lengths.size < 8:
            raise ValueError(f"a length model needs at least 8 outputs, got {lengths.size}")
        matrix = features(prompts)
        from batchllm.costmodel.length_model.censored_fit import fit_censored  # scipy.stats, sklearn: a fit's only

        fit = fit_censored(matrix, np.log(lengths), ~finished, alpha=alpha, seed=seed)
        centre = float(np.mean(fit.predict(matrix)))
        base = residual_base(lengths, finished, fit.out_of_fold - centre)
        new_set = calibrate_new_sets(matrix, lengths, finished, groups, fit.alpha, seed) if groups is not None else None
        caps = np.array([p.max_tokens for p in prompts], float)
        cdf_mean = float(np.mean(RequestLengths.shared(LengthDistribution.fit(lengths.astype(np.int64), finished),
                                                       lengths.size, "prior").expected(caps)))
        if new_set is not None:
            new_set = replace(new_set, outside_shift=_offset_to_mean(new_set.base, np.zeros(caps.size), caps, cdf_mean))
        known = [p.history_chars for p in prompts if p.history_chars is not None]
        history_limit = HISTORY_MARGIN * float(np.percentile(known, 99)) if known else math.inf
        return cls(fit.coef.astype(np.float32), fit.intercept - centre, fit.sigma, base, int(lengths.size), fit.alpha, new_set,
                   history_limit, _offset_to_mean(base, np.zeros(caps.size), caps, cdf_mean))

    def for_new_set(self) -> LengthModel:
        """The model for a prompt set none of its outputs came from: each shift times the share
        that carried over to held-out sets, on their residual base (itself when it was not fit
        on three or more prompt sets)."""
        if self.new_set is None:
            return self
        k = self.new_set.transfer
        return replace(self, coef=self.coef * np.float32(k), intercept=self.intercept * k, base=self.new_set.base,
                       new_set=None, outside_shift=self.new_set.outside_shift)

    def log_shift(self, prompts: Sequence[LengthPrompt]) -> np.ndarray:
        """What the features say of each prompt: for ordering requests against each other."""
        if not prompts:
            return np.zeros(0)
        return np.asarray(features(prompts) @ self.coef, float).ravel() + self.intercept

    def request_lengths(self, prompts: Sequence[LengthPrompt], source: str = "length model") -> RequestLengths:
        """Each request's length; a prompt after a longer conversation than the training prompts'
        gets outside_shift (the per-model CDF's mean), not what its last turn reads as."""
        shifts = self.log_shift(prompts)
        outside = [p.history_chars is not None and p.history_chars > self.history_limit_chars for p in prompts]
        shifts[np.array(outside, bool)] = self.outside_shift
        return RequestLengths(self.base, shifts, source)

    def shifted(self, offset: float) -> LengthModel:
        """Every request's length times exp(offset)."""
        return replace(self, intercept=self.intercept + float(offset), outside_shift=self.outside_shift + float(offset))

    def scaled_to(self, prompts: Sequence[LengthPrompt], lengths: npt.ArrayLike, caps: npt.ArrayLike | None = None) -> LengthModel:
        """This model moved by the one offset that makes its expected capped length over these
        outputs (a pilot's) their mean. `lengths` as the engine reported them (a cut output
        counts its cap, exactly what min(length, cap) is); `caps` each one's max_tokens (by
        default the prompts')."""
        caps = np.asarray([p.max_tokens for p in prompts] if caps is None else caps, float)
        shifts = self.request_lengths(prompts).log_shift
        return self.shifted(_offset_to_mean(self.base, shifts, caps, float(np.mean(np.asarray(lengths, float)))))

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        nonzero = np.flatnonzero(self.coef)
        with replacing(folder / NUMBERS_FILE) as new:
            with open(new.path, "wb") as handle:
                new_base = self.new_set.base if self.new_set else LengthDistribution(np.zeros(0, np.int64), np.zeros(0), 0)
                np.savez_compressed(handle, coef_index=nonzero.astype(np.int64), coef_value=self.coef[nonzero],
                                    base_lengths=self.base.lengths, base_cdf=self.base.cdf, new_base_lengths=new_base.lengths,
                                    new_base_cdf=new_base.cdf)
        record = {"features_version": FEATURES_VERSION, "width": int(self.coef.size), "intercept": self.intercept,
                  "sigma": self.sigma, "censored_at": self.base.censored_at, "trained_on": self.trained_on, "alpha": self.alpha,
                  "history_limit_chars": self.history_limit_chars, "outside_shift": self.outside_shift,
                  "new_set": None if self.new_set is None else {"transfer": self.new_set.transfer, "sets": self.new_set.sets,
                                                                "censored_at": self.new_set.base.censored_at,
                                                                "outside_shift": self.new_set.outside_shift}}
        with replacing(folder / MODEL_FILE) as new:
            new.path.write_text(json.dumps(record, indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path) -> LengthModel:
        folder = Path(folder)
        record = json.loads((folder / MODEL_FILE).read_text())
        if record.get("features_version") != FEATURES_VERSION or record.get("width") != width():
            raise ValueError(f"the length model in {folder} was saved with other features "
                             f"(version {record.get('features_version')}, this is {FEATURES_VERSION}): fit it again")
        with np.load(folder / NUMBERS_FILE, allow_pickle=False) as numbers:
            coef = np.zeros(record["width"], np.float32)
            coef[numbers["coef_index"]] = numbers["coef_value"]
            base = LengthDistribution(numbers["base_lengths"].astype(np.int64), numbers["base_cdf"].astype(float),
                                      int(record["censored_at"]))
            new = record.get("new_set")
            new_set = None if new is None else NewSetCalibration(
                float(new["transfer"]), LengthDistribution(numbers["new_base_lengths"].astype(np.int64),
                                                           numbers["new_base_cdf"].astype(float), int(new["censored_at"])),
                int(new["sets"]), float(new["outside_shift"]))
        return cls(coef, float(record["intercept"]), float(record["sigma"]), base, int(record["trained_on"]),
                   float(record["alpha"]), new_set, float(record["history_limit_chars"]), float(record["outside_shift"]))


def _offset_to_mean(base: LengthDistribution, shifts: np.ndarray, caps: np.ndarray, mean: float) -> float:
    """The one offset to every shift that makes the expected capped length over these requests `mean`."""
    low, high = -6.0, 6.0  # the capped mean only grows with the offset
    for _ in range(50):
        middle = (low + high) / 2
        below = float(np.mean(RequestLengths(base, shifts + middle, "prior").expected(caps))) < mean
        low, high = (middle, high) if below else (low, middle)
    return (low + high) / 2
