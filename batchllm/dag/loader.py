"""YAML file or mapping -> DagSpec: structure, types, templates, references and the graph.

Checks that need the data (columns, types, rows) or the models live in `io.dag_checks`.
Every error is a UserError naming the field and line (a mapping given in Python, which has
no lines: the key path, e.g. `nodes.judge.sampling.max_tokens`), raised before anything runs.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import networkx as nx

from batchllm.core.errors import UserError
from batchllm.core.paths import is_uri
from batchllm.core.requests import ModelTask
from batchllm.core.result_schema import LOGPROB_FIELDS, RESULT_FIELD_NAMES
from batchllm.core.sampling import SAMPLING_KEYS, SamplingError, SamplingSpec, sampling_from
from batchllm.dag.endpoints_section import parse_endpoints
from batchllm.dag.model import (
    INPUT_FORMATS,
    OUTPUT_FORMATS,
    ColumnRef,
    DagSpec,
    EngineSpec,
    InputSpec,
    IterateSpec,
    NearestSpec,
    NodeSpec,
    OutputConstraint,
    OutputSpec,
    Price,
)
from batchllm.dag.nearest_section import check_nearest, parse_nearest
from batchllm.dag.node_prompt import message_templates
from batchllm.dag.node_task import EMBED_SAMPLING, default_field, parse_task, result_fields
from batchllm.dag.sql_names import sql_identifiers
from batchllm.dag.templates import bare_expression, compile_expression, compile_template
from batchllm.dag.yaml_lines import LineDict, read_yaml
from batchllm.dag.yaml_section import Section as _Section
from batchllm.dag.yaml_section import names_section
from batchllm.dag.yaml_section import place as _place
from batchllm.dag.yaml_section import show as _show

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Names every template may use besides columns and nodes; iteration adds two more.
ROW_NAMES = frozenset({"row_id"})
ITERATION_NAMES = frozenset({"step", "previous"})


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
    nearest = parse_nearest(top, path, _check_name)
    nodes = _parse_nodes(top, path, inputs, merges, nearest)
    _check_merges(top, path, merges, nodes)
    check_nearest(top, path, nearest, nodes, merges)
    _check_graph(path, nodes)
    outputs = _parse_outputs(top, path, inputs, nodes, merges, nearest)
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
        number = dict(check=lambda v: v >= 0, expect="a number >= 0")
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
        _check_name(section, name, "merge")
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


def _check_name(section: _Section, key: str, kind: str) -> None:
    if not isinstance(key, str) or not NAME_PATTERN.match(key):
        section.fail(key, f"{kind} name {key!r} is not a valid name", "use letters, digits and _, not starting with a digit")


def _parse_inputs(top: _Section, path: Path) -> dict[str, InputSpec]:
    raw = top.get("inputs", dict, expect="a mapping of input names to {path, id_column, format}")
    if not raw:
        top.fail("inputs", "the DAG declares no inputs", "add at least one input under `inputs:`")
    section = _Section(path, raw, "inputs", top.line("inputs"), set(raw))
    inputs = {}
    for name, body in raw.items():
        _check_name(section, name, "input")
        item = _Section(path, body, f"inputs.{name}", section.line(name), {"path", "id_column", "format"})
        file = item.get("path", str, expect="a path to a file, a folder or a glob")
        id_column = item.get("id_column", str, default=None, expect="a column name")
        file_format = item.get("format", str, default=None, check=lambda v: v in INPUT_FORMATS, expect=f"one of {', '.join(INPUT_FORMATS)}")
        uri = file if is_uri(file) else None
        resolved = Path(file) if Path(file).is_absolute() or uri else (path.parent / file).resolve()
        inputs[name] = InputSpec(name=name, path=resolved, id_column=id_column, line=section.line(name), format=file_format,
                                 uri=uri)
    return inputs


def _parse_sampling(node: _Section, path: Path) -> SamplingSpec:
    if "sampling" not in node.mapping:
        return SamplingSpec()
    where = f"{node.where}.sampling"
    s = _Section(path, node.mapping["sampling"], where, node.line("sampling"), set(SAMPLING_KEYS))
    try:
        return sampling_from({key: _plain(s.mapping[key]) for key in s.mapping})
    except SamplingError as error:
        s.fail(error.key if error.key in s.mapping else None, f"{where}.{error.message}")
        raise


CONSTRAINT_KEYS = ("choices", "json_schema", "regex")


def _parse_output(node: _Section, path: Path) -> OutputConstraint | None:
    """`output: {choices: [...]}`, `{json_schema: {...}}` or `{regex: "..."}`: exactly one."""
    if "output" not in node.mapping:
        return None
    where = f"{node.where}.output"
    o = _Section(path, node.mapping["output"], where, node.line("output"), set(CONSTRAINT_KEYS))
    given = [k for k in CONSTRAINT_KEYS if k in o.mapping]
    if len(given) != 1:
        o.fail(None, f"{where} must name exactly one of {', '.join(CONSTRAINT_KEYS)}, got {len(given)}",
               "e.g. `output: {choices: [yes, no]}`")
    if given == ["choices"]:
        choices = o.get("choices", list, check=lambda v: v and all(isinstance(c, str) and c for c in v),
                        expect="a non-empty list of non-empty strings")
        if len(set(choices)) != len(choices):
            o.fail("choices", f"{where}.choices lists {_show(choices)}, with a choice twice", "list each choice once")
        return OutputConstraint(choices=tuple(choices))
    if given == ["regex"]:
        return OutputConstraint(regex=o.get("regex", str, check=bool, expect="a non-empty regular expression"))
    schema = o.get("json_schema", dict, check=bool, expect="a JSON schema (a mapping)")
    return OutputConstraint(json_schema=json.dumps(_plain(schema)))  # property order kept: the engine generates in it


def _plain(value: object) -> object:
    """YAML's line-tracking mappings -> plain dicts and lists, for JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _parse_nodes(top: _Section, path: Path, inputs: dict[str, InputSpec], merges: dict[str, tuple[str, ...]],
                 nearest: dict[str, NearestSpec]) -> dict[str, NodeSpec]:
    raw = top.get("nodes", dict, expect="a mapping of node names to LLM stages")
    if not raw:
        top.fail("nodes", "the DAG declares no nodes", "add at least one LLM stage under `nodes:`")
    section = _Section(path, raw, "nodes", top.line("nodes"), set(raw))
    allowed = {"model", "adapter", "task", "input", "prompt", "pair", "system", "messages", "chat", "sampling", "where", "iterate",
               "output", "images"}
    parsed: dict[str, tuple[_Section, NodeSpec, set[str]]] = {}
    for name, body in raw.items():
        _check_name(section, name, "node")
        if name in ROW_NAMES | ITERATION_NAMES:
            section.fail(name, f"node name {name!r} is reserved", "rename the node")
        node = _Section(path, body, f"nodes.{name}", section.line(name), allowed)
        task = parse_task(node)
        default_input = next(iter(inputs)) if len(inputs) == 1 else ...
        input_name = node.get("input", str, default_input, expect="the name of an input")
        if input_name not in inputs:
            node.fail("input", f"nodes.{name}.input names unknown input {input_name!r}", f"declared inputs: {', '.join(inputs)}")
        iterate = None
        if "iterate" in node.mapping:
            it = _Section(path, node.mapping["iterate"], f"nodes.{name}.iterate", node.line("iterate"), {"over", "as"})
            iterate = IterateSpec(over=it.get("over", str, expect="a list column"), item_name=it.get("as", str, "item", expect="a name"))
        where_text = node.get("where", str, None, expect="a SQL predicate")
        names: set[str] = set()
        templates = {}
        messages = None
        if "messages" in node.mapping:
            given = [key for key in ("prompt", "system") if key in node.mapping]
            if given:
                node.fail(given[0], f"nodes.{name} gives both `messages:` and `{given[0]}:`",
                          "write the system text and the prompt as messages, or drop `messages:`")
            if node.mapping.get("chat") is False:
                node.fail("chat", f"nodes.{name} gives `messages:` with `chat: false`", "messages need the chat template")
            try:
                messages = message_templates(_plain(node.mapping["messages"]), f"nodes.{name}.messages")
            except ValueError as error:
                node.fail("messages", str(error))
            where = f"{path}, nodes.{name}.messages" if node.line("messages") else f"nodes.{name}.messages"
            if isinstance(messages, str):
                names |= compile_expression(messages, where=where).names
            else:
                for k, turn in enumerate(messages or ()):
                    names |= compile_template(turn.content, where=f"{where}[{k}].content", first_line=None).names
        for key in ("prompt", "pair", "system"):
            source = node.get(key, str, None if key != "prompt" or messages is not None else ..., expect="a template string")
            if source is not None:
                first_line = node.mapping.value_line(key)
                where = f"{path}, nodes.{name}.{key}" if first_line else f"nodes.{name}.{key}"
                templates[key] = compile_template(source, where=where, first_line=first_line)
                names |= templates[key].names
        images = _images(node, path, task, messages is not None)
        for source in images:
            names |= compile_expression(source, where=f"{node.where}.images").names
        locals_ = ITERATION_NAMES | {iterate.item_name} if iterate else frozenset()
        names -= locals_ | ROW_NAMES
        if where_text is not None:
            in_where = sql_identifiers(where_text) & (set(raw) | set(merges) | set(nearest))
            if in_where & set(nearest):
                node.fail("where", f"nodes.{name}.where reads nearest list {sorted(in_where & set(nearest))[0]!r}: `where:` "
                          "reads texts and columns", "read the list in the node's template, or route on its query's input columns")
            names |= in_where
        merges_read = tuple(sorted(n for n in names if n in merges and n not in raw))
        both = sorted(names & {m for merge in merges_read for m in merges[merge]})
        if both:
            node.fail(None, f"node {name!r} reads a merge and its member {both[0]!r}", "read the merge or its members, not both")
        reads = tuple(sorted(n for n in names if n in raw or n in merges_read))
        nearest_read = tuple(sorted(n for n in names if n in nearest and n not in raw and n not in merges))
        names = (names - set(merges_read) - set(nearest_read)) | {m for merge in merges_read for m in merges[merge]}
        names |= {end for n in nearest_read for end in (nearest[n].query, nearest[n].corpus)}
        spec = NodeSpec(
            name=name,
            model=node.get("model", str, expect="a model name or directory"),
            input_name=input_name,
            prompt=templates["prompt"].source if "prompt" in templates else "",
            system=templates["system"].source if "system" in templates else None,
            chat=node.get("chat", bool, task is ModelTask.GENERATE, expect="true or false"),
            sampling=EMBED_SAMPLING if task.pools else _parse_sampling(node, path),
            where=where_text,
            iterate=iterate,
            line=section.line(name),
            upstream=tuple(sorted(n for n in names if n in raw)),
            columns_used=tuple(sorted(n for n in names if n not in raw)),
            output=_parse_output(node, path),
            merges_read=merges_read,
            reads=reads,
            messages=messages,
            task=task,
            nearest_read=nearest_read,
            pair=templates["pair"].source if "pair" in templates else None,
            **_adapter(node, path, task),
            images=images,
            image_dir=str(_input_folder(inputs[input_name])) if images else ".",
        )
        parsed[name] = (node, spec, names)
    for name, (node, spec, _) in parsed.items():
        for read in spec.reads:
            for member in merges.get(read, (read,)):
                if parsed[member][1].task is ModelTask.EMBED:
                    node.fail(None, f"node {name!r} reads {member!r} as text, but {member!r} is an embed node: its result is a vector",
                              f"take {member}.vector into an output column (outputs: ... columns: {{v: {member}.vector}}) instead")
        for read in spec.nearest_read:
            query_input = parsed[nearest[read].query][1].input_name if nearest[read].query in parsed else spec.input_name
            if query_input != spec.input_name:
                node.fail("input", f"node {name!r} reads nearest list {read!r}, whose rows are per row of input {query_input!r}, "
                          f"but runs over {spec.input_name!r}", f"set `input: {query_input}` on {name!r}")
        corpora = {nearest[read].corpus for read in spec.nearest_read} - {nearest[read].query for read in spec.nearest_read} - set(spec.reads)
        for up in spec.upstream:
            if up not in corpora and parsed[up][1].input_name != spec.input_name:
                node.fail(None, f"node {name!r} reads node {up!r}, which runs over another input ({parsed[up][1].input_name!r})",
                          "nodes joined row by row must share one input")
    return {name: spec for name, (_, spec, _) in parsed.items()}


