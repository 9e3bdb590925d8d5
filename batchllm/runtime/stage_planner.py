"""The planner seen from a running job: at every stage boundary, the rest of the run is
planned again from what actually happened, and its first stage is what runs next.

The problem (node speeds per plan) is fit once at the start. At a boundary the timeline
is rebuilt from the runtime's facts: requests each node has finished (scaled to the
planner's estimate of its total), and which engines run where. A node whose requests
all run at once finishes few of them until near its end, so for it the time it has run
on its plan counts too: it is at least that far along its estimated run (drain included),
so what is left is at most the run's estimate less the time it has run. That run begins
where the node's running began: after its pilot, at the units the pilot left done.
Then the chosen method (batchllm's search, or the Max / Min heuristic for comparison)
plans from there. This includes SamuLLM's dynamic rule as a special case: a node whose
(model, plan, devices) is also in the new stage keeps its engine, because the timeline
charges it no start, and idle engines of the same model and shape are handed over.
"""

from __future__ import annotations

import time
from typing import Callable

from batchllm.planner.baselines import max_heuristic, min_heuristic
from batchllm.planner.best import best_schedule
from batchllm.planner.problem import PlanProblem
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import Engine, NodeState, Timeline
from batchllm.runtime.run_state import NodeProgress, RunningPlan
from batchllm.runtime.stage_chooser import StageChoice

SCHEDULE_METHODS: dict[str, Callable[[Timeline], Schedule]] = {
    "plan": best_schedule, "max": max_heuristic, "min": min_heuristic,
}


def known_method(method: str) -> str:
    if method not in SCHEDULE_METHODS:
        raise ValueError(f"unknown schedule method {method!r}; known: {sorted(SCHEDULE_METHODS)}")
    return method


class StagePlanner:
    """A `StageChooser` on a fixed cost model (`problem`)."""

    def __init__(self, problem: PlanProblem, method: str):
        self.problem, self.method = problem, known_method(method)

    def choose(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> StageChoice:
        """`progress` holds the unfinished nodes only; `running` the engines by node."""
        started = time.perf_counter()
        schedule = self.plan(progress, running)
        return StageChoice(schedule.stages[0], schedule.total_s, schedule, time.perf_counter() - started)

    def rest_s(self, progress: dict[str, NodeProgress]) -> float:
        return self.plan(progress, {}).total_s if progress else 0.0

    def plan(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> Schedule:
        """The whole rest of the run from here, as the method plans it."""
        timeline = Timeline(self.problem, 0.0, self._states(progress, running), self._engines(running))
        return SCHEDULE_METHODS[self.method](timeline)

    def _states(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> dict[str, NodeState]:
        """Each node's state in planner requests: a known total scales the units' done share
        to the planner's estimate; otherwise done units count `requests_per_unit` requests each."""
        states = {}
        for name, p in progress.items():
            node = self.problem.nodes[name]
            if p.total_known and p.total_units:
                done = p.done_units / p.total_units * node.requests
            else:
                done = min(float(p.done_units * node.requests_per_unit), node.requests * 0.99)
            state = NodeState(len(node.rounds), 0.0, 1.0).capped(node, min(done, node.requests * 0.999))
            speed = node.speeds.get(running[name].plan) if name in running else None
            if speed is not None and speed.output_curve and p.total_known and p.total_units and len(node.rounds) == 1:
                # as far as the time it has run takes it along its run (its drain included), from
                # where that run began: what is left is that run's time less it, not its share of
                # the requests' time
                began = NodeState(len(node.rounds), 0.0, 1.0).capped(node, p.done_units_before / p.total_units * node.requests)
                timed = began.advanced(node, speed, min(p.running_s, 0.99 * began.remaining_s(node, speed)))
                if timed.remaining_s(node, speed) < state.remaining_s(node, speed):
                    state = timed
            states[name] = state
        return states

    def _engines(self, running: dict[str, RunningPlan]) -> dict[str, Engine]:
        return {name: Engine(self.problem.nodes[name].model, r.plan, r.devices) for name, r in running.items()
                if name in self.problem.nodes}
