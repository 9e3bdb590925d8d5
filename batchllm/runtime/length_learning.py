"""What a run teaches the length model, and what the length model gives the run.

At the start, each model's length model is fit on the outputs the local store has seen
(`planner.length_sources.LengthModels`), and the node fingerprints the store holds outputs
of are the prompt sets that are not new (no pilot). As the run goes, a sample of
each node's requests (the first `SAMPLE_PER_NODE` rendered, its pilot's among them) is
remembered as what the length model reads of them, and when their outputs are committed
the pairs are kept; at the end they are filed in the store under the node's fingerprint,
unless the node's engines reported another engine than the installed one (a stand-in
engine's answers teach nothing about the model's). Memory is bounded by the sample,
whatever the run's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchllm.core.length_prompt import LengthPrompt
from batchllm.core.requests import EngineRequest, FinishReason
from batchllm.costmodel.length_model.observations import ObservationStore
from batchllm.engines.protocol import EngineConfig, WorkerReady
from batchllm.runtime.observer import RunObserver
from batchllm.runtime.step_result import StepResult

SAMPLE_PER_NODE = 2_000


@dataclass
class LengthSampler(RunObserver):
    """Remembers a sample of each node's requests and pairs them with their outputs."""

    fingerprints: dict[str, str]  # node -> its fingerprint (the prompt set's key)
    models: dict[str, str]  # node -> model
    engine_version: str | None = None  # the installed engine's, as engines report it (None: any)
    _foreign: dict[str, str] = field(default_factory=dict)  # model -> the other engine version its engines reported
    _waiting: dict[str, dict[object, LengthPrompt]] = field(default_factory=dict)  # node -> request id -> what was sent
    _seen: dict[str, list[tuple[LengthPrompt, int, bool]]] = field(default_factory=dict)
    _taken: dict[str, int] = field(default_factory=dict)

    def remember(self, node: str, requests: Sequence[EngineRequest]) -> None:
        room = SAMPLE_PER_NODE - self._taken.get(node, 0)
        if room <= 0 or not requests:
            return
        picked = requests[:room]
        waiting = self._waiting.setdefault(node, {})
        for request in picked:
            waiting[request.request_id] = LengthPrompt.of(request, node)
        self._taken[node] = self._taken.get(node, 0) + len(picked)

    def engine_started(self, node: str, config: EngineConfig, load_time_s: float, ready: WorkerReady) -> None:
        if self.engine_version is not None and ready.engine_version != self.engine_version:
            self._foreign[self.models[node]] = ready.engine_version  # engines pass between a model's nodes

    def observe(self, result: StepResult) -> None:
        for commit in result.commits:
            waiting = self._waiting.get(commit.node)
            if not waiting:
                continue
            seen = self._seen.setdefault(commit.node, [])
            for r in commit.results:
                prompt = waiting.pop(r.request_id, None)
                if prompt is not None and not r.is_error and r.num_output_tokens > 0:
                    n = max(len(r.texts), 1)
                    seen.append((prompt, max(round(r.num_output_tokens / n), 1), r.finish_reason != FinishReason.LENGTH))

    def answers(self, node: str) -> list[tuple[LengthPrompt, int]]:
        """The node's sampled requests whose answers were committed, with their lengths
        (a cut answer counts its cap)."""
        return [(prompt, length) for prompt, length, _ in self._seen.get(node, ())]

    def save(self, home: Path) -> int:
        """File what was seen in the store (not what engines of another kind answered: a test's
        or a benchmark's stand-ins); returns how many outputs."""
        saved = 0
        for node, seen in self._seen.items():
            if not seen or self.models[node] in self._foreign:
                continue
            prompts, lengths, finished = zip(*seen)
            ObservationStore.at_home(home, self.models[node]).add(list(prompts), np.array(lengths), np.array(finished),
                                                                  self.fingerprints[node])
            saved += len(seen)
        self._seen = {}
        return saved
