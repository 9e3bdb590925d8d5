"""YAML reading that remembers line numbers, so errors can say where."""

from __future__ import annotations

from pathlib import Path

import yaml

from batchllm.core.errors import UserError


class LineDict(dict):
    """A mapping from YAML that knows its own line and the line of each key (1-based)."""

    line: int = 0
    key_lines: dict[str, int]
    value_lines: dict[str, int]

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)

    def value_line(self, key: str) -> int:
        """First line of a key's value (a block scalar starts on the line after `key: |`)."""
        return self.value_lines.get(key, self.line_of(key))


class _LineLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> LineDict:
        mapping = LineDict(super().construct_mapping(node, deep=deep))
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {}
        mapping.value_lines = {}
        for key_node, value_node in node.value:
            key = key_node.value
            mapping.key_lines[key] = key_node.start_mark.line + 1
            block = getattr(value_node, "style", None) in ("|", ">")
            mapping.value_lines[key] = value_node.start_mark.line + 1 + (1 if block else 0)
        return mapping


def _construct_unique_mapping(loader: _LineLoader, node: yaml.MappingNode) -> LineDict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.value in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
            )
        seen.add(key_node.value)
    return loader.construct_mapping(node, deep=True)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml(path: Path) -> object:
    if not path.is_file():
        raise UserError(f"DAG file {str(path)!r} does not exist", hint="check the path")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read DAG file {str(path)!r}: {exc}") from None
    try:
        return yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"invalid YAML: {problem}", where=where, hint="fix the YAML syntax") from None
