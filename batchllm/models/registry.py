"""Model names in a DAG -> something an engine can load.

A name is one of: an embedded model (`smollm2-135m`, weights in an installed package),
a local Hugging Face directory (absolute, or relative to the DAG file), or a hub id
`owner/name`, taken from the local Hugging Face cache only (looked up offline: a run never
downloads a model). A directory, given or cached, must hold what an engine loads: its
config, its weights (every shard an index names) and a tokenizer; that is checked here,
before anything runs, without reading the weights.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from batchllm.core.errors import UserError
from batchllm.models.embedded import EMBEDDED_MODELS

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+\Z")
DEFAULT_MODEL = "smollm2-135m"


def batchllm_home() -> Path:
    return Path(os.environ.get("BATCHLLM_HOME") or Path.home() / ".cache" / "batchllm")


@dataclass(frozen=True)
class ModelRef:
    name: str  # as written in the DAG
    kind: str  # "embedded" | "local" | "hub"
    location: str  # package model name, directory, or hub id

    def config_dir(self, home: Path) -> Path:
        """A directory with the model's config (and sentence-transformers' files where it has
        them), without converting an embedded model: its shipped config until it is prepared."""
        if self.kind == "embedded":
            embedded = EMBEDDED_MODELS[self.location]
            return embedded.converted_dir(home) if embedded.is_prepared(home) else embedded.config_dir()
        return Path(self.location)

    def materialise(self, home: Path) -> str:
        """What to hand the engine: a directory or hub id (embedded models are converted once)."""
        if self.kind == "embedded":
            return str(EMBEDDED_MODELS[self.location].prepare(home))
        return self.location


def resolve_model(name: str, *, dag_dir: Path, home: Path, where: str) -> ModelRef:
    if name in EMBEDDED_MODELS:
        EMBEDDED_MODELS[name].shipped_path()  # fails early if its package is missing
        return ModelRef(name, "embedded", name)
    local = Path(name) if Path(name).is_absolute() else dag_dir / name
    if local.is_dir():
        missing = missing_model_files(local)
        if missing:
            raise UserError(f"model directory {str(local)!r} has no {missing}", where=where,
                            hint="point `model:` at a complete Hugging Face model directory (config.json, weights, tokenizer)")
        return ModelRef(name, "local", str(local.resolve()))
    if _HUB_ID.match(name) and not name.startswith("."):
        return ModelRef(name, "hub", str(_cached_snapshot(name, where)))
    raise UserError(
        f"unknown model {name!r}: not an embedded model, not a directory, not a hub id",
        where=where,
        hint=f"use {DEFAULT_MODEL!r} (embedded), a local model directory, or a hub id like 'owner/name'",
    )


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "*.tiktoken")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def missing_model_files(directory: Path) -> str | None:
    """What an engine needs that `directory` lacks, in words; None when it has it all."""
    if not (directory / "config.json").is_file():
        return "config.json"
    for index in (directory / name for name in _WEIGHT_INDEXES):
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                return f"readable weight index ({index.name} does not parse)"
            absent = [shard for shard in shards if not (directory / shard).is_file()]
            if absent:
                return f"weight shard {absent[0]} ({len(absent)} of the {len(shards)} shards {index.name} names are missing)"
            break
    else:
        if not _any_file(directory, _WEIGHTS):
            return "weights (no *.safetensors, *.bin or *.gguf file)"
    if not _any_file(directory, _TOKENIZER):
        return "tokenizer (no tokenizer.json, tokenizer.model or tokenizer_config.json)"
    return None


def _any_file(directory: Path, patterns: tuple[str, ...]) -> bool:
    return any(path.is_file() for pattern in patterns for path in directory.glob(pattern))  # a broken link is no file


def _cached_snapshot(hub_id: str, where: str) -> Path:
    """The local cache's complete copy of a hub model, looked up offline."""
    from huggingface_hub import constants, snapshot_download

    how = (f"download it where there is network (`hf download {hub_id}`, into {constants.HF_HUB_CACHE}; "
           "set HF_HUB_CACHE or HF_HOME to use another cache), or give `model:` a local model directory")
    try:
        snapshot = Path(snapshot_download(hub_id, local_files_only=True))
    except Exception as error:  # noqa: BLE001  not cached (LocalEntryNotFoundError), or a cache that does not read
        raise UserError(f"model {hub_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and "
                        f"batchllm does not download models ({type(error).__name__})", where=where, hint=how) from None
    missing = missing_model_files(snapshot)
    if missing:
        raise UserError(f"the cached copy of model {hub_id!r} ({snapshot}) is incomplete: it has no {missing}", where=where,
                        hint=how)
    return snapshot
