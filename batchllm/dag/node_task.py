"""What a node asks of its model (`task:`), and the rules each task puts on the rest of the DAG.

A `generate` node (the default) writes text. An `embed` node gives one vector a unit: the
model reads the node's prompt as plain text (no chat template, no system text) and pools it
into a fixed-size list of float32. Its result has no text, so no template or `where:` may
read it by name; an output column takes it as `node.vector` (the default field of an embed
node) or its token count and finish reason. A `score` node gives one number a unit: the
cosine of the vectors an embedding model gives its `prompt` and its `pair` (as vLLM's score
API does for an embedding model), or a cross-encoder's value for the two texts read as one (a
`...ForSequenceClassification` of one label, as vLLM's score API does for one); templates and
`where:` read it as a number, an output column as `node.score` (float64, its default field). A `classify` node gives one label a unit,
from a sequence-classification model (its config's `id2label`), with every label's
probability: templates and `where:` read the label as text (`where: "mood = 'positive'"`), an
output column takes `node.label` (its default field) or `node.probs` (a fixed-size list of
float32, in the model's label order).
"""

from __future__ import annotations

from batchllm.core.requests import ModelTask
from batchllm.core.result_schema import CLASSIFY_FIELD_COLUMNS, SCORE_FIELD, VECTOR_FIELD_NAME
from batchllm.core.sampling import SamplingSpec
from batchllm.dag.model import EngineSpec
from batchllm.dag.yaml_section import Section

TASKS = tuple(task.value for task in ModelTask)
# An embed request costs its prefill step, as a generation request of one token does (which
# ends in the step that computes its prompt): the planner and the cost model see it so.
EMBED_SAMPLING = SamplingSpec(max_tokens=1)
GENERATION_ONLY_KEYS = ("system", "messages", "chat", "sampling", "output")  # what a pooling node cannot take
EMBED_FIELDS = (VECTOR_FIELD_NAME, "num_prompt_tokens", "finish_reason")  # what `node.field` may name of an embed node
SCORE_FIELDS = (SCORE_FIELD[0], "num_prompt_tokens", "finish_reason")  # and of a score node
CLASSIFY_FIELDS = (*CLASSIFY_FIELD_COLUMNS, "num_prompt_tokens", "finish_reason")  # and of a classify node


def parse_task(node: Section) -> ModelTask:
    """The node's `task:`; a pooling node that sets a key only generation uses is refused, and
    `pair:` belongs to score nodes, which need it."""
    task = ModelTask(node.get("task", str, ModelTask.GENERATE.value, check=lambda v: v in TASKS, expect=", ".join(TASKS[:-1])
                              + f" or {TASKS[-1]}"))
    if task.pools:
        for key in GENERATION_ONLY_KEYS:
            if key in node.mapping:
                node.fail(key, f"{node.where}.{key}: {_a(task)} {task.value} node {task.verb} its prompt as plain text, so `{key}:` does not "
                          "apply", f"drop `{key}:` from {node.where}, or make it a generation node (task: generate)")
    if task is ModelTask.SCORE and "pair" not in node.mapping:
        node.fail(None, f"{node.where} scores a pair of texts, but gives only `prompt:`",
                  "add `pair:`, the template of the text to score the prompt against (e.g. pair: \"{{ answer }}\")")
    if task is not ModelTask.SCORE and "pair" in node.mapping:
        node.fail("pair", f"{node.where}.pair: only a score node reads a pair of texts", "drop `pair:`, or set `task: score`")
    return task


def _a(task: ModelTask) -> str:
    return "an" if task.value[0] in "aeiou" else "a"


def engine_task(task: ModelTask, cross_encoder: bool = False) -> ModelTask:
    """The engine a node's requests run on: a score node's is an embed engine (each of its requests
    is two texts embedded), so embed and score nodes of one model share one, unless its model is a
    cross-encoder (`cross_encoder`: a classifier of one label), whose classify engine reads the
    two texts as one; a classify node's is a classify engine (the head gives its probabilities)."""
    if task is ModelTask.SCORE:
        return ModelTask.CLASSIFY if cross_encoder else ModelTask.EMBED
    return task


def engine_max_model_len(engine: EngineSpec, task: ModelTask) -> int | None:
    """The context length a node's engine is started with: a pooling engine takes its model's own
    (None), since `engine.max_model_len` is for the DAG's generation models (an encoder's
    positions are often fewer: 512 for BERTs)."""
    return None if task.pools else engine.max_model_len


def result_fields(task: ModelTask) -> tuple[str, ...] | None:
    """What `node.field` may name of a pooling node (None: a generation node's, which depend on its options)."""
    return {ModelTask.EMBED: EMBED_FIELDS, ModelTask.SCORE: SCORE_FIELDS, ModelTask.CLASSIFY: CLASSIFY_FIELDS}.get(task)


def default_field(task: ModelTask) -> str:
    """The result field an output column `node` (with no `.field`) takes."""
    return {ModelTask.EMBED: VECTOR_FIELD_NAME, ModelTask.SCORE: SCORE_FIELD[0], ModelTask.CLASSIFY: "label"}.get(task, "text")
