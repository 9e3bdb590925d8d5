"""How much of a length model's spread between requests holds on one prompt set.

A length model learnt on other prompt sets still says which of a new set's requests are
long and which short, and that spread is what the runtime splits replicas and orders
requests by (and what the planner's simulation draws each request's length from). When
it does not hold on the new set (a model learnt on first turns reads a conversation's
short follow-up, "go on", as a short answer), the split gives one replica the requests
it wrongly thinks short, and that replica ends last: the plan, which believed the
spread, ends with the other.

So the spread is scaled by the one factor in SPREAD_SCALES whose per-request expected
lengths (each cut at its max_tokens, taken relative to their mean as the runtime's
forecast does) come nearest, in squared error, to answers of that set: a pilot's, a
random sample of it whose answers all ended. 0 treats every request alike (what is known
without a length model); 1 keeps the model as it is. Ties go to the smaller scale.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from batchllm.costmodel.lengths import LengthDistribution
from batchllm.costmodel.request_lengths import RequestLengths, relative_shifts

SPREAD_SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)


def fitted_spread(level: LengthDistribution, shifts: npt.ArrayLike, lengths: npt.ArrayLike, caps: npt.ArrayLike) -> float:
    """The scale of `shifts` (per request, the length model's) that best predicts `lengths`
    (each request's answer, as long as the engine let it be: a cut answer counts its cap)
    with `level` the set's length distribution; `caps` each request's max_tokens."""
    shifts, lengths, caps = (np.asarray(values, float) for values in (shifts, lengths, caps))
    if not (shifts.size == lengths.size == caps.size):
        raise ValueError(f"{shifts.size} shifts, {lengths.size} lengths and {caps.size} caps: one each per request")
    if shifts.size < 2:
        return 1.0  # nothing to compare: the model as it is
    errors = [float(np.mean((RequestLengths(level, relative_shifts(scale * shifts), "pilot").expected(caps) - lengths) ** 2))
              for scale in SPREAD_SCALES]
    return SPREAD_SCALES[int(np.argmin(errors))]  # argmin: the first of equals, the smaller scale
