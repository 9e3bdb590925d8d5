"""Structured output: a node's `output:` constraint, parsed, checked against what the
engine's backend compiles, and carried to the engine's sampling parameters."""

from __future__ import annotations

import json

import pytest

from batchllm.core.errors import UserError
from batchllm.core.output_constraint import OutputConstraint
from batchllm.dag.loader import load_dag
from batchllm.engines.constraints import check_constraint

DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      route:
        model: ./tiny-model
        prompt: "{{ question }}"
        output: %s
"""


def test_choices_json_schema_and_regex_are_parsed(workspace):
    route = load_dag(workspace.dag(DAG % "{choices: [code, other]}")).nodes["route"]
    assert route.output == OutputConstraint(choices=("code", "other")) and route.output.kind == "choices"
    route = load_dag(workspace.dag(DAG % "{regex: '[0-9]+'}")).nodes["route"]
    assert route.output == OutputConstraint(regex="[0-9]+")
    schema = "{json_schema: {type: object, properties: {label: {type: string}}, required: [label]}}"
    route = load_dag(workspace.dag(DAG % schema)).nodes["route"]
    assert json.loads(route.output.json_schema) == {"type": "object", "properties": {"label": {"type": "string"}},
                                                    "required": ["label"]}


@pytest.mark.parametrize("body, message", [
    ("{choices: [a], regex: x}", "nodes.route.output must name exactly one of choices, json_schema, regex, got 2"),
    ("{}", "nodes.route.output must name exactly one of choices, json_schema, regex, got 0"),
    ("{choices: []}", "nodes.route.output.choices must be a non-empty list of non-empty strings, got []"),
    ("{choices: [a, a]}", "nodes.route.output.choices lists ['a', 'a'], with a choice twice"),
    ("{pattern: x}", "unknown key 'pattern' in nodes.route.output"),
])
def test_bad_output_constraints_are_refused_with_the_line(workspace, body, message):
    with pytest.raises(UserError) as error:
        load_dag(workspace.dag(DAG % body))
    assert message in error.value.paragraph() and "line 7" in error.value.paragraph()


def test_a_regex_the_engine_cannot_compile_is_refused_before_the_run():
    with pytest.raises(UserError, match=r"the engine cannot use the regex '\(ab'"):
        check_constraint(OutputConstraint(regex="(ab"), where="nodes.route")


@pytest.mark.engine  # vLLM's structured-output compiler
@pytest.mark.starts_no_engine
def test_a_json_schema_the_engine_cannot_compile_is_refused_before_the_run():
    with pytest.raises(UserError, match='the engine cannot use this JSON schema: Unsupported type "nonsense"'):
        check_constraint(OutputConstraint(json_schema='{"type": "nonsense"}'), where="nodes.route")


def test_good_constraints_pass_the_check():
    check_constraint(OutputConstraint(regex="(yes|no)"), where="x")
    check_constraint(OutputConstraint(choices=("a", "b")), where="x")
    check_constraint(OutputConstraint(json_schema='{"type": "object", "properties": {"n": {"type": "integer"}}}'), where="x")
    check_constraint(OutputConstraint(json_schema='{"type": "object"}'), where="x")  # OpenAI's json_object mode
    check_constraint(OutputConstraint(json_schema='{"type": "array", "items": {"type": "string"}}'), where="x")


@pytest.mark.engine  # vLLM's sampling parameters
@pytest.mark.starts_no_engine
def test_the_constraint_becomes_vllms_structured_output_parameters():
    from batchllm.engines.vllm_request_params import structured_outputs

    params = structured_outputs(OutputConstraint(choices=("code", "other")))
    assert params.choice == ["code", "other"] and params.json is None and params.regex is None
    params = structured_outputs(OutputConstraint(json_schema='{"type": "object"}'))
    assert params.json == '{"type": "object"}' and params.choice is None
    assert structured_outputs(None) is None


# -- typed columns from a JSON-schema output ------------------------------------------------
JSON_DAG = """
    inputs:
      questions: {path: questions.parquet, id_column: id}
    nodes:
      grade:
        model: ./tiny-model
        prompt: "{{ question }}"
        output:
          json_schema:
            type: object
            properties:
              score: {type: integer}
              confidence: {type: number}
              correct: {type: boolean}
              label: {enum: [easy, hard]}
              tags: {type: array, items: {type: string}}
            required: [score]
    outputs:
      graded:
        columns: {question: question, score: grade.score, confidence: grade.confidence, correct: grade.correct,
                  label: grade.label, tags: grade.tags, raw: grade}
"""
# What the scripted engine answers per question: JSON, one cut short (not JSON), one with a wrong type.
ANSWERS = {
    "What is a prime number?": '{"score": 3, "confidence": 0.5, "correct": true, "label": "easy", "tags": ["math"]}',
    "How do I sort a list in Python?": '{"score": 7, "confidence": 1, "correct": false, "label": "hard", "tags": []}',
    "Why is the sky blue?": '{"score": 4, "confid',
    "What does SQL stand for?": '{"score": "many", "label": "easy"}',
}


def test_json_schema_properties_are_typed_columns_and_text_that_is_not_json_gives_nulls(workspace):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rich.console import Console

    from batchllm.engines.devices import DeviceSet
    from batchllm.runtime.launch import run_dag_file
    from tests.fakes import FakeEngineFactory

    factory = FakeEngineFactory(answer=lambda request: ANSWERS[request.prompt])
    run_dag_file(workspace.dag(JSON_DAG), workspace.out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True),
                 engine_factory=factory, prefix_order=False, schedule="sequential")
    graded = pq.read_table(workspace.out / "graded.parquet")
    assert graded.schema.types[2:] == [pa.int64(), pa.float64(), pa.bool_(), pa.string(), pa.string(), pa.string()]
    rows = graded.drop_columns(["question", "raw"]).to_pylist()
    assert rows == [
        {"row_id": "q1", "score": 3, "confidence": 0.5, "correct": True, "label": "easy", "tags": '["math"]'},
        {"row_id": "q2", "score": 7, "confidence": 1.0, "correct": False, "label": "hard", "tags": "[]"},
        {"row_id": "q3", "score": None, "confidence": None, "correct": None, "label": None, "tags": None},
        {"row_id": "q4", "score": None, "confidence": None, "correct": None, "label": "easy", "tags": None},
    ]
    assert graded.column("raw")[2].as_py() == '{"score": 4, "confid'  # the text itself is kept


def test_default_outputs_add_a_column_per_json_property(workspace):
    dag = load_dag(workspace.dag(JSON_DAG.split("    outputs:")[0]))
    assert {name: (ref.field, ref.json_type) for name, ref in dag.outputs["results"].columns.items()} == {
        "grade": ("text", None), "grade_score": ("score", "integer"), "grade_confidence": ("confidence", "number"),
        "grade_correct": ("correct", "boolean"), "grade_label": ("label", "string"), "grade_tags": ("tags", "json")}


def test_an_output_naming_a_property_the_schema_lacks_lists_the_fields(workspace):
    with pytest.raises(UserError) as error:
        load_dag(workspace.dag(JSON_DAG.replace("score: grade.score", "score: grade.points")))
    assert "'grade.points' names unknown field 'points'" in str(error.value)
    assert error.value.hint == ("fields: text, num_prompt_tokens, num_output_tokens, finish_reason, score, confidence, correct, "
                                "label, tags")
