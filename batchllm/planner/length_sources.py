"""Where a node's predicted output lengths come from: the planner's one seam for them.

`LengthsFor` takes a node's data summary (its sample of requests, each with the fields of
a `LengthPrompt`: `length_prompts(summary)`) and the profile it is planned with, and gives
one `RequestLengths` per sample row. The default, `profile_lengths`, is the profile's CDF
for every request alike: source "store" when the profile was learnt on this machine (the
local profile store), else "prior". A per-request length model or a pilot plugs in here
(`plan_dag(..., lengths_for=...)`, `dag_workloads(..., lengths_for=...)`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from batchllm.costmodel.profile import Profile
from batchllm.costmodel.request_lengths import LengthPrompt, RequestLengths
from batchllm.io.node_data import NodeSummary

LengthsFor = Callable[[NodeSummary, Profile], RequestLengths]  # one per sample row of the summary, in its order


def profile_lengths(summary: NodeSummary, profile: Profile) -> RequestLengths:
    """The profile's CDF for every request alike (what the planner assumed before lengths were predicted)."""
    return RequestLengths.shared(profile.lengths, len(summary.prompt_tokens), "store" if profile.kind == "learnt" else "prior")


def length_prompts(summary: NodeSummary) -> list[LengthPrompt]:
    """What a length model reads of each sample row's request."""
    return [LengthPrompt(s.last_user, s.system, s.template, s.prompt_tokens, s.max_tokens, s.temperature)
            for s in summary.samples]


def output_caps(summary: NodeSummary, max_tokens: int) -> np.ndarray:
    """Per sample row, the most tokens it can generate: max_tokens, and the room its prompt
    leaves in the context (at least 1, as the estimator caps them)."""
    caps = np.full(len(summary.prompt_tokens), max_tokens, np.int64)
    if summary.max_model_len is not None:
        caps = np.minimum(caps, np.maximum(summary.max_model_len - summary.prompt_tokens, 1))
    return caps


def output_quantiles(lengths: RequestLengths, caps: np.ndarray, qs: tuple[float, ...]) -> tuple[float, ...]:
    """Quantiles of the output lengths of the requests together (a request's length is
    min(base x e^shift, cap)): the smallest x with P(length <= x) >= q, over the requests' mixture."""
    if len(lengths) == 0:
        return tuple(0.0 for _ in qs)
    scale = np.exp(lengths.log_shift)
    support = lengths.base.lengths.astype(float)
    cdf = lengths.base.cdf
    candidates = np.unique(np.minimum(np.outer(scale, support), caps[:, None]).ravel())

    def share_at_most(x: float) -> float:
        index = np.searchsorted(support, x / scale * (1 + 1e-12), side="right") - 1
        below = np.where(index >= 0, cdf[np.clip(index, 0, None)], 0.0)
        return float(np.mean(np.where(caps <= x, 1.0, below)))

    result = []
    for q in qs:
        low, high = 0, candidates.size - 1
        while low < high:  # the first candidate whose share reaches q
            middle = (low + high) // 2
            if share_at_most(candidates[middle]) >= q - 1e-12:
                high = middle
            else:
                low = middle + 1
        result.append(float(candidates[low]))
    return tuple(result)
