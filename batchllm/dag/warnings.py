"""Warnings about a DAG that validates but will likely not do what its author meant.

A node runs on a row only when every node it reads produced an output for that row. Two
routes of one router (`where:` nodes over the same upstream nodes) usually take disjoint
rows, so a node that reads both directly never runs on any row. Reading their merge
(`merges:`) is what was meant.
"""

from __future__ import annotations

from batchllm.dag.model import DagSpec


def dag_warnings(dag: DagSpec) -> list[str]:
    warnings = []
    for name, node in dag.nodes.items():
        direct = [u for u in node.reads if u in dag.nodes]
        routes: dict[tuple[str, ...], list[str]] = {}
        for up in direct:
            if dag.nodes[up].where:
                routes.setdefault(tuple(sorted(dag.nodes[up].upstream)), []).append(up)
        for siblings in routes.values():
            if len(siblings) > 1:
                listed = " and ".join(repr(s) for s in siblings)
                warnings.append(
                    f"{dag.where(node.line, f'nodes.{name}', in_file=False)}: node {name!r} reads {listed}, routes with their own `where:`; it runs "
                    f"only on rows where all of them answered, which may be none. To read whichever answered, "
                    f"merge them: `merges: {{answer: [{', '.join(siblings)}]}}` and read `{{{{ answer }}}}`")
    return warnings
