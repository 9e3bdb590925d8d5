"""A schedule: the stages a search method chose, with the timeline's costs."""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.planner.timeline import StageRecord, Timeline


@dataclass(frozen=True)
class Schedule:
    method: str
    stages: tuple[StageRecord, ...]
    total_s: float  # estimated end of the last stage
    search_s: float  # wall time the method took to find it
    optimal: bool | None = None  # exact search: True when proven within its budget

    @classmethod
    def of(cls, method: str, timeline: Timeline, search_s: float, optimal: bool | None = None) -> Schedule:
        if not timeline.done:
            raise ValueError(f"{method}: the timeline still has unfinished nodes {sorted(timeline.states)}")
        return cls(method, timeline.stages, timeline.now_s, search_s, optimal)
