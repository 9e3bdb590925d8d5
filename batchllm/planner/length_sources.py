"""Where a node's predicted output lengths come from: the planner's one seam for them.

`LengthsFor` takes a node's data summary (its sample of requests, each with the fields of
a `LengthPrompt`: `length_prompts(summary)`) and the profile it is planned with, and gives
one `RequestLengths` per sample row. The default, `profile_lengths`, is the profile's CDF
for every request alike: source "store" when the profile was learnt on this machine (the
local profile store), else "prior". A per-request length model or a pilot plugs in here
(`plan_dag(..., lengths_for=...)`, `dag_workloads(..., lengths_for=...)`); `LengthModels`
gives the one fit on the local store's outputs (`ObservationStore.fitted_model`: used only
where it beats the per-model CDF on held-out outputs, the verdict said either way). A node
whose prompt set the store has outputs of (its pilot's, an earlier run's) is planned at that
set's own level (`LengthModels.at_set_levels`), a new one at the level a new set gets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from batchllm.core.length_prompt import LengthPrompt
from batchllm.costmodel.length_model.model import LengthModel
from batchllm.costmodel.length_model.observations import Observations, ObservationStore
from batchllm.costmodel.profile import Profile
from batchllm.costmodel.request_lengths import RequestLengths
from batchllm.dag.model import DagSpec
from batchllm.io.node_data import NodeSummary

LengthsFor = Callable[[NodeSummary, Profile], RequestLengths]  # one per sample row of the summary, in its order


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
    set_levels: Mapping[str, LengthModel] = field(default_factory=dict)  # per node: its model at its prompt set's own level

    @classmethod
    def at_home(cls, home: Path, model_names: Sequence[str]) -> "LengthModels":
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

    def log_shifts(self, dag: DagSpec) -> dict[str, Callable[[Sequence[LengthPrompt]], np.ndarray]]:
        """Per node whose model orders requests: its per-request shifts (the runtime's forecast
        takes them relative to each window's mean)."""
        return {name: model.log_shift for name, node in dag.nodes.items() if (model := self.rankers.get(node.model)) is not None}

    def at_set_levels(self, home: Path, node_sets: Mapping[str, tuple[str, str]]) -> "LengthModels":
        """These models, each node (`node_sets`: per node, its model and the prompt set its outputs are
        filed under) whose prompt set the store has outputs of planned at that set's own level: its model moved so its
        expected capped length over those outputs is their mean (`LengthModel.scaled_to`, as a pilot's
        outputs set a new set's level). At the pooled level of every set it learnt from, the run after
        a pilot of 276 long answers put them at 72.6 s where they took 84.2 s (calibration.py
        --commands on an AVX-512 host, 2026-11-28: its other sets were one-word answers)."""
        levels: dict[str, LengthModel] = {}
        loaded: dict[str, Observations] = {}
        for name, (model_name, key) in node_sets.items():
            model = self.models.get(model_name)
            if model is None or key not in self.known_prompt_sets:
                continue
            if model_name not in loaded:
                loaded[model_name] = ObservationStore.at_home(home, model_name).load()
            seen = loaded[model_name]
            rows = [i for i, filed in enumerate(seen.prompt_sets) if filed == key]
            if rows:
                levels[name] = model.scaled_to([seen.prompts[i] for i in rows], seen.lengths[rows])
        return replace(self, set_levels=levels)

    def lengths_for(self, summary: NodeSummary, profile: Profile) -> RequestLengths:
        """A `LengthsFor`: the node's model's length model where one is used (at its prompt set's
        own level where the store has outputs of it, else at the level a new set gets), else the
        profile's CDF."""
        own = self.set_levels.get(summary.name)
        if own is not None:
            return own.request_lengths(length_prompts(summary))
        model = self.models.get(summary.model)
        if model is None:
            return profile_lengths(summary, profile)
        return model.for_new_set().request_lengths(length_prompts(summary))


def node_sets(dag: DagSpec, prompt_sets: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Per node: its model and the prompt set its outputs are filed under (`prompt_sets`: its fingerprint)."""
    return {name: (node.model, prompt_sets[name]) for name, node in dag.nodes.items()}


def profile_lengths(summary: NodeSummary, profile: Profile) -> RequestLengths:
    """The profile's CDF for every request alike (what the planner assumed before lengths were predicted)."""
    return RequestLengths.shared(profile.lengths, len(summary.prompt_tokens), "store" if profile.kind == "learnt" else "prior")


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
