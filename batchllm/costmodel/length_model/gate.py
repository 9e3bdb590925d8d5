"""Is the length model better than the per-model CDF? Scored on outputs it was not fit on.

Both predict a distribution per request: the model base x exp(shift_i), the CDF one shared
distribution (shift 0, base = Kaplan-Meier of the training lengths). The score is censoring-
aware: the mean absolute error of log length of each request's predicted median, where an
output cut at its cap (known only to be at least that long) costs only what the prediction
falls short of the cap (predicting longer is no error). Lower is better. The model is used
only when it beats the CDF by `margin` (relative) on at least `min_outputs` held-out outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from batchllm.core.length_prompt import LengthPrompt
from batchllm.costmodel.length_model.model import LengthModel
from batchllm.costmodel.length_model.scores import log_error
from batchllm.costmodel.lengths import LengthDistribution

MARGIN = 0.03
MIN_OUTPUTS = 30
RANK_MIN = 0.55  # Harrell's C a model needs to order a prompt set's requests (0.5: chance; ordering by a weak
# ranker costs nothing against today's order, which knows nothing of lengths)


@dataclass(frozen=True)
class GateVerdict:
    use: bool
    model_score: float  # censoring-aware mean |log error| on held-out outputs (nan: not scored)
    cdf_score: float
    reason: str
    concordance: float = float("nan")  # Harrell's C of its shifts within each held-out prompt set (nan: not scored)

    @property
    def ranks(self) -> bool:
        """It orders a set's requests by length well enough for the runtime's split and order,
        where the level comes from the run's own answers (a pilot, the calibration)."""
        return bool(self.concordance >= RANK_MIN)

    @property
    def scored(self) -> bool:
        """Whether the model was compared with the CDF at all (else too few outputs to say)."""
        return not np.isnan(self.model_score)


def within_sets_concordance(model: LengthModel, prompts: Sequence[LengthPrompt], lengths: npt.ArrayLike, finished: npt.ArrayLike,
                            groups: Sequence[str]) -> float:
    """Harrell's C of the model's shifts against the lengths, inside each prompt set (levels
    differ between sets; the runtime learns a set's level from its own answers), averaged."""
    shifts, lengths, finished = model.log_shift(prompts), np.asarray(lengths, float), np.asarray(finished, bool)
    labels = np.asarray(list(groups))
    from batchllm.costmodel.length_model.censored_fit import concordance  # scipy.stats and sklearn: a fit's only

    scores = [concordance(shifts[labels == g], lengths[labels == g], ~finished[labels == g]) for g in sorted(set(groups))]
    return float(np.mean(scores)) if scores else float("nan")


def gate(model: LengthModel, cdf: LengthDistribution, prompts: Sequence[LengthPrompt], lengths: npt.ArrayLike, finished: npt.ArrayLike, *,
         margin: float = MARGIN, min_outputs: int = MIN_OUTPUTS) -> GateVerdict:
    """`prompts`, `lengths`, `finished`: held-out outputs (neither was fit on them)."""
    if len(prompts) < min_outputs:
        return GateVerdict(False, float("nan"), float("nan"),
                           f"{len(prompts)} held-out outputs, fewer than {min_outputs}: the per-model CDF is kept")
    model_score = log_error(model.base, model.request_lengths(prompts).log_shift, lengths, finished)
    cdf_score = log_error(cdf, np.zeros(len(prompts)), lengths, finished)
    if model_score < cdf_score * (1.0 - margin):
        return GateVerdict(True, model_score, cdf_score,
                           f"on {len(prompts)} held-out outputs the length model's log error {model_score:.3f} beats "
                           f"the per-model CDF's {cdf_score:.3f}")
    return GateVerdict(False, model_score, cdf_score,
                       f"on {len(prompts)} held-out outputs the length model's log error {model_score:.3f} does not beat "
                       f"the per-model CDF's {cdf_score:.3f} by {margin:.0%}: the CDF is kept")
