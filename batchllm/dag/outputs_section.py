"""The DAG's `outputs:` section: each output's input, its columns (an input column, a node's field,
or a merge's), its format and where a copy goes; without the section, one data set per input with
every node's text.

    outputs:
      judged: {columns: {question: question, answer: answer, verdict: judge}, format: parquet}
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from batchllm.core.paths import is_uri
from batchllm.core.result_schema import LOGPROB_FIELDS, RESULT_FIELD_NAMES
from batchllm.dag.model import OUTPUT_FORMATS, ColumnRef, InputSpec, NearestSpec, NodeSpec, OutputConstraint, OutputSpec
from batchllm.dag.node_task import default_field, result_fields
from batchllm.dag.yaml_section import Section, check_name, show


def parse_outputs(top: Section, path: Path, inputs: dict[str, InputSpec], nodes: dict[str, NodeSpec],
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
    section = Section(path, raw, "outputs", top.line("outputs"), set(raw))
    outputs = {}
    for name, body in raw.items():
        check_name(section, name, "output")
        out = Section(path, body, f"outputs.{name}", section.line(name), {"input", "columns", "format", "copy_to"})
        columns_raw = out.get("columns", dict, expect="a mapping of column names to `column`, `node` or `node.field`")
        columns = {}
        for column, ref in columns_raw.items():
            if not isinstance(ref, str):
                out.fail("columns", f"outputs.{name}.columns.{column} must be a string, got {show(ref)}")
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
