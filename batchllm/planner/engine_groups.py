"""Engine groups: nodes that run in one engine, planned as one node.

A LoRA adapter is its base model plus small weights the engine swaps in per request, so the
base's nodes and its adapters' nodes can share one engine, their requests batched together
(the runtime gives them one engine when their settings and devices match). The planner sees
such a set as one planning node, named by its members joined with `+`: one plan, one load,
one speed fit on the members' requests together (each member's sample weighted by its
requests), its producers those of its members outside it.

Which nodes: the generation nodes on one model that has adapters in the DAG, none of which
reads another (directly or through other nodes; an answer read by a later member would hold
the whole group back), an iterating node never (its rounds pace it alone). The first such
node in topological order starts a group; each later one joins the first group it reads no
member of, or starts its own. A group of one is no group. Nodes on a model without adapters
keep their own planning nodes: the planner hands an idle engine from one to the next.

The runtime speaks of DAG nodes: `GroupMember` keeps each member's requests, so progress can
be summed into the group's and a schedule's stages spread back over the members.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from batchllm.costmodel.estimator import Workload
from batchllm.costmodel.request_lengths import RequestLengths
from batchllm.dag.model import DagSpec
from batchllm.planner.problem import GroupMember, NodeWorkload, PlanProblem
from batchllm.planner.schedule import Schedule
from batchllm.planner.timeline import StageRecord

GROUP_SEPARATOR = "+"  # node names are identifiers, so a group's name is never a node's


def engine_groups(dag: DagSpec) -> tuple[tuple[str, ...], ...]:
    """The DAG's engine groups (each of at least two nodes, in topological order)."""
    with_adapters = {n.model for n in dag.nodes.values() if n.adapter is not None}
    groups: list[list[str]] = []
    model_of: list[str] = []
    for name in dag.topological_order():
        node = dag.nodes[name]
        if node.model not in with_adapters or node.task.pools or node.iterate is not None or name in node.upstream \
                or node.model in dag.endpoints:
            continue
        ancestors = dag.ancestors(name)
        home = next((i for i, members in enumerate(groups) if model_of[i] == node.model and not ancestors & set(members)), None)
        if home is None:
            groups.append([name])
            model_of.append(node.model)
        else:
            groups[home].append(name)
    return tuple(tuple(members) for members in groups if len(members) > 1)


def grouped(workloads: list[NodeWorkload], groups: tuple[tuple[str, ...], ...]) -> list[NodeWorkload]:
    """The planning nodes: each group's members merged into one, in the place of its first."""
    group_of = {member: members for members in groups for member in members}
    by_name = {w.name: w for w in workloads}
    planned: list[NodeWorkload] = []
    for item in workloads:
        members = group_of.get(item.name)
        if members is None:
            planned.append(item)
        elif item.name == members[0]:
            planned.append(merged([by_name[m] for m in members if m in by_name]))
    renamed = {member: GROUP_SEPARATOR.join(members) for member, members in group_of.items()}  # producers in groups
    return [replace(item, producers=tuple(dict.fromkeys(renamed.get(p, p) for p in item.producers))) for item in planned]


def merged(members: list[NodeWorkload]) -> NodeWorkload:
    """One planning node for a group's members: their requests together in one sample of as
    many requests as theirs together, each member's share its share of the requests; lengths on
    the first member's distribution, each member's scaled to its own mean."""
    if len(members) == 1:
        return members[0]
    requests = [sum(m.rounds) for m in members]
    total = sum(requests)
    size = sum(len(m.workload) for m in members)
    base = _lengths(members[0]).base
    prompts, max_tokens, cached, shifts = [], [], [], []
    for member, count in zip(members, requests):
        workload = member.workload
        if not len(workload) or not count:
            continue
        picked = np.resize(np.arange(len(workload)), max(1, round(size * count / total)))
        lengths = _lengths(member)
        prompts.append(workload.prompt_tokens[picked])
        max_tokens.append(workload.max_tokens[picked])
        cached.append(np.zeros(picked.size, np.int64) if workload.cached_tokens is None else workload.cached_tokens[picked])
        shifts.append(lengths.log_shift[picked] + np.log(lengths.base.mean() / base.mean()))
    first = members[0]
    workload = Workload(np.concatenate(prompts), np.concatenate(max_tokens), cached_tokens=np.concatenate(cached),
                        output_lengths=RequestLengths(base, np.concatenate(shifts), _lengths(first).source)) if prompts else first.workload
    names = tuple(m.name for m in members)
    producers = tuple(dict.fromkeys(p for m in members for p in m.producers if p not in names))
    return NodeWorkload(GROUP_SEPARATOR.join(names), first.profile, workload, (total,), producers,
                        members=tuple(GroupMember(m.name, r, m.requests_per_unit) for m, r in zip(members, requests)))


def _lengths(member: NodeWorkload) -> RequestLengths:
    """A member's lengths per request of its workload: its own, or its profile's for each."""
    if member.workload.output_lengths is not None:
        return member.workload.output_lengths
    return RequestLengths.shared(member.profile.lengths, len(member.workload), "prior")


def problem_groups(problem: PlanProblem) -> tuple[tuple[str, ...], ...]:
    """The groups a problem was built with (to build it again, calibrated)."""
    return tuple(tuple(m.name for m in node.members) for node in problem.nodes.values() if node.members)


def member_schedule(schedule: Schedule, problem: PlanProblem, open_nodes: set[str]) -> Schedule:
    """The schedule in DAG nodes: each group's plan, devices and start given to its open
    members, its requests left shared by their requests."""
    return replace(schedule, stages=tuple(_member_stage(stage, problem, open_nodes) for stage in schedule.stages))


def _member_stage(stage: StageRecord, problem: PlanProblem, open_nodes: set[str]) -> StageRecord:
    if not any(problem.nodes[name].members for name in stage.plans):
        return stage
    names: dict[str, list[tuple[str, float]]] = {}  # planning node -> (node, share of its requests)
    for name in stage.plans:
        members = problem.nodes[name].members
        if not members:
            names[name] = [(name, 1.0)]
            continue
        total = sum(m.requests for m in members) or 1
        names[name] = [(m.name, m.requests / total) for m in members if m.name in open_nodes]
    spread = [(name, node, share) for name, nodes in names.items() for node, share in nodes]
    return replace(stage, plans={node: stage.plans[name] for name, node, _ in spread},
                   placement={node: stage.placement[name] for name, node, _ in spread},
                   start_costs_s={node: stage.start_costs_s[name] for name, node, _ in spread},
                   finished=tuple(node for name, nodes in names.items() if name in stage.finished for node, _ in nodes),
                   requests_left={node: stage.requests_left[name] * share for name, node, share in spread if name in stage.requests_left})
