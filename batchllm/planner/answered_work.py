"""The plan of what is left when part of a DAG's requests is answered before the run begins (by
the result store): each node starts with that share of its requests done, and a node answered
whole is finished before the first stage, so its consumers are ready at once. `run` takes those
answers without an engine, so a plan that computed them would promise the user a longer wait
than the command will be (a DAG run before: the plan said 39.8 s, the run took 18.9 s)."""

from __future__ import annotations

from collections.abc import Mapping

from batchllm.planner.problem import PlanProblem
from batchllm.planner.timeline import NodeState


def answered_states(problem: PlanProblem, answered_share: Mapping[str, float]) -> dict[str, NodeState]:
    """Each unfinished planning node's state with `answered_share` (by DAG node, 0 to 1) of its
    requests done; an engine group's members' shares weighted by their requests."""
    states = {}
    for name, node in problem.nodes.items():
        parts = [(m.name, m.requests) for m in node.members] or [(name, node.requests)]
        done = sum(min(max(answered_share.get(part, 0.0), 0.0), 1.0) * requests for part, requests in parts)
        if node.requests and done >= node.requests:
            continue  # answered whole: finished before the first stage
        states[name] = NodeState(len(node.rounds), 0.0, 1.0).capped(node, done) if done else NodeState()
    return states

