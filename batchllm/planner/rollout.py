"""Greedy with rollouts: at each stage boundary, try stages near the greedy one, finish
each with plain greedy, and keep the stage whose finished schedule ends first.

Neighbours of the greedy stage G: G without one of its nodes (regrown without it), and
the stage grown greedily from each ready node on its fastest plan for each device
count. G itself is always a candidate and its rollout is the plain greedy schedule, so
the result is never later than plain greedy's. After `max_rollouts` rollouts (a count,
not a time, so a plan does not depend on the machine's speed; by default fewer for
bigger DAGs, whose rollouts cost more) the remaining stages are plain greedy.
"""

from __future__ import annotations

import time

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.planner.greedy import greedy_schedule, greedy_stage
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import Timeline


def _fastest_per_device_count(timeline: Timeline, name: str) -> list[ExecutionPlan]:
    """The node's fastest plan on 1, 2, 4, ... devices."""
    best: dict[int, ExecutionPlan] = {}
    for plan in timeline.problem.nodes[name].speeds:
        if plan.devices & (plan.devices - 1):
            continue
        if plan.devices not in best or timeline.remaining_s(name, plan) < timeline.remaining_s(name, best[plan.devices]):
            best[plan.devices] = plan
    return [best[d] for d in sorted(best)]


def neighbour_stages(timeline: Timeline) -> list[dict[str, ExecutionPlan]]:
    """The greedy stage first, then its neighbours, most promising first: without one of
    its nodes, then seeded with the nodes with the most work left."""
    greedy = greedy_stage(timeline)
    stages = [greedy]
    for name in greedy:
        stages.append(greedy_stage(timeline, excluded=frozenset({name})))
    for name in sorted(timeline.ready(), key=timeline.ideal_device_s, reverse=True):
        for plan in _fastest_per_device_count(timeline, name):
            stages.append(greedy_stage(timeline, seed={name: plan}))
    unique: dict[tuple, dict[str, ExecutionPlan]] = {}
    for stage in stages:
        if stage:
            unique.setdefault(tuple(sorted((n, str(p)) for n, p in stage.items())), stage)
    return list(unique.values())


ROLLOUT_BUDGET = 240  # rollouts x nodes: a rollout costs about (nodes x stages) stage growths


def rollout_schedule(timeline: Timeline, *, max_rollouts: int | None = None) -> Schedule:
    started = time.perf_counter()
    left = max_rollouts if max_rollouts is not None else ROLLOUT_BUDGET // max(len(timeline.problem.nodes), 1)
    while not timeline.done:
        stages = neighbour_stages(timeline)[: max(left, 1)]  # the greedy stage always
        left -= len(stages) if len(stages) > 1 else 0
        best: tuple[float, Timeline] | None = None
        for stage in stages:
            after = timeline.advance(stage)
            if len(stages) == 1:
                best = (0.0, after)
                break
            end_s = greedy_schedule(after).total_s if not after.done else after.now_s
            if best is None or end_s < best[0] - 1e-9:
                best = (end_s, after)
        if best is None:
            raise ValueError("no stage to roll out from a timeline that is not done")
        timeline = best[1]
    return Schedule.of("greedy+rollout", timeline, time.perf_counter() - started)
