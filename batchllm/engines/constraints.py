"""Can the engine honour a node's output constraint? Checked before a run, with the
structured-output backend vLLM uses (xgrammar, installed with the engine), so a regex or
JSON schema it cannot compile is a clear error up front, not garbage mid-run. Any schema
the engine compiles is accepted; the top-level properties of an object schema also become
typed output columns (`OutputConstraint.json_fields`).
"""

from __future__ import annotations

import re
from types import ModuleType

from batchllm.core.errors import UserError
from batchllm.core.output_constraint import OutputConstraint


def check_constraint(output: OutputConstraint, *, where: str) -> None:
    xgrammar: ModuleType | None
    try:
        import xgrammar
    except ImportError:  # no engine installed here: Python's own checks only
        xgrammar = None
    if output.regex is not None:
        try:
            re.compile(output.regex)
            if xgrammar is not None:
                xgrammar.Grammar.from_regex(output.regex)
        except (re.error, RuntimeError) as exc:
            raise UserError(f"the engine cannot use the regex {output.regex!r}: {_first_line(exc)}", where=where,
                            hint="write a regular expression without look-arounds or back-references") from None
    if output.json_schema is not None:
        try:
            if xgrammar is not None:
                xgrammar.Grammar.from_json_schema(output.json_schema)
        except RuntimeError as exc:
            raise UserError(f"the engine cannot use this JSON schema: {_first_line(exc)}", where=where,
                            hint="use the JSON Schema keywords type, properties, required, items, enum") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+: ", "", text)
