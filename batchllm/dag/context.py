"""What a node's templates see for one (row, step): the one definition used by the
runtime (rendering requests), the checks (dry render) and the planner (prompt sizes).

- the input row's columns, and `row_id`;
- the final text of each upstream node or merge it reads, under that name (a score node's: its number);
- each nearest list it reads (`nearest:`), under its name: the corpus rows as `nearest_item`s;
- iterating nodes: the list element under `iterate.as`, `step` (0-based) and `previous`
  (the step before's output; None at step 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from batchllm.core.requests import ModelTask
from batchllm.dag.model import DagSpec, NodeSpec


def nearest_item(row: Mapping[str, object], similarity: float) -> dict[str, object]:
    """One row of a nearest list as templates see it: its input's columns, `row_id`, and `similarity`
    (the cosine of its vector and the query's)."""
    return {**row, "similarity": similarity}


def template_context(node: NodeSpec, row: Mapping[str, object], upstream: Mapping[str, object], step: int = 0,
                     previous: str | None = None) -> dict[str, object]:
    context = dict(row)
    context.update(upstream)
    if node.iterate:
        items = cast(Sequence[object], row.get(node.iterate.over) or [])  # the column holds lists
        context.update({node.iterate.item_name: items[step] if step < len(items) else "", "step": step,
                        "previous": previous})
    return context


def nearest_samples(dag: DagSpec, node: NodeSpec, first_rows: Mapping[str, Mapping[str, object]]) -> dict[str, list[dict[str, object]]]:
    """Stand-ins for the nearest lists a node reads, to render it before anything ran: k copies of
    each corpus input's first row (`first_rows`: per input, as templates see it)."""
    samples = {}
    for name in node.nearest_read:
        spec = dag.nearest[name]
        samples[name] = [nearest_item(first_rows[dag.nodes[spec.corpus].input_name], 1.0)] * spec.k
    return samples


def upstream_stand_ins(dag: DagSpec, node: NodeSpec) -> dict[str, object]:
    """What a node's templates read by name, before anything ran: empty text, or 0.0 for a score node (or a merge of them).
    A node not in `dag` (on servers, left out of the planner's part) generates text."""
    def scores(name: str) -> bool:
        first = dag.merges.get(name, (name,))[0]
        return first in dag.nodes and dag.nodes[first].task is ModelTask.SCORE

    return {name: 0.0 if scores(name) else "" for name in node.reads}
