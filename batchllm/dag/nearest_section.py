"""The DAG's `nearest:` section: retrieval inside the DAG. Each entry names, per row of one embed
node's input, the k rows of another embed node's input whose vectors are nearest (cosine):

    nearest:
      passages: {query: question_vector, corpus: document_vector, k: 3}

A node whose template reads `passages` runs over `question_vector`'s input once
`document_vector` has run on every row, and sees a list of the 3 nearest document rows (each
their input's columns, `row_id` and `similarity`), nearest first. The rows come from the
corpus's input; `k` over its rows is refused with the data (`io.dag_checks`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from batchllm.core.requests import ModelTask
from batchllm.dag.model import NearestSpec, NodeSpec
from batchllm.dag.yaml_section import Section, names_section

KEYS = {"query", "corpus", "k"}


def parse_nearest(top: Section, path: Path, check_name: Callable[[Section, str, str], None]) -> dict[str, NearestSpec]:
    """Each entry's fields, typed; what they name is checked by `check_nearest` once the nodes are parsed."""
    section = names_section(top, "nearest", "a mapping of names to {query, corpus, k}")
    if section is None:
        return {}
    nearest = {}
    for name, body in section.mapping.items():
        check_name(section, name, "nearest list")
        entry = Section(path, body, f"nearest.{name}", section.line(name), KEYS)
        nearest[name] = NearestSpec(name, query=entry.get("query", str, expect="an embed node"),
                                    corpus=entry.get("corpus", str, expect="an embed node"),
                                    k=entry.get("k", int, check=lambda v: v >= 1, expect="an integer >= 1"), line=section.line(name))
    return nearest


def check_nearest(top: Section, path: Path, nearest: dict[str, NearestSpec], nodes: dict[str, NodeSpec],
                  merges: dict[str, tuple[str, ...]]) -> None:
    """Both ends are embed nodes of one model (vectors of one space), and the name is no node's or merge's."""
    if not nearest:
        return
    section = Section(path, top.mapping["nearest"], "nearest", top.line("nearest"), set(nearest))
    for name, spec in nearest.items():
        if name in nodes or name in merges:
            section.fail(name, f"nearest list {name!r} has the name of a {'node' if name in nodes else 'merge'}", "rename it")
        entry = Section(path, top.mapping["nearest"][name], f"nearest.{name}", section.line(name), KEYS)
        for key in ("query", "corpus"):
            node = nodes.get(getattr(spec, key))
            if node is None:
                entry.fail(key, f"nearest.{name}.{key} names {getattr(spec, key)!r}, which is not a node",
                           f"nodes: {', '.join(nodes)}")
            if node.task is not ModelTask.EMBED:
                entry.fail(key, f"nearest.{name}.{key} names {node.name!r}, which generates text: nearest rows are found by vectors",
                           f"name an embed node (`task: embed`), or add one that embeds {node.name!r}'s text")
        query, corpus = nodes[spec.query], nodes[spec.corpus]
        if query.model != corpus.model:
            entry.fail("corpus", f"nearest.{name}: {spec.query!r} embeds with {query.model!r} and {spec.corpus!r} with "
                       f"{corpus.model!r}: vectors of two models are not comparable", "embed both with one model")
