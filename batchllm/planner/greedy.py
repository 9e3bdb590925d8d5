"""Greedy execution-stage search (SamuLLM's Algorithm 1, on the fluid speed model).

Each stage starts empty and grows one change at a time: add a ready node with a plan,
or move a node of the stage to a plan with more devices, whichever raises the stage's
throughput most per device it adds. A node is ready when its producers have finished
or are in the stage (pipelining). The stage is complete when no change fits the free
devices or none raises throughput; it runs until its first node finishes, the rest of
the work is updated, and the next stage is searched from scratch: a running node may
keep its plan (no start cost), change it (start cost + in-flight work lost), or pause.

Throughput counts each node's remaining work in ideal device-seconds (its time on its
most efficient plan x that plan's devices) divided by its estimated finish in the
stage, start cost included; so models of different sizes compare, and a reload must pay
for itself.

With `preemption=False` a running node keeps its plan until it finishes, and new
stages only fill the devices it frees.
"""

from __future__ import annotations

import time

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import EPSILON_S, Timeline


def greedy_stage(timeline: Timeline, *, preemption: bool = True, seed: dict[str, ExecutionPlan] | None = None,
                 excluded: frozenset[str] = frozenset()) -> dict[str, ExecutionPlan]:
    """One stage grown greedily; from `seed` if given, never with `excluded` nodes."""
    devices = timeline.problem.cluster.devices
    ideal = {n: timeline.ideal_device_s(n) for n in timeline.states}
    fixed: dict[str, ExecutionPlan] = dict(seed or {})
    if not preemption:
        fixed.update({n: e.plan for n, e in timeline.engines.items() if n in timeline.states})
    chosen = dict(fixed)
    used = sum(p.devices for p in chosen.values())
    current = timeline.throughput(chosen, ideal) if chosen else 0.0
    alone = _AloneThroughput(timeline, ideal)
    refused: set[tuple[str, ExecutionPlan]] = set()  # changes whose devices cannot be placed
    while True:
        best: tuple[float, str, ExecutionPlan, float] | None = None
        for name in timeline.ready(set(chosen)):
            if name in fixed or name in excluded:
                continue
            held = chosen[name].devices if name in chosen else 0
            independent = alone.independent(name, chosen)
            for plan in timeline.problem.nodes[name].speeds:
                if plan.devices <= held or used - held + plan.devices > devices or (name, plan) in refused:
                    continue
                if independent:  # only its own term of the sum changes
                    throughput = current - (alone(name, chosen[name]) if name in chosen else 0.0) + alone(name, plan)
                else:
                    throughput = timeline.throughput({**chosen, name: plan}, ideal)
                gain = (throughput - current) / (plan.devices - held)
                if best is None or gain > best[0]:
                    best = (gain, name, plan, throughput)
        if best is None or (best[0] <= 0 and chosen != fixed):
            break
        _, name, plan, throughput = best
        candidate = {**chosen, name: plan}
        if timeline.placement_for(candidate) is None:
            refused.add((name, plan))
            continue
        held = chosen[name].devices if name in chosen else 0
        chosen, used, current = candidate, used - held + plan.devices, throughput
    return chosen


class _AloneThroughput:
    """A node's term of the stage throughput when nothing else in the stage affects it:
    no producer or consumer in the stage, and no other node of its model (which could
    compete for the same idle engine)."""

    def __init__(self, timeline: Timeline, ideal: dict[str, float]):
        self.timeline, self.ideal = timeline, ideal
        nodes = timeline.problem.nodes
        self.related = {n: set(nodes[n].producers) | {c for c in nodes if n in nodes[c].producers} for n in nodes}

    def independent(self, name: str, chosen: dict[str, ExecutionPlan]) -> bool:
        nodes = self.timeline.problem.nodes
        model = nodes[name].model
        return not any(other != name and (other in self.related[name] or nodes[other].model == model) for other in chosen)

    def __call__(self, name: str, plan: ExecutionPlan) -> float:
        return self.ideal[name] / max(self.timeline.alone_finish_s(name, plan), EPSILON_S)


def greedy_schedule(timeline: Timeline, *, preemption: bool = True, method: str | None = None) -> Schedule:
    started = time.perf_counter()
    while not timeline.done:
        stage = greedy_stage(timeline, preemption=preemption)
        if not stage:
            raise ValueError(f"no node of {sorted(timeline.states)} fits on {timeline.problem.cluster}")
        timeline = timeline.advance(stage)
    return Schedule.of(method or ("greedy" if preemption else "greedy-no-preemption"), timeline, time.perf_counter() - started)
