"""A request file's groups -> the DAG batchllm runs: one node per group, selected by `where:`.

Sampling is per node in batchllm, so lines that differ in model, endpoint, chat shape (one
user message, with a system message, or a longer chat), sampling or response format run in
different nodes, which the planner runs side by side. Invariant:
node names follow only from the groups in order of their first line, so the same request
file gives the same DAG (and the same journals) on every run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from batchllm.openai_batch.model_map import split_local

INPUT_NAME = "requests"
DAG_NAME = "openai-batch"
SLUG_CHARACTERS = 40
POOLING_TASKS = {"embedding": "embed", "score": "score", "rerank": "score"}  # a line's kind -> its node's task


@dataclass(frozen=True)
class BatchGroup:
    """Lines that run in one node."""

    node: str
    model: str  # body.model as requested
    local_model: str  # what runs it: an embedded name, a directory or a hub id, and `:ADAPTER_DIR` (model_map)
    kind: str  # "chat" | "completion" | "embedding" | "score" | "rerank"
    shape: str  # "prompt", "system" (+ prompt) or "messages" (see request_lines.LineRecord.shape)
    sampling: dict | None  # the node's `sampling:` (core.sampling.sampling_mapping); None: an embedding's or a score's
    requests: int  # valid lines in the group
    json_schema: str | None = None  # structured output (body.response_format), JSON text
    images: bool = False  # its lines hold images (a chat's image_url parts)


def node_names(keys: list[tuple[str, str]]) -> list[str]:
    """(model, kind) of each group in order of first line -> unique node names such as
    `gpt_4o_mini_chat`, `gpt_4o_mini_chat_2` for the model's next sampling settings."""
    names: list[str] = []
    for model, kind in keys:
        slug = re.sub(r"[^a-z0-9]+", "_", model.lower()).strip("_")[:SLUG_CHARACTERS] or "model"
        base = f"{'m_' if slug[0].isdigit() else ''}{slug}_{kind}"
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


@dataclass(frozen=True)
class BatchMember:
    """One converted request file in a DAG of several (`batchllm serve` runs queued batches as one
    DAG, so the planner runs their models side by side): its inputs and nodes carry its prefix."""

    prefix: str  # before its node names and input name; "" for the one file of `run-batch`
    requests_path: str
    groups: tuple[BatchGroup, ...]

    @property
    def input_name(self) -> str:
        return f"{INPUT_NAME}_{self.prefix.rstrip('_')}" if self.prefix else INPUT_NAME

    def node(self, group: BatchGroup) -> str:
        return self.prefix + group.node


def batch_dag(requests_path: str, groups: tuple[BatchGroup, ...]) -> dict:
    """The DAG (as a dict of the YAML schema) over the converted request file."""
    return batches_dag([BatchMember("", requests_path, groups)])


def batches_dag(members: list[BatchMember]) -> dict:
    """The DAG over several converted request files: each member's groups select from its own input."""
    nodes: dict[str, dict[str, object]] = {}
    for member in members:
        for group in member.groups:
            nodes[member.node(group)] = {**_node(group), **({"input": member.input_name} if member.prefix else {})}
    return {"name": DAG_NAME, "inputs": {m.input_name: {"path": m.requests_path, "id_column": "request_id"} for m in members},
            "nodes": nodes, "outputs": {}}


def _node(group: BatchGroup) -> dict[str, object]:
    """A group's node; `where:` selects its rows by the group's own name (the `node` column)."""
    if group.kind in POOLING_TASKS:  # no sampling, no chat: the line's text (and a score's pair) pooled
        return {"model": group.local_model, "task": POOLING_TASKS[group.kind], "prompt": "{{ prompt }}",
                **({"pair": "{{ pair }}"} if POOLING_TASKS[group.kind] == "score" else {}), "where": f"node = '{group.node}'"}
    model, adapter = split_local(group.local_model)
    node: dict[str, object] = {"model": model, "chat": group.kind == "chat", "sampling": group.sampling,
                               "where": f"node = '{group.node}'", **({"adapter": adapter} if adapter else {})}
    if group.shape == "messages":
        node["messages"] = "{{ messages }}"
    else:
        node["prompt"] = "{{ prompt }}"
    if group.shape == "system":
        node["system"] = "{{ system }}"
    if group.images:
        node["images"] = "{{ images }}"
    if group.json_schema is not None:
        node["output"] = {"json_schema": json.loads(group.json_schema)}
    return node
