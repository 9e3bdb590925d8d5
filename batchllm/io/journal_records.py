"""A committed result as a node's journal stores it (`node_journal`): a `ResultRecord` per (row,
step), as one JSON line of a tail part or a row of a compacted segment's columns, keyed by
`key_of(row, step)`; and the counts a journal keeps of its records (`JournalStats`).

Invariant: a record read back from its tail line (`record_of`) equals the record written
(`ResultRecord.json_line`), its vector bit for bit (base64 of little-endian float32 bytes).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from batchllm.core.requests import FinishReason, TokenLogprob, parse_finish_text
from batchllm.core.result_schema import result_schema

STEP_BITS = 20  # a (row, step) key is row << STEP_BITS | step: up to a million steps a row


class ResultRecord(NamedTuple):  # one per committed (row, step): built in 0.5 µs, a frozen dataclass in 1.8
    row: int  # the row's position in its input
    step: int
    texts: tuple[str, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str  # as stored: core.requests.finish_text
    logprobs: tuple[TokenLogprob, ...] | None = None  # of texts[0], when the node keeps them
    vector: np.ndarray | None = None  # float32, of an embed node (None where its request failed)
    score: float | None = None  # of a score node (None where its request failed)

    @property
    def text(self) -> str:
        return self.texts[0]

    def json_line(self) -> str:
        """The record as its tail line (what `json.dumps` of its fields gives, three times faster)."""
        logprobs = "" if self.logprobs is None else f', "logprobs": {json.dumps(self.logprobs)}'
        vector = "" if self.vector is None else f', "vector_f32": "{base64.b64encode(self.vector.astype("<f4").tobytes()).decode()}"'
        score = "" if self.score is None else f', "score": {float(self.score)!r}'  # repr: the float's shortest exact text
        return (f'{{"row": {self.row}, "step": {self.step}, "texts": [{", ".join(map(encode_basestring, self.texts))}], '
                f'"num_prompt_tokens": {self.num_prompt_tokens}, "num_output_tokens": {self.num_output_tokens}, '
                f'"finish_reason": {encode_basestring(self.finish_reason)}{logprobs}{vector}{score}}}')


@dataclass(frozen=True)
class JournalStats:
    committed: int = 0
    failed: int = 0  # results of requests that could not run (finish reason ERROR)
    prompt_tokens: int = 0
    output_tokens: int = 0

    def plus(self, other: JournalStats) -> JournalStats:
        return JournalStats(self.committed + other.committed, self.failed + other.failed,
                            self.prompt_tokens + other.prompt_tokens, self.output_tokens + other.output_tokens)

    def minus(self, other: JournalStats) -> JournalStats:
        return JournalStats(self.committed - other.committed, self.failed - other.failed,
                            self.prompt_tokens - other.prompt_tokens, self.output_tokens - other.output_tokens)

    @classmethod
    def of(cls, records: Sequence[ResultRecord]) -> JournalStats:
        if not records:
            return cls()
        _, _, _, prompt_tokens, output_tokens, reasons, *_ = zip(*records)  # the records' fields as columns
        failed = sum(1 for reason in reasons if parse_finish_text(reason)[0] is FinishReason.ERROR)
        return cls(len(records), failed, sum(prompt_tokens), sum(output_tokens))


def segment_schema(samples: int, logprobs: bool = False, vector_dimensions: int | None = None, scores: bool = False) -> pa.Schema:
    """A segment's results, keyed by the row's position."""
    return result_schema(("row", pa.int64()), samples, logprobs, vector_dimensions, scores)


def vector_array(vectors: Sequence[np.ndarray | None], dimensions: int) -> pa.FixedSizeListArray:
    """Vectors as a fixed-size list column (null where a request failed and has none)."""
    present = [v is not None for v in vectors]
    flat = np.zeros((len(vectors), dimensions), np.float32)
    for k, vector in enumerate(vectors):
        if vector is not None:
            if len(vector) != dimensions:
                raise ValueError(f"a vector of {len(vector)} floats where the node's model gives {dimensions}")
            flat[k] = vector
    values = pa.array(flat.reshape(-1), pa.float32())
    return pa.FixedSizeListArray.from_arrays(values, dimensions, mask=pa.array([not p for p in present]))


def key_of(rows: np.ndarray, steps: np.ndarray) -> np.ndarray:
    return (np.asarray(rows, np.int64) << STEP_BITS) | np.asarray(steps, np.int64)


def record_of(raw: bytes) -> ResultRecord:
    """A tail line's record; ValueError (or a JSON or key error) when the line is not one."""
    item = json.loads(raw.decode("utf-8"))
    logprobs = item.get("logprobs")
    record = ResultRecord(int(item["row"]), int(item["step"]), tuple(item["texts"]), int(item["num_prompt_tokens"]),
                          int(item["num_output_tokens"]), str(item["finish_reason"]),
                          None if logprobs is None else tuple(TokenLogprob(t, float(lp), tuple((tt, float(tl)) for tt, tl in top))
                                                              for t, lp, top in logprobs),
                          vector_of(item.get("vector_f32")), None if item.get("score") is None else float(item["score"]))
    if not record.texts or not all(isinstance(t, str) for t in record.texts) or record.row < 0 or record.step < 0:
        raise ValueError("not a result record")
    return record


def vector_of(encoded: str | None) -> np.ndarray | None:
    """A tail line's vector: base64 of little-endian float32 bytes."""
    if encoded is None:
        return None
    return np.frombuffer(base64.b64decode(encoded, validate=True), "<f4").astype(np.float32)


def tail_lines(data: bytes) -> list[str]:
    """The lines of newline-ended tail data: cut at "\\n" only (`splitlines` also cuts at
    U+2028, U+0085 and others, which JSON leaves unescaped inside a text)."""
    return data.decode("utf-8").split("\n")[:-1]
