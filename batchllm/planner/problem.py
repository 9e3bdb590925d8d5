"""What the planner plans: nodes (one per LLM stage of the DAG, self-loops fused) with
their work and their speed under every candidate plan, on one cluster.

Built from a DAG (`planner.from_dag`) or from published workload statistics
(`benchmarks/planner_paper_scenarios.py`); the search never looks further than this.

Invariant: every node has at least one plan that fits on the cluster, so every search
method can always run any ready node alone; a model too big for the devices is refused
when the problem is built (a `UserError` naming the model, what it needs and what there is).

Units: the planner counts requests, one per generated sequence; the runtime counts units
(row, step), each asking for `requests_per_unit` sequences (the node's `sampling.n`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchllm.core.errors import UserError
from batchllm.costmodel.estimator import ExecutionPlan, Workload
from batchllm.costmodel.profile import Profile, ReplicaShape
from batchllm.costmodel.request_lengths import RequestLengths
from batchllm.io.node_data import NodeSummary
from batchllm.planner.cluster import Cluster, candidate_plans, cluster_notes
from batchllm.planner.speed import PlanSpeed, fit_shape_speed, output_curve


@dataclass(frozen=True)
class GroupMember:
    """A DAG node of an engine group (`planner.engine_groups`)."""

    name: str
    requests: int  # planner requests (sequences), as the member's own planning node would count them
    requests_per_unit: int = 1  # its sampling.n


@dataclass(frozen=True)
class NodeWorkload:
    """One planning node before its speeds are fit."""

    name: str
    profile: Profile
    workload: Workload  # a representative set of its requests (prompt lengths, max_tokens)
    rounds: tuple[int, ...]  # requests per round: (N,) for a plain node, per step for an iterating one
    producers: tuple[str, ...] = ()
    requests_per_unit: int = 1  # sequences per runtime unit (row, step): the node's sampling.n
    output_lengths: RequestLengths | None = None  # predicted, one per sample row of `summary` (before `n`)
    summary: NodeSummary | None = None  # its data, when planned from a DAG
    members: tuple[GroupMember, ...] = ()  # an engine group's DAG nodes (none: the node is a DAG node)

    def __post_init__(self) -> None:
        if not self.rounds or min(self.rounds) < 0:
            raise ValueError(f"node {self.name!r}: rounds must be non-empty counts, got {self.rounds!r}")
        if self.requests_per_unit < 1:
            raise ValueError(f"node {self.name!r}: requests_per_unit must be at least 1, got {self.requests_per_unit}")


@dataclass(frozen=True)
class PlanNode:
    name: str
    model: str
    rounds: tuple[int, ...]
    producers: tuple[str, ...]
    speeds: dict[ExecutionPlan, PlanSpeed]
    requests_per_unit: int = 1  # planner requests per runtime unit (row, step): the node's sampling.n
    members: tuple[GroupMember, ...] = ()  # an engine group's DAG nodes (none: the node is a DAG node)

    @property
    def requests(self) -> int:
        return sum(self.rounds)


@dataclass(frozen=True)
class PlanProblem:
    cluster: Cluster
    nodes: dict[str, PlanNode]  # in topological order
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name, node in self.nodes.items():
            if not any(plan.devices <= self.cluster.devices for plan in node.speeds):
                raise ValueError(f"node {name!r} ({node.model}) has no plan on {self.cluster}: "
                                 f"plans {sorted(str(p) for p in node.speeds)}")

    def consumers(self, name: str) -> list[str]:
        return [n for n, node in self.nodes.items() if name in node.producers]


def build_problem(cluster: Cluster, workloads: list[NodeWorkload], notes: tuple[str, ...] = ()) -> PlanProblem:
    """Fit each node's speed on each replica shape once; every plan's speed follows."""
    nodes: dict[str, PlanNode] = {}
    known = {w.name for w in workloads}
    for item in _topological(workloads):
        missing = [p for p in item.producers if p not in known]
        if missing:
            raise ValueError(f"node {item.name!r} reads unknown nodes {missing!r}")
        plans = candidate_plans(item.profile, cluster)
        if not plans:
            raise too_big(item.profile.model, item.profile, cluster, f"node {item.name!r}")
        shapes = {plan.shape for plan in plans}
        speeds_by_shape = {shape: fit_shape_speed(item.profile, shape, item.workload) for shape in sorted(shapes, key=lambda s: s.key)}
        speeds = {plan: speeds_by_shape[plan.shape].plan_speed(plan, _curve(item, plan)) for plan in plans}
        nodes[item.name] = PlanNode(item.name, item.profile.model, item.rounds, item.producers, speeds, item.requests_per_unit,
                                    item.members)
    return PlanProblem(cluster, nodes, (*notes, *cluster_notes(cluster)))


def too_big(model: str, profile: Profile, cluster: Cluster, where: str) -> UserError:
    """The error for a model with no plan on the cluster: what it needs, what there is."""
    needs = sorted(ReplicaShape.parse(key).devices for key in profile.shapes)
    unit = "GPUs" if cluster.kind == "gpu" else "cores"
    need = f"its smallest replica needs {needs[0]} {cluster.hardware} {unit}" if needs else f"it has no replica shape on {cluster.hardware}"
    return UserError(f"model {model!r} fits on no plan of {cluster}: {need}, there {'is' if cluster.devices == 1 else 'are'} "
                     f"{cluster.devices}", where=where, hint="plan for more devices, or pick a smaller model")


def _curve(item: NodeWorkload, plan: ExecutionPlan) -> tuple[float, ...]:
    """Output curve of a plain node's plan (an iterating node's rounds already pace it)."""
    if len(item.rounds) != 1:
        return ()
    return output_curve(item.profile, plan.shape, item.workload, -(-item.rounds[0] // plan.dp))


def _topological(workloads: list[NodeWorkload]) -> list[NodeWorkload]:
    placed: list[NodeWorkload] = []
    names: set[str] = set()
    pending = list(workloads)
    while pending:
        ready = [w for w in pending if all(p in names or p not in {x.name for x in workloads} for p in w.producers)]
        if not ready:
            raise ValueError(f"nodes {[w.name for w in pending]!r} form a cycle")
        for item in ready:
            placed.append(item)
            names.add(item.name)
            pending.remove(item)
    return placed

