"""YAML file or mapping -> DagSpec: structure, types, templates, references and the graph.

Here the top level, `inputs:`, `merges:`, `prices:`, `engine:` and the graph; each larger section has a
module of its own (`nodes_section`, `outputs_section`, `nearest_section`, `endpoints_section`).
Checks that need the data (columns, types, rows) or the models live in `io.dag_checks`.
Every error is a UserError naming the field and line (a mapping given in Python, which has
no lines: the key path, e.g. `nodes.judge.sampling.max_tokens`), raised before anything runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import networkx as nx

from batchllm.core.errors import UserError
from batchllm.core.paths import is_uri
from batchllm.dag.endpoints_section import parse_endpoints
from batchllm.dag.model import INPUT_FORMATS, DagSpec, EngineSpec, InputSpec, NodeSpec, Price
from batchllm.dag.nearest_section import check_nearest, parse_nearest
from batchllm.dag.nodes_section import parse_nodes
from batchllm.dag.outputs_section import parse_outputs
from batchllm.dag.yaml_lines import LineDict, read_yaml
from batchllm.dag.yaml_section import Section as _Section
from batchllm.dag.yaml_section import check_name, names_section
from batchllm.dag.yaml_section import place as _place


def load_dag(path: Path) -> DagSpec:
    path = Path(path)
    # not a mapping: load_dag_mapping's first check says so (a UserError)
    return load_dag_mapping(cast(Mapping, read_yaml(path)), path.parent, path.name)


def load_dag_mapping(mapping: Mapping, base_dir: Path, name: str) -> DagSpec:
    """A DAG from a mapping of the YAML file's schema (read from YAML, or built in Python).

    Relative paths (inputs, model directories) start at `base_dir`; `name` stands for the
    file in error messages (`base_dir/name`) and is the DAG's name unless it has `name:`."""
    path = Path(base_dir) / name
    raw = _with_lines(mapping)
    top = _Section(path, raw, "the DAG", 1, {"name", "inputs", "nodes", "merges", "nearest", "outputs", "engine", "prices",
                                              "endpoints"})
    inputs = _parse_inputs(top, path)
    merges = _parse_merges(top, path)
    nearest = parse_nearest(top, path, check_name)
    nodes = parse_nodes(top, path, inputs, merges, nearest)
    _check_merges(top, path, merges, nodes)
    check_nearest(top, path, nearest, nodes, merges)
    _check_graph(path, nodes)
    outputs = parse_outputs(top, path, inputs, nodes, merges, nearest)
    name = top.get("name", str, default=path.stem, expect="a string")
    return DagSpec(path=path, name=name, inputs=inputs, nodes=nodes, outputs=outputs, engine=_parse_engine(top, path),
                   merges=merges, prices=_parse_prices(top, path, nodes), nearest=nearest,
                   endpoints=parse_endpoints(top, path, nodes))


def _with_lines(value: object) -> object:
    """Plain dicts (a DAG given in Python) -> LineDicts without lines (0: errors name the
    key path instead); YAML's own LineDicts are kept as they are."""
    if isinstance(value, LineDict):
        return value
    if isinstance(value, Mapping):
        converted = LineDict({key: _with_lines(item) for key, item in value.items()})
        converted.line, converted.key_lines, converted.value_lines = 0, {}, {}
        return converted
    if isinstance(value, (list, tuple)):
        return [_with_lines(item) for item in value]
    return value


def _parse_prices(top: _Section, path: Path, nodes: dict[str, NodeSpec]) -> dict[str, Price]:
    """`prices: {<model>: {prompt_per_1m: 0.05, output_per_1m: 0.2}}`: costs in the run summary."""
    if "prices" not in top.mapping:
        return {}
    raw = top.get("prices", dict, expect="a mapping of models to {prompt_per_1m, output_per_1m}")
    models = {node.model for node in nodes.values()}
    section = _Section(path, raw, "prices", top.line("prices"), models)
    prices = {}
    for model, body in raw.items():
        item = _Section(path, body, f"prices.{model}", section.line(model), {"prompt_per_1m", "output_per_1m"})
        number: dict[str, Any] = dict(check=lambda v: v >= 0, expect="a number >= 0")
        prices[model] = Price(float(item.get("prompt_per_1m", (int, float), **number)),
                              float(item.get("output_per_1m", (int, float), **number)))
    return prices


