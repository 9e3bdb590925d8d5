"""The results file: one OpenAI batch output line per request line, in input order.

    {"id": "batch_req_...", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <chat.completion | text_completion | list>}}
    {"id": "batch_req_...", "custom_id": ... | null, "response": null, "error": {"code": ..., "message": ...}}

A line gets an error when it could not run (see `request_lines`, `duplicate_custom_id`),
when the engine refused it (`request_failed`: e.g. a prompt longer than the context) or
when the run stopped before it (`not_completed`: run the same command again). Invariant:
every non-blank request line gives exactly one output line, so every custom_id appears
once; ids are derived from the request file's digest and line, so rewriting the file after
a resume gives the same ids. The file is written beside its place and renamed into it;
rows are read from DuckDB in batches (bounded memory at any size).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from batchllm.core.files import replacing, temporary_beside
from batchllm.core.requests import FinishReason, parse_finish_text
from batchllm.io.output_files import LOGPROBS_SQL_TYPE
from batchllm.io.sql import sql_literal
from batchllm.openai_batch.batch_input import MEMORY_LIMIT, READ_BATCH_LINES, BatchInput


@dataclass(frozen=True)
class ResultCounts:
    lines: int
    succeeded: int
    failed: dict[str, int] = field(default_factory=dict)  # error code -> lines


def write_results(batch: BatchInput, node_files: Mapping[str, Path], output: Path, *, created: int,
                  incomplete: str | None = None) -> ResultCounts:
    """`node_files`: each group's node file (missing ones had no result); `incomplete`: why
    the run stopped early, for lines without a result; `created`: the bodies' Unix time."""
    output.parent.mkdir(parents=True, exist_ok=True)
    spill = temporary_beside(output, ".spill")
    counts: Counter[str] = Counter()
    connection = duckdb.connect(config={"memory_limit": MEMORY_LIMIT, "temp_directory": str(spill)})
    try:
        with replacing(output) as new, open(new.path, "w", encoding="utf-8") as handle:
            for rows in connection.sql(_query(batch, node_files)).to_arrow_reader(READ_BATCH_LINES):
                for row in rows.to_pylist():
                    line = output_line(row, batch.digest, created, incomplete)
                    counts["ok" if line["error"] is None else line["error"]["code"]] += 1
                    handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    finally:
        connection.close()
        shutil.rmtree(spill, ignore_errors=True)
    succeeded = counts.pop("ok", 0)
    return ResultCounts(succeeded + sum(counts.values()), succeeded, dict(sorted(counts.items())))


def _query(batch: BatchInput, node_files: Mapping[str, Path]) -> str:
    files = [str(path) for path in node_files.values() if path.is_file()]
    columns = {name for path in files for name in pq.read_schema(path).names}  # of any node file
    texts = "r.texts" if "texts" in columns else "NULL::VARCHAR[]"
    logprobs = "r.logprobs" if "logprobs" in columns else f"NULL::{LOGPROBS_SQL_TYPE}"
    vector = "r.vector" if "vector" in columns else "NULL::FLOAT[]"
    score = "r.score" if "score" in columns else "NULL::DOUBLE"
    results = (f"read_parquet({_list(files)}, union_by_name = true)" if files else
               "(SELECT NULL::VARCHAR AS row_id, NULL::VARCHAR AS text, NULL::BIGINT AS num_prompt_tokens, "
               "NULL::BIGINT AS num_output_tokens, NULL::VARCHAR AS finish_reason WHERE false)")
    return (f"SELECT l.line, l.custom_id, l.model, l.kind, l.node, l.error_code, l.error_message, r.row_id, r.text, "
            f"{texts} AS texts, {logprobs} AS logprobs, {vector} AS vector, {score} AS score, r.num_prompt_tokens, r.num_output_tokens, "
            "r.finish_reason "
            f"FROM read_parquet({sql_literal(str(batch.lines_path))}) l LEFT JOIN {results} r "
            f"ON l.node IS NOT NULL AND r.row_id = l.custom_id ORDER BY l.line")


def output_line(row: dict, digest: str, created: int, incomplete: str | None) -> dict:
    """One output line from a row of the query (a line and its node's result, if any)."""
    ids = hashlib.sha256(f"{digest}:{row['line']}".encode()).hexdigest()
    line = {"id": f"batch_req_{ids[:32]}", "custom_id": row["custom_id"], "response": None, "error": None}
    if row["error_code"] is not None:
        line["error"] = {"code": row["error_code"], "message": row["error_message"]}
    elif row["row_id"] is None:
        why = f": {incomplete}" if incomplete else ""
        line["error"] = {"code": "not_completed", "message": f"line {row['line']}: no result yet{why}; "
                                                              "run the same command again to resume"}
    elif (failure := parse_finish_text(row["finish_reason"]))[0] is FinishReason.ERROR:
        line["error"] = {"code": "request_failed",
                         "message": f"line {row['line']}: {failure[1]}"}
    else:
        line["response"] = {"status_code": 200, "request_id": f"req_{ids[32:]}", "body": _body(row, ids, created)}
    return line


def _body(row: dict, ids: str, created: int) -> dict:
    if row["kind"] == "embedding":  # vLLM's EmbeddingResponse, as its run-batch writes it
        prompt = row["num_prompt_tokens"]
        return {"id": f"embd-{ids[:24]}", "object": "list", "created": created, "model": row["model"],
                "data": [{"index": 0, "object": "embedding", "embedding": row["vector"]}],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None}}
    if row["kind"] == "score":  # vLLM's ScoreResponse, as its run-batch writes it
        prompt = row["num_prompt_tokens"]
        return {"id": f"score-{ids[:24]}", "object": "list", "created": created, "model": row["model"],
                "data": [{"index": 0, "object": "score", "score": row["score"]}],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None}}
    texts = row["texts"] or [row["text"]]
    chat = row["kind"] == "chat"
    choices = [{"index": k, **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                "logprobs": _logprobs(row["logprobs"]) if k == 0 else None, "finish_reason": row["finish_reason"]}
               for k, text in enumerate(texts)]
    prompt, completion = row["num_prompt_tokens"], row["num_output_tokens"]
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{ids[:24]}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": row["model"], "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _logprobs(tokens: list[dict] | None) -> dict | None:
    """A result's logprobs in OpenAI's `choices[].logprobs` shape (each token with its UTF-8 bytes)."""
    if tokens is None:
        return None
    return {"content": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode()),
                         "top_logprobs": [{"token": top["token"], "logprob": top["logprob"], "bytes": list(top["token"].encode())}
                                          for top in t["top_logprobs"]]} for t in tokens]}


def _list(paths: list[str]) -> str:
    return "[" + ", ".join(sql_literal(p) for p in paths) + "]"
