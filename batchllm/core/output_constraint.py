"""What a node's output must look like, enforced by the engine while it generates (vLLM's
structured outputs): written in a DAG or a batch file, carried by each engine request."""

from __future__ import annotations

import json
from dataclasses import dataclass

# The JSON types a JSON-schema output's top-level property lands as in an output column
# (`node.property`); "json" (objects, arrays, unions) lands as its JSON text.
JSON_FIELD_TYPES = ("integer", "number", "boolean", "string", "json")


@dataclass(frozen=True)
class OutputConstraint:
    """What a node's output must look like, enforced by the engine while it generates
    (vLLM's structured outputs). Exactly one field is set."""

    choices: tuple[str, ...] | None = None  # the output is one of these strings
    json_schema: str | None = None  # the output is JSON valid under this schema (JSON text)
    regex: str | None = None  # the output matches this regular expression

    @property
    def kind(self) -> str:
        return next(k for k in ("choices", "json_schema", "regex") if getattr(self, k) is not None)

    def json_fields(self) -> dict[str, str]:
        """A JSON-schema output's top-level properties -> their type (one of JSON_FIELD_TYPES):
        the typed columns an output may name as `node.property`. Empty for other outputs."""
        schema = json.loads(self.json_schema) if self.json_schema is not None else None
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            return {}
        return {name: _json_field_type(body) for name, body in properties.items() if '"' not in name}


def _json_field_type(body: object) -> str:
    if not isinstance(body, dict):
        return "json"
    kind = body.get("type")
    if isinstance(kind, list):  # e.g. ["integer", "null"]: nullable, one type
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and isinstance(body.get("enum"), list) and body["enum"] and all(isinstance(v, str) for v in body["enum"]):
        kind = "string"
    return kind if kind in JSON_FIELD_TYPES else "json"
