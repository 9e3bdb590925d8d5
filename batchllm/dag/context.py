"""What a node's templates see for one (row, step): the one definition used by the
runtime (rendering requests), the checks (dry render) and the planner (prompt sizes).

- the input row's columns, and `row_id`;
- the final text of each upstream node or merge it reads, under that name;
- iterating nodes: the list element under `iterate.as`, `step` (0-based) and `previous`
  (the step before's output; None at step 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from batchllm.dag.model import NodeSpec


def template_context(node: NodeSpec, row: Mapping[str, object], upstream: Mapping[str, str | None], step: int = 0,
                     previous: str | None = None) -> dict[str, object]:
    context = dict(row)
    context.update(upstream)
    if node.iterate:
        items = cast(Sequence[object], row.get(node.iterate.over) or [])  # the column holds lists
        context.update({node.iterate.item_name: items[step] if step < len(items) else "", "step": step,
                        "previous": previous})
    return context
