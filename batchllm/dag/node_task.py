"""What a node asks of its model (`task:`), and the rules each task puts on the rest of the DAG.

A `generate` node (the default) writes text. An `embed` node gives one vector a unit: the
model reads the node's prompt as plain text (no chat template, no system text) and pools it
into a fixed-size list of float32. Its result has no text, so no template or `where:` may
read it by name; an output column takes it as `node.vector` (the default field of an embed
node) or its token count and finish reason.
"""

from __future__ import annotations

from batchllm.core.requests import ModelTask
from batchllm.core.result_schema import VECTOR_FIELD_NAME
from batchllm.core.sampling import SamplingSpec
from batchllm.dag.model import EngineSpec
from batchllm.dag.yaml_section import Section

TASKS = tuple(task.value for task in ModelTask)
# An embed request costs its prefill step, as a generation request of one token does (which
# ends in the step that computes its prompt): the planner and the cost model see it so.
EMBED_SAMPLING = SamplingSpec(max_tokens=1)
GENERATION_ONLY_KEYS = ("system", "messages", "chat", "sampling", "output")  # what an embed node cannot take
EMBED_FIELDS = (VECTOR_FIELD_NAME, "num_prompt_tokens", "finish_reason")  # what `node.field` may name of an embed node


def parse_task(node: Section) -> ModelTask:
    """The node's `task:`; an embed node that sets a key only generation uses is refused."""
    task = ModelTask(node.get("task", str, ModelTask.GENERATE.value, check=lambda v: v in TASKS, expect=" or ".join(TASKS)))
    if task is ModelTask.EMBED:
        for key in GENERATION_ONLY_KEYS:
            if key in node.mapping:
                node.fail(key, f"{node.where}.{key}: an embed node embeds its prompt as plain text, so `{key}:` does not apply",
                          f"drop `{key}:` from {node.where}, or make it a generation node (task: generate)")
    return task


def engine_max_model_len(engine: EngineSpec, task: ModelTask) -> int | None:
    """The context length a node's engine is started with: an embed engine takes its model's own
    (None), since `engine.max_model_len` is for the DAG's generation models (an encoder's
    positions are often fewer: 512 for BERTs)."""
    return None if task is ModelTask.EMBED else engine.max_model_len


def default_field(task: ModelTask) -> str:
    """The result field an output column `node` (with no `.field`) takes."""
    return VECTOR_FIELD_NAME if task is ModelTask.EMBED else "text"
