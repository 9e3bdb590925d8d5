"""Node fingerprints: a hash of everything that decides a node's results.

A node's fingerprint covers its own spec (the fields that decide results), its input file's bytes (sha256, streamed: the file
is never held in memory) and its upstream nodes' fingerprints, so a change anywhere upstream
invalidates stored results below.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path

from batchllm.core.sampling import DEFAULT_SAMPLING, ORIGINAL_KEYS
from batchllm.dag.model import DagSpec, NodeSpec
from batchllm.io.input_formats import input_digest
from batchllm.io.input_source import InputSource, file_digest
from batchllm.models.lora_adapter import AdapterError, LoraAdapter

__all__ = ["file_digest", "node_fingerprints"]

# Where a node stands in the file, and what the loader derives from its templates: never
# part of its results. (Its adapter counts by what it is: below; its images' folder, the input
# file's, is where the input is, as the input counts by its content.)
NOT_DECISIVE = ("line", "columns_used", "reads", "merges_read", "nearest_read", "adapter", "adapter_name", "image_dir")


def _decisive_fields(node: NodeSpec) -> dict:
    """The node's fields that decide its results, leaving out those at their default: a
    field added to NodeSpec later (with a default) leaves earlier runs resumable."""
    defaults = {f.name: f.default for f in fields(NodeSpec) if f.default is not MISSING}
    decisive = {key: value for key, value in asdict(node).items()
                if key not in NOT_DECISIVE and not (key in defaults and value == defaults[key])}
    sampling_defaults = asdict(DEFAULT_SAMPLING)  # the sampling keys added later count only when set
    decisive["sampling"] = {key: value for key, value in decisive["sampling"].items()
                            if key in ORIGINAL_KEYS or value != sampling_defaults[key]}
    return decisive


def node_fingerprints(dag: DagSpec, sources: dict[str, InputSource] | None = None) -> dict[str, str]:
    """`sources`: the opened inputs, whose digests are computed once per source; without
    them each input file is hashed here (the same value)."""
    if sources is not None:
        inputs = {name: sources[name].fingerprint() for name in dag.inputs}
    else:
        inputs = {name: input_digest(spec) + (spec.id_column or "") for name, spec in dag.inputs.items()}
    prints: dict[str, str] = {}
    for name in dag.topological_order():
        node = _decisive_fields(dag.nodes[name])
        if dag.nodes[name].merges_read:  # which nodes a merge joins, in which order, decides the text read
            node["merges"] = {m: list(dag.merges[m]) for m in dag.nodes[name].merges_read}
        adapter = dag.nodes[name].adapter
        if adapter is not None and dag.on_endpoints(name):  # what the servers serve under the name
            node["adapter"] = f"served as {dag.nodes[name].adapter_name}"
        elif adapter is not None:  # its weights decide the results, wherever the folder is
            node["adapter"] = _adapter_digest(adapter)
        if dag.nodes[name].nearest_read:  # which vectors, and how many rows, decide the rows read
            node["nearest"] = {n: [dag.nearest[n].query, dag.nearest[n].corpus, dag.nearest[n].k] for n in dag.nodes[name].nearest_read}
        payload = {"node": node, "input": inputs[dag.nodes[name].input_name],
                   "upstream": [prints[u] for u in dag.nodes[name].upstream]}
        prints[name] = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return prints


def _adapter_digest(path: str) -> str:
    """A LoRA adapter's content digest (its path where it cannot be read: the checks refuse it before a run)."""
    try:
        return LoraAdapter.read(Path(path)).digest()
    except (AdapterError, OSError):
        return path
