"""A committed result's fields: the one definition that a node's journal segments, its
node file, the DAG's `node.field` output columns and the readers of those files use.

A result is keyed by where it belongs (the row's position in the journal, the row's id in a
node file) and its step; `texts` holds every completion when a node samples n > 1.
"""

from __future__ import annotations

import pyarrow as pa

RESULT_FIELDS = (("text", pa.string()), ("num_prompt_tokens", pa.int64()), ("num_output_tokens", pa.int64()),
                 ("finish_reason", pa.string()))
RESULT_FIELD_NAMES = tuple(name for name, _ in RESULT_FIELDS)  # what an output column may name as `node.field`
STEP_FIELD = ("step", pa.int32())
SAMPLES_FIELD = ("texts", pa.list_(pa.string()))


def result_schema(key: tuple[str, pa.DataType], samples: int = 1) -> pa.Schema:
    """`key`, the step, the result's fields, and `texts` when a node samples more than one."""
    return pa.schema([key, STEP_FIELD, *RESULT_FIELDS, *([SAMPLES_FIELD] if samples > 1 else [])])
