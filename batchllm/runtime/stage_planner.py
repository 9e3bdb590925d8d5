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

An engine group (`planner.engine_groups`) is one planning node for several DAG nodes: their
progress adds up into its own (in planner requests), their engines are its engines, and the
schedule comes back in DAG nodes (each open member with its group's plan and devices), so
the rest of the runtime never sees a group.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchllm.planner.baselines import max_heuristic, min_heuristic
from batchllm.planner.best import best_schedule
from batchllm.planner.engine_groups import member_schedule
from batchllm.planner.problem import GroupMember, PlanProblem
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import Engine, LoadingEngine, NodeState, Timeline, loading_engines
from batchllm.runtime.run_state import NodeProgress, RunningPlan
from batchllm.runtime.stage_chooser import StageChoice

SCHEDULE_METHODS: dict[str, Callable[[Timeline], Schedule]] = {
    "plan": best_schedule, "max": max_heuristic, "min": min_heuristic,
}


def requests_done(units: int, progress: NodeProgress, requests: float, requests_per_unit: int) -> float:
    """`units` of a node's progress in planner requests: their share of its `requests` (the planner's
    estimate) when its total is final, else `requests_per_unit` each, under 99 % of the estimate."""
    if progress.total_known and progress.total_units:
        return units / progress.total_units * requests
    return min(float(units * requests_per_unit), 0.99 * requests)


def group_progress(members: tuple[GroupMember, ...], progress: dict[str, NodeProgress]) -> NodeProgress:
    """An engine group's progress, one unit a planner request: each open member's units done in its
    requests (`requests_done`), each finished member's requests all done; final when every member's
    total is."""
    done = before = 0.0
    known, running_s = True, 0.0
    for member in members:
        p = progress.get(member.name)
        if p is None:  # finished
            done, before = done + member.requests, before + member.requests
            continue
        known = known and p.total_known and p.total_units > 0
        done += requests_done(p.done_units, p, member.requests, member.requests_per_unit)
        before += requests_done(p.done_units_before, p, member.requests, member.requests_per_unit)
        running_s = max(running_s, p.running_s)
    total = sum(m.requests for m in members)
    return NodeProgress(min(round(done), total), total, known, running_s, min(round(before), total))


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
        """The whole rest of the run from here, as the method plans it (in DAG nodes)."""
        planned, engines = self._grouped(progress, running)
        timeline = Timeline(self.problem, 0.0, self._states(planned, engines), self._engines(engines))
        return member_schedule(SCHEDULE_METHODS[self.method](timeline), self.problem, set(progress))

    def _grouped(self, progress: dict[str, NodeProgress],
                 running: dict[str, RunningPlan]) -> tuple[dict[str, NodeProgress], dict[str, RunningPlan]]:
        """Progress and engines by planning node: an engine group's members' summed into its own."""
        if not any(node.members for node in self.problem.nodes.values()):
            return progress, running
        planned, engines = dict(progress), dict(running)
        for name, node in self.problem.nodes.items():
            if not node.members:
                continue
            names = [m.name for m in node.members]
            for member in names:
                planned.pop(member, None)
                engine = engines.pop(member, None)
                if engine is not None:
                    engines.setdefault(name, engine)
            if any(member in progress for member in names):
                planned[name] = group_progress(node.members, progress)
        return planned, engines

    def _states(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> dict[str, NodeState]:
        """Each node's state in planner requests: a known total scales the units' done share
        to the planner's estimate; otherwise done units count `requests_per_unit` requests each."""
        states = {}
        for name, p in progress.items():
            node = self.problem.nodes[name]
            done = requests_done(p.done_units, p, node.requests, node.requests_per_unit)
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
        """The engines by node; those still loading (started early) with the start they have left."""
        loading = {name: LoadingEngine(r.plan, r.devices, r.loading_for_s) for name, r in running.items() if r.loading_for_s is not None}
        return {**{name: Engine(self.problem.nodes[name].model, r.plan, r.devices) for name, r in running.items()
                   if name in self.problem.nodes and r.loading_for_s is None}, **loading_engines(self.problem, loading)}
