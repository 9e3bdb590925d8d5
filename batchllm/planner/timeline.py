"""Execution stages played forward on the fluid speed model: every search method builds
its schedule through `Timeline.advance`, so all of them are judged by the same costs.

A stage is a set of (node, plan) pairs on disjoint devices; it ends when its first node
finishes. Within a stage a node pays its start cost first (engine start + warm-up; none
when it keeps its plan and devices, or takes over an idle engine of the same model and
plan), then progresses through its rounds. A node whose producers run in the same stage
(model-level pipelining) gets its requests as they are produced: its finished share
never exceeds the share they have finished (their plan's output curve: a producer
holding all its requests at once finishes most of them near its end), and it ends at
the earliest one request latency plus a drain after them, plus the work on what they
finish last. A node that changes plan loses the requests in flight (half a drain of work).

Invariant: every node's state only moves forward, and a stage always finishes at
least one node, so a schedule has at most as many stages as nodes plus preemptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.planner.cluster import Placement, place
from batchllm.planner.problem import PlanNode, PlanProblem
from batchllm.planner.speed import PlanSpeed

EPSILON_S = 1e-9


@dataclass(frozen=True)
class NodeState:
    """Progress of one node: rounds before `round_index` are done, `head_done` of that
    round is done, and once all rounds are done `drain_left` of the drain remains."""

    round_index: int = 0
    head_done: float = 0.0
    drain_left: float = 1.0

    def remaining_s(self, node: PlanNode, speed: PlanSpeed) -> float:
        rounds = node.rounds
        if self.round_index >= len(rounds):
            return speed.drain_s * self.drain_left
        head = speed.rest_of_round_s(rounds[self.round_index], self.head_done)
        return head + sum(speed.round_s(n) for n in rounds[self.round_index + 1:]) + speed.drain_s * self.drain_left

    def done_requests(self, node: PlanNode) -> float:
        rounds = node.rounds
        done = float(sum(rounds[: self.round_index]))
        return done + (self.head_done * rounds[self.round_index] if self.round_index < len(rounds) else 0.0)

    def advanced(self, node: PlanNode, speed: PlanSpeed, seconds: float) -> NodeState:
        index, head_done, left = self.round_index, self.head_done, seconds
        while index < len(node.rounds) and left > EPSILON_S:
            round_s = speed.rest_of_round_s(node.rounds[index], head_done)
            if left >= round_s:
                left -= round_s
                index, head_done = index + 1, 0.0
            else:
                head_done = speed.done_share_after(node.rounds[index], head_done, left)
                left = 0.0
        while index < len(node.rounds) and node.rounds[index] == 0:
            index += 1
        drain_left = self.drain_left
        if index >= len(node.rounds) and left > 0 and speed.drain_s > 0:
            drain_left = max(0.0, drain_left - left / speed.drain_s)
        return NodeState(index, head_done, drain_left)

    def capped(self, node: PlanNode, done_requests: float) -> NodeState:
        """This state, but with no more than `done_requests` done (pipelining)."""
        if self.done_requests(node) <= done_requests:
            return self
        index, before = 0, 0.0
        while index < len(node.rounds) and before + node.rounds[index] <= done_requests:
            before += node.rounds[index]
            index += 1
        if index >= len(node.rounds):
            return NodeState(index, 0.0, 1.0)
        return NodeState(index, (done_requests - before) / node.rounds[index], 1.0)


@dataclass(frozen=True)
class Engine:
    """A running engine after a stage: whose it is, its plan and devices, load still left."""

    model: str
    plan: ExecutionPlan
    devices: tuple[int, ...]
    load_left_s: float = 0.0


@dataclass(frozen=True)
class LoadingEngine:
    """An engine whose start began before the plan (started early, while the driver checked and
    planned): its plan, devices, and how long it has been loading."""

    plan: ExecutionPlan
    devices: tuple[int, ...]
    loading_for_s: float


def loading_engines(problem: PlanProblem, loading: Mapping[str, LoadingEngine]) -> dict[str, Engine]:
    """The loading engines as a timeline's engines: each node's, its start left the node's
    start cost on that plan less what it has loaded (a plan the node cannot run is left out)."""
    return {name: Engine(node.model, e.plan, e.devices, max(0.0, node.speeds[e.plan].start_s - e.loading_for_s))
            for name, e in loading.items() if (node := problem.nodes.get(name)) is not None and e.plan in node.speeds}


@dataclass(frozen=True)
class Claim:
    """Running replicas a node keeps or takes over in a new stage."""

    replicas: tuple[tuple[int, ...], ...]  # device ids per claimed replica
    load_left_s: float  # the latest of their unfinished starts
    complete: bool  # every replica of the plan is claimed: no engine start


@dataclass(frozen=True)
class StageRecord:
    index: int
    start_s: float
    duration_s: float
    plans: dict[str, ExecutionPlan]
    placement: Placement
    start_costs_s: dict[str, float]  # engine start paid in this stage, per node
    finished: tuple[str, ...]
    requests_left: dict[str, float]  # after the stage, for every node of the stage

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class Timeline:
    problem: PlanProblem
    now_s: float = 0.0
    states: dict[str, NodeState] = field(default_factory=dict)  # unfinished nodes only
    engines: dict[str, Engine] = field(default_factory=dict)  # by node, from the last stage
    stages: tuple[StageRecord, ...] = ()
    _remaining: dict = field(default_factory=dict, compare=False, repr=False)  # (node, plan) -> seconds, this timeline's states
    _alone_finish: dict = field(default_factory=dict, compare=False, repr=False)  # (node, plan) -> seconds, the node alone in a stage
    _replicas: dict = field(default_factory=dict, compare=False, repr=False)  # (model, shape) -> running replicas

    def alone_finish_s(self, name: str, plan: ExecutionPlan) -> float:
        """Finish of the node on `plan` in a stage where nothing else bears on it."""
        key = (name, plan)
        if key not in self._alone_finish:
            self._alone_finish[key] = self.start_cost_s(name, plan, self._alone_claim(name, plan)) + self.remaining_s(name, plan)
        return self._alone_finish[key]

    def _alone_claim(self, name: str, plan: ExecutionPlan) -> Claim | None:
        """`claims({name: plan})[name]`, from an index of replicas by (model, shape)."""
        if not self._replicas and self.engines:
            for owner, engine in self.engines.items():
                size = engine.plan.shape.devices
                for i in range(engine.plan.dp):
                    self._replicas.setdefault((engine.model, engine.plan.shape), []).append((owner, engine, engine.devices[i * size:(i + 1) * size]))
        matches = self._replicas.get((self.problem.nodes[name].model, plan.shape), [])
        got = ([m for m in matches if m[0] == name] + [m for m in matches if m[0] != name])[: plan.dp]
        if not got:
            return None
        return Claim(tuple(ids for _, _, ids in got), max(e.load_left_s for _, e, _ in got), len(got) == plan.dp)

    def speed(self, name: str, plan: ExecutionPlan) -> PlanSpeed:
        """The node's speed on `plan` from now. Requests running in an engine stay there
        (only those waiting in the runtime's backlog move), so a plain node whose
        remaining requests all run at once on its replicas (its producers finished),
        and that keeps them while adding more of the same shape, goes no faster than on
        its old plan: the added replicas idle."""
        node = self.problem.nodes[name]
        own = self.engines.get(name)
        if (own is None or own.plan not in node.speeds or plan.shape != own.plan.shape or plan.dp <= own.plan.dp
                or len(node.rounds) > 1 or any(p in self.states for p in node.producers)):
            return node.speeds[plan]
        old = node.speeds[own.plan]
        left = node.requests - self.states[name].done_requests(node)
        return old if left <= old.max_running else node.speeds[plan]

    def remaining_s(self, name: str, plan: ExecutionPlan) -> float:
        """Time the node still needs on `plan`, start cost aside."""
        key = (name, plan)
        if key not in self._remaining:
            node = self.problem.nodes[name]
            self._remaining[key] = self.states[name].remaining_s(node, self.speed(name, plan))
        return self._remaining[key]

    @classmethod
    def start(cls, problem: PlanProblem) -> Timeline:
        return cls(problem, states={name: NodeState() for name in problem.nodes})

    @property
    def done(self) -> bool:
        return not self.states

    def ready(self, in_stage: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Unfinished nodes whose producers are finished or run in the same stage."""
        return [n for n in self.states if all(p not in self.states or p in in_stage for p in self.problem.nodes[n].producers)]

    # -- costs of a candidate stage ----------------------------------------------------
    def claims(self, plans: dict[str, ExecutionPlan]) -> dict[str, Claim]:
        """The running replicas each node of a candidate stage keeps or takes over.

        Replicas are engines of one shape; a node first keeps its own replicas of the
        plan's shape (as many as the plan has), then takes idle ones of its model and
        shape: left by a node that finished, paused, or shrank. A node with all its
        replicas claimed starts no engine."""
        pool = [(owner, engine, engine.devices[i * engine.plan.shape.devices:(i + 1) * engine.plan.shape.devices])
                for owner, engine in self.engines.items() for i in range(engine.plan.dp)]
        taken: set[int] = set()
        found: dict[str, list[tuple[Engine, tuple[int, ...]]]] = {n: [] for n in plans}
        for own_first in (True, False):
            for name, plan in plans.items():
                model = self.problem.nodes[name].model
                for index, (owner, engine, ids) in enumerate(pool):
                    if len(found[name]) >= plan.dp:
                        break
                    if index in taken or engine.plan.shape != plan.shape or engine.model != model:
                        continue
                    if own_first != (owner == name):  # owners claim before anyone takes over
                        continue
                    taken.add(index)
                    found[name].append((engine, ids))
        return {n: Claim(tuple(ids for _, ids in got), max(e.load_left_s for e, _ in got), len(got) == plans[n].dp)
                for n, got in found.items() if got}

    def start_cost_s(self, name: str, plan: ExecutionPlan, claim: Claim | None) -> float:
        """Engine start for `name` on `plan`: none when every replica is claimed (what is
        left of their own start). A node that leaves its engine also loses the requests
        it had in flight (half a drain of its old plan)."""
        if claim is not None and claim.complete:
            return claim.load_left_s
        node = self.problem.nodes[name]
        own = self.engines.get(name)
        lost_in_flight_s = node.speeds[own.plan].drain_s / 2 if own is not None and own.plan in node.speeds else 0.0
        return node.speeds[plan].start_s + lost_in_flight_s

    def finish_times(self, plans: dict[str, ExecutionPlan]) -> tuple[dict[str, float], dict[str, float]]:
        """(finish, start cost) per node of the candidate stage, seconds from its start."""
        finish: dict[str, float] = {}
        costs: dict[str, float] = {}
        claims = self.claims(plans)
        for name in self.problem.nodes:  # topological order: producers first
            if name not in plans:
                continue
            node, plan = self.problem.nodes[name], plans[name]
            speed = self.speed(name, plan)
            costs[name] = self.start_cost_s(name, plan, claims.get(name))
            end = costs[name] + self.remaining_s(name, plan)
            for producer in node.producers:
                if producer in plans:  # what the producer finishes in its last request latency is served after it
                    producer_s = max(finish[producer] - costs[producer], EPSILON_S)
                    last_share = 1.0 - min(1.0, speed.request_latency_s / producer_s)
                    late = 1.0 - self.speed(producer, plans[producer]).finished_share(last_share)
                    late_work_s = late * max(0.0, self.remaining_s(name, plan) - speed.drain_s)
                    end = max(end, finish[producer] + speed.request_latency_s + speed.drain_s + late_work_s)
            finish[name] = end
        return finish, costs

    def throughput(self, plans: dict[str, ExecutionPlan], ideal_s: dict[str, float]) -> float:
        """Ideal device-seconds of work per second the candidate stage clears, if each of
        its nodes ran to its end: the unit in which different models' work adds up."""
        finish, _ = self.finish_times(plans)
        return sum(ideal_s[n] / max(finish[n], EPSILON_S) for n in plans)

    def ideal_device_s(self, name: str) -> float:
        """Device-seconds the node's remaining work takes on its most efficient plan."""
        return min(plan.devices * self.remaining_s(name, plan) for plan in self.problem.nodes[name].speeds)

    # -- playing a stage --------------------------------------------------------------
    def placement_for(self, plans: dict[str, ExecutionPlan]) -> Placement | None:
        blocks = {n: (p.dp, p.shape.devices) for n, p in plans.items()}
        kept = {n: tuple(d for ids in c.replicas for d in ids) for n, c in self.claims(plans).items()}
        return place(blocks, kept, self.problem.cluster.devices, self.problem.cluster.node_sizes)

    def advance(self, plans: dict[str, ExecutionPlan]) -> Timeline:
        """Run one stage of these (node, plan) pairs until its first node finishes."""
        if not plans:
            raise ValueError("a stage needs at least one node")
        if sum(p.devices for p in plans.values()) > self.problem.cluster.devices:
            raise ValueError(f"stage {plans} needs more than {self.problem.cluster.devices} devices")
        placement = self.placement_for(plans)
        timeline = self
        if placement is None:  # kept engines block aligned placement: everyone moves and reloads
            timeline = replace(self, engines={}, _alone_finish={}, _replicas={})
            placement = timeline.placement_for(plans)
        if placement is None:  # with no engine kept, a stage within the cluster's devices always fits
            raise ValueError(f"stage {plans} does not fit the cluster's nodes")
        finish, costs = timeline.finish_times(plans)
        duration = min(finish.values())
        states = dict(self.states)
        for name in self.problem.nodes:
            if name not in plans:
                continue
            node = self.problem.nodes[name]
            speed = timeline.speed(name, plans[name])
            state = states[name].advanced(node, speed, max(0.0, duration - costs[name]))
            for producer in node.producers:
                if producer in plans:  # it may serve only what the producer had made one request latency ago
                    producer_node = self.problem.nodes[producer]
                    producer_speed = timeline.speed(producer, plans[producer])
                    made = self.states[producer].advanced(producer_node, producer_speed,
                                                          max(0.0, duration - speed.request_latency_s - costs[producer]))
                    state = state.capped(node, _finished_share(producer_node, producer_speed, made) * node.requests)
            states[name] = state
        finished = tuple(n for n in plans if finish[n] <= duration + EPSILON_S * max(1.0, duration))
        for name in plans:
            state = states[name]
            if name not in finished and state.round_index >= len(self.problem.nodes[name].rounds):
                states[name] = replace(state, drain_left=1.0)  # a pipelined consumer drains after its producer's last output
        for name in finished:
            states.pop(name)
        engines = {n: Engine(self.problem.nodes[n].model, p, placement[n], max(0.0, costs[n] - duration)) for n, p in plans.items()}
        record = StageRecord(len(self.stages), self.now_s, duration, dict(plans), placement, costs, finished,
                             {n: (self.problem.nodes[n].requests - states[n].done_requests(self.problem.nodes[n])) if n in states else 0.0
                              for n in plans})
        return Timeline(self.problem, self.now_s + duration, states, engines, self.stages + (record,))


def _finished_share(node: PlanNode, speed: PlanSpeed, state: NodeState) -> float:
    """Share of the node's requests finished in `state`: steady, or by its output curve
    at the share of its run time done (the drain included: that is when most finish)."""
    if not speed.output_curve:
        return state.done_requests(node) / max(node.requests, 1)
    total_s = speed.run_s(node.rounds)
    return speed.finished_share(1.0 - state.remaining_s(node, speed) / max(total_s, EPSILON_S))
