"""Node fingerprints: a hash of everything that decides a node's results.

A node's fingerprint covers its own spec, its input file's bytes (sha256, streamed: the file
is never held in memory) and its upstream nodes' fingerprints, so a change anywhere upstream
invalidates stored results below.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from batchllm.dag.model import DagSpec
from batchllm.io.input_source import InputSource, file_digest

__all__ = ["file_digest", "node_fingerprints"]


def node_fingerprints(dag: DagSpec, sources: dict[str, InputSource] | None = None) -> dict[str, str]:
    """`sources`: the opened inputs, whose digests are computed once per source; without
    them each input file is hashed here (the same value)."""
    if sources is not None:
        inputs = {name: sources[name].fingerprint() for name in dag.inputs}
    else:
        inputs = {name: file_digest(spec.path) + (spec.id_column or "") for name, spec in dag.inputs.items()}
    prints: dict[str, str] = {}
    for name in dag.topological_order():
        node = asdict(dag.nodes[name])
        node.pop("line")
        payload = {"node": node, "input": inputs[dag.nodes[name].input_name],
                   "upstream": [prints[u] for u in dag.nodes[name].upstream]}
        prints[name] = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return prints
