"""Branch and bound over every stage sequence: the optimum of the schedule space the
greedy search walks (stages end at their first finish; each stage any set of ready
nodes with any plans that fit), for instances small enough to enumerate.

Per stage, a node's options are its fastest plan for each device count (a slower plan
on as many devices is never better), or sitting the stage out. The greedy+rollout schedule is
the first incumbent; a branch is cut when its lower bound reaches the incumbent. A
search that hits `max_stages_tried` returns its incumbent, marked not proven.
"""

from __future__ import annotations

import time

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.planner.baselines import lower_bound_s
from batchllm.planner.rollout import rollout_schedule
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import Timeline


def _options(timeline: Timeline, name: str) -> list[ExecutionPlan]:
    node = timeline.problem.nodes[name]
    best: dict[int, ExecutionPlan] = {}
    cost = {plan: timeline.start_cost_s(name, plan, timeline.claims({name: plan}).get(name)) + timeline.remaining_s(name, plan)
            for plan in node.speeds}
    for plan in node.speeds:
        if plan.devices not in best or cost[plan] < cost[best[plan.devices]]:
            best[plan.devices] = plan
    return sorted(best.values(), key=lambda p: -p.devices)


def stage_choices(timeline: Timeline) -> list[dict[str, ExecutionPlan]]:
    """Every non-empty stage: ready nodes (pipelining included) with plans that fit."""
    devices = timeline.problem.cluster.devices
    order = [n for n in timeline.problem.nodes if n in timeline.states]
    options = {n: _options(timeline, n) for n in order}
    choices: list[dict[str, ExecutionPlan]] = []

    def extend(index: int, chosen: dict[str, ExecutionPlan], free: int) -> None:
        if index == len(order):
            if chosen:
                choices.append(dict(chosen))
            return
        name = order[index]
        producers = timeline.problem.nodes[name].producers
        if all(p not in timeline.states or p in chosen for p in producers):
            for plan in options[name]:
                if plan.devices <= free:
                    chosen[name] = plan
                    extend(index + 1, chosen, free - plan.devices)
                    del chosen[name]
        extend(index + 1, chosen, free)

    extend(0, {}, devices)
    return choices


def exact_schedule(timeline: Timeline, *, max_stages_tried: int = 200_000, incumbent: Schedule | None = None) -> Schedule:
    """`incumbent`: a schedule already found (default: greedy with rollouts)."""
    started = time.perf_counter()
    incumbent = incumbent or rollout_schedule(timeline)
    best_total, best_stages = incumbent.total_s, incumbent.stages
    tried = 0
    exhausted = False

    def search(node: Timeline) -> None:
        nonlocal best_total, best_stages, tried, exhausted
        if node.done:
            if node.now_s < best_total - 1e-9:
                best_total, best_stages = node.now_s, node.stages
            return
        children = []
        for choice in stage_choices(node):
            tried += 1
            if tried > max_stages_tried:
                exhausted = True
                return
            child = node.advance(choice)
            bound = lower_bound_s(child)
            if bound < best_total - 1e-9:
                children.append((bound, child))
        for bound, child in sorted(children, key=lambda item: item[0]):
            if bound < best_total - 1e-9 and not exhausted:
                search(child)

    search(timeline)
    return Schedule("exact", best_stages, best_total, time.perf_counter() - started, optimal=not exhausted)
