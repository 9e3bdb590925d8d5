"""OpenAI batch files of ShareGPT first turns (profiles/prompts/first_turns.parquet) for the
embedded smollm2-135m: the request file the benchmarks that compare batch tools share."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "profiles" / "prompts" / "first_turns.parquet"


def sharegpt_chat_file(path: Path, first_row: int, count: int, max_tokens: int) -> None:
    """`count` chat requests from row `first_row` on, temperature 0, `max_tokens` each."""
    rows = pq.read_table(PROMPTS).slice(first_row, count).to_pylist()
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps({"custom_id": f"sharegpt-{row['id']}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0,
                                              "messages": [{"role": "user", "content": row["prompt"]}]}}) + "\n")
