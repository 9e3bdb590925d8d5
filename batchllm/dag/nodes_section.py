"""The DAG's `nodes:` section: each node's model, task, input, templates (prompt, system, pair,
messages), images, sampling, output constraint, adapter, `where:` and `iterate:`, and what it
reads (columns, upstream nodes, merges, nearest lists), checked against the other nodes.

    nodes:
      answer: {model: smollm2-135m, prompt: "{{ question }}", sampling: {max_tokens: 64}}
      judge:  {model: smollm2-135m, prompt: "Q: {{ question }} A: {{ answer }}", output: {choices: [good, bad]}}
"""

from __future__ import annotations

import json
from pathlib import Path

from batchllm.core.requests import ModelTask
from batchllm.core.sampling import SAMPLING_KEYS, SamplingError, SamplingSpec, sampling_from
from batchllm.dag.model import InputSpec, IterateSpec, NearestSpec, NodeSpec, OutputConstraint
from batchllm.dag.node_prompt import message_templates
from batchllm.dag.node_task import EMBED_SAMPLING, parse_task
from batchllm.dag.sql_names import sql_identifiers
from batchllm.dag.templates import bare_expression, compile_expression, compile_template
from batchllm.dag.yaml_section import Section, check_name, plain, show

# Names every template may use besides columns and nodes; iteration adds two more.
ROW_NAMES = frozenset({"row_id"})
ITERATION_NAMES = frozenset({"step", "previous"})


def parse_nodes(top: Section, path: Path, inputs: dict[str, InputSpec], merges: dict[str, tuple[str, ...]],
                 nearest: dict[str, NearestSpec]) -> dict[str, NodeSpec]:
    raw = top.get("nodes", dict, expect="a mapping of node names to LLM stages")
    if not raw:
        top.fail("nodes", "the DAG declares no nodes", "add at least one LLM stage under `nodes:`")
    section = Section(path, raw, "nodes", top.line("nodes"), set(raw))
    allowed = {"model", "adapter", "task", "input", "prompt", "pair", "system", "messages", "chat", "sampling", "where", "iterate",
               "output", "images"}
    parsed: dict[str, tuple[Section, NodeSpec, set[str]]] = {}
    for name, body in raw.items():
        check_name(section, name, "node")
        if name in ROW_NAMES | ITERATION_NAMES:
            section.fail(name, f"node name {name!r} is reserved", "rename the node")
        node = Section(path, body, f"nodes.{name}", section.line(name), allowed)
        task = parse_task(node)
        default_input = next(iter(inputs)) if len(inputs) == 1 else ...
        input_name = node.get("input", str, default_input, expect="the name of an input")
        if input_name not in inputs:
            node.fail("input", f"nodes.{name}.input names unknown input {input_name!r}", f"declared inputs: {', '.join(inputs)}")
        iterate = None
        if "iterate" in node.mapping:
            it = Section(path, node.mapping["iterate"], f"nodes.{name}.iterate", node.line("iterate"), {"over", "as"})
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
                messages = message_templates(plain(node.mapping["messages"]), f"nodes.{name}.messages")
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
    _check_reads(parsed, merges, nearest)
    return {name: spec for name, (_, spec, _) in parsed.items()}


def _check_reads(parsed: dict[str, tuple[Section, NodeSpec, set[str]]], merges: dict[str, tuple[str, ...]],
                 nearest: dict[str, NearestSpec]) -> None:
    """What each node reads, against the nodes it reads: no embed node's vector as text, a nearest list
    per row of the node's own input, upstream nodes over the same input (row by row)."""
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


def _parse_sampling(node: Section, path: Path) -> SamplingSpec:
    if "sampling" not in node.mapping:
        return SamplingSpec()
    where = f"{node.where}.sampling"
    s = Section(path, node.mapping["sampling"], where, node.line("sampling"), set(SAMPLING_KEYS))
    try:
        return sampling_from({key: plain(s.mapping[key]) for key in s.mapping})
    except SamplingError as error:
        s.fail(error.key if error.key in s.mapping else None, f"{where}.{error.message}")
        raise


CONSTRAINT_KEYS = ("choices", "json_schema", "regex")


def _parse_output(node: Section, path: Path) -> OutputConstraint | None:
    """`output: {choices: [...]}`, `{json_schema: {...}}` or `{regex: "..."}`: exactly one."""
    if "output" not in node.mapping:
        return None
    where = f"{node.where}.output"
    o = Section(path, node.mapping["output"], where, node.line("output"), set(CONSTRAINT_KEYS))
    given = [k for k in CONSTRAINT_KEYS if k in o.mapping]
    if len(given) != 1:
        o.fail(None, f"{where} must name exactly one of {', '.join(CONSTRAINT_KEYS)}, got {len(given)}",
               "e.g. `output: {choices: [yes, no]}`")
    if given == ["choices"]:
        choices = o.get("choices", list, check=lambda v: v and all(isinstance(c, str) and c for c in v),
                        expect="a non-empty list of non-empty strings")
        if len(set(choices)) != len(choices):
            o.fail("choices", f"{where}.choices lists {show(choices)}, with a choice twice", "list each choice once")
        return OutputConstraint(choices=tuple(choices))
    if given == ["regex"]:
        return OutputConstraint(regex=o.get("regex", str, check=bool, expect="a non-empty regular expression"))
    schema = o.get("json_schema", dict, check=bool, expect="a JSON schema (a mapping)")
    return OutputConstraint(json_schema=json.dumps(plain(schema)))  # property order kept: the engine generates in it


def _adapter(node: Section, path: Path, task: ModelTask) -> dict[str, str | None]:
    """`adapter:` on a generation node, as NodeSpec holds it: the LoRA adapter directory (relative to
    the DAG file) and the value as written (on a model served from endpoints: its name there)."""
    adapter = node.get("adapter", str, None, check=bool, expect="a LoRA adapter directory (on endpoints: its name there)")
    if adapter is not None and task is not ModelTask.GENERATE:
        node.fail("adapter", f"{node.where}.adapter: a LoRA adapter applies to a generation node, not to one with `task: {task.value}`",
                  "drop `adapter:`, or give it a node that generates")
    return {"adapter": None if adapter is None else str((path.parent / adapter).resolve()), "adapter_name": adapter}


def _images(node: Section, path: Path, task: ModelTask, has_messages: bool) -> tuple[str, ...]:
    """`images:` as expressions: one (`"{{ photo }}"`: a row's image, or its list of images) or a list
    of them (one image each), shown before the prompt's text in the user message."""
    if "images" not in node.mapping:
        return ()
    value = plain(node.mapping["images"])
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
