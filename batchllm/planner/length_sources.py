"""Where a node's predicted output lengths come from, as the planner asks for them.

The planner asks each node's `OutputLengths` (`costmodel.output_lengths`, the one seam for
output lengths) for its sample rows' lengths, from the node's data summary (its sample of
requests, each with the fields of a `LengthPrompt`: `length_prompts(summary)`) and the
profile it is planned with. The default, `UNLEARNT`, is the profile's CDF for every request
alike: source "store" when the profile was learnt on this machine (the local profile store),
else "prior". A per-request length model plugs in here (`plan_dag(..., lengths=...)`,
`dag_workloads(..., lengths=...)`); `LengthModels.planned` gives each node the one fit on the
local store's outputs for its model (`ObservationStore.fitted_model`: used only where it
beats the per-model CDF on held-out outputs, the verdict said either way), as a
`ModelLengths`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchllm.core.length_prompt import LengthPrompt
from batchllm.costmodel.length_model.model import LengthModel
from batchllm.costmodel.length_model.observations import ObservationStore
from batchllm.costmodel.output_lengths import UNLEARNT, LogShift, OutputLengths, UnlearntLengths
from batchllm.costmodel.profile import Profile
from batchllm.costmodel.request_lengths import RequestLengths
from batchllm.dag.model import DagSpec
from batchllm.io.node_data import NodeSummary


class ModelLengths(UnlearntLengths):
    """A length model as a node's `OutputLengths` for the planner: its sample rows at the
    model's own level (the lengths of every prompt set it learnt from), each with its shift.
    What the run learns of the node is the run's (`NodeLengths`): to the runtime it is unlearnt."""

    def __init__(self, model: LengthModel):
        self.model = model

    def sample_lengths(self, summary: NodeSummary, profile: Profile) -> RequestLengths:
        return self.model.for_new_set().request_lengths(length_prompts(summary))  # the planner does not know if the set is new


@dataclass(frozen=True)
class LengthModels:
    """Per model (as nodes name it): its length model where its lengths beat the per-model CDF
    (`models`: the planner's per-request lengths) and where it orders a prompt set's requests
    well (`rankers`: the runtime's split and order, whose level the run learns), and why or
    why not (when there were outputs enough to compare)."""

    models: dict[str, LengthModel]
    rankers: dict[str, LengthModel]
    verdicts: dict[str, str]
    known_prompt_sets: frozenset[str]

    @classmethod
    def at_home(cls, home: Path, model_names: Sequence[str]) -> LengthModels:
        models, rankers, verdicts, known = {}, {}, {}, set()
        for name in dict.fromkeys(model_names):
            store = ObservationStore.at_home(home, name)
            if not store.path.is_file():  # nothing seen yet: nothing to say
                continue
            known |= store.prompt_sets()
            model, verdict = store.fitted_model()
            if verdict.scored:  # too few outputs to compare says nothing worth printing
                use = "lengths and order" if verdict.use else "order only" if verdict.ranks else "not used"
                verdicts[name] = f"{use}: {verdict.reason}"
            if model is not None and verdict.use:
                models[name] = model
            if model is not None and (verdict.use or verdict.ranks):
                rankers[name] = model
        return cls(models, rankers, verdicts, frozenset(known))

    def log_shifts(self, dag: DagSpec) -> dict[str, LogShift]:
        """Per node whose model orders requests: its per-request shifts (the runtime's forecast
        takes them relative to each window's mean)."""
        return {name: model.log_shift for name, node in dag.nodes.items() if (model := self.rankers.get(node.model)) is not None}

    def planned(self, dag: DagSpec) -> dict[str, OutputLengths] | None:
        """Per node, the lengths the planner predicts: its model's length model where one is
        used, else the profile's CDF; None where no model of the DAG has one used (the
        estimates then sample each profile's CDF as they always did)."""
        if not self.models:
            return None
        return {name: ModelLengths(model) if (model := self.models.get(node.model)) is not None else UNLEARNT
                for name, node in dag.nodes.items()}


def length_prompts(summary: NodeSummary) -> list[LengthPrompt]:
    """What a length model reads of each sample row's request."""
    return list(summary.samples)


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
