"""A committed result's fields: the one definition that a node's journal segments, its
node file, the DAG's `node.field` output columns and the readers of those files use.

A result is keyed by where it belongs (the row's position in the journal, the row's id in a
node file) and its step; `texts` holds every completion when a node samples n > 1,
`logprobs` each output token's log probability (and the top ones) when a node asks for them,
`vector` an embed node's vector (a fixed-size list of float32; its text is empty), and
`score` a score node's number (float64; its text is empty). A classify node's label is its
text and its labels' probabilities its vector; an output column names them `label` and
`probs` (`CLASSIFY_FIELD_COLUMNS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from batchllm.core.requests import TokenLogprob

RESULT_FIELDS = (("text", pa.string()), ("num_prompt_tokens", pa.int64()), ("num_output_tokens", pa.int64()),
                 ("finish_reason", pa.string()))
RESULT_FIELD_NAMES = tuple(name for name, _ in RESULT_FIELDS)  # what an output column may name as `node.field`
STEP_FIELD = ("step", pa.int32())
SAMPLES_FIELD = ("texts", pa.list_(pa.string()))
TOP_LOGPROB = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
LOGPROBS_FIELD = ("logprobs", pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64()),
                                                   ("top_logprobs", pa.list_(TOP_LOGPROB))])))
LOGPROB_FIELDS = ("logprobs", "logprob")  # what `node.field` may name of a node with `logprobs: true` (logprob: their sum)
VECTOR_FIELD_NAME = "vector"
SCORE_FIELD = ("score", pa.float64())
CLASSIFY_FIELD_COLUMNS = {"label": "text", "probs": VECTOR_FIELD_NAME}  # a classify node's fields, and the columns that hold them


def vector_field(dimensions: int) -> tuple[str, pa.DataType]:
    return VECTOR_FIELD_NAME, pa.list_(pa.float32(), dimensions)


def result_schema(key: tuple[str, pa.DataType], samples: int = 1, logprobs: bool = False,
                  vector_dimensions: int | None = None, scores: bool = False) -> pa.Schema:
    """`key`, the step, the result's fields, `texts` when a node samples more than one,
    `logprobs` when it keeps them, `vector` when it embeds and `score` when it scores."""
    return pa.schema([key, STEP_FIELD, *RESULT_FIELDS, *([SAMPLES_FIELD] if samples > 1 else []),
                      *([LOGPROBS_FIELD] if logprobs else []),
                      *([vector_field(vector_dimensions)] if vector_dimensions is not None else []),
                      *([SCORE_FIELD] if scores else [])])


def logprobs_rows(logprobs: Sequence[TokenLogprob] | None) -> list[dict] | None:
    """A result's TokenLogprobs as the rows of a `logprobs` cell."""
    if logprobs is None:
        return None
    return [{"token": t, "logprob": lp, "top_logprobs": [{"token": tt, "logprob": tl} for tt, tl in top]} for t, lp, top in logprobs]
