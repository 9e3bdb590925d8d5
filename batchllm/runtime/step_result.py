"""What one turn of the executor did, as data (`Executor.step()` returns it).

The stage loop, the progress, the stage log of the report and the run's observers
(calibration, estimates) all learn what happened from this record; none of them reaches
into the executor's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.core.requests import EngineResult
from batchllm.engines.protocol import EngineConfig, StepRecord
from batchllm.runtime.engine_set import EngineLoss


@dataclass(frozen=True)
class NodeCommit:
    """Results of one node committed in this turn (journal and ledger), in commit order."""

    node: str
    results: tuple[EngineResult, ...]
    prompt_tokens: int
    output_tokens: int
    failed: int  # results of requests that could not run

    @classmethod
    def of(cls, node: str, results: list[EngineResult]) -> NodeCommit:
        return cls(node, tuple(results), sum(r.num_prompt_tokens for r in results),
                   sum(r.num_output_tokens for r in results), sum(1 for r in results if r.is_error))


@dataclass(frozen=True)
class EngineStep:
    """One engine iteration, as the engine measured it."""

    node: str | None  # the node the engine serves in this stage (None: none any more)
    config: EngineConfig
    step: StepRecord


@dataclass(frozen=True)
class StepResult:
    submitted: int  # requests handed to engines
    commits: tuple[NodeCommit, ...]
    engine_steps: tuple[EngineStep, ...]
    losses: tuple[EngineLoss, ...]  # engines that died; their units are READY again
    ended: tuple[str, ...]  # nodes that finished or failed in this turn

    @property
    def committed(self) -> int:
        return sum(len(c.results) for c in self.commits)
