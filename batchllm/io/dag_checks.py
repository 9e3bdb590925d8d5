"""Checks of a parsed DAG against its data and models, before anything runs.

Columns a template reads must exist in the node's input and hold strings; an
`iterate.over` column must hold lists of strings; a `where:` predicate must bind in
DuckDB over the input columns and upstream outputs; every model must resolve, and do
what its nodes ask of it (a generation node needs a model with a language-model head; an
embed node runs on devices here, with a model whose vector size its files name; a node's
`images:` read columns of paths, URIs or bytes, for a vision-language model).
Inputs are opened, not loaded: the checks read their schemas and first row only.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import cast

import pyarrow as pa

from batchllm.core.errors import UserError
from batchllm.core.requests import ModelTask
from batchllm.dag.context import nearest_samples, template_context, upstream_stand_ins
from batchllm.dag.model import DagSpec, NodeSpec
from batchllm.dag.node_prompt import NodePrompt
from batchllm.dag.templates import compile_expression
from batchllm.io.input_source import InputSource, open_inputs
from batchllm.io.sql import where_row_ids
from batchllm.models.lora_adapter import AdapterError, LoraAdapter
from batchllm.models.model_kind import ModelKind
from batchllm.models.registry import resolve_model


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_text_list(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _is_text(kind.value_type)


def _is_image(kind: pa.DataType) -> bool:
    """What a row's images may be (see core.images): paths or URIs, bytes, a list of either, or a
    Hugging Face datasets image struct {bytes, path}."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _is_image(kind.value_type)
    if pa.types.is_struct(kind):
        names = {kind.field(k).name for k in range(kind.num_fields)}
        return bool(names & {"bytes", "path"}) and all(_is_image(kind.field(k).type) for k in range(kind.num_fields)
                                                       if kind.field(k).name in ("bytes", "path"))
    return _is_text(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _is_message_list(kind: pa.DataType) -> bool:
    """list<struct<role: string, content: string, ...>>: a conversation column."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    names = {kind.value_type.field(k).name: kind.value_type.field(k).type for k in range(kind.value_type.num_fields)}
    return "role" in names and "content" in names and _is_text(names["role"]) and _is_text(names["content"])


def check_dag(dag: DagSpec, home: Path, *, resolve_models: bool = True) -> dict[str, InputSource]:
    """Validate everything that needs data or models; returns the opened inputs.
    Planning for other hardware names models by profile only: `resolve_models=False`."""
    sources = open_inputs(dag.inputs)
    first_rows = {name: source.head_rows(1) for name, source in sources.items()}
    first_records = {name: rows.to_pylist()[0] for name, rows in first_rows.items()}
    _check_nearest_sizes(dag, sources)
    for node in dag.nodes.values():
        _check_node(dag, node, first_rows[node.input_name], nearest_samples(dag, node, first_records))
        if node.task.pools and node.model in dag.endpoints:
            raise UserError(f"node {node.name!r} {node.task.verb} with {node.model!r}, which the DAG serves from endpoints: "
                            f"batchllm {node.task.verb} on its own devices only", where=dag.where(node.line, f"nodes.{node.name}.task"),
                            hint=f"drop {node.model!r} from `endpoints:` to run it here")
        if resolve_models and node.model not in dag.endpoints:  # a server's model needs no files here
            kind = _node_model_kind(dag, node, home)
            if node.images and not kind.sees_images:
                raise UserError(f"node {node.name!r} gives its model images, but model {node.model!r} "
                                f"({', '.join(kind.architectures) or 'no architecture in its config.json'}) sees none: its config has "
                                "no vision_config", where=dag.where(node.line, f"nodes.{node.name}.images"),
                                hint="give the node a vision-language model (LLaVA, Idefics3, SmolVLM, ...), or drop `images:`")
            if node.adapter is not None:
                _check_adapter(dag, node, home)
    for output in dag.outputs.values():
        schema = first_rows[output.input_name].schema
        for column, ref in output.columns.items():
            if ref.node is None and ref.field not in schema.names:
                raise UserError(
                    f"outputs.{output.name}.columns.{column} names {ref.field!r}, which is neither a node nor a column of input {output.input_name!r}",
                    where=dag.where(output.line, f"outputs.{output.name}.columns.{column}", in_file=False),
                    hint=f"nodes: {', '.join(dag.nodes)}; columns: {', '.join(schema.names)}",
                )
    return sources


def _check_nearest_sizes(dag: DagSpec, sources: dict[str, InputSource]) -> None:
    """A nearest list's k is at most its corpus's rows."""
    for name, spec in dag.nearest.items():
        corpus = dag.nodes[spec.corpus]
        rows = sources[corpus.input_name].num_rows
        if spec.k > rows:
            raise UserError(f"nearest.{name}.k is {spec.k}, but its corpus {spec.corpus!r} runs over input {corpus.input_name!r}, "
                            f"which has {rows:,} rows", where=dag.where(spec.line, f"nearest.{name}.k"),
                            hint=f"set k to at most {rows:,}")


def _check_node(dag: DagSpec, node: NodeSpec, first_row: pa.Table, nearest: dict[str, list[dict[str, object]]]) -> None:
    """`first_row`: the input's first row as templates see it (its columns and `row_id`); `nearest`:
    stand-ins for the nearest lists it reads."""
    where = dag.where(node.line, f"nodes.{node.name}")
    schema = first_row.schema
    image_columns = {name for source in node.images for name in compile_expression(source, where=f"{where}.images").names}
    for column in node.columns_used:
        if column not in schema.names:
            close = difflib.get_close_matches(column, [*schema.names, *dag.nodes], n=1)
            listing = f"columns of {node.input_name!r}: {', '.join(schema.names)}; nodes: {', '.join(dag.nodes)}"
            raise UserError(
                f"the template or `where` reads {column!r}, which is neither a node nor a column of input {node.input_name!r}",
                where=where,
                hint=f"did you mean {close[0]!r}? ({listing})" if close else listing,
            )
        if column in dag.nodes:
            raise UserError(f"{column!r} is both a node and a column of input {node.input_name!r}", where=where, hint="rename the node")
        kind = schema.field(column).type
        if isinstance(node.messages, str) and _is_message_list(kind):
            continue
        if column in image_columns:
            if not _is_image(kind):
                raise UserError(f"column {column!r} of input {node.input_name!r} has type {kind}, but `images:` reads paths, "
                                "URIs or image bytes", where=dag.where(node.line, f"nodes.{node.name}.images"),
                                hint="give it a column of strings (paths, data: URIs), of binary (the image files' bytes), a list "
                                     "of those, or a struct {bytes, path} as Hugging Face datasets store images")
            continue
        if not _is_text(kind) and not (node.iterate and column == node.iterate.over):
            raise UserError(
                f"column {column!r} of input {node.input_name!r} has type {kind}, but prompt columns must be strings",
                where=where,
                hint=f"convert it to text in the input file (e.g. DuckDB: CAST({column} AS VARCHAR))",
            )
    if node.iterate:
        over = node.iterate.over
        if over not in schema.names:
            raise UserError(f"iterate.over names {over!r}, which is not a column of input {node.input_name!r}", where=where,
                            hint=f"columns: {', '.join(schema.names)}")
        if not _is_text_list(schema.field(over).type):
            raise UserError(f"iterate.over column {over!r} has type {schema.field(over).type}, but must be a list of strings",
                            where=where, hint="store the chunks of each row as list<string>")
    stand_ins = upstream_stand_ins(dag, node)
    if node.where:
        empty = {name: pa.array([], pa.float64() if isinstance(value, float) else pa.string()) for name, value in stand_ins.items()}
        where_row_ids(first_row.slice(0, 0), empty, node.where, where=f"{where}.where")
    _dry_render(node, first_row, {**stand_ins, **nearest}, where)


def _dry_render(node: NodeSpec, first_row: pa.Table, upstream: dict[str, object], where: str) -> None:
    """Render the node's prompt on the first row at step 0, upstream outputs as stand-ins."""
    row = first_row.to_pylist()[0]
    context = template_context(node, row, upstream)
    NodePrompt(node).render(context, where=where)


def _check_adapter(dag: DagSpec, node: NodeSpec, home: Path) -> None:
    """The node's LoRA adapter can be read, fits its base model and has a rank vLLM's engine takes."""
    assert node.adapter is not None
    where = dag.where(node.line, f"nodes.{node.name}.adapter")
    try:
        adapter = LoraAdapter.read(Path(node.adapter))
        adapter.engine_rank()
    except AdapterError as error:
        raise UserError(str(error), where=where, hint=error.hint) from None
    config_dir = resolve_model(node.model, dag_dir=dag.path.parent, home=home, where=where).config_dir(home)
    try:
        base = json.loads((config_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # a base without a readable config: vLLM says what it finds when it loads the adapter
    misfit = adapter.misfit(base)
    if misfit is not None:
        raise UserError(f"adapter {node.adapter!r} was made for another base than {node.model!r}: {misfit}", where=where,
                        hint="give the node the model the adapter was trained on, or an adapter trained on this one")


def node_vector_dimensions(dag: DagSpec, home: Path) -> dict[str, int]:
    """Each embed node's vector size (its model's), and each classify node's labels (its
    probabilities' vector), checked as `check_dag` does."""
    sizes = {}
    for name, node in dag.nodes.items():
        if node.task is ModelTask.EMBED:  # _node_model_kind refuses an embed node's model without one
            sizes[name] = cast(int, _node_model_kind(dag, node, home).vector_dimensions)
        elif node.task is ModelTask.CLASSIFY:  # and a classify node's without labels
            sizes[name] = len(_node_model_kind(dag, node, home).labels)
    return sizes


def _node_model_kind(dag: DagSpec, node: NodeSpec, home: Path) -> ModelKind:
    """The node's model resolved, and what it can do; UserError if it cannot do what the node asks."""
    where = dag.where(node.line, f"nodes.{node.name}.model")
    kind = ModelKind.of(resolve_model(node.model, dag_dir=dag.path.parent, home=home, where=where).config_dir(home))
    if node.task is ModelTask.GENERATE and kind.architectures and not kind.generates:
        only, task = ("classifies", "classify") if kind.classifies else ("embeds", "embed")
        raise UserError(f"node {node.name!r} generates text, but model {node.model!r} ({', '.join(kind.architectures)}) has no "
                        f"language-model head: it {only} only", where=where,
                        hint=f"set `task: {task}` on the node, or give it a generation model")
    if node.task is ModelTask.EMBED and kind.classifies:
        raise UserError(f"node {node.name!r} embeds, but model {node.model!r} ({', '.join(kind.architectures)}) is a classifier",
                        where=where, hint="set `task: classify` on the node, or give it an embedding model, such as the embedded 'minilm-l6'")
    if node.task is ModelTask.CLASSIFY:
        if not kind.classifies or not kind.labels:
            architectures = ", ".join(kind.architectures) or "no architecture in its config.json"
            what = "its config names no labels (no id2label, no num_labels)" if kind.classifies else "it has no classification head"
            raise UserError(f"node {node.name!r} classifies, but model {node.model!r} ({architectures}): {what}", where=where,
                            hint="give the node a sequence-classification model (architectures: ...ForSequenceClassification, "
                                 "with id2label or num_labels in its config.json)")
        return kind
    if node.task.pools and kind.vector_dimensions is None:
        raise UserError(f"node {node.name!r} {node.task.verb}, but model {node.model!r} names no vector size (no hidden_size in "
                        "its config.json, no sentence-transformers pooling files)", where=where,
                        hint="give the node an embedding model, such as the embedded 'minilm-l6'")
    if node.task is ModelTask.SCORE and kind.classifies and len(kind.labels) != 1:
        raise UserError(f"node {node.name!r} scores, but model {node.model!r} ({', '.join(kind.architectures)}) is a classifier of "
                        f"{len(kind.labels) or 'unnamed'} labels: a cross-encoder that scores gives one", where=where,
                        hint="give the node a cross-encoder (one label) or an embedding model, such as the embedded 'minilm-l6'; "
                             "or set `task: classify` for the labels' probabilities")
    return kind