def _parse_merges(top: _Section, path: Path) -> dict[str, tuple[str, ...]]:
    """`merges: {answer: [tech, general]}`: per row, the output of the first member that has one."""
    section = names_section(top, "merges", "a mapping of merge names to lists of nodes")
    if section is None:
        return {}
    merges = {}
    for name, members in section.mapping.items():
        check_name(section, name, "merge")
        section.get(name, list, check=lambda v: len(v) >= 2 and all(isinstance(m, str) for m in v) and len(set(v)) == len(v),
                    expect="a list of two or more different node names")
        merges[name] = tuple(members)
    return merges


def _check_merges(top: _Section, path: Path, merges: dict[str, tuple[str, ...]], nodes: dict[str, NodeSpec]) -> None:
    if not merges:
        return
    section = _Section(path, top.mapping["merges"], "merges", top.line("merges"), set(merges))
    for name, members in merges.items():
        if name in nodes:
            section.fail(name, f"merge name {name!r} is also a node", "rename the merge")
        unknown = [m for m in members if m not in nodes]
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(nodes), n=1)
            section.fail(name, f"merges.{name} names {unknown[0]!r}, which is not a node",
                         f"did you mean {close[0]!r}?" if close else f"nodes: {', '.join(nodes)}")
        if len({nodes[m].input_name for m in members}) > 1:
            section.fail(name, f"merges.{name} joins nodes of different inputs", "merge nodes that run over one input")
        tasks = sorted({nodes[m].task.value for m in members})
        if len(tasks) > 1:
            kinds = " or ".join({"embed": "a vector", "generate": "a text", "score": "a number"}[t] for t in tasks)
            section.fail(name, f"merges.{name} joins {' and '.join(tasks)} nodes: a row's result would be {kinds}",
                         "merge nodes of one task")


def _parse_inputs(top: _Section, path: Path) -> dict[str, InputSpec]:
    raw = top.get("inputs", dict, expect="a mapping of input names to {path, id_column, format}")
    if not raw:
        top.fail("inputs", "the DAG declares no inputs", "add at least one input under `inputs:`")
    section = _Section(path, raw, "inputs", top.line("inputs"), set(raw))
    inputs = {}
    for name, body in raw.items():
        check_name(section, name, "input")
        item = _Section(path, body, f"inputs.{name}", section.line(name), {"path", "id_column", "format"})
        file = item.get("path", str, expect="a path to a file, a folder or a glob")
        id_column = item.get("id_column", str, default=None, expect="a column name")
        file_format = item.get("format", str, default=None, check=lambda v: v in INPUT_FORMATS, expect=f"one of {', '.join(INPUT_FORMATS)}")
        uri = file if is_uri(file) else None
        resolved = Path(file) if Path(file).is_absolute() or uri else (path.parent / file).resolve()
        inputs[name] = InputSpec(name=name, path=resolved, id_column=id_column, line=section.line(name), format=file_format,
                                 uri=uri)
    return inputs


def _check_graph(path: Path, nodes: dict[str, NodeSpec]) -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from((up, name) for name, node in nodes.items() for up in node.upstream)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    chain = " -> ".join([edge[0] for edge in cycle] + [cycle[0][0]])
    first = nodes[cycle[0][0]]
    raise UserError(
        f"the nodes form a cycle: {chain}",
        where=_place(path, first.line, f"nodes.{first.name}"),
        hint="a node cannot read its own output, directly or through others; use `iterate:` for chains",
    )


def _parse_engine(top: _Section, path: Path) -> EngineSpec:
    if "engine" not in top.mapping:
        return EngineSpec()
    keys = {"max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "enforce_eager"}
    e = _Section(path, top.mapping["engine"], "engine", top.line("engine"), keys)
    positive: dict[str, Any] = dict(check=lambda v: v > 0, expect="a positive integer")
    return EngineSpec(
        max_model_len=e.get("max_model_len", int, None, **positive),
        max_num_seqs=e.get("max_num_seqs", int, None, **positive),
        kv_cache_memory_bytes=e.get("kv_cache_memory_bytes", int, None, **positive),
        enforce_eager=e.get("enforce_eager", bool, None, expect="true or false"),
        line=top.line("engine"),
    )
