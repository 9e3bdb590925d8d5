"""Which local model serves each `body.model` of a request file.

From `--model NAME=LOCAL` options (relative directories start at the current folder) and a
mapping file `--models mapping.yaml` (`{gpt-4o-mini: smollm2-135m, my-model: ./models/x}`,
relative directories start at the file's folder); an option wins over the file. Invariant:
every value is checked (an embedded model, a model directory or a hub id) before any line
is read, and directories are made absolute; a bad mapping is a UserError (exit 2).
An embedded model's own name (`smollm2-135m`) needs no entry. A LoRA adapter on a base is
`BASE:ADAPTER_DIR` (`--model sql-expert=smollm2-135m:./adapters/sql`): its lines run with the
adapter, in one engine with the base's and its other adapters' lines.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from batchllm.core.errors import UserError
from batchllm.models.lora_adapter import AdapterError, LoraAdapter
from batchllm.models.registry import resolve_model

ADAPTER_SEPARATOR = ":"  # BASE:ADAPTER_DIR


def model_map(options: list[str], mapping_file: Path | None, home: Path) -> dict[str, str]:
    entries: dict[str, tuple[str, Path, str]] = {}  # name -> (local, folder it is relative to, where it was given)
    if mapping_file is not None:
        for name, local in _read_mapping(mapping_file).items():
            entries[name] = (local, mapping_file.parent, f"{mapping_file}, {name}")
    for option in options:
        name, sep, local = option.partition("=")
        if not sep or not name.strip() or not local.strip():
            raise UserError(f"--model {option!r} is not NAME=LOCAL", where="--model",
                            hint="e.g. --model gpt-4o-mini=smollm2-135m (an embedded model, a model directory or a hub id)")
        entries[name.strip()] = (local.strip(), Path.cwd(), f"--model {option}")
    mapped = {}
    for name, (local, folder, where) in entries.items():
        base, _, adapter = local.partition(ADAPTER_SEPARATOR)
        ref = resolve_model(base, dag_dir=folder, home=home, where=where)
        mapped[name] = ref.location if ref.kind == "local" else ref.name
        if adapter:
            path = (folder / adapter).resolve()
            try:
                LoraAdapter.read(path)
            except AdapterError as error:
                raise UserError(str(error), where=where, hint=error.hint) from None
            mapped[name] += f"{ADAPTER_SEPARATOR}{path}"
    return mapped


def split_local(local: str) -> tuple[str, str | None]:
    """A mapped local model -> (the model, its adapter directory or None)."""
    model, _, adapter = local.partition(ADAPTER_SEPARATOR)
    return model, adapter or None


def _read_mapping(path: Path) -> dict[str, str]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read the model mapping {str(path)!r}: {exc.strerror or exc}", where="--models") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"the model mapping {str(path)!r} is not valid YAML: {exc}", where="--models") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in raw.items()):
        raise UserError(f"the model mapping {str(path)!r} must map model names to local models", where="--models",
                        hint="e.g. `gpt-4o-mini: smollm2-135m`, one line per model")
    return raw
