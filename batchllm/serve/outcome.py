"""A batch's files at its end, written as OpenAI writes them: lines with a response into the
output file, lines with an error into the error file, under ids made from the batch's, so
writing them again after a crash gives the same files (`FileStore.put` replaces them whole).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.serve.files import FileStore


@dataclass(frozen=True)
class Outcome:
    output_file_id: str | None
    error_file_id: str | None
    completed: int
    failed: int
    usage: dict[str, Any] | None = None

    @property
    def total(self) -> int:
        return self.completed + self.failed


def output_file_id(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def split_results(files: FileStore, batch_id: str, results: Path, *, cancelled: bool) -> Outcome:
    """A run's results file -> the batch's output and error files; `cancelled`: the lines that
    did not run say so (`batch_cancelled`) instead of `not_completed`."""
    ok, failed = [], []
    usage = {"input_tokens": 0, "output_tokens": 0}
    for line in _read_lines(results):
        item = json.loads(line)
        if item.get("error") is None:
            ok.append(line)
            body_usage = (item.get("response") or {}).get("body", {}).get("usage") or {}
            usage["input_tokens"] += int(body_usage.get("prompt_tokens") or 0)
            usage["output_tokens"] += int(body_usage.get("completion_tokens") or 0)
        else:
            if cancelled and item["error"].get("code") == "not_completed":
                number = item["error"]["message"].split(":", 1)[0]
                item["error"] = {"code": "batch_cancelled", "message": f"{number}: the batch was cancelled before this request ran"}
                line = json.dumps(item, ensure_ascii=False)
            failed.append(line)
    output_id = files.put(output_file_id(batch_id, "output"), ok, f"{batch_id}_output.jsonl", "batch_output").id if ok else None
    error_id = files.put(output_file_id(batch_id, "errors"), failed, f"{batch_id}_error.jsonl", "batch_output").id \
        if failed else None
    return Outcome(output_id, error_id, len(ok), len(failed),
                   {**usage, "total_tokens": usage["input_tokens"] + usage["output_tokens"],
                    "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}})


def unstarted_errors(files: FileStore, batch_id: str, requests: Path, code: str, message: str) -> Outcome:
    """A batch that never ran: each request line's error says why."""
    errors = []
    with open(requests, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                try:
                    custom_id = json.loads(raw).get("custom_id")
                except (ValueError, AttributeError):
                    custom_id = None
                errors.append(json.dumps({"id": f"batch_req_{hashlib.sha256(f'{batch_id}:{number}'.encode()).hexdigest()[:32]}",
                                          "custom_id": custom_id if isinstance(custom_id, str) else None, "response": None,
                                          "error": {"code": code, "message": f"line {number}: {message}"}}))
    error_id = files.put(output_file_id(batch_id, "errors"), errors, f"{batch_id}_error.jsonl", "batch_output").id \
        if errors else None
    return Outcome(None, error_id, 0, len(errors))


def _read_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield line.rstrip("\n")
