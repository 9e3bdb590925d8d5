"""An uploaded request file read once before its batch runs: how many lines, which are bad,
and whether it can run at all.

Bad lines (not JSON, an unknown model, an unsupported parameter: run-batch's per-line
errors) do not stop a batch: each becomes its line's error in the error file. The batch
fails at validation only when nothing in the file can run: no request line, no line that
can run, or lines for another endpoint than the batch's (as OpenAI refuses them); its
`errors` then name the lines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchllm.openai_batch.request_lines import KINDS, parse_line

ENDPOINTS = tuple(KINDS)  # the urls run-batch runs: /v1/chat/completions, /v1/completions, /v1/embeddings, /score, /rerank, ...
MAX_ERRORS = 100  # errors a failed batch lists


@dataclass(frozen=True)
class Validated:
    total: int  # non-blank lines
    invalid: int  # lines with an error of their own (they run as failed lines)
    errors: list[dict[str, Any]] = field(default_factory=list)  # not empty: the file cannot run


def _error(code: str, message: str, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def validate_file(path: Path, endpoint: str, models: Mapping[str, str]) -> Validated:
    total = runnable = 0
    bad: list[dict[str, Any]] = []
    other_endpoint: list[dict[str, Any]] = []
    invalid = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            total += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                invalid += 1
                if len(bad) < MAX_ERRORS:
                    bad.append(_error("invalid_json", f"line {number}: not UTF-8 text ({exc.reason} at byte {exc.start})", number))
                continue
            try:
                url = json.loads(text).get("url")
            except (ValueError, AttributeError):
                url = endpoint  # not a JSON object: parse_line says so below
            if url in KINDS and KINDS[url] != KINDS.get(endpoint):
                if len(other_endpoint) < MAX_ERRORS:
                    other_endpoint.append(_error("mismatched_endpoint", f"line {number}: url {url!r} is not the batch's "
                                                                         f"endpoint {endpoint!r}", number))
                continue
            record = parse_line(text, number, models)
            if record.error_code is not None:
                invalid += 1
                if len(bad) < MAX_ERRORS:
                    bad.append(_error(record.error_code, record.error_message or record.error_code, number))
                continue
            runnable += 1
    if total == 0:
        errors = [_error("empty_file", "the input file has no request lines", None)]
    elif other_endpoint:
        errors = other_endpoint
    elif runnable == 0:
        errors = bad
    else:
        errors = []
    return Validated(total, invalid, errors)
