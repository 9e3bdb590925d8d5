"""The results file: one OpenAI batch output line per request line, in input order.

    {"id": "batch_req_...", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <chat.completion | text_completion | list | rerank>}}
    {"id": "batch_req_...", "custom_id": ... | null, "response": null, "error": {"code": ..., "message": ...}}

A line gets an error when it could not run (see `request_lines`, `duplicate_custom_id`),
when the engine refused it (`request_failed`: e.g. a prompt longer than the context; a
pooling line when any of its requests was refused) or when the run stopped before it
(`not_completed`: run the same command again; a pooling line until all its requests have a
result). Invariant:
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
from batchllm.openai_batch.request_lines import ITEM_SEPARATOR


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
    """Each line with its result: a chat's or a completion's one row; a pooling line's rows (one per
    request, `custom_id<US>k`) gathered in order of k into lists, with their second texts (a rerank's
    documents)."""
    files = [str(path) for path in node_files.values() if path.is_file()]
    columns = {name for path in files for name in pq.read_schema(path).names}  # of any node file
    texts = "texts" if "texts" in columns else "NULL::VARCHAR[]"
    logprobs = "logprobs" if "logprobs" in columns else f"NULL::{LOGPROBS_SQL_TYPE}"
    vector = "vector" if "vector" in columns else "NULL::FLOAT[]"
    score = "score" if "score" in columns else "NULL::DOUBLE"
    results = (f"read_parquet({_list(files)}, union_by_name = true)" if files else
               "(SELECT NULL::VARCHAR AS row_id, NULL::VARCHAR AS text, NULL::BIGINT AS num_prompt_tokens, "
               "NULL::BIGINT AS num_output_tokens, NULL::VARCHAR AS finish_reason WHERE false)")
    separator = f"chr({ord(ITEM_SEPARATOR)})"
    return f"""
        WITH r AS (SELECT split_part(row_id, {separator}, 1) AS custom_id, TRY_CAST(NULLIF(split_part(row_id, {separator}, 2), '') AS BIGINT) AS k,
                          row_id, text, {texts} AS texts, {logprobs} AS logprobs, {vector} AS vector, {score} AS score, num_prompt_tokens,
                          num_output_tokens, finish_reason FROM {results}),
        pooled AS (SELECT r.custom_id, count(*) AS results, list(r.vector ORDER BY r.k) AS vectors, list(r.score ORDER BY r.k) AS scores,
                          list(q.pair ORDER BY r.k) AS pairs, list(r.finish_reason ORDER BY r.k) AS finishes,
                          sum(r.num_prompt_tokens)::BIGINT AS prompt_tokens
                   FROM r LEFT JOIN read_parquet({sql_literal(str(batch.requests_path))}) q ON q.request_id = r.row_id
                   WHERE r.k IS NOT NULL GROUP BY r.custom_id)
        SELECT l.line, l.custom_id, l.model, l.kind, l.node, l.error_code, l.error_message, l.items, l.top_n,
               g.row_id, g.text, g.texts, g.logprobs, g.num_prompt_tokens, g.num_output_tokens, g.finish_reason,
               p.results, p.vectors, p.scores, p.pairs, p.finishes, p.prompt_tokens
        FROM read_parquet({sql_literal(str(batch.lines_path))}) l
        LEFT JOIN (SELECT * FROM r WHERE k IS NULL) g ON l.node IS NOT NULL AND l.items IS NULL AND g.row_id = l.custom_id
        LEFT JOIN pooled p ON l.node IS NOT NULL AND l.items IS NOT NULL AND p.custom_id = l.custom_id
        ORDER BY l.line"""


def output_line(row: dict, digest: str, created: int, incomplete: str | None) -> dict:
    """One output line from a row of the query (a line and its node's result, if any)."""
    ids = hashlib.sha256(f"{digest}:{row['line']}".encode()).hexdigest()
    line = {"id": f"batch_req_{ids[:32]}", "custom_id": row["custom_id"], "response": None, "error": None}
    if row["error_code"] is not None:
        line["error"] = {"code": row["error_code"], "message": row["error_message"]}
    elif not _has_result(row):
        why = f": {incomplete}" if incomplete else ""
        line["error"] = {"code": "not_completed", "message": f"line {row['line']}: no result yet{why}; "
                                                              "run the same command again to resume"}
    elif (failure := _failure(row)) is not None:
        line["error"] = {"code": "request_failed", "message": f"line {row['line']}: {failure}"}
    else:
        line["response"] = {"status_code": 200, "request_id": f"req_{ids[32:]}", "body": _body(row, ids, created)}
    return line


def _has_result(row: dict) -> bool:
    """The line's result is all there: a chat's or a completion's row, a pooling line's every request's."""
    return row["row_id"] is not None if row["items"] is None else row["results"] == row["items"]


def _failure(row: dict) -> str | None:
    """Why the engine refused the line's request (a pooling line's first refused one); None: it did not."""
    for finish in (row["finishes"] or []) if row["items"] is not None else [row["finish_reason"]]:
        if (failure := parse_finish_text(finish))[0] is FinishReason.ERROR:
            return failure[1]
    return None


def _body(row: dict, ids: str, created: int) -> dict:
    if row["items"] is not None:
        return _pooling_body(row, ids, created)
    texts = row["texts"] or [row["text"]]
    chat = row["kind"] == "chat"
    choices = [{"index": k, **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                "logprobs": _logprobs(row["logprobs"]) if k == 0 else None, "finish_reason": row["finish_reason"]}
               for k, text in enumerate(texts)]
    prompt, completion = row["num_prompt_tokens"], row["num_output_tokens"]
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{ids[:24]}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": row["model"], "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _pooling_body(row: dict, ids: str, created: int) -> dict:
    """An embedding, score or rerank line's body, as vLLM's run-batch writes it."""
    prompt = row["prompt_tokens"]
    usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None}
    if row["kind"] == "embedding":  # vLLM's EmbeddingResponse
        return {"id": f"embd-{ids[:24]}", "object": "list", "created": created, "model": row["model"],
                "data": [{"index": k, "object": "embedding", "embedding": vector} for k, vector in enumerate(row["vectors"])],
                "usage": usage}
    if row["kind"] == "score":  # vLLM's ScoreResponse
        return {"id": f"score-{ids[:24]}", "object": "list", "created": created, "model": row["model"],
                "data": [{"index": k, "object": "score", "score": score} for k, score in enumerate(row["scores"])], "usage": usage}
    # vLLM's RerankResponse: the documents by relevance, best first, the best top_n
    ranked = sorted(range(len(row["scores"])), key=lambda k: -row["scores"][k])[:row["top_n"] or None]
    return {"id": f"rerank-{ids[:24]}", "model": row["model"], "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": [{"index": k, "document": {"text": row["pairs"][k]}, "relevance_score": row["scores"][k]} for k in ranked]}


def _logprobs(tokens: list[dict] | None) -> dict | None:
    """A result's logprobs in OpenAI's `choices[].logprobs` shape (each token with its UTF-8 bytes)."""
    if tokens is None:
        return None
    return {"content": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode()),
                         "top_logprobs": [{"token": top["token"], "logprob": top["logprob"], "bytes": list(top["token"].encode())}
                                          for top in t["top_logprobs"]]} for t in tokens]}


def _list(paths: list[str]) -> str:
    return "[" + ", ".join(sql_literal(p) for p in paths) + "]"
