"""Request keys: what decides a request's answer, as one 32-byte digest the result store files it under.

A node's requests share a *scope*: the model's identity (its directory's content digest,
`models.model_digest`; an embedded model's, of the checkpoint its package ships and the config
batchllm converts it to, so no key converts a model), the settings that change its numbers (dtype, the engine's task, the
LoRA adapter's content digest) and the node's own constant keys (every sampling key with the
seed, the output constraint, chat or completion). A request's key is its scope's digest
extended by what is its own: the rendered prompt, system message, conversation, score pair
and images (by their bytes' digest). The node's name, its DAG, its row and its run folder are
not in it: the same request in another DAG, run folder or batch file has the same key.

Invariant: two requests have the same key exactly when everything the engine is given to
answer them is the same (up to a digest collision).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from batchllm.core.images import ImageUnreadable, image_bytes
from batchllm.core.requests import EngineRequest
from batchllm.dag.model import DagSpec, NodeSpec
from batchllm.engines.devices import engine_dtype
from batchllm.models.embedded import EMBEDDED_MODELS
from batchllm.models.lora_adapter import AdapterError, LoraAdapter
from batchllm.models.model_digest import model_digest
from batchllm.models.registry import resolve_model

KEY_VERSION = 1  # bump when what goes into a key changes: earlier entries are then never matched


class NodeKeys:
    """The keys of one node's requests."""

    def __init__(self, scope: bytes):
        self.scope = scope  # 32 bytes

    @classmethod
    def of(cls, dag: DagSpec, node: NodeSpec, device_kind: str, home: Path) -> NodeKeys:
        """The node's scope from its model's files and settings (the model is prepared if it is embedded)."""
        ref = resolve_model(node.model, dag_dir=dag.path.parent, home=home, where=f"nodes.{node.name}.model")
        if ref.kind == "embedded":  # by what ships (its converted weights follow from it), never converted for this
            embedded = EMBEDDED_MODELS[ref.location]
            identity = f"{model_digest(embedded.shipped_path(), home)}+{model_digest(embedded.config_dir(), home)}"
        else:
            identity = model_digest(Path(ref.materialise(home)), home)
        adapter = None
        if node.adapter is not None:
            try:
                adapter = LoraAdapter.read(Path(node.adapter)).digest()
            except (AdapterError, OSError):
                adapter = node.adapter
        scope = {"version": KEY_VERSION, "model": identity, "dtype": engine_dtype(device_kind), "task": node.task.value,
                 "adapter": adapter, "sampling": asdict(node.sampling), "chat": node.chat,
                 "output": asdict(node.output) if node.output is not None else None}
        return cls(hashlib.blake2b(json.dumps(scope, sort_keys=True, default=str).encode(), digest_size=32).digest())

    def keys(self, requests: Sequence[EngineRequest]) -> list[bytes]:
        """Each request's key, in order (a few microseconds each)."""
        return [self.key(request) for request in requests]

    def key(self, request: EngineRequest) -> bytes:
        digest = hashlib.blake2b(self.scope, digest_size=32)
        _part(digest, request.prompt)
        _part(digest, request.system)
        _part(digest, request.pair)
        if request.messages is not None:
            digest.update(b"m%d\0" % len(request.messages))
            for role, content in request.messages:
                _part(digest, role)
                _part(digest, content)
        for number, image in enumerate(request.images, start=1):
            digest.update(b"i" + _image_digest(image, number))
        return digest.digest()


def _part(digest: hashlib.blake2b, text: str | None) -> None:
    """A text with its length ahead of it (None apart from ""), so parts cannot run into each other."""
    if text is None:
        digest.update(b"-\0")
        return
    data = text.encode("utf-8", "surrogatepass")
    digest.update(b"%d\0" % len(data))
    digest.update(data)


def _image_digest(image: str | bytes, number: int) -> bytes:
    """An image by its bytes (a file's content, not its path); one that cannot be read by its source
    (the request fails then, and a failed result is never stored)."""
    try:
        data = image_bytes(image, number)
    except (ImageUnreadable, OSError):
        data = image if isinstance(image, bytes) else image.encode()
    return hashlib.blake2b(data, digest_size=16).digest()
