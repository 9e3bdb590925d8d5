"""What people do without a planner, and how far anyone could go: on the same costs.

- Max-heuristic: one node at a time on all devices (its fastest plan there), in
  topological order.
- Min-heuristic: split the devices evenly over as many ready nodes as possible; a node
  keeps its devices until it finishes, and freed devices go, split evenly, to nodes
  still waiting (or stay idle when none waits). A node whose smallest plan needs more
  than the even share takes that smallest plan (a 70B model on 2 of 3 devices); the
  nodes admitted are the most that fit side by side, smallest need first, and the
  others wait for devices to free up.
- Lower bound: no schedule on the fluid model ends earlier than the larger of (a) all
  remaining work at each round's most efficient plan, spread over every device, and
  (b) the longest producer-consumer chain, each node at its fastest, and a consumer
  ending at least its drain after its producer (the timeline lets a pipelined consumer
  that outlives its producer's stage finish with only its drain left, so a request
  latency on top would not bound every schedule).

Max and Min always find a stage: every node has a plan on the cluster (`PlanProblem`
checks it), so a node alone on free devices always fits.
"""

from __future__ import annotations

import time

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import Timeline


def _fastest_within(timeline: Timeline, name: str, devices: int) -> ExecutionPlan | None:
    options = [p for p in timeline.problem.nodes[name].speeds if p.devices <= devices]
    if not options:
        return None
    node = timeline.problem.nodes[name]
    return min(options, key=lambda p: (node.speeds[p].start_s + timeline.remaining_s(name, p), p.devices))


def _fits(timeline: Timeline, name: str, devices: int) -> ExecutionPlan:
    """The fastest plan of the node within `devices` (a node always has one within the cluster's)."""
    plan = _fastest_within(timeline, name, devices)
    if plan is None:
        raise ValueError(f"node {name!r} has no plan within {devices} devices")
    return plan


def max_heuristic(timeline: Timeline) -> Schedule:
    started = time.perf_counter()
    devices = timeline.problem.cluster.devices
    while not timeline.done:
        name = timeline.ready()[0]
        timeline = timeline.advance({name: _fits(timeline, name, devices)})
    return Schedule.of("max-heuristic", timeline, time.perf_counter() - started)


def min_heuristic(timeline: Timeline) -> Schedule:
    started = time.perf_counter()
    devices = timeline.problem.cluster.devices
    while not timeline.done:
        running = {n: e.plan for n, e in timeline.engines.items() if n in timeline.states}
        free = devices - sum(p.devices for p in running.values())
        waiting = [n for n in timeline.ready() if n not in running]
        stage = {**running, **even_split(timeline, waiting, free)}
        if not stage:
            raise ValueError(f"min-heuristic: no node of {sorted(timeline.states)} fits on {timeline.problem.cluster}")
        timeline = timeline.advance(stage)
    return Schedule.of("min-heuristic", timeline, time.perf_counter() - started)


def even_split(timeline: Timeline, waiting: list[str], free: int) -> dict[str, ExecutionPlan]:
    """Plans for as many waiting nodes as fit on `free` devices, each on its fastest plan
    within an even share of them, or on its smallest plan when that needs more."""
    nodes = timeline.problem.nodes
    smallest = {n: min(p.devices for p in nodes[n].speeds) for n in waiting}
    admitted: list[str] = []
    reserved = 0
    for name in sorted(waiting, key=lambda n: smallest[n]):  # stable: ready order among equals
        if reserved + smallest[name] <= free:
            admitted.append(name)
            reserved += smallest[name]
    if not admitted:
        return {}
    share = free // len(admitted)
    plans: dict[str, ExecutionPlan] = {}
    for name in admitted:
        reserved -= smallest[name]  # now what the nodes after this one need at least
        plan = _fits(timeline, name, min(max(share, smallest[name]), free - reserved))
        plans[name] = plan
        free -= plan.devices
    return {n: plans[n] for n in waiting if n in plans}


def lower_bound_s(timeline: Timeline) -> float:
    """A time no schedule from this point beats (see the module docstring). A model with
    no engine running must start one: that start's device-seconds and time count too."""
    problem = timeline.problem
    running_models = {e.model for e in timeline.engines.values()}
    start_device_s: dict[str, float] = {}  # per model to start: the cheapest start, once
    device_s = 0.0
    path: dict[str, float] = {}
    for name, node in problem.nodes.items():
        if name not in timeline.states:
            continue
        state = timeline.states[name]
        rounds = node.rounds[state.round_index:]
        for index, requests in enumerate(rounds):
            weight = 1.0 - state.head_done if index == 0 else 1.0
            device_s += weight * min(p.devices * s.round_s(requests) for p, s in node.speeds.items())
        device_s += state.drain_left * min(p.devices * s.drain_s for p, s in node.speeds.items())
        start_s = 0.0
        if node.model not in running_models:
            start_s = min(s.start_s for s in node.speeds.values())
            cheapest = min(p.devices * s.start_s for p, s in node.speeds.items())
            start_device_s[node.model] = min(start_device_s.get(node.model, cheapest), cheapest)
        own = start_s + min(timeline.remaining_s(name, p) for p in node.speeds)
        after = [path[p] + min(s.drain_s for s in node.speeds.values()) for p in node.producers if p in path]
        path[name] = max([own, *after])
    device_s += sum(start_device_s.values())
    return timeline.now_s + max(device_s / problem.cluster.devices, max(path.values(), default=0.0))