def _adapter(node: _Section, path: Path, task: ModelTask) -> dict[str, str | None]:
    """`adapter:` on a generation node, as NodeSpec holds it: the LoRA adapter directory (relative to
    the DAG file) and the value as written (on a model served from endpoints: its name there)."""
    adapter = node.get("adapter", str, None, check=bool, expect="a LoRA adapter directory (on endpoints: its name there)")
    if adapter is not None and task is not ModelTask.GENERATE:
        node.fail("adapter", f"{node.where}.adapter: a LoRA adapter applies to a generation node, not to one with `task: {task.value}`",
                  "drop `adapter:`, or give it a node that generates")
    return {"adapter": None if adapter is None else str((path.parent / adapter).resolve()), "adapter_name": adapter}


def _images(node: _Section, path: Path, task: ModelTask, has_messages: bool) -> tuple[str, ...]:
    """`images:` as expressions: one (`"{{ photo }}"`: a row's image, or its list of images) or a list
    of them (one image each), shown before the prompt's text in the user message."""
    if "images" not in node.mapping:
        return ()
    value = _plain(node.mapping["images"])
    items = value if isinstance(value, list) else [value]
    how = "write `images: \"{{ photo }}\"` (a column of paths, data: URIs or image bytes) or a list of such expressions"
    sources = []
    for item in items:
        expression = bare_expression(item) if isinstance(item, str) else None
        if expression is None:
            node.fail("images", f"{node.where}.images must be an expression such as \"{{{{ photo }}}}\" or a list of them, got {value!r}", how)
        sources.append(expression)
    if not sources:
        node.fail("images", f"{node.where}.images is an empty list", how)
    if task is not ModelTask.GENERATE:
        node.fail("images", f"{node.where}.images: images go to a generation node, not to one with `task: {task.value}`",
                  "drop `images:`, or give them to a node that generates with a vision-language model")
    if has_messages or node.mapping.get("chat") is False:
        what = "`messages:`" if has_messages else "`chat: false`"
        node.fail("images", f"{node.where}.images goes with a `prompt:` in the chat (the images come before its text), not with {what}",
                  "write the user message as `prompt:` (and `system:`), chat on")
    return tuple(sources)


