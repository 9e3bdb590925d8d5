"""Model names in a DAG -> something an engine can load.

A name is one of: an embedded model (`smollm2-135m`, weights in an installed package),
a local Hugging Face directory (absolute, or relative to the DAG file), or a hub id
`owner/name` (loads only where the hub or a local hub cache has it).
"""

from __future__ import annotations

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

    def materialise(self, home: Path) -> str:
        """What to hand the engine: a directory or hub id (embedded models are converted once)."""
        if self.kind == "embedded":
            return str(EMBEDDED_MODELS[self.location].prepare(home))
        return self.location


def resolve_model(name: str, *, dag_dir: Path, home: Path, where: str) -> ModelRef:
    if name in EMBEDDED_MODELS:
        EMBEDDED_MODELS[name].source_gguf()  # fails early if its package is missing
        return ModelRef(name, "embedded", name)
    local = Path(name) if Path(name).is_absolute() else dag_dir / name
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"model directory {str(local)!r} has no config.json", where=where,
                            hint="point `model:` at a Hugging Face model directory")
        return ModelRef(name, "local", str(local.resolve()))
    if _HUB_ID.match(name) and not name.startswith("."):
        return ModelRef(name, "hub", name)
    raise UserError(
        f"unknown model {name!r}: not an embedded model, not a directory, not a hub id",
        where=where,
        hint=f"use {DEFAULT_MODEL!r} (embedded), a local model directory, or a hub id like 'owner/name'",
    )
