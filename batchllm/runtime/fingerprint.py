"""Node fingerprints: a hash of everything that decides a node's results.

A node's fingerprint covers its own spec, its input file's bytes and its upstream
nodes' fingerprints, so a change anywhere upstream invalidates stored results below.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from batchllm.dag.model import DagSpec


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def node_fingerprints(dag: DagSpec) -> dict[str, str]:
    inputs = {name: file_digest(spec.path) + (spec.id_column or "") for name, spec in dag.inputs.items()}
    prints: dict[str, str] = {}
    for name in dag.topological_order():
        node = asdict(dag.nodes[name])
        node.pop("line")
        payload = {"node": node, "input": inputs[dag.nodes[name].input_name],
                   "upstream": [prints[u] for u in dag.nodes[name].upstream]}
        prints[name] = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return prints