def _input_folder(spec: InputSpec) -> Path:
    """Where a row's relative image paths start: the input file's folder (a folder input: itself)."""
    if spec.uri is not None:
        return Path(".")
    return spec.path if spec.path.is_dir() else spec.path.parent


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


def _parse_outputs(top: _Section, path: Path, inputs: dict[str, InputSpec], nodes: dict[str, NodeSpec],
                   merges: dict[str, tuple[str, ...]], nearest: dict[str, NearestSpec]) -> dict[str, OutputSpec]:
    if "outputs" not in top.mapping:  # default: one data set per input, every node's text
        outputs = {}
        for input_name in inputs:
            columns = {}
            for n, spec in nodes.items():
                if spec.input_name == input_name:
                    columns[n] = ColumnRef(n, default_field(spec.task))
                    for field, kind in (spec.output.json_fields() if spec.output else {}).items():
                        columns.setdefault(f"{n}_{field}", ColumnRef(n, field, kind))
            name = "results" if len(inputs) == 1 else input_name
            if columns:
                outputs[name] = OutputSpec(name=name, input_name=input_name, columns=columns, line=0)
        return outputs
    raw = top.get("outputs", dict, expect="a mapping of output names to {columns}")
    section = _Section(path, raw, "outputs", top.line("outputs"), set(raw))
    outputs = {}
    for name, body in raw.items():
        _check_name(section, name, "output")
        out = _Section(path, body, f"outputs.{name}", section.line(name), {"input", "columns", "format", "copy_to"})
        columns_raw = out.get("columns", dict, expect="a mapping of column names to `column`, `node` or `node.field`")
        columns = {}
        for column, ref in columns_raw.items():
            if not isinstance(ref, str):
                out.fail("columns", f"outputs.{name}.columns.{column} must be a string, got {_show(ref)}")
            head, _, field = ref.partition(".")
            if head in nearest and head not in nodes:
                out.fail("columns", f"outputs.{name}.columns.{column} names nearest list {head!r}: an output column is one value a row",
                         f"take what a node made of it (a node whose template reads {head!r}), or {nearest[head].query}.vector")
            if head in nodes or head in merges:
                task = nodes[merges.get(head, (head,))[0]].task  # a merge's members share one (_check_merges)
                field = field or default_field(task)
                json_fields = _json_fields(head, nodes, merges)
                with_logprobs = all(nodes[m].sampling.logprobs for m in merges.get(head, (head,)))
                known = result_fields(task) or (*RESULT_FIELD_NAMES, *(LOGPROB_FIELDS if with_logprobs else ()))
                if field not in known and field not in json_fields:
                    hint = (f"set `sampling: {{logprobs: true}}` on {head!r} to keep them" if field in LOGPROB_FIELDS
                            else f"fields: {', '.join((*known, *json_fields))}")
                    out.fail("columns", f"outputs.{name}.columns.{column}: {ref!r} names unknown field {field!r}", hint)
                columns[column] = ColumnRef(head, field, None if field in known else json_fields[field])
            else:
                columns[column] = ColumnRef(None, ref)
        node_inputs = {nodes[merges[c.node][0] if c.node in merges else c.node].input_name for c in columns.values() if c.node}
        default_input = next(iter(node_inputs)) if len(node_inputs) == 1 else (next(iter(inputs)) if len(inputs) == 1 else ...)
        input_name = out.get("input", str, default_input, expect="the name of an input")
        if input_name not in inputs:
            out.fail("input", f"outputs.{name}.input names unknown input {input_name!r}", f"declared inputs: {', '.join(inputs)}")
        if node_inputs - {input_name}:
            out.fail("columns", f"outputs.{name} mixes nodes of different inputs", "make one output per input")
        file_format = out.get("format", str, "parquet", check=lambda v: v in OUTPUT_FORMATS, expect=f"one of {', '.join(OUTPUT_FORMATS)}")
        copy_to = out.get("copy_to", str, None, check=bool, expect="a path or a URI such as s3://bucket/results.parquet")
        if copy_to is not None and not is_uri(copy_to) and not Path(copy_to).is_absolute():
            copy_to = str((path.parent / copy_to).resolve())
        outputs[name] = OutputSpec(name=name, input_name=input_name, columns=columns, line=section.line(name), format=file_format,
                                   copy_to=copy_to)
    return outputs


def _json_fields(name: str, nodes: dict[str, NodeSpec], merges: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The typed JSON fields of a node's output, or those every member of a merge has alike."""
    per_member = [cast(OutputConstraint, nodes[m].output).json_fields() if nodes[m].output else {}
                  for m in merges.get(name, (name,))]
    return {field: kind for field, kind in per_member[0].items() if all(other.get(field) == kind for other in per_member)}


def _parse_engine(top: _Section, path: Path) -> EngineSpec:
    if "engine" not in top.mapping:
        return EngineSpec()
    keys = {"max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "enforce_eager"}
    e = _Section(path, top.mapping["engine"], "engine", top.line("engine"), keys)
    positive = dict(check=lambda v: v > 0, expect="a positive integer")
    return EngineSpec(
        max_model_len=e.get("max_model_len", int, None, **positive),
        max_num_seqs=e.get("max_num_seqs", int, None, **positive),
        kv_cache_memory_bytes=e.get("kv_cache_memory_bytes", int, None, **positive),
        enforce_eager=e.get("enforce_eager", bool, None, expect="true or false"),
        line=top.line("engine"),
    )
